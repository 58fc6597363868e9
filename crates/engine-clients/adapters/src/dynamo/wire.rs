//! The Dynamo vLLM RL contract's wire values, for both sides: mx's client sends the requests
//! and reads the answers; mx's reference worker (and every fake engine of the tests and
//! benchmarks) reads the requests and sends the answers. The exact bodies, read from ai-dynamo
//! 1.6.1 and checked against a running worker, are in [`crate::dynamo`]'s docs.
//!
//! Field names are Dynamo's, exactly. Conventions:
//! - A request field left out (or null) takes the engine's default; mx's client always sends
//!   every field it knows, so each request field is an `Option` skipped when `None`. Unknown
//!   request fields are ignored and a key given twice is refused.
//! - Answers are read as leniently as Dynamo's releases require: text fields (`message`,
//!   `version`, the worker descriptions) may be strings or numbers, `instance_id` is a number or
//!   a string ([`InstanceId`]), `routes` are strings or objects naming the route in `name` or
//!   `route`, and an optional field of an unexpected type reads as absent.
//! - `cache_tiers_cleared` and `apply_seconds` are mx extensions: engines that do not report
//!   them leave them out, and mx reads that as "no tiers cleared".

use serde::{Deserialize, Serialize};

use super::PauseMode;
use crate::de;

/// Body of `POST {system_url}/engine/pause_generation`: `{mode, clear_cache}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRequest {
    /// What happens to in-flight requests (`keep`, `wait`, `abort`); absent: Dynamo's default,
    /// `keep`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PauseMode>,
    /// Whether the engine clears its prefix cache while pausing; absent: Dynamo's default,
    /// `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_cache: Option<bool>,
}

/// The worker method mx's vLLM plugin adds (`mx.vllm.INSTALL_METHOD`): one vLLM
/// `collective_rpc` that opens a weight-update session, installs `version_id` through mx's
/// weight-transfer backend and closes the session, on every rank.
pub const MX_INSTALL_RPC: &str = "mx_install";

/// Body of `POST {system_url}/engine/update_weights_from_distributed`. Dynamo strips its own
/// keys (`engine_rpc`, `weight_version`, `reset_prefix_cache`, `allow_unpaused`) and calls
/// vLLM's `collective_rpc(engine_rpc, kwargs=<the rest>)`: mx sends
/// `{"engine_rpc": "mx_install", "version_id": V, "weight_version": V, "reset_prefix_cache":
/// true}`, so the rest is `{"version_id": V}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateFromDistributedRequest {
    /// The worker method to call (Dynamo's default: `update_weights_from_path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_rpc: Option<String>,
    /// The version the worker records once the call succeeds (absent: it keeps the one it had
    /// and answers `"version": "unknown"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// Whether Dynamo resets vLLM's prefix cache after the call (Dynamo's default: true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_prefix_cache: Option<bool>,
    /// `mx_install`'s argument: the mx version id (or a retained id) to install.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version_id: Option<String>,
}

/// Body of `POST {system_url}/engine/update_weights_from_disk`: `{model_path, weight_version}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightsRequest {
    /// What to load: a checkpoint directory (mx's reference worker also resolves `mx://<64
    /// hex>`, a version mx staged; a real Dynamo worker reads it as a path and fails).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// The version the engine reports once loaded (an `mx:<64 hex>` id for mx versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The body of the routes that take no arguments (`get_weight_version`,
/// `resume_generation`): `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmptyRequest {}

/// Whether an engine route succeeded: `"ok"` or `"error"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyStatus {
    /// The route did what was asked.
    Ok,
    /// It failed; `message` says why.
    Error,
}

