//! The caller's description of the shards it holds, and its validation against the model and
//! the registered memory.

use std::collections::BTreeMap;

use mx_layout::{DType, ModelInfo, TensorBox};

use crate::{Error, ShardProblem};

/// A region registered with [`crate::Publisher::register`] (its index, in registration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemoryId(pub(crate) usize);

impl MemoryId {
    /// The index (registration order, from 0).
    pub fn index(self) -> usize {
        self.0
    }
}

/// One shard a trainer rank holds: the box `shard` of global tensor `tensor`, stored row-major
/// (C order, densely) at `memory + offset .. + numel(shard) * dtype.size_bytes()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// Global (checkpoint) tensor name, as in the model.
    pub tensor: String,
    /// Element type; must be the model's.
    pub dtype: DType,
    /// Global shape in elements; must be the model's.
    pub global_shape: Vec<u64>,
    /// The box of the global tensor this shard holds (inside `global_shape`).
    pub shard: TensorBox,
    /// The registered region holding its bytes.
    pub memory: MemoryId,
    /// Byte offset of its first byte in that region.
    pub offset: u64,
}

impl ShardSpec {
    /// Bytes of the box, `None` when the size overflows u64.
    pub fn byte_len(&self) -> Option<u64> {
        self.shard
            .numel()
            .and_then(|n| n.checked_mul(self.dtype.size_bytes()))
    }
}

/// Checks every spec against the model (tensor, dtype, global shape, box inside the shape),
/// the registered region lengths `regions` (bytes inside, checked arithmetic) and each other
/// (no two boxes of one tensor overlap). The first problem is returned, naming the tensor.
pub(crate) fn validate(
    specs: &[ShardSpec],
    model: &ModelInfo,
    regions: &[u64],
) -> Result<(), Error> {
    let by_name: BTreeMap<&str, &mx_layout::TensorSpec> =
        model.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut seen: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, s) in specs.iter().enumerate() {
        let bad = |problem| Error::BadShard {
            index: i,
            tensor: s.tensor.clone(),
            problem,
        };
        let t = by_name
            .get(s.tensor.as_str())
            .ok_or_else(|| bad(ShardProblem::UnknownTensor))?;
        if s.dtype != t.dtype {
            return Err(bad(ShardProblem::DType {
                given: s.dtype,
                model: t.dtype,
            }));
        }
        if s.global_shape != t.shape {
            return Err(bad(ShardProblem::Shape {
                given: s.global_shape.clone(),
                model: t.shape.clone(),
            }));
        }
        if s.shard.global_offset.len() != s.shard.local_shape.len() || !s.shard.fits_in(&t.shape) {
            return Err(bad(ShardProblem::OutsideShape {
                shard: s.shard.clone(),
                shape: t.shape.clone(),
            }));
        }
        let region_len = *regions
            .get(s.memory.0)
            .ok_or_else(|| bad(ShardProblem::UnknownMemory { memory: s.memory.0 }))?;
        let len = s.byte_len();
        let inside = len
            .and_then(|l| s.offset.checked_add(l))
            .is_some_and(|end| end <= region_len);
        if !inside {
            return Err(bad(ShardProblem::OutsideMemory {
                memory: s.memory.0,
                offset: s.offset,
                len: len.unwrap_or(u64::MAX),
                region_len,
            }));
        }
        let others = seen.entry(s.tensor.as_str()).or_default();
        if let Some(&j) = others
            .iter()
            .find(|&&j| !s.shard.is_empty() && specs[j].shard.intersect(&s.shard).is_some())
        {
            return Err(bad(ShardProblem::Overlap {
                other: j,
                other_box: specs[j].shard.clone(),
            }));
        }
        others.push(i);
    }
    Ok(())
}
