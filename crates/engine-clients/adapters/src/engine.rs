//! One client over every engine contract: [`EngineClient`], the calls a refit makes on one
//! engine (pause, apply, read the version back, resume, generate), and the types every contract
//! shares ([`PauseMode`], [`Answer`]); each engine kind's module implements it
//! (`crate::dynamo::DynamoWorkerClient`, `crate::dynamo_sglang::DynamoSglangClient`,
//! `crate::sglang::SglangClient`,
//! `crate::vllm::VllmClient`) and `crate::client_for` picks the one an [`EngineApi`] names.
//! This module imports no engine kind, and no kind imports another. What each contract lacks is
//! answered, not failed: a Dynamo SGLang worker has no version read-back and may not serve
//! pause/continue (the framework then gates generation itself), and its answers say so. Judging the answers (the version after apply, golden tokens) is the
//! caller's.

use std::fmt;

use mx_layout::ResidentVersion;
use serde::{Deserialize, Serialize};

use crate::generate::Generation;
use crate::identity::Proof;
use crate::Error;

/// Which engine contract a worker speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineApi {
    /// A Dynamo vLLM worker's RL routes `POST {system_url}/engine/{route}` (pause_generation,
    /// update_weights_from_distributed into mx's backend, get_weight_version,
    /// resume_generation), found through the frontend's RL listener (`crate::dynamo`).
    Dynamo,
    /// A Dynamo SGLang worker: `POST {system_url}/engine/control/{route}`
    /// (update_weights_from_disk) and the default `/engine/pause_generation`,
    /// `/engine/continue_generation`; no version read-back (`crate::dynamo_sglang`). Spelled
    /// `sglang` before SGLang's own server had a kind of its own (proto value 2 is unchanged).
    DynamoSglang,
    /// SGLang's own server (`python -m sglang.launch_server`, 0.5.23): `/pause_generation`
    /// with its modes, the weight-update session (`/begin_weight_update`,
    /// `/update_weights_from_tensor` into mx's loader, `/end_weight_update`), `/flush_cache`,
    /// `GET /model_info` (the version), `/continue_generation`, `/generate`
    /// (`crate::sglang`).
    Sglang,
    /// vLLM's native RL routes on its OpenAI-compatible server (`VLLM_SERVER_DEV_MODE=1`):
    /// `POST {system_url}/pause`, `/start_weight_update`, `/update_weights`,
    /// `/finish_weight_update`, `/reset_prefix_cache`, `/resume`, `GET /weight_info` (the
    /// read-back) and `POST /v1/completions` for the post-update generation.
    Vllm,
}

impl EngineApi {
    /// Whether a rollback can restore any version the worker held by its id (the start-up
    /// checkpoint `disk:<dir>` included), not only an mx version: vLLM (mx's backend) and
    /// SGLang's own server (mx's loader), which keep what they held. A Dynamo vLLM worker's
    /// route installs mx versions only; a Dynamo SGLang worker loads from disk.
    pub fn restores_any_version(self) -> bool {
        matches!(self, EngineApi::Vllm | EngineApi::Sglang)
    }

    /// Whether the engine's own version read-back only echoes the version a request named, so
    /// the resident version is taken from what mx's code in each rank reports
    /// (`ReportResident`): SGLang's own server and Dynamo's SGLang worker, whose custom weight
    /// loader cannot fail a request (an exception there kills the server), so mx's loader
    /// restores the previous version itself and SGLang still answers success.
    pub fn resident_from_ranks(self) -> bool {
        matches!(self, EngineApi::Sglang | EngineApi::DynamoSglang)
    }
}

impl fmt::Display for EngineApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineApi::Dynamo => "dynamo",
            EngineApi::DynamoSglang => "dynamo_sglang",
            EngineApi::Sglang => "sglang",
            EngineApi::Vllm => "vllm",
        })
    }
}

impl std::str::FromStr for EngineApi {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "dynamo" => Ok(EngineApi::Dynamo),
            "dynamo_sglang" => Ok(EngineApi::DynamoSglang),
            "sglang" => Ok(EngineApi::Sglang),
            "vllm" => Ok(EngineApi::Vllm),
            other => Err(format!(
                "unknown engine api {other:?} (dynamo|dynamo_sglang|sglang|vllm)"
            )),
        }
    }
}

/// What a pause, resume or version read-back answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// The engine's message, or what the contract lacks (e.g. SGLang's "not allowlisted").
    pub message: String,
    /// The weight version the engine reports, when it reports one (always, for a read-back
    /// over a contract that has one).
    pub version: Option<ResidentVersion>,
}

/// One request inside an engine call and how long it took (e.g. vLLM's `update_weights` inside
/// APPLY): where a stall's time goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// The request, as the contract names it (`update_weights`, `reset_prefix_cache`, ...).
    pub step: String,
    /// Wall seconds from sending it to its answer.
    pub seconds: f64,
}

/// What an APPLY answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApplyAnswer {
    /// The engine's message.
    pub message: String,
    /// The weight version the engine reports after the update, when it reports one.
    pub version: Option<ResidentVersion>,
    /// Cache tiers the engine says it cleared (empty when it does not say).
    pub cache_tiers_cleared: Vec<String>,
    /// Requests paused by the update (SGLang's `num_paused_requests`; 0 elsewhere).
    pub paused_requests: u64,
    /// The requests the apply made, in order, with their seconds (empty where not timed).
    pub steps: Vec<StepTime>,
}

/// The calls a refit makes on one engine, over whichever contract it speaks. Every call checks
/// the HTTP status and the body and has the client's deadline ([`Error::Timeout`]).
#[async_trait::async_trait]
pub trait EngineClient: Send + Sync {
    /// Gates generation; `mode` says what happens to in-flight requests (where the contract
    /// takes one).
    ///
    /// # Errors
    /// The contract's [`Error`]s.
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error>;

