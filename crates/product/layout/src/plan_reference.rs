//! The planner and cutter as they were before [`crate::plan::SourceIndex`]: one pass over every
//! shard of every source per call. Kept as it was (test-only), but for the order of its (source,
//! shard) groups (now that of their first discovery, as the indexed planner's), as the reference
//! the indexed versions must reproduce exactly, with the plan types of then (one contiguous copy and one segment per
//! row, owned names, candidate lists); [`expand`] turns a compact [`Plan`] into that form.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};

use crate::plan::{
    decompose, prove_coverage, validate_manifest, CostModel, Cut, Plan, Read, Strategy, ZeroFill,
};
use crate::{Digest, Error, RankLayout, SourceManifest, TensorBox};

/// An apply copy as plans had them: one contiguous range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub rank_index: usize,
    pub staging_offset: u64,
    pub live_offset: u64,
    pub len: u64,
}

/// A digest check as plans had them: (staging offset, length) segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VerifyItem {
    pub source: usize,
    pub tensor: String,
    pub dest_rank: u32,
    pub shared_with: Vec<u32>,
    pub region: TensorBox,
    pub digest: Digest,
    pub segments: Vec<(u64, u64)>,
}

/// A strategy choice as plans had them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Choice {
    pub tensor: String,
    pub source: usize,
    pub strategy: Strategy,
    pub descriptors: u64,
    pub wire_bytes: u64,
    pub candidates: Vec<(Strategy, f64)>,
}

/// A plan as plans were: every strided copy and segment one entry per row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RefPlan {
    pub reads: Vec<Read>,
    pub staging_bytes: u64,
    pub copies: Vec<Copy>,
    pub zero_fills: Vec<ZeroFill>,
    pub verify: Vec<VerifyItem>,
    pub choices: Vec<Choice>,
    pub useful_bytes: u64,
    pub wire_bytes: u64,
    pub predicted_seconds: f64,
}

/// The compact plan `p`, made from `sources`, row by row (digest checks with the region and digest
/// of their published pieces): each strided copy as its rows, each segment as its runs.
pub(crate) fn expand(p: &Plan, sources: &[SourceManifest]) -> RefPlan {
    let copies = p
        .copies
        .iter()
        .flat_map(|c| {
            assert!(c.count >= 1, "{c:?}");
            if c.count == 1 {
                assert_eq!((c.staging_stride, c.live_stride), (0, 0), "{c:?}");
            }
            assert_eq!(c.rows().count() as u64, c.count, "{c:?}");
            c.rows().map(move |(s, l)| Copy {
                rank_index: c.rank_index,
                staging_offset: s,
                live_offset: l,
                len: c.len,
            })
        })
        .collect();
    let verify = p
        .verify
        .iter()
        .map(|v| {
            for g in v.segments.iter() {
                assert!(g.count >= 1, "{g:?}");
                if g.count == 1 {
                    assert_eq!(g.stride, 0, "{g:?}");
                }
            }
            let piece = v.published(sources).expect("the item's published piece");
            assert_eq!(piece.tensor, p.tensor_name(v.tensor));
            assert_eq!(piece.dest_rank, v.dest_rank);
            VerifyItem {
                source: v.source,
                tensor: p.tensor_name(v.tensor).to_string(),
                dest_rank: v.dest_rank,
                shared_with: v.shared_with.clone(),
                region: piece.region.clone(),
                digest: piece.digest,
                segments: v.byte_ranges().collect(),
            }
        })
        .collect();
    let choices = p
        .choices
        .iter()
        .map(|c| Choice {
            tensor: p.tensor_name(c.tensor).to_string(),
            source: c.source,
            strategy: c.strategy,
            descriptors: c.descriptors,
            wire_bytes: c.wire_bytes,
            candidates: c.candidates.to_vec(),
        })
        .collect();
    RefPlan {
        reads: p.reads.clone(),
        staging_bytes: p.staging_bytes,
        copies,
        zero_fills: p.zero_fills.clone(),
        verify,
        choices,
        useful_bytes: p.useful_bytes,
        wire_bytes: p.wire_bytes,
        predicted_seconds: p.predicted_seconds,
    }
}

