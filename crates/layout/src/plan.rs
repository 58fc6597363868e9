//! Transfer planning: for the ranks one worker holds, which bytes to READ from which source, where
//! they land in the worker's staging buffer, how they are verified, and how apply copies them into
//! the live buffers.
//!
//! The planner intersects every destination piece with the source shards of the same tensor that
//! overlap it, found through a [`SourceIndex`] built once over the manifests (shards sorted by box
//! with a dim-0 interval search, published pieces stored with the shard they were cut from), then
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
//!
//! Cost: building the index is linear in the manifests (about 1.7 s for the 484k shards and 1.5M
//! pieces of Kimi-K2 on 256 FSDP ranks); one plan is linear in the intersections it finds (see
//! [`crate::frontier::fleet_plan_report`] for measurements). A plan reads the index front to back
//! (each destination rank's published pieces are stored together, in shard order), keeps one
//! record per intersection, which is regrouped in place and finally becomes that intersection's
//! [`VerifyItem`] where it lies, and emits strided copies and segments in closed form (no walk
//! over rows): at frontier scale its time goes mostly to first touches of fresh memory and cache
//! misses, not to arithmetic.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{
    DType, DestPiece, Digest, Error, LayoutSpec, Piece, RankLayout, ShardEntry, SourceManifest,
    TensorBox,
};

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

/// One apply copy: `count` rows of `len` staged bytes into a rank's live buffer, row `i` (from 0)
/// from staging offset `staging_offset + i * staging_stride` to live offset
/// `live_offset + i * live_stride` (all in bytes). A run of rows with constant strides (a strided
/// region applied row by row) is one copy; `count == 1` is a single contiguous copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy {
    /// Index of the rank in the `dest` slice given to [`plan`].
    pub rank_index: usize,
    /// Offset of the first row in the staging buffer (bytes).
    pub staging_offset: u64,
    /// Offset of the first row in the rank's live buffer (bytes).
    pub live_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Rows (at least 1; plans serialized before strided copies have none: 1).
    #[serde(default = "one")]
    pub count: u64,
    /// Bytes from one row's staging offset to the next (0 when `count == 1`).
    #[serde(default)]
    pub staging_stride: u64,
    /// Bytes from one row's live offset to the next (0 when `count == 1`).
    #[serde(default)]
    pub live_stride: u64,
}

fn one() -> u64 {
    1
}

impl Copy {
    /// A single contiguous copy of `len` bytes (one row).
    pub fn single(rank_index: usize, staging_offset: u64, live_offset: u64, len: u64) -> Copy {
        Copy {
            rank_index,
            staging_offset,
            live_offset,
            len,
            count: 1,
            staging_stride: 0,
            live_stride: 0,
        }
    }

    /// (staging offset, live offset) of row `i`; `None` when `i >= count` or an offset
    /// overflows u64.
    pub fn row(&self, i: u64) -> Option<(u64, u64)> {
        if i >= self.count {
            return None;
        }
        let s = i
            .checked_mul(self.staging_stride)
            .and_then(|d| self.staging_offset.checked_add(d))?;
        let l = i
            .checked_mul(self.live_stride)
            .and_then(|d| self.live_offset.checked_add(d))?;
        Some((s, l))
    }

    /// (staging offset, live offset) of every row, in order; stops early at the first row whose
    /// offset overflows u64 (a plan from [`plan`] has none).
    pub fn rows(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map_while(|i| self.row(i))
    }

    /// Bytes copied (`count * len`); `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.count.checked_mul(self.len)
    }

    /// Whether the rows are contiguous in the live buffer (one row, or `live_stride == len`):
    /// then the copy writes the single live range `live_offset..live_offset + bytes()`.
    pub fn live_contiguous(&self) -> bool {
        self.count <= 1 || self.live_stride == self.len
    }
}

/// Apply copies as a plan emits them, from rows appended one at a time: a row continuing the
/// previous one (same rank, contiguous at both ends) extends it, and rows of equal length at
/// constant (non-negative) strides form one strided [`Copy`]. Expanding the result row by row
/// gives exactly the list of contiguous copies merged the same way without strides.
struct CopySink {
    out: Vec<Copy>,
    /// The last contiguous copy, still growing: (rank, staging, live, len).
    pending: Option<(usize, u64, u64, u64)>,
}

impl CopySink {
    fn new(capacity: usize) -> CopySink {
        CopySink {
            out: Vec::with_capacity(capacity),
            pending: None,
        }
    }

    fn push(&mut self, rank: usize, s: u64, l: u64, len: u64) {
        if let Some(p) = &mut self.pending {
            if p.0 == rank && p.1.wrapping_add(p.3) == s && p.2.wrapping_add(p.3) == l {
                p.3 = p.3.wrapping_add(len);
                return;
            }
            let p = *p;
            self.flush(p);
        }
        self.pending = Some((rank, s, l, len));
    }

    fn flush(&mut self, (rank, s, l, len): (usize, u64, u64, u64)) {
        if let Some(c) = self.out.last_mut() {
            if c.rank_index == rank && c.len == len {
                if c.count == 1 {
                    if let (Some(ds), Some(dl)) = (
                        s.checked_sub(c.staging_offset),
                        l.checked_sub(c.live_offset),
                    ) {
                        c.count = 2;
                        c.staging_stride = ds;
                        c.live_stride = dl;
                        return;
                    }
                } else if c.row(c.count - 1).is_some_and(|(ps, pl)| {
                    ps.checked_add(c.staging_stride) == Some(s)
                        && pl.checked_add(c.live_stride) == Some(l)
                }) {
                    c.count += 1;
                    return;
                }
            }
        }
        self.out.push(Copy::single(rank, s, l, len));
    }

    /// As `count` calls of [`CopySink::push`], row `i` at staging `s + i * ss` and live
    /// `l + i * ls` (wrapping): row by row until the rows settle into one strided copy, then the
    /// rest at once.
    fn push_rows(
        &mut self,
        rank: usize,
        (s, ss): (u64, u64),
        (l, ls): (u64, u64),
        len: u64,
        count: u64,
    ) {
        let row = |i: u64| {
            (
                s.wrapping_add(i.wrapping_mul(ss)),
                l.wrapping_add(i.wrapping_mul(ls)),
            )
        };
        let last = count.saturating_sub(1);
        // Every row without overflow (then each row extends the strided copy the previous
        // ones formed), and rows that do not merge into one contiguous run.
        let regular = !(ss == len && ls == len)
            && last
                .checked_mul(ss)
                .and_then(|d| s.checked_add(d))
                .is_some()
            && last
                .checked_mul(ls)
                .and_then(|d| l.checked_add(d))
                .is_some();
        let mut i = 0;
        while i < count {
            let (si, li) = row(i);
            self.push(rank, si, li, len);
            i += 1;
            if regular && i >= 3 && i < count && self.pending == Some((rank, si, li, len)) {
                let (sp, lp) = row(i - 2);
                if let Some(c) = self.out.last_mut() {
                    if c.rank_index == rank
                        && c.len == len
                        && c.count >= 2
                        && c.staging_stride == ss
                        && c.live_stride == ls
                        && c.row(c.count - 1) == Some((sp, lp))
                    {
                        // Rows i..=last each flush the previous one into `c`.
                        c.count += count - i;
                        let (sl, ll) = row(last);
                        self.pending = Some((rank, sl, ll, len));
                        return;
                    }
                }
            }
        }
    }

    fn finish(mut self) -> Vec<Copy> {
        if let Some(p) = self.pending.take() {
            self.flush(p);
        }
        self.out
    }
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

/// `count` equal runs of `len` bytes of the staging buffer, run `i` (from 0) at
/// `offset + i * stride` (bytes): a strided region staged row by row is one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Segment {
    /// Staging offset of the first run.
    pub offset: u64,
    /// Bytes per run.
    pub len: u64,
    /// Runs (at least 1).
    #[serde(default = "one")]
    pub count: u64,
    /// Bytes from one run's offset to the next (0 when `count == 1`).
    #[serde(default)]
    pub stride: u64,
}

impl Segment {
    /// (staging offset, length) of every run, in order; stops early at the first run whose
    /// offset overflows u64 (a plan from [`plan`] has none).
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map_while(|i| {
            i.checked_mul(self.stride)
                .and_then(|d| self.offset.checked_add(d))
                .map(|o| (o, self.len))
        })
    }
}

/// Segments from runs appended one at a time: a run continuing the previous one extends it,
/// runs of equal length at a constant (non-negative) stride form one [`Segment`]. Expanding the
/// result gives exactly the runs merged the same way without strides.
#[derive(Default)]
struct SegmentSink {
    out: Vec<Segment>,
    /// The last contiguous run, still growing: (offset, len).
    pending: Option<(u64, u64)>,
}

impl SegmentSink {
    fn push(&mut self, o: u64, len: u64) {
        if let Some(p) = &mut self.pending {
            if p.0.wrapping_add(p.1) == o {
                p.1 = p.1.wrapping_add(len);
                return;
            }
            let p = *p;
            self.flush(p);
        }
        self.pending = Some((o, len));
    }

    fn flush(&mut self, (o, len): (u64, u64)) {
        if let Some(g) = self.out.last_mut() {
            if g.len == len {
                if g.count == 1 {
                    if let Some(d) = o.checked_sub(g.offset) {
                        g.count = 2;
                        g.stride = d;
                        return;
                    }
                } else if (g.count - 1)
                    .checked_mul(g.stride)
                    .and_then(|x| x.checked_add(g.offset))
                    .and_then(|x| x.checked_add(g.stride))
                    == Some(o)
                {
                    g.count += 1;
                    return;
                }
            }
        }
        self.out.push(Segment {
            offset: o,
            len,
            count: 1,
            stride: 0,
        });
    }

    /// As `count` calls of [`SegmentSink::push`], run `i` at `o + i * st` (wrapping), `len`
    /// bytes each: run by run until the runs settle into one strided segment, then the rest at
    /// once.
    fn push_runs(&mut self, o: u64, st: u64, len: u64, count: u64) {
        let run = |i: u64| o.wrapping_add(i.wrapping_mul(st));
        let last = count.saturating_sub(1);
        let regular = st != len
            && last
                .checked_mul(st)
                .and_then(|d| o.checked_add(d))
                .is_some();
        let mut i = 0;
        while i < count {
            let oi = run(i);
            self.push(oi, len);
            i += 1;
            if regular && i >= 3 && i < count && self.pending == Some((oi, len)) {
                let prev = run(i - 2);
                if let Some(g) = self.out.last_mut() {
                    if g.len == len
                        && g.count >= 2
                        && g.stride == st
                        && (g.count - 1)
                            .checked_mul(g.stride)
                            .and_then(|x| x.checked_add(g.offset))
                            == Some(prev)
                    {
                        g.count += count - i;
                        self.pending = Some((run(last), len));
                        return;
                    }
                }
            }
        }
    }

    /// The segments; the sink is left empty for reuse (keeping its buffer when one segment is
    /// taken).
    fn take(&mut self) -> Segments {
        if let Some(p) = self.pending.take() {
            self.flush(p);
        }
        if let [g] = self.out.as_slice() {
            let g = *g;
            self.out.clear();
            return Segments(SegmentsRepr::One(g));
        }
        Segments::from(std::mem::take(&mut self.out))
    }
}

/// The staging segments of a [`VerifyItem`], in order: one held inline (the common case, a
/// region staged in one piece or as one strided run), more on the heap. Derefs to a slice of
/// [`Segment`]s; serialized as a list.
#[derive(Clone, Serialize, Deserialize)]
#[serde(from = "Vec<Segment>", into = "Vec<Segment>")]
pub struct Segments(SegmentsRepr);

#[derive(Clone)]
enum SegmentsRepr {
    One(Segment),
    Many(Vec<Segment>),
}

impl Default for Segments {
    fn default() -> Self {
        Segments(SegmentsRepr::Many(Vec::new()))
    }
}

impl std::ops::Deref for Segments {
    type Target = [Segment];

    fn deref(&self) -> &[Segment] {
        match &self.0 {
            SegmentsRepr::One(g) => std::slice::from_ref(g),
            SegmentsRepr::Many(v) => v,
        }
    }
}

impl From<Vec<Segment>> for Segments {
    fn from(v: Vec<Segment>) -> Segments {
        match v.as_slice() {
            [g] => Segments(SegmentsRepr::One(*g)),
            _ => Segments(SegmentsRepr::Many(v)),
        }
    }
}

impl From<Segments> for Vec<Segment> {
    fn from(s: Segments) -> Vec<Segment> {
        match s.0 {
            SegmentsRepr::One(g) => vec![g],
            SegmentsRepr::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a Segments {
    type Item = &'a Segment;
    type IntoIter = std::slice::Iter<'a, Segment>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Segments {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Segments {}

impl Hash for Segments {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (**self).hash(h);
    }
}

impl std::fmt::Debug for Segments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// One digest check after the pull: blake3 over the runs of `segments` of the staging buffer, in
/// order, must equal the digest of the piece `sources[source].pieces[piece]` (a [`DestPiece`]:
/// the region of `tensor` the source cut for `dest_rank`, and its digest), `sources` being the
/// manifests the plan was made from. The item names the piece instead of copying its region and
/// digest: a frontier-scale plan has hundreds of thousands of items.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyItem {
    /// Index of the source manifest.
    pub source: usize,
    /// Index of the published piece in that manifest's `pieces`.
    pub piece: u32,
    /// The checkpoint tensor: its name is `Plan::tensors[tensor]` ([`Plan::tensor_name`]).
    pub tensor: u32,
    /// Destination rank the region was cut for.
    pub dest_rank: u32,
    /// Other destination ranks of this worker whose identical region is served by the same
    /// staged bytes (replicated tensors are pulled and verified once).
    pub shared_with: Vec<u32>,
    /// Staging segments in row-major order of the region.
    pub segments: Segments,
}

impl VerifyItem {
    /// The published piece this item checks (its tensor, region and expected digest), looked up
    /// in `sources`, the manifests the plan was made from; `None` when they do not have it
    /// (other manifests than the plan's).
    pub fn published<'m>(&self, sources: &'m [SourceManifest]) -> Option<&'m DestPiece> {
        let i = usize::try_from(self.piece).ok()?;
        sources.get(self.source)?.pieces.get(i)
    }

