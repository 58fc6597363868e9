//! The typed forms of what the control plane stores and answers: states, the stage command, the
//! staged report and status views. Proto messages are converted into and out of these in [`crate::convert`].

use std::collections::BTreeMap;
use std::fmt;

use mx_layout::{
    Digest, LayoutSpec, RankDigests, ResidentVersion, SourceManifest, TensorBox, TensorSpec,
    VersionId,
};
use serde::{Deserialize, Serialize};

/// Lifecycle of a policy version.
///
/// `Declared -> Publishing -> Ready -> Committing -> Committed`: COMMITTING while a refit to it
/// is open, COMMITTED once a refit to it committed. A refit that ends otherwise puts the version
/// back in the state it had before (see [`crate::refit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum VersionState {
    /// Declared by the orchestrator; no source published yet.
    Declared,
    /// Some sources published; not every slot, or a declared tensor is not covered.
    Publishing,
    /// Every slot published and every declared tensor covered; the version digest is fixed.
    Ready,
    /// A refit to it is open.
    Committing,
    /// A refit to it committed (every worker of that refit's set runs it).
    Committed,
}

impl VersionState {
    /// True when a wait for `wanted` is satisfied by `self` (states are ordered along the happy
    /// path).
    pub fn reaches(self, wanted: VersionState) -> bool {
        self >= wanted
    }
}

impl fmt::Display for VersionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VersionState::Declared => "DECLARED",
            VersionState::Publishing => "PUBLISHING",
            VersionState::Ready => "READY",
            VersionState::Committing => "COMMITTING",
            VersionState::Committed => "COMMITTED",
        })
    }
}

/// Lifecycle of a worker for the version it was last asked to stage. (Applies are not worker
/// states: a refit applies through the worker's engine routes and journals each call, see
/// [`crate::refit`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WorkerState {
    /// Registered, nothing asked.
    Idle,
    /// Asked to stage a version.
    Staging,
    /// Reported the version staged and verified.
    Staged,
    /// Reported a failure (see `last_error`).
    Failed,
}

impl fmt::Display for WorkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkerState::Idle => "IDLE",
            WorkerState::Staging => "STAGING",
            WorkerState::Staged => "STAGED",
            WorkerState::Failed => "FAILED",
        })
    }
}

/// A command the control plane sends to one worker over its `WatchCommands` stream. Staging is
/// the only one: installing a version is an engine call of a refit
/// (`update_weights_from_disk` with `mx://<digest>`), never a command.
///
/// Delivery is at least once: a worker that reconnects while a command is outstanding gets it
/// again (and stages and reports again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Pull and verify the version into staging; then `report_staged`.
    Stage {
        /// Version label.
        label: String,
        /// Version identity.
        version_digest: Digest,
    },
}

/// A worker's result for a Stage command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StagedReport {
    /// Reporting worker.
    pub worker_id: String,
    /// Version label it staged.
    pub label: String,
    /// True when pulled and verified.
    pub ok: bool,
    /// Failure description when `!ok` (empty otherwise).
    pub error: String,
    /// Digests of the staged bytes per rank.
    pub ranks: Vec<RankDigests>,
    /// Useful destination bytes pulled.
    pub bytes: u64,
    /// Read descriptors posted.
    pub descriptors: u64,
    /// Wall seconds of the stage.
    pub seconds: f64,
    /// Strategy name -> number of pieces pulled with it.
    pub strategies: BTreeMap<String, u64>,
    /// What served the bytes: `trainer`, `artifact_canonical`, `artifact_delta`, `peer`; empty
    /// when nothing was pulled.
    #[serde(default)]
    pub source: String,
    /// Bytes moved from the source (an artifact: bytes fetched from the object store).
    #[serde(default)]
    pub wire_bytes: u64,
}

