//! SGLang's own server's wire values (`python -m sglang.launch_server`, sglang 0.5.23; the same
//! structs at 0.5.21), for both sides: mx's client sends the requests and reads the answers;
//! the tests' fake engines read the requests and send the answers.
//!
//! Field names are SGLang's, exactly (`sglang/srt/managers/io_struct.py`). Conventions:
//! - A request field left out takes SGLang's default, so optional fields are `Option`s skipped
//!   when `None`. SGLang ignores fields it does not know (its msgspec structs are read with
//!   `extra_behavior="ignore"`); a route without fields still needs a body: `{}`.
//! - The weight-update routes answer `{success, message}` with HTTP 200 on success and 400 on
//!   failure; `success` is required. Validation errors answer 400 in SGLang's `ErrorResponse`
//!   shape (`{object: "error", message, type, param, code}`), read through its `message`.
//! - `/flush_cache` answers text, not JSON.

use serde::{Deserialize, Serialize};

use crate::de;
use crate::engine::SglangPause;

/// Body of `POST /pause_generation`: `{mode}` (`PauseGenerationReqInput`, default `abort`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRequest {
    /// What happens to in-flight requests; absent: `abort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<SglangPause>,
}

/// Body of `POST /continue_generation`: `{torch_empty_cache}` (`ContinueGenerationReqInput`,
/// default `true`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContinueRequest {
    /// Whether the scheduler empties torch's allocator cache first; absent: `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_empty_cache: Option<bool>,
}

/// The answer of `/pause_generation` and `/continue_generation`: HTTP 200 `{message, status:
/// "ok"}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusResponse {
    /// `"ok"` on success.
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub status: String,
    /// SGLang's message (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
}

/// Body of `POST /begin_weight_update`: `{selector}` (`BeginWeightUpdateReqInput`: `target`,
/// `draft` or `all`, default `all`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BeginRequest {
    /// Which model's weights the session updates; absent: `all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
}

/// Body of `POST /update_weights_from_tensor` (`UpdateWeightsFromTensorReqInput`), as mx sends
/// it: one serialized `[(name, tensor)]` list per tensor-parallel rank (base64 of a pickle that
/// SGLang's allowlisting unpickler reads), handed to the loader `load_format` names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateFromTensorRequest {
    /// Rank `r` reads element `r`.
    pub serialized_named_tensors: Vec<String>,
    /// The custom weight loader (`module.function`, listed in the server's
    /// `--custom-weight-loader`); absent: the model's own `load_weights`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_format: Option<String>,
    /// Whether the scheduler flushes its cache after the load; absent: `true` (mx sends `false`
    /// and flushes through `/flush_cache` after the session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_cache: Option<bool>,
    /// The version SGLang records (and answers in `/model_info`) on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The answer of the weight-update routes (`/begin_weight_update`,
/// `/update_weights_from_tensor`, `/end_weight_update`): `{success, message}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateResponse {
    /// Whether the route did what was asked.
    pub success: bool,
    /// SGLang's message (empty when absent).
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
}

/// SGLang's validation-error answer (`ErrorResponse`): HTTP 400 `{object: "error", message,
/// type, param, code}`; mx reads its `message`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// What is wrong.
    #[serde(default, deserialize_with = "de::text_or_empty")]
    pub message: String,
}

/// The part of `GET /model_info` mx reads: `{weight_version, model_path, ...}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The version SGLang recorded last (`"default"` until an update names one).
    pub weight_version: Option<String>,
    /// The checkpoint it started from (or loaded last from disk).
    #[serde(default, deserialize_with = "de::lenient")]
    pub model_path: Option<String>,
}

/// The part of `GET /server_info` mx reads: `{tp_size, ...}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Tensor-parallel ranks of the server.
    pub tp_size: u32,
}
