//! Exporting a published version to object storage from the trainer side: the version's
//! record (its trainer shards, id and the destination layouts registered) comes from the control
//! plane, the bytes from the trainer (whole tensors), the artifact goes to an `s3://` URL through
//! [`mx_artifact`], and the artifact is recorded with the control plane (with its base, for a
//! delta: the version lineage).

use mx_artifact::{
    export_canonical, export_delta, ArtifactUrl, DeltaBase, ExportOptions, ExportRequest, Exported,
    Store, StoreOptions, WholeTensor,
};
use mx_control::client::ControlClient;
use mx_control::{ArtifactKind, ArtifactRecord, VersionInfo};
use mx_layout::{rank_layouts, ModelInfo, RankLayout, ShardEntry, VersionId};

use crate::Error;

/// The base of a delta export: a version recorded at the control plane and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct ExportBase<'a> {
    /// The base version's label.
    pub label: &'a str,
    /// Its tensors, whole.
    pub tensors: &'a [WholeTensor<'a>],
}

/// What to export and where.
#[derive(Debug, Clone, Copy)]
pub struct ExportSpec<'a> {
    /// The version's label (READY at the control plane).
    pub label: &'a str,
    /// Where: `s3://bucket/prefix` (a fresh prefix per version).
    pub url: &'a ArtifactUrl,
    /// The version's tensors, whole, in the order to write them.
    pub tensors: &'a [WholeTensor<'a>],
    /// `Some`: an XOR delta against this base; `None`: canonical safetensors.
    pub base: Option<ExportBase<'a>>,
    /// Files written beside a canonical artifact (e.g. `config.json`).
    pub extra: &'a [(String, Vec<u8>)],
    /// Chunking, compression, file sizes.
    pub options: ExportOptions,
    /// Client timeouts and retries.
    pub store: StoreOptions,
}

/// The version's id and trainer shards, from its record.
fn version_of(info: &VersionInfo) -> Result<(VersionId, Vec<ShardEntry>), Error> {
    let d = info.version_digest.ok_or_else(|| Error::Export {
        label: info.label.clone(),
        reason: format!(
            "the version is {}, not READY: nothing to export yet",
            info.state
        ),
    })?;
    let shards = info
        .manifests
        .iter()
        .flat_map(|m| m.shards.iter().cloned())
        .collect();
    Ok((VersionId(d), shards))
}

/// Writes `spec.label`'s version to `spec.url` (canonical, or a delta against `spec.base`) and
/// records it at the control plane. The bytes are proven to be the version first (every trainer
/// shard's blake3, then the Merkle root); the manifest carries region digests for every
/// destination layout registered now. The object store is configured from the AWS environment
/// ([`Store::from_env`]).
///
/// # Errors
/// [`Error::Export`] (the version or its base not READY); [`Error::Artifact`] (bytes that are not
/// the version, object-store failures); [`Error::Control`].
pub async fn export_version(
    client: &ControlClient,
    model: &ModelInfo,
    spec: &ExportSpec<'_>,
) -> Result<Exported, Error> {
    let info = client.get_version(spec.label).await?;
    let (version, shards) = version_of(&info)?;
    let mut layouts: Vec<Vec<RankLayout>> = Vec::new();
    for l in client.list_layouts().await? {
        match rank_layouts(model, l) {
            Ok(r) => layouts.push(r),
            Err(e) => tracing::warn!(layout = %l, "no region digests for layout {l}: {e}"),
        }
    }
    let store = Store::from_env(spec.url, spec.store)?;
    let req = ExportRequest {
        version,
        label: Some(spec.label),
        shards: &shards,
        tensors: spec.tensors,
        layouts: &layouts,
    };
    let (exported, kind, base) = match spec.base {
        None => (
            export_canonical(&store, spec.url, &req, spec.extra, &spec.options).await?,
            ArtifactKind::Canonical,
            None,
        ),
        Some(b) => {
            let binfo = client.get_version(b.label).await?;
            let (bid, bshards) = version_of(&binfo)?;
            // The base bytes must be the base version exactly (its shards, its root), whether or
            // not it has an artifact: a delta against other bytes would be useless to every
            // worker holding the real base.
            mx_artifact::prove_version(&ExportRequest {
                version: bid,
                label: Some(b.label),
                shards: &bshards,
                tensors: b.tensors,
                layouts: &[],
            })?;
            // The newest artifact of the base (a reader resolves chains through it).
            let base_url: Option<ArtifactUrl> = match binfo.artifacts.last() {
                Some(a) => Some(a.url.parse()?),
                None => None,
            };
            let base = DeltaBase {
                version: bid,
                url: base_url.as_ref(),
                tensors: b.tensors,
            };
            (
                export_delta(&store, spec.url, &req, &base, &spec.options).await?,
                ArtifactKind::Delta,
                Some(bid.digest()),
            )
        }
    };
    client
        .register_artifact(
            spec.label,
            &ArtifactRecord {
                url: spec.url.to_string(),
                manifest_digest: exported.manifest_digest,
                kind,
                base,
            },
        )
        .await?;
    Ok(exported)
}