/// Why a version's sources may stop serving it: their memory may be written again (a trainer
/// that updates in place takes its next optimizer step). Derived from journaled records, so a
/// restarted control plane answers the same; the first one reached sticks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Release {
    /// Every worker of the version's last stage reported it STAGED and verified: either a refit
    /// to it left its STAGE phase (`refit` set; its set may not need the sources any more),
    /// or every worker of a plain `Stage` reported STAGED (`refit` unset).
    Staged {
        /// The refit whose STAGE completed, if it was a refit.
        refit: Option<u64>,
        /// The workers that staged it (the stage's set), sorted.
        workers: Vec<String>,
    },
    /// A refit to it ended ABORTED, ROLLED_BACK or FENCED before any stage of it completed:
    /// nobody will pull it from this refit. (An orchestrator that refits it again after this
    /// must expect the sources to hold other bytes: publish a new version instead.)
    RefitEnded {
        /// The refit.
        refit: u64,
        /// How it ended.
        outcome: crate::refit::Outcome,
    },
    /// A version declared after it was committed: the fleet moved past it.
    Superseded {
        /// The committed version's label.
        by: String,
    },
    /// A source released it ([`crate::client::ControlClient::release_version`]): that slot's
    /// memory no longer holds it, so the version can no longer be pulled whole.
    Source {
        /// The slot that released it.
        slot: u32,
    },
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Release::Staged {
                refit: Some(id),
                workers,
            } => write!(f, "staged by refit {id} on {}", workers.join(",")),
            Release::Staged {
                refit: None,
                workers,
            } => write!(f, "staged on {}", workers.join(",")),
            Release::RefitEnded { refit, outcome } => {
                write!(f, "refit {refit} ended {outcome} before staging it")
            }
            Release::Superseded { by } => write!(f, "superseded: {by} was committed"),
            Release::Source { slot } => write!(f, "released by source slot {slot}"),
        }
    }
}

/// What an artifact holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// Whole tensors (Hugging Face safetensors files with an index).
    Canonical,
    /// An exact-base XOR delta.
    Delta,
}

/// A version written to object storage (`mx-artifact`), as the control plane records it: the
/// artifact's URL, the blake3 of its manifest object (readers check the manifest against it, so
/// what the bucket holds cannot pass for another version), and, for a delta, its base version
/// (the lineage: full, delta, delta, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArtifactRecord {
    /// `s3://bucket/prefix`.
    pub url: String,
    /// blake3 of `<url>/mx-artifact.json`.
    pub manifest_digest: Digest,
    /// Canonical or delta.
    pub kind: ArtifactKind,
    /// Delta only: the version it is against.
    pub base: Option<Digest>,
}

/// A worker serving a version it applied, from its own memory: a NIXL source like a trainer
/// rank. Its shards are regions whose digests the version's record holds for the worker's
/// layout (checked when it starts serving); its pieces for other layouts join the record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerSource {
    /// The serving worker.
    pub worker_id: String,
    /// What it serves, where (its NIXL agent and memory).
    pub manifest: SourceManifest,
}

/// A region of a declared tensor that no published shard covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoverageGap {
    /// The tensor.
    pub tensor: String,
    /// One uncovered box (global coordinates).
    pub region: TensorBox,
}

/// Everything known about one version, as `GetVersion` answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionInfo {
    /// Human label (e.g. trainer step); not the identity.
    pub label: String,
    /// Current state.
    pub state: VersionState,
    /// Layout of the sources (slots `0..world_size`).
    pub trainer_layout: LayoutSpec,
    /// Declared tensors.
    pub tensors: Vec<TensorSpec>,
    /// The identity, once READY (kept in every later state).
    pub version_digest: Option<Digest>,
    /// Slots that published, ascending.
    pub published_slots: Vec<u32>,
    /// Slots still expected, ascending.
    pub missing_slots: Vec<u32>,
    /// Declared tensors in no manifest (computed once every slot published).
    pub missing_tensors: Vec<String>,
    /// Declared tensors held only in part (computed once every slot published).
    pub coverage_gaps: Vec<CoverageGap>,
    /// The published manifests, by slot.
    pub manifests: Vec<SourceManifest>,
    /// The commit's worker set, sorted, once committing.
    pub commit_workers: Vec<String>,
    /// Whether (and why) its sources may stop serving it; see [`Release`].
    pub release: Option<Release>,
    /// Its artifacts in object storage, in registration order.
    pub artifacts: Vec<ArtifactRecord>,
    /// Workers serving it from their memory, by worker id.
    pub peers: Vec<PeerSource>,
    /// With a fanned-out answer ([`crate::client::ControlClient::get_version_for`]) of a READY
    /// (or later) version: the Merkle proof of `manifests`' shards against `version_digest`.
    /// `None` in a whole answer (check the root over every manifest instead).
    pub proof: Option<mx_layout::merkle::VersionProof>,
    /// The outputs its trainer published for the post-update check
    /// ([`crate::check`]), if any.
    pub expected_outputs: Option<crate::check::GenerationCheck>,
}

