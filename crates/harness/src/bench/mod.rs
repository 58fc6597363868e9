//! `mx-lab bench`: the numbers behind mx's claims, measured side by side in one run (see
//! BENCHMARKS.md). Each part prints a table; `mx-lab bench all --report PATH` runs them all and
//! writes one JSON report.

pub mod control;
pub mod disk;
pub mod plan;
pub mod pull;
pub mod sources;

use std::path::PathBuf;
use std::time::Instant;

use clap::Subcommand;
use serde::Serialize;

/// `mx-lab bench` parts.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Every part below, then one JSON report (quick by default: about 35 s of measuring here).
    All(AllArgs),
    /// NIXL pull bandwidth against a memcpy of the same bytes, with the knobs that move it.
    Pull(pull::PullArgs),
    /// End to end against the disk path (write a checkpoint, update_weights_from_disk).
    Disk(disk::DiskArgs),
    /// The planner at DeepSeek-V3 / Kimi-K2 scale, and a Kimi-K2 refit projected onto real
    /// hardware.
    Plan(plan::PlanArgs),
    /// One rank staging the same version from each source: trainer ranks, a peer, the canonical
    /// artifact, the XOR delta.
    Sources(sources::SourcesArgs),
    /// Control plane at fleet scale: simulated workers doing stage/commit rounds over loopback.
    Control(control::ControlArgs),
    /// One process of simulated workers (started by `mx-lab bench control`).
    #[command(hide = true)]
    SimWorkers(control::SimArgs),
}

/// `mx-lab bench all` arguments.
#[derive(clap::Args, Debug)]
pub struct AllArgs {
    /// Write the combined JSON report here.
    #[arg(long)]
    report: PathBuf,
    /// More repetitions, every pull variant, DeepSeek-V3 too.
    #[arg(long)]
    full: bool,
    /// HF checkpoint directory for the pull and disk parts (default: SmolLM2 from setup.sh).
    #[arg(long)]
    model: Option<PathBuf>,
}

/// What this machine is, for the report.
#[derive(Debug, Serialize)]
struct Machine {
    cpu: String,
    cores: usize,
    memory_gib: f64,
    kernel: String,
    transparent_hugepages: String,
}

fn machine() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(String::new, |(_, v)| v.trim().to_string());
    let mem_kb: f64 = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        memory_gib: mem_kb / (1024.0 * 1024.0),
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        transparent_hugepages: read("/sys/kernel/mm/transparent_hugepage/enabled")
            .trim()
            .to_string(),
    }
}

/// The combined report of `mx-lab bench all`.
#[derive(Debug, Serialize)]
struct AllReport {
    /// Pull of the inference layout against memcpy of the same bytes (same run).
    pull_vs_memcpy: f64,
    /// Disk-path time / mx time, end to end (same run, alternating).
    refit_vs_disk_speedup: f64,
    /// Kimi-K2: the slowest destination rank's plan, one core (ms).
    plan_ms_per_worker_kimi_k2: f64,
    /// Commit round of 1,000 simulated workers (ms, median), as issue 4 defines it: from the
    /// orchestrator's refit request until every worker acknowledged APPLIED and the COMMIT
    /// decision is durable (orchestrator-gated: the orchestrator holds the safe point; each APPLY
    /// answer names the resident version, so there is no separate read-back).
    commit_ms_1000_workers: f64,
    /// The full lifecycle: pause, apply, read back, resume every worker, then COMMIT.
    commit_ms_1000_workers_full_lifecycle: f64,
    /// Orchestrator-gated with a separate read-back call per worker (apply, read back, COMMIT).
    commit_ms_1000_workers_orchestrator_gated: f64,
    /// The round of `commit_ms_1000_workers` on 10,000 simulated workers (ms, median), bearer
    /// tokens checked on every RPC; its report has the control plane's memory and the journal
    /// bytes per commit.
    commit_ms_10000_workers: f64,
    quick: bool,
    seconds: f64,
    machine: Machine,
    pull: pull::PullReport,
    disk: disk::DiskReport,
    plan: plan::PlanReport,
    control: control::ControlReport,
    control_full_lifecycle: control::ControlReport,
    control_orchestrator_gated: control::ControlReport,
    control_10000_workers: control::ControlReport,
    /// One rank staging one version from each source (trainer, peer, canonical, delta).
    sources: sources::SourcesReport,
}

fn write_json(path: &Option<PathBuf>, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(p) = path {
        mx_cli::report::write_report(p, value)?;
        eprintln!("report written to {}", p.display());
    }
    Ok(())
}

