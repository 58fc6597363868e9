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

// The output types (`output`) and the index (`index`); a plan's phases, in order: `discover`
// (intersections), `choose` (strategies), `stage` (staging and reads), `apply` (copies and digest
// checks), `coverage` (the proof); their tools: `isect`, `geometry`, `order`, `sinks`; and `cut`
// (what publishers digest and pack, synthetic manifests).
mod apply;
mod choose;
mod coverage;
mod cut;
mod discover;
mod geometry;
mod index;
mod isect;
mod order;
mod output;
mod sinks;
mod stage;
#[cfg(test)]
mod tests;

pub use coverage::prove_coverage;
// For the reference planner of the tests (`plan_reference`); the planner uses it from `cut`.
#[cfg(test)]
pub(crate) use cut::missing_digest;
pub use cut::{cut_for_layout, pack_marks, synthetic_manifest, synthetic_manifests, Cut};
pub use geometry::decompose;
pub use index::{validate_manifest, SourceIndex};
pub use output::{
    Candidates, Choice, Copy, CostModel, Plan, Read, Segment, Segments, Strategy, VerifyItem,
    ZeroFill,
};

use apply::{apply, zero_fills, Applied, StagingMap};
use discover::Found;
use stage::{stage, Staged};

use crate::{Error, RankLayout, SourceManifest};

impl SourceIndex<'_> {
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

        // 1. Intersections, in order of discovery (rank, parameter, piece, box group), then
        // grouped by (source, shard): groups in order of their first discovery, each group's
        // intersections in order of discovery. Boxes of intersections go to one flat list,
        // `rdims`.
        let Found {
            mut isects,
            keys,
            rdims,
            tensors,
            member_at,
        } = self.intersections(dest)?;

        // 2. Strategy per (source, shard); wire runs deduplicated by (source, addr, len).
        // Identical wire runs are merged when staged (step 3).
        let (choices, wires) =
            self.choose_strategies(&mut isects, &keys, &member_at, &rdims, cost, opts)?;
        drop(keys);

        // 3. Staging offsets in (source, addr) order, then coalescing.
        let Staged {
            staging,
            reads,
            staging_bytes,
            shared_staging,
        } = stage(&wires.wire, sources.len(), &member_at)?;
        let wire_bytes = staging_bytes;

        // 4. Apply copies and verification segments, in group order.
        let map = StagingMap {
            staging: &staging,
            img_all: &wires.img_all,
        };
        let Applied {
            copies,
            verify,
            useful_bytes,
        } = apply(isects, dest, sources, &rdims, map, shared_staging);
        let zero_fills = zero_fills(dest);
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
