//! `mx-lab bench sources`: one rank staging the same version from each source, side by side in one
//! run: the trainer ranks that published it, a peer worker serving it from its memory, its
//! canonical artifact and its XOR delta in object storage (moto on loopback).
//!
//! Two versions of the real SmolLM2 checkpoint: `v1-1` (the checkpoint) and `v2-1`, a small RL
//! step written here as a second checkpoint directory: about one bf16 element in [`CHANGE_EVERY`],
//! scattered by a hash, moves one ulp (0.5% of the elements, the fraction a 1e-6 learning rate
//! changed in `examples/delta_vs_full.py`). Each is published by its own two `mx-lab publish` ranks
//! (FSDP-2, separate processes); an `mx worker` of tp:3 is refitted to `v2-1` and serves it as
//! a peer; `mx export` writes `v2-1` canonical and as a delta against `v1-1`. This process is
//! the measured worker: rank 0 of tp:3 holding `v1-1`, it stages `v2-1` from each source in
//! turn (round-robin, `reps` rounds, median), verifying every byte as a worker does; nothing is
//! applied between stages.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_artifact::{ArtifactSource, ArtifactUrl, Chain, Store, StoreOptions, DEFAULT_CHAIN_LIMIT};
use mx_checkpoint::Checkpoint;
use mx_control::client::ControlClient;
use mx_control::{ArtifactKind, Outcome, PauseMode, RefitSpec, VersionState};
use mx_layout::{LayoutSpec, ModelInfo, SourceManifest, TensorSpec, VersionId};
use mx_nixl::Agent;
use mx_puller::exec::ExecOptions;
use mx_puller::{Puller, PullerConfig, StageReport};
use serde::Serialize;

use crate::fleet::{default_model, median, wait_until, Procs, WorkDir};
use crate::s3::LoopbackS3;

/// One bf16 element in this many is changed between the two versions.
pub const CHANGE_EVERY: usize = 200;

/// `mx-lab bench sources` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct SourcesArgs {
    /// HF checkpoint directory (default: the SmolLM2 checkpoint scripts/setup.sh prepares).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Rounds over the four sources (median reported).
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Keep the work directory (logs, the second checkpoint).
    #[arg(long)]
    pub keep: bool,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One source's figures for one rank.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SourceRow {
    /// Bytes read from the source (NIXL READs, or object-store GETs: compressed delta chunks).
    pub(crate) wire_bytes: u64,
    /// Median seconds of the whole stage: plan, reads, delta decode, verification.
    pub(crate) stage_s: f64,
    /// Median seconds of the reads alone.
    pub(crate) pull_s: f64,
    /// Bytes the rank holds (the staged version).
    pub(crate) useful_bytes: u64,
}

/// The result of `mx-lab bench sources`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SourcesReport {
    model: String,
    /// The measured rank: `tp:3` rank 0.
    rank: String,
    /// Fraction of the elements changed between the base and the staged version.
    changed_elements: f64,
    reps: u32,
    pub(crate) trainer: SourceRow,
    pub(crate) peer: SourceRow,
    pub(crate) artifact_canonical: SourceRow,
    pub(crate) artifact_delta: SourceRow,
}

