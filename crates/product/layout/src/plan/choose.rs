//! Phase 2 of a plan: the strategy per (source, shard) under the cost model, and the wire runs
//! and staging image of every intersection it implies. Wire runs are deduplicated by (source,
//! addr, len) when staged (phase 3).

use std::ops::Range;

use super::discover::count_overflow;
use super::geometry::Runs;
use super::index::SourceIndex;
use super::isect::{Img, Isect};
use super::output::{Candidates, Choice, CostModel, Strategy};
use super::PlanOptions;
use crate::{Error, SourceManifest};

/// The wire runs the strategies chose and the staging images that point into them.
pub(super) struct Wires {
    /// Wire runs (source, address, length), one per id; identical runs are merged when staged.
    pub(super) wire: Vec<(usize, u64, u64)>,
    /// The flat image list: run `j` of an [`Img::Flat`] image at `start` is at
    /// (wire id, offset) `img_all[start + j]`.
    pub(super) img_all: Vec<(u32, u64)>,
}

impl Wires {
    /// Adds a wire run; its id.
    #[inline]
    fn intern(&mut self, w: (usize, u64, u64)) -> Result<u32, Error> {
        let id = u32::try_from(self.wire.len()).map_err(|_| count_overflow("wire run count"))?;
        self.wire.push(w);
        Ok(id)
    }

    /// The position the next image run takes in the flat image list.
    #[inline]
    fn img_at_end(&self) -> Result<u32, Error> {
        u32::try_from(self.img_all.len()).map_err(|_| count_overflow("staging image list"))
    }
}

/// Buffers reused from group to group.
#[derive(Default)]
struct Scratch {
    runs: Vec<(u64, u64)>,
    merged: Vec<(u64, u64)>,
    ids: Vec<u32>,
}

/// The strategies considered for one group: (strategy, predicted seconds, descriptors, bytes).
struct Estimate {
    cands: [(Strategy, f64, u64, u64); 3],
    n_cands: usize,
    /// The group is one intersection whose runs neither touch nor overlap.
    single: bool,
    /// The superset span: its first address and length.
    lo: u64,
    span: u64,
}

/// Number of descriptors and bytes of `runs` (addr, len) after sorting, deduplicating and
/// coalescing adjacent runs. Sorts `runs` in place.
fn coalesced_count_in(runs: &mut Vec<(u64, u64)>) -> (u64, u64) {
    runs.sort_unstable();
    runs.dedup();
    let mut n = 0u64;
    let mut bytes = 0u64;
    let mut end: Option<u64> = None;
    for &(a, l) in runs.iter() {
        bytes += l;
        if end != Some(a) {
            n += 1;
        }
        end = Some(a + l);
    }
    (n, bytes)
}

impl SourceIndex<'_> {
    /// Phase 2: the strategy of each group `member_at` delimits in `isects` (whose shards `keys`
    /// numbers), with the wire runs it reads and each intersection's staging image.
    pub(super) fn choose_strategies(
        &self,
        isects: &mut [Isect<'_>],
        keys: &[usize],
        member_at: &[usize],
        rdims: &[u64],
        cost: &CostModel,
        opts: PlanOptions,
    ) -> Result<(Vec<Choice>, Wires), Error> {
        let n_groups = member_at.len() - 1;
        let members_of = |p: usize| member_at[p]..member_at[p + 1];
        let mut wires = Wires {
            wire: Vec::with_capacity(isects.len()),
            img_all: Vec::new(),
        };
        let mut scratch = Scratch::default();
        let mut choices = Vec::with_capacity(n_groups);
        for p in 0..n_groups {
            let idx = members_of(p);
            // The group's (source, shard).
            let si = isects.get(idx.start).map_or(0, |x| x.source as usize);
            let hi = keys.get(idx.start).map_or(0, |&k| k - self.shard_base[si]);
            // The choice's tensor is the first intersection's.
            let tensor = isects.get(idx.start).map_or(0, |x| x.tensor);
            let est = estimate(
                isects,
                idx.clone(),
                (self.sources, si, hi),
                rdims,
                cost,
                opts,
                &mut scratch.runs,
            );
            let cands = &est.cands[..est.n_cands];
            // On ties prefer exact (its reads stay contiguous with the neighbouring shards'
            // reads, which coalesce across tensors), then packed, then superset.
            let rank_of = |st: Strategy| match st {
                Strategy::Exact => 0,
                Strategy::Packed => 1,
                Strategy::Superset => 2,
            };
            let best = cands
                .iter()
                .min_by(|a, b| a.1.total_cmp(&b.1).then(rank_of(a.0).cmp(&rank_of(b.0))))
                .copied()
                .unwrap_or(cands[0]);
            choices.push(Choice {
                tensor,
                source: si,
                strategy: best.0,
                descriptors: best.2,
                wire_bytes: best.3,
                candidates: Candidates::new(cands.iter().map(|c| (c.0, c.1))),
            });
            match best.0 {
                Strategy::Exact => {
                    stage_exact(isects, idx, si, est.single, &mut wires, &mut scratch)?;
                }
                Strategy::Packed => stage_packed(isects, idx, si, &mut wires)?,
                Strategy::Superset => {
                    stage_superset(isects, idx, si, (est.lo, est.span), &mut wires)?;
                }
            }
        }
        Ok((choices, wires))
    }
}

