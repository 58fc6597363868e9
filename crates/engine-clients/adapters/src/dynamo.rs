//! Client for a Dynamo vLLM worker: discovery through the frontend's RL listener, the worker's
//! engine routes on its system server, and generation through the frontend pinned to the worker.
//! The wire values both sides use are in [`wire`].
//!
//! The contract, read from ai-dynamo 1.6.1 (`dynamo/vllm/handlers.py`, `worker_factory.py`,
//! `dynamo/common/rl/admin.py`; the listener is compiled into `dynamo/_core.abi3.so`) and checked
//! against a running frontend and worker (docs/notes/issue32-plan.md, "Live probe"):
//!
//! - `GET {listener}/v1/rl/workers` (the frontend with `DYN_ENABLE_RL=true`, on `DYN_RL_PORT`):
//!   200 `{"protocol_version": 1, "namespace": "dynamo", "workers": [{"namespace", "component",
//!   "endpoint", "instance_id": u64, "transport": {"tcp": "..."}, "request_plane_url",
//!   "system_url", "model", "routes": [12 names, sorted], "world_size"}]}`. Only workers started
//!   with `--enable-rl` are listed; a worker whose probe failed is listed with `"routes": []`
//!   and `"error"`; a worker whose process died is no longer listed. A failed discovery is 500
//!   `{"error": "discovery_failed", "message"}`.
//! - `POST {system_url}/engine/<route>` with a JSON object (answers carry `content-type:
//!   text/plain` but are JSON). Every route answers **HTTP 200** with `{"status": "ok", ...}` or
//!   `{"status": "error", "message"}`; a body that is not JSON is 400 `{"error": "Invalid JSON",
//!   "message"}`, an unknown route 404 `{"error": "Route not found", "message"}`, a handler that
//!   raised 500 `{"error": "Handler error", "message"}`.
//!   - `pause_generation {"mode": "keep"|"wait"|"abort", "clear_cache": bool}` (defaults `keep`,
//!     `false`): `{"status": "ok", "message": "Engine paused", "mode", "clear_cache"}`.
//!     Idempotent. A paused worker stays in the frontend's routing (requests sent to it wait).
//!     `abort` ends in-flight requests with a normal-looking `finish_reason: "stop"`.
//!   - `update_weights_from_distributed` (any object; Dynamo strips `engine_rpc` (default
//!     `update_weights_from_path`), `weight_version`, `reset_prefix_cache` (default true) and
//!     `allow_unpaused` (default false), then calls vLLM's `collective_rpc(engine_rpc,
//!     kwargs=<the rest>)` and resets the prefix cache): `{"status": "ok", "version": V,
//!     "version_declared": true}`; refused unless paused ("Worker must be paused via
//!     pause_generation() before updating weights. ..."); a raising rpc is `{"status": "error",
//!     "message": "Call to collective_rpc method failed: ..."}`.
//!   - `update_weights_from_disk {"model_path", "weight_version"}`: vLLM's `reload_weights`
//!     from a directory; the same answers. After a failed load the weights are undefined (meta
//!     tensors) while `get_weight_version` and `liveness_probe` still answer as before, and the
//!     first generation after a resume kills the engine: a failed install must be followed by
//!     a good one before the worker resumes.
//!   - `get_weight_version {}`: `{"status": "ok", "version": V|null, "version_declared": bool}`;
//!     `null` / `false` before any declared update.
//!   - `resume_generation {}`: `{"status": "ok", "message": "Engine resumed"}` (also when not
//!     paused).
//!   - also `liveness_probe`, `flush_cache`, `abort_request`, `set_weight_version`,
//!     `init_weights_update_group` (`{"engine_rpc", ...kwargs}` → `collective_rpc`; the worker
//!     exits when it takes over `DYN_RL_INIT_WEIGHTS_TIMEOUT_S`, default 30 s),
//!     `destroy_weights_update_group`, `update_weights_from_tensor` (always an error).
//! - `POST {frontend}/v1/completions` with `"nvext": {"backend_instance_id": <instance_id>,
//!   "extra_fields": ["engine_data"]}`: served by that worker (an unknown id is HTTP 400); the
//!   answer's top-level `nvext.engine_data.completion_token_ids` holds the token ids (a Dynamo
//!   SGLang worker's does not: with `"logprobs": 1, "return_tokens_as_token_ids": true` the
//!   first choice's `logprobs.tokens` spell them `"token_id:<id>"`, [`generate_pinned`]).
//!
//! How mx installs: the worker's vLLM runs mx's weight-transfer backend (`--weight-transfer-config
//! '{"backend": "mx"}'`), initialized through `init_weights_update_group` with `engine_rpc:
//! "init_weight_transfer_engine"` (`mx.dynamo.attach`). Each rank stages versions through its
//! own puller while the worker generates; APPLY is `update_weights_from_distributed` with
//! `engine_rpc: "mx_install"` ([`wire::MX_INSTALL_RPC`]): one `collective_rpc` in which every
//! rank installs the staged bytes (vLLM's layerwise reload, as the vLLM kind) and, on failure,
//! restores the previous version before answering. No checkpoint is written, no bytes cross
//! HTTP.

