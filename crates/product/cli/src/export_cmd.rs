//! `mx export`: writes a READY version to object storage (S3) as canonical Hugging Face
//! safetensors, or as an exact-base XOR delta against another READY version, and records the
//! artifact (and its lineage) at the control plane. The bytes come from a checkpoint directory
//! (optionally advanced by the demo trainer's deterministic steps, as `mx-lab publish --steps`
//! does) and are proven to be the version before anything is written.

use std::path::PathBuf;

use anyhow::{bail, Context};
use mx_artifact::{read_version, ArtifactUrl, ExportOptions, Store, StoreOptions, WholeTensor};
use mx_control::client::ControlClient;
use mx_publisher::{export_version, ExportBase, ExportSpec};

/// Flags of `mx export`.
#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// The version to export (READY at the control plane).
    #[arg(long)]
    pub label: String,
    /// HF checkpoint directory the version's bytes come from.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The demo trainer's deterministic training steps 2..=STEP applied to the checkpoint first
    /// (1: the checkpoint as is), as `mx-lab publish` does for version `step-STEP`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub step: u32,
    /// Where: `s3://bucket/prefix` (a fresh prefix per version). Endpoint, region and
    /// credentials come from AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY (and AWS_ALLOW_HTTP=true for an http:// endpoint).
    #[arg(long)]
    pub to: String,
    /// Write an XOR delta against this READY version instead of a canonical checkpoint; its
    /// bytes are read back (and checked) from its newest recorded artifact.
    #[arg(long)]
    pub base: Option<String>,
    /// Delta: bytes of a tensor per independently fetchable range.
    #[arg(long, default_value_t = 4 << 20)]
    pub chunk_bytes: u64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `mx export`.
pub(crate) async fn run(a: ExportArgs) -> anyhow::Result<()> {
    let url: ArtifactUrl = a.to.parse()?;
    let ckpt = mx_checkpoint::Checkpoint::open(&a.checkpoint)?;
    let config = ckpt
        .config()
        .with_context(|| format!("{} has no config.json", ckpt.dir().display()))?;
    let model = mx_layout::ModelInfo::from_hf_config(config, ckpt.specs())?;
    let specs = ckpt.specs();
    let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(specs.len());
    for s in &specs {
        let mut b = ckpt.tensor(&s.name)?.data.to_vec();
        for k in 2..=a.step {
            mx_layout::update::training_step(s.dtype, &mut b, k);
        }
        bytes.push(b);
    }
    let tensors: Vec<WholeTensor<'_>> = specs
        .iter()
        .zip(&bytes)
        .map(|(spec, bytes)| WholeTensor { spec, bytes })
        .collect();
    let client = ControlClient::connect(&a.control).await?;
    let base_bytes = match &a.base {
        None => None,
        Some(label) => {
            let info = client.get_version(label).await?;
            let Some(art) = info.artifacts.last() else {
                bail!("the base {label} has no recorded artifact to read its bytes from: export it first");
            };
            let burl: ArtifactUrl = art.url.parse()?;
            let store = Store::from_env(&burl, StoreOptions::default())?;
            Some(read_version(&store, &burl, Some(art.manifest_digest)).await?)
        }
    };
    let base_tensors: Vec<WholeTensor<'_>> = base_bytes
        .iter()
        .flatten()
        .map(|(spec, bytes)| WholeTensor { spec, bytes })
        .collect();
    let extra: Vec<(String, Vec<u8>)> = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .filter_map(|n| {
        std::fs::read(a.checkpoint.join(n))
            .ok()
            .map(|b| (n.to_string(), b))
    })
    .collect();
    let spec = ExportSpec {
        label: &a.label,
        url: &url,
        tensors: &tensors,
        base: a.base.as_deref().map(|label| ExportBase {
            label,
            tensors: &base_tensors,
        }),
        extra: &extra,
        options: ExportOptions {
            chunk_bytes: a.chunk_bytes,
            ..ExportOptions::default()
        },
        store: StoreOptions::default(),
    };
    let e = export_version(&client, &model, &spec).await?;
    let model_bytes: u64 = bytes.iter().map(|b| b.len() as u64).sum();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "url": e.url.to_string(),
                "label": a.label,
                "version": e.manifest.version.to_string(),
                "kind": e.manifest.kind,
                "base": e.manifest.base.map(|b| b.to_string()),
                "manifest_digest": e.manifest_digest.to_string(),
                "data_bytes": e.data_bytes,
                "model_bytes": model_bytes,
                "seconds": e.seconds,
            })
        );
    } else {
        println!(
            "exported {} ({}) to {} as {:?}{}: {} bytes for a {model_bytes}-byte model in {:.2} s; manifest blake3 {}",
            a.label,
            e.manifest.version,
            e.url,
            e.manifest.kind,
            e.manifest.base.map(|b| format!(" against {b}")).unwrap_or_default(),
            e.data_bytes,
            e.seconds,
            e.manifest_digest
        );
    }
    Ok(())
}
