//! Planner at frontier scale: one `SourceIndex::plan` for the slowest destination rank of one
//! vLLM `tp:8` instance (expert parallel 8) refitted from a 256-rank trainer (FSDP over 256,
//! experts EP=64), for Kimi-K2 (1.04T) and DeepSeek-V3 (671B). The manifests and the index are
//! built once per model, outside the timed loop (about 15 s and 1.5 GB for Kimi-K2).
//!
//! `cargo bench --bench planner -- --quick`
#![allow(clippy::expect_used, clippy::unwrap_used, missing_docs)] // bench: panics are failures

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use mx_layout::frontier::FrontierModel;
use mx_layout::plan::{CostModel, SourceIndex};

fn bench_model(c: &mut Criterion, model: &FrontierModel) {
    let trainer = model.trainer_layouts(256, 64).expect("trainer layout");
    let dest = model.inference_layouts(8, 8).expect("inference layout");
    let manifests = model.manifests(&trainer, &dest).expect("manifests");
    drop(trainer);
    let index = SourceIndex::new(&manifests).expect("index");
    let cost = CostModel::default();
    // The slowest rank, from one plan of each.
    let (slowest, _) = dest
        .iter()
        .enumerate()
        .map(|(r, rl)| {
            let t = Instant::now();
            let p = index.plan(std::slice::from_ref(rl), &cost).expect("plan");
            let el = t.elapsed();
            drop(p);
            (r, el)
        })
        .max_by_key(|&(_, el)| el)
        .expect("ranks");
    let rl = &dest[slowest];
    let mut g = c.benchmark_group(model.name.as_str());
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    g.bench_function(
        format!("plan tp:8 ep=8 rank {slowest} from fsdp:256 ep=64"),
        |b| b.iter(|| index.plan(std::slice::from_ref(rl), &cost).expect("plan")),
    );
    g.finish();
}

fn planner(c: &mut Criterion) {
    bench_model(c, &FrontierModel::kimi_k2());
    bench_model(c, &FrontierModel::deepseek_v3());
}

criterion_group!(benches, planner);
criterion_main!(benches);
