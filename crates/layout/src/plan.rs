//! Transfer planning: for the ranks one worker holds, which bytes to READ from which source, where
//! they land in the worker's staging buffer, how they are verified, and how apply copies them into
//! the live buffers.
//!
//! The planner intersects every destination piece with every source shard of the same tensor, then
//! chooses, per (tensor, source shard), the cheapest of three strategies under a [`CostModel`]
//! (`descriptors x per_descriptor_s + bytes / wire_gbps`):
//! - [`Strategy::Exact`]: the exact contiguous runs of the intersection in the source's memory,
//!   deduplicated and coalesced across all ranks of the worker (a worker holding every TP rank of
//!   a row-parallel weight pulls whole rows);
//! - [`Strategy::Superset`]: one contiguous span of the source shard covering every intersection,
//!   extra bytes included; apply picks the rows out locally;
//! - [`Strategy::Packed`]: regions the publisher packed contiguously for this destination layout.
//!
//! Wire runs are laid out in staging in (source, address) order, so runs adjacent at the source
//! coalesce into one NIXL descriptor. Apply copies staged bytes into the live buffers; vocab padding
//! rows are zero-filled. [`plan`] proves that every live byte of every rank is written exactly
//! once and fails closed naming the parameter otherwise.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::{Digest, Error, RankLayout, SourceManifest, TensorBox};

/// Measured costs of the data plane and of the local work per staged segment, inputs to the
/// planner.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Fixed cost of one READ descriptor (seconds).
    pub per_descriptor_s: f64,
    /// Streaming bandwidth of the wire (GB/s, 1e9 bytes per second).
    pub wire_gbps: f64,
    /// Local cost of one staged segment (seconds): a strided region is verified and applied one
    /// row at a time, a packed one in a single piece.
    #[serde(default)]
    pub per_segment_s: f64,
}

impl Default for CostModel {
    /// The UCX-over-shared-memory numbers measured on the reference CPU machine (FACTS.md):
    /// 2.5 us per descriptor, 10.5 GB/s; 50 ns per staged segment.
    fn default() -> Self {
        CostModel {
            per_descriptor_s: 2.5e-6,
            wire_gbps: 10.5,
            per_segment_s: 5e-8,
        }
    }
}

impl CostModel {
    /// Predicted seconds for `descriptors` reads moving `bytes` in total.
    pub fn seconds(&self, descriptors: u64, bytes: u64) -> f64 {
        descriptors as f64 * self.per_descriptor_s + bytes as f64 / (self.wire_gbps.max(1e-9) * 1e9)
    }

    /// As [`CostModel::seconds`], plus `segments` staged segments of local work.
    pub fn seconds_with_segments(&self, descriptors: u64, bytes: u64, segments: u64) -> f64 {
        self.seconds(descriptors, bytes) + segments as f64 * self.per_segment_s
    }
}

/// How the bytes of one (tensor, source shard) are pulled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Strategy {
    /// Exact runs of the source shard.
    Exact,
    /// One contiguous superset span, repacked locally at apply.
    Superset,
    /// Regions packed by the publisher for this destination layout.
    Packed,
}

impl Strategy {
    /// Lowercase name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Exact => "exact",
            Strategy::Superset => "superset",
            Strategy::Packed => "packed",
        }
    }
}

/// One NIXL READ descriptor: `len` bytes from `src_addr` in source `source` (an index into the
/// manifests given to [`plan`]) into the staging buffer at `staging_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Read {
    /// Index of the source manifest.
    pub source: usize,
    /// Source virtual address.
    pub src_addr: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the staging buffer.
    pub staging_offset: u64,
}

/// One apply copy: staged bytes into a rank's live buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy {
    /// Index of the rank in the `dest` slice given to [`plan`].
    pub rank_index: usize,
    /// Offset in the staging buffer.
    pub staging_offset: u64,
    /// Offset in the rank's live buffer.
    pub live_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A zero-filled range of a rank's live buffer (vocab padding rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroFill {
    /// Index of the rank in the `dest` slice.
    pub rank_index: usize,
    /// Offset in the rank's live buffer.
    pub live_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One digest check after the pull: blake3 over `segments` of the staging buffer, in order, must