/// SplitMix64 (Steele, Lea, Flood 2014): a well-spread hash of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes `ckpt` with about one bf16 element in [`CHANGE_EVERY`] (chosen by a hash of the tensor
/// and element index) moved one ulp up or down as
/// a checkpoint directory `dir` (config and tokenizer files copied); returns the fraction of
/// elements changed.
fn write_step(ckpt: &Checkpoint, src: &Path, dir: &Path) -> anyhow::Result<f64> {
    std::fs::create_dir_all(dir)?;
    for e in std::fs::read_dir(src)? {
        let p = e?.path();
        let name = p.file_name().context("file name")?.to_owned();
        let is_weights = p.extension().is_some_and(|x| {
            x == "safetensors" || x == "json" && name == "model.safetensors.index.json"
        });
        if p.is_file() && !is_weights {
            std::fs::copy(&p, dir.join(&name))?;
        }
    }
    let specs = ckpt.specs();
    let (mut changed, mut total) = (0u64, 0u64);
    let mut tensors: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = Vec::new();
    for (k, s) in specs.iter().enumerate() {
        let t = ckpt.tensor(&s.name)?;
        let mut b = t.data.to_vec();
        let elem = s.dtype.size_bytes() as usize;
        total += (b.len() / elem.max(1)) as u64;
        if s.dtype == mx_layout::DType::BF16 {
            for i in 0..b.len() / 2 {
                let h = splitmix64(((k as u64) << 40) ^ i as u64);
                if h.is_multiple_of(CHANGE_EVERY as u64) {
                    // One ulp up or down, as most elements an lr-1e-6 step changes move.
                    let x = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
                    let y = if h & (1 << 32) == 0 {
                        x.wrapping_add(1)
                    } else {
                        x.wrapping_sub(1)
                    };
                    b[2 * i..2 * i + 2].copy_from_slice(&y.to_le_bytes());
                    changed += 1;
                }
            }
        }
        let dtype = match s.dtype {
            mx_layout::DType::BF16 => safetensors::Dtype::BF16,
            mx_layout::DType::F16 => safetensors::Dtype::F16,
            mx_layout::DType::F32 => safetensors::Dtype::F32,
            d => bail!(
                "tensor {}: dtype {d:?} is not written by this bench",
                s.name
            ),
        };
        let shape = s.shape.iter().map(|&d| d as usize).collect();
        tensors.push((s.name.clone(), b, dtype, shape));
    }
    let views = tensors
        .iter()
        .map(|(n, b, d, sh)| {
            Ok((
                n.as_str(),
                safetensors::tensor::TensorView::new(*d, sh.clone(), b)?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    Ok(changed as f64 / total.max(1) as f64)
}

/// Waits until `label` is READY; returns its id and manifests.
async fn ready(
    procs: &mut Procs,
    work: &Path,
    client: &ControlClient,
    label: &str,
) -> anyhow::Result<(VersionId, Vec<SourceManifest>)> {
    wait_until(procs, work, Duration::from_secs(300), || async {
        Ok(client
            .get_version(label)
            .await
            .map(|v| v.state.reaches(VersionState::Ready))
            .unwrap_or(false))
    })
    .await
    .with_context(|| format!("waiting for {label} to be READY"))?;
    let v = client.get_version(label).await?;
    let id = v.version_digest.context("READY without a digest")?;
    Ok((VersionId(id), v.manifests))
}

/// Runs `mx export ARGS` with the S3 variables; fails with its output.
fn export(s3: &LoopbackS3, args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .arg("export")
        .args(args)
        .envs(s3.vars())
        .output()?;
    if !out.status.success() {
        bail!(
            "mx export {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Stages one source on `p` (off the async threads), timing the whole call; releases it.
fn timed(
    p: &mut Puller,
    f: impl FnOnce(&mut Puller) -> Result<StageReport, mx_puller::Error>,
) -> anyhow::Result<(StageReport, f64)> {
    let t = Instant::now();
    let r = tokio::task::block_in_place(|| f(p))?;
    let s = t.elapsed().as_secs_f64();
    p.release_staged();
    Ok((r, s))
}

/// What the measured rank stages from, all serving `v2-1`.
struct Fleet {
    v1: VersionId,
    v1_manifests: Vec<SourceManifest>,
    v2: VersionId,
    v2_manifests: Vec<SourceManifest>,
    /// The peer's manifests, slots renumbered as a worker does.
    peers: Vec<SourceManifest>,
    canonical: mx_control::ArtifactRecord,
    delta: mx_control::ArtifactRecord,
}

/// Starts the control plane, both versions' publishers and the peer (refitted to `v2-1`), and
/// exports the artifacts.
async fn prepare(
    procs: &mut Procs,
    work: &Path,
    s3: &LoopbackS3,
    model_dir: &Path,
    v2_dir: &Path,
    specs: &[TensorSpec],
) -> anyhow::Result<Fleet> {
    let (addr, client) = crate::fleet::start_control(procs, work).await?;
    let fsdp: LayoutSpec = "fsdp:2".parse()?;
    let tp: LayoutSpec = "tp:3".parse()?;
    client
        .register_worker("bench-rank", "bench-rank", &[0], tp)
        .await?;
    for (prefix, dir) in [("v1-", model_dir), ("v2-", v2_dir)] {
        client
            .declare_version(&format!("{prefix}1"), fsdp, specs)
            .await?;
        for r in 0..fsdp.world_size {
            let mut args = crate::fleet::publish_args(&addr, dir, fsdp, r, 1);
            args.extend(["--label-prefix".into(), prefix.into(), "--stay".into()]);
            procs.spawn(&format!("publisher-{prefix}{r}"), work, &args)?;
        }
    }
    let (v1, v1_manifests) = ready(procs, work, &client, "v1-1").await?;
    let (v2, v2_manifests) = ready(procs, work, &client, "v2-1").await?;

    // The peer: an `mx worker` of tp:3 refitted to v2-1, serving it from its memory.
    let wargs = crate::fleet::worker_args(&addr, model_dir, tp, &[0, 1, 2], "peer", "peer");
    procs.spawn("worker-peer", work, &wargs)?;
    wait_until(procs, work, Duration::from_secs(120), || async {
        let st = client.get_status().await?;
        Ok(st
            .workers
            .iter()
            .any(|w| w.worker_id == "peer" && w.connected))
    })
    .await
    .context("waiting for the peer worker")?;
    let id = client
        .refit(&RefitSpec {
            no_check: false,
            label: "v2-1".into(),
            worker_ids: vec!["peer".into()],
            pause_mode: PauseMode::Wait,
            allow_partial: false,
            check: None,
            framework_step: 0,
            stage_timeout_ms: 120_000,
            call_timeout_ms: 30_000,
            apply_parallelism: 0,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        })
        .await?;
    let r = mx_cli::refits::wait_end(&client, id, Duration::from_secs(300)).await?;
    if r.outcome != Some(Outcome::Committed) {
        bail!(
            "the peer's refit to v2-1 ended {:?}: {}",
            r.outcome,
            r.reason
        );
    }
    wait_until(procs, work, Duration::from_secs(60), || async {
        Ok(!client.get_version("v2-1").await?.peers.is_empty())
    })
    .await
    .context("waiting for the peer to serve v2-1")?;

    // The artifacts: v1-1 canonical (the delta's base bytes are read back from it), v2-1
    // canonical and as a delta against v1-1.
    let md = model_dir.display().to_string();
    let v2d = v2_dir.display().to_string();
    export(
        s3,
        &[
            "--control",
            &addr,
            "--label",
            "v1-1",
            "--checkpoint",
            &md,
            "--to",
            "s3://mx-bench/v1",
        ],
    )?;
    export(
        s3,
        &[
            "--control",
            &addr,
            "--label",
            "v2-1",
            "--checkpoint",
            &v2d,
            "--to",
            "s3://mx-bench/v2-full",
        ],
    )?;
    export(
        s3,
        &[
            "--control",
            &addr,
            "--label",
            "v2-1",
            "--checkpoint",
            &v2d,
            "--base",
            "v1-1",
            "--to",
            "s3://mx-bench/v2-delta",
        ],
    )?;
    let info = client.get_version("v2-1").await?;
    let artifact = |kind: ArtifactKind| {
        info.artifacts
            .iter()
            .find(|x| x.kind == kind)
            .cloned()
            .with_context(|| format!("v2-1 has no {kind:?} artifact recorded"))
    };
    let (canonical, delta) = (
        artifact(ArtifactKind::Canonical)?,
        artifact(ArtifactKind::Delta)?,
    );
    let peers: Vec<SourceManifest> = info
        .peers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut m = p.manifest.clone();
            m.slot = i as u32;
            m
        })
        .collect();

    Ok(Fleet {
        v1,
        v1_manifests,
        v2,
        v2_manifests,
        peers,
        canonical,
        delta,
    })
}

/// Runs `mx-lab bench sources`.
pub(crate) async fn run(a: &SourcesArgs) -> anyhow::Result<SourcesReport> {
    mx_nixl::nixl_available()?;
    let model_dir = a.model.clone().unwrap_or_else(default_model);
    let ckpt = Checkpoint::open(&model_dir)
        .with_context(|| format!("{} (run scripts/setup.sh)", model_dir.display()))?;
    let model = ModelInfo::from_hf_config(ckpt.config().context("config.json")?, ckpt.specs())?;
    let specs: Vec<TensorSpec> = ckpt.specs();
    let work_dir = WorkDir::create("bench-sources", a.keep)?;
    let work = work_dir.path.clone();
    let v2_dir = work.join("v2");
    let changed = write_step(&ckpt, &model_dir, &v2_dir)?;
    let s3 = LoopbackS3::start()?;
    s3.bucket("mx-bench")?;

    let mut procs = Procs(Vec::new());
    let f = prepare(&mut procs, &work, &s3, &model_dir, &v2_dir, &specs).await?;
    let (v1, v2) = (f.v1, f.v2);
    let tp: LayoutSpec = "tp:3".parse()?;
    let (canonical, delta, peers, v2_manifests) = (f.canonical, f.delta, f.peers, f.v2_manifests);

    // The measured rank, holding v1-1 (staged from the trainer ranks and applied).
    let mut p = Puller::new(
        PullerConfig {
            model: model.clone(),
            layout: tp,
            ranks: vec![0],
            retain: false,
        },
        Some(Agent::new(&format!(
            "mx-bench-sources-{}",
            std::process::id()
        ))?),
    )?;
    let total = p.rank_layouts()[0].total_bytes;
    p.register_rank(0, Box::new(vec![0u8; usize::try_from(total)?]))?;
    let opts = ExecOptions::default();
    tokio::task::block_in_place(|| p.stage(v1, &f.v1_manifests, &opts))?;
    p.apply(v1)?;

    let vars = s3.vars();
    let handle = tokio::runtime::Handle::current();
    let mut runs: BTreeMap<&str, Vec<(StageReport, f64)>> = BTreeMap::new();
    for _ in 0..a.reps.max(1) {
        let r = timed(&mut p, |p| p.stage(v2, &v2_manifests, &opts))?;
        runs.entry("trainer").or_default().push(r);
        let r = timed(&mut p, |p| p.stage_vouched(v2, &peers, &opts))?;
        runs.entry("peer").or_default().push(r);
        for (name, rec) in [
            ("artifact_canonical", &canonical),
            ("artifact_delta", &delta),
        ] {
            // Opening the artifact (manifest GET, chain resolution) is part of the stage.
            let t = Instant::now();
            let url: ArtifactUrl = rec.url.parse()?;
            let store = Store::from_vars(&url, StoreOptions::default(), vars.clone())?;
            let chain = Chain::resolve(
                &store,
                &url,
                Some(rec.manifest_digest),
                Some(v1),
                DEFAULT_CHAIN_LIMIT,
            )
            .await?;
            let src = Arc::new(ArtifactSource::new(store, chain, handle.clone())?);
            let open_s = t.elapsed().as_secs_f64();
            let (rep, s) = timed(&mut p, |p| p.stage_artifact(v2, src, &opts))?;
            runs.entry(name).or_default().push((rep, s + open_s));
        }
    }
    let row = |name: &str| -> anyhow::Result<SourceRow> {
        let v = runs.get(name).context("no runs")?;
        let last = &v.last().context("no runs")?.0;
        if last.source != name {
            bail!("{name}: the stage reports source {:?}", last.source);
        }
        Ok(SourceRow {
            wire_bytes: last.wire_bytes,
            stage_s: median(&v.iter().map(|x| x.1).collect::<Vec<_>>()),
            pull_s: median(&v.iter().map(|x| x.0.pull_s).collect::<Vec<_>>()),
            useful_bytes: last.useful_bytes,
        })
    };
    let report = SourcesReport {
        model: model_dir.display().to_string(),
        rank: "tp:3 rank 0".into(),
        changed_elements: changed,
        reps: a.reps.max(1),
        trainer: row("trainer")?,
        peer: row("peer")?,
        artifact_canonical: row("artifact_canonical")?,
        artifact_delta: row("artifact_delta")?,
    };
    println!(
        "sources: tp:3 rank 0 stages v2-1 ({:.2}% of the elements changed from the v1-1 it holds), median of {}",
        changed * 100.0,
        report.reps
    );
    println!(
        "{:<20} {:>14} {:>10} {:>10}",
        "source", "wire bytes", "stage s", "reads s"
    );
    for (n, r) in [
        ("trainer", &report.trainer),
        ("peer", &report.peer),
        ("artifact_canonical", &report.artifact_canonical),
        ("artifact_delta", &report.artifact_delta),
    ] {
        println!(
            "{n:<20} {:>14} {:>10.3} {:>10.3}",
            r.wire_bytes, r.stage_s, r.pull_s
        );
    }
    Ok(report)
}
