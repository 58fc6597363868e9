//! Phase 1 of a plan: the intersections of every destination piece with the source shards of its
//! tensor, in order of discovery (rank, parameter, piece, box group), then grouped by (source,
//! shard).

use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;

use super::cut::missing_digest;
use super::geometry::{intersect_into, runs_in};
use super::index::{FxMap, SourceIndex, TensorShards};
use super::isect::{Img, Isect};
use super::order::{group_by_first_seen, permute_in_place};
use crate::{DType, Error, LayoutSpec, Param, Piece, RankLayout, TensorBox};

/// The intersections of a plan, grouped by (source, shard): groups in order of their first
/// discovery, each group's intersections in order of discovery.
pub(super) struct Found<'d> {
    /// The intersections; group `p`'s are `isects[member_at[p]..member_at[p + 1]]`.
    pub(super) isects: Vec<Isect<'d>>,
    /// Dense shard number of each intersection's shard.
    pub(super) keys: Vec<usize>,
    /// The boxes of the intersections, flat ([`Isect::region`]).
    pub(super) rdims: Vec<u64>,
    /// The plan's tensor names, each once, in order of discovery.
    pub(super) tensors: Vec<Arc<str>>,
    /// Where each group starts in `isects`, then `isects.len()` (just `[0]` when there are none).
    pub(super) member_at: Vec<usize>,
}

/// The error for an index that does not fit in 32 bits.
pub(super) fn count_overflow(what: &'static str) -> Error {
    Error::Overflow {
        what,
        tensor: String::new(),
    }
}

/// The plan's tensor names, each once, and the id of each tensor met (by its entry's address in
/// the index), with the last one at hand: pieces of one tensor come together.
#[derive(Default)]
struct TensorNames {
    names: Vec<Arc<str>>,
    ids: FxMap<usize, u32>,
    last: Option<(usize, u32)>,
}

impl TensorNames {
    /// The id of the index's tensor `ts_key` (`ts`, named `tensor` by the piece), given it the
    /// first time.
    #[inline]
    fn id(&mut self, ts_key: usize, ts: &TensorShards, tensor: &str) -> Result<u32, Error> {
        Ok(match self.last {
            Some((k, id)) if k == ts_key => id,
            _ => {
                let id = match self.ids.get(&ts_key) {
                    Some(&id) => id,
                    None => {
                        let id = u32::try_from(self.names.len()).map_err(|_| Error::Overflow {
                            what: "tensor count",
                            tensor: tensor.to_string(),
                        })?;
                        self.names.push(Arc::clone(&ts.name));
                        self.ids.insert(ts_key, id);
                        id
                    }
                };
                self.last = Some((ts_key, id));
                id
            }
        })
    }
}

/// Phase 1's lists as they grow: boxes of intersections go to one flat list, `rdims`.
struct Discovery<'d> {
    found: Vec<Isect<'d>>,
    /// Dense shard number of each found intersection's shard.
    keys: Vec<usize>,
    rdims: Vec<u64>,
    tensors: TensorNames,
    /// The index's tensor of the previous piece looked up.
    last_lookup: Option<usize>,
}

/// A destination piece with the rank and parameter that hold it.
#[derive(Clone, Copy)]
struct DestAt<'d> {
    /// Index of the rank in the plan's `dest`.
    ri: u32,
    rl: &'d RankLayout,
    param: &'d Param,
    piece: &'d Piece,
}

/// Checks a source's dtype and global shape against the destination piece's.
#[inline]
fn check_matches(piece: &Piece, s_dtype: DType, s_shape: &[u64]) -> Result<(), Error> {
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
}