/// (source, destination rank, tensor, region) of a published piece.
type PieceKey<'a> = (usize, u32, &'a str, &'a TensorBox);
/// (source, digest, segments) of a verification already planned.
type VerifyKey = (usize, Digest, Vec<(u64, u64)>);

/// Intersection of one destination piece with one source shard.
struct Isect<'a> {
    rank_index: usize,
    dest_rank: u32,
    source: usize,
    tensor: &'a str,
    region: TensorBox,
    /// Piece region and live offset.
    piece_region: &'a TensorBox,
    piece_offset: u64,
    elem: u64,
    digest: Digest,
    packed_addr: Option<u64>,
    /// Source addresses of its runs in the shard, row-major, and run length in bytes.
    src_runs: Vec<u64>,
    src_run_bytes: u64,
    /// After the strategy choice: staging image = runs of `img_run_bytes` at (wire id, offset).
    img: Vec<(usize, u64)>,
    img_run_bytes: u64,
}

fn coalesced_count(mut runs: Vec<(u64, u64)>) -> (u64, u64) {
    runs.sort_unstable();
    runs.dedup();
    let mut n = 0u64;
    let mut bytes = 0u64;
    let mut end: Option<u64> = None;
    for (a, l) in runs {
        bytes += l;
        if end != Some(a) {
            n += 1;
        }
        end = Some(a + l);
    }
    (n, bytes)
}

