//! `mx-lab bench control`: the control plane at fleet scale. A real `mx control` process (journal
//! fsync'd on the real disk) and `--workers` simulated workers spread over `--procs` processes:
//! each simulated worker registers over loopback gRPC, holds its own command stream, answers
//! Stage commands with a staged report, says whose engine it is (`mx/identity`, as mx's own
//! routes do), and serves the Dynamo engine routes (pause, update
//! weights, read version, resume) under its own URL prefix, remembering the version it was asked
//! to apply. Nothing is pulled: this measures the control plane, not the data plane.
//!
//! One round = `mx stage` of a new version to every worker (timed: STAGE request to all
//! STAGED) then `mx commit` (timed: the refit request until the refit ended COMMITTED, i.e.
//! every worker paused, applied, read back and resumed, and the COMMIT decision fsync'd).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::extract::{Path as UrlPath, State};
use axum::routing::post;
use axum::{Json, Router};
use mx_adapters::dynamo::wire::{EngineResponse, UpdateFromDistributedRequest};
use mx_control::client::ControlClient;
use mx_control::refit::{EngineApi, EngineEndpoint, Outcome, RefitSpec, Registration};
use mx_control::{Command, PauseMode, StagedReport, WorkerState};
use mx_layout::{DType, Digest, LayoutSpec, MemDevice, ShardEntry, SourceManifest, TensorBox};
use serde::Serialize;

use crate::fleet::{median, Procs, WorkDir};

/// `mx-lab bench control` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct ControlArgs {
    /// Simulated workers.
    #[arg(long, default_value_t = 1000)]
    pub workers: u32,
    /// Processes the simulated workers are spread over (at most one per worker).
    #[arg(long, default_value_t = 4)]
    pub procs: u32,
    /// Stage/commit rounds (each to a new version), at least 2: the first is reported apart as
    /// warm-up, the median of the others is the result.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..))]
    pub rounds: u32,
    /// Workers applying at once in the commit round (0 = all; 1 = one after the other, for a
    /// side-by-side with the sequential apply of earlier versions).
    #[arg(long, default_value_t = 0)]
    pub apply_parallelism: u32,
    /// The orchestrator holds the safe point: no pause/resume engine calls.
    #[arg(long)]
    pub orchestrator_gated: bool,
    /// VERIFY takes the resident version from each APPLY answer (no get_weight_version calls).
    #[arg(long)]
    pub verify_from_apply_answer: bool,
    /// After the rounds, one more refit in which one worker's APPLY fails: measures the rollback
    /// of the whole set to the committed version (refit request until ROLLED_BACK).
    #[arg(long)]
    pub rollback: bool,
    /// `mx control --refit-detail`: refits that keep every engine call (older ones keep a
    /// summary); the control plane's default when not given.
    #[arg(long)]
    pub refit_detail: Option<usize>,
    /// Keep the work directory (journal, logs).
    #[arg(long)]
    pub keep: bool,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `mx-lab bench sim-workers`: one process of simulated workers (started by `mx-lab bench control`).
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Control plane address.
    #[arg(long)]
    control: String,
    /// First worker index.
    #[arg(long)]
    first: u32,
    /// Number of workers in this process.
    #[arg(long)]
    count: u32,
    /// Written once every worker registered and holds its command stream.
    #[arg(long)]
    ready_file: PathBuf,
    /// The first simulated worker (`sim-00000`) fails `update_weights_from_distributed` of the version
    /// id this file holds, while it exists.
    #[arg(long)]
    fail_file: Option<PathBuf>,
}

/// One measured round.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Round {
    label: String,
    /// STAGE request until every worker reported STAGED (ms).
    stage_ms: f64,
    /// Refit request until the refit ended COMMITTED (ms): the commit round.
    commit_ms: f64,
    /// Phase durations from the refit record (ms, control-plane clock): PREPARE, APPLY, VERIFY,
    /// RESUME, COMMIT.
    phases_ms: Vec<(String, u64)>,
    /// Control-plane CPU seconds (user + system) during the commit round.
    commit_cpu_s: f64,
    /// Control-plane CPU seconds during the stage round.
    stage_cpu_s: f64,
    /// Journal bytes written by the commit round.
    commit_journal_bytes: u64,
    /// Journal bytes written by the stage round (declare, publish, stage, staged reports).
    stage_journal_bytes: u64,
    /// The control plane's resident memory after the round (VmRSS, MB).
    rss_mb: f64,
}

