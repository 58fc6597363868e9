//! `mx-lab bench plan`: the planner at frontier scale (DeepSeek-V3, Kimi-K2; 256 trainer ranks with
//! EP=64 and FSDP over the rest, 16 inference instances of TP=8 with EP=8), and the projection of
//! a Kimi-K2 refit onto real hardware from the planner's per-NIC bytes.

use std::path::PathBuf;

use mx_layout::frontier::{fleet_plan_report, FleetPlanReport, FrontierModel, FrontierTrainer};
use mx_layout::{LayoutSpec, Scheme};
use serde::Serialize;

/// `mx-lab bench plan` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// Trainer ranks.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub trainer_ranks: u32,
    /// Trainer expert parallelism (experts of an EP group are FSDP-sharded over its ranks).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub trainer_ep: u32,
    /// A Megatron-Core trainer instead of torchtitan FSDP2 + EP: `megatron:tp=T,pp=P,ep=E`
    /// (`--trainer-ranks` and `--trainer-ep` are then unused).
    #[arg(long, value_parser = parse_megatron)]
    pub trainer_layout: Option<FrontierTrainer>,
    /// Inference tensor parallelism per instance.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub tp: u32,
    /// Inference expert parallelism per instance.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub ep: u32,
    /// Inference instances.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub instances: u32,
    /// Only Kimi-K2 (skip DeepSeek-V3), for a quick run.
    #[arg(long)]
    pub quick: bool,
    /// NIC line rate per GPU, Gb/s (8 x 400 Gb/s per 8-GPU node).
    #[arg(long, default_value_t = 400.0)]
    pub nic_gbit: f64,
    /// Fraction of line rate one-sided RDMA READs of large messages reach.
    #[arg(long, default_value_t = 0.9)]
    pub rdma_efficiency: f64,
    /// Fixed cost per READ descriptor on an RDMA NIC (seconds), for the projection.
    #[arg(long, default_value_t = 1e-6)]
    pub rdma_per_descriptor_s: f64,
    /// Commit round of the fleet (ms), for the projection (default: measured by `mx-lab bench
    /// control` at 1,000 simulated workers on the reference machine; `mx-lab bench all` passes its
    /// own measurement).
    #[arg(long, default_value_t = 300.0)]
    pub commit_ms: f64,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `megatron:tp=T,pp=P,ep=E` as a frontier trainer.
fn parse_megatron(s: &str) -> Result<FrontierTrainer, String> {
    let l: LayoutSpec = s.parse().map_err(|e: mx_layout::Error| e.to_string())?;
    match l.scheme {
        Scheme::Megatron(d) => Ok(FrontierTrainer::Megatron {
            tp: d.tp,
            pp: d.pp,
            ep: d.ep,
        }),
        _ => Err(format!("{s}: expected megatron:tp=T,pp=P,ep=E")),
    }
}

/// The projection of one refit onto real hardware, for one weight format.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Projection {
    format: String,
    /// Largest bytes one inference GPU receives.
    max_gpu_ingress_bytes: u64,
    /// Largest bytes one trainer GPU sends (all instances pull from the trainer).
    max_trainer_egress_bytes: u64,
    /// Line-rate lower bound: the busiest NIC's bytes / line rate (s).
    line_rate_bound_s: f64,
    /// Which side bounds it.
    bound_by: String,
    /// mx projected: bytes at `rdma_efficiency` x line rate + the slowest rank's descriptors x
    /// per-descriptor cost + the commit round (planning is done before the safe point) (s).
    mx_projected_s: f64,
}

/// The result of `mx-lab bench plan`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PlanReport {
    models: Vec<FleetPlanReport>,
    /// Peak resident memory of this process while planning (bytes, `VmHWM`).
    peak_rss_bytes: u64,
    /// Kimi-K2: the slowest destination rank's plan (ms).
    pub(crate) plan_ms_per_worker_kimi_k2: f64,
    projection: Vec<Projection>,
    assumptions: Vec<String>,
    /// Published numbers the projection is set beside.
    published: Vec<(String, f64)>,
}

fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Runs `mx-lab bench plan` on the calling thread.
pub(crate) fn run(a: &PlanArgs) -> anyhow::Result<PlanReport> {
    let mut models = vec![FrontierModel::kimi_k2()];
    if !a.quick {
        models.push(FrontierModel::deepseek_v3());
    }
    let mut reports = Vec::new();
    for m in &models {
        eprintln!("planning {} ...", m.name);
        let trainer = a.trainer_layout.unwrap_or(FrontierTrainer::Fsdp {
            world: a.trainer_ranks,
            ep: a.trainer_ep,
        });
        reports.push(fleet_plan_report(m, trainer, a.tp, a.ep, a.instances)?);
    }
    let kimi = &reports[0];
    let line = a.nic_gbit / 8.0 * 1e9; // bytes per second per NIC
    let eff = a.rdma_efficiency.clamp(0.01, 1.0);
    let descriptors_s = kimi.max_reads as f64 * a.rdma_per_descriptor_s;
    let project = |format: &str, ingress: u64, egress: u64| {
        let (busiest, by) = if ingress >= egress {
            (ingress, "inference GPU ingress")
        } else {
            (egress, "trainer GPU egress")
        };
        let bound = busiest as f64 / line;
        Projection {
            format: format.into(),
            max_gpu_ingress_bytes: ingress,
            max_trainer_egress_bytes: egress,
            line_rate_bound_s: bound,
            bound_by: by.into(),
            mx_projected_s: bound / eff + descriptors_s + a.commit_ms / 1e3,
        }
    };
    let projection = vec![
        project(
            "BF16",
            kimi.max_rank_bytes_bf16,
            kimi.max_trainer_egress_bf16,
        ),
        project(
            "FP8 (e4m3, 128x128 block scales)",
            kimi.max_rank_bytes_fp8,
            kimi.max_trainer_egress_fp8,
        ),
    ];
    let assumptions = vec![
        format!(
            "Kimi-K2 ({} params), trainer {} GPUs ({}), inference {} instances x {} GPUs ({})",
            kimi.params, a.trainer_ranks, kimi.trainer, a.instances, a.tp, kimi.inference
        ),
        format!(
            "one {} Gb/s NIC per GPU (8 x 400 Gb/s per 8-GPU node) on both sides; full-bisection fabric",
            a.nic_gbit
        ),
        "every instance pulls from the trainer GPUs directly (no relay through instances that already hold the version)".into(),
        format!(
            "RDMA READs of large messages at {:.0}% of line rate; {:.1} us per READ descriptor, the slowest rank's {} descriptors posted serially",
            eff * 100.0,
            a.rdma_per_descriptor_s * 1e6,
            kimi.max_reads
        ),
        format!(
            "the commit round of the fleet: {:.0} ms (measured by mx-lab bench control at 1,000 simulated workers on the 2-core reference machine)",
            a.commit_ms
        ),
        "plans are made before the safe point (the planner is not on the critical path; its time is reported above)".into(),
        "verification is not on the critical path: the digest of each region is checked as it lands, overlapped with the next source's pull (as mx worker does on CPU; GPU-side hashing of VRAM staging is not built yet)".into(),
        "FP8: every 2-D linear weight except embeddings, lm_head and the router is 1 byte/element plus an F32 scale per 128x128 block, converted on the trainer side before publishing (as Perplexity's BF16-to-FP8 setup does); BF16 Kimi-K2 does not fit 8 H200s (the BF16 row is bytes only)".into(),
    ];
    let report = PlanReport {
        plan_ms_per_worker_kimi_k2: kimi.slowest_rank_ms,
        peak_rss_bytes: peak_rss_bytes(),
        models: reports,
        projection,
        assumptions,
        published: vec![
            (
                "Perplexity transfer engine, Kimi-K2, 256 BF16 training GPUs -> 128 FP8 inference GPUs (s)".into(),
                1.3,
            ),
            (
                "checkpoint-engine, Kimi-K2 FP8, 256 H20, TP16 (s)".into(),
                16.0,
            ),
        ],
    };
    print_report(&report);
    Ok(report)
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn print_report(r: &PlanReport) {
    println!("\nplanner at frontier scale (one core, wall time; manifests synthesized from the published configs)");
    println!(
        "{:<12} {:>9} {:>9} {:>10} {:>9} {:>11} {:>10} {:>9} {:>11} {:>11} {:>11}",
        "model",
        "shards",
        "pieces",
        "manif. s",
        "index s",
        "slowest ms",
        "median ms",
        "fleet s",
        "all-ranks s",
        "reads/rank",
        "copies/rank"
    );
    for m in &r.models {
        println!(
            "{:<12} {:>9} {:>9} {:>10.2} {:>9.2} {:>11.1} {:>10.1} {:>9.2} {:>11.2} {:>11} {:>11}",
            m.model,
            m.shards,
            m.pieces,
            m.manifest_seconds,
            m.index_seconds,
            m.slowest_rank_ms,
            m.median_rank_ms,
            m.whole_fleet_seconds,
            m.projected_all_ranks_seconds,
            m.max_reads,
            m.max_copies
        );
    }
    println!(
        "peak RSS {:.2} GB; Kimi-K2 slowest destination rank {:.1} ms (target < 50 ms)",
        gb(r.peak_rss_bytes),
        r.plan_ms_per_worker_kimi_k2
    );
    for m in &r.models {
        println!(
            "{}: the slowest rank's plan holds {:.1} MB; writing that much fresh memory takes {:.1} ms here (same run)",
            m.model,
            m.slowest_rank_plan_bytes as f64 / 1e6,
            m.slowest_rank_fresh_memory_ms
        );
        println!(
            "{}: a worker's first stage indexes its own rank's pieces in {:.1} ms (all pieces: {:.1} ms); the next version from the same arenas: geometry check {:.1} ms (plan kept)",
            m.model,
            m.own_rank_index_seconds * 1e3,
            m.index_seconds * 1e3,
            m.geometry_seconds * 1e3
        );
    }
    println!("\nprojection: Kimi-K2 refit on real hardware");
    println!(
        "{:<34} {:>14} {:>16} {:>14} {:>24} {:>12}",
        "format", "GPU ingress GB", "trainer egress GB", "line rate s", "bound by", "mx proj. s"
    );
    for p in &r.projection {
        println!(
            "{:<34} {:>14.1} {:>16.1} {:>14.2} {:>24} {:>12.2}",
            p.format,
            gb(p.max_gpu_ingress_bytes),
            gb(p.max_trainer_egress_bytes),
            p.line_rate_bound_s,
            p.bound_by,
            p.mx_projected_s
        );
    }
    for (what, s) in &r.published {
        println!("  published: {what}: {s}");
    }
    for a in &r.assumptions {
        println!("  assumption: {a}");
    }
}