/// One line of the fleet status per version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionSummary {
    /// Label.
    pub label: String,
    /// State.
    pub state: VersionState,
    /// Identity, once READY.
    pub version_digest: Option<Digest>,
    /// Slots of its trainer layout (its world size).
    pub slots: u32,
    /// Its publishers, one per published slot, ascending slot.
    pub publishers: Vec<PublisherStatus>,
    /// Workers serving it from their memory as peers, by id.
    pub peers: Vec<String>,
    /// URIs of its artifacts in object storage, in registration order.
    pub artifacts: Vec<String>,
    /// Whether (and why) its sources may stop serving it; see [`Release`].
    pub release: Option<Release>,
}

/// How recently a source was heard from: a publisher's layout watcher calls `ListLayouts`
/// every [`PUBLISHER_PING_MS`] while it serves a version, naming its NIXL agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Liveness {
    /// Heard from within [`SILENT_AFTER_MS`].
    Live,
    /// Heard from before, not within [`SILENT_AFTER_MS`]: exited, hung or cut off.
    Silent,
    /// Not heard from since this control plane started (or an older publisher that does not
    /// name its agent).
    Unknown,
}

/// How often a serving publisher names itself to the control plane, in milliseconds (its layout
/// watcher's poll interval).
pub const PUBLISHER_PING_MS: u64 = 300;

/// A source not heard from for this long is [`Liveness::Silent`], in milliseconds (ten of its
/// pings).
pub const SILENT_AFTER_MS: u64 = 10 * PUBLISHER_PING_MS;

impl Liveness {
    /// The liveness of a source last heard from `ago_ms` milliseconds ago (`None`: never).
    pub fn of(ago_ms: Option<u64>) -> Liveness {
        match ago_ms {
            None => Liveness::Unknown,
            Some(ms) if ms <= SILENT_AFTER_MS => Liveness::Live,
            Some(_) => Liveness::Silent,
        }
    }

    /// `live`, `silent` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Liveness::Live => "live",
            Liveness::Silent => "silent",
            Liveness::Unknown => "unknown",
        }
    }

    /// Parses [`Liveness::as_str`]'s names.
    pub fn parse(s: &str) -> Option<Liveness> {
        [Liveness::Live, Liveness::Silent, Liveness::Unknown]
            .into_iter()
            .find(|l| l.as_str() == s)
    }
}

/// One published slot of a version: the NIXL agent that published it and whether it still
/// serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublisherStatus {
    /// Trainer slot (rank in the trainer layout).
    pub slot: u32,
    /// The publishing NIXL agent's name.
    pub agent_name: String,
    /// The label of a later version this agent published into the same memory: this slot no
    /// longer holds this version.
    pub retired_by: Option<String>,
    /// Milliseconds since the agent was last heard from (`None`: not since this control plane
    /// started).
    pub last_seen_ms: Option<u64>,
    /// [`Liveness::of`] `last_seen_ms`.
    pub liveness: Liveness,
}

