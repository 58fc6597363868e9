//! mx-follower: what makes an inference engine a worker of the fleet, apart from the engine.
//!
//! A [`Worker`] holds one or more ranks of an inference layout (one process holding its TP ranks,
//! like an engine's executor). It registers with the control plane (its layout, its engine
//! endpoint and its resident version), follows the commands on its stream, and serves the
//! engines' HTTP contracts. The same follower runs inside the reference worker (mx-worker, with
//! its candle engine), inside an engine's process through the bindings ([`embedded`]: Python's
//! `mx.Puller`, the C ABI's `mx_puller`, over the engine's own memory) and beside a vLLM that
//! serves the routes itself ([`Worker::attach`]).
//!
//! Map: [`worker`](Worker) (registration, the command stream, reconnects, peer offers) ·
//! [`Instance`] (the version store: live, pinned, staged; apply, pause gate, generation through
//! an [`Engine`]) · `gate` (pause modes) · `sources` (trainer, peer and artifact sources of a
//! stage) · `store` (a checkpoint directory sliced into ranks) · [`http`] (the engine routes) ·
//! [`embedded`] (the bindings' puller) · [`failpoints`] (fault injection, armed only by mx-lab).
//!
//! - **Stage** (gRPC command): fetch the version's manifests, measure the data plane's cost model
//!   once ([`mx_nixl::probe_costs`], plus the local per-segment cost), plan
//!   ([`mx_layout::plan::plan`]), pull with NIXL READs into staging (one registered huge-page
//!   arena per source, kept across versions), verify every pulled region against the digest its
//!   source published (no extra bytes on the wire) on a second thread while the next source is
//!   pulled, report STAGED with per-rank digests of what was verified. Live weights are not
//!   touched. A version that is already live or pinned is reported STAGED at once.
//! - **Apply** (`update_weights_from_disk` over HTTP with `model_path` `mx://<digest hex>`, the
//!   call a refit makes in its APPLY phase; there is no apply command): the version store
//!   ([`Instance`]) holds the *live* version, the *pinned* previous one and the *staged* one.
//!   Applying the staged version copies it out of staging into new live buffers (the old live
//!   becomes pinned); applying the pinned version swaps the two (a rollback, no copy); applying
//!   the live one is a no-op. A `model_path` that is a directory loads that safetensors
//!   checkpoint. After every apply the engine ([`Engine`]) is given the live weights and every
//!   cache tier is cleared ([`CACHE_TIERS`]; an instance that runs no engine caches nothing, so
//!   it reports every tier clear). On error nothing changes.
//! - **HTTP** ([`http::serve`]): Dynamo vLLM RL discovery and engine routes, SGLang's control
//!   routes, SGLang-native `/generate` (greedy, with the live weights), pause/resume with modes
//!   keep, wait and abort ([`PauseMode`]), `GET /mx/live_digests` (blake3 of every live
//!   parameter per rank, for orchestrators that check live bytes), and failpoints for fleet tests
//!   ([`failpoints`]).
//! - **Reconnect**: when the command stream ends because the control plane went away (or it
//!   was unreachable at start), the worker keeps serving its engine and its weights and
//!   reconnects with capped, jittered exponential backoff, by default forever: re-register with
//!   its current resident version, watch again. It stops only when another process holds its
//!   id ([`Error::Displaced`]: its engine is retired first) or after an explicit
//!   [`WorkerConfig::reconnect_timeout`].
//!
//! Versions: what is resident is a [`ResidentVersion`]: an mx policy version (`mx:<64 hex>`), or
//! weights loaded from disk, named by the request's `weight_version`, or `disk:<path>`.
//!
//! `/generate` decodes exactly `max_new_tokens` tokens unless one of the request's
//! `stop_token_ids` comes first: unlike SGLang the end-of-sequence token is not a default stop,
//! so a post-update generation compares token for token with golden tokens.
//!
//! Left out: batching (one sequence decodes at a time; concurrent requests queue for the
//! engine), sampling other than greedy, tokenization, fixed live addresses for an engine this
//! crate runs (a real engine's CUDA graphs need them; the bindings apply in place).
#![forbid(unsafe_code)]

pub mod embedded;
mod engine;
pub mod failpoints;
mod gate;
pub mod http;
mod instance;
mod sources;
mod store;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use engine::{Engine, EngineBuilder, EngineError, StagedHook};
pub use gate::{PauseMode, PauseOutcome};
pub use instance::{
    ApplyKind, ApplyOutcome, ApplySource, FinishReason, GenerateOutput, GenerateRequest, Instance,
    InstanceConfig, Versions, CACHE_TIERS,
};
pub use mx_layout::ResidentVersion;
pub use mx_puller::StageReport;
pub use worker::{Worker, WorkerConfig, MAX_BACKOFF};

