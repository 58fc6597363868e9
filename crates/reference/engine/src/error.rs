//! The crate's error type.

use std::path::PathBuf;

use mx_layout::DType;

/// Everything that can go wrong in mx-engine. Every variant names the tensor, rank or field at
/// fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `config.json` lacks a field, has a wrong type or describes a model candle's llama cannot
    /// run.
    #[error("config.json field {field}: {reason}")]
    BadConfig {
        /// The field at fault (or `"config.json"` when the whole value is unreadable).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("tensor {tensor} is missing ({reason})")]
    MissingTensor {
        /// HF name of the missing tensor.
        tensor: String,
        /// Why it is needed.
        reason: String,
    },
    /// A tensor's shape disagrees with what the config implies (or with the model's tensor list).
    #[error("tensor {tensor} has shape {got:?}, expected {expected:?}")]
    BadShape {
        /// HF name of the tensor.
        tensor: String,
        /// Expected shape (elements).
        expected: Vec<u64>,
        /// Shape found.
        got: Vec<u64>,
    },
    /// A tensor's dtype is not one the engine loads (BF16, F16, F32), or disagrees with the
    /// model's tensor list.
    #[error("tensor {tensor} has dtype {dtype}: {reason}")]
    BadDType {
        /// HF name of the tensor.
        tensor: String,
        /// The dtype found.
        dtype: DType,
        /// What was expected.
        reason: String,
    },
    /// A tensor's byte length is not `product(shape) * dtype size`.
    #[error("tensor {tensor} holds {got} bytes, its shape and dtype need {expected}")]
    BadLength {
        /// HF name of the tensor.
        tensor: String,
        /// Bytes needed.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// Some elements of a tensor are in no piece of the given ranks.
    #[error("tensor {tensor} is not fully covered by the given ranks: {missing} of {total} elements missing")]
    NotCovered {
        /// HF name of the tensor.
        tensor: String,
        /// Elements not covered.
        missing: u64,
        /// Elements in the tensor.
        total: u64,
    },
    /// A rank's layout or live buffer is inconsistent: a piece outside its buffer or outside its
    /// tensor, a piece of an unknown tensor, or replicas of the same elements that disagree.
    #[error("rank {rank} (index {index}), tensor {tensor}: {reason}")]
    BadRank {
        /// Index of the rank in the `ranks` slice.
        index: usize,
        /// The rank number its layout states.
        rank: u32,
        /// The tensor whose piece is at fault.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// `ranks` and `live` have different lengths.
    #[error("{ranks} rank layouts but {buffers} live buffers")]
    RankCount {
        /// Number of rank layouts.
        ranks: usize,
        /// Number of live buffers.
        buffers: usize,
    },
    /// A size or offset overflowed (u64 or usize).
    #[error("size overflow computing {what} of tensor {tensor}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
        /// The tensor concerned.
        tensor: String,
    },
    /// A generation request the engine cannot serve.
    #[error("bad request, {field}: {reason}")]
    BadRequest {
        /// The field at fault (`prompt`, `prompt[i]`, `max_new`).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint in a model directory could not be opened (the golden path).
    #[error("reading the checkpoint in {dir}: {source}")]
    Checkpoint {
        /// The model directory.
        dir: PathBuf,
        /// mx-checkpoint's error (it names the file and tensor at fault).
        #[source]
        source: Box<mx_checkpoint::Error>,
    },
    /// A model directory has no `config.json` (the golden path needs it to build the model).
    #[error("model directory {dir} has no config.json")]
    NoConfig {
        /// The model directory.
        dir: PathBuf,
    },
    /// candle failed.
    #[error("candle failed while {during}: {source}")]
    Candle {
        /// What the engine was doing (names the tensor when loading one).
        during: String,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
}

/// Wraps a candle error with what was being done.
pub(crate) fn candle(during: impl Into<String>) -> impl FnOnce(candle_core::Error) -> Error {
    let during = during.into();
    move |source| Error::Candle { during, source }
}
