//! The source index: every source's shards, grouped per tensor by box with a dim-0 interval
//! search, and the pieces each source published from them, built once per set of manifests.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use crate::{DType, DestPiece, Error, LayoutSpec, RankLayout, SourceManifest, TensorBox};

/// A fast, non-cryptographic hasher (the rustc `FxHasher` mixing step) for the planner's internal
/// maps, whose keys are short tuples of integers, tensor ids and boxes. Not HashDoS-resistant:
/// the keys come from manifests the fleet's own trainer ranks publish.
#[derive(Default, Clone, Copy)]
pub(super) struct FxHasher(u64);

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

pub(super) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// A 64-bit hash of a tensor name (FxHasher over its bytes), for [`SourceIndex`]'s name table.
pub(super) fn name_hash(name: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(name.as_bytes());
    h.finish()
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

/// A published piece as the planner looks it up: stored with the other pieces published for the
/// same destination (layout, rank), in shard order, region and digest inline.
pub(super) struct PieceEntry {
    /// The alternative (source shard) it was cut from: an index into [`TensorShards::alts`].
    alt: usize,
    /// Its region is `piece_dims[region_at..]`: the offset, then the shape, `ndim` each, where
    /// `ndim` is that of the shard's box (it lies inside it).
    region_at: usize,
    /// Its index in its manifest's `pieces`.
    pub(super) index: u32,
    pub(super) packed_addr: Option<u64>,
}

/// The shards of one tensor over all sources, grouped by box, with the pieces cut from them.
pub(super) struct TensorShards {
    /// Distinct shard boxes in [`TensorBox`] order. Sources holding the same box (replicated
    /// sources) are alternatives of one group.
    pub(super) groups: Vec<BoxGroup>,
    /// `prefix_end[i]`: the largest dim-0 end of `groups[..=i]` (non-decreasing), so the first
    /// group that can reach past a given row is found by binary search.
    prefix_end: Vec<u64>,
    /// Every group's box, flat: its global offset then its local shape.
    dims: Vec<u64>,
    /// Every group's alternatives, flat, in (source, shard) order: (source, shard, address).
    pub(super) alts: Vec<(usize, usize, u64)>,
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
    pub(super) uniform: Option<(DType, Vec<u64>)>,
    /// The tensor's name, allocated once: every plan's items and choices of the tensor share it.
    pub(super) name: Arc<str>,
}

pub(super) struct BoxGroup {
    /// Dim-0 start and end (saturating) of the box; (0, u64::MAX) for a 0-d box.
    start0: u64,
    pub(super) end0: u64,
    /// The box is `dims[dims_at..dims_at + ndim]` (offset), then `ndim` more (shape).
    dims_at: usize,
    pub(super) ndim: usize,
    /// Its alternatives are `alts[alts_at..alts_at + n_alts]` (at least one).
    pub(super) alts_at: usize,
    pub(super) n_alts: usize,
}

impl TensorShards {
    /// Groups whose dim-0 extent may intersect that of the box at `offset` with `shape`, in box
    /// order: every group that does is in the range (the range may hold some that do not).
    pub(super) fn candidates(&self, offset: &[u64], shape: &[u64]) -> std::ops::Range<usize> {
        let (Some(&lo0), Some(&n0)) = (offset.first(), shape.first()) else {
            return 0..self.groups.len();
        };
        let hi0 = lo0.saturating_add(n0);
        let upper = self.groups.partition_point(|g| g.start0 < hi0);
        let lower = self.prefix_end.partition_point(|&e| e <= lo0);
        lower..upper.max(lower)
    }

    /// (offset, shape) of a group's box.
    pub(super) fn bx(&self, g: &BoxGroup) -> (&[u64], &[u64]) {
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
    pub(super) fn rank_pieces(&self, layout: LayoutSpec, rank: u32) -> std::ops::Range<usize> {
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
    pub(super) fn piece(
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
    pub(super) sources: &'m [SourceManifest],
    /// Index of the first shard of each source in a dense numbering of all shards.
    pub(super) shard_base: Vec<usize>,
    pub(super) shard_count: usize,
    /// Every tensor's shards, in order of first appearance over the sources (checkpoint order,
    /// as a plan visits them): the entries of neighbouring tensors lie side by side in memory.
    pub(super) tensors: Vec<TensorShards>,
    /// Tensor index by the 64-bit hash of its name ([`name_hash`]), checked against the entry's
    /// name; names whose hash another name took are in `collided`. A lookup touches this small
    /// table and the entry, not the manifests' strings.
    pub(super) by_hash: FxMap<u64, u32>,
    pub(super) collided: FxMap<&'m str, u32>,
    /// Intersections and box dims (u64s) the last plan found: the next plan reserves as much
    /// up front (plans against one index are alike), instead of growing its lists by copying.
    pub(super) last_found: AtomicUsize,
    pub(super) last_dims: AtomicUsize,
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
        let ShardsByTensor {
            shard_base,
            shard_count,
            by_tensor,
            position,
        } = shards_by_tensor(sources)?;
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
            if let Some(t) = TensorShards::group(sources, name, cands) {
                tensors.push(t);
            }
        }
        let attached = attach_pieces(sources, only, &position, &tensors)?;
        for (t, list) in tensors.iter_mut().zip(attached) {
            t.store_pieces(list);
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
    pub(super) fn tensor_near(
        &self,
        name: &str,
        hint: Option<usize>,
    ) -> Option<(usize, &TensorShards)> {
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
    pub(super) fn tensor(&self, name: &str) -> Option<(usize, &TensorShards)> {
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
}

/// The pieces attached to one tensor's alternatives: (alternative, index of the piece in its
/// manifest, the piece).
type Attached<'m> = Vec<(usize, u32, &'m DestPiece)>;

/// The shards of a set of sources, numbered and listed per tensor.
struct ShardsByTensor<'m> {
    /// Index of the first shard of each source in a dense numbering of all shards.
    shard_base: Vec<usize>,
    shard_count: usize,
    /// Each tensor's shards as (source, shard), tensors in order of first appearance.
    by_tensor: Vec<(&'m str, Vec<(usize, usize)>)>,
    /// Each tensor's position in `by_tensor`.
    position: FxMap<&'m str, usize>,
}

/// Numbers the shards of `sources` and lists them per tensor.
///
/// # Errors
/// [`Error::Overflow`] when the shards cannot be counted in a `usize`.
fn shards_by_tensor(sources: &[SourceManifest]) -> Result<ShardsByTensor<'_>, Error> {
    let mut shard_base = Vec::with_capacity(sources.len());
    let mut shard_count = 0usize;
    // Each tensor's shards, tensors in order of first appearance.
    let mut by_tensor: Vec<(&str, Vec<(usize, usize)>)> = Vec::new();
    let mut position: FxMap<&str, usize> = FxMap::default();
    for (si, m) in sources.iter().enumerate() {
        shard_base.push(shard_count);
        shard_count = shard_count
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
    Ok(ShardsByTensor {
        shard_base,
        shard_count,
        by_tensor,
        position,
    })
}

impl TensorShards {
    /// The tensor `name` whose shards are `cands` (source, shard) of `sources`, grouped by box,
    /// without pieces yet; `None` for no shards.
    fn group(
        sources: &[SourceManifest],
        name: &str,
        cands: Vec<(usize, usize)>,
    ) -> Option<TensorShards> {
        let &(s0, h0) = cands.first()?;
        let first = &sources[s0].shards[h0];
        let uniform = cands
            .iter()
            .all(|&(si, hi)| {
                let s = &sources[si].shards[hi];
                s.dtype == first.dtype && s.global_shape == first.global_shape
            })
            .then(|| (first.dtype, first.global_shape.clone()));
        let mut boxes: BTreeMap<&TensorBox, Vec<(usize, usize)>> = BTreeMap::new();
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
        Some(t)
    }

    /// Stores the pieces `list` attached to this tensor's alternatives ([`attach_pieces`]).
    fn store_pieces(&mut self, mut list: Attached<'_>) {
        // By (layout, rank), then alternative; manifest order kept among equals.
        list.sort_by_key(|&(a, _, p)| (p.layout, p.dest_rank, a));
        self.pieces.reserve_exact(list.len());
        for (a, index, p) in list {
            let key = (p.layout, p.dest_rank);
            if self.piece_keys.last().is_none_or(|k| k.0 != key) {
                self.piece_keys.push((key, self.pieces.len()));
            }
            self.pieces.push(PieceEntry {
                alt: a,
                region_at: self.piece_dims.len(),
                index,
                packed_addr: p.packed_addr,
            });
            self.piece_dims.extend_from_slice(&p.region.global_offset);
            self.piece_dims.extend_from_slice(&p.region.local_shape);
        }
    }
}

/// Each published piece of `sources` (whose (layout, destination rank) is in `only`, when
/// given) goes with every shard of its own source that holds its region: the planner only asks
/// a shard for regions inside it. Per tensor of `tensors` (found by `position`): (alternative,
/// index of the piece in its manifest, the piece), in manifest order.
///
/// # Errors
/// [`Error::Overflow`] when a manifest's pieces cannot be counted in a `u32`.
fn attach_pieces<'m>(
    sources: &'m [SourceManifest],
    only: Option<&[(LayoutSpec, u32)]>,
    position: &FxMap<&str, usize>,
    tensors: &[TensorShards],
) -> Result<Vec<Attached<'m>>, Error> {
    let mut attached: Vec<Attached<'m>> = vec![Vec::new(); tensors.len()];
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
    Ok(attached)
}
