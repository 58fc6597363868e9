//! Loading rank buffers from a safetensors checkpoint on disk.

use std::path::Path;

use mx_checkpoint::Checkpoint;
use mx_layout::{ModelInfo, RankLayout, TensorBox};
use rayon::prelude::*;

use crate::Error;

/// Appends the row-major box `region` of a tensor of `shape` (elements of `es` bytes, bytes in
/// `full`) to `out`. The caller checked that `region` fits in `shape` and `full` holds the
/// whole tensor.
fn slice_box(full: &[u8], shape: &[u64], region: &TensorBox, es: usize, out: &mut [u8]) {
    let nd = shape.len();
    if nd == 0 {
        out[..es].copy_from_slice(&full[..es]);
        return;
    }
    // Row-major strides in bytes.
    let mut stride = vec![es; nd];
    for d in (0..nd - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1] as usize;
    }
    let run = region.local_shape[nd - 1] as usize * es;
    let rows: u64 = region.local_shape[..nd - 1].iter().product();
    let mut idx = vec![0u64; nd.saturating_sub(1)];
    for r in 0..rows as usize {
        let start: usize = (0..nd)
            .map(|d| {
                (region.global_offset[d] + idx.get(d).copied().unwrap_or(0)) as usize * stride[d]
            })
            .sum();
        out[r * run..(r + 1) * run].copy_from_slice(&full[start..start + run]);
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < region.local_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Fills new rank buffers for `dest` from the checkpoint in `dir`: every piece sliced from its
/// tensor, vocab padding zero.
///
/// # Errors
/// [`Error::Checkpoint`] when `dir` is not a readable safetensors checkpoint;
/// [`Error::DiskMismatch`] naming the tensor when the checkpoint lacks one of the model's
/// tensors or holds it with another dtype or shape.
pub(crate) fn load_disk(
    dir: &Path,
    model: &ModelInfo,
    dest: &[RankLayout],
) -> Result<Vec<Vec<u8>>, Error> {
    let ckpt = Checkpoint::open(dir)?;
    let mismatch = |tensor: &str, reason: String| Error::DiskMismatch {
        path: dir.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    };
    // Check every tensor the model needs before copying anything.
    for spec in &model.tensors {
        let t = ckpt
            .tensor(&spec.name)
            .map_err(|e| mismatch(&spec.name, e.to_string()))?;
        if t.dtype != spec.dtype || t.shape != spec.shape {
            return Err(mismatch(
                &spec.name,
                format!(
                    "checkpoint has {} {:?}, the model {} {:?}",
                    t.dtype, t.shape, spec.dtype, spec.shape
                ),
            ));
        }
    }
    dest.par_iter()
        .map(|rl| {
            let mut buf = vec![0u8; rl.total_bytes as usize];
            for p in &rl.params {
                for piece in &p.pieces {
                    let t = ckpt
                        .tensor(&piece.tensor)
                        .map_err(|e| mismatch(&piece.tensor, e.to_string()))?;
                    let es = piece.dtype.size_bytes() as usize;
                    let len = piece.region.numel().unwrap_or(0) as usize * es;
                    if !piece.region.fits_in(&t.shape) || t.dtype != piece.dtype {
                        return Err(mismatch(
                            &piece.tensor,
                            format!("rank {} piece {} does not fit it", rl.rank, piece.region),
                        ));
                    }
                    let o = piece.offset as usize;
                    slice_box(t.data, &t.shape, &piece.region, es, &mut buf[o..o + len]);
                }
                // Vocab padding rows stay zero (the buffer is new).
            }
            Ok(buf)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_a_3d_box() {
        // 2x3x4 u8 tensor 0..24; box offset (1,1,1) shape (1,2,2) -> [17,18,21,22].
        let full: Vec<u8> = (0..24).collect();
        let r = TensorBox {
            global_offset: vec![1, 1, 1],
            local_shape: vec![1, 2, 2],
        };
        let mut out = vec![0u8; 4];
        slice_box(&full, &[2, 3, 4], &r, 1, &mut out);
        assert_eq!(out, vec![17, 18, 21, 22]);
    }
}
