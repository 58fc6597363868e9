//! Orders and permutations the planner computes in linear time: wire runs by (source, address),
//! intersections grouped by shard, radix orders by key, and permutations applied in place.

use super::index::FxMap;

/// The indices of `wire` runs (source, address, length) in the order of their values, stably
/// (equal runs in index order); every source is below `n_sources`. A stable counting sort by
/// source, then a check that each source's runs are in order already (a plan meets a source's
/// shards in the order they lie in its arena), sorting only the sources whose runs are not.
pub(super) fn order_wires(wire: &[(usize, u64, u64)], n_sources: usize) -> Vec<usize> {
    let mut at = vec![0usize; n_sources + 1];
    for &(si, _, _) in wire {
        if let Some(c) = at.get_mut(si + 1) {
            *c += 1;
        }
    }
    for k in 1..at.len() {
        at[k] += at[k - 1];
    }
    let starts = at.clone();
    let mut order = vec![0usize; wire.len()];
    for (i, &(si, _, _)) in wire.iter().enumerate() {
        // Sources at or past `n_sources` (none in a plan) go after the rest, in order.
        let slot = at.get_mut(si).map(|c| {
            let k = *c;
            *c += 1;
            k
        });
        match slot.and_then(|k| order.get_mut(k)) {
            Some(o) => *o = i,
            None => return by_value(wire),
        }
    }
    for w in starts.windows(2) {
        let seg = &mut order[w[0]..w[1]];
        if !seg.windows(2).all(|p| wire[p[0]] <= wire[p[1]]) {
            seg.sort_by_key(|&i| wire[i]);
        }
    }
    order
}

/// The indices of `wire` in the order of their values, stably.
pub(super) fn by_value(wire: &[(usize, u64, u64)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..wire.len()).collect();
    order.sort_by_key(|&i| wire[i]);
    order
}

/// Reorders `v` so that `v[k]` becomes the old `v[perm[k]]`, in place (by swaps along each cycle
/// of the permutation). `perm` must be a permutation of `0..v.len()`; otherwise some items end
/// up elsewhere, without a panic.
pub(super) fn permute_in_place<T>(v: &mut [T], perm: &[usize]) {
    let n = v.len().min(perm.len());
    let mut done = vec![false; n];
    for start in 0..n {
        if done[start] {
            continue;
        }
        // Slot `j` holds the old `v[start]`; it takes the old `v[perm[j]]`, which still sits at
        // `perm[j]` (not yet visited), and passes `v[start]` on.
        let mut j = start;
        loop {
            done[j] = true;
            let src = perm[j];
            if src == start || src >= n || done[src] {
                break;
            }
            v.swap(j, src);
            j = src;
        }
    }
}

/// The order that groups `keys` (each below `bound`) by key, stably: groups in order of their
/// key's first occurrence, each in index order. `None` when `keys` are grouped already (every
/// key's occurrences in a row), the common case, found in one pass over a bitset of `bound` bits.
pub(super) fn group_by_first_seen(keys: &[usize], bound: usize) -> Option<Vec<usize>> {
    let mut seen = vec![0u64; bound.div_ceil(64)];
    let mut test_and_set = |key: usize| -> bool {
        match seen.get_mut(key / 64) {
            Some(w) => {
                let bit = 1u64 << (key % 64);
                let was = *w & bit != 0;
                *w |= bit;
                was
            }
            None => false,
        }
    };
    let grouped = keys
        .iter()
        .enumerate()
        .all(|(k, &key)| (k > 0 && keys[k - 1] == key) || !test_and_set(key));
    if grouped {
        return None;
    }
    // Dense group numbers in order of first occurrence, then a stable sort by them.
    let mut group_of: FxMap<usize, usize> = FxMap::default();
    let ordinals: Vec<usize> = keys
        .iter()
        .map(|&key| {
            let next = group_of.len();
            *group_of.entry(key).or_insert(next)
        })
        .collect();
    Some(order_by_key(&ordinals, group_of.len()))
}

/// The indices `0..keys.len()` ordered by key, stably (equal keys in index order); every key is
/// below `bound`. A least-significant-digit radix sort: linear in the keys.
pub(super) fn order_by_key(keys: &[usize], bound: usize) -> Vec<usize> {
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    let mut cur: Vec<usize> = (0..keys.len()).collect();
    let key_bits = usize::BITS - bound.leading_zeros();
    if keys.len() < 2 || key_bits == 0 {
        return cur;
    }
    let mut next: Vec<usize> = vec![0; keys.len()];
    let mut shift = 0;
    while shift < key_bits {
        let digit = |i: usize| (keys.get(i).copied().unwrap_or(0) >> shift) & (BUCKETS - 1);
        let mut count = [0usize; BUCKETS];
        for &i in &cur {
            count[digit(i)] += 1;
        }
        let mut at = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = at;
            at += n;
        }
        for &i in &cur {
            let d = digit(i);
            if let Some(slot) = next.get_mut(count[d]) {
                *slot = i;
            }
            count[d] += 1;
        }
        std::mem::swap(&mut cur, &mut next);
        shift += BITS;
    }
    cur
}
