//! The coverage proof: every live byte of every destination rank is written exactly once, by one
//! apply copy or one zero fill.

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
    for c in copies {
        if c.rank_index >= dest.len() || c.count == 0 {
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