pub mod wire;

use std::time::Duration;

use serde::Deserialize;

use crate::engine::{Answer, ApplyAnswer, EngineClient, PauseMode};
use crate::generate::Generation;
use crate::{de, send, snippet, Error};
use mx_layout::ResidentVersion;
use wire::{
    CompletionRequest, CompletionResponse, DiscoveryError, EmptyRequest, EngineResponse,
    NvextRequest, PauseRequest, ReplyStatus, UpdateFromDistributedRequest, UpdateWeightsRequest,
    WorkerInfo, WorkersResponse, MX_INSTALL_RPC,
};

/// Routes a worker must expose for mx to refit it.
pub const REQUIRED_ROUTES: [&str; 4] = [
    "pause_generation",
    "update_weights_from_distributed",
    "get_weight_version",
    "resume_generation",
];

/// Where a Dynamo worker's generation goes: the frontend's `POST {url}/v1/completions` for
/// `model`, pinned to the worker by `nvext.backend_instance_id`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Frontend {
    /// The frontend's HTTP base URL (its `--http-port`), e.g. `http://127.0.0.1:8000`.
    pub url: String,
    /// The served model name (`--served-model-name`).
    pub model: String,
    /// The worker's `instance_id` as `/v1/rl/workers` lists it.
    pub instance_id: u64,
}

/// One worker as `GET /v1/rl/workers` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoWorker {
    /// Dynamo namespace.
    pub namespace: String,
    /// Component name.
    pub component: String,
    /// Endpoint name.
    pub endpoint: String,
    /// Instance id (numbers are kept as their decimal text).
    pub instance_id: String,
    /// Request-plane transport.
    pub transport: String,
    /// Request-plane URL.
    pub request_plane_url: String,
    /// Base URL of the worker's system server (the engine routes live under it).
    pub system_url: Option<String>,
    /// Admin base URL, when the listener reports one.
    pub admin_base_url: Option<String>,
    /// Served model, when reported.
    pub model: Option<String>,
    /// Engine routes the worker exposes.
    pub routes: Vec<String>,
    /// The engine's world size, when reported.
    pub world_size: Option<u64>,
    /// A per-worker discovery error, when the listener could not describe it fully.
    pub error: Option<String>,
}

/// The answer of `GET /v1/rl/workers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    /// The listener's namespace.
    pub namespace: String,
    /// Workers that can be refitted: each exposes [`REQUIRED_ROUTES`] and a `system_url`, and
    /// carries no discovery error.
    pub workers: Vec<DynamoWorker>,
    /// Workers left out, each with the reason (a discovery error, a missing route, no
    /// `system_url`), in listing order.
    pub left_out: Vec<(DynamoWorker, String)>,
}

/// Why `w` cannot be refitted, or `None` when it can.
fn unrefittable(w: &DynamoWorker) -> Option<String> {
    if let Some(e) = &w.error {
        return Some(format!("the listener reports an error: {e}"));
    }
    let missing: Vec<&str> = REQUIRED_ROUTES
        .into_iter()
        .filter(|route| !w.routes.iter().any(|r| r == route))
        .collect();
    if !missing.is_empty() {
        return Some(format!(
            "it does not expose route(s) {}",
            missing.join(", ")
        ));
    }
    if w.system_url.is_none() {
        return Some("it has no system_url".into());
    }
    None
}

