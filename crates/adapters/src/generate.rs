//! Greedy generation over SGLang's native `POST {system_url}/generate` (the route mx's reference
//! worker serves too): `{input_ids, sampling_params: {max_new_tokens, temperature: 0}}` answers
//! `{output_ids, meta_info: {...}}`.

use std::time::Duration;

use serde_json::{json, Value};

use crate::{post_json, snippet, Error};

/// The answer of one generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// `meta_info.weight_version`, when the engine reports it.
    pub weight_version: Option<String>,
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
    let body = json!({
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    });
    let (status, json, raw) = post_json(http, &url, &body, timeout).await?;
    if status != 200 {
        return Err(Error::Status {
            url,
            status,
            body: snippet(&raw),
        });
    }
    let bad = |reason: String| Error::BadResponse {
        url: url.clone(),
        reason,
    };
    let ids = json
        .get("output_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(format!("no output_ids: {}", snippet(&raw))))?;
    let output_ids = ids
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(format!("output_ids[{i}] = {v} is not a token id")))
        })
        .collect::<Result<Vec<u32>, Error>>()?;
    let meta = json.get("meta_info");
    Ok(Generation {
        output_ids,
        weight_version: meta
            .and_then(|m| m.get("weight_version"))
            .and_then(Value::as_str)
            .map(str::to_string),
        cached_tokens: meta
            .and_then(|m| m.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}
