//! Independent reference slicing for the demo's final check: the expected bytes of every
//! destination parameter, computed straight from the checkpoint file (plus the known training
//! update), with none of the planner's code.

use std::collections::{BTreeMap, HashMap};

use mx_checkpoint::Checkpoint;
use mx_layout::{Digest, RankLayout, TensorBox};

/// Appends `region` of a row-major tensor of `shape` (elements of `es` bytes) to `out`.
pub fn slice_into(full: &[u8], shape: &[u64], region: &TensorBox, es: usize, out: &mut Vec<u8>) {
    let nd = shape.len();
    if nd == 0 {
        out.extend_from_slice(&full[..es]);
        return;
    }
    let mut stride = vec![es; nd];
    for d in (0..nd - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1] as usize;
    }
    fn rec(d: usize, base: usize, full: &[u8], stride: &[usize], r: &TensorBox, out: &mut Vec<u8>) {
        let off = r.global_offset[d] as usize;
        let n = r.local_shape[d] as usize;
        if d + 1 == stride.len() {
            let s = base + off * stride[d];
            out.extend_from_slice(&full[s..s + n * stride[d]]);
        } else {
            for i in 0..n {
                rec(d + 1, base + (off + i) * stride[d], full, stride, r, out);
            }
        }
    }
    rec(0, 0, full, &stride, region, out);
}

/// Full tensors of a version: the checkpoint's bytes with training steps 2..=`step` applied in
/// order (version 1 is the checkpoint itself).
pub(crate) struct Reference<'a> {
    ckpt: &'a Checkpoint,
    step: u32,
    cache: HashMap<String, Vec<u8>>,
}

impl<'a> Reference<'a> {
    pub(crate) fn new(ckpt: &'a Checkpoint, step: u32) -> Self {
        Reference {
            ckpt,
            step,
            cache: HashMap::new(),
        }
    }

    fn full(&mut self, name: &str) -> anyhow::Result<(&[u8], Vec<u64>)> {
        let t = self.ckpt.tensor(name)?;
        let shape = t.shape.clone();
        if self.step <= 1 {
            return Ok((t.data, shape));
        }
        if !self.cache.contains_key(name) {
            let mut v = t.data.to_vec();
            for k in 2..=self.step {
                mx_layout::update::training_step(t.dtype, &mut v, k);
            }
            self.cache.insert(name.to_string(), v);
        }
        Ok((
            self.cache.get(name).map(Vec::as_slice).unwrap_or_default(),
            shape,
        ))
    }

    /// blake3 of every parameter of `rl`, built by slicing the reference tensors.
    pub(crate) fn rank_digests(
        &mut self,
        rl: &RankLayout,
    ) -> anyhow::Result<BTreeMap<String, Digest>> {
        let mut out = BTreeMap::new();
        for p in &rl.params {
            let mut bytes = Vec::with_capacity(p.len as usize);
            for piece in &p.pieces {
                let (full, shape) = self.full(&piece.tensor)?;
                slice_into(
                    full,
                    &shape,
                    &piece.region,
                    piece.dtype.size_bytes() as usize,
                    &mut bytes,
                );
            }
            if let Some((_, z)) = p.zero_fill {
                bytes.resize(bytes.len() + z as usize, 0);
            }
            anyhow::ensure!(
                bytes.len() as u64 == p.len,
                "reference size of {} is {} not {}",
                p.name,
                bytes.len(),
                p.len
            );
            out.insert(p.name.clone(), Digest::of(&bytes));
        }
        Ok(out)
    }
}
