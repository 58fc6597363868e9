//! The fleet refit lifecycle, as data: what a refit asks for, its phases, the calls made to each
//! worker's engine and their results, and how it ended.
//!
//! One refit moves a target worker set to one policy version:
//!
//! ```text
//! STAGE -> PREPARE -> APPLY -> VERIFY -> RESUME -> CHECK -> COMMIT      (outcome COMMITTED)
//!   |         |          |        |         |        |
//!   +---------+----------+--------+---------+--------+--> ABORT         (nobody applied: V-1)
//!                        +--------+---------+--------+--> ROLLBACK      (applied ones back to V-1)
//! ```
//!
//! The first APPLY call journaled is the point of no return: before it any failure aborts
//! (paused engines are resumed, the staged version is left unused); after it any failure rolls
//! every worker of the set back to the version it had when the refit began (each worker keeps it
//! pinned). Rollouts are gated from BEGIN until END: a worker is admitted again only when its
//! resident version is the one the fleet settled on.
//!
//! Every step is journaled by the control plane before it acts ([`crate::state::Record`]'s
//! `Refit*` and `Worker*` records), and every worker call's intent ([`WorkerCall`]) comes before
//! its result ([`CallResult`]), so a restarted control plane knows exactly which calls may have
//! happened and asks the workers instead of guessing.

use std::collections::BTreeMap;
use std::fmt;

use mx_layout::{Digest, LayoutSpec, ResidentVersion, VersionId};
use serde::{Deserialize, Serialize};

/// Which engine contract the control plane speaks to a worker (DESIGN.md "Engine contracts");
/// defined beside the clients that speak them.
pub use mx_adapters::EngineApi;

/// Where a Dynamo worker generates (its frontend, pinned to the worker); defined beside the
/// client that calls it.
pub use mx_adapters::dynamo::Frontend as EngineFrontend;

/// Where a worker's engine routes live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineEndpoint {
    /// The contract to speak.
    pub api: EngineApi,
    /// Base URL of the worker's system server, e.g. `http://127.0.0.1:8081`.
    pub system_url: String,
    /// The engine holds weights but runs no model the control plane can generate with (e.g.
    /// an engine embedding mx-puller with only its parameter memory): refits record its
    /// post-update generation as skipped instead of calling it.
    #[serde(default)]
    pub no_model: bool,
    /// Where the engine generates when not at `system_url` (a Dynamo worker: the frontend's
    /// `/v1/completions`, pinned to the worker); `None`: at `system_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<EngineFrontend>,
}

/// What a worker says about itself when it (re-)registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Worker id, unique in the fleet.
    pub worker_id: String,
    /// Inference instance name.
    pub instance: String,
    /// Ranks of `layout` it holds.
    pub ranks: Vec<u32>,
    /// Its inference layout.
    pub layout: LayoutSpec,
    /// Its engine routes; `None` for a worker that only stages (it cannot be refitted).
    pub engine: Option<EngineEndpoint>,
    /// The version id resident in its live weights (an mx version, or another label: [`ResidentVersion`]), `None` when it has none.
    pub resident_version: Option<ResidentVersion>,
    /// What generation requests its engine accepts, when known: a refit's post-update check is
    /// validated against them before anything pauses.
    #[serde(default)]
    pub model_limits: Option<ModelLimits>,
    /// What its engine has seen of refits and leaders ([`crate::testimony`]).
    #[serde(default)]
    pub seen: Seen,
}

/// What a worker's engine has seen of the control plane: the highest refit id that called it
/// and the highest leader epoch (0: none, or an engine that cannot tell). A registration
/// carries it so that the fleet can contradict a damaged journal ([`crate::testimony`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    /// Highest refit id ([`mx_adapters::REFIT_HEADER`]).
    pub refit: u64,
    /// Highest leader epoch ([`mx_adapters::EPOCH_HEADER`]).
    pub epoch: u64,
}

/// The limits of a worker's model on generation requests (HF `config.json`: `vocab_size`,
/// `max_position_embeddings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLimits {
    /// Token ids must be below this.
    pub vocab_size: u64,
    /// Prompt tokens plus new tokens must not exceed this.
    pub max_positions: u64,
}

