//! `mx-lab bench disk`: mx against the disk path frameworks use today (`update_weights_from_disk`),
//! end to end, same model, same machine, same run, alternating.
//!
//! The inference instance is `tp:3` served by three `mx worker` processes, one per rank (as
//! vLLM runs one process per GPU): each holds only its own shard, so an apply is a copy into
//! its live buffers and nothing else.
//!
//! - Disk path: the trainer holds version k in memory; the clock starts; it writes a safetensors
//!   checkpoint (one file plus `config.json`, no fsync: the page cache as the write leaves it),
//!   then every rank's `update_weights_from_disk` reads the file and slices its shard (all ranks
//!   at once, as a framework calls them). The clock stops when every rank answered.
//! - mx: four `mx-lab publish` processes (FSDP-4 trainer ranks) hold version k in memory; the clock
//!   starts; the orchestrator declares k, every rank digests and publishes its manifest, every
//!   worker pulls and verifies exactly its bytes (blake3 per region), and a refit applies them
//!   (pause, apply, read back, resume, COMMIT journaled). The clock stops at COMMITTED.
//!
//! After each pair the live parameter digests of every rank (read from the workers' own routes)
//! must be identical between the two paths: the same version k, byte for byte.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_checkpoint::Checkpoint;
use mx_control::{Outcome, PauseMode, RefitSpec, VersionState, WorkerState};
use serde::Serialize;

use crate::demo::live_digests;
use crate::fleet::{default_model, median, wait_until, Procs, WorkDir};

/// `mx-lab bench disk` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct DiskArgs {
    /// HF checkpoint directory (default: the SmolLM2 checkpoint scripts/setup.sh prepares).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Pairs (disk path, mx) measured, each on a new version.
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Keep the work directory (logs, checkpoints).
    #[arg(long)]
    pub keep: bool,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One (disk, mx) pair.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DiskPair {
    version: u32,
    /// Disk path: writing the checkpoint (s).
    disk_write_s: f64,
    /// Disk path: every rank's pause, update_weights_from_disk and resume (s).
    disk_load_s: f64,
    /// Disk path end to end (s).
    disk_s: f64,
    /// mx: declare until READY (publishers digest and publish) (s).
    mx_publish_s: f64,
    /// mx: stage (pull + verify on every worker) (s).
    mx_stage_s: f64,
    /// mx: refit until COMMITTED (s).
    mx_commit_s: f64,
    /// mx end to end (s).
    mx_s: f64,
    /// Live digests of every rank equal after both paths.
    same_bytes: bool,
}

/// The result of `mx-lab bench disk`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DiskReport {
    model: String,
    checkpoint_bytes: u64,
    pairs: Vec<DiskPair>,
    disk_s: f64,
    mx_s: f64,
    /// Median disk time / median mx time.
    pub(crate) refit_vs_disk_speedup: f64,
    /// Generation stall of the disk path: the reload (the engines cannot serve while their
    /// weights are replaced; the write can overlap rollouts) (s, median).
    disk_stall_s: f64,
    /// Generation stall of mx: the commit round (the pull ran beside the live weights) (s,
    /// median).
    mx_stall_s: f64,
    /// disk_stall_s / mx_stall_s.
    stall_speedup: f64,
}

const WORKERS: [&str; 3] = ["disk-bench-r0", "disk-bench-r1", "disk-bench-r2"];