    /// (staging offset, length) of every run of every segment: the bytes the digest covers, in
    /// order.
    pub fn byte_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segments.iter().flat_map(Segment::runs)
    }
}

/// The predicted seconds of every strategy considered for one (tensor, source shard), in the
/// order considered (exact, packed when available, superset): at most three, inline (seconds
/// and strategies in separate arrays, so that the many choices of a plan stay small).
/// Serialized as a list of (strategy, seconds).
#[derive(Clone, Copy, Serialize, Deserialize)]
#[serde(into = "Vec<(Strategy, f64)>", try_from = "Vec<(Strategy, f64)>")]
pub struct Candidates {
    seconds: [f64; 3],
    strategies: [Strategy; 3],
    len: u8,
}

impl Candidates {
    /// Number of candidates (at most three).
    pub fn len(&self) -> usize {
        usize::from(self.len).min(3)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The candidates, in order: (strategy, predicted seconds).
    pub fn iter(&self) -> impl Iterator<Item = (Strategy, f64)> + '_ {
        self.strategies
            .iter()
            .copied()
            .zip(self.seconds.iter().copied())
            .take(self.len())
    }

    /// The candidates, in order, as a list of (strategy, predicted seconds).
    pub fn to_vec(&self) -> Vec<(Strategy, f64)> {
        self.iter().collect()
    }

    /// The first three of `list`.
    fn new(list: impl IntoIterator<Item = (Strategy, f64)>) -> Candidates {
        let mut c = Candidates {
            seconds: [0.0; 3],
            strategies: [Strategy::Exact; 3],
            len: 0,
        };
        for (k, (st, secs)) in (0..3).zip(list) {
            c.strategies[k] = st;
            c.seconds[k] = secs;
            c.len += 1;
        }
        c
    }
}

impl PartialEq for Candidates {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl std::fmt::Debug for Candidates {
    /// As the list of (strategy, seconds).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl From<Candidates> for Vec<(Strategy, f64)> {
    fn from(c: Candidates) -> Self {
        c.to_vec()
    }
}

impl TryFrom<Vec<(Strategy, f64)>> for Candidates {
    type Error = String;

    fn try_from(v: Vec<(Strategy, f64)>) -> Result<Self, Self::Error> {
        if v.len() > 3 {
            return Err(format!("{} candidates, at most 3", v.len()));
        }
        Ok(Candidates::new(v))
    }
}

/// The strategy chosen for one (tensor, source shard) and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The checkpoint tensor: its name is `Plan::tensors[tensor]` ([`Plan::tensor_name`]).
    pub tensor: u32,
    /// Source index.
    pub source: usize,
    /// Chosen strategy.
    pub strategy: Strategy,
    /// Descriptors it needs (before cross-tensor coalescing).
    pub descriptors: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// Predicted seconds of every candidate: (strategy, seconds).
    pub candidates: Candidates,
}

/// Serde for a list of `Arc<str>` as a list of plain strings (without serde's `rc` feature).
mod arc_strs {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[Arc<str>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|n| &**n))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Arc<str>>, D::Error> {
        Vec::<String>::deserialize(d).map(|v| v.into_iter().map(Arc::from).collect())
    }
}

/// A complete plan for one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Coalesced READ descriptors, in (source, address) order.
    pub reads: Vec<Read>,
    /// Size of the staging buffer (bytes).
    pub staging_bytes: u64,
    /// Apply copies, coalesced; runs of rows at constant strides are one strided copy.
    pub copies: Vec<Copy>,
    /// Zero fills.
    pub zero_fills: Vec<ZeroFill>,
    /// Digest checks.
    pub verify: Vec<VerifyItem>,
    /// Per (tensor, source) strategy choices.
    pub choices: Vec<Choice>,
    /// The checkpoint tensors the digest checks and choices name, each once, in order of
    /// discovery: [`VerifyItem::tensor`] and [`Choice::tensor`] index this list (one shared name
    /// per tensor, not one per item).
    #[serde(with = "arc_strs")]
    pub tensors: Vec<Arc<str>>,
    /// Live bytes written from pulled data (destination bytes, padding excluded).
    pub useful_bytes: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// The cost model's prediction for the reads (seconds).
    pub predicted_seconds: f64,
}

impl Plan {
    /// The name of tensor `id` of [`Plan::tensors`] (as [`VerifyItem::tensor`] and
    /// [`Choice::tensor`] give it); empty for an id the plan does not have.
    pub fn tensor_name(&self, id: u32) -> &str {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.tensors.get(i))
            .map_or("", |n| n)
    }

    /// Number of pieces per strategy (for reports).
    pub fn strategy_counts(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for c in &self.choices {
            *m.entry(c.strategy.as_str().to_string()).or_insert(0) += 1;
        }
        m
    }

    /// Bytes of the plan's items in memory: each list's length times its item size, plus the
    /// heap each item owns (segments kept off line, `shared_with` lists; the tensor names,
    /// shared with the index, and spare capacity, which is never touched, are not counted). What planning
    /// writes to fresh memory at the least, for reports.
    pub fn approx_bytes(&self) -> u64 {
        use std::mem::size_of;
        let mut b = size_of::<Plan>()
            + self.reads.len() * size_of::<Read>()
            + self.copies.len() * size_of::<Copy>()
            + self.zero_fills.len() * size_of::<ZeroFill>()
            + self.verify.len() * size_of::<VerifyItem>()
            + self.choices.len() * size_of::<Choice>()
            + self.tensors.len() * size_of::<Arc<str>>();
        for v in &self.verify {
            b += v.shared_with.len() * size_of::<u32>();
            if let SegmentsRepr::Many(s) = &v.segments.0 {
                b += s.len() * size_of::<Segment>();
            }
        }
        b as u64
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

/// Run starts of an inner box inside a dense row-major outer box, in elements from the outer
/// box's origin: what [`decompose`] lists, without the list when the starts are evenly spaced
/// (every box split in at most one dim besides its outermost).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Runs {
    /// `count` runs at `first + i * stride`.
    Arith { first: u64, stride: u64, count: u64 },
    /// Explicit starts.
    List(Vec<u64>),
}

impl Runs {
    fn len(&self) -> u64 {
        match self {
            Runs::Arith { count, .. } => *count,
            Runs::List(v) => v.len() as u64,
        }
    }

    /// Start of run `i < len()`.
    fn get(&self, i: u64) -> u64 {
        match self {
            Runs::Arith { first, stride, .. } => first.wrapping_add(i.wrapping_mul(*stride)),
            Runs::List(v) => v.get(i as usize).copied().unwrap_or(0),
        }
    }
}

/// [`decompose`] of the box (`io`, `is`) inside the box (`oo`, `os`) (same number of dims), as
/// (elements per run, [`Runs`]). Arithmetic wraps like the release build of [`decompose`].
fn runs_in(io: &[u64], is: &[u64], oo: &[u64], os: &[u64]) -> (u64, Runs) {
    let n = is.len();
    if n == 0 || io.len() != n || oo.len() != n || os.len() != n {
        return (
            1,
            Runs::Arith {
                first: 0,
                stride: 0,
                count: 1,
            },
        );
    }
    let mut k = n - 1;
    while k > 0 && is[k] == os[k] {
        k -= 1;
    }
    if k <= 1 {
        // Strides from the innermost dim out; the run is is[k] * stride[k].
        let mut stride = 1u64;
        let mut base = 0u64;
        let (mut stride_k, mut stride_0) = (1u64, 1u64);
        for d in (0..n).rev() {
            if d == k {
                stride_k = stride;
            }
            if d == 0 {
                stride_0 = stride;
            }
            base = base.wrapping_add(io[d].wrapping_sub(oo[d]).wrapping_mul(stride));
            if d > 0 {
                stride = stride.wrapping_mul(os[d]);
            }
        }
        let run = is[k].wrapping_mul(stride_k);
        let (stride, count) = if k == 1 { (stride_0, is[0]) } else { (0, 1) };
        return (
            run,
            Runs::Arith {
                first: base,
                stride,
                count,
            },
        );
    }
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1].wrapping_mul(os[d + 1]);
    }
    let run = is[k].wrapping_mul(stride[k]);
    let base = (0..n).fold(0u64, |acc, d| {
        acc.wrapping_add(io[d].wrapping_sub(oo[d]).wrapping_mul(stride[d]))
    });
    let count = is[..k].iter().fold(1u64, |a, &x| a.wrapping_mul(x));
    let mut starts = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut idx = vec![0u64; k];
    for _ in 0..count {
        let off = (0..k).fold(0u64, |acc, d| {
            acc.wrapping_add(idx[d].wrapping_mul(stride[d]))
        });
        starts.push(base.wrapping_add(off));
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < is[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    (run, Runs::List(starts))
}

/// Appends the intersection of box (`ao`, `as_`) with box (`bo`, `bs`), as [`TensorBox::intersect`]
/// computes it, to `out` (offset, then shape); false, appending nothing, when empty or malformed.
fn intersect_into(ao: &[u64], as_: &[u64], bo: &[u64], bs: &[u64], out: &mut Vec<u64>) -> bool {
    let n = as_.len();
    if bs.len() != n || ao.len() != n || bo.len() != n {
        return false;
    }
    let lo = |d: usize| ao[d].max(bo[d]);
    let hi = |d: usize| (ao[d].saturating_add(as_[d])).min(bo[d].saturating_add(bs[d]));
    if (0..n).any(|d| hi(d) <= lo(d)) {
        return false;
    }
    out.extend((0..n).map(lo));
    out.extend((0..n).map(|d| hi(d) - lo(d)));
    true
}

/// Where the staged copy of an intersection's runs lies: image run `j` at (wire id, offset).
/// Wire ids and positions in the image list are 32-bit (a plan with more is an
/// [`Error::Overflow`]), so that an [`Isect`] stays two cache lines.
#[derive(Debug, Clone, Copy)]
enum Img {
    /// `count` runs, run `j` at (`wire`, `off0 + j * stride`).
    Affine {
        wire: u32,
        off0: u64,
        stride: u64,
        count: u64,
    },
    /// `count` runs listed at `start..` of the plan's flat image list.
    Flat { start: u32, count: u64 },
}

impl Img {
    fn count(&self) -> u64 {
        match self {
            Img::Affine { count, .. } | Img::Flat { count, .. } => *count,
        }
    }
}

/// Intersection of one destination piece with one source shard (128 bytes: a plan holds one per
/// (shard, destination piece) pair met, ~187k for a Kimi-K2 rank, in fresh memory).
struct Isect<'a> {
    /// The destination piece (tensor, region, live offset).
    piece: &'a Piece,
    /// Source address of the shard: run `i` of the region is at `src_base + runs.get(i) * elem`,
    /// `src_run_bytes` long.
    src_base: u64,
    /// Packed address of the published piece (meaningful when `has_packed`; copied: the index
    /// is cold by the time it is used).
    packed_addr: u64,
    src_run_bytes: u64,
    runs: Runs,
    /// After the strategy choice: the staging image, runs of [`Isect::img_run_bytes`].
    img: Img,
    /// Index of the destination rank in the plan's `dest`.
    rank_index: u32,
    /// Index of the source manifest.
    source: u32,
    /// The tensor: an index into the plan's list of tensor names.
    tensor: u32,
    /// The intersection box is `rdims[region_at..]` of the plan's flat box list: its offset,
    /// then its shape, as many dims as the piece's region.
    region_at: u32,
    /// Index of the published piece in its manifest.
    piece_index: u32,
    /// Bytes per element.
    elem: u32,
    /// Whether the published piece has a packed address.
    has_packed: bool,
    /// Whether the strategy staged the region packed (one image run of every source run).
    staged_packed: bool,
}

// Kept at two cache lines: a plan writes one per intersection to fresh memory.
const _: () = assert!(std::mem::size_of::<Isect<'static>>() <= 128);

impl Isect<'_> {
    /// (offset, shape) of the intersection box in the plan's flat box list.
    fn region<'d>(&self, rdims: &'d [u64]) -> (&'d [u64], &'d [u64]) {
        let n = self.piece.region.local_shape.len();
        let at = self.region_at as usize;
        let o = rdims.get(at..at + n).unwrap_or_default();
        let s = rdims.get(at + n..at + 2 * n).unwrap_or_default();
        (o, s)
    }

    /// Elements of the intersection box (0 on overflow, as [`TensorBox::numel`]).
    fn numel(&self, rdims: &[u64]) -> u64 {
        self.region(rdims)
            .1
            .iter()
            .try_fold(1u64, |a, &x| a.checked_mul(x))
            .unwrap_or(0)
    }

    /// Source address of run `i`.
    fn src_run(&self, i: u64) -> u64 {
        self.src_base
            .wrapping_add(self.runs.get(i).wrapping_mul(u64::from(self.elem)))
    }

    /// Bytes of one staging-image run: the source run, or every source run back to back when
    /// staged packed.
    fn img_run_bytes(&self) -> u64 {
        if self.staged_packed {
            self.runs.len().wrapping_mul(self.src_run_bytes)
        } else {
            self.src_run_bytes
        }
    }

    /// (addr, addr + len) of every source run, in order.
    fn src_spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.runs.len()).map(|i| {
            let a = self.src_run(i);
            (a, a + self.src_run_bytes)
        })
    }

    /// The runs are strictly increasing with gaps between them (one isect's runs then coalesce
    /// into exactly `len()` descriptors and merge into none of each other).
    fn runs_disjoint_gapped(&self) -> bool {
        match &self.runs {
            Runs::Arith { count, stride, .. } => {
                *count == 1
                    || stride
                        .checked_mul(u64::from(self.elem))
                        .is_some_and(|step| step > self.src_run_bytes)
            }
            Runs::List(_) => false,
        }
    }
}

