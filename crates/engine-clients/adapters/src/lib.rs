//! mx-adapters: clients for the inference engines' weight-update contracts.
//!
//! - [`dynamo`]: a Dynamo vLLM worker (ai-dynamo 1.6.1). Discovery with `GET
//!   {listener}/v1/rl/workers` (`protocol_version` must be 1; workers that cannot be refitted
//!   are left out with the reason), then per worker `POST {system_url}/engine/{route}` for
//!   `pause_generation` (`{mode, clear_cache}`), `update_weights_from_distributed` (mx's
//!   `mx_install` rpc), `get_weight_version` and `resume_generation`, every answer HTTP 200
//!   `{status: ok|error, ...}`; generation through the frontend's `/v1/completions` pinned to
//!   the worker.
//! - [`dynamo_sglang`]: a Dynamo SGLang worker's fixed routes (no discovery, no version
//!   read-back: its ranks report what they hold): `POST
//!   {system_url}/engine/control/update_weights_from_tensor` naming the version to mx's loader
//!   (as on SGLang's own server) answering `{success, message}`; `/engine/pause_generation`
//!   (`{mode}`) and `/engine/continue_generation` (`{torch_empty_cache}`) where the deployment
//!   serves them (else reported as "the framework must gate generation itself"); generation
//!   through the frontend pinned to the worker.
//! - [`sglang`]: SGLang's own server: `/pause_generation` with SGLang's modes, the weight-update
//!   session (`/begin_weight_update`, `/update_weights_from_tensor` naming the version to mx's
//!   loader, `/end_weight_update`), `/flush_cache`, `GET /model_info` (the version),
//!   `/continue_generation`, `/generate`.
//! - [`vllm`]: vLLM's own RL routes on its OpenAI-compatible server (`VLLM_SERVER_DEV_MODE=1`):
//!   `POST /pause`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
//!   `/reset_prefix_cache`, `/resume`, `GET /weight_info` (the read-back), `GET /is_paused`, and
//!   `POST /v1/completions` for generation. Requests and answers are typed serde structs.
//!
//! Each contract's requests and answers are typed serde values in its `wire` module
//! ([`dynamo::wire`], [`dynamo_sglang::wire`], [`sglang::wire`], [`generate::wire`],
//! [`vllm::wire`]), shared by every
//! side: these clients, mx's reference worker that serves the Dynamo and Dynamo SGLang routes, and the
//! fake engines of the tests and benchmarks. Field names follow the contracts exactly; each
//! module's docs say which fields are optional and how leniently answers are read.
//!
//! [`EngineClient`] is the one interface a refit needs (pause, apply, read the version back,
//! resume, generate), implemented by every contract's client; [`client_for`] picks it from an
//! [`EngineApi`].
//!
//! Every call checks the HTTP status AND the body, and has a deadline: a timeout is a worker
//! failure ([`Error::Timeout`]), never a hang.
//!
//! Left out: the refit state machine that sequences these calls and judges their answers
//! (mx-control) and the engines.
//!
//! Map: [`engine`] (the one trait a refit speaks, [`engine::EngineClient`], and `PauseMode`) ·
//! [`vllm`] · [`sglang`] · [`dynamo`] · [`dynamo_sglang`] (one client per contract, each with its `wire` types) ·
//! [`generate`] (greedy `/generate`) · `de` (lenient readings of engine answers).
#![forbid(unsafe_code)]

mod de;
pub mod dynamo;
pub mod dynamo_sglang;
pub mod engine;
pub mod generate;
pub mod identity;
pub mod sglang;
pub mod vllm;

pub use engine::{Answer, ApplyAnswer, EngineApi, EngineClient, PauseMode, SglangPause, StepTime};
pub use identity::{incarnation_digest, EngineIdentity, Proof};

use dynamo::DynamoWorkerClient;
use dynamo_sglang::DynamoSglangClient;
use sglang::SglangClient;
use vllm::VllmClient;

/// The client for the engine at `url` (its system server or base URL) speaking `api`, over
/// `http` (shared: connections are kept alive across calls and engines), every call with
/// `timeout` as its deadline; a Dynamo worker (vLLM or SGLang) generates through `frontend`
/// when given (the other kinds ignore it); `ranks`: how many mx workers share the engine (its
/// tensor-parallel ranks: a Dynamo SGLang worker's update carries one entry per rank).
pub fn client_for(
    api: EngineApi,
    http: &reqwest::Client,
    url: &str,
    frontend: Option<&dynamo::Frontend>,
    ranks: usize,
    timeout: Duration,
) -> Box<dyn EngineClient> {
    match api {
        EngineApi::Dynamo => Box::new(
            DynamoWorkerClient::with_client(http.clone(), url, timeout)
                .with_frontend(frontend.cloned()),
        ),
        EngineApi::DynamoSglang => Box::new(
            DynamoSglangClient::with_client(http.clone(), url, timeout)
                .with_frontend(frontend.cloned())
                .with_tp_size(u32::try_from(ranks).unwrap_or(u32::MAX)),
        ),
        EngineApi::Sglang => Box::new(SglangClient::with_client(http.clone(), url, timeout)),
        EngineApi::Vllm => Box::new(VllmClient::with_client(http.clone(), url, timeout)),
    }
}