/// Runs `mx-lab bench disk`.
pub(crate) async fn run(a: &DiskArgs) -> anyhow::Result<DiskReport> {
    mx_nixl::nixl_available()?;
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let model_dir = a
        .model
        .clone()
        .unwrap_or_else(default_model)
        .canonicalize()?;
    let ckpt = Checkpoint::open(&model_dir)
        .with_context(|| format!("{} (run scripts/setup.sh)", model_dir.display()))?;
    let specs = ckpt.specs();
    drop(ckpt);
    let work_dir = WorkDir::create("bench-disk", a.keep)?;
    let work = work_dir.path.clone();
    let mut procs = Procs(Vec::new());
    let (addr, client) = crate::fleet::start_control(&mut procs, &work).await?;
    let model_s = model_dir.display().to_string();
    let tp3: mx_layout::LayoutSpec = "tp:3".parse()?;
    for (r, id) in (0u32..).zip(WORKERS) {
        let args = crate::fleet::worker_args(&addr, &model_dir, tp3, &[r], id, "disk-bench");
        procs.spawn(id, &work, &args)?;
    }
    let ids: Vec<String> = WORKERS.iter().map(|s| s.to_string()).collect();
    wait_until(&mut procs, &work, Duration::from_secs(120), || async {
        let s = client.get_status().await?;
        Ok(ids
            .iter()
            .all(|id| s.workers.iter().any(|w| &w.worker_id == id && w.connected)))
    })
    .await
    .context("waiting for the workers to register")?;
    let status = client.get_status().await?;
    let urls: Vec<String> = ids
        .iter()
        .map(|id| {
            status
                .workers
                .iter()
                .find(|w| &w.worker_id == id)
                .and_then(|w| w.engine.as_ref())
                .map(|e| e.system_url.clone())
                .with_context(|| format!("worker {id} registered no engine routes"))
        })
        .collect::<anyhow::Result<_>>()?;
    let trainer: mx_layout::LayoutSpec = "fsdp:4".parse()?;
    client.declare_version("step-1", trainer, &specs).await?;
    let steps = a.reps + 1;
    for r in 0..trainer.world_size {
        let mut args = crate::fleet::publish_args(&addr, &model_dir, trainer, r, steps);
        args.push("--stay".into());
        procs.spawn(&format!("publisher-{r}"), &work, &args)?;
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    // Version 1 everywhere (untimed): the starting point of both paths.
    mx_refit(&client, &mut procs, &work, &ids, "step-1").await?;

    let mut pairs = Vec::new();
    let mut checkpoint_bytes = 0;
    for k in 2..=steps {
        // The trainer's version k in memory (untimed), as the disk path's trainer would hold it.
        let weights = mx_engine::golden::version_weights(&model_dir, k)?;
        let tensors: Vec<(String, mx_layout::DType, Vec<u64>, Vec<u8>)> = weights
            .into_iter()
            .map(|(n, (d, s, b))| (n, d, s, b))
            .collect();
        checkpoint_bytes = tensors.iter().map(|t| t.3.len() as u64).sum();
        let dir = work.join(format!("ckpt-step-{k}"));
        std::fs::create_dir_all(&dir)?;

        // Disk path.
        let t0 = Instant::now();
        mx_checkpoint::write_safetensors_with_sync(
            &dir.join(mx_checkpoint::SINGLE_FILE),
            &tensors,
            false,
        )?;
        std::fs::copy(
            model_dir.join(mx_checkpoint::CONFIG_FILE),
            dir.join(mx_checkpoint::CONFIG_FILE),
        )?;
        let disk_write_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let calls = urls.iter().map(|u| {
            let c = mx_adapters::dynamo::DynamoWorkerClient::with_client(
                http.clone(),
                u,
                Duration::from_secs(300),
            );
            let path = dir.display().to_string();
            async move {
                // Dynamo refuses an update of a worker that is not paused.
                c.pause(mx_adapters::PauseMode::Keep, false).await?;
                let r = c
                    .update_weights_from_disk(&path, &format!("disk:step-{k}"))
                    .await;
                c.resume().await?;
                r
            }
        });
        for r in futures_util::future::join_all(calls).await {
            r.context("update_weights_from_disk")?;
        }
        let disk_load_s = t1.elapsed().as_secs_f64();
        let disk_s = t0.elapsed().as_secs_f64();
        let mut disk_digests = Vec::new();
        for u in &urls {
            disk_digests.push(live_digests(&http, u).await?.ranks);
        }

        // mx.
        let label = format!("step-{k}");
        let t0 = Instant::now();
        client.declare_version(&label, trainer, &specs).await?;
        client
            .wait_version(&label, VersionState::Ready, Duration::from_secs(300))
            .await?;
        let mx_publish_s = t0.elapsed().as_secs_f64();
        let (stage_s, commit_s) = mx_refit(&client, &mut procs, &work, &ids, &label).await?;
        let mx_s = t0.elapsed().as_secs_f64();
        let mut mx_digests = Vec::new();
        for u in &urls {
            mx_digests.push(live_digests(&http, u).await?.ranks);
        }
        let same_bytes = disk_digests == mx_digests;
        if !same_bytes {
            bail!("version {k}: the live bytes after the disk path and after mx differ");
        }
        pairs.push(DiskPair {
            version: k,
            disk_write_s,
            disk_load_s,
            disk_s,
            mx_publish_s,
            mx_stage_s: stage_s,
            mx_commit_s: commit_s,
            mx_s,
            same_bytes,
        });
        std::fs::remove_dir_all(&dir)?;
    }
    procs.check(&work)?;
    drop(procs);
    let disk_s = median(&pairs.iter().map(|p| p.disk_s).collect::<Vec<_>>());
    let mx_s = median(&pairs.iter().map(|p| p.mx_s).collect::<Vec<_>>());
    let disk_stall_s = median(&pairs.iter().map(|p| p.disk_load_s).collect::<Vec<_>>());
    let mx_stall_s = median(&pairs.iter().map(|p| p.mx_commit_s).collect::<Vec<_>>());
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let report = DiskReport {
        model: model_s,
        checkpoint_bytes,
        pairs,
        disk_s,
        mx_s,
        refit_vs_disk_speedup: ratio(disk_s, mx_s),
        disk_stall_s,
        mx_stall_s,
        stall_speedup: ratio(disk_stall_s, mx_stall_s),
    };
    print_report(&report);
    Ok(report)
}

/// Stages `label` on `ids` and commits it by refit; returns (stage s, refit s).
async fn mx_refit(
    client: &mx_control::client::ControlClient,
    procs: &mut Procs,
    work: &std::path::Path,
    ids: &[String],
    label: &str,
) -> anyhow::Result<(f64, f64)> {
    client
        .wait_version(label, VersionState::Ready, Duration::from_secs(300))
        .await?;
    let t = Instant::now();
    client.stage(label, ids).await?;
    let (reached, briefs) = client
        .wait_workers(label, ids, WorkerState::Staged, Duration::from_secs(300))
        .await?;
    if !reached {
        procs.check(work)?;
        bail!("stage of {label} failed: {briefs:?}");
    }
    let stage_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let id = client
        .refit(&RefitSpec {
            no_check: false,
            label: label.to_string(),
            worker_ids: ids.to_vec(),
            pause_mode: PauseMode::Keep,
            allow_partial: false,
            check: None,
            framework_step: 0,
            stage_timeout_ms: 300_000,
            call_timeout_ms: 300_000,
            apply_parallelism: 0,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        })
        .await?;
    let refit = mx_cli::refits::wait_end(client, id, Duration::from_secs(600)).await?;
    if refit.outcome != Some(Outcome::Committed) {
        bail!(
            "refit to {label} ended {:?}: {}",
            refit.outcome,
            refit.reason
        );
    }
    Ok((stage_s, t.elapsed().as_secs_f64()))
}

fn print_report(r: &DiskReport) {
    println!(
        "\nrefit vs the disk path ({}, {:.1} MB; tp:3, one process per rank; mx from 4 FSDP publishers)",
        r.model,
        r.checkpoint_bytes as f64 / 1e6
    );
    println!(
        "{:<8} {:>10} {:>10} {:>9} {:>11} {:>9} {:>10} {:>7} {:>9}",
        "version",
        "disk write",
        "disk load",
        "disk s",
        "mx-lab publish",
        "mx stage",
        "mx commit",
        "mx s",
        "same"
    );
    for p in &r.pairs {
        println!(
            "{:<8} {:>10.3} {:>10.3} {:>9.3} {:>11.3} {:>9.3} {:>10.3} {:>7.3} {:>9}",
            format!("step-{}", p.version),
            p.disk_write_s,
            p.disk_load_s,
            p.disk_s,
            p.mx_publish_s,
            p.mx_stage_s,
            p.mx_commit_s,
            p.mx_s,
            p.same_bytes
        );
    }
    println!(
        "median end to end: disk path {:.3} s, mx {:.3} s: mx is {:.1}x faster (target >= 5x)",
        r.disk_s, r.mx_s, r.refit_vs_disk_speedup
    );
    println!(
        "median generation stall: disk reload {:.3} s, mx commit round {:.3} s: {:.1}x shorter",
        r.disk_stall_s, r.mx_stall_s, r.stall_speedup
    );
}