/// Plans the pull for the ranks `dest` of one worker from `sources`.
///
/// Every destination piece must be covered by the sources' shards of the same tensor, with the same
/// dtype and global shape, and every intersection must have a digest the source published for the
/// destination's layout and rank.
///
/// # Errors
/// [`Error::BadManifest`] for an inconsistent manifest; [`Error::MissingTensor`] when no source has
/// a tensor the destination needs or a source lacks a digest for a region; [`Error::Mismatch`] on
/// dtype or shape disagreement; [`Error::CoverageGap`] / [`Error::Overlap`] naming the parameter
/// when the live bytes would not be written exactly once; [`Error::Overflow`].
pub(crate) fn plan(
    dest: &[RankLayout],
    sources: &[SourceManifest],
    cost: &CostModel,
) -> Result<RefPlan, Error> {
    for m in sources {
        validate_manifest(m)?;
    }
    let mut by_tensor: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    for (si, m) in sources.iter().enumerate() {
        for (hi, s) in m.shards.iter().enumerate() {
            by_tensor
                .entry(s.tensor.as_str())
                .or_default()
                .push((si, hi));
        }
    }
    let mut piece_index: HashMap<PieceKey<'_>, (Digest, Option<u64>)> = HashMap::new();
    for (si, m) in sources.iter().enumerate() {
        for p in &m.pieces {
            if dest.first().is_some_and(|d| d.layout == p.layout) {
                piece_index.insert(
                    (si, p.dest_rank, p.tensor.as_str(), &p.region),
                    (p.digest, p.packed_addr),
                );
            }
        }
    }

    // 1. Intersections, grouped by (source, shard); groups in order of their first
    // intersection's discovery.
    let mut groups: Vec<((usize, usize), Vec<Isect<'_>>)> = Vec::new();
    let mut group_of: HashMap<(usize, usize), usize> = HashMap::new();
    for (ri, rl) in dest.iter().enumerate() {
        for param in &rl.params {
            for piece in &param.pieces {
                let Some(cands) = by_tensor.get(piece.tensor.as_str()) else {
                    return Err(Error::MissingTensor {
                        tensor: piece.tensor.clone(),
                        reason: format!(
                            "no source published it (needed by {} on rank {})",
                            param.name, rl.rank
                        ),
                    });
                };
                // Sources holding the same box (replicated sources, replicated kv heads) are
                // alternatives: pick one per box, spread over ranks and tensors.
                let mut alternatives: BTreeMap<&TensorBox, Vec<(usize, usize)>> = BTreeMap::new();
                for &(si, hi) in cands {
                    alternatives
                        .entry(&sources[si].shards[hi].shard)
                        .or_default()
                        .push((si, hi));
                }
                let spread = (rl.rank as usize)
                    .wrapping_add(param.pieces.len())
                    .wrapping_add(piece.tensor.len());
                for alts in alternatives.values() {
                    let (si, hi) = alts[spread % alts.len()];
                    let s = &sources[si].shards[hi];
                    if s.dtype != piece.dtype {
                        return Err(Error::Mismatch {
                            tensor: piece.tensor.clone(),
                            what: "dtype",
                            source_value: s.dtype.to_string(),
                            dest_value: piece.dtype.to_string(),
                        });
                    }
                    if s.global_shape != piece.global_shape {
                        return Err(Error::Mismatch {
                            tensor: piece.tensor.clone(),
                            what: "shape",
                            source_value: format!("{:?}", s.global_shape),
                            dest_value: format!("{:?}", piece.global_shape),
                        });
                    }
                    let Some(region) = s.shard.intersect(&piece.region) else {
                        continue;
                    };
                    let Some(&(digest, packed_addr)) =
                        piece_index.get(&(si, rl.rank, piece.tensor.as_str(), &region))
                    else {
                        return Err(crate::plan::missing_digest(
                            &piece.tensor,
                            sources[si].slot,
                            &region,
                            rl,
                        ));
                    };
                    let elem = s.dtype.size_bytes();
                    let (run, starts) = decompose(&region, &s.shard);
                    let src_runs = starts.iter().map(|st| s.addr + st * elem).collect();
                    let g = *group_of.entry((si, hi)).or_insert_with(|| {
                        groups.push(((si, hi), Vec::new()));
                        groups.len() - 1
                    });
                    groups[g].1.push(Isect {
                        rank_index: ri,
                        dest_rank: rl.rank,
                        source: si,
                        tensor: piece.tensor.as_str(),
                        region,
                        piece_region: &piece.region,
                        piece_offset: piece.offset,
                        elem,
                        digest,
                        packed_addr,
                        src_runs,
                        src_run_bytes: run * elem,
                        img: Vec::new(),
                        img_run_bytes: 0,
                    });
                }
            }
        }
    }

    // 2. Strategy per (source, shard); wire runs deduplicated by (source, addr, len).
    let mut wire: Vec<(usize, u64, u64)> = Vec::new();
    let mut wire_id: HashMap<(usize, u64, u64), usize> = HashMap::new();
    let mut intern = |w: (usize, u64, u64)| -> usize {
        *wire_id.entry(w).or_insert_with(|| {
            wire.push(w);
            wire.len() - 1
        })
    };
    let mut choices = Vec::new();
    for ((si, hi), isects) in groups.iter_mut() {
        let s = &sources[*si].shards[*hi];
        let exact_runs: Vec<(u64, u64)> = isects
            .iter()
            .flat_map(|x| x.src_runs.iter().map(move |&a| (a, x.src_run_bytes)))
            .collect();
        let (n_exact, b_exact) = coalesced_count(exact_runs);
        // Exact and superset stage each region row by row: one segment per source run.
        let strided: u64 = isects.iter().map(|x| x.src_runs.len() as u64).sum();
        let mut cands = vec![(
            Strategy::Exact,
            cost.seconds_with_segments(n_exact, b_exact, strided),
            n_exact,
            b_exact,
        )];
        if isects.iter().all(|x| x.packed_addr.is_some()) {
            let runs = isects
                .iter()
                .map(|x| {
                    (
                        x.packed_addr.unwrap_or(0),
                        x.region.numel().unwrap_or(0) * x.elem,
                    )
                })
                .collect();
            let (n, b) = coalesced_count(runs);
            let segs = isects.len() as u64;
            cands.push((
                Strategy::Packed,
                cost.seconds_with_segments(n, b, segs),
                n,
                b,
            ));
        }
        let lo = isects
            .iter()
            .filter_map(|x| x.src_runs.first().copied())
            .min()
            .unwrap_or(s.addr);
        let hi_end = isects
            .iter()
            .filter_map(|x| x.src_runs.last().map(|a| a + x.src_run_bytes))
            .max()
            .unwrap_or(s.addr);
        let span = hi_end - lo;
        cands.push((
            Strategy::Superset,
            cost.seconds_with_segments(1, span, strided),
            1,
            span,
        ));
        // On ties prefer exact (its reads stay contiguous with the neighbouring shards' reads,
        // which coalesce across tensors), then packed, then superset.
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
            tensor: s.tensor.clone(),
            source: *si,
            strategy: best.0,
            descriptors: best.2,
            wire_bytes: best.3,
            candidates: cands.iter().map(|c| (c.0, c.1)).collect(),
        });
        match best.0 {
            Strategy::Exact => {
                // Merge the group's runs first (adjacent or overlapping), so a worker holding
                // every TP rank of a row-parallel weight gets one wire run, not one per row.
                let mut runs: Vec<(u64, u64)> = isects
                    .iter()
                    .flat_map(|x| x.src_runs.iter().map(move |&a| (a, a + x.src_run_bytes)))
                    .collect();
                runs.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (a, e) in runs {
                    match merged.last_mut() {
                        Some(m) if a <= m.1 => m.1 = m.1.max(e),
                        _ => merged.push((a, e)),
                    }
                }
                let ids: Vec<usize> = merged
                    .iter()
                    .map(|&(a, e)| intern((*si, a, e - a)))
                    .collect();
                for x in isects.iter_mut() {
                    x.img_run_bytes = x.src_run_bytes;
                    x.img = x
                        .src_runs
                        .iter()
                        .map(|&a| {
                            let k = merged.partition_point(|m| m.0 <= a).saturating_sub(1);
                            (ids[k], a - merged[k].0)
                        })
                        .collect();
                }
            }
            Strategy::Packed => {
                for x in isects.iter_mut() {
                    let bytes = x.src_runs.len() as u64 * x.src_run_bytes;
                    x.img_run_bytes = bytes;
                    x.img = vec![(intern((*si, x.packed_addr.unwrap_or(0), bytes)), 0)];
                }
            }
            Strategy::Superset => {
                let id = intern((*si, lo, span));
                for x in isects.iter_mut() {
                    x.img_run_bytes = x.src_run_bytes;
                    x.img = x.src_runs.iter().map(|&a| (id, a - lo)).collect();
                }
            }
        }
    }

    // 3. Staging offsets in (source, addr) order, then coalescing.
    let mut order: Vec<usize> = (0..wire.len()).collect();
    order.sort_by_key(|&i| wire[i]);
    let mut staging = vec![0u64; wire.len()];
    let mut off = 0u64;
    let mut reads: Vec<Read> = Vec::new();
    for &i in &order {
        let (si, a, l) = wire[i];
        staging[i] = off;
        match reads.last_mut() {
            Some(r)
                if r.source == si && r.src_addr + r.len == a && r.staging_offset + r.len == off =>
            {
                r.len += l
            }
            _ => reads.push(Read {
                source: si,
                src_addr: a,
                len: l,
                staging_offset: off,
            }),
        }
        off = off.checked_add(l).ok_or(Error::Overflow {
            what: "staging size",
            tensor: String::new(),
        })?;
    }
    let staging_bytes = off;
    let wire_bytes = staging_bytes;

    // 4. Apply copies and verification segments.
    let mut copies: Vec<Copy> = Vec::new();
    let mut verify: Vec<VerifyItem> = Vec::new();
    let mut seen_verify: HashMap<VerifyKey, usize> = HashMap::new();
    let mut useful_bytes = 0u64;
    for (_, isects) in &groups {
        for x in isects {
            let img: Vec<u64> = x.img.iter().map(|&(id, o)| staging[id] + o).collect();
            let (lrun, lstarts) = decompose(&x.region, x.piece_region);
            let lrun_b = lrun * x.elem;
            let unit = gcd(lrun_b, x.img_run_bytes);
            let total = img.len() as u64 * x.img_run_bytes;
            useful_bytes += total;
            let mut pos = 0u64;
            while pos < total {
                let s_off = img[(pos / x.img_run_bytes) as usize] + pos % x.img_run_bytes;
                let l_off =
                    x.piece_offset + lstarts[(pos / lrun_b) as usize] * x.elem + pos % lrun_b;
                match copies.last_mut() {
                    Some(c)
                        if c.rank_index == x.rank_index
                            && c.staging_offset + c.len == s_off
                            && c.live_offset + c.len == l_off =>
                    {
                        c.len += unit
                    }
                    _ => copies.push(Copy {
                        rank_index: x.rank_index,
                        staging_offset: s_off,
                        live_offset: l_off,
                        len: unit,
                    }),
                }
                pos += unit;
            }
            let mut segments: Vec<(u64, u64)> = Vec::new();
            for &o in &img {
                match segments.last_mut() {
                    Some(sg) if sg.0 + sg.1 == o => sg.1 += x.img_run_bytes,
                    _ => segments.push((o, x.img_run_bytes)),
                }
            }
            match seen_verify.entry((x.source, x.digest, segments.clone())) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    let v = &mut verify[*e.get()];
                    if v.dest_rank != x.dest_rank && !v.shared_with.contains(&x.dest_rank) {
                        v.shared_with.push(x.dest_rank);
                    }
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(verify.len());
                    verify.push(VerifyItem {
                        source: x.source,
                        tensor: x.tensor.to_string(),
                        dest_rank: x.dest_rank,
                        shared_with: Vec::new(),
                        region: x.region.clone(),
                        digest: x.digest,
                        segments,
                    });
                }
            }
        }
    }
    let mut zero_fills = Vec::new();
    for (ri, rl) in dest.iter().enumerate() {
        for p in &rl.params {
            if let Some((o, l)) = p.zero_fill {
                if l > 0 {
                    zero_fills.push(ZeroFill {
                        rank_index: ri,
                        live_offset: o,
                        len: l,
                    });
                }
            }
        }
    }
    let as_copies: Vec<crate::plan::Copy> = copies
        .iter()
        .map(|c| crate::plan::Copy::single(c.rank_index, c.staging_offset, c.live_offset, c.len))
        .collect();
    prove_coverage(dest, &as_copies, &zero_fills)?;
    let predicted_seconds = cost.seconds(reads.len() as u64, wire_bytes);
    Ok(RefPlan {
        reads,
        staging_bytes,
        copies,
        zero_fills,
        verify,
        choices,
        useful_bytes,
        wire_bytes,
        predicted_seconds,
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a.max(1)
    } else {
        gcd(b, a % b)
    }
}