/// An HTTP client for engine routes that sends `authorization: Bearer <token>` with every
/// request when `token` is set (the engine's API key: vLLM's `--api-key`, SGLang's
/// `--api-key`, `mx worker --http-token-file`), with `TCP_NODELAY`.
///
/// # Errors
/// A message when the token is not a valid header value (not printable ASCII).
pub fn http_client(token: Option<&str>) -> Result<reqwest::Client, String> {
    http_client_with(token, None)
}

/// The header carrying the control-plane leader's epoch on every engine call (a decimal `u64`):
/// an engine that has seen a higher one refuses the call (409), so a deposed leader cannot
/// pause, apply or resume anything (mx-control's `ha` module).
pub const EPOCH_HEADER: &str = "x-mx-epoch";

/// The header carrying the id of the refit an engine call belongs to (a decimal `u64`). mx's
/// engine routes remember the highest one and report it when their worker registers, so a
/// control plane whose journal lost that refit learns it from the fleet (mx-control's
/// `testimony` module).
pub const REFIT_HEADER: &str = "x-mx-refit";

tokio::task_local! {
    /// The refit whose engine calls the current task makes: every request sent inside
    /// [`for_refit`] carries it in [`REFIT_HEADER`].
    static REFIT: u64;
}

/// Runs `calls` (engine calls of refit `id`) so that each request carries [`REFIT_HEADER`].
pub async fn for_refit<F: std::future::Future>(id: u64, calls: F) -> F::Output {
    REFIT.scope(id, calls).await
}

/// [`http_client`] that also sends `epoch` in [`EPOCH_HEADER`] on every request.
///
/// # Errors
/// As [`http_client`].
pub fn http_client_with(
    token: Option<&str>,
    epoch: Option<u64>,
) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder().tcp_nodelay(true);
    let mut h = reqwest::header::HeaderMap::new();
    if let Some(t) = token {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", t.trim()))
            .map_err(|_| "engine token: not printable ASCII".to_string())?;
        v.set_sensitive(true);
        h.insert(reqwest::header::AUTHORIZATION, v);
    }
    if let Some(e) = epoch {
        h.insert(EPOCH_HEADER, reqwest::header::HeaderValue::from(e));
    }
    b = b.default_headers(h);
    b.build().map_err(|e| format!("HTTP client: {e}"))
}

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
    /// APPLY was asked for a version the contract cannot install; nothing was sent.
    #[error("{version:?} cannot be applied: {reason}")]
    Unappliable {
        /// The version asked for.
        version: String,
        /// Why not.
        reason: &'static str,
    },
    /// A step of a multi-call APPLY (vLLM's weight-update session) failed; the steps before it
    /// succeeded and the ones after it were not sent.
    #[error("{step}{}: {source}", installed_note(.installed))]
    ApplyStep {
        /// The route that failed, e.g. `update_weights`.
        step: &'static str,
        /// The version whose weights the steps before had already installed, if they had.
        installed: Option<String>,
        /// The step's error.
        source: Box<Error>,
    },
    /// The engine reports no weight version where one is needed (vLLM's `GET /weight_info`
    /// answering `weight_version: null`).
    #[error("{url}: engine reports no weight version (weight_version: null)")]
    NoVersion {
        /// The URL called.
        url: String,
    },
    /// What the engine's contract cannot do (e.g. a `wait` pause on SGLang); nothing was sent.
    #[error("the engine's contract has no {what}")]
    Unsupported {
        /// What was asked, and what the contract offers instead.
        what: String,
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

/// `" (the weights of V are installed)"` when `installed` names V.
fn installed_note(installed: &Option<String>) -> String {
    installed
        .as_ref()
        .map(|v| format!(" (the weights of {v} are installed)"))
        .unwrap_or_default()
}

/// Sends `req` (to `url`) with a deadline and returns the HTTP status and the body's text.
pub(crate) async fn send(
    url: &str,
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<(u16, String), Error> {
    let req = match REFIT.try_with(|id| *id) {
        Ok(id) => req.header(REFIT_HEADER, id),
        Err(_) => req,
    };
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
    Ok((status, text))
}

/// Sends `req` (to `url`) with a deadline and requires HTTP 200 and a body that deserializes as
/// `Resp`: [`Error::Status`] with the body's first 512 bytes otherwise, [`Error::BadResponse`]
/// naming the serde error for a 200 whose body does not follow the contract.
pub(crate) async fn send_typed<Resp: DeserializeOwned>(
    url: &str,
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<Resp, Error> {
    let (status, raw) = send(url, req, timeout).await?;
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
