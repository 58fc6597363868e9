//! Client for the Dynamo vLLM RL listener (discovery + per-worker engine routes); the wire
//! values both sides use are in [`wire`].

pub mod wire;

use std::time::Duration;

use serde::Deserialize;

use crate::engine::{mx_model_path, Answer, ApplyAnswer, EngineClient, PauseMode};
use crate::generate::Generation;
use crate::{de, send, snippet, Error};
use mx_layout::ResidentVersion;
use wire::{
    DiscoveryError, EmptyRequest, EngineResponse, PauseRequest, ReplyStatus, UpdateWeightsRequest,
    WorkerInfo, WorkersResponse,
};

/// Routes a worker must expose for mx to refit it.
pub const REQUIRED_ROUTES: [&str; 4] = [
    "pause_generation",
    "update_weights_from_disk",
    "get_weight_version",
    "resume_generation",
];

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
    /// Workers, each checked to expose [`REQUIRED_ROUTES`] and a `system_url`.
    pub workers: Vec<DynamoWorker>,
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
    /// (or the older `system_routes`), and checks that every worker has a `system_url`, no
    /// discovery error and all of [`REQUIRED_ROUTES`].
    ///
    /// # Errors
    /// [`Error::DiscoveryFailed`] (HTTP 500 `discovery_failed`), [`Error::Status`],
    /// [`Error::Protocol`], [`Error::BadResponse`], [`Error::MissingRoute`] naming the worker,
    /// [`Error::Engine`] for a worker that carries an `error`, [`Error::Timeout`].
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
        for w in list {
            let w = DynamoWorker::from(w);
            if let Some(e) = &w.error {
                return Err(Error::Engine {
                    url: url.clone(),
                    message: format!("worker {} ({}): {e}", w.instance_id, w.endpoint),
                });
            }
            for route in REQUIRED_ROUTES {
                if !w.routes.iter().any(|r| r == route) {
                    return Err(Error::MissingRoute {
                        instance: w.instance_id.clone(),
                        endpoint: w.endpoint.clone(),
                        route,
                    });
                }
            }
            if w.system_url.is_none() {
                return Err(Error::BadResponse {
                    url: url.clone(),
                    reason: format!("worker {} has no system_url", w.instance_id),
                });
            }
            workers.push(w);
        }
        Ok(Discovery { namespace, workers })
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
            timeout: self.timeout,
        })
    }
}

/// The engine routes of one Dynamo worker: `POST {system_url}/engine/{route}`.
#[derive(Debug, Clone)]
pub struct DynamoWorkerClient {
    http: reqwest::Client,
    system_url: String,
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
            timeout,
        }
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
            mode: Some(mode),
            clear_cache: Some(clear_cache),
        };
        self.call("pause_generation", &body).await
    }

    /// `update_weights_from_disk` with `{model_path, weight_version}`.
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

    /// `get_weight_version`: the version the engine reports resident.
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`]; [`Error::BadResponse`] when no `version` is returned.
    pub async fn get_weight_version(&self) -> Result<String, Error> {
        let r = self.call("get_weight_version", &EmptyRequest {}).await?;
        r.version.ok_or_else(|| Error::BadResponse {
            url: format!("{}/engine/get_weight_version", self.system_url),
            reason: "no version in the answer".into(),
        })
    }

    /// `resume_generation`.
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`].
    pub async fn resume(&self) -> Result<EngineReply, Error> {
        self.call("resume_generation", &EmptyRequest {}).await
    }
}

/// The refit's calls over the Dynamo routes: pause without clearing caches (the apply clears
/// them), apply as `update_weights_from_disk` of `mx://<hex>`, the read-back as
/// `get_weight_version`, generation over the native `/generate`.
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
        let model_path = mx_model_path(version)?;
        let a = self
            .update_weights_from_disk(&model_path, &version.to_string())
            .await?;
        Ok(ApplyAnswer {
            message: a.message,
            version: a.version.as_deref().map(ResidentVersion::parse),
            cache_tiers_cleared: a.cache_tiers_cleared,
            paused_requests: 0,
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
        crate::generate::generate(
            &self.http,
            &self.system_url,
            prompt,
            max_new_tokens,
            self.timeout,
        )
        .await
    }

    async fn identify(&self) -> Result<crate::identity::Proof, Error> {
        crate::identity::mx_route(&self.http, &self.system_url, self.timeout).await
    }
}
