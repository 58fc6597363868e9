//! The planner's cost model, measured once per puller: the data plane's per-descriptor cost and
//! wire bandwidth against a real source, and the local cost of one staged segment.

use std::time::Instant;

use mx_layout::plan::CostModel;
use mx_layout::{Digest, SourceManifest};
use mx_nixl::{Agent, Arena};

/// Measures the cost model against the largest shard of `manifests` through `agent`; falls
/// back to the reference numbers ([`CostModel::default`]) when the probe cannot run (tiny
/// models, a source that does not answer: staging then reports the real error).
pub(crate) fn measure(agent: &Agent, manifests: &[SourceManifest]) -> CostModel {
    let Some((m, shard)) = manifests
        .iter()
        .flat_map(|m| m.shards.iter().map(move |s| (m, s)))
        .max_by_key(|(_, s)| s.len)
    else {
        return CostModel::default();
    };
    let Ok(remote) = agent.load_remote(&m.agent_metadata) else {
        return CostModel::default();
    };
    let scratch_len = shard.len.min(64 << 20);
    let Ok(mut scratch) = Arena::new(agent, scratch_len.max(1)) else {
        return CostModel::default();
    };
    match mx_nixl::probe_costs(agent, &remote, shard.addr, shard.len, &mut scratch) {
        Ok(c) => {
            tracing::info!(
                per_descriptor_us = c.per_descriptor_s * 1e6,
                wire_gbps = c.wire_gbps,
                "measured data-plane costs"
            );
            CostModel {
                per_descriptor_s: c.per_descriptor_s,
                wire_gbps: c.wire_gbps,
                per_segment_s: segment_cost(),
            }
        }
        Err(e) => {
            tracing::warn!("cost probe failed ({e}); using reference costs");
            CostModel::default()
        }
    }
}

/// Local cost of one staged segment (seconds): verifying and applying 4096 segments of 384
/// bytes against one contiguous 1.5 MiB piece, the difference per segment (median of 5, >= 0).
pub(crate) fn segment_cost() -> f64 {
    const N: usize = 4096;
    const SEG: usize = 384;
    let src: Vec<u8> = (0..N * SEG).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; N * SEG];
    let mut diffs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let d1 = mx_layout::digest_segments(src.chunks(SEG));
        for (o, i) in dst.chunks_mut(SEG).zip(src.chunks(SEG)) {
            o.copy_from_slice(i);
        }
        let strided = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let d2 = Digest::of(&src);
        dst.copy_from_slice(&src);
        let whole = t.elapsed().as_secs_f64();
        if d1 == d2 {
            diffs.push(((strided - whole) / N as f64).max(0.0));
        }
    }
    diffs.sort_by(f64::total_cmp);
    let per = diffs.get(diffs.len() / 2).copied().unwrap_or(5e-8);
    tracing::info!(
        per_segment_ns = per * 1e9,
        "measured local per-segment cost"
    );
    per
}