/// equal `digest` (which the source published for `region` of `tensor` cut for `dest_rank`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyItem {
    /// Index of the source manifest.
    pub source: usize,
    /// Checkpoint tensor name.
    pub tensor: String,
    /// Destination rank the region was cut for.
    pub dest_rank: u32,
    /// Other destination ranks of this worker whose identical region is served by the same
    /// staged bytes (replicated tensors are pulled and verified once).
    pub shared_with: Vec<u32>,
    /// The region (global coordinates).
    pub region: TensorBox,
    /// Expected digest.
    pub digest: Digest,
    /// (staging offset, length) segments in row-major order of the region.
    pub segments: Vec<(u64, u64)>,
}

/// The strategy chosen for one (tensor, source shard) and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Checkpoint tensor name.
    pub tensor: String,
    /// Source index.
    pub source: usize,
    /// Chosen strategy.
    pub strategy: Strategy,
    /// Descriptors it needs (before cross-tensor coalescing).
    pub descriptors: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// Predicted seconds of every candidate: (strategy, seconds).
    pub candidates: Vec<(Strategy, f64)>,
}

/// A complete plan for one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Coalesced READ descriptors, in (source, address) order.
    pub reads: Vec<Read>,
    /// Size of the staging buffer (bytes).
    pub staging_bytes: u64,
    /// Apply copies, coalesced.
    pub copies: Vec<Copy>,
    /// Zero fills.
    pub zero_fills: Vec<ZeroFill>,
    /// Digest checks.
    pub verify: Vec<VerifyItem>,
    /// Per (tensor, source) strategy choices.
    pub choices: Vec<Choice>,
    /// Live bytes written from pulled data (destination bytes, padding excluded).
    pub useful_bytes: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// The cost model's prediction for the reads (seconds).
    pub predicted_seconds: f64,
}

impl Plan {
    /// Number of pieces per strategy (for reports).
    pub fn strategy_counts(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for c in &self.choices {
            *m.entry(c.strategy.as_str().to_string()).or_insert(0) += 1;
        }
        m
    }
}

/// Row-major runs of `inner` inside a dense row-major `outer` box: (elements per run, start of
/// each run in elements from `outer`'s origin), in row-major order of `inner`.
pub fn decompose(inner: &TensorBox, outer: &TensorBox) -> (u64, Vec<u64>) {
    let n = inner.ndim();
    if n == 0 {
        return (1, vec![0]);
    }
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * outer.local_shape[d + 1];
    }
    let mut k = n - 1;
    while k > 0 && inner.local_shape[k] == outer.local_shape[k] {
        k -= 1;
    }
    let run = inner.local_shape[k] * stride[k];
    let base: u64 = (0..n)
        .map(|d| (inner.global_offset[d] - outer.global_offset[d]) * stride[d])
        .sum();
    let count: u64 = inner.local_shape[..k].iter().product();
    let mut starts = Vec::with_capacity(count as usize);
    let mut idx = vec![0u64; k];
    for _ in 0..count {
        let off: u64 = (0..k).map(|d| idx[d] * stride[d]).sum();
        starts.push(base + off);
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < inner.local_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    (run, starts)
}

