//! mx-adapters: clients for the inference engines' weight-update contracts.
//!
//! - [`dynamo`]: the Dynamo vLLM RL listener. Discovery with `GET {base}/v1/rl/workers`
//!   (`protocol_version` must be 1; the worker list is `workers`, or `system_routes` in older
//!   releases; a discovery failure is HTTP 500 `{error: "discovery_failed", message}`), then per
//!   worker `POST {system_url}/engine/{route}` for `pause_generation` (`{mode, clear_cache}`),
//!   `update_weights_from_disk` (`{model_path, weight_version}`), `get_weight_version` and
//!   `resume_generation`; every response is `{status: ok|error, message, version}`.
//! - [`sglang`]: SGLang's fixed routes (no discovery, no version read-back):
//!   `POST {system_url}/engine/control/update_weights_from_disk` with `{model_path,
//!   weight_version, flush_cache, keep_pause}` answering `{success, message,
//!   num_paused_requests}`; `pause_generation` / `continue_generation` (`{torch_empty_cache}`)
//!   exist only where the deployment allowlists them, so their absence is detected and reported
//!   as "the framework must gate generation itself".
//! - [`vllm`]: vLLM's own RL routes on its OpenAI-compatible server (`VLLM_SERVER_DEV_MODE=1`):
//!   `POST /pause`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
//!   `/reset_prefix_cache`, `/resume`, `GET /weight_info` (the read-back), `GET /is_paused`, and
//!   `POST /v1/completions` for generation. Requests and answers are typed serde structs.
//!
//! Every call checks the HTTP status AND the body, and has a deadline: a timeout is a worker
//! failure ([`Error::Timeout`]), never a hang. Field names follow the contracts exactly.
//!
//! Left out: the refit state machine that sequences these calls (mx-control) and the engines.
#![forbid(unsafe_code)]

pub mod dynamo;
pub mod generate;
pub mod sglang;
pub mod vllm;

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Errors of the engine adapters; each names the worker (URL) and route at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The HTTP request could not be sent or its body read.
    #[error("{url}: {source}")]
    Http {
        /// The URL called.
        url: String,
        /// The transport error.
        source: reqwest::Error,
    },
    /// The call did not finish within its deadline (a worker failure).
    #[error("{url}: no answer within {timeout:?}")]
    Timeout {
        /// The URL called.
        url: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The engine answered with a non-success HTTP status.
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        /// The URL called.
        url: String,
        /// HTTP status code.
        status: u16,
        /// The response body (truncated to 512 bytes).
        body: String,
    },
    /// The body is not what the contract specifies.
    #[error("{url}: response does not follow the contract: {reason}")]
    BadResponse {
        /// The URL called.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The engine answered HTTP 200 but reported a failure in the body.
    #[error("{url}: engine reported an error: {message}")]
    Engine {
        /// The URL called.
        url: String,
        /// The engine's message.
        message: String,
    },
    /// Dynamo discovery failed (HTTP 500 `{error: "discovery_failed", message}`).
    #[error("discovery at {url} failed: {message}")]
    DiscoveryFailed {
        /// The discovery URL.
        url: String,
        /// The listener's message.
        message: String,
    },
    /// The listener speaks another protocol version.
    #[error("discovery at {url}: protocol_version {found}, mx speaks 1")]
    Protocol {
        /// The discovery URL.
        url: String,
        /// The version found.
        found: u64,
    },
    /// A discovered worker lacks a route the refit needs.
    #[error("worker {instance} ({endpoint}) does not expose route {route}")]
    MissingRoute {
        /// Worker instance id.
        instance: String,
        /// Worker endpoint.
        endpoint: String,
        /// The missing route.
        route: &'static str,
    },
    /// A route the deployment did not allowlist (SGLang pause/continue).
    #[error("{url}: route {route} is not allowlisted by this deployment: the framework must gate generation itself")]
    RouteNotAllowlisted {
        /// The URL called.
        url: String,
        /// The route.
        route: &'static str,
    },
}

/// Sends `body` as JSON to `url` with a deadline and returns (status, parsed JSON body or
/// `Null`, raw text).
pub(crate) async fn post_json(
    http: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(u16, serde_json::Value, String), Error> {
    send(url, http.post(url).json(body), timeout).await
}

/// GETs `url` with a deadline; as [`post_json`].
pub(crate) async fn get_json(
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(u16, serde_json::Value, String), Error> {
    send(url, http.get(url), timeout).await
}

async fn send(
    url: &str,
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<(u16, serde_json::Value, String), Error> {
    let resp = match tokio::time::timeout(timeout, req.send()).await {
        Err(_) => {
            return Err(Error::Timeout {
                url: url.to_string(),
                timeout,
            })
        }
        Ok(r) => r.map_err(|source| Error::Http {
            url: url.to_string(),
            source,
        })?,
    };
    read_body(url, resp, timeout).await
}

async fn read_body(
    url: &str,
    resp: reqwest::Response,
    timeout: Duration,
) -> Result<(u16, serde_json::Value, String), Error> {
    let status = resp.status().as_u16();
    let text = match tokio::time::timeout(timeout, resp.text()).await {
        Err(_) => {
            return Err(Error::Timeout {
                url: url.to_string(),
                timeout,
            })
        }
        Ok(t) => t.map_err(|source| Error::Http {
            url: url.to_string(),
            source,
        })?,
    };
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    Ok((status, json, text))
}

/// Sends `req` (to `url`) with a deadline and requires HTTP 200 and a body that deserializes as
/// `Resp`: [`Error::Status`] with the body's first 512 bytes otherwise, [`Error::BadResponse`]
/// naming the serde error for a 200 whose body does not follow the contract.
pub(crate) async fn send_typed<Resp: DeserializeOwned>(
    url: &str,
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<Resp, Error> {
    let (status, _, raw) = send(url, req, timeout).await?;
    if status != 200 {
        return Err(Error::Status {
            url: url.to_string(),
            status,
            body: snippet(&raw),
        });
    }
    serde_json::from_str(&raw).map_err(|e| Error::BadResponse {
        url: url.to_string(),
        reason: format!("{e}: {}", snippet(&raw)),
    })
}

/// POSTs `body` as JSON to `url`; as [`send_typed`].
pub(crate) async fn post_typed<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    body: &Req,
    timeout: Duration,
) -> Result<Resp, Error> {
    send_typed(url, http.post(url).json(body), timeout).await
}

/// The first 512 bytes of a body, for error messages.
pub(crate) fn snippet(text: &str) -> String {
    let mut end = text.len().min(512);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The strings of `v[field]` when it is an array (non-strings skipped); empty otherwise.
pub(crate) fn string_list(v: &serde_json::Value, field: &str) -> Vec<String> {
    v.get(field)
        .and_then(serde_json::Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}