/// Errors of the worker. Each names the version, field, tensor, rank or source at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading a checkpoint failed (the model's headers, or a disk apply's directory).
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] mx_checkpoint::Error),
    /// Layout or planning failed.
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// The data plane failed.
    #[error("nixl: {0}")]
    Nixl(#[from] mx_nixl::Error),
    /// Staging, applying or rolling back through the puller failed: no data plane, manifests
    /// of another version, an unreachable source, a failed READ or verification, an apply of a
    /// version that is neither staged, retained nor live.
    #[error(transparent)]
    Puller(#[from] mx_puller::Error),
    /// The control plane failed.
    #[error("control plane: {0}")]
    Control(#[from] mx_control::Error),
    /// No source of the version could serve it: every one tried failed.
    #[error("no source could stage {label}: {tried}")]
    NoSource {
        /// The version's label.
        label: String,
        /// Each source tried and its error.
        tried: String,
    },
    /// The engine refused the weights or the request.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// A disk checkpoint does not fit the model this worker serves.
    #[error("checkpoint {path}: tensor {tensor}: {reason}")]
    DiskMismatch {
        /// Checkpoint directory.
        path: PathBuf,
        /// The tensor at fault.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The model dir has no config.json.
    #[error("model dir {dir} has no config.json")]
    NoConfig {
        /// Directory.
        dir: PathBuf,
    },
    /// A request field is missing or malformed.
    #[error("bad request: {field}: {reason}")]
    BadRequest {
        /// The field at fault, e.g. `sampling_params.temperature`.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Generation is impossible on this worker (it does not hold every rank, or the model is
    /// not llama-family).
    #[error("generation unavailable: {reason}")]
    GenerationUnavailable {
        /// Why, naming the ranks held and the layout.
        reason: String,
    },
    /// No weights are live yet.
    #[error("no weights are live (apply a version or load a checkpoint first)")]
    NoWeights,
    /// Generation is paused with mode abort.
    #[error("generation paused")]
    Paused,
    /// The request was stopped between tokens by a pause with mode abort.
    #[error("aborted by pause_generation")]
    Aborted,
    /// The `generate.fail` failpoint is set.
    #[error("failpoint generate.fail is set")]
    FailpointGenerate,
    /// The HTTP listen address could not be bound.
    #[error("cannot serve HTTP on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Another live process holds this worker's id: the control plane refused its
    /// registration or command stream ([`mx_control::Error::is_worker_id_in_use`]). At start it
    /// means the id (or the engine URL) is taken; later, that a newer process took the id over
    /// while this one was away. Either way this process must stop serving: its engine is
    /// retired ([`Instance::retire`]) before this error is returned.
    #[error("worker {worker_id:?} was displaced: {reason}")]
    Displaced {
        /// This worker's id.
        worker_id: String,
        /// The control plane's refusal.
        reason: String,
    },
    /// A command stream came from a control-plane leader of a lower epoch than one already
    /// seen (on an engine call or a stream): a deposed leader. The worker reconnects to the
    /// replicas it was given instead.
    #[error("worker {worker_id:?}: the control plane's command stream is of leader epoch {epoch}, older than epoch {seen} already seen (a deposed leader)")]
    DeposedLeader {
        /// This worker's id.
        worker_id: String,
        /// The stream's epoch.
        epoch: u64,
        /// The highest epoch seen.
        seen: u64,
    },
    /// The control plane stayed unreachable for the whole reconnect timeout (only with an
    /// explicit [`WorkerConfig::reconnect_timeout`]; by default a worker retries forever).
    #[error("worker {worker_id:?} lost the control plane at {control} and could not reconnect within {seconds} s: {last_error}")]
    ReconnectTimeout {
        /// This worker's id.
        worker_id: String,
        /// Control plane address.
        control: String,
        /// The timeout, seconds.
        seconds: f64,
        /// The last connect/register/watch error.
        last_error: String,
    },
    /// A background task died.
    #[error("task failed: {0}")]
    Task(String),
    /// An embedded puller was asked for something that needs a control plane, and was made
    /// without one.
    #[error("this puller has no control plane (it was created without one)")]
    NoControlPlane,
    /// No READY version of the control plane has this id.
    #[error("no READY version of the control plane has id {id}")]
    UnknownVersionId {
        /// The id asked for.
        id: String,
    },
    /// The version is known but not READY (not every trainer slot published it yet).
    #[error("version {label:?} is {state} (not READY yet)")]
    VersionNotReady {
        /// The version's label.
        label: String,
        /// Its state.
        state: String,
    },
    /// Apply of "the staged version" with nothing staged.
    #[error("nothing is staged (stage a version first, or name the version to apply)")]
    NothingStaged,
    /// An embedded puller that is served was asked to stage, apply or roll back directly.
    #[error("this puller is served: the control plane drives its {what} (refit the worker to the version instead); done directly it would replace what the control plane staged or leave its record of this worker's resident version wrong")]
    ServedPuller {
        /// What was asked.
        what: &'static str,
    },
    /// An embedded puller is served already.
    #[error("this puller is served already")]
    AlreadyServed,
}
