//! `mx-lab validate`: runs the refit fault matrix against a real local fleet and reports, per
//! scenario, the expected and observed outcome, every worker's version afterwards (read back
//! from the engines themselves, not from the control plane), whether the fleet is consistent and
//! whether the journal on disk is complete.
//!
//! The embedded fleet: `mx control` (its own process, so it can be SIGKILLed and restarted on
//! the same address), two FSDP trainer ranks publishing step-1 and step-2 of SmolLM2, and two
//! reference inference workers: `w0` (tp:3, all three ranks, Dynamo contract) and `w1` (tp:1,
//! SGLang contract). Faults are real: SIGKILL of processes, a byte flipped in a publisher's
//! memory through `/proc/<pid>/mem`, worker failpoints for timing (hang, skipped cache clear,
//! failing generation), and control-plane failpoints that SIGKILL it at each transition.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_control::client::ControlClient;
use mx_control::{Action, GenerationCheck, Outcome, PauseMode, Refit, RefitSpec, VersionState};
use serde::Serialize;
use serde_json::json;

use crate::fleet::{connect, default_model, Procs, WorkDir};
use mx_cli::refits::{golden, print_refit, wait_end};

mod chaos;
mod ha;
mod restarts;

/// Flags of `mx-lab validate`.
#[derive(clap::Args, Debug, Clone)]
pub struct ValidateArgs {
    /// HF checkpoint directory (llama family).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Run only these scenarios (comma-separated names; see the table).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Keep the work directory (logs, journal).
    #[arg(long)]
    pub keep: bool,
    /// Chaos mode instead of the matrix: N refits in a row, each with a SIGKILL of a randomly
    /// chosen process (control plane, a worker, a publisher) at a random moment, restarted as a
    /// supervisor would, and the lifecycle's invariants checked from the engines after each.
    #[arg(long, value_name = "N")]
    pub chaos: Option<u32>,
    /// Seed of the chaos schedule (the same seed gives the same victims and delays).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// High availability instead of the matrix: the control plane runs as two replicas on a
    /// 3-member etcd cluster started on loopback (needs `etcd` on PATH), and the leader is
    /// SIGKILLed at each refit transition (`leader_killed_at_<point>`, after `happy_path`).
    #[arg(long, conflicts_with = "chaos")]
    pub ha: bool,
}

/// One scenario's row.
#[derive(Debug, Clone, Serialize)]
struct ScenarioReport {
    name: String,
    expected: String,
    observed: String,
    passed: bool,
    fleet_consistent: bool,
    journal_complete: bool,
    /// Worker -> version id after the scenario, read back from the engine.
    versions_after: BTreeMap<String, String>,
    seconds: f64,
    detail: String,
}

const WORKERS: [&str; 2] = ["w0", "w1"];
const CHECK_TOKENS: u32 = 4;
/// Engine call deadline in the matrix (the hung worker sleeps past it).
const CALL_TIMEOUT_MS: u64 = 10_000;

/// Crash points of the control plane, in lifecycle order, with the outcome a restart must reach.
const CRASH_POINTS: [(&str, Outcome); 9] = [
    ("stage", Outcome::Aborted),
    ("prepare", Outcome::Aborted),
    ("apply", Outcome::Aborted),
    ("apply-sent:0", Outcome::RolledBack),
    ("apply:1", Outcome::RolledBack),
    ("verify", Outcome::RolledBack),
    ("resume", Outcome::RolledBack),
    ("check", Outcome::RolledBack),
    ("commit", Outcome::Committed),
];

/// The outcome a refit interrupted at crash `point` must end with, and the version every worker
/// serves then (step-2 once committed, else step-1 again).
///
/// # Errors
/// When `point` is not one of [`CRASH_POINTS`].
fn crash_expectation(point: &str) -> anyhow::Result<(Outcome, &'static str)> {
    let expect = CRASH_POINTS
        .iter()
        .find(|(p, _)| *p == point)
        .map(|(_, o)| *o)
        .with_context(|| format!("unknown crash point {point}"))?;
    let label = if expect == Outcome::Committed {
        "step-2"
    } else {
        "step-1"
    };
    Ok((expect, label))
}

struct Fleet {
    work: PathBuf,
    model: PathBuf,
    procs: Procs,
    listen: String,
    control: String,
    journal: PathBuf,
    client: ControlClient,
    http: reqwest::Client,
    /// Version label -> (version id, golden tokens).
    versions: BTreeMap<String, (String, Vec<u32>)>,
    /// Publisher processes: (process name, `mx` arguments), to restart them as they started.
    publishers: Vec<(String, Vec<String>)>,
    /// With `--ha`: the etcd cluster and the replicas (`control` is then their URL list and the
    /// journal lives in etcd).
    ha: Option<ha::Ha>,
}