/// The result of `mx-lab bench control`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ControlReport {
    workers: u32,
    procs: u32,
    apply_parallelism: u32,
    orchestrator_gated: bool,
    verify_from_apply_answer: bool,
    /// Rounds after the first, each a new version.
    rounds: Vec<Round>,
    warmup: Option<Round>,
    /// Median commit round (ms) over `rounds`.
    pub(crate) commit_ms: f64,
    /// Median stage round (ms).
    stage_ms: f64,
    /// Control-plane CPU per worker in a commit round (microseconds, median).
    commit_cpu_us_per_worker: f64,
    /// Journal bytes per worker per commit round.
    commit_journal_bytes_per_worker: f64,
    /// Journal bytes per worker per stage round.
    stage_journal_bytes_per_worker: f64,
    /// Authentication the control plane ran with (`bearer tokens`: every RPC checked).
    auth: &'static str,
    /// The control plane's resident memory after the rounds (VmRSS, MB) and its peak (VmHWM).
    control_rss_mb: f64,
    /// Peak resident memory of the control plane (MB).
    control_peak_rss_mb: f64,
    /// The journal file (kept with `--keep`).
    journal_path: String,
    /// With `--rollback`: the refit whose APPLY failed on one worker, from the refit request
    /// until every worker was rolled back, verified and resumed (ms).
    pub(crate) rollback_ms: Option<f64>,
}

/// Resident and peak resident memory of a process (MB), from `/proc/<pid>/status`.
fn rss_mb(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |key: &str| -> anyhow::Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| format!("no {key} in /proc/{pid}/status"))?;
        let v = line
            .split_whitespace()
            .nth(1)
            .with_context(|| format!("malformed {line:?}"))?;
        Ok(v.parse::<f64>()?)
    };
    Ok((kb("VmRSS:")? / 1e3, kb("VmHWM:")? / 1e3))
}

/// The bench's principals: an orchestrator, a publisher and the simulated workers (`sim-*`),
/// each with a fresh random token; `mx control` runs with them as its token file.
struct BenchTokens {
    orchestrator: String,
    publisher: String,
    workers: String,
}

impl BenchTokens {
    fn new() -> BenchTokens {
        let fresh = |who: &str| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            blake3::hash(format!("{who}:{nanos}:{}", std::process::id()).as_bytes())
                .to_hex()
                .to_string()
        };
        BenchTokens {
            orchestrator: fresh("orchestrator"),
            publisher: fresh("publisher"),
            workers: fresh("workers"),
        }
    }

    /// Writes the token file into `work`; returns its path.
    fn write(&self, work: &std::path::Path) -> anyhow::Result<PathBuf> {
        let path = work.join("tokens");
        std::fs::write(
            &path,
            format!(
                "{},orchestrator,bench\n{},publisher,bench-trainer,*\n{},worker,sim,sim-*\n",
                self.orchestrator, self.publisher, self.workers
            ),
        )?;
        Ok(path)
    }

    fn auth(token: &str) -> anyhow::Result<mx_control::client::ClientAuth> {
        Ok(mx_control::client::ClientAuth::none().with_token(token)?)
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(f.get(i).context("short /proc stat")?.parse::<f64>()?)
    };
    let hz = clock_ticks();
    Ok((ticks(11)? + ticks(12)?) / hz)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 when unknown), the unit of `/proc` CPU times.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions and only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

const TENSOR: &str = "model.layers.0.mlp.down_proj.weight";
const SHAPE: [u64; 2] = [64, 64];

fn worker_id(i: u32) -> String {
    format!("sim-{i:05}")
}

/// A one-tensor version whose digest depends on `label` (manifests only; nothing is pulled).
fn manifest(label: &str, trainer: LayoutSpec, inference: LayoutSpec) -> SourceManifest {
    let digest = Digest::of(label.as_bytes());
    let region = TensorBox::full(&SHAPE);
    SourceManifest {
        slot: 0,
        layout: trainer,
        agent_name: "bench-source".into(),
        agent_metadata: Vec::new(),
        shards: vec![ShardEntry {
            tensor: TENSOR.into(),
            dtype: DType::BF16,
            global_shape: SHAPE.to_vec(),
            shard: region.clone(),
            addr: 1 << 40,
            len: SHAPE[0] * SHAPE[1] * 2,
            device: MemDevice::Dram,
            digest,
        }],
        pieces: vec![mx_layout::DestPiece {
            layout: inference,
            dest_rank: 0,
            tensor: TENSOR.into(),
            region,
            digest,
            packed_addr: None,
        }],
        pack_seconds: 0.0,
    }
}

