//! The checkpoint crate's error type.

use std::path::PathBuf;

use mx_layout::DType;

/// Errors from opening, reading and writing checkpoints. Each names the file, and where one is at
/// fault the tensor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system error on a file or directory.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done: "opening", "mapping", "reading", "writing", ...
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("no checkpoint in {dir}: expected model.safetensors or model.safetensors.index.json")]
    NoCheckpoint {
        /// The directory given.
        dir: PathBuf,
    },
    /// The file is shorter than the 8-byte header length prefix.
    #[error("{file}: truncated header: file is {file_len} bytes, the length prefix alone needs 8")]
    HeaderTruncated {
        /// The safetensors file.
        file: PathBuf,
        /// Its length in bytes.
        file_len: u64,
    },
    /// The header length prefix is larger than the safetensors limit (100 MB).
    #[error("{file}: header length {header_len} exceeds the limit of {limit} bytes")]
    HeaderTooLarge {
        /// The safetensors file.
        file: PathBuf,
        /// The header length the prefix declares, in bytes.
        header_len: u64,
        /// The largest header accepted, in bytes.
        limit: u64,
    },
    /// The header length prefix points past the end of the file.
    #[error("{file}: header length {header_len} runs past the end of the {file_len}-byte file")]
    HeaderPastEof {
        /// The safetensors file.
        file: PathBuf,
        /// The header length the prefix declares, in bytes.
        header_len: u64,
        /// The file's length in bytes.
        file_len: u64,
    },
    /// The header is not UTF-8 JSON, or not a JSON object.
    #[error("{file}: bad header: {reason}")]
    BadHeader {
        /// The safetensors file.
        file: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor's header entry lacks or garbles `dtype`, `shape` or `data_offsets`.
    #[error("{file}: tensor {tensor}: bad header entry: {reason}")]
    BadTensorEntry {
        /// The safetensors file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with the entry.
        reason: String,
    },
    /// A dtype name that mx does not support (see [`mx_layout::DType`]).
    #[error("{file}: tensor {tensor}: unsupported dtype {dtype:?}")]
    UnknownDType {
        /// The safetensors file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype as written in the header.
        dtype: String,
    },
    /// A tensor's `data_offsets` run past the end of the file's data section.
    #[error(
        "{file}: tensor {tensor}: data_offsets [{begin}, {end}) run past the end of the \
         {data_len}-byte data section"
    )]
    OffsetsPastEnd {
        /// The safetensors file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Start offset in the data section, bytes.
        begin: u64,
        /// End offset (exclusive) in the data section, bytes.
        end: u64,
        /// Length of the file's data section (after the header), bytes.
        data_len: u64,
    },
    /// A tensor's byte length does not equal its element count times its dtype's size.
    #[error(
        "{file}: tensor {tensor}: {actual} bytes of data, but {dtype} {shape:?} needs {expected}"
    )]
    LengthMismatch {
        /// The safetensors file (or the file being written).
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The tensor's dtype.
        dtype: DType,
        /// The tensor's shape.
        shape: Vec<u64>,
        /// Bytes the dtype and shape need.
        expected: u64,
        /// Bytes present (`end - begin`, or the buffer's length when writing).
        actual: u64,
    },
    /// The safetensors crate refused the file for a reason the checks above do not name (for
    /// example tensors that overlap, leave gaps, or bytes after the last tensor).
    #[error("{file}: rejected by the safetensors reader: {source}")]
    Safetensors {
        /// The safetensors file.
        file: PathBuf,
        /// The safetensors crate's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// `model.safetensors.index.json` does not parse or lacks a usable `weight_map`.
    #[error("{index}: bad index: {reason}")]
    BadIndex {
        /// The index file.
        index: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The index maps a tensor to a file that does not exist.
    #[error("{index}: tensor {tensor} is mapped to {file}, which does not exist")]
    IndexFileMissing {
        /// The index file.
        index: PathBuf,
        /// The first tensor mapped to the missing file.
        tensor: String,
        /// The missing file.
        file: PathBuf,
    },
    /// The index maps a tensor to a file that does not hold it.
    #[error("{index}: tensor {tensor} is mapped to {file}, which does not hold it")]
    IndexTensorMissing {
        /// The index file.
        index: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shard file named by the index.
        file: PathBuf,
    },
    /// A shard holds a tensor that the index does not map to it.
    #[error("{index}: {file} holds tensor {tensor}, which the weight_map does not map to it")]
    UnlistedTensor {
        /// The index file.
        index: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shard file holding it.
        file: PathBuf,
    },
    /// The same tensor name appears twice (in the tensors given to write).
    #[error("{file}: tensor {tensor} appears more than once")]
    DuplicateTensor {
        /// The file being written.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// `config.json` is present but is not valid JSON.
    #[error("{file}: bad config: {reason}")]
    BadConfig {
        /// The config file.
        file: PathBuf,
        /// The JSON parser's message.
        reason: String,
    },
    /// A tensor name that the checkpoint does not hold.
    #[error("checkpoint {dir} has no tensor {name}")]
    MissingTensor {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The name asked for.
        name: String,
    },
    /// A JSON object (in a header, the index or `config.json`) holds a key twice, also when
    /// the two spellings differ only by escaping.
    #[error("{file}: duplicate key {key:?} in the JSON object at {path}")]
    DuplicateKey {
        /// The file.
        file: PathBuf,
        /// The repeated key, unescaped.
        key: String,
        /// Where the object is (`$` is the top level, then `.key` and `[index]` steps).
        path: String,
    },
    /// A header's `__metadata__` is not an object of strings.
    #[error("{file}: __metadata__ key {key:?}: {reason}")]
    BadMetadata {
        /// The safetensors file.
        file: PathBuf,
        /// The metadata key at fault (empty when `__metadata__` itself is not an object).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// `config.json` ties the word embeddings (`tie_word_embeddings: true`), and the checkpoint
    /// holds an output projection that differs from the embedding.
    #[error("{dir}: config.json ties the word embeddings, but {lm_head} differs from {embedding}: {reason}")]
    TiedEmbeddingMismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The embedding tensor (`model.embed_tokens.weight`).
        embedding: String,
        /// The output projection (`lm_head.weight`).
        lm_head: String,
        /// How they differ.
        reason: String,
    },
    /// A layout that needs the model's shape (tensor parallelism), for a checkpoint without
    /// `config.json`.
    #[error("{file} is missing: layout {layout} needs the model's shape from it (replicated and fsdp layouts do not)")]
    NoConfig {
        /// The missing `config.json`.
        file: PathBuf,
        /// The layout that needs it.
        layout: String,
    },
    /// `config.json` and the tensors do not describe a model mx can lay out.
    #[error("{dir}: {source}")]
    Model {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The layout crate's error.
        #[source]
        source: mx_layout::Error,
    },
}
