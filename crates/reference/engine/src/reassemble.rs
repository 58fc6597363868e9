//! Rebuilding full checkpoint tensors from the live buffers of a layout's ranks.

use std::collections::BTreeMap;

use mx_layout::{ModelInfo, Piece, RankLayout, TensorSpec};

use crate::Error;

/// One tensor being rebuilt: its bytes and which elements have been written.
struct Target<'a> {
    spec: &'a TensorSpec,
    /// Element size in bytes.
    es: usize,
    /// Element count.
    numel: u64,
    bytes: Vec<u8>,
    /// One bit per element, set once written.
    written: Vec<u64>,
    /// Number of set bits in `written`.
    covered: u64,
}

/// Sets bits `[start, end)` of `bits`, returning how many were not set before.
/// `end` must be at most `bits.len() * 64`.
fn set_range(bits: &mut [u64], start: u64, end: u64) -> u64 {
    let mut newly = 0u64;
    let mut i = start;
    while i < end {
        let word = (i / 64) as usize;
        let lo = i % 64;
        let hi = (end - (i - lo)).min(64);
        let mask = if hi - lo == 64 {
            u64::MAX
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        if let Some(w) = bits.get_mut(word) {
            newly += u64::from((mask & !*w).count_ones());
            *w |= mask;
        }
        i = i - lo + hi;
    }
    newly
}

/// Rebuilds full HF-named tensors from the live buffers of TP ranks (or any layout), using each
/// piece's region: piece bytes at `piece.offset` of `live[i]` are the row-major box
/// `piece.region` of tensor `piece.tensor`. Vocab padding rows (a param's `zero_fill`) are
/// ignored. Where ranks hold the same elements (replicated norms, replicated kv heads), the copies
/// must agree byte for byte.
///
/// `ranks[i]` describes `live[i]`; any subset of ranks of any layouts may be given as long as
/// together they cover every tensor of `model.tensors`. Returns each tensor's row-major bytes in
/// its checkpoint dtype, keyed by HF name.
///
/// # Errors
/// - [`Error::RankCount`] when `ranks` and `live` differ in length;
/// - [`Error::BadRank`] naming the rank and tensor when a buffer is shorter than its layout, a
///   piece lies outside its buffer or its tensor, names a tensor `model` lacks, disagrees with the
///   model on dtype or global shape, or two replicas of the same elements differ;
/// - [`Error::NotCovered`] naming the first tensor (by name) some of whose elements no piece holds;
/// - [`Error::Overflow`] when a tensor's size does not fit in memory sizes.
pub fn reassemble(
    model: &ModelInfo,
    ranks: &[RankLayout],
    live: &[&[u8]],
) -> Result<BTreeMap<String, Vec<u8>>, Error> {
    if ranks.len() != live.len() {
        return Err(Error::RankCount {
            ranks: ranks.len(),
            buffers: live.len(),
        });
    }
    let mut targets: BTreeMap<&str, Target<'_>> = BTreeMap::new();
    for spec in &model.tensors {
        let overflow = |what| Error::Overflow {
            what,
            tensor: spec.name.clone(),
        };
        let numel = spec
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| overflow("element count"))?;
        let len = numel
            .checked_mul(spec.dtype.size_bytes())
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| overflow("byte length"))?;
        let words = usize::try_from(numel.div_ceil(64)).map_err(|_| overflow("coverage map"))?;
        targets.insert(
            spec.name.as_str(),
            Target {
                spec,
                // Element sizes are 1..=8 bytes.
                es: spec.dtype.size_bytes() as usize,
                numel,
                bytes: vec![0u8; len],
                written: vec![0u64; words],
                covered: 0,
            },
        );
    }
    for (index, (layout, buf)) in ranks.iter().zip(live).enumerate() {
        let bad = |tensor: &str, reason: String| Error::BadRank {
            index,
            rank: layout.rank,
            tensor: tensor.to_string(),
            reason,
        };
        if (buf.len() as u64) < layout.total_bytes {
            return Err(bad(
                "",
                format!(
                    "live buffer holds {} bytes, the layout needs {}",
                    buf.len(),
                    layout.total_bytes
                ),
            ));
        }
        for piece in layout.params.iter().flat_map(|p| &p.pieces) {
            let target = targets.get_mut(piece.tensor.as_str()).ok_or_else(|| {
                bad(
                    &piece.tensor,
                    "the piece names a tensor the model does not have".into(),
                )
            })?;
            copy_piece(piece, buf, target).map_err(|reason| bad(&piece.tensor, reason))?;
        }
    }
    let mut out = BTreeMap::new();
    for (name, t) in targets {
        if t.covered != t.numel {
            return Err(Error::NotCovered {
                tensor: name.to_string(),
                missing: t.numel - t.covered,
                total: t.numel,
            });
        }
        out.insert(name.to_string(), t.bytes);
    }
    Ok(out)
}