/// The indices of `wire` runs (source, address, length) in the order of their values, stably
/// (equal runs in index order); every source is below `n_sources`. A stable counting sort by
/// source, then a check that each source's runs are in order already (a plan meets a source's
/// shards in the order they lie in its arena), sorting only the sources whose runs are not.
fn order_wires(wire: &[(usize, u64, u64)], n_sources: usize) -> Vec<usize> {
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
fn by_value(wire: &[(usize, u64, u64)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..wire.len()).collect();
    order.sort_by_key(|&i| wire[i]);
    order
}

/// Merges verification items with the same source, segments and digest (that of their published
/// pieces in `sources`) into the first of them, in order: a later one adds its destination rank to the first one's `shared_with` (unless it
/// is the first one's own rank or already listed) and is dropped. `heads[i]` is the first
/// staging offset of item `i`'s segments (`u64::MAX` for none): equal items have equal heads.
fn dedup_verify(verify: &mut Vec<VerifyItem>, heads: &[u64], sources: &[SourceManifest]) {
    if heads.len() != verify.len() || heads.windows(2).all(|w| w[0] < w[1]) {
        return;
    }
    let mut order: Vec<usize> = (0..heads.len()).collect();
    // Stable: items with one head stay in order.
    order.sort_by_key(|&i| heads[i]);
    let mut dup = vec![false; verify.len()];
    let mut k = 0;
    while k < order.len() {
        let h = heads[order[k]];
        let e = k + order[k..].partition_point(|&i| heads[i] == h);
        for a in k + 1..e {
            let i = order[a];
            let x = &verify[i];
            let rep = order[k..a].iter().copied().find(|&j| {
                let v = &verify[j];
                !dup[j]
                    && v.source == x.source
                    && v.segments == x.segments
                    && v.published(sources).map(|p| p.digest)
                        == x.published(sources).map(|p| p.digest)
            });
            if let Some(j) = rep {
                dup[i] = true;
                let r = x.dest_rank;
                let v = &mut verify[j];
                if v.dest_rank != r && !v.shared_with.contains(&r) {
                    v.shared_with.push(r);
                }
            }
        }
        k = e.max(k + 1);
    }
    let mut it = dup.into_iter();
    verify.retain(|_| !it.next().unwrap_or(false));
}

/// Reorders `v` so that `v[k]` becomes the old `v[perm[k]]`, in place (by swaps along each cycle
/// of the permutation). `perm` must be a permutation of `0..v.len()`; otherwise some items end
/// up elsewhere, without a panic.
fn permute_in_place<T>(v: &mut [T], perm: &[usize]) {
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
fn group_by_first_seen(keys: &[usize], bound: usize) -> Option<Vec<usize>> {
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
fn order_by_key(keys: &[usize], bound: usize) -> Vec<usize> {
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

/// A fast, non-cryptographic hasher (the rustc `FxHasher` mixing step) for the planner's internal
/// maps, whose keys are short tuples of integers, tensor ids and boxes. Not HashDoS-resistant:
/// the keys come from manifests the fleet's own trainer ranks publish.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl FxHasher {
    const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(Self::K);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        // The product's low bits depend only on the last word's low bits, and hashbrown picks
        // buckets by the low bits: bring the well-mixed high bits down.
        self.0.rotate_left(26)
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// A 64-bit hash of a tensor name (FxHasher over its bytes), for [`SourceIndex`]'s name table.
fn name_hash(name: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(name.as_bytes());
    h.finish()
}

/// A published piece as the planner looks it up: stored with the other pieces published for the
/// same destination (layout, rank), in shard order, region and digest inline.
struct PieceEntry {
    /// The alternative (source shard) it was cut from: an index into [`TensorShards::alts`].
    alt: usize,
    /// Its region is `piece_dims[region_at..]`: the offset, then the shape, `ndim` each, where
    /// `ndim` is that of the shard's box (it lies inside it).
    region_at: usize,
    /// Its index in its manifest's `pieces`.
    index: u32,
    packed_addr: Option<u64>,
}

/// The shards of one tensor over all sources, grouped by box, with the pieces cut from them.
struct TensorShards {
    /// Distinct shard boxes in [`TensorBox`] order. Sources holding the same box (replicated
    /// sources) are alternatives of one group.
    groups: Vec<BoxGroup>,
    /// `prefix_end[i]`: the largest dim-0 end of `groups[..=i]` (non-decreasing), so the first
    /// group that can reach past a given row is found by binary search.
    prefix_end: Vec<u64>,
    /// Every group's box, flat: its global offset then its local shape.
    dims: Vec<u64>,
    /// Every group's alternatives, flat, in (source, shard) order: (source, shard, address).
    alts: Vec<(usize, usize, u64)>,
    /// The pieces published for each destination (layout, rank), sorted by key:
    /// `pieces[piece_keys[k].1..piece_keys[k + 1].1]` (the last up to `pieces.len()`) are those
    /// for `piece_keys[k].0`. A plan for one rank reads its own list front to back.
    piece_keys: Vec<((LayoutSpec, u32), usize)>,
    /// Each piece goes with every alternative whose source published it and whose shard holds
    /// its region; sorted by (layout, rank, alternative), then in manifest order.
    pieces: Vec<PieceEntry>,
    piece_dims: Vec<u64>,
    /// The (dtype, global shape) every shard of the tensor agrees on; `None` when they disagree
    /// (then every group is visited and checked, as without an index).
    uniform: Option<(DType, Vec<u64>)>,
    /// The tensor's name, allocated once: every plan's items and choices of the tensor share it.
    name: Arc<str>,
}

struct BoxGroup {
    /// Dim-0 start and end (saturating) of the box; (0, u64::MAX) for a 0-d box.
    start0: u64,
    end0: u64,
    /// The box is `dims[dims_at..dims_at + ndim]` (offset), then `ndim` more (shape).
    dims_at: usize,
    ndim: usize,
    /// Its alternatives are `alts[alts_at..alts_at + n_alts]` (at least one).
    alts_at: usize,
    n_alts: usize,
}

impl TensorShards {
    /// Groups whose dim-0 extent may intersect that of the box at `offset` with `shape`, in box
    /// order: every group that does is in the range (the range may hold some that do not).
    fn candidates(&self, offset: &[u64], shape: &[u64]) -> std::ops::Range<usize> {
        let (Some(&lo0), Some(&n0)) = (offset.first(), shape.first()) else {
            return 0..self.groups.len();
        };
        let hi0 = lo0.saturating_add(n0);
        let upper = self.groups.partition_point(|g| g.start0 < hi0);
        let lower = self.prefix_end.partition_point(|&e| e <= lo0);
        lower..upper.max(lower)
    }

    /// (offset, shape) of a group's box.
    fn bx(&self, g: &BoxGroup) -> (&[u64], &[u64]) {
        let o = self
            .dims
            .get(g.dims_at..g.dims_at + g.ndim)
            .unwrap_or_default();
        let s = self
            .dims
            .get(g.dims_at + g.ndim..g.dims_at + 2 * g.ndim)
            .unwrap_or_default();
        (o, s)
    }

    /// The pieces published for (`layout`, `rank`): a range of `pieces`, sorted by alternative.
    fn rank_pieces(&self, layout: LayoutSpec, rank: u32) -> std::ops::Range<usize> {
        let key = (layout, rank);
        let k = self.piece_keys.partition_point(|e| e.0 < key);
        match self.piece_keys.get(k) {
            Some(&(kk, start)) if kk == key => {
                let end = self
                    .piece_keys
                    .get(k + 1)
                    .map_or(self.pieces.len(), |e| e.1);
                start..end
            }
            _ => 0..0,
        }
    }

    /// The last piece of `list` (a [`TensorShards::rank_pieces`] range) published by
    /// alternative `alt`'s source for `region` within its shard, `ndim` being the shard's.
    /// `cursor` is a position in `list` at or before the first piece of `alt`; it is advanced to
    /// that first piece, so that a caller visiting alternatives in increasing order reads the
    /// list front to back.
    fn piece(
        &self,
        list: &std::ops::Range<usize>,
        cursor: &mut usize,
        alt: usize,
        ndim: usize,
        (ro, rs): (&[u64], &[u64]),
    ) -> Option<&PieceEntry> {
        let pieces = self.pieces.get(list.clone())?;
        let mut c = cursor.saturating_sub(list.start).min(pieces.len());
        // A few steps forward, then a binary search over the rest.
        let mut steps = 0;
        while pieces.get(c).is_some_and(|e| e.alt < alt) {
            steps += 1;
            if steps > 8 {
                c += pieces[c..].partition_point(|e| e.alt < alt);
                break;
            }
            c += 1;
        }
        *cursor = list.start + c;
        let d = &self.piece_dims;
        let mut found = None;
        for e in pieces[c..].iter().take_while(|e| e.alt == alt) {
            if d.get(e.region_at..e.region_at + ndim)
                .is_some_and(|o| dims_eq(o, ro))
                && d.get(e.region_at + ndim..e.region_at + 2 * ndim)
                    .is_some_and(|x| dims_eq(x, rs))
            {
                found = Some(e);
            }
        }
        found
    }
}

/// `a == b` for the few dims of a box, compared in line (a slice `==` calls `memcmp`, whose call
/// costs more than comparing two or three words).
#[inline]
fn dims_eq(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// An index over the shards and published pieces of a set of source manifests, built once and
/// shared by every plan against that set (one per destination rank or worker).
///
/// Holds, per tensor, the shards of every source sorted by box with a dim-0 interval search (an
/// FSDP dim-0 piece finds its few intersecting shards by binary search, not by scanning all of
/// them), and with each shard the pieces its source published from it, sorted by (destination
/// layout, destination rank), their regions inline with their positions in the manifests.
/// Tensors lie in one list in checkpoint order, found by a table of name hashes. Borrows the
/// manifests; building it validates every manifest once.
pub struct SourceIndex<'m> {
    sources: &'m [SourceManifest],
    /// Index of the first shard of each source in a dense numbering of all shards.
    shard_base: Vec<usize>,
    shard_count: usize,
    /// Every tensor's shards, in order of first appearance over the sources (checkpoint order,
    /// as a plan visits them): the entries of neighbouring tensors lie side by side in memory.
    tensors: Vec<TensorShards>,
    /// Tensor index by the 64-bit hash of its name ([`name_hash`]), checked against the entry's
    /// name; names whose hash another name took are in `collided`. A lookup touches this small
    /// table and the entry, not the manifests' strings.
    by_hash: FxMap<u64, u32>,
    collided: FxMap<&'m str, u32>,
    /// Intersections and box dims (u64s) the last plan found: the next plan reserves as much
    /// up front (plans against one index are alike), instead of growing its lists by copying.
    last_found: AtomicUsize,
    last_dims: AtomicUsize,
}

impl<'m> SourceIndex<'m> {
    /// Validates every manifest ([`validate_manifest`]) and indexes its shards and pieces.
    ///
    /// # Errors
    /// [`Error::BadManifest`] for the first inconsistent manifest, in order;
    /// [`Error::Overflow`] when the shards cannot be counted in a `usize`.
    pub fn new(sources: &'m [SourceManifest]) -> Result<SourceIndex<'m>, Error> {
        Self::build(sources, None)
    }

    /// An index that serves plans for the ranks `dest` only: [`SourceIndex::new`], keeping just
    /// the published pieces a plan for `dest` looks up (those cut for the first rank's layout
    /// and one of `dest`'s ranks). A worker planning its own ranks indexes a fraction of the
    /// pieces (one rank of `tp:8`: an eighth). Every manifest is still validated whole, and a
    /// plan of `dest` equals the one a full index gives.
    ///
    /// # Errors
    /// As [`SourceIndex::new`].
    pub fn for_ranks(
        sources: &'m [SourceManifest],
        dest: &[RankLayout],
    ) -> Result<SourceIndex<'m>, Error> {
        let mut keys: Vec<(LayoutSpec, u32)> = match dest.first() {
            Some(first) => dest.iter().map(|rl| (first.layout, rl.rank)).collect(),
            None => Vec::new(),
        };
        keys.sort_unstable();
        keys.dedup();
        Self::build(sources, Some(&keys))
    }

    /// [`SourceIndex::new`], keeping only the pieces whose (layout, destination rank) is in
    /// `only` (sorted), when given.
    fn build(
        sources: &'m [SourceManifest],
        only: Option<&[(LayoutSpec, u32)]>,
    ) -> Result<SourceIndex<'m>, Error> {
        for m in sources {
            validate_manifest(m)?;
        }
        let mut shard_base = Vec::with_capacity(sources.len());
        let mut shard_count = 0usize;
        // Each tensor's shards, tensors in order of first appearance.
        let mut by_tensor: Vec<(&'m str, Vec<(usize, usize)>)> = Vec::new();
        let mut position: FxMap<&'m str, usize> = FxMap::default();
        for (si, m) in sources.iter().enumerate() {
            shard_base.push(shard_count);
            shard_count =
                shard_count
                    .checked_add(m.shards.len())
                    .ok_or_else(|| Error::Overflow {
                        what: "shard count",
                        tensor: String::new(),
                    })?;
            for (hi, s) in m.shards.iter().enumerate() {
                let k = *position.entry(s.tensor.as_str()).or_insert_with(|| {
                    by_tensor.push((s.tensor.as_str(), Vec::new()));
                    by_tensor.len() - 1
                });
                by_tensor[k].1.push((si, hi));
            }
        }
        let n_tensors = u32::try_from(by_tensor.len()).map_err(|_| Error::Overflow {
            what: "tensor count",
            tensor: String::new(),
        })?;
        let mut tensors: Vec<TensorShards> = Vec::with_capacity(by_tensor.len());
        let mut by_hash: FxMap<u64, u32> = FxMap::default();
        by_hash.reserve(by_tensor.len());
        let mut collided: FxMap<&'m str, u32> = FxMap::default();
        for (id, (name, cands)) in (0..n_tensors).zip(by_tensor) {
            match by_hash.entry(name_hash(name)) {
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(id);
                }
                std::collections::hash_map::Entry::Occupied(_) => {
                    collided.insert(name, id);
                }
            }
            let Some(&(s0, h0)) = cands.first() else {
                continue;
            };
            let first = &sources[s0].shards[h0];
            let uniform = cands
                .iter()
                .all(|&(si, hi)| {
                    let s = &sources[si].shards[hi];
                    s.dtype == first.dtype && s.global_shape == first.global_shape
                })
                .then(|| (first.dtype, first.global_shape.clone()));
            let mut boxes: BTreeMap<&'m TensorBox, Vec<(usize, usize)>> = BTreeMap::new();
            for (si, hi) in cands {
                boxes
                    .entry(&sources[si].shards[hi].shard)
                    .or_default()
                    .push((si, hi));
            }
            let mut t = TensorShards {
                groups: Vec::with_capacity(boxes.len()),
                prefix_end: Vec::with_capacity(boxes.len()),
                dims: Vec::new(),
                alts: Vec::new(),
                piece_keys: Vec::new(),
                pieces: Vec::new(),
                piece_dims: Vec::new(),
                uniform,
                name: Arc::from(name),
            };
            let mut e = 0u64;
            for (bx, alts) in boxes {
                let (start0, end0) = match (bx.global_offset.first(), bx.local_shape.first()) {
                    (Some(&o), Some(&n)) => (o, o.saturating_add(n)),
                    _ => (0, u64::MAX),
                };
                let g = BoxGroup {
                    start0,
                    end0,
                    dims_at: t.dims.len(),
                    ndim: bx.local_shape.len(),
                    alts_at: t.alts.len(),
                    n_alts: alts.len(),
                };
                t.dims.extend_from_slice(&bx.global_offset);
                t.dims.extend_from_slice(&bx.local_shape);
                t.alts.extend(
                    alts.iter()
                        .map(|&(si, hi)| (si, hi, sources[si].shards[hi].addr)),
                );
                e = e.max(end0);
                t.prefix_end.push(e);
                t.groups.push(g);
            }
            tensors.push(t);
        }
        // Each published piece goes with every shard of its own source that holds its region:
        // the planner only asks a shard for regions inside it.
        let mut attached: Vec<Vec<(usize, u32, &'m DestPiece)>> = vec![Vec::new(); tensors.len()];
        for (si, m) in sources.iter().enumerate() {
            for (pi, p) in m.pieces.iter().enumerate() {
                if only.is_some_and(|keys| keys.binary_search(&(p.layout, p.dest_rank)).is_err()) {
                    continue;
                }
                let Some(&ti) = position.get(p.tensor.as_str()) else {
                    continue;
                };
                let Some(t) = tensors.get(ti) else {
                    continue;
                };
                let pi = u32::try_from(pi).map_err(|_| Error::Overflow {
                    what: "piece count of a manifest",
                    tensor: p.tensor.clone(),
                })?;
                let (po, ps) = (&p.region.global_offset, &p.region.local_shape);
                if po.len() != ps.len() {
                    continue;
                }
                for gi in t.candidates(po, ps) {
                    let g = &t.groups[gi];
                    let (go, gs) = t.bx(g);
                    let inside = go.len() == po.len()
                        && (0..po.len()).all(|d| {
                            po[d] >= go[d]
                                && po[d]
                                    .checked_add(ps[d])
                                    .zip(go[d].checked_add(gs[d]))
                                    .is_some_and(|(pe, ge)| pe <= ge)
                        });
                    if !inside {
                        continue;
                    }
                    let alts = &t.alts[g.alts_at..g.alts_at + g.n_alts];
                    let from = alts.partition_point(|a| a.0 < si);
                    for (k, a) in alts[from..].iter().enumerate() {
                        if a.0 != si {
                            break;
                        }
                        attached[ti].push((g.alts_at + from + k, pi, p));
                    }
                }
            }
        }
        for (t, mut list) in tensors.iter_mut().zip(attached) {
            // By (layout, rank), then alternative; manifest order kept among equals.
            list.sort_by_key(|&(a, _, p)| (p.layout, p.dest_rank, a));
            t.pieces.reserve_exact(list.len());
            for (a, index, p) in list {
                let key = (p.layout, p.dest_rank);
                if t.piece_keys.last().is_none_or(|k| k.0 != key) {
                    t.piece_keys.push((key, t.pieces.len()));
                }
                t.pieces.push(PieceEntry {
                    alt: a,
                    region_at: t.piece_dims.len(),
                    index,
                    packed_addr: p.packed_addr,
                });
                t.piece_dims.extend_from_slice(&p.region.global_offset);
                t.piece_dims.extend_from_slice(&p.region.local_shape);
            }
        }
        Ok(SourceIndex {
            sources,
            shard_base,
            shard_count,
            tensors,
            by_hash,
            collided,
            last_found: AtomicUsize::new(0),
            last_dims: AtomicUsize::new(0),
        })
    }

    /// [`SourceIndex::tensor`], trying first the tensor at `hint` and the one after it: a
    /// destination lists its pieces mostly in checkpoint order, as the index lists its tensors,
    /// and a name compared in place costs less than the hash table's cache misses.
    fn tensor_near(&self, name: &str, hint: Option<usize>) -> Option<(usize, &TensorShards)> {
        if let Some(h) = hint {
            for i in [h, h.wrapping_add(1)] {
                if let Some(t) = self.tensors.get(i).filter(|t| *t.name == *name) {
                    return Some((i, t));
                }
            }
        }
        self.tensor(name)
    }

    /// The shards of the tensor named `name` and their index in [`SourceIndex::tensors`].
    fn tensor(&self, name: &str) -> Option<(usize, &TensorShards)> {
        let hit = |id: u32| {
            let i = usize::try_from(id).ok()?;
            let t = self.tensors.get(i)?;
            (*t.name == *name).then_some((i, t))
        };
        self.by_hash
            .get(&name_hash(name))
            .and_then(|&id| hit(id))
            .or_else(|| self.collided.get(name).and_then(|&id| hit(id)))
    }

    /// The manifests this index was built over (source `i` of a plan is `sources()[i]`).
    pub fn sources(&self) -> &'m [SourceManifest] {
        self.sources
    }

    /// Rough bytes of the index itself (structs, tables and their heap; not the manifests it
    /// borrows), for memory reports.
    pub fn approx_bytes(&self) -> u64 {
        use std::mem::size_of;
        let mut b = size_of::<Self>() + self.shard_base.capacity() * size_of::<usize>();
        // Hash table: one control byte per slot besides the slot.
        b += self.tensors.capacity() * size_of::<TensorShards>();
        // Hash tables: one control byte per slot besides the slot.
        b += self.by_hash.capacity() * (size_of::<(u64, u32)>() + 1);
        b += self.collided.capacity() * (size_of::<(&str, u32)>() + 1);
        for t in &self.tensors {
            if let Some((_, shape)) = &t.uniform {
                b += shape.capacity() * size_of::<u64>();
            }
            b += t.groups.capacity() * size_of::<BoxGroup>();
            b += (t.prefix_end.capacity() + t.dims.capacity() + t.piece_dims.capacity())
                * size_of::<u64>();
            b += t.alts.capacity() * size_of::<(usize, usize, u64)>();
            b += t.piece_keys.capacity() * size_of::<((LayoutSpec, u32), usize)>();
            b += t.pieces.capacity() * size_of::<PieceEntry>();
            // The shared name: its bytes and the two reference counts.
            b += t.name.len() + 2 * size_of::<usize>();
        }
        b as u64
    }

    /// Plans the pull for the ranks `dest` of one worker from the indexed sources; the same plan
    /// as [`plan`] over the same manifests.
    ///
    /// Every destination piece must be covered by the sources' shards of the same tensor, with the
    /// same dtype and global shape, and every intersection must have a digest the source published
    /// for the destination's layout (that of `dest[0]`) and rank.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when no source has a tensor the destination needs or a source
    /// lacks a digest for a region; [`Error::Mismatch`] on dtype or shape disagreement;
    /// [`Error::CoverageGap`] / [`Error::Overlap`] naming the parameter when the live bytes would
    /// not be written exactly once; [`Error::Overflow`].
    pub fn plan(&self, dest: &[RankLayout], cost: &CostModel) -> Result<Plan, Error> {
        self.plan_with(dest, cost, PlanOptions::default())
    }

    /// [`SourceIndex::plan`] with [`PlanOptions`].
    ///
    /// # Errors
    /// As [`SourceIndex::plan`].
    pub fn plan_with(
        &self,
        dest: &[RankLayout],
        cost: &CostModel,
        opts: PlanOptions,
    ) -> Result<Plan, Error> {
        let sources = self.sources;
        let layout0 = dest.first().map(|d| d.layout);

        // 1. Intersections, in order of discovery (rank, parameter, piece, box group), then
        // grouped by (source, shard): groups in order of their first discovery, each group's
        // intersections in order of discovery. Boxes of intersections go to one flat list,
        // `rdims`.
        let hint = self.last_found.load(AtomicOrdering::Relaxed);
        let mut found: Vec<Isect<'_>> = Vec::with_capacity(hint);
        // Dense shard number of each found intersection's shard.
        let mut keys: Vec<usize> = Vec::with_capacity(hint);
        let mut rdims: Vec<u64> = Vec::with_capacity(self.last_dims.load(AtomicOrdering::Relaxed));
        // The plan's tensor names, each once, and the id of each tensor met (by its entry's
        // address in the index), with the last one at hand: pieces of one tensor come together.
        let mut tensors: Vec<Arc<str>> = Vec::new();
        let mut tensor_ids: FxMap<usize, u32> = FxMap::default();
        let mut last_tensor: Option<(usize, u32)> = None;
        // The index's tensor of the previous piece looked up.
        let mut last_lookup: Option<usize> = None;
        // Intersections hold 32-bit source and rank indices (checked here, once).
        let count_overflow = |what: &'static str| Error::Overflow {
            what,
            tensor: String::new(),
        };
        u32::try_from(sources.len()).map_err(|_| count_overflow("source count"))?;
        for (ri, rl) in dest.iter().enumerate() {
            let ri = u32::try_from(ri).map_err(|_| count_overflow("destination rank count"))?;
            for param in &rl.params {
                for piece in &param.pieces {
                    let Some((ts_key, ts)) = self.tensor_near(&piece.tensor, last_lookup) else {
                        return Err(Error::MissingTensor {
                            tensor: piece.tensor.clone(),
                            reason: format!(
                                "no source published it (needed by {} on rank {})",
                                param.name, rl.rank
                            ),
                        });
                    };
                    last_lookup = Some(ts_key);
                    let mismatch = |s_dtype: DType, s_shape: &[u64]| -> Result<(), Error> {
                        if s_dtype != piece.dtype {
                            return Err(Error::Mismatch {
                                tensor: piece.tensor.clone(),
                                what: "dtype",
                                source_value: s_dtype.to_string(),
                                dest_value: piece.dtype.to_string(),
                            });
                        }
                        if s_shape != piece.global_shape.as_slice() {
                            return Err(Error::Mismatch {
                                tensor: piece.tensor.clone(),
                                what: "shape",
                                source_value: format!("{s_shape:?}"),
                                dest_value: format!("{:?}", piece.global_shape),
                            });
                        }
                        Ok(())
                    };
                    let pr = &piece.region;
                    // A malformed region intersects nothing (the coverage proof names it).
                    let malformed = pr.global_offset.len() != pr.local_shape.len();
                    // Uniform tensors are checked once and only the groups that can intersect
                    // the piece are visited; otherwise every group is visited and checked.
                    let (range, uniform_elem) = match &ts.uniform {
                        Some((dt, shape)) => {
                            let dt = *dt;
                            mismatch(dt, shape)?;
                            let r = if malformed {
                                0..0
                            } else {
                                ts.candidates(&pr.global_offset, &pr.local_shape)
                            };
                            (r, Some(dt.size_bytes()))
                        }
                        None => (0..ts.groups.len(), None),
                    };
                    let lo0 = pr.global_offset.first().copied().unwrap_or(0);
                    // Sources holding the same box (replicated sources, replicated kv heads) are
                    // alternatives: pick one per box, spread over ranks and tensors.
                    let spread = (rl.rank as usize)
                        .wrapping_add(param.pieces.len())
                        .wrapping_add(piece.tensor.len());
                    // This rank's published pieces of the tensor, read front to back as the
                    // groups (and their alternatives) go up.
                    let plist = layout0.map_or(0..0, |l| ts.rank_pieces(l, rl.rank));
                    let mut cursor = plist.start;
                    for g in ts.groups.get(range).unwrap_or_default() {
                        let alt = g.alts_at + spread % g.n_alts.max(1);
                        let Some(&(si, hi, addr)) = ts.alts.get(alt) else {
                            continue;
                        };
                        let elem = match uniform_elem {
                            Some(e) => {
                                if g.end0 <= lo0 {
                                    continue;
                                }
                                e
                            }
                            None => {
                                let s = &sources[si].shards[hi];
                                mismatch(s.dtype, &s.global_shape)?;
                                if malformed {
                                    continue;
                                }
                                s.dtype.size_bytes()
                            }
                        };
                        let (so, ss) = ts.bx(g);
                        let region_at = rdims.len();
                        if !intersect_into(so, ss, &pr.global_offset, &pr.local_shape, &mut rdims) {
                            continue;
                        }
                        let (ro, rs) = rdims[region_at..].split_at(ss.len());
                        let region_at = u32::try_from(region_at).map_err(|_| Error::Overflow {
                            what: "intersection box list",
                            tensor: piece.tensor.clone(),
                        })?;
                        let found_entry = ts.piece(&plist, &mut cursor, alt, g.ndim, (ro, rs));
                        let Some(entry) = found_entry else {
                            let region = TensorBox {
                                global_offset: ro.to_vec(),
                                local_shape: rs.to_vec(),
                            };
                            return Err(missing_digest(
                                &piece.tensor,
                                sources[si].slot,
                                &region,
                                rl,
                            ));
                        };
                        let tensor = match last_tensor {
                            Some((k, id)) if k == ts_key => id,
                            _ => {
                                let id = match tensor_ids.get(&ts_key) {
                                    Some(&id) => id,
                                    None => {
                                        let id = u32::try_from(tensors.len()).map_err(|_| {
                                            Error::Overflow {
                                                what: "tensor count",
                                                tensor: piece.tensor.clone(),
                                            }
                                        })?;
                                        tensors.push(Arc::clone(&ts.name));
                                        tensor_ids.insert(ts_key, id);
                                        id
                                    }
                                };
                                last_tensor = Some((ts_key, id));
                                id
                            }
                        };
                        let (run, runs) = runs_in(ro, rs, so, ss);
                        keys.push(self.shard_base[si] + hi);
                        found.push(Isect {
                            piece,
                            src_base: addr,
                            packed_addr: entry.packed_addr.unwrap_or(0),
                            src_run_bytes: run.wrapping_mul(elem),
                            runs,
                            img: Img::Flat { start: 0, count: 0 },
                            rank_index: ri,
                            // Below `sources.len()`, checked to fit above.
                            source: si as u32,
                            tensor,
                            region_at,
                            piece_index: entry.index,
                            // A dtype's size: 1 to 8 bytes.
                            elem: elem as u32,
                            has_packed: entry.packed_addr.is_some(),
                            staged_packed: false,
                        });
                    }
                }
            }
        }
        self.last_found.store(found.len(), AtomicOrdering::Relaxed);
        self.last_dims.store(rdims.len(), AtomicOrdering::Relaxed);
        // Groups in order of their first intersection's discovery, each in order of discovery:
        // group `p`'s intersections are `isects[member_at[p]..member_at[p + 1]]`. A plan for one
        // rank meets each shard once per tensor, in a row: its intersections are grouped as
        // found and nothing moves. Otherwise they are moved into group order in place (no second
        // copy of the intersections).
        if let Some(order) = group_by_first_seen(&keys, self.shard_count) {
            permute_in_place(&mut found, &order);
            permute_in_place(&mut keys, &order);
        }
        let mut member_at: Vec<usize> = vec![0];
        for k in 1..keys.len() {
            if keys[k - 1] != keys[k] {
                member_at.push(k);
            }
        }
        if !found.is_empty() {
            member_at.push(found.len());
        }
        let n_groups = member_at.len() - 1;
        let mut isects = found;
        let members_of = |p: usize| member_at[p]..member_at[p + 1];

        // 2. Strategy per (source, shard); wire runs deduplicated by (source, addr, len).
        // Identical wire runs are merged when staged (step 3).
        let mut wire: Vec<(usize, u64, u64)> = Vec::with_capacity(isects.len());
        let mut intern = |w: (usize, u64, u64)| -> Result<u32, Error> {
            let id = u32::try_from(wire.len()).map_err(|_| count_overflow("wire run count"))?;
            wire.push(w);
            Ok(id)
        };
        let mut img_all: Vec<(u32, u64)> = Vec::new();
        let img_at_end = |img_all: &Vec<(u32, u64)>| {
            u32::try_from(img_all.len()).map_err(|_| count_overflow("staging image list"))
        };
        let mut scratch: Vec<(u64, u64)> = Vec::new();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        let mut ids: Vec<u32> = Vec::new();
        let mut choices = Vec::with_capacity(n_groups);
        for p in 0..n_groups {
            let idx = members_of(p);
            // The group's (source, shard).
            let si = isects.get(idx.start).map_or(0, |x| x.source as usize);
            let hi = keys.get(idx.start).map_or(0, |&k| k - self.shard_base[si]);
            // The choice's tensor is the first intersection's.
            let tensor = isects.get(idx.start).map_or(0, |x| x.tensor);
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
                    coalesced_count_in(&mut scratch)
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
                    (x.packed_addr, x.numel(&rdims) * u64::from(x.elem))
                }));
                let (n, b) = coalesced_count_in(&mut scratch);
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
            let cands = &cands[..n_cands];
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
                    if let Some(i) = single.map(|_| idx.start) {
                        // Runs neither touch nor overlap: each is its own wire run.
                        let x = &isects[i];
                        let n = x.runs.len();
                        let img = if n == 1 {
                            Img::Affine {
                                wire: intern((si, x.src_run(0), x.src_run_bytes))?,
                                off0: 0,
                                stride: 0,
                                count: 1,
                            }
                        } else {
                            let start = img_at_end(&img_all)?;
                            for r in 0..n {
                                let id = intern((si, x.src_run(r), x.src_run_bytes))?;
                                img_all.push((id, 0));
                            }
                            Img::Flat { start, count: n }
                        };
                        isects[i].img = img;
                        continue;
                    }
                    // Merge the group's runs first (adjacent or overlapping), so a worker
                    // holding every TP rank of a row-parallel weight gets one wire run, not one
                    // per row.
                    scratch.clear();
                    for i in idx.clone() {
                        scratch.extend(isects[i].src_spans());
                    }
                    scratch.sort_unstable();
                    merged.clear();
                    for &(a, e) in &scratch {
                        match merged.last_mut() {
                            Some(m) if a <= m.1 => m.1 = m.1.max(e),
                            _ => merged.push((a, e)),
                        }
                    }
                    ids.clear();
                    for &(a, e) in &merged {
                        ids.push(intern((si, a, e - a))?);
                    }
                    for i in idx.clone() {
                        let x = &mut isects[i];
                        let start = img_at_end(&img_all)?;
                        let n = x.runs.len();
                        for r in 0..n {
                            let a = x.src_run(r);
                            let k = merged.partition_point(|m| m.0 <= a).saturating_sub(1);
                            img_all.push((ids[k], a - merged[k].0));
                        }
                        x.img = Img::Flat { start, count: n };
                    }
                }
                Strategy::Packed => {
                    for i in idx.clone() {
                        let x = &mut isects[i];
                        let bytes = x.runs.len() * x.src_run_bytes;
                        x.staged_packed = true;
                        x.img = Img::Affine {
                            wire: intern((si, x.packed_addr, bytes))?,
                            off0: 0,
                            stride: 0,
                            count: 1,
                        };
                    }
                }
                Strategy::Superset => {
                    let id = intern((si, lo, span))?;
                    for i in idx.clone() {
                        let x = &mut isects[i];
                        x.img = match x.runs {
                            Runs::Arith { count, stride, .. } => Img::Affine {
                                wire: id,
                                off0: x.src_run(0) - lo,
                                stride: stride.wrapping_mul(u64::from(x.elem)),
                                count,
                            },
                            Runs::List(_) => {
                                let start = img_at_end(&img_all)?;
                                let n = x.runs.len();
                                for r in 0..n {
                                    img_all.push((id, x.src_run(r) - lo));
                                }
                                Img::Flat { start, count: n }
                            }
                        };
                    }
                }
            }
        }
        drop(keys);
        drop(scratch);
        drop(merged);
        drop(ids);

        // 3. Staging offsets in (source, addr) order, then coalescing.
        let worder = order_wires(&wire, sources.len());
        // Two items can share staging bytes (and be merged) only through a wire run staged once
        // for several (below) or a group of several intersections.
        let mut shared_staging = member_at.windows(2).any(|w| w[1] - w[0] > 1);
        let mut staging = vec![0u64; wire.len()];
        let mut off = 0u64;
        let mut reads: Vec<Read> = Vec::new();
        let mut prev: Option<usize> = None;
        for &i in &worder {
            let (si, a, l) = wire[i];
            if let Some(p) = prev.filter(|&p| wire[p] == wire[i]) {
                staging[i] = staging[p];
                shared_staging = true;
                continue;
            }
            prev = Some(i);
            staging[i] = off;
            match reads.last_mut() {
                Some(r)
                    if r.source == si
                        && r.src_addr + r.len == a
                        && r.staging_offset + r.len == off =>
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
        drop(worder);
        let staging_bytes = off;
        let wire_bytes = staging_bytes;

        // 4. Apply copies and verification segments, in group order.
        let mut copies = CopySink::new(isects.len());
        let mut seg_sink = SegmentSink::default();
        // The staging offset of each item's first byte (`u64::MAX`: none): items with the same
        // bytes share it.
        let mut heads: Vec<u64> = Vec::with_capacity(if shared_staging { isects.len() } else { 0 });
        let mut useful_bytes = 0u64;
        // Each intersection becomes its verification item where it lies (the same size: the
        // collection reuses the intersections' memory).
        let mut verify: Vec<VerifyItem> = isects
            .into_iter()
            .map(|x| {
                let img_at = |j: u64| -> u64 {
                    match x.img {
                        Img::Affine {
                            wire, off0, stride, ..
                        } => staging[wire as usize]
                            .wrapping_add(off0)
                            .wrapping_add(j.wrapping_mul(stride)),
                        Img::Flat { start, .. } => {
                            let (w, o) = img_all
                                .get(start as usize + j as usize)
                                .copied()
                                .unwrap_or((0, 0));
                            staging[w as usize].wrapping_add(o)
                        }
                    }
                };
                let n_img = x.img.count();
                let (ro, rs) = x.region(&rdims);
                let (lrun, lruns) = runs_in(
                    ro,
                    rs,
                    &x.piece.region.global_offset,
                    &x.piece.region.local_shape,
                );
                let elem = u64::from(x.elem);
                let lrun_b = lrun.wrapping_mul(elem);
                let irb = x.img_run_bytes();
                let total = n_img.wrapping_mul(irb);
                useful_bytes = useful_bytes.saturating_add(total);
                let live_at = |q: u64| x.piece.offset.wrapping_add(lruns.get(q).wrapping_mul(elem));
                // Staged and live runs both evenly spaced: the rows the walk below visits, in
                // closed form (row `p` at staging `s0 + p * ss`, live `l0 + p * ls`).
                let img_affine = match x.img {
                    Img::Affine {
                        wire, off0, stride, ..
                    } => Some((staging[wire as usize].wrapping_add(off0), stride)),
                    Img::Flat { .. } => None,
                };
                let live_affine = match lruns {
                    Runs::Arith { first, stride, .. } => Some((
                        x.piece.offset.wrapping_add(first.wrapping_mul(elem)),
                        stride.wrapping_mul(elem),
                    )),
                    Runs::List(_) => None,
                };
                let closed = match (img_affine, live_affine) {
                    (Some((s0, ss)), Some((l0, ls))) if irb > 0 && lrun_b > 0 => {
                        if irb == lrun_b {
                            Some((s0, ss, l0, ls, irb, n_img))
                        } else if n_img == 1 && irb % lrun_b == 0 {
                            Some((s0, lrun_b, l0, ls, lrun_b, irb / lrun_b))
                        } else if lruns.len() == 1
                            && lrun_b % irb == 0
                            && n_img.checked_mul(irb) == Some(lrun_b)
                        {
                            Some((s0, ss, l0, irb, irb, n_img))
                        } else {
                            None
                        }
                    }
                    _ => None,
                };
                if let Some((s0, ss, l0, ls, len, count)) = closed {
                    copies.push_rows(x.rank_index as usize, (s0, ss), (l0, ls), len, count);
                } else {
                    let unit = gcd(lrun_b, irb);
                    // Walk both sides in steps of `unit` (it divides both run lengths).
                    let (mut j, mut jo) = (0u64, 0u64);
                    let (mut q, mut qo) = (0u64, 0u64);
                    let mut s_base = img_at(0);
                    let mut l_base = live_at(0);
                    let mut pos = 0u64;
                    while pos < total {
                        let s_off = s_base.wrapping_add(jo);
                        let l_off = l_base.wrapping_add(qo);
                        copies.push(x.rank_index as usize, s_off, l_off, unit);
                        pos += unit;
                        jo += unit;
                        if jo >= irb {
                            j += 1;
                            jo = 0;
                            if pos < total {
                                s_base = img_at(j);
                            }
                        }
                        qo += unit;
                        if qo >= lrun_b {
                            q += 1;
                            qo = 0;
                            if pos < total {
                                l_base = live_at(q);
                            }
                        }
                    }
                }
                match img_affine {
                    Some((s0, ss)) => seg_sink.push_runs(s0, ss, irb, n_img),
                    None => {
                        for jj in 0..n_img {
                            seg_sink.push(img_at(jj), irb);
                        }
                    }
                }
                let segments = seg_sink.take();
                if shared_staging {
                    heads.push(segments.first().map_or(u64::MAX, |sg| sg.offset));
                }
                VerifyItem {
                    source: x.source as usize,
                    tensor: x.tensor,
                    dest_rank: dest.get(x.rank_index as usize).map_or(0, |rl| rl.rank),
                    piece: x.piece_index,
                    shared_with: Vec::new(),
                    segments,
                }
            })
            .collect();
        if shared_staging {
            dedup_verify(&mut verify, &heads, sources);
        }
        drop(heads);
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
        let mut copies = copies.finish();
        copies.shrink_to_fit();
        prove_coverage(dest, &copies, &zero_fills)?;
        let predicted_seconds = cost.seconds(reads.len() as u64, wire_bytes);
        Ok(Plan {
            reads,
            staging_bytes,
            copies,
            zero_fills,
            verify,
            choices,
            tensors,
            useful_bytes,
            wire_bytes,
            predicted_seconds,
        })
    }
}