impl ModelLimits {
    /// Checks a post-update generation against these limits.
    ///
    /// # Errors
    /// `(field, reason)`: `check.probes[p].prompt_tokens[i]` for the first token id outside the vocabulary,
    /// `check.max_new_tokens` when prompt plus new tokens exceed the positions.
    pub fn check(&self, c: &GenerationCheck) -> Result<(), (String, String)> {
        for (p, probe) in c.probes.iter().enumerate() {
            if let Some((i, t)) = probe
                .prompt_tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| u64::from(t) >= self.vocab_size)
            {
                return Err((
                    format!("check.probes[{p}].prompt_tokens[{i}]"),
                    format!(
                        "token id {t} is outside the vocabulary of {}",
                        self.vocab_size
                    ),
                ));
            }
            let need =
                (probe.prompt_tokens.len() as u64).saturating_add(u64::from(c.max_new_tokens));
            if need > self.max_positions {
                return Err((
                    "check.max_new_tokens".to_string(),
                    format!(
                        "{} prompt tokens of probe {p} + {} new exceed max_position_embeddings {}",
                        probe.prompt_tokens.len(),
                        c.max_new_tokens,
                        self.max_positions
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The `model_path` that asks an mx worker to apply a staged (or pinned) version: `mx://<hex>`.
pub fn model_path(d: &Digest) -> String {
    VersionId(*d).model_path()
}

pub use mx_adapters::PauseMode;

pub use crate::check::{GenerationCheck, Probe};

/// What the orchestrator asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefitSpec {
    /// Version label (must be READY or already committed once).
    pub label: String,
    /// Target worker set.
    pub worker_ids: Vec<String>,
    /// How in-flight requests are handled at PREPARE.
    pub pause_mode: PauseMode,
    /// Proceed without workers that are not connected (else a missing worker aborts the refit).
    pub allow_partial: bool,
    /// The post-update generation (`crate::check`). `None`: the expected outputs published with
    /// the version, if any, unless `no_check`.
    pub check: Option<GenerationCheck>,
    /// No post-update generation, even when the version has published expected outputs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_check: bool,
    /// The trainer's step, for the journal (0 = unknown).
    pub framework_step: u64,
    /// Deadline for the whole STAGE phase, milliseconds.
    pub stage_timeout_ms: u64,
    /// Deadline of each engine call, milliseconds (a hung worker fails after it).
    pub call_timeout_ms: u64,
    /// How many workers APPLY at once: 0 = the whole set concurrently (the default; each apply
    /// is local to its worker), 1 = one after the other, N = at most N in flight. A failed apply
    /// stops new ones from starting; those in flight finish before the rollback.
    #[serde(default)]
    pub apply_parallelism: u32,
    /// The orchestrator holds the safe point itself (no generation in flight on the set, as in
    /// a synchronous RL loop between rollouts): PREPARE and RESUME make no engine calls, and a
    /// rollback re-applies without pausing. Rollouts stay gated by the control plane from BEGIN
    /// to END either way.
    #[serde(default)]
    pub orchestrator_gated: bool,
    /// VERIFY takes each worker's resident version from its APPLY answer where the engine
    /// reported one (Dynamo's `version` field of `update_weights_from_disk`, the value
    /// `get_weight_version` serves, already required to equal the target), instead of a second
    /// `get_weight_version` call. Workers whose answer carried no version (SGLang, older Dynamo)
    /// are still read back. Off by default: a separate read-back also catches an engine whose
    /// answer and resident state disagree.
    #[serde(default)]
    pub verify_from_apply_answer: bool,
}

/// Default STAGE deadline (ms).
pub const DEFAULT_STAGE_TIMEOUT_MS: u64 = 300_000;
/// Default engine call deadline (ms).
pub const DEFAULT_CALL_TIMEOUT_MS: u64 = 60_000;

/// A refit's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Workers pull and verify the version into staging.
    Stage,
    /// Generation is paused on every worker (the safe point).
    Prepare,
    /// Workers install the staged version and clear every cache tier.
    Apply,
    /// The resident version is read back from every worker.
    Verify,
    /// Engines resume (rollouts still gated by the control plane).
    Resume,
    /// The post-update generation runs on every worker.
    Check,
    /// The decision: the version is live everywhere in the set; rollouts admitted.
    Commit,
    /// Before the point of no return: nobody applies.
    Abort,
    /// After it: every worker goes back to the version it had.
    Rollback,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Stage => "STAGE",
            Phase::Prepare => "PREPARE",
            Phase::Apply => "APPLY",
            Phase::Verify => "VERIFY",
            Phase::Resume => "RESUME",
            Phase::Check => "CHECK",
            Phase::Commit => "COMMIT",
            Phase::Abort => "ABORT",
            Phase::Rollback => "ROLLBACK",
        })
    }
}

/// One engine call to one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Action {
    /// pause_generation.
    Pause,
    /// update_weights_from_disk with `model_path` = `mx://<hex>` of `version`'s digest.
    Apply {
        /// The version to install: an mx version, or (a rollback on an engine that retains
        /// its start-up checkpoint, vLLM with mx's backend) the label it was resident as.
        version: ResidentVersion,
    },
    /// get_weight_version.
    ReadVersion,
    /// resume_generation / continue_generation.
    Resume,
    /// The post-update generation.
    Generate,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Pause => f.write_str("pause"),
            Action::Apply { version } => write!(f, "apply {version}"),
            Action::ReadVersion => f.write_str("read_version"),
            Action::Resume => f.write_str("resume"),
            Action::Generate => f.write_str("generate"),
        }
    }
}

