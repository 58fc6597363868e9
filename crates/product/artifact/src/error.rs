//! Errors of mx-artifact: each names the artifact URL, tensor, object or version at fault.

use mx_layout::{Digest, VersionId};

/// What went wrong writing or reading an artifact.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL is not `s3://bucket[/prefix]`.
    #[error("bad artifact URL {url:?}: {reason}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The object store refused or failed a request (after its retries and timeouts).
    #[error("object store, {url}: {op}: {source}")]
    Store {
        /// The artifact or object URL.
        url: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An object of the artifact is missing.
    #[error("{url} is missing from the object store ({what})")]
    Missing {
        /// The object URL.
        url: String,
        /// What it holds.
        what: String,
    },
    /// The manifest is not the one the control plane recorded for this artifact.
    #[error("artifact manifest {url}: blake3 {found}, but {expected} was recorded for it")]
    ManifestDigest {
        /// The manifest URL.
        url: String,
        /// The recorded digest.
        expected: Digest,
        /// The digest of the bytes read.
        found: Digest,
    },
    /// The manifest does not parse or does not hold together.
    #[error("artifact manifest {url}: {reason}")]
    BadManifest {
        /// The manifest URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A delta chunk's bytes are not what the manifest says (corrupt, truncated, replaced).
    #[error(
        "delta {url}: tensor {tensor} chunk {chunk} (object {object} bytes {at}+{len}): {reason}"
    )]
    BadChunk {
        /// The artifact URL.
        url: String,
        /// The tensor.
        tensor: String,
        /// The chunk's index in the tensor.
        chunk: usize,
        /// The object holding it.
        object: String,
        /// Offset in the object.
        at: u64,
        /// Compressed length.
        len: u64,
        /// What is wrong (digest mismatch, decompression error, wrong length).
        reason: String,
    },
    /// A delta cannot be applied to the version held: it is against another base.
    #[error(
        "delta {url} gives {version} from base {base}, but the version held is {held} \
         (a delta applies only to its exact base)"
    )]
    WrongBase {
        /// The delta artifact.
        url: String,
        /// The version it produces.
        version: VersionId,
        /// Its base.
        base: VersionId,
        /// What the reader holds (an mx id, `disk:...`, or `nothing`).
        held: String,
    },
    /// The chain of deltas from the version held to the target is longer than allowed.
    #[error("resolving {url}: more than {limit} deltas between {held} and {target}")]
    ChainTooLong {
        /// The target artifact.
        url: String,
        /// The limit.
        limit: usize,
        /// What the reader holds.
        held: String,
        /// The target version.
        target: VersionId,
    },
    /// The bytes given to an export are not the version they are said to be, or do not fit
    /// together.
    #[error("export of {version}: tensor {tensor}: {reason}")]
    NotTheVersion {
        /// The version being exported.
        version: String,
        /// The tensor at fault.
        tensor: String,
        /// What differs.
        reason: String,
    },
    /// A read asks for bytes outside the artifact.
    #[error(
        "artifact {url}: read of {len} bytes at virtual address {addr:#x} is outside every tensor"
    )]
    OutOfRange {
        /// The artifact URL.
        url: String,
        /// The virtual address.
        addr: u64,
        /// Bytes asked.
        len: u64,
    },
    /// Layout or planning errors.
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// Local I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
