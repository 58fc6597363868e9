//! One client over every engine contract: [`EngineClient`], the calls a refit makes on one
//! engine (pause, apply, read the version back, resume, generate), and the types every contract
//! shares ([`PauseMode`], [`Answer`]); each engine kind's module implements it
//! (`crate::dynamo::DynamoWorkerClient`, `crate::sglang::SglangClient`,
//! `crate::vllm::VllmClient`) and `crate::client_for` picks the one an [`EngineApi`] names.
//! This module imports no engine kind, and no kind imports another. What each contract lacks is answered, not failed: SGLang has no version
//! read-back and may not allowlist pause/continue (the framework then gates generation itself),
//! and its answers say so. Judging the answers (the version after apply, golden tokens) is the
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
    /// Dynamo vLLM RL routes `POST {system_url}/engine/{route}` (pause_generation,
    /// update_weights_from_disk, get_weight_version, resume_generation).
    Dynamo,
    /// SGLang `POST {system_url}/engine/control/{route}` (update_weights_from_disk; pause and
    /// continue only where allowlisted; no version read-back).
    Sglang,
    /// vLLM's native RL routes on its OpenAI-compatible server (`VLLM_SERVER_DEV_MODE=1`):
    /// `POST {system_url}/pause`, `/start_weight_update`, `/update_weights`,
    /// `/finish_weight_update`, `/reset_prefix_cache`, `/resume`, `GET /weight_info` (the
    /// read-back) and `POST /v1/completions` for the post-update generation.
    Vllm,
}

impl fmt::Display for EngineApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineApi::Dynamo => "dynamo",
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
            "sglang" => Ok(EngineApi::Sglang),
            "vllm" => Ok(EngineApi::Vllm),
            other => Err(format!("unknown engine api {other:?} (dynamo|sglang|vllm)")),
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

/// What an APPLY answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyAnswer {
    /// The engine's message.
    pub message: String,
    /// The weight version the engine reports after the update, when it reports one.
    pub version: Option<ResidentVersion>,
    /// Cache tiers the engine says it cleared (empty when it does not say).
    pub cache_tiers_cleared: Vec<String>,
    /// Requests paused by the update (SGLang's `num_paused_requests`; 0 elsewhere).
    pub paused_requests: u64,
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

/// The `mx://<64 hex>` model path of an `mx:<64 hex>` version id, for the contracts that load
/// from a path.
///
/// # Errors
/// [`Error::Unappliable`] for any other version.
pub(crate) fn mx_model_path(version: &ResidentVersion) -> Result<String, Error> {
    version
        .mx()
        .map(|v| v.model_path())
        .ok_or_else(|| Error::Unappliable {
            version: version.to_string(),
            reason: "not an mx version id (mx:<64 hex>)",
        })
}

/// `pause_generation` modes: what happens to in-flight requests (Dynamo's spelling; the one
/// type mx uses for it, in the control plane, the journal and the reference worker).
///
/// Written as Dynamo spells it; read through [`FromStr`](std::str::FromStr), so SGLang's
/// spellings are accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Keep them paused in place and resume them after.
    Keep,
    /// Wait for them to finish.
    #[default]
    Wait,
    /// Abort them.
    Abort,
}

impl std::str::FromStr for PauseMode {
    type Err = String;

    /// Dynamo's `keep`, `wait`, `abort`, and SGLang's `in_place` / `retract` (both hold the
    /// request: `keep`).
    fn from_str(s: &str) -> Result<PauseMode, String> {
        match s {
            "keep" | "in_place" | "retract" => Ok(PauseMode::Keep),
            "wait" => Ok(PauseMode::Wait),
            "abort" => Ok(PauseMode::Abort),
            other => Err(format!("{other:?} is not one of keep, wait, abort")),
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
    /// The contract's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Keep => "keep",
            PauseMode::Wait => "wait",
            PauseMode::Abort => "abort",
        }
    }
}
