//! Phase 4 of a plan: apply copies and verification segments, in group order (each intersection
//! becomes its digest check), and the zero fills of vocab padding.

use super::geometry::{runs_in, Runs};
use super::isect::{Img, Isect};
use super::output::{VerifyItem, ZeroFill};
use super::sinks::{CopySink, SegmentSink};
use crate::{RankLayout, SourceManifest};

/// Where staged image runs lie: the staging offset of every wire run (by id) and the flat image
/// list of [`Img::Flat`] images.
#[derive(Clone, Copy)]
pub(super) struct StagingMap<'a> {
    pub(super) staging: &'a [u64],
    pub(super) img_all: &'a [(u32, u64)],
}

impl StagingMap<'_> {
    /// Staging offset of run `j` of `img`.
    #[inline]
    fn at(&self, img: &Img, j: u64) -> u64 {
        match *img {
            Img::Affine {
                wire, off0, stride, ..
            } => self.staging[wire as usize]
                .wrapping_add(off0)
                .wrapping_add(j.wrapping_mul(stride)),
            Img::Flat { start, .. } => {
                let (w, o) = self
                    .img_all
                    .get(start as usize + j as usize)
                    .copied()
                    .unwrap_or((0, 0));
                self.staging[w as usize].wrapping_add(o)
            }
        }
    }
}

/// The apply copies (still to be finished), the digest checks and the live bytes they write.
pub(super) struct Applied {
    pub(super) copies: CopySink,
    pub(super) verify: Vec<VerifyItem>,
    pub(super) useful_bytes: u64,
}

/// Phase 4's state: the sinks the intersections' copies and segments go to.
struct Apply<'a> {
    map: StagingMap<'a>,
    rdims: &'a [u64],
    dest: &'a [RankLayout],
    shared_staging: bool,
    copies: CopySink,
    seg_sink: SegmentSink,
    /// The staging offset of each item's first byte (`u64::MAX`: none): items with the same
    /// bytes share it.
    heads: Vec<u64>,
    useful_bytes: u64,
}

/// Phase 4: the apply copies and the digest check of every intersection of `isects` (boxes in
/// `rdims`, staged where `map` says), in order; checks of identical staged bytes merged when
/// `shared_staging` says they may be.
pub(super) fn apply(
    isects: Vec<Isect<'_>>,
    dest: &[RankLayout],
    sources: &[SourceManifest],
    rdims: &[u64],
    map: StagingMap<'_>,
    shared_staging: bool,
) -> Applied {
    let mut ap = Apply {
        map,
        rdims,
        dest,
        shared_staging,
        copies: CopySink::new(isects.len()),
        seg_sink: SegmentSink::default(),
        heads: Vec::with_capacity(if shared_staging { isects.len() } else { 0 }),
        useful_bytes: 0,
    };
    // Each intersection becomes its verification item where it lies (the same size: the
    // collection reuses the intersections' memory).
    let mut verify: Vec<VerifyItem> = isects.into_iter().map(|x| ap.verify_item(x)).collect();
    let Apply {
        copies,
        heads,
        useful_bytes,
        ..
    } = ap;
    if shared_staging {
        dedup_verify(&mut verify, &heads, sources);
    }
    drop(heads);
    Applied {
        copies,
        verify,
        useful_bytes,
    }
}

impl Apply<'_> {
    /// The copies of `x` into the live buffer, and its digest check.
    #[inline]
    fn verify_item(&mut self, x: Isect<'_>) -> VerifyItem {
        let map = self.map;
        let img_at = |j: u64| map.at(&x.img, j);
        let n_img = x.img.count();
        let irb = x.img_run_bytes();
        let total = n_img.wrapping_mul(irb);
        self.useful_bytes = self.useful_bytes.saturating_add(total);
        // Staged runs evenly spaced: (staging offset of run 0, stride).
        let img_affine = match x.img {
            Img::Affine {
                wire, off0, stride, ..
            } => Some((map.staging[wire as usize].wrapping_add(off0), stride)),
            Img::Flat { .. } => None,
        };
        self.push_copies(&x, img_affine, n_img, irb);
        match img_affine {
            Some((s0, ss)) => self.seg_sink.push_runs(s0, ss, irb, n_img),
            None => {
                for jj in 0..n_img {
                    self.seg_sink.push(img_at(jj), irb);
                }
            }
        }
        let segments = self.seg_sink.take();
        if self.shared_staging {
            self.heads
                .push(segments.first().map_or(u64::MAX, |sg| sg.offset));
        }
        VerifyItem {
            source: x.source as usize,
            tensor: x.tensor,
            dest_rank: self.dest.get(x.rank_index as usize).map_or(0, |rl| rl.rank),
            piece: x.piece_index,
            shared_with: Vec::new(),
            segments,
        }
    }

    /// The apply copies of `x`: its `n_img` staged image runs of `irb` bytes (evenly spaced
    /// as `img_affine` says, when they are) onto the runs of its region in the live buffer.
    #[inline]
    fn push_copies(&mut self, x: &Isect<'_>, img_affine: Option<(u64, u64)>, n_img: u64, irb: u64) {
        let map = self.map;
        let img_at = |j: u64| map.at(&x.img, j);
        let (ro, rs) = x.region(self.rdims);
        let (lrun, lruns) = runs_in(
            ro,
            rs,
            &x.piece.region.global_offset,
            &x.piece.region.local_shape,
        );
        let elem = u64::from(x.elem);
        let lrun_b = lrun.wrapping_mul(elem);
        let total = n_img.wrapping_mul(irb);
        let live_at = |q: u64| x.piece.offset.wrapping_add(lruns.get(q).wrapping_mul(elem));
        // Staged and live runs both evenly spaced: the rows the walk below visits, in
        // closed form (row `p` at staging `s0 + p * ss`, live `l0 + p * ls`).
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
                } else if n_img == 1 && irb.is_multiple_of(lrun_b) {
                    Some((s0, lrun_b, l0, ls, lrun_b, irb / lrun_b))
                } else if lruns.len() == 1
                    && lrun_b.is_multiple_of(irb)
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
            self.copies
                .push_rows(x.rank_index as usize, (s0, ss), (l0, ls), len, count);
            return;
        }
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
            self.copies.push(x.rank_index as usize, s_off, l_off, unit);
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
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a.max(1)
    } else {
        gcd(b, a % b)
    }
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

/// The zero fills of every rank of `dest` (vocab padding rows), in order.
pub(super) fn zero_fills(dest: &[RankLayout]) -> Vec<ZeroFill> {
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
    zero_fills
}