fn s(v: &str) -> String {
    v.to_string()
}

fn control_args(listen: &str, journal: &Path) -> Vec<String> {
    vec![
        s("control"),
        s("--insecure-loopback"),
        s("--listen"),
        s(listen),
        s("--journal"),
        journal.display().to_string(),
    ]
}

impl Fleet {
    fn control_args(&self) -> Vec<String> {
        control_args(&self.listen, &self.journal)
    }

    /// `mx-lab publish` of FSDP rank `rank` publishing versions `first..=last` (step-k is the
    /// checkpoint after k-1 known training steps).
    fn publisher_args(&self, rank: u32, first: u32, last: u32) -> Vec<String> {
        vec![
            s("publish"),
            s("--control"),
            self.control.clone(),
            s("--model"),
            self.model.display().to_string(),
            s("--layout"),
            s("fsdp:2"),
            s("--rank"),
            rank.to_string(),
            s("--first-step"),
            first.to_string(),
            s("--steps"),
            last.to_string(),
            s("--wait-s"),
            s("3600"),
            s("--stay"),
        ]
    }

    fn worker_args(&self, id: &str, load: bool) -> Vec<String> {
        let (layout, ranks, api) = if id == "w0" {
            ("tp:3", "0,1,2", "dynamo")
        } else {
            ("tp:1", "0", "dynamo_sglang")
        };
        let mut a = vec![
            s("worker"),
            s("--control"),
            self.control.clone(),
            s("--model"),
            self.model.display().to_string(),
            s("--layout"),
            s(layout),
            s("--ranks"),
            s(ranks),
            s("--id"),
            s(id),
            s("--engine-api"),
            s(api),
            s("--failpoints"),
        ];
        if load {
            a.push(s("--load"));
            a.push(self.model.display().to_string());
        }
        a
    }

    async fn status(&self) -> anyhow::Result<mx_control::FleetStatus> {
        Ok(self.client.get_status().await?)
    }

    async fn system_url(&self, id: &str) -> anyhow::Result<String> {
        let st = self.status().await?;
        st.workers
            .iter()
            .find(|w| w.worker_id == id)
            .and_then(|w| w.engine.as_ref())
            .map(|e| e.system_url.clone())
            .with_context(|| format!("worker {id} has no engine endpoint"))
    }

    async fn failpoints(&self, id: &str, body: serde_json::Value) -> anyhow::Result<()> {
        let url = format!("{}/mx/failpoints", self.system_url(id).await?);
        let r = self.http.post(&url).json(&body).send().await?;
        if !r.status().is_success() {
            bail!("{url}: HTTP {}", r.status());
        }
        Ok(())
    }

    async fn clear_failpoints(&self) -> anyhow::Result<()> {
        for w in WORKERS {
            self.failpoints(
                w,
                json!({"apply.sleep_ms": null, "apply.skip_cache_clear": null,
                       "pause.sleep_ms": null, "generate.fail": null,
                       "stage.sleep_between_sources_ms": null}),
            )
            .await?;
        }
        Ok(())
    }

    /// A rollout: greedy generation of the check prompt on a worker (fills its prefix cache).
    async fn rollout(&self, id: &str) -> anyhow::Result<Vec<u32>> {
        let url = self.system_url(id).await?;
        let g = mx_adapters::generate::generate(
            &self.http,
            &url,
            &mx_engine::golden::CHECK_PROMPT,
            CHECK_TOKENS,
            Duration::from_secs(60),
        )
        .await?;
        Ok(g.output_ids)
    }