/// The regions a source holding `shards` must digest for every rank of a destination layout
/// (`dest` = all ranks of that layout). Deterministic: shard order, then rank, then piece order.
///
/// # Errors
/// [`Error::Overflow`] when a shard's size overflows.
pub(crate) fn cut_for_layout(
    shards: &[crate::ShardEntry],
    dest: &[RankLayout],
) -> Result<Vec<Cut>, Error> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (hi, s) in shards.iter().enumerate() {
        let elem = s.dtype.size_bytes();
        s.shard
            .numel()
            .and_then(|n| n.checked_mul(elem))
            .ok_or(Error::Overflow {
                what: "shard bytes",
                tensor: s.tensor.clone(),
            })?;
        for rl in dest {
            for p in &rl.params {
                for piece in &p.pieces {
                    if piece.tensor != s.tensor {
                        continue;
                    }
                    let Some(region) = s.shard.intersect(&piece.region) else {
                        continue;
                    };
                    if !seen.insert((hi, rl.rank, region.clone())) {
                        continue;
                    }
                    let (run, starts) = decompose(&region, &s.shard);
                    out.push(Cut {
                        shard: hi,
                        dest_rank: rl.rank,
                        tensor: s.tensor.clone(),
                        region,
                        run_bytes: run * elem,
                        run_offsets: starts.iter().map(|st| st * elem).collect(),
                    });
                }
            }
        }
    }
    Ok(out)
}