/// Copies one piece from a rank buffer into its tensor. Errors are reasons (the caller names the
/// rank and tensor).
fn copy_piece(piece: &Piece, buf: &[u8], t: &mut Target<'_>) -> Result<(), String> {
    let spec = t.spec;
    if piece.dtype != spec.dtype {
        return Err(format!(
            "piece dtype {} but the model's tensor is {}",
            piece.dtype, spec.dtype
        ));
    }
    if piece.global_shape != spec.shape {
        return Err(format!(
            "piece global shape {:?} but the model's tensor is {:?}",
            piece.global_shape, spec.shape
        ));
    }
    let region = &piece.region;
    if region.global_offset.len() != region.local_shape.len() || !region.fits_in(&spec.shape) {
        return Err(format!(
            "region (offset {:?}, shape {:?}) lies outside shape {:?}",
            region.global_offset, region.local_shape, spec.shape
        ));
    }
    // The region fits in the tensor, whose byte size fits in usize: these cannot overflow.
    let es = t.es as u64;
    let numel = region.local_shape.iter().product::<u64>();
    let piece_bytes = numel * es;
    let end = piece
        .offset
        .checked_add(piece_bytes)
        .filter(|&e| e <= buf.len() as u64)
        .ok_or_else(|| {
            format!(
                "piece bytes {}..+{piece_bytes} lie past the live buffer's {} bytes",
                piece.offset,
                buf.len()
            )
        })?;
    if numel == 0 {
        return Ok(());
    }
    let src = &buf[piece.offset as usize..end as usize];
    let ndim = spec.shape.len();
    if ndim == 0 {
        return write_run(t, src, 0, 1);
    }
    // Row-major strides of the global tensor, in elements.
    let mut strides = vec![1u64; ndim];
    for d in (0..ndim - 1).rev() {
        strides[d] = strides[d + 1] * spec.shape[d + 1];
    }
    let run = region.local_shape[ndim - 1];
    let run_bytes = (run * es) as usize;
    let mut idx = vec![0u64; ndim - 1];
    for chunk in src.chunks_exact(run_bytes) {
        let start: u64 = (0..ndim)
            .map(|d| (region.global_offset[d] + idx.get(d).copied().unwrap_or(0)) * strides[d])
            .sum();
        write_run(t, chunk, start, run)?;
        // Advance the odometer over the leading dims.
        for d in (0..ndim - 1).rev() {
            idx[d] += 1;
            if idx[d] < region.local_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(())
}

/// Writes `n` elements at element `start` of the target, checking agreement where already written.
fn write_run(t: &mut Target<'_>, src: &[u8], start: u64, n: u64) -> Result<(), String> {
    let lo = start as usize * t.es;
    let dst = &mut t.bytes[lo..lo + src.len()];
    let newly = set_range(&mut t.written, start, start + n);
    if newly == 0 && dst != src {
        return Err(format!(
            "elements {start}..{} were already written by another piece with different bytes",
            start + n
        ));
    }
    dst.copy_from_slice(src);
    t.covered += newly;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn set_range_counts_new_bits() {
        let mut bits = vec![0u64; 3];
        assert_eq!(set_range(&mut bits, 3, 130), 127);
        assert_eq!(set_range(&mut bits, 0, 192), 65);
        assert_eq!(set_range(&mut bits, 60, 70), 0);
        assert!(bits.iter().all(|&w| w == u64::MAX));
        let mut bits = vec![0u64; 1];
        assert_eq!(set_range(&mut bits, 0, 64), 64);
        assert_eq!(bits[0], u64::MAX);
    }
}