/// A successful `{status: "ok", message, version}` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineReply {
    /// The engine's message.
    pub message: String,
    /// The weight version it reports, when it reports one.
    pub version: Option<String>,
    /// Cache tiers the engine says it cleared (`cache_tiers_cleared`, an mx extension; empty
    /// when the engine does not report them).
    pub cache_tiers_cleared: Vec<String>,
}

impl From<WorkerInfo> for DynamoWorker {
    fn from(w: WorkerInfo) -> DynamoWorker {
        DynamoWorker {
            namespace: w.namespace,
            component: w.component,
            endpoint: w.endpoint,
            instance_id: w.instance_id.to_string(),
            transport: w.transport,
            request_plane_url: w.request_plane_url,
            system_url: w.system_url,
            admin_base_url: w.admin_base_url,
            model: w.model,
            routes: w.routes,
            world_size: w.world_size,
            error: w.error,
        }
    }
}

/// The part of a discovery answer read first: which protocol it speaks.
#[derive(Deserialize)]
struct ProtocolHeader {
    #[serde(default, deserialize_with = "de::lenient")]
    protocol_version: Option<u64>,
}

/// `raw` as a `T`, or [`Error::BadResponse`] naming the serde error and the body.
fn parse<T: serde::de::DeserializeOwned>(url: &str, raw: &str) -> Result<T, Error> {
    serde_json::from_str(raw).map_err(|e| Error::BadResponse {
        url: url.to_string(),
        reason: format!("{e}: {}", snippet(raw)),
    })
}

/// Discovery client for one Dynamo RL listener.
#[derive(Debug, Clone)]
pub struct DynamoClient {
    http: reqwest::Client,
    base_url: String,
    timeout: Duration,
}

impl DynamoClient {
    /// A client for the listener at `base_url` (e.g. `http://127.0.0.1:8000`); every call has
    /// `timeout` as its deadline.
    pub fn new(base_url: &str, timeout: Duration) -> DynamoClient {
        DynamoClient::with_client(reqwest::Client::new(), base_url, timeout)
    }

    /// [`new`](Self::new) over `http` (e.g. [`crate::http_client`] with an engine token).
    pub fn with_client(http: reqwest::Client, base_url: &str, timeout: Duration) -> DynamoClient {
        DynamoClient {
            http,
            base_url: base_url.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    /// `GET {base}/v1/rl/workers`: requires `protocol_version` 1, accepts the list as `workers`
    /// (or the older `system_routes`), and sorts the workers into those that can be refitted (a
    /// `system_url`, no discovery error, all of [`REQUIRED_ROUTES`]) and those left out, with
    /// the reason: one bad worker does not fail the others' discovery.
    ///
    /// # Errors
    /// [`Error::DiscoveryFailed`] (HTTP 500 `discovery_failed`), [`Error::Status`],
    /// [`Error::Protocol`], [`Error::BadResponse`] (a body off the contract), [`Error::Timeout`].
    pub async fn discover(&self) -> Result<Discovery, Error> {
        let url = format!("{}/v1/rl/workers", self.base_url);
        let (status, raw) = send(&url, self.http.get(&url), self.timeout).await?;
        if status == 500 {
            if let Ok(e) = serde_json::from_str::<DiscoveryError>(&raw) {
                if e.error == DiscoveryError::DISCOVERY_FAILED {
                    return Err(Error::DiscoveryFailed {
                        url,
                        message: e.message,
                    });
                }
            }
        }
        if status != 200 {
            return Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            });
        }
        let header: ProtocolHeader = parse(&url, &raw)?;
        match header.protocol_version {
            Some(1) => {}
            Some(found) => return Err(Error::Protocol { url, found }),
            None => {
                return Err(Error::BadResponse {
                    url,
                    reason: "no protocol_version".into(),
                })
            }
        }
        let body: WorkersResponse = parse(&url, &raw)?;
        let namespace = body.namespace.clone();
        let list = body.into_workers().ok_or_else(|| Error::BadResponse {
            url: url.clone(),
            reason: "no workers list (workers or system_routes)".into(),
        })?;
        let mut workers = Vec::with_capacity(list.len());
        let mut left_out = Vec::new();
        for w in list {
            let w = DynamoWorker::from(w);
            match unrefittable(&w) {
                Some(why) => left_out.push((w, why)),
                None => workers.push(w),
            }
        }
        Ok(Discovery {
            namespace,
            workers,
            left_out,
        })
    }

