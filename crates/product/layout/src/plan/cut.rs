//! Cuts (the regions a source digests, and may pack, for a destination layout) and the synthetic
//! manifests built from them for offline planning and benchmarks.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use serde::{Deserialize, Serialize};

use super::geometry::decompose;
use super::index::{FxHasher, FxMap};
use crate::{
    DestPiece, Digest, Error, LayoutSpec, RankLayout, ShardEntry, SourceManifest, TensorBox,
};

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
