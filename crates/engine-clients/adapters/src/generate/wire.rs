//! SGLang's native `POST {system_url}/generate` wire values (served by mx's reference worker
//! too), for both sides.
//!
//! Field names are SGLang's, exactly. Conventions:
//! - Request fields left out (or null) take the engine's defaults, so each is an `Option`
//!   skipped when `None`; `temperature` is written as an integer when integral (`0`). Unknown
//!   fields are ignored; a key given twice is refused.
//! - In the answer, `output_ids` is required (u32 token ids); everything in `meta_info` is
//!   optional and a value of another type reads as absent (`cached_tokens` then counts as 0).
//! - A failure is a non-200 status; mx's worker answers `{"error": {message, code}}`
//!   ([`ErrorResponse`]).

use serde::{Deserialize, Serialize};

use crate::de;

/// Body of `POST /generate`: `{input_ids, sampling_params}` (mx sends token ids, never `text`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<Vec<u32>>,
    /// A text prompt (SGLang's alternative to `input_ids`; engines without a tokenizer refuse
    /// it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<serde_json::Value>,
    /// Sampling parameters; absent: the engine's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_params: Option<SamplingParams>,
}

/// `sampling_params` of a generate request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Most new tokens to generate; absent: the engine's default (SGLang and mx: 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy (the only value mx's worker accepts).
    #[serde(
        default,
        serialize_with = "de::opt_number",
        skip_serializing_if = "Option::is_none"
    )]
    pub temperature: Option<f64>,
    /// Generation stops after the first of these tokens (included in the output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Whether the end-of-sequence token is ignored as a stop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
}

/// The answer of `POST /generate`: `{output_ids, meta_info}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateResponse {
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// What the engine reports about the generation (empty when absent).
    #[serde(default)]
    pub meta_info: MetaInfo,
}

/// `meta_info` of a generate answer; every field optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaInfo {
    /// The weight version that generated the output.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub weight_version: Option<String>,
    /// Prompt length in tokens.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub prompt_tokens: Option<u64>,
    /// Generated tokens.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from the prefix cache.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub cached_tokens: Option<u64>,
    /// Why the generation stopped.
    #[serde(
        default,
        deserialize_with = "de::lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub finish_reason: Option<FinishReason>,
}

/// `meta_info.finish_reason`: `{"type": "length", "length": n}` or `{"type": "stop",
/// "matched": token}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` tokens were generated.
    Length {
        /// How many.
        length: u64,
    },
    /// A stop token was generated.
    Stop {
        /// The token.
        matched: u32,
    },
}

/// mx's worker's failure answer: `{"error": {message, code}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// The failure.
    pub error: ErrorBody,
}

/// The `error` of an [`ErrorResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What failed.
    pub message: String,
    /// The HTTP status, repeated.
    pub code: u16,
}