/// The answer of every engine route: `{status, message, version}` (plus mx's extensions).
/// `status: "error"` is a failure whatever the HTTP status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineResponse {
    /// Success or failure.
    pub status: ReplyStatus,
    /// The engine's message (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
    /// The weight version the engine holds, when it reports one.
    #[serde(
        default,
        deserialize_with = "de::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub version: Option<String>,
    /// Whether the version was declared (Dynamo 1.6.1: `false` for the start-up version, which
    /// it reports as `null`, and for an update sent without `weight_version`).
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub version_declared: Option<bool>,
    /// Cache tiers the engine cleared (mx extension; `update_weights_from_disk` only).
    #[serde(
        default,
        deserialize_with = "de::opt_string_list",
        skip_serializing_if = "Option::is_none"
    )]
    pub cache_tiers_cleared: Option<Vec<String>>,
    /// Seconds the update took (mx extension; `update_weights_from_disk` only).
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub apply_seconds: Option<f64>,
}

impl EngineResponse {
    /// `{status: "ok", message, version}`.
    pub fn ok(message: impl Into<String>, version: Option<String>) -> EngineResponse {
        EngineResponse {
            status: ReplyStatus::Ok,
            message: message.into(),
            version_declared: version.as_ref().map(|_| true),
            version,
            cache_tiers_cleared: None,
            apply_seconds: None,
        }
    }

    /// `{status: "error", message, version}`.
    pub fn error(message: impl Into<String>, version: Option<String>) -> EngineResponse {
        EngineResponse {
            status: ReplyStatus::Error,
            ..EngineResponse::ok(message, version)
        }
    }
}

/// A worker's instance id: Dynamo lists a number, some releases a string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InstanceId {
    /// A JSON number (mx's worker lists a number below 2^53).
    Number(serde_json::Number),
    /// A string.
    Text(String),
}

impl std::fmt::Display for InstanceId {
    /// Numbers as their decimal text, strings as they are.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InstanceId::Number(n) => write!(f, "{n}"),
            InstanceId::Text(s) => f.write_str(s),
        }
    }
}

/// One worker as `GET {base}/v1/rl/workers` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Dynamo namespace.
    #[serde(deserialize_with = "de::text")]
    pub namespace: String,
    /// Component name.
    #[serde(deserialize_with = "de::text")]
    pub component: String,
    /// Endpoint name.
    #[serde(deserialize_with = "de::text")]
    pub endpoint: String,
    /// Instance id.
    pub instance_id: InstanceId,
    /// Request-plane transport: a string, or Dynamo 1.6.1's object
    /// (`{"tcp": "<host:port>/<hex id>/<ns>/<component>/<endpoint>"}`) kept as its JSON text.
    #[serde(deserialize_with = "de::text_or_json")]
    pub transport: String,
    /// Request-plane URL.
    #[serde(deserialize_with = "de::text")]
    pub request_plane_url: String,
    /// Base URL of the worker's system server (the engine routes live under it).
    #[serde(
        default,
        deserialize_with = "de::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub system_url: Option<String>,
    /// Admin base URL, when the listener reports one.
    #[serde(
        default,
        deserialize_with = "de::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub admin_base_url: Option<String>,
    /// Served model, when reported.
    #[serde(
        default,
        deserialize_with = "de::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub model: Option<String>,
    /// Engine routes the worker exposes (strings, or objects with `name`/`route`, read as their
    /// names; written as strings).
    #[serde(default, deserialize_with = "de::routes")]
    pub routes: Vec<String>,
    /// The engine's world size (number of ranks), when reported.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub world_size: Option<u64>,
    /// A per-worker discovery error, when the listener could not describe it fully.
    #[serde(
        default,
        deserialize_with = "de::opt_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub error: Option<String>,
}

/// The answer of `GET {base}/v1/rl/workers`: `{protocol_version, namespace, workers}`, the list
/// named `system_routes` by older releases.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkersResponse {
    /// The listener's protocol version (mx speaks 1); absent when missing or not a number.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub protocol_version: Option<u64>,
    /// The listener's namespace (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub namespace: String,
    /// The workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<Vec<WorkerInfo>>,
    /// The workers, as older releases name the list (read when `workers` is absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_routes: Option<Vec<WorkerInfo>>,
}

impl WorkersResponse {
    /// The worker list: `workers`, else `system_routes`; `None` when neither is there.
    pub fn into_workers(self) -> Option<Vec<WorkerInfo>> {
        self.workers.or(self.system_routes)
    }
}