/// Checks a manifest's shards: box inside the global shape, `len == numel * dtype size`, no
/// address overflow.
///
/// # Errors
/// [`Error::BadManifest`] naming the slot and tensor.
pub fn validate_manifest(m: &SourceManifest) -> Result<(), Error> {
    for s in &m.shards {
        let bad = |reason: String| Error::BadManifest {
            slot: m.slot,
            tensor: s.tensor.clone(),
            reason,
        };
        if !s.shard.fits_in(&s.global_shape)
            || s.shard.global_offset.len() != s.shard.local_shape.len()
        {
            return Err(bad(format!(
                "box {} is outside shape {:?}",
                s.shard, s.global_shape
            )));
        }
        let bytes = s
            .shard
            .numel()
            .and_then(|n| n.checked_mul(s.dtype.size_bytes()))
            .ok_or_else(|| bad("size overflows u64".into()))?;
        if bytes != s.len {
            return Err(bad(format!("len {} != numel x dtype size {bytes}", s.len)));
        }
        if s.addr.checked_add(s.len).is_none() {
            return Err(bad("addr + len overflows".into()));
        }
    }
    for p in &m.pieces {
        if let Some(a) = p.packed_addr {
            let ok = p
                .region
                .numel()
                .and_then(|n| n.checked_mul(8))
                .and_then(|n| a.checked_add(n))
                .is_some();
            if !ok {
                return Err(Error::BadManifest {
                    slot: m.slot,
                    tensor: p.tensor.clone(),
                    reason: "packed region overflows".into(),
                });
            }
        }
    }
    Ok(())
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
pub fn plan(
    dest: &[RankLayout],
    sources: &[SourceManifest],
    cost: &CostModel,
) -> Result<Plan, Error> {
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

    // 1. Intersections, grouped by (source, shard).
    let mut groups: BTreeMap<(usize, usize), Vec<Isect<'_>>> = BTreeMap::new();
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
                        return Err(Error::MissingTensor {
                            tensor: piece.tensor.clone(),
                            reason: format!(
                                "source slot {} published no digest for region {region} of layout {} rank {}",
                                sources[si].slot, rl.layout, rl.rank
                            ),
                        });
                    };
                    let elem = s.dtype.size_bytes();
                    let (run, starts) = decompose(&region, &s.shard);
                    let src_runs = starts.iter().map(|st| s.addr + st * elem).collect();
                    groups.entry((si, hi)).or_default().push(Isect {
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
    for isects in groups.values() {
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
    prove_coverage(dest, &copies, &zero_fills)?;
    let predicted_seconds = cost.seconds(reads.len() as u64, wire_bytes);
    Ok(Plan {
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

/// Checks that copies and zero fills write every byte of every rank's live buffer exactly once.
///
/// # Errors
/// [`Error::CoverageGap`] or [`Error::Overlap`] naming the parameter and byte range.
pub fn prove_coverage(
    dest: &[RankLayout],
    copies: &[Copy],
    zero_fills: &[ZeroFill],
) -> Result<(), Error> {
    let mut per_rank: Vec<Vec<(u64, u64)>> = vec![Vec::new(); dest.len()];
    for c in copies {
        if let Some(v) = per_rank.get_mut(c.rank_index) {
            v.push((c.live_offset, c.len));
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
                .find(|p| o >= p.offset && o < p.offset + p.len.max(1))
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
                    end: cursor.min(o + l),
                });
            }
            cursor = o + l;
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

/// One region a source must digest (and may pack) for a destination rank: the intersection of
/// one of its shards with one piece of the destination rank, as runs of the shard's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cut {
    /// Index of the shard in the source's shard list.
    pub shard: usize,
    /// Destination rank.
    pub dest_rank: u32,
    /// Checkpoint tensor name.
    pub tensor: String,
    /// Intersection box (global coordinates).
    pub region: TensorBox,
    /// Bytes per run.
    pub run_bytes: u64,
    /// Byte offset of each run within the shard, in row-major order of `region`.
    pub run_offsets: Vec<u64>,
}

impl Cut {
    /// Total bytes of the region.
    pub fn bytes(&self) -> u64 {
        self.run_bytes * self.run_offsets.len() as u64
    }
}

/// The regions a source holding `shards` must digest for every rank of a destination layout
/// (`dest` = all ranks of that layout). Deterministic: shard order, then rank, then piece order.
///
/// # Errors
/// [`Error::Overflow`] when a shard's size overflows.
pub fn cut_for_layout(
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

/// Which cuts the publisher packs: every strided cut (more than one run in the shard) whose
/// destination rank some registered worker holds. A packed region is pulled, verified and applied
/// as one contiguous piece instead of one row at a time; its cost is one copy at the source per
/// version, shared by every worker of that layout. Returns one flag per cut.
pub fn pack_marks(cuts: &[Cut], rank_sets: &[Vec<u32>]) -> Vec<bool> {
    cuts.iter()
        .map(|c| c.run_offsets.len() > 1 && rank_sets.iter().any(|rs| rs.contains(&c.dest_rank)))
        .collect()
}

/// Executes a plan with plain memory copies, for tests and for checking plans without NIXL.
///
/// `memory(source, addr, len)` returns the source's bytes. Returns the live buffers, one per rank
/// of `dest`, or the first failed verification as `Err((tensor, dest_rank))`.
pub fn execute_in_memory<'m>(
    plan: &Plan,
    dest: &[RankLayout],
    memory: impl Fn(usize, u64, u64) -> Option<&'m [u8]>,
) -> Result<Vec<Vec<u8>>, (String, u32)> {
    let mut staging = vec![0u8; plan.staging_bytes as usize];
    for r in &plan.reads {
        let src = memory(r.source, r.src_addr, r.len).ok_or_else(|| (format!("read {r:?}"), 0))?;
        staging[r.staging_offset as usize..(r.staging_offset + r.len) as usize]
            .copy_from_slice(src);
    }
    for v in &plan.verify {
        let mut h = blake3::Hasher::new();
        for &(o, l) in &v.segments {
            h.update(&staging[o as usize..(o + l) as usize]);
        }
        if Digest::from(h.finalize()) != v.digest {
            return Err((v.tensor.clone(), v.dest_rank));
        }
    }
    let mut live: Vec<Vec<u8>> = dest
        .iter()
        .map(|d| vec![0xAA; d.total_bytes as usize])
        .collect();
    for c in &plan.copies {
        live[c.rank_index][c.live_offset as usize..(c.live_offset + c.len) as usize]
            .copy_from_slice(
                &staging[c.staging_offset as usize..(c.staging_offset + c.len) as usize],
            );
    }
    for z in &plan.zero_fills {
        live[z.rank_index][z.live_offset as usize..(z.live_offset + z.len) as usize].fill(0);
    }
    Ok(live)
}

/// Manifests of every source rank of `trainer` as publishers would publish them for destination
/// layout `dest` (addresses synthetic: source `r` at `(r + 1) << 40`, digests zero), with strided
/// cuts packed for the given worker rank sets (see [`pack_marks`]). For offline planning
/// (`mx plan`) and planner benchmarks; no bytes exist behind the addresses.
///
/// # Errors
/// [`Error::ImpossibleLayout`] and the other errors of [`crate::rank_layouts`].
pub fn synthetic_manifests(
    model: &crate::ModelInfo,
    trainer: crate::LayoutSpec,
    dest: crate::LayoutSpec,
    pack_for: &[Vec<u32>],
) -> Result<Vec<SourceManifest>, Error> {
    let dest_layouts = crate::rank_layouts(model, dest)?;
    let mut out = Vec::with_capacity(trainer.world_size as usize);
    for r in 0..trainer.world_size {
        let rl = crate::rank_layout(model, trainer, r)?;
        let base = (u64::from(r) + 1) << 40;
        let shards = rl.shard_entries(base);
        let cuts = cut_for_layout(&shards, &dest_layouts)?;
        let marks = pack_marks(&cuts, pack_for);
        let mut cursor = base + rl.total_bytes;
        let pieces = cuts
            .into_iter()
            .zip(marks)
            .map(|(c, m)| {
                let packed_addr = m.then(|| {
                    let a = cursor;
                    cursor += c.bytes();
                    a
                });
                crate::DestPiece {
                    layout: dest,
                    dest_rank: c.dest_rank,
                    tensor: c.tensor,
                    region: c.region,
                    digest: Digest::default(),
                    packed_addr,
                }
            })
            .collect();
        out.push(SourceManifest {
            slot: r,
            layout: trainer,
            agent_name: format!("synthetic-{r}"),
            agent_metadata: Vec::new(),
            shards,
            pieces,
            pack_seconds: 0.0,
        });
    }
    Ok(out)
}