    /// A client for one discovered worker's engine routes.
    ///
    /// # Errors
    /// [`Error::BadResponse`] when the worker has no `system_url`.
    pub fn worker(&self, w: &DynamoWorker) -> Result<DynamoWorkerClient, Error> {
        let system_url = w.system_url.clone().ok_or_else(|| Error::BadResponse {
            url: self.base_url.clone(),
            reason: format!("worker {} has no system_url", w.instance_id),
        })?;
        Ok(DynamoWorkerClient {
            http: self.http.clone(),
            system_url: system_url.trim_end_matches('/').to_string(),
            frontend: None,
            timeout: self.timeout,
        })
    }
}

/// The engine routes of one Dynamo worker: `POST {system_url}/engine/{route}`, and its
/// generation through the frontend when one is set ([`DynamoWorkerClient::with_frontend`]).
#[derive(Debug, Clone)]
pub struct DynamoWorkerClient {
    http: reqwest::Client,
    system_url: String,
    frontend: Option<Frontend>,
    timeout: Duration,
}

impl DynamoWorkerClient {
    /// A client for the worker whose system server is at `system_url`.
    pub fn new(system_url: &str, timeout: Duration) -> DynamoWorkerClient {
        DynamoWorkerClient::with_client(reqwest::Client::new(), system_url, timeout)
    }

    /// As [`DynamoWorkerClient::new`], sharing `http` (and its pool of kept-alive connections)
    /// with other clients: a control plane calling a thousand workers opens connections once,
    /// not once per call.
    pub fn with_client(
        http: reqwest::Client,
        system_url: &str,
        timeout: Duration,
    ) -> DynamoWorkerClient {
        DynamoWorkerClient {
            http,
            system_url: system_url.trim_end_matches('/').to_string(),
            frontend: None,
            timeout,
        }
    }

    /// This client generating through `frontend` (a real Dynamo worker has no generation route
    /// on its system server); without one, generation goes to `{system_url}/generate` (mx's
    /// reference worker).
    pub fn with_frontend(mut self, frontend: Option<Frontend>) -> DynamoWorkerClient {
        self.frontend = frontend.map(|f| Frontend {
            url: f.url.trim_end_matches('/').to_string(),
            ..f
        });
        self
    }

    /// The worker's system server base URL.
    pub fn system_url(&self) -> &str {
        &self.system_url
    }

    /// `POST {system_url}/engine/{route}` with `body`; HTTP 200 AND `status: "ok"` required.
    async fn call<Req: serde::Serialize>(
        &self,
        route: &str,
        body: &Req,
    ) -> Result<EngineReply, Error> {
        let url = format!("{}/engine/{route}", self.system_url);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        let answer = serde_json::from_str::<EngineResponse>(&raw);
        if status != 200 {
            return Err(match answer {
                Ok(EngineResponse {
                    status: ReplyStatus::Error,
                    message,
                    ..
                }) => Error::Engine {
                    url,
                    message: format!("HTTP {status}: {message}"),
                },
                _ => Error::Status {
                    url,
                    status,
                    body: snippet(&raw),
                },
            });
        }
        let a = answer.map_err(|e| Error::BadResponse {
            url: url.clone(),
            reason: format!("{e}: {}", snippet(&raw)),
        })?;
        match a.status {
            ReplyStatus::Ok => Ok(EngineReply {
                message: a.message,
                version: a.version,
                cache_tiers_cleared: a.cache_tiers_cleared.unwrap_or_default(),
            }),
            ReplyStatus::Error => Err(Error::Engine {
                url,
                message: a.message,
            }),
        }
    }