/// The single tensor every simulated version declares, and its manifest's layouts.
fn version_layouts() -> anyhow::Result<(LayoutSpec, LayoutSpec, Vec<mx_layout::TensorSpec>)> {
    let tensors = vec![mx_layout::TensorSpec {
        name: TENSOR.into(),
        dtype: DType::BF16,
        shape: SHAPE.to_vec(),
    }];
    Ok(("fsdp:1".parse()?, "tp:1".parse()?, tensors))
}

/// Declares and publishes version `label`, stages it on `ids` and waits until all are STAGED;
/// returns its version id (`mx:<digest>`).
async fn stage_version(
    client: &ControlClient,
    publisher: &ControlClient,
    label: &str,
    ids: &[String],
) -> anyhow::Result<String> {
    let (trainer, inference, tensors) = version_layouts()?;
    client.declare_version(label, trainer, &tensors).await?;
    let published = publisher
        .publish(label, &manifest(label, trainer, inference))
        .await?;
    let digest = published
        .version_digest
        .with_context(|| format!("{label} is not READY after its only source published"))?;
    client.stage(label, ids).await?;
    let (reached, briefs) = client
        .wait_workers(label, ids, WorkerState::Staged, Duration::from_secs(300))
        .await?;
    if !reached {
        let bad = briefs
            .iter()
            .find(|b| b.state != WorkerState::Staged)
            .map(|b| format!("{} {:?} {:?}", b.worker_id, b.state, b.error));
        bail!("stage of {label} did not reach every worker: {bad:?}");
    }
    Ok(mx_layout::VersionId(digest).to_string())
}

/// The refit every round asks for.
fn refit_spec(a: &ControlArgs, label: &str, ids: &[String], step: u64) -> RefitSpec {
    RefitSpec {
        no_check: false,
        label: label.to_string(),
        worker_ids: ids.to_vec(),
        pause_mode: PauseMode::Keep,
        allow_partial: false,
        check: None,
        framework_step: step,
        stage_timeout_ms: 300_000,
        call_timeout_ms: 60_000,
        apply_parallelism: a.apply_parallelism,
        orchestrator_gated: a.orchestrator_gated,
        verify_from_apply_answer: a.verify_from_apply_answer,
    }
}

/// One refit whose APPLY fails on the first worker: returns the time from the refit request to
/// its end (ms), after checking that it ended ROLLED_BACK with every worker back on the version
/// it ran before.
async fn rollback_round(
    a: &ControlArgs,
    client: &ControlClient,
    publisher: &ControlClient,
    ids: &[String],
    fail_file: &std::path::Path,
) -> anyhow::Result<f64> {
    let label = "bench-rollback";
    let before = client.get_status().await?;
    let target = stage_version(client, publisher, label, ids).await?;
    std::fs::write(fail_file, &target)?;
    let t = Instant::now();
    let id = client
        .refit(&refit_spec(a, label, ids, u64::from(a.rounds) + 1))
        .await?;
    let refit = mx_cli::refits::wait_end(client, id, Duration::from_secs(600)).await?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    std::fs::remove_file(fail_file)?;
    if refit.outcome != Some(Outcome::RolledBack) {
        bail!(
            "refit {id} with a failing APPLY ended {:?}, not rolled back: {}",
            refit.outcome,
            refit.reason
        );
    }
    let after = client.get_status().await?;
    let resident = |s: &mx_control::types::FleetStatus| -> HashMap<String, Option<String>> {
        s.workers
            .iter()
            .map(|w| {
                (
                    w.worker_id.clone(),
                    w.resident_id.as_ref().map(ToString::to_string),
                )
            })
            .collect()
    };
    let (was, now) = (resident(&before), resident(&after));
    if let Some(w) = ids.iter().find(|w| was.get(*w) != now.get(*w)) {
        bail!(
            "worker {w} was not rolled back: {:?} before, {:?} after",
            was.get(w),
            now.get(w)
        );
    }
    println!(
        "rollback of {} workers (APPLY failed on one): {ms:.1} ms, {}",
        ids.len(),
        refit.reason
    );
    Ok(ms)
}

