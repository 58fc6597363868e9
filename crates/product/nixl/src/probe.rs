//! Measuring what a READ costs ([`probe_costs`]) and what a local copy costs ([`memcpy_gbps`]).

use std::time::Instant;

use crate::agent::Agent;
use crate::arena::{Arena, HugeMap};
use crate::read::{ReadOp, ReadOptions};
use crate::Error;

/// Time of a READ as `descriptors * per_descriptor_s + bytes / (wire_gbps * 1e9)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one descriptor, seconds (> 0).
    pub per_descriptor_s: f64,
    /// Streaming bandwidth, GB/s (1e9 bytes per second, > 0).
    pub wire_gbps: f64,
}

impl CostModel {
    /// Predicted seconds for `descriptors` descriptors moving `bytes` bytes in all.
    pub fn seconds(&self, descriptors: u64, bytes: u64) -> f64 {
        descriptors as f64 * self.per_descriptor_s + bytes as f64 / (self.wire_gbps * 1e9)
    }

    /// Run length at which per-descriptor overhead equals streaming time, bytes.
    pub fn break_even_bytes(&self) -> f64 {
        self.per_descriptor_s * self.wire_gbps * 1e9
    }
}

/// Small reads the probe times: 512 of 4 KiB each (fewer when the region is small).
const SMALL_LEN: u64 = 4096;
const SMALL_COUNT: u64 = 512;
/// The contiguous read: up to 64 MiB.
const BIG_MAX: u64 = 64 << 20;
const REPEATS: usize = 5;

/// Measures per-descriptor cost and bandwidth of READs from `remote` (already loaded into
/// `agent`), reading `[remote_addr, remote_addr + remote_len)` of its registered memory into
/// `scratch` (whose contents are overwritten).
///
/// Times one contiguous read of `min(remote_len, scratch.len(), 64 MiB)` bytes and a batch of
/// up to 512 scattered 4 KiB reads (strided so NIXL cannot merge them), each the median of 5 after
/// a warm-up, with [`ReadOptions::default`]; then solves
/// `t = n * per_descriptor_s + bytes / bw` for the two unknowns. Noise that would make either
/// negative falls back to `bw` from the big read and the per-descriptor cost from the
/// remainder of the small one.
///
/// # Errors
/// [`Error::Probe`] when the region or scratch is under 64 KiB, and whatever [`Agent::read`]
/// returns.
pub fn probe_costs(
    agent: &Agent,
    remote: &str,
    remote_addr: u64,
    remote_len: u64,
    scratch: &mut Arena,
) -> Result<CostModel, Error> {
    let min = 16 * SMALL_LEN;
    if remote_len < min || scratch.len() < min {
        return Err(Error::Probe {
            reason: format!(
                "needs at least {min} bytes of remote region and scratch, got {remote_len} and {}",
                scratch.len()
            ),
        });
    }
    let opts = ReadOptions::default();
    let big_len = remote_len.min(scratch.len()).min(BIG_MAX);
    let big = [ReadOp {
        remote_addr,
        len: big_len,
        local_offset: 0,
    }];
    // Scattered small reads: stride at least 2 runs apart on both sides, so no two are adjacent.
    let count = SMALL_COUNT
        .min(remote_len / (2 * SMALL_LEN))
        .min(scratch.len() / (2 * SMALL_LEN));
    let remote_stride = (remote_len / count) / SMALL_LEN * SMALL_LEN;
    let small: Vec<ReadOp> = (0..count)
        .map(|i| ReadOp {
            remote_addr: remote_addr + i * remote_stride,
            len: SMALL_LEN,
            local_offset: i * 2 * SMALL_LEN,
        })
        .collect();
    let small_bytes = count * SMALL_LEN;

    // Warm-up: connects UCX lazily and faults in both sides.
    agent.read(remote, &big, scratch, &opts)?;
    agent.read(remote, &small, scratch, &opts)?;
    let mut t_big = Vec::with_capacity(REPEATS);
    let mut t_small = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        t_big.push(agent.read(remote, &big, scratch, &opts)?.seconds);
        t_small.push(agent.read(remote, &small, scratch, &opts)?.seconds);
    }
    let tb = median(&mut t_big);
    let ts = median(&mut t_small);
    let model = fit(
        1.0,
        big_len as f64,
        tb,
        count as f64,
        small_bytes as f64,
        ts,
    );
    tracing::debug!(
        remote,
        big_len,
        t_big = tb,
        small = count,
        t_small = ts,
        per_descriptor_us = model.per_descriptor_s * 1e6,
        wire_gbps = model.wire_gbps,
        "NIXL cost probe"
    );
    Ok(model)
}

