//! The planner's record of one intersection (destination piece x source shard) and of where its
//! staged copy lies.

use super::geometry::Runs;
use crate::Piece;

/// Where the staged copy of an intersection's runs lies: image run `j` at (wire id, offset).
/// Wire ids and positions in the image list are 32-bit (a plan with more is an
/// [`Error::Overflow`](crate::Error::Overflow)), so that an [`Isect`] stays two cache lines.
#[derive(Debug, Clone, Copy)]
pub(super) enum Img {
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
    pub(super) fn count(&self) -> u64 {
        match self {
            Img::Affine { count, .. } | Img::Flat { count, .. } => *count,
        }
    }
}

/// Intersection of one destination piece with one source shard (128 bytes: a plan holds one per
/// (shard, destination piece) pair met, ~187k for a Kimi-K2 rank, in fresh memory).
pub(super) struct Isect<'a> {
    /// The destination piece (tensor, region, live offset).
    pub(super) piece: &'a Piece,
    /// Source address of the shard: run `i` of the region is at `src_base + runs.get(i) * elem`,
    /// `src_run_bytes` long.
    pub(super) src_base: u64,
    /// Packed address of the published piece (meaningful when `has_packed`; copied: the index
    /// is cold by the time it is used).
    pub(super) packed_addr: u64,
    pub(super) src_run_bytes: u64,
    pub(super) runs: Runs,
    /// After the strategy choice: the staging image, runs of [`Isect::img_run_bytes`].
    pub(super) img: Img,
    /// Index of the destination rank in the plan's `dest`.
    pub(super) rank_index: u32,
    /// Index of the source manifest.
    pub(super) source: u32,
    /// The tensor: an index into the plan's list of tensor names.
    pub(super) tensor: u32,
    /// The intersection box is `rdims[region_at..]` of the plan's flat box list: its offset,
    /// then its shape, as many dims as the piece's region.
    pub(super) region_at: u32,
    /// Index of the published piece in its manifest.
    pub(super) piece_index: u32,
    /// Bytes per element.
    pub(super) elem: u32,
    /// Whether the published piece has a packed address.
    pub(super) has_packed: bool,
    /// Whether the strategy staged the region packed (one image run of every source run).
    pub(super) staged_packed: bool,
}

// Kept at two cache lines: a plan writes one per intersection to fresh memory.
const _: () = assert!(std::mem::size_of::<Isect<'static>>() <= 128);

impl Isect<'_> {
    /// (offset, shape) of the intersection box in the plan's flat box list.
    pub(super) fn region<'d>(&self, rdims: &'d [u64]) -> (&'d [u64], &'d [u64]) {
        let n = self.piece.region.local_shape.len();
        let at = self.region_at as usize;
        let o = rdims.get(at..at + n).unwrap_or_default();
        let s = rdims.get(at + n..at + 2 * n).unwrap_or_default();
        (o, s)
    }

    /// Elements of the intersection box (0 on overflow, as
    /// [`TensorBox::numel`](crate::TensorBox::numel)).
    pub(super) fn numel(&self, rdims: &[u64]) -> u64 {
        self.region(rdims)
            .1
            .iter()
            .try_fold(1u64, |a, &x| a.checked_mul(x))
            .unwrap_or(0)
    }

    /// Source address of run `i`.
    pub(super) fn src_run(&self, i: u64) -> u64 {
        self.src_base
            .wrapping_add(self.runs.get(i).wrapping_mul(u64::from(self.elem)))
    }

    /// Bytes of one staging-image run: the source run, or every source run back to back when
    /// staged packed.
    pub(super) fn img_run_bytes(&self) -> u64 {
        if self.staged_packed {
            self.runs.len().wrapping_mul(self.src_run_bytes)
        } else {
            self.src_run_bytes
        }
    }

    /// (addr, addr + len) of every source run, in order.
    pub(super) fn src_spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.runs.len()).map(|i| {
            let a = self.src_run(i);
            (a, a + self.src_run_bytes)
        })
    }

    /// The runs are strictly increasing with gaps between them (one isect's runs then coalesce
    /// into exactly `len()` descriptors and merge into none of each other).
    pub(super) fn runs_disjoint_gapped(&self) -> bool {
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