/// Why a worker is not admitted to rollouts, by kind: the typed form of
/// [`WorkerStatus::admission`]'s sentence (the `mx_workers_gated{reason}` gauge counts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// An open refit holds it.
    InRefit,
    /// It left a refit before the refit could settle it (its engine may still be paused).
    Departed,
    /// A refit of another worker called an engine it shares an address with: its engine is
    /// read back before it is trusted.
    EngineUnread,
    /// A refit could not bring it back: what is resident is unknown.
    Fenced,
    /// No weights resident (or not known).
    NoWeights,
    /// Its resident version is not the fleet's.
    Stale,
    /// It has no command stream open to the control plane.
    Disconnected,
}

impl Gate {
    /// Every gate, in the order [`crate::state::State::admission`] tests them.
    pub const ALL: [Gate; 7] = [
        Gate::InRefit,
        Gate::Departed,
        Gate::EngineUnread,
        Gate::Fenced,
        Gate::NoWeights,
        Gate::Stale,
        Gate::Disconnected,
    ];

    /// The snake-case name (`in_refit`, `departed`, ...), as in JSON and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Gate::InRefit => "in_refit",
            Gate::Departed => "departed",
            Gate::EngineUnread => "engine_unread",
            Gate::Fenced => "fenced",
            Gate::NoWeights => "no_weights",
            Gate::Stale => "stale",
            Gate::Disconnected => "disconnected",
        }
    }

    /// Parses [`Gate::as_str`]'s names.
    pub fn parse(s: &str) -> Option<Gate> {
        Gate::ALL.into_iter().find(|g| g.as_str() == s)
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The version a fleet last committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetVersion {
    /// Its label.
    pub label: String,
    /// Its version id.
    pub version_id: VersionId,
}

/// One registered worker (an inference instance holding `ranks` of `layout`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerStatus {
    /// Worker id.
    pub worker_id: String,
    /// Instance name (one instance may hold several ranks).
    pub instance: String,
    /// Ranks of `layout` it holds.
    pub ranks: Vec<u32>,
    /// Its inference layout.
    pub layout: LayoutSpec,
    /// State for `label`.
    pub state: WorkerState,
    /// Label of the version being (or last) staged.
    pub label: Option<String>,
    /// Digest of that version.
    pub version_digest: Option<Digest>,
    /// The digest inside `resident_id` when that is an mx version (`mx:<hex>`).
    pub resident_version: Option<Digest>,
    /// Last failure it reported.
    pub last_error: Option<String>,
    /// Its last Stage result.
    pub last_staged: Option<StagedReport>,
    /// Its engine routes.
    pub engine: Option<crate::refit::EngineEndpoint>,
    /// Version id resident in its live weights, as last learned (`mx:<hex>` for mx versions).
    pub resident_id: Option<ResidentVersion>,
    /// Rollouts may be sent to it.
    pub admitted: bool,
    /// Why it is not admitted (empty when admitted).
    pub admission: String,
    /// It has a command stream open to this control plane now.
    pub connected: bool,
    /// Why it is not admitted, by kind (`None` when admitted).
    pub gate: Option<Gate>,
    /// The label of the declared version whose id `resident_version` is (`None` when no
    /// declared version has it).
    pub resident_label: Option<String>,
}

/// A worker's state in brief, as `WaitWorkers` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerBrief {
    /// Worker id.
    pub worker_id: String,
    /// Its state (FAILED when not registered).
    pub state: WorkerState,
    /// The version label it is on.
    pub label: Option<String>,
    /// Its last failure.
    pub error: Option<String>,
}

/// `GetStatus`: every version (in declaration order) and every worker (by id).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetStatus {
    /// Versions.
    pub versions: Vec<VersionSummary>,
    /// Workers.
    pub workers: Vec<WorkerStatus>,
    /// The version the fleet last committed.
    pub fleet_version: Option<FleetVersion>,
    /// The refit in progress.
    pub open_refit: Option<u64>,
    /// Set while the control plane does not act on its fleet: the fleet contradicted the
    /// journal (`crate::testimony`); what contradicts it and what to do.
    pub halted: Option<String>,
}