/// The predicted cost of each strategy for the group `isects[idx]` of shard `hi` of source `si`:
/// exact, packed when every intersection has a packed address, superset when `opts` allows it.
#[inline]
fn estimate(
    isects: &[Isect<'_>],
    idx: Range<usize>,
    (sources, si, hi): (&[SourceManifest], usize, usize),
    rdims: &[u64],
    cost: &CostModel,
    opts: PlanOptions,
    scratch: &mut Vec<(u64, u64)>,
) -> Estimate {
    let single = match isects.get(idx.clone()) {
        Some([x]) if x.runs_disjoint_gapped() => Some(x),
        _ => None,
    };
    let (n_exact, b_exact) = match single {
        Some(x) => (x.runs.len(), x.runs.len() * x.src_run_bytes),
        None => {
            scratch.clear();
            for i in idx.clone() {
                let x = &isects[i];
                scratch.extend(x.src_spans().map(|(a, e)| (a, e - a)));
            }
            coalesced_count_in(scratch)
        }
    };
    // Exact and superset stage each region row by row: one segment per source run.
    let strided: u64 = idx.clone().map(|i| isects[i].runs.len()).sum();
    let mut cands: [(Strategy, f64, u64, u64); 3] = [(Strategy::Exact, 0.0, 0, 0); 3];
    let mut n_cands = 0;
    cands[n_cands] = (
        Strategy::Exact,
        cost.seconds_with_segments(n_exact, b_exact, strided),
        n_exact,
        b_exact,
    );
    n_cands += 1;
    if idx.clone().all(|i| isects[i].has_packed) {
        scratch.clear();
        scratch.extend(idx.clone().map(|i| {
            let x = &isects[i];
            (x.packed_addr, x.numel(rdims) * u64::from(x.elem))
        }));
        let (n, b) = coalesced_count_in(scratch);
        let segs = idx.len() as u64;
        cands[n_cands] = (
            Strategy::Packed,
            cost.seconds_with_segments(n, b, segs),
            n,
            b,
        );
        n_cands += 1;
    }
    // (The shard's address only for an empty group, which there is not: the manifests
    // are cold by now.)
    let s_addr = || {
        sources
            .get(si)
            .and_then(|m| m.shards.get(hi))
            .map_or(0, |s| s.addr)
    };
    let lo = idx
        .clone()
        .map(|i| isects[i].src_run(0))
        .min()
        .unwrap_or_else(s_addr);
    let hi_end = idx
        .clone()
        .map(|i| {
            let x = &isects[i];
            x.src_run(x.runs.len().saturating_sub(1)) + x.src_run_bytes
        })
        .max()
        .unwrap_or_else(s_addr);
    let span = hi_end - lo;
    if opts.superset {
        cands[n_cands] = (
            Strategy::Superset,
            cost.seconds_with_segments(1, span, strided),
            1,
            span,
        );
        n_cands += 1;
    }
    Estimate {
        cands,
        n_cands,
        single: single.is_some(),
        lo,
        span,
    }
}

/// [`Strategy::Exact`] for the group `isects[idx]` of source `si`: the exact runs, merged when
/// they touch or overlap; `single` as [`Estimate::single`].
#[inline]
fn stage_exact(
    isects: &mut [Isect<'_>],
    idx: Range<usize>,
    si: usize,
    single: bool,
    wires: &mut Wires,
    scratch: &mut Scratch,
) -> Result<(), Error> {
    if let Some(i) = single.then_some(idx.start) {
        // Runs neither touch nor overlap: each is its own wire run.
        let x = &isects[i];
        let n = x.runs.len();
        let img = if n == 1 {
            Img::Affine {
                wire: wires.intern((si, x.src_run(0), x.src_run_bytes))?,
                off0: 0,
                stride: 0,
                count: 1,
            }
        } else {
            let start = wires.img_at_end()?;
            for r in 0..n {
                let id = wires.intern((si, x.src_run(r), x.src_run_bytes))?;
                wires.img_all.push((id, 0));
            }
            Img::Flat { start, count: n }
        };
        isects[i].img = img;
        return Ok(());
    }
    // Merge the group's runs first (adjacent or overlapping), so a worker
    // holding every TP rank of a row-parallel weight gets one wire run, not one
    // per row.
    let Scratch { runs, merged, ids } = scratch;
    runs.clear();
    for i in idx.clone() {
        runs.extend(isects[i].src_spans());
    }
    runs.sort_unstable();
    merged.clear();
    for &(a, e) in runs.iter() {
        match merged.last_mut() {
            Some(m) if a <= m.1 => m.1 = m.1.max(e),
            _ => merged.push((a, e)),
        }
    }
    ids.clear();
    for &(a, e) in merged.iter() {
        ids.push(wires.intern((si, a, e - a))?);
    }
    for i in idx {
        let x = &mut isects[i];
        let start = wires.img_at_end()?;
        let n = x.runs.len();
        for r in 0..n {
            let a = x.src_run(r);
            let k = merged.partition_point(|m| m.0 <= a).saturating_sub(1);
            wires.img_all.push((ids[k], a - merged[k].0));
        }
        x.img = Img::Flat { start, count: n };
    }
    Ok(())
}

/// [`Strategy::Packed`] for the group `isects[idx]` of source `si`: each region's packed copy,
/// one wire run each.
#[inline]
fn stage_packed(
    isects: &mut [Isect<'_>],
    idx: Range<usize>,
    si: usize,
    wires: &mut Wires,
) -> Result<(), Error> {
    for i in idx {
        let x = &mut isects[i];
        let bytes = x.runs.len() * x.src_run_bytes;
        x.staged_packed = true;
        x.img = Img::Affine {
            wire: wires.intern((si, x.packed_addr, bytes))?,
            off0: 0,
            stride: 0,
            count: 1,
        };
    }
    Ok(())
}

/// [`Strategy::Superset`] for the group `isects[idx]` of source `si`: one wire run, the span
/// `lo..lo + span`, with each region's runs at their offsets in it.
#[inline]
fn stage_superset(
    isects: &mut [Isect<'_>],
    idx: Range<usize>,
    si: usize,
    (lo, span): (u64, u64),
    wires: &mut Wires,
) -> Result<(), Error> {
    let id = wires.intern((si, lo, span))?;
    for i in idx {
        let x = &mut isects[i];
        x.img = match x.runs {
            Runs::Arith { count, stride, .. } => Img::Affine {
                wire: id,
                off0: x.src_run(0) - lo,
                stride: stride.wrapping_mul(u64::from(x.elem)),
                count,
            },
            Runs::List(_) => {
                let start = wires.img_at_end()?;
                let n = x.runs.len();
                for r in 0..n {
                    wires.img_all.push((id, x.src_run(r) - lo));
                }
                Img::Flat { start, count: n }
            }
        };
    }
    Ok(())
}