/// Plans the pull for the ranks `dest` of one worker from `sources`:
/// `SourceIndex::for_ranks(sources, dest)?.plan(dest, cost)` (an index of the pieces cut for
/// `dest` only). Callers planning several workers or ranks against the same manifests should
/// build one [`SourceIndex::new`] and plan each from it.
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
    SourceIndex::for_ranks(sources, dest)?.plan(dest, cost)
}

/// Choices the planner may make beyond the cost model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Allow [`Strategy::Superset`] reads (a contiguous span that also carries bytes no
    /// destination rank needs, so staging holds more than the ranks' own bytes).
    pub superset: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { superset: true }
    }
}

/// [`plan`] whose staging holds at most `max_staging_bytes` when it can: the cheapest plan is
/// kept when it fits; otherwise the plan without [`Strategy::Superset`] reads (whose staging is
/// the useful bytes: every destination byte is read once, replicated pieces once for all the
/// ranks sharing them) is returned, fitting or not; the caller compares
/// [`Plan::staging_bytes`] with its bound.
///
/// # Errors
/// As [`plan`].
pub fn plan_within(
    dest: &[RankLayout],
    sources: &[SourceManifest],
    cost: &CostModel,
    max_staging_bytes: u64,
) -> Result<Plan, Error> {
    let index = SourceIndex::for_ranks(sources, dest)?;
    let p = index.plan(dest, cost)?;
    if p.staging_bytes <= max_staging_bytes {
        return Ok(p);
    }
    index.plan_with(dest, cost, PlanOptions { superset: false })
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
fn sort_by_start(v: &mut Vec<(u64, u64)>) {
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
fn prove_coverage_sorted(
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
/// The destination pieces are indexed by tensor name first, so the work is proportional to the
/// shards times the pieces of each shard's own tensor.
///
/// # Errors
/// [`Error::Overflow`] when a shard's size overflows.
pub fn cut_for_layout(shards: &[ShardEntry], dest: &[RankLayout]) -> Result<Vec<Cut>, Error> {
    let mut by_tensor: FxMap<&str, Vec<(u32, &TensorBox)>> = FxMap::default();
    for rl in dest {
        for p in &rl.params {
            for piece in &p.pieces {
                by_tensor
                    .entry(piece.tensor.as_str())
                    .or_default()
                    .push((rl.rank, &piece.region));
            }
        }
    }
    let mut out = Vec::new();
    // (rank, region) already cut from the current shard.
    let mut seen: HashSet<(u32, TensorBox), BuildHasherDefault<FxHasher>> = HashSet::default();
    for (hi, s) in shards.iter().enumerate() {
        let elem = s.dtype.size_bytes();
        s.shard
            .numel()
            .and_then(|n| n.checked_mul(elem))
            .ok_or(Error::Overflow {
                what: "shard bytes",
                tensor: s.tensor.clone(),
            })?;
        let Some(pieces) = by_tensor.get(s.tensor.as_str()) else {
            continue;
        };
        seen.clear();
        for &(rank, piece_region) in pieces {
            let Some(region) = s.shard.intersect(piece_region) else {
                continue;
            };
            if !seen.insert((rank, region.clone())) {
                continue;
            }
            let (run, starts) = decompose(&region, &s.shard);
            out.push(Cut {
                shard: hi,
                dest_rank: rank,
                tensor: s.tensor.clone(),
                region,
                run_bytes: run * elem,
                run_offsets: starts.iter().map(|st| st * elem).collect(),
            });
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

/// Manifests of every source rank of `trainer` as publishers would publish them for destination
/// layout `dest` (addresses synthetic: source `r` at `(r + 1) << 40`, digests zero), with strided
/// cuts packed for the given worker rank sets (see [`pack_marks`]). For offline planning
/// (`mx plan`) and planner benchmarks; no bytes exist behind the addresses.
///
/// # Errors
/// [`Error::ImpossibleLayout`] and the other errors of [`crate::rank_layouts`].
pub fn synthetic_manifests(
    model: &crate::ModelInfo,
    trainer: LayoutSpec,
    dest: LayoutSpec,
    pack_for: &[Vec<u32>],
) -> Result<Vec<SourceManifest>, Error> {
    let dest_layouts = crate::rank_layouts(model, dest)?;
    let mut out = Vec::with_capacity(trainer.world_size as usize);
    for r in 0..trainer.world_size {
        let rl = crate::rank_layout(model, trainer, r)?;
        out.push(synthetic_manifest(&rl, &dest_layouts, pack_for)?);
    }
    Ok(out)
}

/// The manifest source rank `src` would publish for the destination layout whose ranks are `dest`
/// (all ranks of one layout, labelled `dest[0].layout`): slot `src.rank`, its shards at the
/// synthetic address `(src.rank + 1) << 40` in DRAM, one piece per [`cut_for_layout`] cut with a
/// zero digest, strided cuts packed after the shards for the worker rank sets `pack_for` (see
/// [`pack_marks`]; empty: nothing packed). What [`synthetic_manifests`] builds per rank, for
/// layouts given as explicit [`RankLayout`]s (e.g. [`crate::frontier`]).
///
/// # Errors
/// [`Error::Overflow`] when an address or size overflows u64.
pub fn synthetic_manifest(
    src: &RankLayout,
    dest: &[RankLayout],
    pack_for: &[Vec<u32>],
) -> Result<SourceManifest, Error> {
    let overflow = |what| Error::Overflow {
        what,
        tensor: String::new(),
    };
    let r = src.rank;
    let base = (u64::from(r) + 1)
        .checked_shl(40)
        .filter(|b| b.checked_add(src.total_bytes).is_some())
        .ok_or_else(|| overflow("synthetic source address"))?;
    let shards = src.shard_entries(base);
    let cuts = cut_for_layout(&shards, dest)?;
    let marks = pack_marks(&cuts, pack_for);
    let layout = dest.first().map_or(src.layout, |d| d.layout);
    let mut cursor = base + src.total_bytes;
    let mut pieces = Vec::with_capacity(cuts.len());
    for (c, m) in cuts.into_iter().zip(marks) {
        let packed_addr = if m {
            let a = cursor;
            cursor = cursor
                .checked_add(c.bytes())
                .ok_or_else(|| overflow("synthetic packed address"))?;
            Some(a)
        } else {
            None
        };
        pieces.push(DestPiece {
            layout,
            dest_rank: c.dest_rank,
            tensor: c.tensor,
            region: c.region,
            digest: Digest::default(),
            packed_addr,
        });
    }
    Ok(SourceManifest {
        slot: r,
        layout: src.layout,
        agent_name: format!("synthetic-{r}"),
        agent_metadata: Vec::new(),
        shards,
        pieces,
        pack_seconds: 0.0,
    })
}

/// The error for a piece a source did not digest for the destination's layout (its publisher
/// did not cut for that layout), with what to do about it.
pub(crate) fn missing_digest(
    tensor: &str,
    slot: u32,
    region: &TensorBox,
    rl: &RankLayout,
) -> Error {
    Error::MissingTensor {
        tensor: tensor.to_string(),
        reason: format!(
            "source slot {slot} published no digest for region {region} of layout {} rank {} \
             (its publisher has not cut for this layout: a layout registered after the version \
             was published is added while the publishers still hold it, so retry shortly; once \
             they handed it back, publish a new version)",
            rl.layout, rl.rank
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use proptest::prelude::*;

    use super::*;
    use crate::plan_reference;
    use crate::{rank_layouts, MemDevice, ModelInfo, Scheme, TensorSpec};

    fn llama(heads: u64, kv: u64, head_dim: u64, hidden: u64, inter: u64, vocab: u64) -> ModelInfo {
        let dtype = DType::BF16;
        let mut t = vec![];
        let mut add = |name: String, shape: Vec<u64>| t.push(TensorSpec { name, dtype, shape });
        add("model.embed_tokens.weight".into(), vec![vocab, hidden]);
        add("lm_head.weight".into(), vec![vocab, hidden]);
        add("model.norm.weight".into(), vec![hidden]);
        for l in 0..2 {
            let l = format!("model.layers.{l}");
            add(
                format!("{l}.self_attn.q_proj.weight"),
                vec![heads * head_dim, hidden],
            );
            add(
                format!("{l}.self_attn.k_proj.weight"),
                vec![kv * head_dim, hidden],
            );
            add(
                format!("{l}.self_attn.v_proj.weight"),
                vec![kv * head_dim, hidden],
            );
            add(
                format!("{l}.self_attn.o_proj.weight"),
                vec![hidden, heads * head_dim],
            );
            add(format!("{l}.mlp.gate_proj.weight"), vec![inter, hidden]);
            add(format!("{l}.mlp.up_proj.weight"), vec![inter, hidden]);
            add(format!("{l}.mlp.down_proj.weight"), vec![hidden, inter]);
            add(format!("{l}.input_layernorm.weight"), vec![hidden]);
            add(format!("{l}.post_attention_layernorm.weight"), vec![hidden]);
        }
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
            "num_hidden_layers": 2, "intermediate_size": inter, "tie_word_embeddings": false,
        });
        ModelInfo::from_hf_config(&cfg, t).unwrap()
    }

    /// `p` with its copies and segments expanded row by row and compressed again.
    fn recompress(p: &Plan) -> Plan {
        let mut q = p.clone();
        let mut sink = CopySink::new(0);
        for c in &p.copies {
            for (s, l) in c.rows() {
                sink.push(c.rank_index, s, l, c.len);
            }
        }
        q.copies = sink.finish();
        let mut seg = SegmentSink::default();
        for v in &mut q.verify {
            let runs: Vec<(u64, u64)> = v.byte_ranges().collect();
            for (o, l) in runs {
                seg.push(o, l);
            }
            v.segments = seg.take();
        }
        q
    }

    /// Distinct digests per piece, so verification dedup depends on real content identity.
    fn with_digests(mut ms: Vec<SourceManifest>) -> Vec<SourceManifest> {
        for m in &mut ms {
            for p in &mut m.pieces {
                let mut h = blake3::Hasher::new();
                h.update(p.tensor.as_bytes());
                for v in p.region.global_offset.iter().chain(&p.region.local_shape) {
                    h.update(&v.to_le_bytes());
                }
                p.digest = h.finalize().into();
            }
        }
        ms
    }

    /// The compact plan, made from `ms` and expanded row by row, is the reference's plan.
    fn same(
        ms: &[SourceManifest],
        new: Result<Plan, Error>,
        old: Result<plan_reference::RefPlan, Error>,
    ) -> Result<(), TestCaseError> {
        match (new, old) {
            (Ok(a), Ok(b)) => {
                // The compact form is canonical: re-compressing the expansion gives it back.
                prop_assert_eq!(&recompress(&a), &a);
                prop_assert_eq!(plan_reference::expand(&a, ms), b)
            }
            (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
            (a, b) => prop_assert!(false, "indexed {:?} vs reference {:?}", a.err(), b.err()),
        }
        Ok(())
    }

    fn check_all(
        dest_all: &[RankLayout],
        ms: &[SourceManifest],
        cost: &CostModel,
    ) -> Result<(), TestCaseError> {
        // One index, many plans: each single rank, then the whole layout, each equal to the
        // per-call planner of before.
        let index = SourceIndex::new(ms).unwrap();
        for r in 0..dest_all.len() {
            let d = &dest_all[r..=r];
            same(ms, index.plan(d, cost), plan_reference::plan(d, ms, cost))?;
            same(ms, plan(d, ms, cost), plan_reference::plan(d, ms, cost))?;
        }
        same(
            ms,
            index.plan(dest_all, cost),
            plan_reference::plan(dest_all, ms, cost),
        )?;
        Ok(())
    }

    fn layout(s: u8, n: u32) -> LayoutSpec {
        LayoutSpec {
            scheme: [Scheme::Fsdp, Scheme::VllmTp, Scheme::Replicated][s as usize],
            world_size: n,
        }
    }

    fn grid(shape: &[u64], g: &[u64]) -> Vec<TensorBox> {
        let cuts: Vec<Vec<(u64, u64)>> = (0..shape.len())
            .map(|d| {
                let n = g[d].min(shape[d]).max(1);
                let per = shape[d].div_ceil(n);
                (0..n)
                    .map(|i| (i * per, ((i + 1) * per).min(shape[d])))
                    .filter(|(a, b)| b > a)
                    .collect()
            })
            .collect();
        let mut out = vec![];
        for a in &cuts[0] {
            for b in &cuts[1] {
                for c in &cuts[2] {
                    out.push(TensorBox {
                        global_offset: vec![a.0, b.0, c.0],
                        local_shape: vec![a.1 - a.0, b.1 - b.0, c.1 - c.0],
                    });
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// The indexed planner equals the per-call planner on llama layouts, with and without
        /// packing, replicated (alternative) sources included.
        #[test]
        fn indexed_plan_equals_reference(
            kv in 1..4u64, group in 1..3u64, head_dim in 1..4u64, hidden in 1..10u64,
            inter in 1..10u64, vocab in 1..130u64, s in 0..3u8, sn in 1..6u32, d in 0..3u8,
            dn in 1..5u32, pack: bool, per_desc in 0.0..2e-5f64,
        ) {
            let model = llama(kv * group, kv, head_dim, hidden, inter, vocab);
            let src = layout(s, if s == 2 { sn.min(3) } else { sn });
            let dst = layout(d, dn);
            let (Ok(_), Ok(dest_all)) = (rank_layouts(&model, src), rank_layouts(&model, dst)) else {
                return Ok(());
            };
            let packs: Vec<Vec<u32>> = if pack { vec![(0..dn).collect()] } else { vec![] };
            let ms = with_digests(synthetic_manifests(&model, src, dst, &packs).unwrap());
            let cost = CostModel { per_descriptor_s: per_desc, wire_gbps: 10.0, per_segment_s: per_desc / 20.0 };
            check_all(&dest_all, &ms, &cost)?;
            // Every source shard cut exactly as the straightforward cutter does.
            for r in 0..src.world_size {
                let rl = crate::rank_layout(&model, src, r).unwrap();
                let shards = rl.shard_entries(0);
                prop_assert_eq!(
                    cut_for_layout(&shards, &dest_all).unwrap(),
                    plan_reference::cut_for_layout(&shards, &dest_all).unwrap()
                );
            }
        }

        /// The chain-based coverage proof agrees with sorting every copy: random tilings of two
        /// ranks' buffers cut into copies, shuffled, then possibly perturbed.
        #[test]
        fn coverage_proof_equals_sorting_every_copy(
            cuts in proptest::collection::vec((0..2usize, 1..6u64), 1..24),
            order in proptest::collection::vec(0..1000u32, 24),
            perturb in proptest::option::of((0..24usize, 0..3u8)),
            zero_rank1 in 0..4u64,
        ) {
            let mut ends = [0u64; 2];
            let mut copies = vec![];
            for (k, &(r, l)) in cuts.iter().enumerate() {
                copies.push(Copy::single(r, k as u64 * 7, ends[r], l));
                ends[r] += l;
            }
            let zero = vec![ZeroFill { rank_index: 1, live_offset: ends[1], len: zero_rank1 }];
            let mk = |rank: u32, total: u64| RankLayout {
                layout: LayoutSpec { scheme: Scheme::VllmTp, world_size: 2 },
                rank,
                params: vec![],
                total_bytes: total,
            };
            let dest = [mk(0, ends[0]), mk(1, ends[1] + zero_rank1)];
            let n = copies.len();
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_by_key(|&i| order[i]);
            let mut copies: Vec<Copy> = idx.into_iter().map(|i| copies[i]).collect();
            if let Some((i, how)) = perturb {
                let c = &mut copies[i % n];
                match how {
                    0 => c.len += 1,
                    1 => c.live_offset += 1,
                    _ => c.len = 0,
                }
            }
            let fast = prove_coverage(&dest, &copies, &zero).map_err(|e| e.to_string());
            let slow = prove_coverage_sorted(&dest, &copies, &zero).map_err(|e| e.to_string());
            prop_assert_eq!(&fast, &slow);
            // The same rows as strided copies: the same verdict and error.
            let mut sink = CopySink::new(0);
            for c in &copies {
                sink.push(c.rank_index, c.staging_offset, c.live_offset, c.len);
            }
            let strided = sink.finish();
            let rows: Vec<Copy> = strided
                .iter()
                .flat_map(|c| c.rows().map(move |(s, l)| Copy::single(c.rank_index, s, l, c.len)))
                .collect();
            let merged = {
                // What the sink merged without strides: the rows themselves.
                let mut sink = CopySink::new(0);
                for c in &rows {
                    sink.push(c.rank_index, c.staging_offset, c.live_offset, c.len);
                }
                sink.finish()
            };
            prop_assert_eq!(&merged, &strided);
            let fast2 = prove_coverage(&dest, &strided, &zero).map_err(|e| e.to_string());
            let slow2 = prove_coverage_sorted(&dest, &rows, &zero).map_err(|e| e.to_string());
            prop_assert_eq!(&fast2, &slow2);
            // Merging abutting copies changes neither coverage nor (for tilings) the verdict.
            prop_assert_eq!(fast2.is_ok(), fast.is_ok());
        }

        /// The compact run description lists exactly the runs of `decompose`.
        #[test]
        fn runs_in_equals_decompose(
            dims in proptest::collection::vec((1..6u64, 0..6u64, 0..6u64, 0..9u64), 0..5),
        ) {
            // Per dim: outer extent, inner start and length inside it, outer global offset.
            let outer = TensorBox {
                global_offset: dims.iter().map(|d| d.3).collect(),
                local_shape: dims.iter().map(|d| d.0).collect(),
            };
            let start = |d: &(u64, u64, u64, u64)| d.1 % d.0;
            let inner = TensorBox {
                global_offset: dims.iter().map(|d| d.3 + start(d)).collect(),
                local_shape: dims.iter().map(|d| 1 + d.2 % (d.0 - start(d))).collect(),
            };
            prop_assume!(outer.contains(&inner));
            let (run, starts) = decompose(&inner, &outer);
            let (run2, runs) = runs_in(
                &inner.global_offset, &inner.local_shape, &outer.global_offset, &outer.local_shape,
            );
            prop_assert_eq!(run, run2);
            let listed: Vec<u64> = (0..runs.len()).map(|i| runs.get(i)).collect();
            prop_assert_eq!(listed, starts);
        }

        /// Rows pushed at once equal the same rows pushed one by one, after any earlier rows;
        /// likewise segment runs.
        #[test]
        fn closed_form_rows_equal_row_by_row(
            before in proptest::collection::vec((0..2usize, 0..64u64, 0..64u64, 1..5u64), 0..4),
            rank in 0..2usize, s in 0..64u64, ss in 0..9u64, l in 0..64u64, ls in 0..9u64,
            len in 1..5u64, count in 0..9u64, wrap: bool,
        ) {
            // Offsets near u64::MAX make some rows wrap: then the rows are pushed one by one.
            let top = if wrap { u64::MAX - 40 } else { 0 };
            let (s, l) = (s.wrapping_add(top), l.wrapping_add(top));
            let mut a = CopySink::new(0);
            let mut b = CopySink::new(0);
            for &(r, x, y, n) in &before {
                a.push(r, x, y, n);
                b.push(r, x, y, n);
            }
            a.push_rows(rank, (s, ss), (l, ls), len, count);
            for i in 0..count {
                b.push(rank, s.wrapping_add(i * ss), l.wrapping_add(i * ls), len);
            }
            prop_assert_eq!(a.finish(), b.finish());
            let mut a = SegmentSink::default();
            let mut b = SegmentSink::default();
            for &(_, x, _, n) in &before {
                a.push(x, n);
                b.push(x, n);
            }
            a.push_runs(s, ss, len, count);
            for i in 0..count {
                b.push(s.wrapping_add(i * ss), len);
            }
            prop_assert_eq!(a.take(), b.take());
        }

        /// The radix ordering is a stable sort by key; the permutation applies it in place.
        #[test]
        fn order_by_key_is_a_stable_sort(keys in proptest::collection::vec(0..5000usize, 0..300)) {
            let order = order_by_key(&keys, 5000);
            let mut expect: Vec<usize> = (0..keys.len()).collect();
            expect.sort_by_key(|&i| keys[i]);
            prop_assert_eq!(&order, &expect);
            let mut v: Vec<usize> = (0..keys.len()).map(|i| i * 10).collect();
            permute_in_place(&mut v, &order);
            let want: Vec<usize> = order.iter().map(|&i| i * 10).collect();
            prop_assert_eq!(v, want);
        }

        /// Grouping by first occurrence: groups in order of their key's first occurrence, members
        /// in index order; `None` exactly when the keys are grouped already. Small key ranges
        /// make repeats (and so both paths) common.
        #[test]
        fn group_by_first_seen_groups_stably(
            keys in proptest::collection::vec(0..12usize, 0..200),
            runs in proptest::bool::ANY,
        ) {
            // Half the cases grouped already: each key's occurrences in a row.
            let keys = if runs {
                let mut k = keys;
                k.sort_unstable();
                k
            } else {
                keys
            };
            let mut first: Vec<usize> = Vec::new();
            for &k in &keys {
                if !first.contains(&k) {
                    first.push(k);
                }
            }
            let mut expect: Vec<usize> = (0..keys.len()).collect();
            expect.sort_by_key(|&i| first.iter().position(|&f| f == keys[i]));
            let grouped = keys
                .iter()
                .enumerate()
                .all(|(i, k)| keys[..i].last() == Some(k) || !keys[..i].contains(k));
            match group_by_first_seen(&keys, 12) {
                None => {
                    prop_assert!(grouped);
                    prop_assert_eq!(expect, (0..keys.len()).collect::<Vec<_>>());
                }
                Some(order) => {
                    prop_assert!(!grouped);
                    prop_assert_eq!(order, expect);
                }
            }
        }

        /// Wire runs are ordered exactly as a stable sort by value, whether or not each source's
        /// runs come in order (few distinct values make ties common).
        #[test]
        fn order_wires_is_a_stable_sort(
            wire in proptest::collection::vec((0..4usize, 0..6u64, 1..3u64), 0..120),
            sorted_per_source in proptest::bool::ANY,
        ) {
            let mut wire = wire;
            if sorted_per_source {
                wire.sort_by_key(|w| (w.1, w.2));
            }
            prop_assert_eq!(order_wires(&wire, 4), by_value(&wire));
        }

        /// The radix sort of spans orders by start exactly as a comparison sort (long lists take
        /// the radix path; starts spread over up to 40 bits, so it runs four digit passes).
        #[test]
        fn sort_by_start_orders_by_start(
            seed in proptest::collection::vec((0..(1u64 << 40), 0..1000u64), 0..64),
            len in 4096..6000usize,
        ) {
            let mut v: Vec<(u64, u64)> = (0..len)
                .map(|i| {
                    let (a, b) = seed.get(i % seed.len().max(1)).copied().unwrap_or((0, 0));
                    (a.wrapping_mul(i as u64 + 1) % (1 << 40), b)
                })
                .collect();
            let mut want = v.clone();
            want.sort_unstable_by_key(|x| x.0);
            sort_by_start(&mut v);
            let starts: Vec<u64> = v.iter().map(|x| x.0).collect();
            let want_starts: Vec<u64> = want.iter().map(|x| x.0).collect();
            prop_assert_eq!(starts, want_starts);
            let (mut a, mut b) = (v, want);
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
        }

        /// 3-D grids, sources from one or two different grids (two grids overlap: an error the
        /// indexed planner must report exactly as before), some replicated.
        #[test]
        fn indexed_plan_equals_reference_on_grids(
            shape in proptest::collection::vec(1..7u64, 3),
            g1 in proptest::collection::vec(1..4u64, 3),
            g2 in proptest::collection::vec(1..4u64, 3),
            dg in proptest::collection::vec(1..4u64, 3),
            two_grids: bool, replicas in 1..3usize, drop_one: bool,
        ) {
            let t = TensorSpec { name: "experts.w".into(), dtype: DType::F32, shape: shape.clone() };
            let sl = layout(0, 1);
            let dl = layout(1, 1);
            let dest_all: Vec<RankLayout> = grid(&shape, &dg).into_iter().enumerate()
                .map(|(i, b)| RankLayout::from_boxes(dl, i as u32, &[(t.clone(), b)]).unwrap())
                .collect();
            let mut boxes = grid(&shape, &g1);
            if two_grids {
                boxes.extend(grid(&shape, &g2));
            }
            let mut ms = vec![];
            for _ in 0..replicas {
                for b in &boxes {
                    let rl = RankLayout::from_boxes(sl, ms.len() as u32, &[(t.clone(), b.clone())]).unwrap();
                    ms.push(synthetic_manifest(&rl, &dest_all, &[vec![0, 2]]).unwrap());
                }
            }
            if drop_one && ms.len() > 1 {
                ms.remove(ms.len() / 2);
            }
            let ms = with_digests(ms);
            check_all(&dest_all, &ms, &CostModel::default())?;
            let all: Vec<ShardEntry> = ms.iter().flat_map(|m| m.shards.clone()).collect();
            prop_assert_eq!(
                cut_for_layout(&all, &dest_all).unwrap(),
                plan_reference::cut_for_layout(&all, &dest_all).unwrap()
            );
        }
    }

    fn base_case() -> (Vec<RankLayout>, Vec<SourceManifest>) {
        let model = llama(4, 2, 4, 8, 12, 100);
        let dest = rank_layouts(&model, "tp:2".parse().unwrap()).unwrap();
        let ms = synthetic_manifests(
            &model,
            "fsdp:3".parse().unwrap(),
            "tp:2".parse().unwrap(),
            &[vec![1]],
        )
        .unwrap();
        (dest, with_digests(ms))
    }

    fn same_error(dest: &[RankLayout], ms: &[SourceManifest]) -> String {
        let cost = CostModel::default();
        let old = plan_reference::plan(dest, ms, &cost)
            .unwrap_err()
            .to_string();
        let new = plan(dest, ms, &cost).unwrap_err().to_string();
        assert_eq!(new, old);
        new
    }

    #[test]
    fn strided_copies_and_segments() {
        // Rows of 4 bytes: staging every 10, live every 4 (contiguous), then a break.
        let mut sink = CopySink::new(0);
        for i in 0..5u64 {
            sink.push(0, 100 + 10 * i, 4 * i, 4);
        }
        sink.push(0, 3, 20, 2);
        sink.push(0, 5, 22, 2); // continues the previous row: one copy of 4
        sink.push(1, 0, 0, 4);
        let c = sink.finish();
        assert_eq!(
            c,
            vec![
                Copy {
                    rank_index: 0,
                    staging_offset: 100,
                    live_offset: 0,
                    len: 4,
                    count: 5,
                    staging_stride: 10,
                    live_stride: 4
                },
                Copy::single(0, 3, 20, 4),
                Copy::single(1, 0, 0, 4),
            ]
        );
        assert!(c[0].live_contiguous());
        assert_eq!(c[0].bytes(), Some(20));
        assert_eq!(c[0].rows().last(), Some((140, 16)));
        assert_eq!(c[0].row(5), None);
        // Old JSON (no strides) reads as single copies and segments.
        let old: Copy =
            serde_json::from_str(r#"{"rank_index":1,"staging_offset":2,"live_offset":3,"len":4}"#)
                .unwrap();
        assert_eq!(old, Copy::single(1, 2, 3, 4));
        let seg: Segment = serde_json::from_str(r#"{"offset":5,"len":6}"#).unwrap();
        assert_eq!(seg.runs().collect::<Vec<_>>(), vec![(5, 6)]);
        let mut s = SegmentSink::default();
        for o in [0u64, 8, 16, 20, 40] {
            s.push(o, 4);
        }
        // 16 and 20 join into one run of 8.
        let segs = s.take();
        assert_eq!(
            segs.iter().flat_map(Segment::runs).collect::<Vec<_>>(),
            vec![(0, 4), (8, 4), (16, 8), (40, 4)]
        );
        assert_eq!(segs.len(), 3);
        let c = Candidates::new([
            (super::Strategy::Exact, 1.0),
            (super::Strategy::Superset, 2.0),
        ]);
        let j = serde_json::to_string(&c).unwrap();
        assert_eq!(j, r#"[["Exact",1.0],["Superset",2.0]]"#);
        assert_eq!(serde_json::from_str::<Candidates>(&j).unwrap(), c);
    }

    #[test]
    fn segments_stand_for_a_list() {
        let g = Segment {
            offset: 1,
            len: 2,
            count: 3,
            stride: 4,
        };
        for v in [vec![], vec![g], vec![g, g]] {
            let s = Segments::from(v.clone());
            assert_eq!(&*s, v.as_slice());
            assert_eq!((&s).into_iter().count(), v.len());
            let j = serde_json::to_string(&s).unwrap();
            assert_eq!(j, serde_json::to_string(&v).unwrap());
            assert_eq!(serde_json::from_str::<Segments>(&j).unwrap(), s);
            assert_eq!(Vec::from(s), v);
        }
    }

    #[test]
    fn errors_are_those_of_the_reference() {
        let (dest, ms) = base_case();
        // Missing digest for a region.
        let mut m = ms.clone();
        m[1].pieces.retain(|p| !p.tensor.ends_with("o_proj.weight"));
        assert!(same_error(&dest, &m).contains("published no digest"));
        // A tensor nobody published.
        let mut m = ms.clone();
        for x in &mut m {
            x.shards.retain(|s| s.tensor != "model.norm.weight");
        }
        assert!(same_error(&dest, &m).contains("no source published it"));
        // Dtype disagreement on every shard (uniform) and on one source only (not uniform).
        let mut m = ms.clone();
        for x in &mut m {
            for s in &mut x.shards {
                if s.tensor.ends_with("down_proj.weight") {
                    s.dtype = DType::F16;
                }
            }
        }
        assert!(same_error(&dest, &m).contains("dtype mismatch"));
        let mut m = ms.clone();
        for s in &mut m[2].shards {
            if s.tensor == "lm_head.weight" {
                s.global_shape = vec![200, 4];
                s.shard.local_shape = vec![s.shard.local_shape[0], 4];
                s.len = s.shard.numel().unwrap() * 2;
            }
        }
        assert!(same_error(&dest, &m).contains("shape mismatch"));
        // A missing source: coverage gap.
        assert!(same_error(&dest, &ms[..2]).contains("coverage gap"));
        // An inconsistent manifest.
        let mut m = ms.clone();
        m[0].shards[0].len += 1;
        assert!(same_error(&dest, &m).contains("manifest of source slot 0"));
        assert!(SourceIndex::new(&m).is_err());
        // A malformed destination region is refused without panicking.
        let mut d = dest.clone();
        d[0].params[0].pieces[0].region.global_offset.pop();
        let e = plan(&d, &ms, &CostModel::default()).unwrap_err();
        assert!(matches!(e, Error::CoverageGap { .. }), "{e}");
    }

    #[test]
    fn one_index_serves_every_worker_like_a_fresh_plan() {
        let model = llama(8, 2, 4, 16, 24, 300);
        let tp4: LayoutSpec = "tp:4".parse().unwrap();
        let dest = rank_layouts(&model, tp4).unwrap();
        // Four FSDP sources plus a replica of each: alternatives spread over ranks.
        let mut ms =
            synthetic_manifests(&model, "fsdp:4".parse().unwrap(), tp4, &[vec![0, 1]]).unwrap();
        let replicas: Vec<SourceManifest> = ms
            .iter()
            .map(|m| {
                let mut r = m.clone();
                r.slot += 4;
                r
            })
            .collect();
        ms.extend(replicas);
        let ms = with_digests(ms);
        let cost = CostModel::default();
        let index = SourceIndex::new(&ms).unwrap();
        assert!(index.approx_bytes() > 0);
        assert_eq!(index.sources().len(), 8);
        for workers in [vec![0usize], vec![1, 2], vec![0, 1, 2, 3], vec![3]] {
            let d: Vec<RankLayout> = workers.iter().map(|&r| dest[r].clone()).collect();
            let a = index.plan(&d, &cost).unwrap();
            let b = plan(&d, &ms, &cost).unwrap();
            // An index of these ranks' pieces only plans them alike, and is smaller.
            let own = SourceIndex::for_ranks(&ms, &d).unwrap();
            assert_eq!(own.plan(&d, &cost).unwrap(), a);
            if workers.len() < 4 {
                assert!(own.approx_bytes() < index.approx_bytes());
            }
            let c = plan_reference::plan(&d, &ms, &cost).unwrap();
            assert_eq!(a, b);
            assert_eq!(plan_reference::expand(&a, &ms), c);
            // Both replicas serve some reads.
            if workers.len() == 4 {
                assert!(a.reads.iter().any(|r| r.source >= 4));
                assert!(a.reads.iter().any(|r| r.source < 4));
            }
        }
    }

    /// Tensors are found by name through the hash table, and through the collision table when
    /// another name holds their hash: here every name's hash is made to point at the first
    /// tensor, so all but that one are looked up as collided names. Plans are unchanged.
    #[test]
    fn tensors_are_found_by_name_even_when_hashes_collide() {
        let model = llama(8, 2, 4, 16, 24, 300);
        let tp2: LayoutSpec = "tp:2".parse().unwrap();
        let dest = rank_layouts(&model, tp2).unwrap();
        let ms = synthetic_manifests(&model, "fsdp:2".parse().unwrap(), tp2, &[]).unwrap();
        let cost = CostModel::default();
        let index = SourceIndex::new(&ms).unwrap();
        let expect = index.plan(&dest, &cost).unwrap();
        let names: Vec<Arc<str>> = index.tensors.iter().map(|t| Arc::clone(&t.name)).collect();
        assert!(names.len() > 2);
        // In order of first appearance over the sources.
        assert_eq!(&*names[0], ms[0].shards[0].tensor.as_str());
        let mut forced = SourceIndex::new(&ms).unwrap();
        forced.by_hash.clear();
        forced.collided.clear();
        for (id, n) in (0u32..).zip(&names) {
            forced.by_hash.insert(name_hash(n), 0);
            if id > 0 {
                forced.collided.insert(ms_name(&ms, n), id);
            }
        }
        for (i, n) in names.iter().enumerate() {
            assert_eq!(index.tensor(n).map(|(k, _)| k), Some(i));
            assert_eq!(forced.tensor(n).map(|(k, _)| k), Some(i), "{n}");
        }
        assert!(index.tensor("no.such.tensor").is_none());
        assert!(forced.tensor("no.such.tensor").is_none());
        assert_eq!(forced.plan(&dest, &cost).unwrap(), expect);
    }

    /// The manifests' own copy of tensor name `n` (the collision table borrows from them).
    fn ms_name<'m>(ms: &'m [SourceManifest], n: &str) -> &'m str {
        ms.iter()
            .flat_map(|m| &m.shards)
            .find(|s| s.tensor == n)
            .map(|s| s.tensor.as_str())
            .unwrap()
    }
    #[test]
    fn synthetic_manifest_matches_synthetic_manifests() {
        let model = llama(4, 2, 4, 8, 12, 100);
        let (src, dst): (LayoutSpec, LayoutSpec) =
            ("fsdp:3".parse().unwrap(), "tp:2".parse().unwrap());
        let all = synthetic_manifests(&model, src, dst, &[vec![0]]).unwrap();
        let dest = rank_layouts(&model, dst).unwrap();
        for (r, m) in all.iter().enumerate() {
            let rl = crate::rank_layout(&model, src, r as u32).unwrap();
            assert_eq!(&synthetic_manifest(&rl, &dest, &[vec![0]]).unwrap(), m);
            assert_eq!(m.shards[0].addr, (r as u64 + 1) << 40);
            assert!(m.shards.iter().all(|s| s.device == MemDevice::Dram));
        }
    }

    /// A new policy version changes every digest and nothing else: the geometry digest is
    /// unchanged and so is the plan, whose checks then look up the new digests. Any field a
    /// plan depends on changes the geometry digest.
    #[test]
    fn geometry_digest_ignores_digests_and_sees_every_planned_field() {
        type Change = Box<dyn Fn(&mut Vec<SourceManifest>)>;
        let model = llama(8, 2, 4, 16, 24, 300);
        let tp2: LayoutSpec = "tp:2".parse().unwrap();
        let dest = rank_layouts(&model, tp2).unwrap();
        let a = with_digests(
            synthetic_manifests(&model, "fsdp:4".parse().unwrap(), tp2, &[vec![0, 1]]).unwrap(),
        );
        let g = crate::geometry_digest(&a);
        let mut b = a.clone();
        for m in &mut b {
            m.pack_seconds = 1.5;
            m.agent_metadata = vec![9; 8];
            for s in &mut m.shards {
                s.digest = Digest([1; 32]);
            }
            for p in &mut m.pieces {
                p.digest = Digest([2; 32]);
            }
        }
        assert_eq!(crate::geometry_digest(&b), g);
        let cost = CostModel::default();
        let pa = plan(&dest, &a, &cost).unwrap();
        assert_eq!(plan(&dest, &b, &cost).unwrap(), pa);
        assert!(!pa.verify.is_empty());
        for v in &pa.verify {
            assert_ne!(v.published(&a).unwrap().digest, Digest([2; 32]));
            assert_eq!(v.published(&b).unwrap().digest, Digest([2; 32]));
        }

        let (ps, pp) = a
            .iter()
            .enumerate()
            .find_map(|(i, m)| {
                m.pieces
                    .iter()
                    .position(|p| p.packed_addr.is_some())
                    .map(|j| (i, j))
            })
            .expect("a packed piece");
        let changes: Vec<(&str, Change)> = vec![
            ("slot", Box::new(|m| m[1].slot = 9)),
            (
                "source layout",
                Box::new(|m| m[0].layout = "fsdp:8".parse().unwrap()),
            ),
            ("agent name", Box::new(|m| m[0].agent_name.push('x'))),
            ("source order", Box::new(|m| m.swap(0, 1))),
            ("a source fewer", Box::new(|m| drop(m.pop()))),
            (
                "shard tensor",
                Box::new(|m| m[0].shards[0].tensor.push('x')),
            ),
            (
                "shard dtype",
                Box::new(|m| m[0].shards[0].dtype = DType::F32),
            ),
            (
                "global shape",
                Box::new(|m| m[0].shards[0].global_shape[0] += 1),
            ),
            (
                "shard offset",
                Box::new(|m| m[3].shards[2].shard.global_offset[0] += 1),
            ),
            (
                "shard shape",
                Box::new(|m| m[3].shards[2].shard.local_shape[0] -= 1),
            ),
            ("shard address", Box::new(|m| m[2].shards[1].addr += 64)),
            ("shard length", Box::new(|m| m[2].shards[1].len += 2)),
            (
                "memory kind",
                Box::new(|m| m[0].shards[0].device = MemDevice::Vram(0)),
            ),
            ("a shard fewer", Box::new(|m| drop(m[1].shards.pop()))),
            (
                "piece layout",
                Box::new(|m| m[0].pieces[0].layout = "tp:4".parse().unwrap()),
            ),
            ("piece rank", Box::new(|m| m[0].pieces[0].dest_rank += 1)),
            (
                "piece tensor",
                Box::new(|m| m[0].pieces[0].tensor.push('x')),
            ),
            (
                "piece offset",
                Box::new(|m| m[1].pieces[3].region.global_offset[0] += 1),
            ),
            (
                "piece shape",
                Box::new(|m| m[1].pieces[3].region.local_shape[0] += 1),
            ),
            (
                "packed address moved",
                Box::new(move |m| {
                    m[ps].pieces[pp].packed_addr = m[ps].pieces[pp].packed_addr.map(|x| x + 2)
                }),
            ),
            (
                "packed address dropped",
                Box::new(move |m| m[ps].pieces[pp].packed_addr = None),
            ),
            (
                "packed address added",
                Box::new(|m| m[0].pieces[0].packed_addr = Some(0)),
            ),
            ("a piece fewer", Box::new(|m| drop(m[0].pieces.pop()))),
        ];
        assert!(a[0].pieces[0].packed_addr.is_none());
        for (what, change) in changes {
            let mut c = a.clone();
            change(&mut c);
            assert_ne!(c, a, "{what}: the change did nothing");
            assert_ne!(crate::geometry_digest(&c), g, "{what}");
        }
    }
}