    /// `pause_generation` with `{mode, clear_cache}`.
    ///
    /// # Errors
    /// As every route: [`Error::Status`] (or [`Error::Engine`] when a non-200 body says
    /// `status: "error"`), [`Error::Engine`] for `status: "error"`, [`Error::BadResponse`],
    /// [`Error::Timeout`], [`Error::Http`].
    pub async fn pause(&self, mode: PauseMode, clear_cache: bool) -> Result<EngineReply, Error> {
        let body = PauseRequest {
            mode: Some(mode.keep_wait_abort()),
            clear_cache: Some(clear_cache),
        };
        self.call("pause_generation", &body).await
    }

    /// `update_weights_from_disk` with `{model_path, weight_version}`: vLLM reloads the
    /// checkpoint directory `model_path` (the worker must be paused).
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`].
    pub async fn update_weights_from_disk(
        &self,
        model_path: &str,
        weight_version: &str,
    ) -> Result<EngineReply, Error> {
        let body = UpdateWeightsRequest {
            model_path: Some(model_path.to_string()),
            weight_version: Some(weight_version.to_string()),
        };
        self.call("update_weights_from_disk", &body).await
    }

    /// `update_weights_from_distributed` with `{"engine_rpc": "mx_install", "version_id": V,
    /// "weight_version": V, "reset_prefix_cache": true}`: every rank's mx backend installs `V`
    /// (staged, or resident or retained already) and the worker records `V` and resets its
    /// prefix cache (the worker must be paused).
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`] (an install that failed, after the backend restored the
    /// previous version, is [`Error::Engine`] with vLLM's message).
    pub async fn mx_install(&self, version: &str) -> Result<EngineReply, Error> {
        let body = UpdateFromDistributedRequest {
            engine_rpc: Some(MX_INSTALL_RPC.into()),
            weight_version: Some(version.into()),
            reset_prefix_cache: Some(true),
            version_id: Some(version.into()),
        };
        self.call("update_weights_from_distributed", &body).await
    }

    /// `get_weight_version`: the version the engine reports resident.
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`]; [`Error::NoVersion`] when the worker reports none
    /// (`"version": null`, Dynamo's answer before any declared update).
    pub async fn get_weight_version(&self) -> Result<String, Error> {
        let r = self.call("get_weight_version", &EmptyRequest {}).await?;
        r.version.ok_or_else(|| Error::NoVersion {
            url: format!("{}/engine/get_weight_version", self.system_url),
        })
    }

    /// Greedy decoding of `max_tokens` after `prompt` on this worker, through the frontend
    /// ([`generate_pinned`]).
    ///
    /// # Errors
    /// As [`generate_pinned`].
    pub async fn generate_through(
        &self,
        frontend: &Frontend,
        prompt: &[u32],
        max_tokens: u32,
    ) -> Result<Generation, Error> {
        generate_pinned(
            &self.http,
            frontend,
            prompt,
            max_tokens,
            false,
            self.timeout,
        )
        .await
    }