    /// The version each engine holds, asked from the engine itself: Dynamo's
    /// get_weight_version, vLLM's `GET /weight_info`; for SGLang (no read-back) the version whose
    /// golden tokens its generation reproduces.
    async fn engine_versions(&self) -> anyhow::Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let st = self.status().await?;
        for w in WORKERS {
            // A worker that is gone (killed and not back) is not part of the fleet now.
            let Some(ws) = st.workers.iter().find(|x| x.worker_id == w && x.connected) else {
                continue;
            };
            let Some(e) = &ws.engine else { continue };
            let v = match e.api {
                mx_control::EngineApi::Dynamo => mx_adapters::dynamo::DynamoWorkerClient::new(
                    &e.system_url,
                    Duration::from_secs(60),
                )
                .get_weight_version()
                .await
                .unwrap_or_else(|err| format!("(error: {err})")),
                mx_control::EngineApi::Vllm => {
                    let c =
                        mx_adapters::vllm::VllmClient::new(&e.system_url, Duration::from_secs(60));
                    match c.weight_version().await {
                        Ok(v) => v.unwrap_or_else(|| "(no weight version)".into()),
                        Err(err) => format!("(error: {err})"),
                    }
                }
                // No read-back in this contract (SGLang's own server has one, but mx validate
                // runs mx's reference worker, which speaks Dynamo's two contracts).
                mx_control::EngineApi::DynamoSglang | mx_control::EngineApi::Sglang => {
                    match self.rollout(w).await {
                        Ok(tokens) => self
                            .versions
                            .iter()
                            .find(|(_, (_, g))| *g == tokens)
                            .map(|(_, (id, _))| id.clone())
                            .unwrap_or_else(|| format!("(unknown: tokens {tokens:?})")),
                        Err(err) => format!("(error: {err})"),
                    }
                }
            };
            out.insert(s(w), v);
        }
        Ok(out)
    }

    fn spec(&self, label: &str) -> anyhow::Result<RefitSpec> {
        self.spec_on(label, &WORKERS)
    }

    /// The matrix's refit of `label` on `workers` only.
    fn spec_on(&self, label: &str, workers: &[&str]) -> anyhow::Result<RefitSpec> {
        let (_, golden) = self.versions.get(label).context("unknown label")?;
        Ok(RefitSpec {
            no_check: false,
            label: s(label),
            worker_ids: workers.iter().map(|w| s(w)).collect(),
            pause_mode: PauseMode::Wait,
            allow_partial: false,
            check: Some(GenerationCheck {
                source: format!("the demo's golden tokens of {label}"),
                ..GenerationCheck::tokens(
                    mx_engine::golden::CHECK_PROMPT.to_vec(),
                    CHECK_TOKENS,
                    golden.clone(),
                )
            }),
            framework_step: label.trim_start_matches("step-").parse().unwrap_or(0),
            stage_timeout_ms: 120_000,
            call_timeout_ms: CALL_TIMEOUT_MS,
            // One after the other, so the crash point `apply:1` lies between w0's and w1's apply.
            apply_parallelism: 1,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        })
    }

    async fn refit(&self, label: &str) -> anyhow::Result<Refit> {
        self.refit_on(label, &WORKERS).await
    }

    /// Refits `workers` only to `label` and waits for the end.
    async fn refit_on(&self, label: &str, workers: &[&str]) -> anyhow::Result<Refit> {
        let id = self.client.refit(&self.spec_on(label, workers)?).await?;
        wait_end(&self.client, id, Duration::from_secs(600)).await
    }

    /// Moves the fleet to `label` if it is not there (rollouts of the old version first, so the
    /// prefix caches hold stale entries a skipped clear would serve).
    async fn ensure(&self, label: &str) -> anyhow::Result<()> {
        let (target, _) = self.versions.get(label).context("unknown label")?.clone();
        let st = self.status().await?;
        let there = st
            .fleet_version
            .as_ref()
            .is_some_and(|f| f.version_id.to_string() == target)
            && WORKERS.iter().all(|w| {
                st.workers
                    .iter()
                    .any(|x| x.worker_id == *w && x.admitted && holds(&x.resident_id, &target))
            });
        if !there {
            let r = self.refit(label).await?;
            if r.outcome != Some(Outcome::Committed) {
                print_refit(&r);
                bail!("could not bring the fleet to {label}: {}", r.reason);
            }
        }
        Ok(())
    }

    /// Journal completeness, from the file on disk: replayed into a fresh state, every refit
    /// since `from` has BEGIN, END and a result for every call.
    async fn journal_gaps(&self, from: u64) -> anyhow::Result<Vec<String>> {
        let st = self.journal_state().await?;
        Ok(st
            .refits()
            .filter(|r| r.id >= from)
            .flat_map(Refit::journal_gaps)
            .collect())
    }

    /// The state the journal replays to: from the file on disk (and its snapshot) or, with
    /// `--ha`, from etcd.
    async fn journal_state(&self) -> anyhow::Result<mx_control::state::State> {
        match &self.ha {
            Some(ha) => Ok(ha.journal().await?.replay(Path::new("etcd:/mx/journal/"))?),
            None => Ok(mx_control::journal::load_state(&self.journal)?),
        }
    }

    async fn wait_registered(&self, id: &str) -> anyhow::Result<()> {
        let t = Instant::now();
        loop {
            if let Ok(st) = self.client.get_status().await {
                if st
                    .workers
                    .iter()
                    .any(|w| w.worker_id == id && w.engine.is_some() && w.connected)
                {
                    return Ok(());
                }
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!("worker {id} did not register");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Flips one byte of a child's memory at `addr` through `/proc/<pid>/mem` (the parent may; UCX
/// reads the same memory with process_vm_readv). Returns the original byte.
fn flip_byte(pid: u32, addr: u64) -> anyhow::Result<u8> {
    let path = format!("/proc/{pid}/mem");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {path}"))?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, addr)
        .with_context(|| format!("reading {path} at {addr:#x}"))?;
    f.write_all_at(&[b[0] ^ 0xFF], addr)
        .with_context(|| format!("writing {path} at {addr:#x}"))?;
    Ok(b[0])
}

/// Runs `mx-lab validate`: every scenario of the fault matrix (or `--chaos N` random kills)
/// against a real local fleet; prints the table and writes the report.
///
/// # Errors
/// When a scenario fails (naming it and what was observed) or the fleet cannot start.
pub fn run(args: ValidateArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run_async(args))
}

/// Which sources the embedded fleet runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sources {
    /// Two FSDP ranks that publish step-1, train in place and publish step-2 into the same
    /// memory (step-1 is then retired from its sources: the fault matrix relies on it).
    TrainInPlace,
    /// Four processes: two FSDP ranks serve step-1 only, two others step-2 only, so both
    /// versions stay pullable from their sources (chaos: a worker restarted empty can always be
    /// brought back to either).
    EachVersionServed,
}

/// Starts the embedded fleet (control plane, workers, publishers), computes the golden tokens,
/// commits step-1 and waits until step-2 is READY.
async fn start_fleet(
    model: &Path,
    keep: bool,
    sources: Sources,
    with_ha: bool,
) -> anyhow::Result<(WorkDir, Fleet)> {
    if !model.join("config.json").exists() {
        bail!(
            "{} has no config.json: run scripts/setup.sh (or pass --model)",
            model.display()
        );
    }
    let work_dir = WorkDir::create("validate", keep)?;
    let work = work_dir.path.clone();
    // A free port for the control plane, reused across its restarts.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let listen = format!("127.0.0.1:{port}");
    let control = format!("http://{listen}");
    let journal = work.join("journal.jsonl");
    let mut procs = Procs(Vec::new());
    let mut ha = if with_ha {
        Some(ha::Ha::start(&work)?)
    } else {
        None
    };
    let control = match &mut ha {
        Some(h) => {
            h.wait_etcd().await?;
            for i in 0..ha::REPLICAS.len() {
                h.spawn_replica(&mut procs, i, &work, &journal, &[])?;
            }
            h.control_urls()
        }
        None => {
            procs.spawn("control", &work, &control_args(&listen, &journal))?;
            control
        }
    };
    let client = connect(&control, Duration::from_secs(30)).await?;
    let mut f = Fleet {
        work: work.clone(),
        model: model.to_path_buf(),
        procs,
        listen,
        control,
        journal,
        client,
        http: reqwest::Client::new(),
        versions: BTreeMap::new(),
        publishers: Vec::new(),
        ha,
    };

    eprintln!("computing golden tokens (forward passes over checkpoint + known updates)");
    for (k, label) in [(1u32, "step-1"), (2, "step-2")] {
        let g = golden(model, k, &mx_engine::golden::CHECK_PROMPT, CHECK_TOKENS)?;
        f.versions.insert(s(label), (String::new(), g));
    }
    if f.versions["step-1"].1 == f.versions["step-2"].1 {
        bail!("the golden tokens of step-1 and step-2 are equal: the post-update check cannot tell them apart");
    }
    for w in WORKERS {
        let a = f.worker_args(w, false);
        f.procs.spawn(&format!("worker-{w}"), &work, &a)?;
    }
    for w in WORKERS {
        f.wait_registered(w).await?;
    }
    let ckpt = mx_checkpoint::Checkpoint::open(model)?;
    let specs = ckpt.specs();
    let trainer = "fsdp:2".parse()?;
    f.client.declare_version("step-1", trainer, &specs).await?;
    f.client.declare_version("step-2", trainer, &specs).await?;
    f.publishers = match sources {
        Sources::TrainInPlace => (0..2)
            .map(|r| (format!("publisher-{r}"), f.publisher_args(r, 1, 2)))
            .collect(),
        Sources::EachVersionServed => (0..2)
            .flat_map(|r| {
                [(1, 1), (2, 2)].map(|(first, last)| {
                    (
                        format!("publisher-step{first}-{r}"),
                        f.publisher_args(r, first, last),
                    )
                })
            })
            .collect(),
    };
    for (name, a) in f.publishers.clone() {
        f.procs.spawn(&name, &work, &a)?;
    }
    learn_version(&mut f, "step-1").await?;
    eprintln!("bootstrap: refit step-1");
    let r = f.refit("step-1").await?;
    print_refit(&r);
    if r.outcome != Some(Outcome::Committed) {
        bail!("bootstrap refit to step-1 failed: {}", r.reason);
    }
    learn_version(&mut f, "step-2").await?;
    Ok((work_dir, f))
}

async fn run_async(args: ValidateArgs) -> anyhow::Result<()> {
    let model = args.model.clone().unwrap_or_else(default_model);
    if let Some(n) = args.chaos {
        let (work_dir, f) =
            start_fleet(&model, args.keep, Sources::EachVersionServed, false).await?;
        return chaos::run(f, &work_dir, n, args.seed, args.report.as_deref()).await;
    }
    let (work_dir, mut f) = start_fleet(&model, args.keep, Sources::TrainInPlace, args.ha).await?;
    let work = work_dir.path.clone();

    let names: Vec<String> = if args.ha {
        std::iter::once(s("happy_path"))
            .chain(ha::scenario_names())
            .collect()
    } else {
        matrix_names()
    };
    let mut reports = Vec::new();
    for name in names {
        if !args.only.is_empty() && !args.only.contains(&name) {
            continue;
        }
        eprintln!("scenario {name}");
        let t = Instant::now();
        let first_refit = next_refit_id(&f).await?;
        let res = scenario(&mut f, &name).await;
        let (expected, observed, passed_inner, detail) = match res {
            Ok(x) => x,
            Err(e) => (s("-"), s("error"), false, format!("{e:#}")),
        };
        let _ = f.clear_failpoints().await;
        let versions_after = f.engine_versions().await.unwrap_or_default();
        let distinct: std::collections::BTreeSet<&String> = versions_after.values().collect();
        let known = versions_after
            .values()
            .all(|v| f.versions.values().any(|(id, _)| id == v));
        let fleet_consistent = distinct.len() == 1 && known;
        let gaps = f
            .journal_gaps(first_refit)
            .await
            .unwrap_or_else(|e| vec![e.to_string()]);
        let journal_complete = gaps.is_empty();
        let detail = if gaps.is_empty() {
            detail
        } else {
            format!("{detail}; journal: {}", gaps.join("; "))
        };
        let row = ScenarioReport {
            name: name.clone(),
            expected,
            observed,
            passed: passed_inner && fleet_consistent && journal_complete,
            fleet_consistent,
            journal_complete,
            versions_after,
            seconds: t.elapsed().as_secs_f64(),
            detail,
        };
        eprintln!(
            "  {} expected {} observed {} consistent {} journal {}",
            if row.passed { "PASS" } else { "FAIL" },
            row.expected,
            row.observed,
            row.fleet_consistent,
            row.journal_complete
        );
        reports.push(row);
    }
    print_table(&f, &reports);
    if let Some(p) = &args.report {
        let all = reports.iter().all(|r| r.passed);
        mx_cli::report::write_report(
            p,
            &json!({
                "passed": all,
                "scenarios": reports,
                "versions": f.versions.iter().map(|(l, (id, g))| json!({"label": l, "version": id, "golden_tokens": g})).collect::<Vec<_>>(),
            }),
        )?;
    }
    if let Some(bad) = reports.iter().find(|r| !r.passed) {
        bail!(
            "scenario {} failed: {} (logs in {}{})",
            bad.name,
            bad.detail,
            work.display(),
            if args.keep {
                ""
            } else {
                ", pass --keep to keep them"
            }
        );
    }
    if reports.is_empty() {
        bail!("no scenario matched --only {:?}", args.only);
    }
    Ok(())
}

/// The scenarios of the fault matrix, in the order they run.
fn matrix_names() -> Vec<String> {
    // Scenarios that need a real pull come first: once a worker held step-2 it keeps it pinned
    // and stages it again without pulling.
    let mut names: Vec<String> = vec![
        s("corrupted_source_byte"),
        s("publisher_killed_mid_pull"),
        s("happy_path"),
        s("same_version_twice"),
        s("post_update_generation_fails"),
        s("cache_not_cleared"),
        s("worker_hung_in_apply"),
    ];
    names.extend(
        CRASH_POINTS
            .iter()
            .map(|(p, _)| format!("control_plane_killed_at_{p}")),
    );
    names.extend([
        s("stale_outside_the_set"),
        s("verify_only_check_fails"),
        s("missing_worker"),
        s("missing_worker_allowed"),
        s("stale_worker_rejoins"),
        // Last: these restart workers empty, so they hold step-1 no more (its sources moved on).
        s("empty_worker_in_a_failed_refit"),
        s("worker_restarted_during_apply"),
        s("engine_changed_behind_the_control_plane"),
        s("worker_restarted_during_prepare"),
    ]);
    names
}

async fn next_refit_id(f: &Fleet) -> anyhow::Result<u64> {
    Ok(f.journal_state().await?.next_refit_id())
}

/// Waits until `label` is READY and records its version id.
async fn learn_version(f: &mut Fleet, label: &str) -> anyhow::Result<()> {
    wait_ready(f, label).await?;
    let d = f
        .client
        .get_version(label)
        .await?
        .version_digest
        .with_context(|| format!("{label} READY without a digest"))?;
    f.versions
        .get_mut(label)
        .with_context(|| label.to_string())?
        .0 = mx_layout::VersionId(d).to_string();
    Ok(())
}

/// True when `resident` is the version with id `id` (`mx:<hex>`).
pub(super) fn holds(resident: &Option<mx_layout::ResidentVersion>, id: &str) -> bool {
    resident.as_ref().is_some_and(|r| r.to_string() == id)
}

async fn wait_ready(f: &mut Fleet, label: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let work = f.work.clone();
        f.procs.check(&work)?;
        if let Ok(v) = f.client.get_version(label).await {
            if v.state.reaches(VersionState::Ready) {
                return Ok(());
            }
        }
        if t.elapsed() > Duration::from_secs(600) {
            bail!("{label} did not become READY");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs one scenario; returns (expected, observed, passed, detail).
/// True when every worker of refit `r` ended with `label`'s version resident.
fn on(r: &Refit, label: &str, f: &Fleet) -> bool {
    let v = &f.versions[label].0;
    r.workers.values().all(|w| holds(&w.resident, v))
}

async fn scenario(f: &mut Fleet, name: &str) -> anyhow::Result<(String, String, bool, String)> {
    match name {
        n if n.starts_with("leader_killed_at_") => {
            ha::leader_killed_at(f, n.trim_start_matches("leader_killed_at_")).await
        }
        n if n.starts_with("refit_cli_leader_killed_after_") => {
            let ms = n
                .trim_start_matches("refit_cli_leader_killed_after_")
                .trim_end_matches("ms")
                .parse::<u64>()
                .with_context(|| format!("scenario {n}: not a delay in ms"))?;
            ha::cli_refit_through_leader_kill(f, Duration::from_millis(ms)).await
        }
        "happy_path" => {
            f.ensure("step-1").await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::Committed) && on(&r, "step-2", f);
            Ok((
                s("COMMITTED on step-2"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "same_version_twice" => {
            f.ensure("step-2").await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let count = |pred: fn(&Action) -> bool| {
                r.workers
                    .values()
                    .flat_map(|w| &w.calls)
                    .filter(|c| pred(&c.action))
                    .count()
            };
            let changed = count(|a| matches!(a, Action::Pause | Action::Apply { .. }));
            let reads = count(|a| *a == Action::ReadVersion);
            let checks = count(|a| *a == Action::Generate);
            let ok = r.outcome == Some(Outcome::Committed)
                && changed == 0
                && reads == WORKERS.len()
                && checks == WORKERS.len()
                && on(&r, "step-2", f);
            Ok((
                s("verify-only COMMITTED: nothing paused or applied, every engine read back and checked"),
                format!(
                    "{}: {changed} pause/apply calls, {reads} read-backs, {checks} checks",
                    outcome_str(&r)
                ),
                ok,
                r.reason.clone(),
            ))
        }
        "stale_outside_the_set" => {
            f.ensure("step-1").await?;
            let r = f.refit_on("step-2", &["w0"]).await?;
            print_refit(&r);
            let st = f.status().await?;
            let w = |id: &str| st.workers.iter().find(|w| w.worker_id == id).cloned();
            let (w0, w1) = (w("w0").context("w0")?, w("w1").context("w1")?);
            let stale = !w1.admitted && w1.admission.contains("stale");
            // Bring w1 along so the fleet is one version again.
            let again = f.refit("step-2").await?;
            let ok = r.outcome == Some(Outcome::Committed)
                && w0.admitted
                && stale
                && again.outcome == Some(Outcome::Committed);
            Ok((
                s("w1 (outside the set, still on step-1) gated as stale; then COMMITTED on both"),
                format!(
                    "{} on w0; w1 admitted {} ({}); refit of both {}",
                    outcome_str(&r),
                    w1.admitted,
                    w1.admission,
                    outcome_str(&again)
                ),
                ok,
                r.reason.clone(),
            ))
        }
        "corrupted_source_byte" => {
            f.ensure("step-1").await?;
            let info = f.client.get_version("step-2").await?;
            let m = info
                .manifests
                .iter()
                .find(|m| m.slot == 0)
                .context("slot 0")?;
            let shard = m.shards.iter().find(|s| s.len > 0).context("a shard")?;
            let addr = shard.addr + shard.len / 2;
            let pid = f.procs.pid("publisher-0").context("publisher-0")?;
            let orig = flip_byte(pid, addr)?;
            let r = f.refit("step-2").await;
            // Restore the byte whatever happened.
            flip_byte(pid, addr)?;
            let r = r?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::Aborted)
                && on(&r, "step-1", f)
                && r.reason.contains("verif");
            Ok((
                s("ABORTED at STAGE (verification), all on step-1"),
                outcome_str(&r),
                ok,
                format!(
                    "flipped byte {orig:#04x} of {} at {addr:#x}: {}",
                    shard.tensor, r.reason
                ),
            ))
        }
        "post_update_generation_fails" => {
            f.ensure("step-1").await?;
            f.failpoints("w1", json!({"generate.fail": true})).await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::RolledBack) && on(&r, "step-1", f);
            Ok((
                s("ROLLED_BACK, all on step-1"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "cache_not_cleared" => {
            f.ensure("step-1").await?;
            // A rollout of the check prompt on step-1 leaves it in w1's prefix cache.
            f.rollout("w1").await?;
            f.failpoints("w1", json!({"apply.skip_cache_clear": true}))
                .await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::RolledBack)
                && on(&r, "step-1", f)
                && r.reason.contains("golden");
            Ok((
                s("ROLLED_BACK (golden mismatch), all on step-1"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "worker_hung_in_apply" => {
            f.ensure("step-1").await?;
            f.failpoints("w1", json!({"apply.sleep_ms": CALL_TIMEOUT_MS + 3_000}))
                .await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::RolledBack) && on(&r, "step-1", f);
            Ok((
                s("ROLLED_BACK after the deadline, all on step-1"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        n if n.starts_with("control_plane_killed_at_") => {
            let point = n.trim_start_matches("control_plane_killed_at_");
            let (expect, label) = crash_expectation(point)?;
            f.ensure("step-1").await?;
            // Restart the control plane with the failpoint armed.
            f.procs.kill("control")?;
            let args = f.control_args();
            let work = f.work.clone();
            f.procs
                .spawn_env("control", &work, &args, &[("MX_CONTROL_CRASH_AT", point)])?;
            f.client = connect(&f.control, Duration::from_secs(30)).await?;
            for w in WORKERS {
                wait_connected(f, w).await?;
            }
            let id = f.client.refit(&f.spec("step-2")?).await?;
            f.procs.wait_exit("control", Duration::from_secs(300))?;
            // Restart without it: the new control plane reads the journal and settles the refit.
            f.procs.spawn("control", &work, &args)?;
            f.client = connect(&f.control, Duration::from_secs(30)).await?;
            let r = wait_end(&f.client, id, Duration::from_secs(300)).await?;
            print_refit(&r);
            let ok = r.outcome == Some(expect) && on(&r, label, f) && r.recovered;
            for w in WORKERS {
                wait_connected(f, w).await?;
            }
            Ok((
                format!("{expect} after restart, all on {label}"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "publisher_killed_mid_pull" => {
            f.ensure("step-1").await?;
            for w in WORKERS {
                f.failpoints(w, json!({"stage.sleep_between_sources_ms": 1500}))
                    .await?;
            }
            let id = f.client.refit(&f.spec("step-2")?).await?;
            // Kill source slot 1 while the workers sleep after pulling slot 0's bytes.
            tokio::time::sleep(Duration::from_millis(700)).await;
            f.procs.kill("publisher-1")?;
            let r = wait_end(&f.client, id, Duration::from_secs(300)).await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::Aborted) && on(&r, "step-1", f);
            // Bring the source back: it republishes the same bytes (same digest).
            let old = agent_of(f, 1).await?;
            let a = f.publisher_args(1, 1, 2);
            let work = f.work.clone();
            f.procs.spawn("publisher-1", &work, &a)?;
            let t = Instant::now();
            while agent_of(f, 1).await? == old {
                if t.elapsed() > Duration::from_secs(300) {
                    bail!("publisher-1 did not republish step-2");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok((
                s("ABORTED at STAGE, all on step-1"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "missing_worker" => {
            f.ensure("step-1").await?;
            f.procs.kill("worker-w1")?;
            wait_disconnected(f, "w1").await?;
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::Aborted)
                && r.reason.contains("w1")
                && r.workers
                    .get("w0")
                    .is_some_and(|w| holds(&w.resident, &f.versions["step-1"].0));
            Ok((
                s("ABORTED (missing w1), w0 stays on step-1"),
                outcome_str(&r),
                ok,
                r.reason.clone(),
            ))
        }
        "missing_worker_allowed" => {
            // The orchestrator explicitly accepts a smaller set: w1 is down (killed by
            // missing_worker, or here).
            if f.procs.pid("worker-w1").is_some() {
                f.procs.kill("worker-w1")?;
            }
            wait_disconnected(f, "w1").await?;
            let mut spec = f.spec("step-2")?;
            spec.allow_partial = true;
            let id = f.client.refit(&spec).await?;
            let r = wait_end(&f.client, id, Duration::from_secs(600)).await?;
            print_refit(&r);
            let ok = r.outcome == Some(Outcome::Committed)
                && r.dropped.iter().any(|(w, _)| w == "w1")
                && r.workers.keys().eq(["w0"].iter())
                && on(&r, "step-2", f);
            Ok((
                s("COMMITTED on w0 only (w1 dropped), w0 on step-2"),
                format!(
                    "{}, dropped {:?}",
                    outcome_str(&r),
                    r.dropped.iter().map(|d| &d.0).collect::<Vec<_>>()
                ),
                ok,
                r.reason.clone(),
            ))
        }
        "stale_worker_rejoins" => {
            if f.procs.pid("worker-w1").is_some() {
                f.procs.kill("worker-w1")?;
            }
            let a = f.worker_args("w1", true);
            let work = f.work.clone();
            f.procs.spawn("worker-w1", &work, &a)?;
            wait_connected(f, "w1").await?;
            let st = f.status().await?;
            let w1 = st
                .workers
                .iter()
                .find(|w| w.worker_id == "w1")
                .context("w1")?;
            let gated = !w1.admitted && w1.admission.contains("stale");
            let admission = w1.admission.clone();
            let r = f.refit("step-2").await?;
            print_refit(&r);
            let st = f.status().await?;
            let admitted = st.workers.iter().all(|w| w.admitted);
            let ok =
                gated && r.outcome == Some(Outcome::Committed) && admitted && on(&r, "step-2", f);
            Ok((
                s("not admitted until refitted; then COMMITTED on step-2"),
                format!("gated: {gated} ({admission}); refit {}", outcome_str(&r)),
                ok,
                r.reason.clone(),
            ))
        }
        "verify_only_check_fails" => restarts::verify_only_check_fails(f).await,
        "empty_worker_in_a_failed_refit" => restarts::empty_worker_in_a_failed_refit(f).await,
        "worker_restarted_during_apply" => restarts::worker_restarted_during_apply(f).await,
        "engine_changed_behind_the_control_plane" => restarts::engine_changed(f).await,
        "worker_restarted_during_prepare" => restarts::worker_restarted_during_prepare(f).await,
        other => bail!("unknown scenario {other}"),
    }
}

async fn agent_of(f: &Fleet, slot: u32) -> anyhow::Result<String> {
    let info = f.client.get_version("step-2").await?;
    Ok(info
        .manifests
        .iter()
        .find(|m| m.slot == slot)
        .map(|m| m.agent_name.clone())
        .unwrap_or_default())
}

async fn is_connected(f: &Fleet, id: &str) -> anyhow::Result<bool> {
    let st = f.status().await?;
    Ok(st.workers.iter().any(|w| w.worker_id == id && w.connected))
}

async fn wait_disconnected(f: &Fleet, id: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    while is_connected(f, id).await? {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("the control plane still sees {id} connected");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn wait_connected(f: &Fleet, id: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    while !is_connected(f, id).await.unwrap_or(false) {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("worker {id} did not (re)connect");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn print_table(f: &Fleet, rows: &[ScenarioReport]) {
    let short = |v: &str| {
        f.versions
            .iter()
            .find(|(_, (id, _))| id == v)
            .map(|(l, _)| l.clone())
            .unwrap_or_else(|| v.chars().take(20).collect())
    };
    // Columns as wide as their longest entry: nothing is cut off.
    let width = |head: &str, cell: &dyn Fn(&ScenarioReport) -> usize| {
        rows.iter().map(cell).max().unwrap_or(0).max(head.len())
    };
    let wn = width("scenario", &|r| r.name.chars().count());
    let wo = width("observed", &|r| r.observed.chars().count());
    let we = width("expected", &|r| r.expected.chars().count());
    println!(
        "\n{:<wn$} {:<6} {:<wo$} {:<we$} {:<24} {:<10} {:<8}",
        "scenario",
        "result",
        "observed",
        "expected",
        "versions after (w0 w1)",
        "consistent",
        "journal"
    );
    for r in rows {
        let v: Vec<String> = r.versions_after.values().map(|x| short(x)).collect();
        println!(
            "{:<wn$} {:<6} {:<wo$} {:<we$} {:<24} {:<10} {:<8}",
            r.name,
            if r.passed { "PASS" } else { "FAIL" },
            r.observed,
            r.expected,
            v.join(" "),
            r.fleet_consistent,
            if r.journal_complete {
                "complete"
            } else {
                "GAPS"
            }
        );
    }
}

/// A refit's outcome as the rows print it (`OPEN` while it has none).
fn outcome_str(r: &Refit) -> String {
    r.outcome.map_or_else(|| s("OPEN"), |o| o.to_string())
}