impl SourceIndex<'_> {
    /// Phase 1: the intersections of every piece of `dest` with the indexed shards, grouped by
    /// (source, shard).
    pub(super) fn intersections<'d>(&self, dest: &'d [RankLayout]) -> Result<Found<'d>, Error> {
        let layout0 = dest.first().map(|d| d.layout);
        let hint = self.last_found.load(AtomicOrdering::Relaxed);
        let mut st = Discovery {
            found: Vec::with_capacity(hint),
            keys: Vec::with_capacity(hint),
            rdims: Vec::with_capacity(self.last_dims.load(AtomicOrdering::Relaxed)),
            tensors: TensorNames::default(),
            last_lookup: None,
        };
        // Intersections hold 32-bit source and rank indices (checked here, once).
        u32::try_from(self.sources.len()).map_err(|_| count_overflow("source count"))?;
        for (ri, rl) in dest.iter().enumerate() {
            let ri = u32::try_from(ri).map_err(|_| count_overflow("destination rank count"))?;
            for param in &rl.params {
                for piece in &param.pieces {
                    let at = DestAt {
                        ri,
                        rl,
                        param,
                        piece,
                    };
                    self.intersect_piece(&mut st, at, layout0)?;
                }
            }
        }
        self.last_found
            .store(st.found.len(), AtomicOrdering::Relaxed);
        self.last_dims
            .store(st.rdims.len(), AtomicOrdering::Relaxed);
        let Discovery {
            mut found,
            mut keys,
            rdims,
            tensors,
            ..
        } = st;
        let member_at = group_by_shard(&mut found, &mut keys, self.shard_count);
        Ok(Found {
            isects: found,
            keys,
            rdims,
            tensors: tensors.names,
            member_at,
        })
    }

    /// The intersections of one destination piece with the shards of its tensor, appended to
    /// `st` in box order.
    fn intersect_piece<'d>(
        &self,
        st: &mut Discovery<'d>,
        DestAt {
            ri,
            rl,
            param,
            piece,
        }: DestAt<'d>,
        layout0: Option<LayoutSpec>,
    ) -> Result<(), Error> {
        let sources = self.sources;
        let Some((ts_key, ts)) = self.tensor_near(&piece.tensor, st.last_lookup) else {
            return Err(Error::MissingTensor {
                tensor: piece.tensor.clone(),
                reason: format!(
                    "no source published it (needed by {} on rank {})",
                    param.name, rl.rank
                ),
            });
        };
        st.last_lookup = Some(ts_key);
        let pr = &piece.region;
        // A malformed region intersects nothing (the coverage proof names it).
        let malformed = pr.global_offset.len() != pr.local_shape.len();
        // Uniform tensors are checked once and only the groups that can intersect
        // the piece are visited; otherwise every group is visited and checked.
        let (range, uniform_elem) = match &ts.uniform {
            Some((dt, shape)) => {
                let dt = *dt;
                check_matches(piece, dt, shape)?;
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
                    check_matches(piece, s.dtype, &s.global_shape)?;
                    if malformed {
                        continue;
                    }
                    s.dtype.size_bytes()
                }
            };
            let (so, ss) = ts.bx(g);
            let region_at = st.rdims.len();
            if !intersect_into(so, ss, &pr.global_offset, &pr.local_shape, &mut st.rdims) {
                continue;
            }
            let (ro, rs) = st.rdims[region_at..].split_at(ss.len());
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
                return Err(missing_digest(&piece.tensor, sources[si].slot, &region, rl));
            };
            let tensor = st.tensors.id(ts_key, ts, &piece.tensor)?;
            let (run, runs) = runs_in(ro, rs, so, ss);
            st.keys.push(self.shard_base[si] + hi);
            st.found.push(Isect {
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
        Ok(())
    }
}

/// Groups `found` (and their `keys`, the dense shard numbers) by shard, in order of each group's
/// first intersection's discovery, each in order of discovery; returns where each group starts,
/// then `found.len()`: group `p`'s intersections are `found[member_at[p]..member_at[p + 1]]`. A
/// plan for one rank meets each shard once per tensor, in a row: its intersections are grouped
/// as found and nothing moves. Otherwise they are moved into group order in place (no second
/// copy of the intersections).
fn group_by_shard(found: &mut [Isect<'_>], keys: &mut [usize], shard_count: usize) -> Vec<usize> {
    if let Some(order) = group_by_first_seen(keys, shard_count) {
        permute_in_place(found, &order);
        permute_in_place(keys, &order);
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
    member_at
}
