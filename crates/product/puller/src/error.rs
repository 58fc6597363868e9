//! The puller's one error type.

/// Errors of the puller. Each names the version, rank, parameter, tensor or source at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Layout or planning failed (e.g. the sources do not cover a parameter).
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// The data plane failed outside a pull (creating a lane agent, registering staging).
    #[error("nixl: {0}")]
    Nixl(#[from] mx_nixl::Error),
    /// Staging needs a NIXL agent and this puller has none.
    #[error("this puller has no NIXL agent: it cannot stage")]
    NoDataPlane,
    /// A source's NIXL metadata could not be loaded: the publisher behind it is gone or
    /// unreachable.
    #[error("source slot {slot} (agent {agent}) is unreachable: loading its NIXL metadata failed: {source}")]
    SourceUnreachable {
        /// Source slot.
        slot: u32,
        /// Its NIXL agent.
        agent: String,
        /// The data-plane error.
        source: mx_nixl::Error,
    },
    /// A NIXL READ from one source failed.
    #[error("pull from source slot {slot} (agent {agent}) failed: {source}")]
    Pull {
        /// Source slot.
        slot: u32,
        /// Its NIXL agent.
        agent: String,
        /// The data-plane error.
        source: mx_nixl::Error,
    },
    /// Reading an object-storage source (an artifact) failed: a missing or corrupt object, a
    /// store that does not answer, a delta against another base.
    #[error("reading artifact {url} failed: {source}")]
    ObjectRead {
        /// The artifact's URL.
        url: String,
        /// What failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Resolving or opening an artifact failed (its manifest missing, corrupt or not the one
    /// recorded, a chain that does not lead from the version held, the store misconfigured).
    #[error(transparent)]
    Artifact(#[from] mx_artifact::Error),
    /// A delta applies only to its exact base, and the version resident is another.
    #[error("the delta {url} gives {version} from base {base}, but this worker holds {held}")]
    WrongBase {
        /// The delta artifact.
        url: String,
        /// The version it gives.
        version: String,
        /// Its base.
        base: String,
        /// What is resident (`nothing` when nothing is).
        held: String,
    },
    /// An in-process source (tests, benchmarks) has no bytes at a read's range.
    #[error("source slot {slot} has no bytes at {addr:#x}+{len}")]
    SourceRange {
        /// Source slot.
        slot: u32,
        /// Start address of the read.
        addr: u64,
        /// Bytes.
        len: u64,
    },
    /// A pulled region did not match its source's digest.
    #[error("verification failed: tensor {tensor} region {region} for rank {rank} from source slot {slot}")]
    Verify {
        /// Tensor.
        tensor: String,
        /// Region.
        region: String,
        /// Destination rank.
        rank: u32,
        /// Source slot.
        slot: u32,
    },
    /// The manifests staged from are not the version asked for: their shards' Merkle root
    /// differs from the version id.
    #[error("manifests are of version {found}, not {wanted}")]
    WrongManifests {
        /// The version asked for.
        wanted: String,
        /// The version the manifests' shards make.
        found: String,
    },
    /// The manifests a control plane sent for a version (only those a worker's plan reads) are
    /// not proven to be the version's: a shard's tensor, box or digest is not the version's
    /// (named), or the proof's hashes do not reach the version id.
    #[error("the control plane's answer for version {version} is refused: {source}")]
    Unproven {
        /// The version asked for.
        version: String,
        /// What the proof check found ([`mx_layout::Error::ShardNotInVersion`],
        /// [`mx_layout::Error::ProofRoot`], [`mx_layout::Error::ProofMalformed`]).
        source: Box<mx_layout::Error>,
    },
    /// The manifests a control plane sent for a version (only those a worker's plan reads)
    /// leave bytes of a held rank uncovered: a shard the rank needs was left out.
    #[error("the control plane's answer for version {version} leaves out a shard this worker needs: {source}")]
    Incomplete {
        /// The version asked for.
        version: String,
        /// What the planner found uncovered ([`mx_layout::Error::CoverageGap`] naming the
        /// parameter, rank and bytes, or [`mx_layout::Error::MissingTensor`] naming the tensor).
        source: Box<mx_layout::Error>,
    },
    /// A destination parameter registered with another dtype, shape or length than the layout
    /// gives it, or twice, or one the rank does not hold.
    #[error("rank {rank} parameter {param}: {reason}")]
    BadDestination {
        /// The rank.
        rank: u32,
        /// The parameter (the engine's name, e.g. `model.layers.0.self_attn.qkv_proj.weight`).
        param: String,
        /// What is wrong.
        reason: String,
    },
    /// Registered memory is no longer where it was registered (the engine freed, moved or
    /// resized the tensor behind it): nothing was read or written.
    #[error("rank {rank} parameter {param}: its memory changed since it was registered: {reason}")]
    DestinationChanged {
        /// The rank.
        rank: u32,
        /// The parameter.
        param: String,
        /// What changed.
        reason: String,
    },
    /// The ranks a puller was made for are empty or repeat one.
    #[error("ranks {ranks:?}: {reason}")]
    BadRanks {
        /// The ranks as given.
        ranks: Vec<u32>,
        /// What is wrong.
        reason: String,
    },
    /// A rank this puller does not hold.
    #[error("rank {rank} is not one of this puller's ranks {held:?}")]
    UnknownRank {
        /// The rank asked for.
        rank: u32,
        /// The ranks held.
        held: Vec<u32>,
    },
    /// An operation needs every parameter of every rank registered.
    #[error("rank {rank} parameter {param} has no destination memory registered")]
    Unregistered {
        /// The rank.
        rank: u32,
        /// The first parameter without memory.
        param: String,
    },
    /// Destination memory refused a read or write (e.g. a device copy failed).
    #[error("rank {rank} destination memory at {offset}+{len}: {reason}")]
    Memory {
        /// The rank.
        rank: u32,
        /// Offset in the rank's layout.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The memory's own error.
        reason: String,
    },
    /// Apply named a version that is neither staged, retained nor resident.
    #[error("cannot apply {version}: it is not staged (staged: {staged}), not retained (retained: {retained}) and not resident (resident: {resident})")]
    UnknownVersion {
        /// The version asked for.
        version: String,
        /// What is staged.
        staged: String,
        /// What is retained.
        retained: String,
        /// What is resident.
        resident: String,
    },
    /// Rollback without a retained copy of the previous version.
    #[error("cannot roll back: {reason}")]
    NoRollback {
        /// Why (retention off, or nothing applied yet).
        reason: String,
    },
    /// A thread of the executor died.
    #[error("internal: {0}")]
    Task(String),
}

impl Error {
    /// The error's kind as a short stable name (`source_unreachable`, `verify`, ...), for metric
    /// labels and logs: one name per variant, never data from the error.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Layout(_) => "layout",
            Error::Nixl(_) => "nixl",
            Error::NoDataPlane => "no_data_plane",
            Error::SourceUnreachable { .. } => "source_unreachable",
            Error::Pull { .. } => "pull",
            Error::ObjectRead { .. } => "object_read",
            Error::Artifact(_) => "artifact",
            Error::WrongBase { .. } => "wrong_base",
            Error::SourceRange { .. } => "source_range",
            Error::Verify { .. } => "verify",
            Error::WrongManifests { .. } => "wrong_manifests",
            Error::Unproven { .. } => "unproven",
            Error::Incomplete { .. } => "incomplete",
            Error::BadDestination { .. } => "bad_destination",
            Error::DestinationChanged { .. } => "destination_changed",
            Error::BadRanks { .. } => "bad_ranks",
            Error::UnknownRank { .. } => "unknown_rank",
            Error::Unregistered { .. } => "unregistered",
            Error::Memory { .. } => "memory",
            Error::UnknownVersion { .. } => "unknown_version",
            Error::NoRollback { .. } => "no_rollback",
            Error::Task(_) => "task",
        }
    }
}
