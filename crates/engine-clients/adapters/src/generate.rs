//! Greedy generation over SGLang's native `POST {system_url}/generate` (the route mx's reference
//! worker serves too): `{input_ids, sampling_params: {max_new_tokens, temperature: 0}}` answers
//! `{output_ids, meta_info: {...}}`; the wire values both sides use are in [`wire`].

pub mod wire;

use std::time::Duration;

use crate::{post_typed, Error};
use wire::{GenerateRequest, GenerateResponse, SamplingParams};

/// The answer of one generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// `meta_info.weight_version`, when the engine reports it.
    pub weight_version: Option<mx_layout::ResidentVersion>,
    /// `meta_info.cached_tokens`: prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
}

/// Greedy decoding of `max_new_tokens` after `input_ids` on the engine at `system_url`.
///
/// # Errors
/// [`Error::Status`] for a non-200 answer, [`Error::BadResponse`] when `output_ids` is missing or
/// holds something other than u32 token ids, [`Error::Timeout`], [`Error::Http`].
pub async fn generate(
    http: &reqwest::Client,
    system_url: &str,
    input_ids: &[u32],
    max_new_tokens: u32,
    timeout: Duration,
) -> Result<Generation, Error> {
    let url = format!("{}/generate", system_url.trim_end_matches('/'));
    let body = GenerateRequest {
        input_ids: Some(input_ids.to_vec()),
        text: None,
        sampling_params: Some(SamplingParams {
            max_new_tokens: Some(u64::from(max_new_tokens)),
            temperature: Some(0.0),
            ..SamplingParams::default()
        }),
    };
    let r: GenerateResponse = post_typed(http, &url, &body, timeout).await?;
    Ok(Generation {
        output_ids: r.output_ids,
        weight_version: r
            .meta_info
            .weight_version
            .as_deref()
            .map(mx_layout::ResidentVersion::parse),
        cached_tokens: r.meta_info.cached_tokens.unwrap_or(0),
    })
}
