//! `mx plan`: the transfer plan for one worker, computed offline from a checkpoint's config and
//! tensor list (no NIXL, no processes): which strategy every tensor gets, descriptors, bytes.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mx_checkpoint::Checkpoint;
use mx_layout::plan::{plan, synthetic_manifests, CostModel};
use mx_layout::LayoutSpec;
use serde::Serialize;

/// Flags of `mx plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// HF checkpoint directory (only config.json and the safetensors headers are read).
    #[arg(long)]
    model: PathBuf,
    /// Trainer (source) layout: fsdp:N, replicated:N, tp:N, tp-ep:N or megatron:tp=T,pp=P,ep=E
    /// (Megatron-Core's ranks and names).
    #[arg(long, default_value = "fsdp:4")]
    trainer_layout: LayoutSpec,
    /// Inference (destination) layout: tp:N (vLLM tensor parallel), tp-ep:N (with
    /// --enable-expert-parallel), fsdp:N or replicated:N.
    #[arg(long, default_value = "tp:3")]
    inference_layout: LayoutSpec,
    /// Ranks the worker holds (default: all).
    #[arg(long, value_delimiter = ',')]
    ranks: Vec<u32>,
    /// Per-descriptor cost in microseconds (default: the reference measurement, 2.5).
    #[arg(long)]
    per_descriptor_us: Option<f64>,
    /// Wire bandwidth in GB/s (default: 10.5).
    #[arg(long)]
    wire_gbps: Option<f64>,
    /// Local cost per staged segment in nanoseconds (default: 50).
    #[arg(long)]
    per_segment_ns: Option<f64>,
    /// Plan as if the publishers packed nothing.
    #[arg(long)]
    no_pack: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct TensorRow {
    tensor: String,
    strategies: BTreeMap<String, u64>,
    descriptors: u64,
    wire_bytes: u64,
}

#[derive(Serialize)]
struct PlanReport {
    trainer_layout: String,
    inference_layout: String,
    ranks: Vec<u32>,
    cost: CostModel,
    reads: usize,
    wire_bytes: u64,
    useful_bytes: u64,
    staging_bytes: u64,
    apply_copies: usize,
    verify_items: usize,
    predicted_seconds: f64,
    tensors: Vec<TensorRow>,
}

pub(crate) fn run(a: PlanArgs) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(&a.model)?;
    let model = ckpt.model_info(&[a.trainer_layout, a.inference_layout])?;
    let ranks: Vec<u32> = if a.ranks.is_empty() {
        (0..a.inference_layout.world_size).collect()
    } else {
        a.ranks.clone()
    };
    let mut seen = std::collections::BTreeSet::new();
    for r in &ranks {
        anyhow::ensure!(seen.insert(*r), "rank {r} is listed twice in --ranks");
    }
    if let Some(us) = a.per_descriptor_us {
        anyhow::ensure!(
            us.is_finite() && us >= 0.0,
            "--per-descriptor-us must be a finite number >= 0, got {us}"
        );
    }
    if let Some(g) = a.wire_gbps {
        anyhow::ensure!(
            g.is_finite() && g > 0.0,
            "--wire-gbps must be a finite number > 0, got {g}"
        );
    }
    if let Some(ns) = a.per_segment_ns {
        anyhow::ensure!(
            ns.is_finite() && ns >= 0.0,
            "--per-segment-ns must be a finite number >= 0, got {ns}"
        );
    }
    let mut cost = CostModel::default();
    if let Some(ns) = a.per_segment_ns {
        cost.per_segment_s = ns * 1e-9;
    }
    if let Some(us) = a.per_descriptor_us {
        cost.per_descriptor_s = us * 1e-6;
    }
    if let Some(g) = a.wire_gbps {
        cost.wire_gbps = g;
    }
    let manifests = synthetic_manifests(
        &model,
        a.trainer_layout,
        a.inference_layout,
        if a.no_pack {
            &[]
        } else {
            std::slice::from_ref(&ranks)
        },
    )?;
    let dest = ranks
        .iter()
        .map(|&r| {
            anyhow::ensure!(
                r < a.inference_layout.world_size,
                "rank {r} is outside {}",
                a.inference_layout
            );
            Ok(mx_layout::rank_layout(&model, a.inference_layout, r)?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let p = plan(&dest, &manifests, &cost)?;
    let mut rows: BTreeMap<String, TensorRow> = BTreeMap::new();
    for c in &p.choices {
        let name = p.tensor_name(c.tensor);
        let row = rows.entry(name.to_string()).or_insert_with(|| TensorRow {
            tensor: name.to_string(),
            strategies: BTreeMap::new(),
            descriptors: 0,
            wire_bytes: 0,
        });
        *row.strategies
            .entry(c.strategy.as_str().to_string())
            .or_insert(0) += 1;
        row.descriptors += c.descriptors;
        row.wire_bytes += c.wire_bytes;
    }
    let report = PlanReport {
        trainer_layout: a.trainer_layout.to_string(),
        inference_layout: a.inference_layout.to_string(),
        ranks,
        cost,
        reads: p.reads.len(),
        wire_bytes: p.wire_bytes,
        useful_bytes: p.useful_bytes,
        staging_bytes: p.staging_bytes,
        apply_copies: p.copies.len(),
        verify_items: p.verify.len(),
        predicted_seconds: p.predicted_seconds,
        tensors: rows.into_values().collect(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<52} {:<24} {:>11} {:>12}",
        "tensor", "strategy (per source)", "descriptors", "wire bytes"
    );
    for r in &report.tensors {
        let s: Vec<String> = r
            .strategies
            .iter()
            .map(|(k, n)| format!("{k}x{n}"))
            .collect();
        println!(
            "{:<52} {:<24} {:>11} {:>12}",
            r.tensor,
            s.join(" "),
            r.descriptors,
            r.wire_bytes
        );
    }
    println!(
        "\n{} -> {} ranks {:?}: {} reads after coalescing, {} wire bytes for {} useful, {} apply copies, {} digest checks; predicted {:.2} ms at {:.2} us/descriptor, {:.1} GB/s",
        report.trainer_layout,
        report.inference_layout,
        report.ranks,
        report.reads,
        report.wire_bytes,
        report.useful_bytes,
        report.apply_copies,
        report.verify_items,
        report.predicted_seconds * 1e3,
        cost.per_descriptor_s * 1e6,
        cost.wire_gbps
    );
    Ok(())
}
