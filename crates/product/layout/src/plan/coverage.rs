//! The coverage proof: every live byte of every destination rank is written exactly once, by one
//! apply copy or one zero fill.

use super::index::FxMap;
use super::output::{Copy, ZeroFill};
use crate::{Error, RankLayout};

/// Checks that copies and zero fills write every byte of every rank's live buffer exactly once.
///
/// A copy whose rows are contiguous in the live buffer ([`Copy::live_contiguous`]) writes one
/// range; any other writes one range per row. Ranges that continue one another (same rank, each
/// starting where the previous one ends) are first joined into chains, and the chains are sorted
/// (runs of increasing chains, as a plan emits them, sort in near-linear time); only when that
/// quick proof fails are the rows of every copy sorted to name the first gap or overlap (the
/// same error as for the copies expanded row by row).
///
/// # Errors
/// [`Error::CoverageGap`] or [`Error::Overlap`] naming the parameter and byte range.
pub fn prove_coverage(
    dest: &[RankLayout],
    copies: &[Copy],
    zero_fills: &[ZeroFill],
) -> Result<(), Error> {
    if chains_tile(dest, copies, zero_fills) {
        return Ok(());
    }
    prove_coverage_sorted(dest, copies, zero_fills)
}

/// True when the chains of abutting copies plus the zero fills tile every rank's buffer exactly
/// (then every copy does, too). False does not prove a gap or overlap.
fn chains_tile(dest: &[RankLayout], copies: &[Copy], zero_fills: &[ZeroFill]) -> bool {
    let mut per_rank: Vec<Vec<(u64, u64)>> = vec![Vec::new(); dest.len()];
    let mut cur: Option<(usize, u64, u64)> = None;
    // Adds the live range `o..o + len` of rank `r` to the chains; false on overflow.
    let mut add = |r: usize, o: u64, len: u64| -> bool {
        match &mut cur {
            Some((cr, _, e)) if *cr == r && *e == o => {
                let Some(ne) = e.checked_add(len) else {
                    return false;
                };
                *e = ne;
            }
            _ => {
                if let Some((cr, s, e)) = cur {
                    per_rank[cr].push((s, e));
                }
                let Some(e) = o.checked_add(len) else {
                    return false;
                };
                cur = Some((r, o, e));
            }
        }
        true
    };
    let (bands, banded) = bands(copies);
    for (i, c) in copies.iter().enumerate() {
        if c.rank_index >= dest.len() || c.count == 0 || banded[i] {
            continue;
        }
        if c.live_contiguous() {
            let Some(b) = c.bytes() else {
                return false;
            };
            if !add(c.rank_index, c.live_offset, b) {
                return false;
            }
            continue;
        }
        for i in 0..c.count {
            let Some((_, l)) = c.row(i) else {
                return false;
            };
            if !add(c.rank_index, l, c.len) {
                return false;
            }
        }
    }
    if let Some((r, s, e)) = cur {
        per_rank[r].push((s, e));
    }
    for (r, s, e) in bands {
        if let Some(v) = per_rank.get_mut(r) {
            v.push((s, e));
        }
    }
    for z in zero_fills {
        if let Some(v) = per_rank.get_mut(z.rank_index) {
            let Some(e) = z.live_offset.checked_add(z.len) else {
                return false;
            };
            v.push((z.live_offset, e));
        }
    }
    dest.iter().zip(per_rank).all(|(rl, mut w)| {
        sort_by_start(&mut w);
        let mut cursor = 0u64;
        for (s, e) in w {
            if s != cursor {
                return false;
            }
            cursor = e;
        }
        cursor == rl.total_bytes
    })
}