/// Runs one `mx-lab bench` part.
pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cmd {
        BenchCmd::All(a) => {
            let t = Instant::now();
            let quick = !a.full;
            // The full lifecycle; orchestrator-gated (no pause/resume calls); and gated with the
            // resident versions taken from the APPLY answers (the round as issue 4 defines it).
            let mut controls = Vec::new();
            for (gated, from_apply) in [(false, false), (true, false), (true, true)] {
                eprintln!(
                    "[1/5] control plane, 1,000 simulated workers, orchestrator-gated: {gated}, versions from APPLY answers: {from_apply}"
                );
                controls.push(rt.block_on(control::run(&control::ControlArgs {
                    workers: 1000,
                    procs: 2,
                    rounds: if quick { 4 } else { 8 },
                    apply_parallelism: 0,
                    orchestrator_gated: gated,
                    verify_from_apply_answer: from_apply,
                    // The rollback of the whole set, measured once, in the full lifecycle.
                    rollback: !gated,
                    refit_detail: None,
                    keep: false,
                    json: None,
                }))?);
            }
            let (Some(control_lean), Some(control_gated), Some(control)) =
                (controls.pop(), controls.pop(), controls.pop())
            else {
                anyhow::bail!("control plane benchmark produced no report");
            };
            eprintln!("[1/5] control plane, 10,000 simulated workers, the same round");
            let control_10k = rt.block_on(control::run(&control::ControlArgs {
                workers: 10_000,
                procs: 4,
                rounds: if quick { 4 } else { 6 },
                apply_parallelism: 0,
                orchestrator_gated: true,
                verify_from_apply_answer: true,
                rollback: false,
                refit_detail: None,
                keep: false,
                json: None,
            }))?;
            eprintln!("[2/5] planner at frontier scale and the hardware projection");
            let plan = plan::run(&plan::PlanArgs {
                trainer_ranks: 256,
                trainer_ep: 64,
                trainer_layout: None,
                tp: 8,
                ep: 8,
                instances: 16,
                quick,
                nic_gbit: 400.0,
                rdma_efficiency: 0.9,
                rdma_per_descriptor_s: 1e-6,
                commit_ms: control.commit_ms,
                json: None,
            })?;
            eprintln!("[3/5] pull vs memcpy");
            let pull = rt.block_on(pull::run(&pull::PullArgs {
                model: a.model.clone(),
                trainer_layout: "fsdp:4".parse()?,
                inference_layout: "tp:3".parse()?,
                reps: if quick { 5 } else { 9 },
                quick,
                keep: false,
                json: None,
            }))?;
            eprintln!("[4/5] refit vs the disk path");
            let disk = rt.block_on(disk::run(&disk::DiskArgs {
                model: a.model.clone(),
                reps: if quick { 3 } else { 7 },
                keep: false,
                json: None,
            }))?;
            eprintln!("[5/5] one rank staging from each source");
            let sources = rt.block_on(sources::run(&sources::SourcesArgs {
                model: a.model.clone(),
                reps: if quick { 3 } else { 5 },
                keep: false,
                json: None,
            }))?;
            let report = AllReport {
                pull_vs_memcpy: pull.pull_vs_memcpy,
                refit_vs_disk_speedup: disk.refit_vs_disk_speedup,
                plan_ms_per_worker_kimi_k2: plan.plan_ms_per_worker_kimi_k2,
                commit_ms_1000_workers: control_lean.commit_ms,
                commit_ms_1000_workers_full_lifecycle: control.commit_ms,
                commit_ms_1000_workers_orchestrator_gated: control_gated.commit_ms,
                commit_ms_10000_workers: control_10k.commit_ms,
                quick,
                seconds: t.elapsed().as_secs_f64(),
                machine: machine(),
                pull,
                disk,
                plan,
                control: control_lean,
                control_full_lifecycle: control,
                control_orchestrator_gated: control_gated,
                control_10000_workers: control_10k,
                sources,
            };
            println!(
                "\nsummary: pull_vs_memcpy {:.2}, refit_vs_disk_speedup {:.2}, plan_ms_per_worker_kimi_k2 {:.1}, commit_ms_1000_workers {:.1} (full lifecycle {:.1}, gated with read-back {:.1}), commit_ms_10000_workers {:.1} ({:.0} s)",
                report.pull_vs_memcpy,
                report.refit_vs_disk_speedup,
                report.plan_ms_per_worker_kimi_k2,
                report.commit_ms_1000_workers,
                report.commit_ms_1000_workers_full_lifecycle,
                report.commit_ms_1000_workers_orchestrator_gated,
                report.commit_ms_10000_workers,
                report.seconds
            );
            write_json(&Some(a.report), &report)
        }
        BenchCmd::Control(a) => {
            let r = rt.block_on(control::run(&a))?;
            write_json(&a.json, &r)
        }
        BenchCmd::Pull(a) => {
            let r = rt.block_on(pull::run(&a))?;
            write_json(&a.json, &r)
        }
        BenchCmd::Disk(a) => {
            let r = rt.block_on(disk::run(&a))?;
            write_json(&a.json, &r)
        }
        BenchCmd::Sources(a) => {
            let r = rt.block_on(sources::run(&a))?;
            write_json(&a.json, &r)
        }
        BenchCmd::Plan(a) => {
            let r = plan::run(&a)?;
            write_json(&a.json, &r)
        }
        BenchCmd::SimWorkers(a) => rt.block_on(control::sim_workers(a)),
    }
}