/// The result of one engine call.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CallResult {
    /// HTTP status and body both said success (and, for checks, the values matched).
    pub ok: bool,
    /// Why not, naming the worker, route and what differed.
    pub error: String,
    /// Wall seconds of the call.
    pub seconds: f64,
    /// The version the engine reports resident (apply, read_version), when it reports one.
    pub version: Option<ResidentVersion>,
    /// Cache tiers the engine says it cleared (apply).
    pub cache_tiers_cleared: Vec<String>,
    /// Generated tokens (generate).
    pub tokens: Vec<u32>,
    /// Requests paused by the update (SGLang's `num_paused_requests`).
    pub paused_requests: u64,
    /// The engine's message.
    pub message: String,
    /// The requests an apply made and their seconds (vLLM's `update_weights`,
    /// `reset_prefix_cache`, ...), where the engine client times them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<mx_adapters::StepTime>,
    /// Nothing was sent: the engine at the worker's URL said it serves other workers
    /// (`crate::identity`), so the call was refused before it was made. Such a worker cannot
    /// be settled through that URL: an abort does not resume it and a rollback fences it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub not_sent: bool,
}

/// How a refit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every worker of the set runs the version; rollouts admitted.
    Committed,
    /// Failed before any apply: every worker kept its version.
    Aborted,
    /// Failed after some applies: every worker is back on its previous version.
    RolledBack,
    /// A worker could not be brought back in time: it stays gated (not admitted) until it is
    /// refitted again; the others are consistent.
    Fenced,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Committed => "COMMITTED",
            Outcome::Aborted => "ABORTED",
            Outcome::RolledBack => "ROLLED_BACK",
            Outcome::Fenced => "FENCED",
        })
    }
}

/// One call as journaled: the intent, then (when it finished) the result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerCall {
    /// The call.
    pub action: Action,
    /// Phase it belongs to.
    pub phase: Phase,
    /// Its result; `None` while in flight (or when the control plane died during it).
    pub result: Option<CallResult>,
}

/// One worker in a refit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefitWorker {
    /// Resident version when the refit began (the rollback target).
    pub previous: Option<ResidentVersion>,
    /// Resident version now, as last learned from the worker (apply answers and read-backs).
    pub resident: Option<ResidentVersion>,
    /// STAGE seconds as the worker reported them, and useful bytes pulled.
    pub stage_seconds: f64,
    /// Useful bytes pulled.
    pub stage_bytes: u64,
    /// Engine calls in order.
    pub calls: Vec<WorkerCall>,
    /// Set when the worker registered again while the refit was open (its process restarted
    /// or reconnected): what it then reported resident. Its staged copy and pinned previous
    /// version may be gone, so the driver aborts before the point of no return, and after it
    /// brings the worker back to [`RefitWorker::previous`] by staging that version again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reregistered: Option<Rejoined>,
}

/// What a worker reported when it registered again during an open refit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejoined {
    /// The version resident in its engine then (`None`: no weights).
    pub resident: Option<ResidentVersion>,
}