/// Strided copies of one rank whose rows, side by side, fill their common stride exactly: a
/// destination's whole rows assembled from column slices of several sources (a row-parallel
/// weight, or an expert's down projection, gathered whole from tensor-parallel shards). Each such
/// group is one contiguous span `first offset .. + count * stride` of `(rank, start, end)`, and
/// `banded[i]` marks the copies it stands for; every other copy is left to the rows.
fn bands(copies: &[Copy]) -> (Vec<(usize, u64, u64)>, Vec<bool>) {
    let mut banded = vec![false; copies.len()];
    let mut groups: FxMap<(usize, u64, u64), Vec<usize>> = FxMap::default();
    for (i, c) in copies.iter().enumerate() {
        if c.count > 1 && !c.live_contiguous() && c.len > 0 && c.len < c.live_stride {
            groups
                .entry((c.rank_index, c.count, c.live_stride))
                .or_default()
                .push(i);
        }
    }
    let mut out = Vec::new();
    for ((rank, count, stride), mut members) in groups {
        members.sort_unstable_by_key(|&i| copies[i].live_offset);
        let mut run_start = 0;
        while run_start < members.len() {
            // Extend a run of abutting row segments until it spans the stride exactly.
            let first = copies[members[run_start]].live_offset;
            let mut end = first;
            let mut k = run_start;
            while k < members.len() && copies[members[k]].live_offset == end && end - first < stride
            {
                end = end.saturating_add(copies[members[k]].len);
                k += 1;
            }
            if end - first == stride {
                if let Some(span_end) = count.checked_mul(stride).and_then(|n| first.checked_add(n))
                {
                    out.push((rank, first, span_end));
                    for &i in &members[run_start..k] {
                        banded[i] = true;
                    }
                }
                run_start = k;
            } else {
                run_start += 1;
            }
        }
    }
    (out, banded)
}

/// Sorts `(start, end)` spans by start (spans with equal starts in no particular order): a
/// least-significant-digit radix sort over the bits the largest start uses, linear in the
/// spans (a plan at frontier scale proves ~150k chains per rank); short lists use
/// `sort_unstable`.
pub(super) fn sort_by_start(v: &mut Vec<(u64, u64)>) {
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    if v.len() < 4096 {
        v.sort_unstable();
        return;
    }
    let max = v.iter().map(|x| x.0).max().unwrap_or(0);
    let key_bits = u64::BITS - max.leading_zeros();
    let mut other = vec![(0u64, 0u64); v.len()];
    let mut shift = 0;
    while shift < key_bits {
        let digit = |x: &(u64, u64)| ((x.0 >> shift) as usize) & (BUCKETS - 1);
        let mut count = [0usize; BUCKETS];
        for x in v.iter() {
            count[digit(x)] += 1;
        }
        let mut at = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = at;
            at += n;
        }
        for x in v.iter() {
            let d = digit(x);
            if let Some(slot) = other.get_mut(count[d]) {
                *slot = *x;
            }
            count[d] += 1;
        }
        std::mem::swap(v, &mut other);
        shift += BITS;
    }
}

/// [`prove_coverage`] by sorting every copy; names the first gap or overlap.
pub(super) fn prove_coverage_sorted(
    dest: &[RankLayout],
    copies: &[Copy],
    zero_fills: &[ZeroFill],
) -> Result<(), Error> {
    let mut per_rank: Vec<Vec<(u64, u64)>> = vec![Vec::new(); dest.len()];
    for c in copies {
        if let Some(v) = per_rank.get_mut(c.rank_index) {
            // A row past u64::MAX is at u64::MAX: outside every buffer, so reported.
            v.extend((0..c.count).map(|i| {
                let l = i
                    .checked_mul(c.live_stride)
                    .and_then(|d| c.live_offset.checked_add(d))
                    .unwrap_or(u64::MAX);
                (l, c.len)
            }));
        }
    }
    for z in zero_fills {
        if let Some(v) = per_rank.get_mut(z.rank_index) {
            v.push((z.live_offset, z.len));
        }
    }
    for (rl, mut w) in dest.iter().zip(per_rank) {
        w.sort_unstable();
        let name_at = |o: u64| {
            rl.params
                .iter()
                .find(|p| o >= p.offset && o < p.offset.saturating_add(p.len.max(1)))
                .map(|p| p.name.clone())
                .unwrap_or_else(|| "<outside any parameter>".into())
        };
        let mut cursor = 0u64;
        for (o, l) in w {
            if o > cursor {
                return Err(Error::CoverageGap {
                    param: name_at(cursor),
                    rank: rl.rank,
                    start: cursor,
                    end: o,
                });
            }
            if o < cursor {
                return Err(Error::Overlap {
                    param: name_at(o),
                    rank: rl.rank,
                    start: o,
                    end: cursor.min(o.saturating_add(l)),
                });
            }
            cursor = o.saturating_add(l);
        }
        if cursor != rl.total_bytes {
            return Err(Error::CoverageGap {
                param: name_at(cursor),
                rank: rl.rank,
                start: cursor,
                end: rl.total_bytes,
            });
        }
    }
    Ok(())
}
