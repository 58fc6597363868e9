//! `mx-lab demo`: control plane, trainer publishers and inference workers as separate OS processes on
//! loopback. For each version step-1..step-N it measures the pull (`--runs` stages), commits the
//! version with a refit (the control plane's one commit path: STAGE, PREPARE, APPLY, VERIFY,
//! RESUME, CHECK against golden tokens where the workers can generate, COMMIT), and checks every
//! worker's live bytes (read from its `GET /mx/live_digests`) against slices computed
//! independently from the checkpoint file.

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use mx_checkpoint::Checkpoint;
use mx_control::client::ControlClient;
use mx_control::{GenerationCheck, Outcome, PauseMode, RefitSpec, VersionState, WorkerState};
use mx_layout::model::Family;
use mx_layout::{rank_layout, LayoutSpec, ModelInfo};
use serde::Serialize;

use crate::fleet::{default_model, median, wait_until, Procs, WorkDir};
use crate::slice::Reference;

/// Flags of `mx-lab demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// HF checkpoint directory (default: the SmolLM2-135M checkpoint made by scripts/setup.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Trainer layout of the publishers.
    #[arg(long, default_value = "fsdp:4")]
    trainer_layout: LayoutSpec,
    /// Inference layout of each instance (all its ranks in one process, unless
    /// `--process-per-rank`).
    #[arg(long, default_value = "tp:3")]
    inference_layout: LayoutSpec,
    /// Number of inference instances.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// Versions to refit (a deterministic training step between each).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=100))]
    steps: u32,
    /// Run each inference instance as one process per rank instead of one process per instance.
    #[arg(long)]
    process_per_rank: bool,
    /// Stage runs per version (the reported pull GB/s is the median).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Disable source-side packing at the publishers.
    #[arg(long)]
    no_pack: bool,
    /// Write the JSON report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Keep the work directory (journal, logs).
    #[arg(long)]
    keep: bool,
}

#[derive(Serialize)]
struct RankReport {
    rank: u32,
    tensors: std::collections::BTreeMap<String, String>,
}

#[derive(Serialize)]
struct WorkerReport {
    worker_id: String,
    instance: String,
    ranks: Vec<RankReport>,
    verified: bool,
    bytes: u64,
    descriptors: u64,
    seconds: f64,
    gbps: f64,
    strategies: std::collections::BTreeMap<String, u64>,
    mismatches: Vec<String>,
}

#[derive(Serialize)]
struct VersionReport {
    label: String,
    version_digest: String,
    /// The refit that committed it.
    refit_id: u64,
    /// Golden tokens every worker generated after the apply (`None`: no post-update generation,
    /// the workers cannot generate).
    golden_tokens: Option<Vec<u32>>,
    stage_seconds_runs: Vec<f64>,
    stage_seconds_median: f64,
    pack_seconds: f64,
    useful_bytes: u64,
    pull_gbps: f64,
    all_verified: bool,
    workers: Vec<WorkerReport>,
}

#[derive(Serialize)]
struct Report {
    model_dir: String,
    trainer_layout: String,
    inference_layout: String,
    all_verified: bool,
    pull_gbps: f64,
    memcpy_gbps: f64,
    pull_vs_memcpy: f64,
    version_digests: Vec<String>,
    versions: Vec<VersionReport>,
    /// Workers of the last version, with live digests per rank.
    workers: Vec<WorkerReport>,
}

/// Most OS processes the demo starts (publishers + workers) on one machine.
const MAX_PROCESSES: u32 = 64;

/// Tokens of the post-update generation.
const CHECK_TOKENS: u32 = 4;

/// What a worker's `GET /mx/live_digests` answers.
#[derive(serde::Deserialize, PartialEq, Debug)]
pub(crate) struct LiveDigests {
    pub(crate) version: String,
    pub(crate) ranks: Vec<LiveRank>,
}

/// One rank's live parameter digests.
#[derive(serde::Deserialize, PartialEq, Debug)]
pub(crate) struct LiveRank {
    pub(crate) rank: u32,
    pub(crate) tensors: std::collections::BTreeMap<String, String>,
}

