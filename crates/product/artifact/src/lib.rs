//! mx-artifact: policy versions as artifacts in object storage, and verified ranged reads of them.
//!
//! A trainer exports a version ([`export_canonical`], [`export_delta`]) to an `s3://bucket/prefix`
//! ([`ArtifactUrl`]) through an S3 client configured from the standard AWS environment
//! ([`Store::from_env`], the `object_store` crate):
//! - **canonical**: Hugging Face safetensors files with `model.safetensors.index.json`, whole
//!   tensors (loadable by `transformers` / vLLM as a checkpoint);
//! - **delta**: an exact-base XOR delta: for each tensor, fixed ranges of its row-major bytes
//!   (4 MiB by default) hold `zstd(target ^ base)`, each fetchable on its own by (object, offset,
//!   length) and checked by its blake3; ranges where nothing changed store nothing.
//!
//! Beside either, `mx-artifact.json` ([`ArtifactManifest`]) names the version (the trainer
//! publication's Merkle root, proven over the bytes before anything is written: see
//! [`prove_version`]), the base of a delta, and the digests of the regions workers verify. The
//! manifest is written last; its blake3 is what the control plane records.
//!
//! A worker resolves the [`Chain`] from the version it holds to the target (a canonical artifact,
//! or deltas from its exact base, following `base_url`s up to a limit) and stages through an
//! [`ArtifactSource`]: the planner sees one whole-tensor shard per tensor at a virtual address,
//! and each read of a plan becomes ranged GETs of exactly those bytes (canonical) or of the
//! delta ranges covering them, XORed onto the base bytes the worker holds.
//!
//! Left out: deleting or garbage-collecting artifacts; server-side encryption settings (the
//! bucket's defaults apply).
//!
//! Map: `store` (`s3://` URLs and the S3 client) · `format` (`mx-artifact.json`) · `export`
//! (canonical files and XOR deltas) · `read` (the chain from the version held, ranged reads) ·
//! `error`.

mod error;
mod export;
mod format;
mod read;
mod store;

pub use error::Error;
pub use export::{
    export_canonical, export_delta, prove_version, DeltaBase, ExportOptions, ExportRequest,
    Exported, WholeTensor,
};
pub use format::{
    ArtifactKind, ArtifactManifest, Chunk, Location, ObjectEntry, TensorEntry, FORMAT, INDEX_NAME,
    MANIFEST_NAME, MAX_CHUNK_BYTES,
};
pub use read::{
    read_version, Artifact, ArtifactSource, ByteRead, Chain, DEFAULT_CHAIN_LIMIT, TENSOR_ADDR_BITS,
};
pub use store::{ArtifactUrl, Store, StoreOptions};