/// Solves `t1 = n1*c + b1*x`, `t2 = n2*c + b2*x` for `c` (per descriptor) and `x = 1/bw`.
fn fit(n1: f64, b1: f64, t1: f64, n2: f64, b2: f64, t2: f64) -> CostModel {
    let det = n1 * b2 - n2 * b1;
    let (mut c, mut x) = if det.abs() > f64::EPSILON {
        ((t1 * b2 - t2 * b1) / det, (n1 * t2 - n2 * t1) / det)
    } else {
        (f64::NAN, f64::NAN)
    };
    if !(x.is_finite() && x > 0.0) {
        x = t1.max(1e-12) / b1.max(1.0);
    }
    if !(c.is_finite() && c > 0.0) {
        c = ((t2 - b2 * x) / n2.max(1.0)).max(1e-9);
    }
    CostModel {
        per_descriptor_s: c,
        wire_gbps: 1.0 / x / 1e9,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Measured local copy bandwidth in GB/s (1e9 bytes/s): `bytes` copied between two pre-faulted
/// huge-page buffers by `threads` threads (0 counts as 1) at once, each copying an equal share;
/// the median of 3 runs after a warm-up. Returns 0.0 when `bytes` is 0 or cannot be mapped.
pub fn memcpy_gbps(bytes: u64, threads: usize) -> f64 {
    let threads = threads.max(1);
    if bytes == 0 {
        return 0.0;
    }
    let (Ok(mut src), Ok(mut dst)) = (HugeMap::new(bytes), HugeMap::new(bytes)) else {
        return 0.0;
    };
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = i as u8;
    }
    let share = (src.len().div_ceil(threads)).max(1);
    let mut runs = Vec::with_capacity(3);
    for round in 0..4 {
        let s = src.as_slice();
        let d = dst.as_mut_slice();
        let t0 = Instant::now();
        std::thread::scope(|scope| {
            for (from, to) in s.chunks(share).zip(d.chunks_mut(share)) {
                scope.spawn(move || to.copy_from_slice(from));
            }
        });
        let secs = t0.elapsed().as_secs_f64();
        if round > 0 {
            runs.push(secs);
        }
    }
    let secs = median(&mut runs);
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_exact_parameters() {
        let (c, bw) = (2.5e-6, 10.0e9);
        let t = |n: f64, b: f64| n * c + b / bw;
        let m = fit(1.0, 64e6, t(1.0, 64e6), 512.0, 2e6, t(512.0, 2e6));
        assert!((m.per_descriptor_s - c).abs() < 1e-12, "{m:?}");
        assert!((m.wire_gbps - 10.0).abs() < 1e-6, "{m:?}");
        assert!((m.break_even_bytes() - 25_000.0).abs() < 1e-3);
        assert!((m.seconds(2, 1_000_000_000) - (5e-6 + 0.1)).abs() < 1e-12);
    }

    #[test]
    fn fit_stays_positive_on_noise() {
        // Small reads faster per byte than the big one: the exact solve gives a negative cost.
        let m = fit(1.0, 64e6, 0.01, 512.0, 2e6, 0.0001);
        assert!(m.per_descriptor_s > 0.0 && m.wire_gbps > 0.0, "{m:?}");
    }

    #[test]
    fn memcpy_measures_something() {
        let g = memcpy_gbps(8 << 20, 2);
        assert!(g > 0.1, "memcpy {g} GB/s");
        assert_eq!(memcpy_gbps(0, 1), 0.0);
    }
}
