//! A Dynamo SGLang worker's wire values (`POST {system_url}/engine/control/{route}` and the
//! native `/engine/pause_generation`, `/engine/continue_generation`), for both
//! sides: mx's client sends the requests and reads the answers; mx's reference worker and the
//! fake engines of the tests read the requests and send the answers.
//!
//! Field names are SGLang's, exactly. Conventions:
//! - A request field left out (or null) takes the engine's default, so each is an `Option`
//!   skipped when `None`. Unknown request fields are ignored; a key given twice is refused.
//! - `update_weights_from_disk` answers `{success, message, num_paused_requests}`: `success` is
//!   required (an answer without it does not follow the contract), the others read as empty /
//!   0 when absent or of another type.
//! - `pause_generation` / `continue_generation` answer `{"status": "ok"}`; they are read only
//!   for `status: "error"` or `success: false`.
//! - `cache_tiers_cleared` is an mx extension: engines that do not report it leave it out, read
//!   as "no tiers cleared".

use serde::{Deserialize, Serialize};

use crate::de;
use crate::engine::SglangPause;

/// Body of `update_weights_from_disk`: `{model_path, weight_version, flush_cache, keep_pause,
/// abort_all_requests}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightsRequest {
    /// What to load: a checkpoint directory, or `mx://<64 hex>` for a version mx staged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// The version the engine records once loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// Whether to flush the KV/prefix cache after loading; absent: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_cache: Option<bool>,
    /// Whether generation stays paused after the update; absent: false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_pause: Option<bool>,
    /// Whether in-flight requests are aborted (instead of held) for the update; absent: false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_all_requests: Option<bool>,
}

/// Body of `pause_generation`: `{mode}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRequest {
    /// What happens to in-flight requests; absent: SGLang's default, `abort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<SglangPause>,
}

/// Body of `continue_generation`: `{torch_empty_cache}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContinueRequest {
    /// Whether the engine frees torch's cached allocations first; absent: false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_empty_cache: Option<bool>,
}

/// The answer of `update_weights_from_disk` (and mx's worker's answer to every control route):
/// `{success, message, num_paused_requests}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightsResponse {
    /// Whether the route did what was asked; `false` is a failure whatever the HTTP status.
    pub success: bool,
    /// The engine's message (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
    /// Requests paused during the update (0 when absent).
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub num_paused_requests: Option<u64>,
    /// Cache tiers the engine cleared (mx extension).
    #[serde(
        default,
        deserialize_with = "de::opt_string_list",
        skip_serializing_if = "Option::is_none"
    )]
    pub cache_tiers_cleared: Option<Vec<String>>,
}

impl UpdateWeightsResponse {
    /// `{success, message}`.
    pub fn new(success: bool, message: impl Into<String>) -> UpdateWeightsResponse {
        UpdateWeightsResponse {
            success,
            message: message.into(),
            num_paused_requests: None,
            cache_tiers_cleared: None,
        }
    }
}

/// The answer of `pause_generation` / `continue_generation` as mx reads it (`{"status":
/// "ok"}`): only `status: "error"` or `success: false` is a failure.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlResponse {
    /// `"ok"` or `"error"` (Dynamo's wrapper of SGLang's methods).
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub status: Option<String>,
    /// `false` when the route failed; absent in SGLang's own answers.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub success: Option<bool>,
    /// The engine's message (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
}
