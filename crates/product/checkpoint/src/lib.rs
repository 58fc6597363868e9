//! mx-checkpoint: reads Hugging Face safetensors checkpoints, zero-copy, over read-only memory maps.
//!
//! Job: open a checkpoint directory (`model.safetensors`, or `model.safetensors.index.json` plus
//! the shards its `weight_map` names), validate every header and tensor extent up front, and hand
//! out borrowed views of tensor bytes with their dtype and shape, plus the tensor list as
//! [`mx_layout::TensorSpec`]s and the directory's `config.json`. The publisher loads its shards
//! from these views; the orchestrator declares a version's tensor list from [`Checkpoint::specs`];
//! tests check pulled bytes against them.
//!
//! Main types: [`Checkpoint`] (an open directory), [`TensorView`] (one tensor's bytes),
//! [`Header`] (a checked safetensors header, parsed from bytes), [`parse_index`] and
//! [`parse_config`] (the index and `config.json` from their text),
//! [`write_safetensors`] (writes a file, for tests and tools) and [`Error`].
//!
//! Bad input is an [`Error`] naming the file and tensor, never a panic: a file shorter than the
//! length prefix, a header length past the end of the file or over 100 MB, a header that is not
//! UTF-8 JSON, a tensor entry without dtype/shape/offsets, a dtype mx does not support, offsets
//! past the end of the data, a byte length that disagrees with shape x dtype size, and an index
//! that names a missing file or a tensor its shard lacks (or a shard tensor the index omits), a
//! key repeated in any JSON object (also after unescaping; [`Error::DuplicateKey`]), a
//! `__metadata__` value that is not a string ([`Error::BadMetadata`] naming its key), and a
//! tied-embedding `lm_head.weight` that differs from the embedding. The
//! safetensors crate then validates each file again (gaps, overlaps, trailing bytes).
//!
//! Left out: converting dtypes, slicing tensors into layout boxes (mx-layout plans, callers copy),
//! writing sharded checkpoints, and non-safetensors formats (GGUF is converted beforehand by
//! `scripts/gguf_to_hf.py`). Files are mapped, not copied: a checkpoint file truncated by another
//! process while open faults on access, so checkpoints are treated as immutable while open. This
//! is the crate's only `unsafe` (the `mmap` call).

mod checkpoint;
mod error;
mod file;
mod write;

pub use checkpoint::{
    parse_config, parse_index, Checkpoint, TensorView, CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
};
pub use error::Error;
pub use file::{Header, HeaderTensor};
pub use write::{write_safetensors, write_safetensors_with_sync};