/// The live bytes' digests, read from the worker's own route (not from anything it reported).
pub(crate) async fn live_digests(
    http: &reqwest::Client,
    system_url: &str,
) -> anyhow::Result<LiveDigests> {
    let url = format!("{}/mx/live_digests", system_url.trim_end_matches('/'));
    let r = http
        .get(&url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = r.status();
    let body = r.text().await.with_context(|| format!("GET {url}"))?;
    if !status.is_success() {
        bail!("GET {url}: {status}: {body}");
    }
    serde_json::from_str(&body).with_context(|| format!("GET {url}: unexpected answer"))
}

/// The post-update generation of demo version `k`, when the workers can generate: every worker
/// holds every rank of its layout and the model is llama-family. Golden tokens come from the
/// checkpoint plus the known training steps, never from pulled bytes.
async fn check_for(
    model_dir: &Path,
    family: Family,
    whole_instances: bool,
    k: u32,
) -> anyhow::Result<Option<GenerationCheck>> {
    if !whole_instances || family != Family::Llama {
        return Ok(None);
    }
    let dir = model_dir.to_path_buf();
    let prompt = mx_engine::golden::CHECK_PROMPT.to_vec();
    let expected =
        tokio::task::spawn_blocking(move || mx_cli::refits::golden(&dir, k, &prompt, CHECK_TOKENS))
            .await??;
    Ok(Some(GenerationCheck {
        source: format!("the demo's golden tokens of version {k}"),
        ..GenerationCheck::tokens(
            mx_engine::golden::CHECK_PROMPT.to_vec(),
            CHECK_TOKENS,
            expected,
        )
    }))
}

/// Runs `mx-lab demo`: starts the fleet, refits it through the versions, checks every worker's
/// bytes and post-update tokens, prints the tables and writes the report.
///
/// # Errors
/// The first failed step, with its context (a process that died, a refit that did not
/// commit, bytes that differ from the checkpoint).
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let per_instance = if args.process_per_rank {
        args.inference_layout.world_size
    } else {
        1
    };
    let procs = args.trainer_layout.world_size + args.workers.saturating_mul(per_instance);
    if procs > MAX_PROCESSES {
        bail!(
            "the demo starts one process per trainer rank and per inference worker: {procs} processes ({} + {} x {per_instance}) is more than {MAX_PROCESSES}",
            args.trainer_layout.world_size,
            args.workers
        );
    }
    if let Some(p) = &args.report {
        // Fail now, not after the whole run, on a report path that cannot be written.
        std::fs::write(p, b"{}")
            .with_context(|| format!("cannot write the report to {}", p.display()))?;
    }
    let rt = crate::runtime()?;
    rt.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        // On a signal the demo future is dropped, and with it every child process.
        tokio::select! {
            r = run_async(args) => r,
            _ = tokio::signal::ctrl_c() => bail!("interrupted (SIGINT); child processes stopped"),
            _ = term.recv() => bail!("terminated (SIGTERM); child processes stopped"),
        }
    })
}