    /// `resume_generation`.
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`].
    pub async fn resume(&self) -> Result<EngineReply, Error> {
        self.call("resume_generation", &EmptyRequest {}).await
    }
}

/// How long [`generate_pinned`] waits before asking a frontend that answered "not ready" again.
const NOT_READY_RETRY: Duration = Duration::from_millis(200);

/// Greedy decoding of `max_tokens` after `prompt` on one Dynamo worker, through its frontend:
/// `POST {frontend}/v1/completions` pinned by `nvext.backend_instance_id`, asking for
/// `engine_data` and, with `logprobs`, for `logprobs: 1` with `return_tokens_as_token_ids`; the
/// token ids are `nvext.engine_data.completion_token_ids` (Dynamo's vLLM worker) or else the
/// first choice's `logprobs.tokens` (its SGLang worker reports no token ids in `engine_data`:
/// ask with `logprobs`), see [`CompletionResponse::token_ids`].
///
/// # Errors
/// [`Error::Status`] for a non-200 answer (400 for an instance the frontend does not know, 503
/// when the engine died; a 503 "not ready", the frontend re-listing a worker that just resumed,
/// is asked again until `timeout`), [`Error::BadResponse`] when the answer carries no token ids,
/// [`Error::Timeout`], [`Error::Http`].
pub async fn generate_pinned(
    http: &reqwest::Client,
    frontend: &Frontend,
    prompt: &[u32],
    max_tokens: u32,
    logprobs: bool,
    timeout: Duration,
) -> Result<Generation, Error> {
    let url = format!("{}/v1/completions", frontend.url);
    let body = CompletionRequest {
        model: frontend.model.clone(),
        prompt: prompt.to_vec(),
        max_tokens,
        temperature: 0.0,
        ignore_eos: Some(true),
        logprobs: logprobs.then_some(1),
        return_tokens_as_token_ids: logprobs.then_some(true),
        nvext: NvextRequest {
            backend_instance_id: frontend.instance_id,
            extra_fields: vec!["engine_data".into()],
        },
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let r: CompletionResponse = loop {
        match crate::post_typed(http, &url, &body, timeout).await {
            // The frontend unlists a worker while it is paused and lists it again once its
            // discovery sees it resumed; in between it answers 503 "... is not ready to serve
            // requests yet" (seen with Dynamo 1.6.1's SGLang worker right after a refit's
            // resume). The worker is there a moment later: ask again until the deadline.
            Err(Error::Status {
                status: 503,
                body: ref b,
                ..
            }) if b.contains("not ready")
                && tokio::time::Instant::now() + NOT_READY_RETRY < deadline =>
            {
                tokio::time::sleep(NOT_READY_RETRY).await;
            }
            r => break r?,
        }
    };
    let output_ids = r
        .token_ids()
        .map_err(|reason| Error::BadResponse { url, reason })?;
    Ok(Generation {
        output_ids,
        weight_version: None,
        cached_tokens: 0,
    })
}

/// The refit's calls over the Dynamo routes: pause without clearing caches (the apply resets
/// the prefix cache), apply as [`DynamoWorkerClient::mx_install`], the read-back as
/// `get_weight_version`, generation through the frontend (or the reference worker's
/// `/generate` when no frontend is set).
#[async_trait::async_trait]
impl EngineClient for DynamoWorkerClient {
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error> {
        let a = DynamoWorkerClient::pause(self, mode, false).await?;
        Ok(Answer {
            message: a.message,
            version: a.version.as_deref().map(ResidentVersion::parse),
        })
    }

    async fn apply(&self, version: &ResidentVersion) -> Result<ApplyAnswer, Error> {
        let a = self.mx_install(&version.to_string()).await?;
        let mut cache_tiers_cleared = a.cache_tiers_cleared;
        if cache_tiers_cleared.is_empty() {
            // The route resets vLLM's prefix cache after the install (reset_prefix_cache: true).
            cache_tiers_cleared.push("prefix_cache".into());
        }
        Ok(ApplyAnswer {
            message: a.message,
            version: a.version.as_deref().map(ResidentVersion::parse),
            cache_tiers_cleared,
            paused_requests: 0,
            steps: Vec::new(),
        })
    }

    async fn read_version(&self) -> Result<Answer, Error> {
        Ok(Answer {
            message: String::new(),
            version: Some(ResidentVersion::parse(&self.get_weight_version().await?)),
        })
    }

    async fn resume(&self) -> Result<Answer, Error> {
        let a = DynamoWorkerClient::resume(self).await?;
        Ok(Answer {
            message: a.message,
            version: a.version.as_deref().map(ResidentVersion::parse),
        })
    }

    async fn generate(&self, prompt: &[u32], max_new_tokens: u32) -> Result<Generation, Error> {
        match &self.frontend {
            Some(f) => self.generate_through(f, prompt, max_new_tokens).await,
            None => {
                crate::generate::generate(
                    &self.http,
                    &self.system_url,
                    prompt,
                    max_new_tokens,
                    self.timeout,
                )
                .await
            }
        }
    }

    async fn identify(&self) -> Result<crate::identity::Proof, Error> {
        crate::identity::mx_route(&self.http, &self.system_url, self.timeout).await
    }
}
