//! The CPU work of a publish: digest shards, cut the regions every destination layout needs,
//! digest them and pack the strided ones contiguously. Synchronous and parallel (rayon); the
//! bytes come in as one slice per shard, wherever they live.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use mx_layout::plan::{cut_for_layout, pack_marks, Cut};
use mx_layout::{DestPiece, Digest, LayoutSpec, RankLayout, ShardEntry};
use rayon::prelude::*;

use crate::Error;

/// A destination layout as one publish sees it: its ranks and which of them registered workers
/// hold (for packing).
pub(crate) struct DestLayout {
    pub(crate) layout: LayoutSpec,
    pub(crate) ranks: Vec<RankLayout>,
    /// Rank sets of the workers registered with this layout.
    pub(crate) rank_sets: Vec<Vec<u32>>,
}

/// The cuts of one destination layout, each marked when it is packed.
#[derive(Debug, Clone)]
pub(crate) struct Cuts {
    pub(crate) layout: LayoutSpec,
    pub(crate) cuts: Vec<Cut>,
    pub(crate) marks: Vec<bool>,
}

/// Cuts `shards` for every layout of `dests`; marks strided cuts that some registered worker
/// needs when `pack`.
///
/// # Errors
/// [`Error::Layout`] when a shard's size overflows.
pub(crate) fn cut_all(
    shards: &[ShardEntry],
    dests: &[DestLayout],
    pack: bool,
) -> Result<Vec<Cuts>, Error> {
    dests
        .iter()
        .map(|d| {
            let cuts = cut_for_layout(shards, &d.ranks)?;
            let marks = if pack {
                pack_marks(&cuts, &d.rank_sets)
            } else {
                vec![false; cuts.len()]
            };
            Ok(Cuts {
                layout: d.layout,
                cuts,
                marks,
            })
        })
        .collect()
}

/// Bytes the packed cuts of `all` take.
pub(crate) fn packed_bytes(all: &[Cuts]) -> u64 {
    all.iter()
        .flat_map(|c| c.cuts.iter().zip(&c.marks))
        .filter(|(_, m)| **m)
        .map(|(c, _)| c.bytes())
        .sum()
}

/// Fills each shard's digest from its bytes (`bytes[i]` holds shard `i`'s `len` bytes).
pub(crate) fn digest_shards(shards: &mut [ShardEntry], bytes: &[&[u8]]) {
    shards
        .par_iter_mut()
        .zip(bytes.par_iter())
        .for_each(|(s, b)| s.digest = Digest::of(b));
}

/// Digests every cut of `all` from the shard bytes, copying the marked ones contiguously into
/// `pack` (in order; `pack` must hold [`packed_bytes`]) whose first byte peers address as
/// `pack_addr`. Returns the pieces (in order of `all`, then cut order) and the seconds spent
/// copying (summed over threads).
pub(crate) fn cut_pieces(
    bytes: &[&[u8]],
    all: &[Cuts],
    pack: &mut [u8],
    pack_addr: u64,
) -> (Vec<DestPiece>, f64) {
    let mut jobs: Vec<(LayoutSpec, &Cut, Option<u64>)> = Vec::new();
    let mut cursor = 0u64;
    for c in all {
        for (cut, &mark) in c.cuts.iter().zip(&c.marks) {
            let at = mark.then(|| {
                let a = cursor;
                cursor += cut.bytes();
                a
            });
            jobs.push((c.layout, cut, at));
        }
    }
    // Disjoint slices of the pack area, one per packed cut, for parallel packing.
    let mut slots: Vec<Option<&mut [u8]>> = Vec::with_capacity(jobs.len());
    let mut rest: &mut [u8] = pack;
    for (_, c, at) in &jobs {
        if at.is_some() {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(c.bytes() as usize);
            slots.push(Some(a));
            rest = b;
        } else {
            slots.push(None);
        }
    }
    let nanos = AtomicU64::new(0);
    let digests: Vec<Digest> = jobs
        .par_iter()
        .zip(slots.into_par_iter())
        .map(|((_, c, _), slot)| {
            let src = bytes[c.shard];
            let rb = c.run_bytes as usize;
            match slot {
                Some(out) => {
                    let t = Instant::now();
                    for (i, &o) in c.run_offsets.iter().enumerate() {
                        let o = o as usize;
                        out[i * rb..(i + 1) * rb].copy_from_slice(&src[o..o + rb]);
                    }
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    nanos.fetch_add(ns, Ordering::Relaxed);
                    Digest::of(out)
                }
                None => mx_layout::digest_segments(c.run_offsets.iter().map(|&o| {
                    let o = o as usize;
                    &src[o..o + rb]
                })),
            }
        })
        .collect();
    let pieces = jobs
        .iter()
        .zip(digests)
        .map(|((layout, c, at), digest)| DestPiece {
            layout: *layout,
            dest_rank: c.dest_rank,
            tensor: c.tensor.clone(),
            region: c.region.clone(),
            digest,
            packed_addr: at.map(|a| pack_addr + a),
        })
        .collect();
    (pieces, nanos.load(Ordering::Relaxed) as f64 * 1e-9)
}
