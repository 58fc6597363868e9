//! What a plan is made of: the cost model it is chosen under, its strategies, and the reads,
//! apply copies, zero fills, staging segments, digest checks and choices it lists.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{DestPiece, SourceManifest};

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
/// manifests given to [`plan`](super::plan)) into the staging buffer at `staging_offset`.
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
    /// Index of the rank in the `dest` slice given to [`plan`](super::plan).
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
    /// offset overflows u64 (a plan from [`plan`](super::plan) has none).
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
    /// offset overflows u64 (a plan from [`plan`](super::plan) has none).
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map_while(|i| {
            i.checked_mul(self.stride)
                .and_then(|d| self.offset.checked_add(d))
                .map(|o| (o, self.len))
        })
    }
}

/// The staging segments of a [`VerifyItem`], in order: one held inline (the common case, a
/// region staged in one piece or as one strided run), more on the heap. Derefs to a slice of
/// [`Segment`]s; serialized as a list.
#[derive(Clone, Serialize, Deserialize)]
#[serde(from = "Vec<Segment>", into = "Vec<Segment>")]
pub struct Segments(pub(super) SegmentsRepr);

#[derive(Clone)]
pub(super) enum SegmentsRepr {
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
    pub(super) fn new(list: impl IntoIterator<Item = (Strategy, f64)>) -> Candidates {
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