/// HTTP 500 answer of a failed discovery: `{error: "discovery_failed", message}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiscoveryError {
    /// `"discovery_failed"`.
    pub error: String,
    /// What failed (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
}

impl DiscoveryError {
    /// The `error` value of a failed discovery.
    pub const DISCOVERY_FAILED: &'static str = "discovery_failed";
}

/// Body of the frontend's `POST {frontend}/v1/completions` as mx sends it for a post-update
/// check: greedy, token ids in, pinned to one worker, the token ids asked back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The served model name (the frontend routes by it).
    pub model: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// 0: greedy.
    #[serde(serialize_with = "de::number")]
    pub temperature: f64,
    /// Generate `max_tokens` even past an end-of-sequence token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Log-probabilities of the `logprobs` likeliest tokens per position: mx asks for 1, with
    /// [`CompletionRequest::return_tokens_as_token_ids`], to read the token ids of a worker
    /// that leaves them out of `engine_data` (Dynamo's SGLang worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Spell `logprobs.tokens` as `"token_id:<id>"` (the vLLM OpenAI extension Dynamo's
    /// frontend honours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_tokens_as_token_ids: Option<bool>,
    /// Dynamo's extension: the worker and the extra answer fields.
    pub nvext: NvextRequest,
}

/// `nvext` of a completion request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvextRequest {
    /// The worker that must serve the request (its `instance_id` in `/v1/rl/workers`, a u64
    /// above 2^53: never through a float). An unknown id is HTTP 400.
    pub backend_instance_id: u64,
    /// `["engine_data"]`: the answer's `nvext.engine_data` carries the token ids.
    pub extra_fields: Vec<String>,
}

/// The part of the frontend's completion answer mx reads: `nvext.engine_data` and the first
/// choice's `logprobs.tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// Dynamo's extension (present when `extra_fields` asked for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvext: Option<NvextResponse>,
    /// The completions (one: mx sends no `n`).
    #[serde(default)]
    pub choices: Vec<CompletionChoice>,
}

impl CompletionResponse {
    /// The generated token ids: `nvext.engine_data.completion_token_ids` (Dynamo's vLLM
    /// worker), else the first choice's `logprobs.tokens` read as `"token_id:<id>"` (every
    /// worker, when the request set `logprobs` and `return_tokens_as_token_ids`).
    ///
    /// # Errors
    /// In words, when the answer has neither, or a token is not spelled `token_id:<u32>`.
    pub fn token_ids(&self) -> Result<Vec<u32>, String> {
        if let Some(ids) = self
            .nvext
            .as_ref()
            .and_then(|n| n.engine_data.as_ref())
            .and_then(|d| d.completion_token_ids.clone())
        {
            return Ok(ids);
        }
        let tokens = self
            .choices
            .first()
            .and_then(|c| c.logprobs.as_ref())
            .map(|l| &l.tokens)
            .ok_or(
                "neither nvext.engine_data.completion_token_ids nor choices[0].logprobs.tokens",
            )?;
        tokens
            .iter()
            .map(|t| {
                t.strip_prefix("token_id:")
                    .and_then(|id| id.parse::<u32>().ok())
                    .ok_or_else(|| format!("logprobs token {t:?} is not \"token_id:<u32>\""))
            })
            .collect()
    }
}

/// `nvext` of a completion answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvextResponse {
    /// What the engine reports about the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_data: Option<EngineData>,
}

/// `nvext.engine_data`: the request's token ids as the worker saw and produced them (Dynamo's
/// vLLM worker; its SGLang worker reports only `kv_cache_hit` here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineData {
    /// Generated token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_token_ids: Option<Vec<u32>>,
    /// Prompt token ids (when reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// One choice of a completion answer: its `logprobs`, when asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// The choice's log-probabilities (`null` unless the request set `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChoiceLogprobs>,
}

/// `choices[i].logprobs`: the part mx reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceLogprobs {
    /// The generated tokens, `"token_id:<id>"` with `return_tokens_as_token_ids`.
    #[serde(default)]
    pub tokens: Vec<String>,
}