impl RefitWorker {
    /// True when the worker registered again during the refit reporting a resident version
    /// other than `previous`, or none: it lost what the refit relies on (a restart).
    pub fn lost_weights(&self) -> bool {
        self.reregistered
            .as_ref()
            .is_some_and(|r| r.resident != self.previous)
    }

    /// True when an apply was issued to this worker (its weights may have changed).
    pub fn apply_issued(&self) -> bool {
        self.calls
            .iter()
            .any(|c| matches!(c.action, Action::Apply { .. }))
    }
}

/// A refit as the control plane knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refit {
    /// Refit id (ascending from 1).
    pub id: u64,
    /// What was asked (its `worker_ids` is the final set).
    pub spec: RefitSpec,
    /// The target version's digest.
    pub digest: Digest,
    /// The target version's id (of `digest`).
    pub target: VersionId,
    /// Workers left out (not connected) with the reason, when `allow_partial`.
    pub dropped: Vec<(String, String)>,
    /// Current phase; phases passed, with the unix millisecond each began.
    pub phase: Phase,
    /// Phases in order with their start time (unix ms).
    pub phases: Vec<(Phase, u64)>,
    /// Per worker.
    pub workers: BTreeMap<String, RefitWorker>,
    /// The outcome, once ended.
    pub outcome: Option<Outcome>,
    /// Why it did not commit (empty when it did).
    pub reason: String,
    /// Unix ms of BEGIN.
    pub started_ms: u64,
    /// Unix ms of END.
    pub ended_ms: Option<u64>,
    /// True when a control plane recovered this refit after a restart.
    pub recovered: bool,
    /// Set when its per-worker detail was dropped ([`crate::history`]): `workers`, `dropped`
    /// and `spec.worker_ids` are empty then, and these are their counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trimmed: Option<crate::history::Trimmed>,
    /// The id of the request that started it (0: none): a request repeated with the same id
    /// is answered this refit's id and starts nothing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub request_id: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How the reason of a refit that a restarted (or newly elected) control plane ended begins
/// when the refit had not failed before the restart: the control plane, not the fleet, ended it.
pub const RESTART_REASON: &str = "control plane restarted in phase";

impl Refit {
    /// True when a control plane that recovered this refit after a restart or failover ended
    /// it ABORTED or ROLLED_BACK for that reason alone (nothing had failed before): every
    /// worker is back on its previous version, and the same refit may be asked for again.
    pub fn ended_by_restart(&self) -> bool {
        self.recovered
            && matches!(
                self.outcome,
                Some(Outcome::Aborted) | Some(Outcome::RolledBack)
            )
            && self.reason.starts_with(RESTART_REASON)
    }

    /// True once an apply was issued to any worker (the point of no return is passed).
    pub fn past_no_return(&self) -> bool {
        self.workers.values().any(RefitWorker::apply_issued)
    }

    /// True when every worker of the set already held the target when the refit began (a
    /// refit of the committed version): nothing is staged, paused or applied; the refit reads
    /// every engine's version back and runs the post-update check (STAGE -> VERIFY -> RESUME
    /// -> CHECK -> COMMIT), so a worker that only claims the version is caught.
    pub fn verify_only(&self) -> bool {
        !self.workers.is_empty()
            && self
                .workers
                .values()
                .all(|w| w.previous.as_ref().is_some_and(|p| p.is(self.target)))
    }

    /// What is missing for this refit's journal to be complete: BEGIN and END recorded, every
    /// call intent followed by its result, every worker's resulting version known. Empty when
    /// complete.
    pub fn journal_gaps(&self) -> Vec<String> {
        let mut gaps = Vec::new();
        if self.outcome.is_none() {
            gaps.push(format!("refit {} has no END", self.id));
        }
        for (id, w) in &self.workers {
            for c in &w.calls {
                if c.result.is_none() {
                    gaps.push(format!(
                        "worker {id}: {} ({}) has no result",
                        c.action, c.phase
                    ));
                }
            }
            if self.outcome.is_some() && w.resident.is_none() && w.previous.is_some() {
                gaps.push(format!("worker {id}: resulting version unknown"));
            }
        }
        gaps
    }
}

/// Unix time in milliseconds (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
