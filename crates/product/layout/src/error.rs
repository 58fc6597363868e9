//! The layout crate's error type.

/// Errors from layout derivation and planning. Each names the tensor, rank or field at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dtype name that is not one of the supported element types.
    #[error("unknown dtype {name:?}")]
    UnknownDType {
        /// The name as given.
        name: String,
    },
    /// A digest string that is not 64 hex characters.
    #[error("bad digest {value:?}: expected 64 hex characters")]
    BadDigest {
        /// The value as given.
        value: String,
    },
    /// A version id that is not `mx:<64 hex>` (or a `model_path` that is not `mx://<64 hex>`).
    #[error(
        "bad version id {value:?}: expected mx:<64 hex digits> (model_path mx://<64 hex digits>)"
    )]
    BadVersionId {
        /// The value as given.
        value: String,
    },
    /// A layout spec that does not parse.
    #[error("bad layout spec {spec:?}: {reason}")]
    BadLayoutSpec {
        /// The spec as given.
        spec: String,
        /// Why it was refused.
        reason: String,
    },
    /// A rank outside the layout's world (`rank >= world_size`).
    #[error("rank {rank} is outside layout {layout} (its ranks are 0..{world_size})")]
    RankOutsideLayout {
        /// The rank asked for.
        rank: u32,
        /// The layout.
        layout: String,
        /// Its world size.
        world_size: u32,
    },
    /// A layout that cannot split a tensor, e.g. tp=2 over 9 attention heads.
    #[error("layout {layout} cannot place tensor {tensor}: {reason}")]
    ImpossibleLayout {
        /// The layout.
        layout: String,
        /// The tensor at fault.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// A model config that lacks a field or has an inconsistent value.
    #[error("model config: field {field}: {reason}")]
    BadConfig {
        /// The field at fault.
        field: String,
        /// Why.
        reason: String,
    },
    /// A tensor the layout needs is missing from the checkpoint or the manifests.
    #[error("tensor {tensor} is missing: {reason}")]
    MissingTensor {
        /// The tensor at fault.
        tensor: String,
        /// Where it was expected.
        reason: String,
    },
    /// Source and destination disagree on a tensor's dtype or global shape.
    #[error("tensor {tensor}: {what} mismatch: source has {source_value}, destination expects {dest_value}")]
    Mismatch {
        /// The tensor at fault.
        tensor: String,
        /// `dtype` or `shape`.
        what: &'static str,
        /// What the source published.
        source_value: String,
        /// What the destination needs.
        dest_value: String,
    },
    /// Some destination bytes would not be written by the plan.
    #[error("coverage gap in {param} (rank {rank}) at bytes {start}..{end}")]
    CoverageGap {
        /// Destination parameter.
        param: String,
        /// Destination rank.
        rank: u32,
        /// First byte not covered (offset within the rank's buffer).
        start: u64,
        /// End of the gap.
        end: u64,
    },
    /// Some destination bytes would be written twice by the plan.
    #[error("overlap in {param} (rank {rank}) at bytes {start}..{end}")]
    Overlap {
        /// Destination parameter.
        param: String,
        /// Destination rank.
        rank: u32,
        /// First byte written twice.
        start: u64,
        /// End of the overlap.
        end: u64,
    },
    /// A size or offset computation overflowed u64.
    #[error("arithmetic overflow computing {what} for {tensor}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
        /// The tensor at fault.
        tensor: String,
    },
    /// A manifest entry that is internally inconsistent (length vs box, box outside shape).
    #[error("manifest of source slot {slot}: tensor {tensor}: {reason}")]
    BadManifest {
        /// Source slot.
        slot: u32,
        /// The tensor at fault.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// A layout that needs the model's shape (heads, vocab: tensor parallelism) for a model
    /// known only by its tensors, from a checkpoint without `config.json`.
    #[error(
        "layout {layout} needs the model's shape from config.json, and the checkpoint has none \
         (only replicated and fsdp layouts work without it)"
    )]
    NoModelConfig {
        /// The layout.
        layout: String,
    },
    /// A tied-embedding model (`tie_word_embeddings: true`) whose checkpoint also holds an
    /// output projection that is not the embedding.
    #[error("config.json ties the word embeddings, but {lm_head} is not {embedding}: {reason}")]
    TiedEmbeddingMismatch {
        /// The embedding tensor (`model.embed_tokens.weight`).
        embedding: String,
        /// The output projection (`lm_head.weight`).
        lm_head: String,
        /// How they differ.
        reason: String,
    },
    /// A Merkle proof of a version's shards whose shape does not fit the tree it claims (too
    /// few or too many hashes, a position past the leaves or given twice).
    #[error("malformed Merkle proof: {reason}")]
    ProofMalformed {
        /// What does not fit.
        reason: String,
    },
    /// A Merkle proof whose hashes, with the shards sent, do not give the version id: a leaf or
    /// subtree hash in it is wrong (forged, or of another version).
    #[error(
        "the Merkle proof does not reach version {version}: its leaf and subtree hashes give \
         {found} (a hash in it is forged or of another version)"
    )]
    ProofRoot {
        /// The version asked for.
        version: String,
        /// The root the proof gives.
        found: String,
    },
    /// A shard sent as part of a version whose leaf (tensor, box, digest) is not the one the
    /// version holds at its position: it was tampered with, or belongs to another version.
    #[error(
        "shard {tensor} {region} of source slot {slot} is not leaf {position} of version \
         {version}: its tensor, box or digest differs from what the version holds"
    )]
    ShardNotInVersion {
        /// The version asked for.
        version: String,
        /// Source slot the shard was sent in.
        slot: u32,
        /// Its tensor.
        tensor: String,
        /// Its box.
        region: String,
        /// The leaf index the answer gave it.
        position: u64,
    },
}