    /// Installs `version` (an `mx:<64 hex>` id; vLLM also restores a retained id such as
    /// `disk:<dir>`).
    ///
    /// # Errors
    /// [`Error::Unappliable`] for a version the contract cannot name (nothing is sent);
    /// [`Error::ApplyStep`] naming the step of a multi-call apply that failed; the contract's
    /// [`Error`]s.
    async fn apply(&self, version: &ResidentVersion) -> Result<ApplyAnswer, Error>;

    /// Reads back the version the engine holds; over a contract without read-back (SGLang)
    /// the answer has no version and its message says so.
    ///
    /// # Errors
    /// [`Error::NoVersion`] when the engine reports none; the contract's [`Error`]s.
    async fn read_version(&self) -> Result<Answer, Error>;

    /// Lets generation go on.
    ///
    /// # Errors
    /// The contract's [`Error`]s.
    async fn resume(&self) -> Result<Answer, Error>;

    /// Greedy decoding of `max_new_tokens` tokens after `prompt` (token ids).
    ///
    /// # Errors
    /// The contract's [`Error`]s.
    async fn generate(&self, prompt: &[u32], max_new_tokens: u32) -> Result<Generation, Error>;

    /// Asks the engine which mx workers it serves ([`crate::identity`]): read-only, made before
    /// any call that changes the engine.
    ///
    /// # Errors
    /// The contract's [`Error`]s; an engine without the identity route is
    /// [`Proof::NotOffered`], not an error.
    async fn identify(&self) -> Result<Proof, Error>;
}

/// Pause modes: what happens to in-flight requests while the engine is paused (the one type mx
/// uses for it, in the control plane, the journal and the reference worker). Each contract
/// spells them its own way: [`PauseMode::as_str`] is mx's (and Dynamo's) spelling;
/// [`SglangPause::of`] maps to SGLang's.
///
/// Read through [`FromStr`](std::str::FromStr): `keep`, `wait`, `abort`, `retract`,
/// `in_place`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Hold them and let them go on after the install, recomputing what they had computed
    /// with the old weights (vLLM and Dynamo: `keep`, with mx's cache reset preempting the
    /// held requests; SGLang: `retract`).
    Keep,
    /// Wait for them to finish (vLLM and Dynamo; SGLang has no such mode: there, `retract`).
    #[default]
    Wait,
    /// Abort them.
    Abort,
    /// SGLang's `retract`: held requests go back to the queue, their KV freed; elsewhere as
    /// [`PauseMode::Keep`].
    Retract,
    /// SGLang's `in_place`: held requests keep their KV and batch slots. A cache flush is then
    /// refused, so mx retracts them after the install before it flushes; and an update that
    /// fails may have changed the weights: the worker is reinstalled on its previous version
    /// before it resumes. Elsewhere as [`PauseMode::Keep`].
    InPlace,
}

impl std::str::FromStr for PauseMode {
    type Err = String;

    fn from_str(s: &str) -> Result<PauseMode, String> {
        match s {
            "keep" => Ok(PauseMode::Keep),
            "wait" => Ok(PauseMode::Wait),
            "abort" => Ok(PauseMode::Abort),
            "retract" => Ok(PauseMode::Retract),
            "in_place" => Ok(PauseMode::InPlace),
            other => Err(format!(
                "{other:?} is not one of keep, wait, abort, retract, in_place"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for PauseMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<PauseMode, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl PauseMode {
    /// mx's spelling (`keep`, `wait`, `abort`, `retract`, `in_place`).
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Keep => "keep",
            PauseMode::Wait => "wait",
            PauseMode::Abort => "abort",
            PauseMode::Retract => "retract",
            PauseMode::InPlace => "in_place",
        }
    }

    /// The mode among vLLM's and Dynamo's (`keep`, `wait`, `abort`): SGLang's `retract` and
    /// `in_place` hold the requests, as `keep` does.
    pub fn keep_wait_abort(self) -> PauseMode {
        match self {
            PauseMode::Retract | PauseMode::InPlace => PauseMode::Keep,
            other => other,
        }
    }
}

/// SGLang's pause modes (`PauseGenerationReqInput.mode` at sglang 0.5.21 and 0.5.23, default
/// `abort`), for both SGLang kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SglangPause {
    /// Abort in-flight requests (the tokenizer manager then waits for the model-update lock).
    Abort,
    /// Move running requests back to the waiting queue, freeing their KV.
    Retract,
    /// Stop the scheduler where it is; requests keep their KV and batch slots.
    InPlace,
}

impl SglangPause {
    /// SGLang's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SglangPause::Abort => "abort",
            SglangPause::Retract => "retract",
            SglangPause::InPlace => "in_place",
        }
    }

    /// mx's `mode` as SGLang spells it: `keep` and `retract` are `retract`, `in_place` and
    /// `abort` themselves. SGLang has no mode that lets in-flight requests finish first, so
    /// `wait` (mx's default) is `retract` too: they are held, not lost, and finish on the new
    /// weights after the install (their KV recomputed).
    ///
    /// # Errors
    /// None today; the `Result` leaves room for a mode SGLang cannot take.
    pub fn of(mode: PauseMode) -> Result<SglangPause, Error> {
        match mode {
            PauseMode::Keep | PauseMode::Retract => Ok(SglangPause::Retract),
            PauseMode::InPlace => Ok(SglangPause::InPlace),
            PauseMode::Abort => Ok(SglangPause::Abort),
            PauseMode::Wait => Ok(SglangPause::Retract),
        }
    }
}