async fn run_async(args: DemoArgs) -> anyhow::Result<()> {
    let model_dir = args.model.clone().unwrap_or_else(default_model);
    if !model_dir.join("config.json").exists() {
        bail!(
            "no checkpoint at {} (config.json missing): run scripts/setup.sh to make the SmolLM2 checkpoint, or pass --model DIR",
            model_dir.display()
        );
    }
    mx_nixl::nixl_available()?;
    let model_dir = model_dir.canonicalize()?;
    let ckpt = Checkpoint::open(&model_dir)?;
    let config = ckpt.config().context("config.json")?;
    let model = ModelInfo::from_hf_config(config, ckpt.specs())?;
    // Fail at plan time, before any process starts, on layouts that cannot split the model.
    mx_layout::rank_layouts(&model, args.trainer_layout)?;
    let dest: Vec<_> = mx_layout::rank_layouts(&model, args.inference_layout)?;

    let work_dir = WorkDir::create("demo", args.keep)?;
    let work = work_dir.path.clone();
    let pb = ProgressBar::new_spinner();
    pb.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {msg}",
    )?);
    pb.enable_steady_tick(Duration::from_millis(120));
    let mut procs = Procs(Vec::new());

    pb.set_message("starting control plane");
    let addr_file = work.join("control.addr");
    procs.spawn(
        "control",
        &work,
        &[
            "control".into(),
            "--insecure-loopback".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--journal".into(),
            work.join("journal.jsonl").display().to_string(),
            "--addr-file".into(),
            addr_file.display().to_string(),
        ],
    )?;
    let t = Instant::now();
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break format!("http://{a}");
        }
        procs.check(&work)?;
        if t.elapsed() > Duration::from_secs(30) {
            bail!(
                "control plane did not start within 30 s (log: {})",
                work.join("control.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let client = ControlClient::connect(&addr).await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;

    pb.set_message(format!(
        "starting {} inference instances ({})",
        args.workers, args.inference_layout
    ));
    // (worker id, instance, ranks): one process per instance, or one per rank.
    let mut members: Vec<(String, String, Vec<u32>)> = Vec::new();
    for i in 0..args.workers {
        let inst = format!("inst-{i}");
        if args.process_per_rank {
            for r in 0..args.inference_layout.world_size {
                members.push((format!("{inst}-rank{r}"), inst.clone(), vec![r]));
            }
        } else {
            members.push((
                inst.clone(),
                inst,
                (0..args.inference_layout.world_size).collect(),
            ));
        }
    }
    let worker_ids: Vec<String> = members.iter().map(|m| m.0.clone()).collect();
    for (id, inst, ranks) in &members {
        let a =
            crate::fleet::worker_args(&addr, &model_dir, args.inference_layout, ranks, id, inst);
        procs.spawn(id, &work, &a)?;
    }
    wait_until(&mut procs, &work, Duration::from_secs(120), || async {
        let s = client.get_status().await?;
        Ok(worker_ids
            .iter()
            .all(|id| s.workers.iter().any(|w| &w.worker_id == id)))
    })
    .await
    .context("waiting for workers to register")?;

    let specs = ckpt.specs();
    client
        .declare_version("step-1", args.trainer_layout, &specs)
        .await?;
    pb.set_message(format!(
        "starting {} trainer publishers ({})",
        args.trainer_layout.world_size, args.trainer_layout
    ));
    for r in 0..args.trainer_layout.world_size {
        let mut a =
            crate::fleet::publish_args(&addr, &model_dir, args.trainer_layout, r, args.steps);
        if args.no_pack {
            a.push("--no-pack".into());
        }
        procs.spawn(&format!("publisher-{r}"), &work, &a)?;
    }

    let mut versions = Vec::new();
    for k in 1..=args.steps {
        let label = format!("step-{k}");
        if k > 1 {
            client
                .declare_version(&label, args.trainer_layout, &specs)
                .await?;
        }
        pb.set_message(format!("{label}: waiting for every source slot to publish"));
        wait_until(&mut procs, &work, Duration::from_secs(300), || async {
            Ok(client
                .get_version(&label)
                .await
                .map(|v| v.state.reaches(VersionState::Ready))
                .unwrap_or(false))
        })
        .await
        .with_context(|| format!("waiting for {label} READY"))?;
        let info = client.get_version(&label).await?;
        let digest = info
            .version_digest
            .context("READY version without digest")?;
        let pack_seconds = info
            .manifests
            .iter()
            .map(|m| m.pack_seconds)
            .fold(0.0, f64::max);

        let mut walls = Vec::new();
        for run in 0..args.runs.max(1) {
            pb.set_message(format!(
                "{label}: stage run {}/{} on {} workers",
                run + 1,
                args.runs.max(1),
                args.workers
            ));
            let t0 = Instant::now();
            client.stage(&label, &worker_ids).await?;
            // Long poll (answers as soon as every worker is STAGED or one failed); between
            // polls the children are checked, so a dead worker fails the demo at once.
            wait_until(&mut procs, &work, Duration::from_secs(300), || async {
                let (reached, briefs) = client
                    .wait_workers(
                        &label,
                        &worker_ids,
                        WorkerState::Staged,
                        Duration::from_secs(1),
                    )
                    .await?;
                if let Some(b) = briefs.iter().find(|b| b.state == WorkerState::Failed) {
                    bail!(
                        "worker {} failed to stage {label}: {}",
                        b.worker_id,
                        b.error.clone().unwrap_or_default()
                    );
                }
                Ok(reached)
            })
            .await?;
            walls.push(t0.elapsed().as_secs_f64());
        }
        let check = check_for(&model_dir, model.family, !args.process_per_rank, k).await?;
        pb.set_message(format!(
            "{label}: refit (stage, pause, apply, verify, resume,{} commit)",
            if check.is_some() { " check," } else { "" }
        ));
        let golden_tokens = check.as_ref().map(|c| {
            c.probes
                .first()
                .map(|p| p.tokens.clone())
                .unwrap_or_default()
        });
        let refit_id = client
            .refit(&RefitSpec {
                no_check: false,
                label: label.clone(),
                worker_ids: worker_ids.clone(),
                pause_mode: PauseMode::Wait,
                allow_partial: false,
                check,
                framework_step: u64::from(k),
                stage_timeout_ms: mx_control::refit::DEFAULT_STAGE_TIMEOUT_MS,
                call_timeout_ms: mx_control::refit::DEFAULT_CALL_TIMEOUT_MS,
                apply_parallelism: 0,
                orchestrator_gated: false,
                verify_from_apply_answer: false,
            })
            .await?;
        let refit = mx_cli::refits::wait_end(&client, refit_id, Duration::from_secs(900)).await?;
        if refit.outcome != Some(Outcome::Committed) {
            procs.check(&work)?;
            bail!(
                "refit {refit_id} of {label} ended {}: {}",
                refit.outcome.map(|o| o.to_string()).unwrap_or_default(),
                refit.reason
            );
        }

        pb.set_message(format!(
            "{label}: checking live bytes against the checkpoint"
        ));
        let status = client.get_status().await?;
        let mut reference = Reference::new(&ckpt, k);
        let mut expected = std::collections::BTreeMap::new();
        for rl in &dest {
            expected.insert(rl.rank, reference.rank_digests(rl)?);
        }
        let mut workers = Vec::new();
        let mut useful = 0u64;
        let target = mx_layout::VersionId(digest).to_string();
        for id in &worker_ids {
            let w = status
                .workers
                .iter()
                .find(|w| &w.worker_id == id)
                .context("worker vanished")?;
            let staged = w.last_staged.clone().unwrap_or_default();
            let url = &w
                .engine
                .as_ref()
                .with_context(|| format!("worker {id} registered no engine routes"))?
                .system_url;
            let live = live_digests(&http, url)
                .await
                .with_context(|| format!("reading worker {id}'s live digests"))?;
            let mut mismatches = Vec::new();
            if live.version != target {
                mismatches.push(format!("resident version {} != {target}", live.version));
            }
            for &r in &w.ranks {
                let got = live.ranks.iter().find(|x| x.rank == r);
                let want = &expected[&r];
                match got {
                    None => mismatches.push(format!("rank {r}: no live digests reported")),
                    Some(g) => {
                        for (name, d) in want {
                            if g.tensors.get(name) != Some(&d.to_string()) {
                                mismatches.push(format!("rank {r} {name}"));
                            }
                        }
                        if g.tensors.len() != want.len() {
                            mismatches.push(format!(
                                "rank {r}: {} params reported, {} expected",
                                g.tensors.len(),
                                want.len()
                            ));
                        }
                    }
                }
            }
            useful += staged.bytes;
            workers.push(WorkerReport {
                worker_id: id.clone(),
                instance: w.instance.clone(),
                ranks: live
                    .ranks
                    .iter()
                    .map(|r| RankReport {
                        rank: r.rank,
                        tensors: r.tensors.clone(),
                    })
                    .collect(),
                verified: mismatches.is_empty(),
                bytes: staged.bytes,
                descriptors: staged.descriptors,
                seconds: staged.seconds,
                gbps: staged.bytes as f64 / staged.seconds.max(1e-9) / 1e9,
                strategies: staged.strategies.clone(),
                mismatches,
            });
        }
        let stage_median = median(&walls);
        let pull_gbps = useful as f64 / (stage_median + pack_seconds).max(1e-9) / 1e9;
        versions.push(VersionReport {
            label: label.clone(),
            version_digest: digest.to_string(),
            refit_id,
            golden_tokens,
            stage_seconds_runs: walls,
            stage_seconds_median: stage_median,
            pack_seconds,
            useful_bytes: useful,
            pull_gbps,
            all_verified: workers.iter().all(|w| w.verified),
            workers,
        });
    }
    pb.set_message("measuring memcpy of the same bytes");
    let last_useful = versions.last().map(|v| v.useful_bytes).unwrap_or(0);
    let memcpy = mx_nixl::memcpy_gbps(last_useful, worker_ids.len());
    pb.finish_and_clear();
    drop(procs);

    let pull_gbps = median(&versions.iter().map(|v| v.pull_gbps).collect::<Vec<_>>());
    let all_verified = versions.iter().all(|v| v.all_verified);
    print_tables(&args, &model_dir, &versions, pull_gbps, memcpy);
    let report = Report {
        model_dir: model_dir.display().to_string(),
        trainer_layout: args.trainer_layout.to_string(),
        inference_layout: args.inference_layout.to_string(),
        all_verified,
        pull_gbps,
        memcpy_gbps: memcpy,
        pull_vs_memcpy: if memcpy > 0.0 {
            pull_gbps / memcpy
        } else {
            0.0
        },
        version_digests: versions.iter().map(|v| v.version_digest.clone()).collect(),
        workers: versions
            .last()
            .map(|v| v.workers.iter().map(clone_worker).collect())
            .unwrap_or_default(),
        versions,
    };
    if let Some(p) = &args.report {
        mx_cli::report::write_report(p, &report)?;
        println!("report written to {}", p.display());
    }
    if args.keep {
        println!("work directory (journal, logs): {}", work.display());
    }
    if !all_verified {
        for v in &report.versions {
            for w in &v.workers {
                for m in w.mismatches.iter().take(5) {
                    eprintln!("{} {}: mismatch {m}", v.label, w.worker_id);
                }
            }
        }
        bail!("some workers' live bytes do not match the checkpoint");
    }
    let _ = rank_layout;
    Ok(())
}

fn clone_worker(w: &WorkerReport) -> WorkerReport {
    WorkerReport {
        worker_id: w.worker_id.clone(),
        instance: w.instance.clone(),
        ranks: w
            .ranks
            .iter()
            .map(|r| RankReport {
                rank: r.rank,
                tensors: r.tensors.clone(),
            })
            .collect(),
        verified: w.verified,
        bytes: w.bytes,
        descriptors: w.descriptors,
        seconds: w.seconds,
        gbps: w.gbps,
        strategies: w.strategies.clone(),
        mismatches: w.mismatches.clone(),
    }
}

fn print_tables(
    args: &DemoArgs,
    model_dir: &Path,
    versions: &[VersionReport],
    pull: f64,
    memcpy: f64,
) {
    println!(
        "mx-lab demo: {} -> {} x {} instances, model {}",
        args.trainer_layout,
        args.inference_layout,
        args.workers,
        model_dir.display()
    );
    for v in versions {
        println!("\n{}  version {}", v.label, &v.version_digest[..16]);
        println!(
            "{:<14} {:<10} {:>12} {:>11} {:>9} {:>7}  {:<28} verified",
            "worker", "ranks", "bytes", "descriptors", "seconds", "GB/s", "strategies"
        );
        for w in &v.workers {
            let ranks: Vec<String> = w.ranks.iter().map(|r| r.rank.to_string()).collect();
            let strat: Vec<String> = w
                .strategies
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect();
            println!(
                "{:<14} {:<10} {:>12} {:>11} {:>9.4} {:>7.2}  {:<28} {}",
                w.worker_id,
                ranks.join(","),
                w.bytes,
                w.descriptors,
                w.seconds,
                w.gbps,
                strat.join(" "),
                if w.verified { "yes" } else { "NO" }
            );
        }
        println!(
            "stage wall (median of {}): {:.4} s + publisher packing {:.4} s -> aggregate pull {:.2} GB/s",
            v.stage_seconds_runs.len(),
            v.stage_seconds_median,
            v.pack_seconds,
            v.pull_gbps
        );
        println!(
            "committed by refit {}; post-update generation: {}",
            v.refit_id,
            match &v.golden_tokens {
                Some(t) => format!("golden tokens {t:?} on every worker"),
                None => "none (the workers cannot generate: a rank per process, or not a llama-family model)".into(),
            }
        );
    }
    println!(
        "\npull {:.2} GB/s vs memcpy {:.2} GB/s ({} concurrent copies, same bytes): ratio {:.2}",
        pull,
        memcpy,
        versions.first().map(|v| v.workers.len()).unwrap_or(0),
        if memcpy > 0.0 { pull / memcpy } else { 0.0 }
    );
}
