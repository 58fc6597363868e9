//! Where a worker stages a version from, in order of cost: workers serving it from their memory
//! (peers, NIXL; one layout's group at a time, the worker's own layout first), then the trainer
//! ranks that published it (NIXL), then its artifacts in object storage: a delta whose exact
//! base is resident, then the canonical artifacts, then any other delta whose chain resolves
//! (through its base URLs, on top of a canonical artifact). A source that fails (unreachable, a failed read, bytes that do not
//! verify, a delta against another base) is dropped and the next is tried; the stage fails only
//! when no source is left, naming what each one answered. Nothing unverified is ever staged.
//!
//! A version the fleet committed before (a worker joining the fleet, one brought back, a
//! rollback target) goes to the trainer ranks last: they have moved on to training, and a join
//! must not load them.

use std::sync::Arc;

use mx_artifact::{ArtifactSource, ArtifactUrl, Chain, Store, StoreOptions, DEFAULT_CHAIN_LIMIT};
use mx_control::{ArtifactKind, ArtifactRecord, VersionInfo};
use mx_layout::{Digest, VersionId};
use mx_puller::StageReport;

use crate::{Error, Instance};

/// The artifacts of `info` in the order a worker holding `held` tries them.
pub(crate) fn artifact_order(info: &VersionInfo, held: Option<VersionId>) -> Vec<&ArtifactRecord> {
    let rank = |a: &ArtifactRecord| match (a.kind, a.base) {
        (ArtifactKind::Delta, Some(b)) if Some(VersionId(b)) == held => 0,
        (ArtifactKind::Canonical, _) => 1,
        _ => 2,
    };
    let mut v: Vec<&ArtifactRecord> = info.artifacts.iter().collect();
    v.sort_by_key(|a| rank(a));
    v
}

/// Stages `label` (`digest`) on `inst` from the first source that serves it; `joining`: the
/// fleet committed `label` before (its record is COMMITTED; the trainer ranks are tried last).
///
/// # Errors
/// [`Error::NoSource`] naming every source tried and its error (a puller without a data plane
/// fails at once with [`Error::Puller`]).
pub(crate) async fn stage_from_any(
    inst: &Instance,
    label: &str,
    digest: Digest,
    info: VersionInfo,
    joining: bool,
) -> Result<StageReport, Error> {
    let mut tried: Vec<String> = Vec::new();
    // Peers, one layout at a time (shards of different layouts overlap), this worker's own
    // layout first.
    let mine = inst.layout();
    let mut layouts: Vec<mx_layout::LayoutSpec> =
        info.peers.iter().map(|p| p.manifest.layout).collect();
    layouts.sort_by_key(|l| (*l != mine, l.to_string()));
    layouts.dedup();
    for l in layouts {
        let group: Vec<mx_layout::SourceManifest> = info
            .peers
            .iter()
            .filter(|p| p.manifest.layout == l)
            .enumerate()
            .map(|(i, p)| {
                let mut m = p.manifest.clone();
                m.slot = i as u32;
                m
            })
            .collect();
        let names: Vec<&str> = info
            .peers
            .iter()
            .filter(|p| p.manifest.layout == l)
            .map(|p| p.worker_id.as_str())
            .collect();
        match inst.stage_peers(label, digest, group).await {
            Ok(r) => return Ok(r),
            Err(Error::Puller(mx_puller::Error::NoDataPlane)) => {
                return Err(Error::Puller(mx_puller::Error::NoDataPlane))
            }
            Err(e) => {
                tracing::warn!(label, layout = %l, "peer sources failed, trying the next source: {e}");
                tried.push(format!("peers {} ({l}): {e}", names.join(",")));
            }
        }
    }
    // The fleet's committed version is served by peers and artifacts first: its trainer ranks
    // have moved on to training (a joining worker must not load them); they are the last resort.
    let trainer_last = joining;
    if !trainer_last {
        if let Some(r) = stage_trainer(inst, label, digest, &info, &mut tried).await? {
            return Ok(r);
        }
    }
    let held = inst.resident_version().and_then(|r| r.mx());
    for a in artifact_order(&info, held) {
        match stage_artifact(inst, label, digest, a, held).await {
            Ok(r) => return Ok(r),
            Err(e) => {
                tracing::warn!(
                    label,
                    url = a.url,
                    "artifact source failed, trying the next source: {e}"
                );
                tried.push(format!("{}: {e}", a.url));
            }
        }
    }
    if trainer_last {
        if let Some(r) = stage_trainer(inst, label, digest, &info, &mut tried).await? {
            return Ok(r);
        }
    }
    Err(Error::NoSource {
        label: label.to_string(),
        tried: if tried.is_empty() {
            "none recorded".into()
        } else {
            tried.join("; ")
        },
    })
}

/// Stages from the trainer ranks' manifests, if any (checked by the answer's proof when it has
/// one, by their root otherwise); a failure is recorded in `tried`.
///
/// # Errors
/// Only a puller without a data plane.
async fn stage_trainer(
    inst: &Instance,
    label: &str,
    digest: Digest,
    info: &VersionInfo,
    tried: &mut Vec<String>,
) -> Result<Option<StageReport>, Error> {
    if info.manifests.is_empty() {
        return Ok(None);
    }
    // A fanned-out answer (only what the plan reads) comes with its proof; a whole record (an
    // older control plane) is checked by its root.
    let staged = match &info.proof {
        Some(proof) => {
            inst.stage_proven(label, digest, info.manifests.clone(), proof.clone())
                .await
        }
        None => inst.stage(label, digest, info.manifests.clone()).await,
    };
    match staged {
        Ok(r) => Ok(Some(r)),
        Err(Error::Puller(mx_puller::Error::NoDataPlane)) => {
            Err(Error::Puller(mx_puller::Error::NoDataPlane))
        }
        Err(e) => {
            tracing::warn!(label, "trainer sources failed, trying the next source: {e}");
            tried.push(format!("trainer ranks: {e}"));
            Ok(None)
        }
    }
}

/// Resolves `a`'s chain for what is held and stages from it.
async fn stage_artifact(
    inst: &Instance,
    label: &str,
    digest: Digest,
    a: &ArtifactRecord,
    held: Option<VersionId>,
) -> Result<StageReport, Error> {
    let url: ArtifactUrl = a.url.parse().map_err(mx_puller::Error::from)?;
    let store = Store::from_env(&url, StoreOptions::default()).map_err(mx_puller::Error::from)?;
    let chain = Chain::resolve(
        &store,
        &url,
        Some(a.manifest_digest),
        held,
        DEFAULT_CHAIN_LIMIT,
    )
    .await
    .map_err(mx_puller::Error::from)?;
    let source = ArtifactSource::new(store, chain, tokio::runtime::Handle::current())
        .map_err(mx_puller::Error::from)?;
    inst.stage_artifact(label, digest, Arc::new(source)).await
}
