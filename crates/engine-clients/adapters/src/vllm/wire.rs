//! vLLM's native RL and completion wire values (vLLM 0.32.0; see [`crate::vllm`] for the
//! routes), for both sides: mx's client sends the requests and reads the answers; fake servers
//! in tests read the requests and send the answers.
//!
//! Field names are vLLM's, exactly. Conventions: answers must carry the fields the contract
//! names (a missing one does not follow the contract); fields the contract does not name are
//! ignored, since servers add some; `temperature` is written as an integer when integral (`0`).
//! `/pause`, `/start_weight_update`, `/reset_prefix_cache` and `/resume` take no body (the
//! pause mode travels in the query string).

use serde::{Deserialize, Serialize};

use crate::de;

/// `/pause` and `/resume` answer: `{"status": "paused"}` / `{"status": "resumed"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusResponse {
    /// `"paused"` or `"resumed"`.
    pub status: String,
}

/// The weight-update routes' answer: `{"message": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageResponse {
    /// The engine's message.
    pub message: String,
}

/// Body of `POST /update_weights`: `{"update_info": {"version_id": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateWeightsRequest {
    /// Handed as-is to the server's weight-transfer backend.
    pub update_info: UpdateInfo,
}

/// What mx's weight-transfer backend reads from `update_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateInfo {
    /// The version to install (`mx:<64 hex>`, or a retained id such as `disk:<dir>`).
    pub version_id: String,
}

/// Body of `POST /finish_weight_update`: `{"weight_version": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishWeightUpdateRequest {
    /// The version the engine records as its weight version.
    pub weight_version: String,
}

/// `GET /weight_info` answer: `weight_version` must be present, null allowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightInfoResponse {
    /// The engine's weight version; `None` (null) when it has none.
    #[serde(deserialize_with = "required_nullable")]
    pub weight_version: Option<String>,
}

/// Makes an `Option` field required (present, possibly null): serde treats a missing
/// `Option` field as `None` unless the field has its own deserializer.
fn required_nullable<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Option::<String>::deserialize(d)
}

/// `POST /reset_prefix_cache` answer: `{"success": bool}` (`false` while KV blocks are held).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetPrefixCacheResponse {
    /// Whether the cache was reset.
    pub success: bool,
}

/// `GET /is_paused` answer: `{"is_paused": bool}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IsPausedResponse {
    /// Whether generation is paused.
    pub is_paused: bool,
}

/// `POST /v1/completions` body (greedy, token ids in and out; `model` is optional for a server
/// serving one model, so mx leaves it out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Sampling temperature (mx: 0, greedy).
    #[serde(serialize_with = "de::number")]
    pub temperature: f64,
    /// Whether each choice carries `token_ids` (mx: true).
    pub return_token_ids: bool,
    /// Whether end-of-sequence is ignored (mx: true, so exactly `max_tokens` come back).
    pub ignore_eos: bool,
}

/// `POST /v1/completions` answer: `{"choices": [...], "usage": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// The choices (mx asks for exactly one).
    pub choices: Vec<CompletionChoice>,
    /// Token counts, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice; `token_ids` is required (the request asked for it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Generated token ids.
    #[serde(deserialize_with = "required_token_ids")]
    pub token_ids: Vec<u32>,
}

fn required_token_ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    Option::<Vec<u32>>::deserialize(d)?.ok_or_else(|| serde::de::Error::custom("token_ids is null"))
}

/// `usage` of a completion answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Details of the prompt's tokens, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}