/// Runs `mx-lab bench control`: prints a table and returns the report.
pub(crate) async fn run(a: &ControlArgs) -> anyhow::Result<ControlReport> {
    if a.workers == 0 || a.procs == 0 || a.rounds == 0 {
        bail!("--workers, --procs and --rounds must be at least 1");
    }
    // On the real disk (not tmpfs): the journal's fsyncs are part of what is measured.
    let work_dir = WorkDir::create("bench-control", a.keep)?;
    let work = work_dir.path.clone();
    let mut procs = Procs(Vec::new());
    // Authentication on, as in production: every RPC is checked against the token file.
    let tokens = BenchTokens::new();
    let token_file = tokens.write(&work)?;
    let mut control_args = vec!["--tokens".into(), token_file.display().to_string()];
    if let Some(k) = a.refit_detail {
        control_args.extend(["--refit-detail".into(), k.to_string()]);
    }
    let (control, client) = crate::fleet::start_control_with(
        &mut procs,
        &work,
        &control_args,
        &BenchTokens::auth(&tokens.orchestrator)?,
    )
    .await?;
    let publisher =
        ControlClient::connect_with(&control, &BenchTokens::auth(&tokens.publisher)?).await?;
    let journal = work.join("journal.jsonl");
    let control_pid = procs.pid("control").context("control plane pid")?;
    let fail_file = work.join("fail-apply.version");
    let n_procs = a.procs.min(a.workers);
    let per = a.workers.div_ceil(n_procs);
    let mut ready = Vec::new();
    for p in 0..n_procs {
        let first = p * per;
        let count = per.min(a.workers.saturating_sub(first));
        if count == 0 {
            break;
        }
        let rf = work.join(format!("sim-{p}.ready"));
        procs.spawn_env(
            &format!("sim-{p}"),
            &work,
            &[
                "bench".into(),
                "sim-workers".into(),
                "--control".into(),
                control.clone(),
                "--first".into(),
                first.to_string(),
                "--count".into(),
                count.to_string(),
                "--ready-file".into(),
                rf.display().to_string(),
                "--fail-file".into(),
                fail_file.display().to_string(),
            ],
            &[
                ("MX_CONTROL_TOKEN", tokens.workers.as_str()),
                ("MX_CONTROL_TOKEN_FILE", ""),
            ],
        )?;
        ready.push(rf);
    }
    let t = Instant::now();
    while !ready.iter().all(|r| r.exists()) {
        procs.check(&work)?;
        if t.elapsed() > Duration::from_secs(300) {
            bail!("simulated workers did not come up within 300 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids: Vec<String> = (0..a.workers).map(worker_id).collect();
    eprintln!(
        "{} simulated workers in {} processes registered ({:.1} s)",
        a.workers,
        ready.len(),
        t.elapsed().as_secs_f64()
    );

    let mut all = Vec::new();
    for r in 0..a.rounds {
        let label = format!("bench-{r}");
        let j0 = std::fs::metadata(&journal)?.len();
        let c0 = cpu_seconds(control_pid)?;
        let t0 = Instant::now();
        stage_version(&client, &publisher, &label, &ids).await?;
        let stage_ms = t0.elapsed().as_secs_f64() * 1e3;
        let c1 = cpu_seconds(control_pid)?;
        let j1 = std::fs::metadata(&journal)?.len();
        let spec = refit_spec(a, &label, &ids, u64::from(r) + 1);
        let t1 = Instant::now();
        let id = client.refit(&spec).await?;
        let refit = mx_cli::refits::wait_end(&client, id, Duration::from_secs(600)).await?;
        let commit_ms = t1.elapsed().as_secs_f64() * 1e3;
        let c2 = cpu_seconds(control_pid)?;
        let j2 = std::fs::metadata(&journal)?.len();
        if refit.outcome != Some(Outcome::Committed) {
            bail!(
                "refit {id} to {label} ended {:?}: {}",
                refit.outcome,
                refit.reason
            );
        }
        let phases_ms = refit
            .phases
            .windows(2)
            .map(|w| (w[0].0.to_string(), w[1].1.saturating_sub(w[0].1)))
            .chain(refit.phases.last().map(|l| {
                (
                    l.0.to_string(),
                    refit.ended_ms.unwrap_or(l.1).saturating_sub(l.1),
                )
            }))
            .collect();
        all.push(Round {
            label,
            stage_ms,
            commit_ms,
            phases_ms,
            commit_cpu_s: c2 - c1,
            stage_cpu_s: c1 - c0,
            // A compaction between two measures truncates the journal: 0 for that round.
            commit_journal_bytes: j2.saturating_sub(j1),
            stage_journal_bytes: j1.saturating_sub(j0),
            rss_mb: rss_mb(control_pid)?.0,
        });
    }
    let rollback_ms = if a.rollback {
        Some(rollback_round(a, &client, &publisher, &ids, &fail_file).await?)
    } else {
        None
    };
    procs.check(&work)?;
    let (control_rss_mb, control_peak_rss_mb) = rss_mb(control_pid)?;
    drop(procs);
    let warmup = (all.len() > 1).then(|| all.remove(0));
    let n = f64::from(a.workers);
    let report = ControlReport {
        workers: a.workers,
        procs: u32::try_from(ready.len()).unwrap_or(u32::MAX),
        apply_parallelism: a.apply_parallelism,
        orchestrator_gated: a.orchestrator_gated,
        verify_from_apply_answer: a.verify_from_apply_answer,
        commit_ms: median(&all.iter().map(|r| r.commit_ms).collect::<Vec<_>>()),
        stage_ms: median(&all.iter().map(|r| r.stage_ms).collect::<Vec<_>>()),
        commit_cpu_us_per_worker: median(
            &all.iter()
                .map(|r| r.commit_cpu_s * 1e6 / n)
                .collect::<Vec<_>>(),
        ),
        commit_journal_bytes_per_worker: median(
            &all.iter()
                .map(|r| r.commit_journal_bytes as f64 / n)
                .collect::<Vec<_>>(),
        ),
        stage_journal_bytes_per_worker: median(
            &all.iter()
                .map(|r| r.stage_journal_bytes as f64 / n)
                .collect::<Vec<_>>(),
        ),
        journal_path: journal.display().to_string(),
        auth: "bearer tokens",
        control_rss_mb,
        control_peak_rss_mb,
        rollback_ms,
        rounds: all,
        warmup,
    };
    print_report(&report);
    Ok(report)
}

fn print_report(r: &ControlReport) {
    println!(
        "\ncontrol plane, {} simulated workers in {} processes (loopback gRPC + HTTP, {} on every RPC, journal fsync'd on disk)",
        r.workers, r.procs, r.auth
    );
    println!(
        "{:<10} {:>10} {:>10} {:>34} {:>10} {:>12} {:>12} {:>8}",
        "round",
        "stage ms",
        "commit ms",
        "phases ms (prep/apply/verify/resume/commit)",
        "cpu s",
        "journal B",
        "B/worker",
        "RSS MB"
    );
    for x in r.warmup.iter().chain(&r.rounds) {
        let phases: Vec<String> = x
            .phases_ms
            .iter()
            .skip(1)
            .map(|p| p.1.to_string())
            .collect();
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>34} {:>10.3} {:>12} {:>12.0} {:>8.0}",
            x.label,
            x.stage_ms,
            x.commit_ms,
            phases.join("/"),
            x.commit_cpu_s,
            x.commit_journal_bytes,
            x.commit_journal_bytes as f64 / f64::from(r.workers),
            x.rss_mb
        );
    }
    println!(
        "median commit round {:.1} ms, stage round {:.1} ms; control-plane CPU {:.1} us/worker; journal {:.0} B/worker per commit, {:.0} B/worker per stage; control-plane memory {:.0} MB (peak {:.0} MB)",
        r.commit_ms,
        r.stage_ms,
        r.commit_cpu_us_per_worker,
        r.commit_journal_bytes_per_worker,
        r.stage_journal_bytes_per_worker,
        r.control_rss_mb,
        r.control_peak_rss_mb
    );
}

/// Versions the simulated workers were asked to apply, by worker id.
#[derive(Default)]
struct SimState {
    resident: Mutex<HashMap<String, String>>,
    /// See [`SimArgs::fail_file`].
    fail_file: Option<PathBuf>,
}

/// `{status: "ok", message: "", version}`; an apply's answer also names the tier it cleared.
fn ok(version: Option<&str>) -> Json<EngineResponse> {
    match version {
        Some(v) => Json(EngineResponse {
            cache_tiers_cleared: Some(vec!["kv".into()]),
            ..EngineResponse::ok("", Some(v.to_string()))
        }),
        None => Json(EngineResponse::ok("", None)),
    }
}

/// `{status: "error", message}`.
fn refused(message: impl Into<String>) -> Json<EngineResponse> {
    Json(EngineResponse::error(message, None))
}

/// The Dynamo engine routes of one simulated worker, `POST /w/{id}/engine/{route}`, following the
/// contract `mx_adapters::dynamo` speaks (status "ok", the version where the route reports one).
async fn engine_route(
    State(st): State<Arc<SimState>>,
    UrlPath((id, route)): UrlPath<(String, String)>,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, Json<EngineResponse>) {
    use axum::http::StatusCode;
    let update = serde_json::from_slice::<UpdateFromDistributedRequest>(&body).unwrap_or_default();
    let mut resident = st
        .resident
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match route.as_str() {
        "pause_generation" | "resume_generation" => (StatusCode::OK, ok(None)),
        "update_weights_from_distributed" => match update.weight_version.as_deref() {
            Some(v)
                if id == worker_id(0)
                    && st
                        .fail_file
                        .as_ref()
                        .and_then(|f| std::fs::read_to_string(f).ok())
                        .is_some_and(|f| f == v) =>
            {
                // Dynamo answers a failed install HTTP 200 with status "error".
                (StatusCode::OK, refused("simulated apply failure"))
            }
            Some(v) => {
                resident.insert(id, v.to_string());
                (StatusCode::OK, ok(Some(v)))
            }
            None => (StatusCode::BAD_REQUEST, refused("weight_version missing")),
        },
        "get_weight_version" => match resident.get(&id) {
            Some(v) => (StatusCode::OK, ok(Some(v))),
            None => (
                StatusCode::OK,
                Json(EngineResponse::ok("", Some(String::new()))),
            ),
        },
        _ => (StatusCode::NOT_FOUND, refused(format!("no route {route}"))),
    }
}

/// `GET /w/{id}/mx/identity`: whose engine this is, as mx's own engine routes answer it (the
/// simulated workers register without an incarnation, so its digest is of 0).
async fn identity_route(
    UrlPath(id): UrlPath<String>,
) -> Json<mx_adapters::identity::wire::IdentityResponse> {
    Json(mx_adapters::identity::wire::IdentityResponse {
        engines: vec![mx_adapters::EngineIdentity {
            instance: id.clone(),
            worker_id: id,
            incarnation_digest: mx_adapters::incarnation_digest(0),
        }],
    })
}

/// Runs one process of simulated workers until killed.
pub(crate) async fn sim_workers(a: SimArgs) -> anyhow::Result<()> {
    let st = Arc::new(SimState {
        fail_file: a.fail_file.clone(),
        ..SimState::default()
    });
    let app = Router::new()
        .route("/w/{id}/engine/{route}", post(engine_route))
        .route("/w/{id}/mx/identity", axum::routing::get(identity_route))
        .with_state(Arc::clone(&st));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("simulated engine server: {e}");
        }
    });
    let layout: LayoutSpec = "tp:1".parse()?;
    // One gRPC connection per 50 workers (HTTP/2 servers cap concurrent streams per connection).
    let mut clients = Vec::new();
    for _ in 0..a.count.div_ceil(50) {
        clients.push(ControlClient::connect(&a.control).await?);
    }
    let mut tasks = Vec::new();
    for k in 0..a.count {
        let i = a.first + k;
        let id = worker_id(i);
        let client = clients[(k / 50) as usize].clone();
        client
            .register(&Registration {
                worker_id: id.clone(),
                instance: id.clone(),
                ranks: vec![0],
                layout,
                engine: Some(EngineEndpoint {
                    api: EngineApi::Dynamo,
                    system_url: format!("http://{addr}/w/{id}"),
                    no_model: false,
                    frontend: None,
                }),
                resident_version: None,
                model_limits: None,
                seen: Default::default(),
            })
            .await
            .with_context(|| format!("registering {id}"))?;
        let mut stream = client.watch_commands(&id).await?;
        tasks.push(tokio::spawn(async move {
            while let Some(cmd) = stream.next().await? {
                let Command::Stage { label, .. } = cmd;
                client
                    .report_staged(&StagedReport {
                        worker_id: id.clone(),
                        label,
                        ok: true,
                        error: String::new(),
                        ranks: Vec::new(),
                        bytes: 0,
                        descriptors: 0,
                        seconds: 0.0,
                        strategies: Default::default(),
                        source: String::new(),
                        wire_bytes: 0,
                    })
                    .await?;
            }
            anyhow::Ok(())
        }));
    }
    std::fs::write(&a.ready_file, addr.to_string())?;
    for t in tasks {
        t.await??;
    }
    Ok(())
}
