//! Client for the Dynamo vLLM RL listener (discovery + per-worker engine routes).

use std::time::Duration;

use serde_json::{json, Value};

use crate::{get_json, post_json, snippet, Error};

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

/// `pause_generation` modes: what happens to in-flight requests (Dynamo's spelling; the one
/// type mx uses for it, in the control plane, the journal and the reference worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Keep them paused in place and resume them after.
    Keep,
    /// Wait for them to finish.
    #[default]
    Wait,
    /// Abort them.
    Abort,
}

impl std::str::FromStr for PauseMode {
    type Err = String;

    /// Dynamo's `keep`, `wait`, `abort`, and SGLang's `in_place` / `retract` (both hold the
    /// request: `keep`).
    fn from_str(s: &str) -> Result<PauseMode, String> {
        match s {
            "keep" | "in_place" | "retract" => Ok(PauseMode::Keep),
            "wait" => Ok(PauseMode::Wait),
            "abort" => Ok(PauseMode::Abort),
            other => Err(format!("{other:?} is not one of keep, wait, abort")),
        }
    }
}

impl PauseMode {
    /// The contract's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Keep => "keep",
            PauseMode::Wait => "wait",
            PauseMode::Abort => "abort",
        }
    }
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

fn text(v: &Value, field: &str) -> Option<String> {
    match v.get(field)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn parse_worker(url: &str, v: &Value) -> Result<DynamoWorker, Error> {
    let need = |field: &str| {
        text(v, field).ok_or_else(|| Error::BadResponse {
            url: url.to_string(),
            reason: format!("a worker lacks field {field}: {}", snippet(&v.to_string())),
        })
    };
    let routes = v
        .get("routes")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|r| match r {
                    Value::String(s) => Some(s.clone()),
                    other => text(other, "name").or_else(|| text(other, "route")),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(DynamoWorker {
        namespace: need("namespace")?,
        component: need("component")?,
        endpoint: need("endpoint")?,
        instance_id: need("instance_id")?,
        transport: need("transport")?,
        request_plane_url: need("request_plane_url")?,
        system_url: text(v, "system_url"),
        admin_base_url: text(v, "admin_base_url"),
        model: text(v, "model"),
        routes,
        world_size: v.get("world_size").and_then(Value::as_u64),
        error: text(v, "error"),
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
        DynamoClient {
            http: reqwest::Client::new(),
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
        let (status, body, raw) = get_json(&self.http, &url, self.timeout).await?;
        if status == 500 && body.get("error").and_then(Value::as_str) == Some("discovery_failed") {
            return Err(Error::DiscoveryFailed {
                url,
                message: text(&body, "message").unwrap_or_default(),
            });
        }
        if status != 200 {
            return Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            });
        }
        let version = body.get("protocol_version").and_then(Value::as_u64);
        match version {
            Some(1) => {}
            Some(found) => return Err(Error::Protocol { url, found }),
            None => {
                return Err(Error::BadResponse {
                    url,
                    reason: "no protocol_version".into(),
                })
            }
        }
        let list = body
            .get("workers")
            .or_else(|| body.get("system_routes"))
            .and_then(Value::as_array)
            .ok_or_else(|| Error::BadResponse {
                url: url.clone(),
                reason: "no workers list (workers or system_routes)".into(),
            })?;
        let mut workers = Vec::with_capacity(list.len());
        for w in list {
            let w = parse_worker(&url, w)?;
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
        Ok(Discovery {
            namespace: text(&body, "namespace").unwrap_or_default(),
            workers,
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

    async fn call(&self, route: &str, body: Value) -> Result<EngineReply, Error> {
        let url = format!("{}/engine/{route}", self.system_url);
        let (status, json, raw) = post_json(&self.http, &url, &body, self.timeout).await?;
        let st = json.get("status").and_then(Value::as_str);
        if status != 200 {
            return Err(match st {
                Some("error") => Error::Engine {
                    url,
                    message: format!(
                        "HTTP {status}: {}",
                        text(&json, "message").unwrap_or_default()
                    ),
                },
                _ => Error::Status {
                    url,
                    status,
                    body: snippet(&raw),
                },
            });
        }
        match st {
            Some("ok") => Ok(EngineReply {
                message: text(&json, "message").unwrap_or_default(),
                version: text(&json, "version"),
                cache_tiers_cleared: crate::string_list(&json, "cache_tiers_cleared"),
            }),
            Some("error") => Err(Error::Engine {
                url,
                message: text(&json, "message").unwrap_or_default(),
            }),
            _ => Err(Error::BadResponse {
                url,
                reason: format!("status must be \"ok\" or \"error\": {}", snippet(&raw)),
            }),
        }
    }

    /// `pause_generation` with `{mode, clear_cache}`.
    ///
    /// # Errors
    /// As every route: [`Error::Status`], [`Error::Engine`], [`Error::BadResponse`],
    /// [`Error::Timeout`], [`Error::Http`].
    pub async fn pause(&self, mode: PauseMode, clear_cache: bool) -> Result<EngineReply, Error> {
        self.call(
            "pause_generation",
            json!({"mode": mode.as_str(), "clear_cache": clear_cache}),
        )
        .await
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
        self.call(
            "update_weights_from_disk",
            json!({"model_path": model_path, "weight_version": weight_version}),
        )
        .await
    }

    /// `get_weight_version`: the version the engine reports resident.
    ///
    /// # Errors
    /// As [`DynamoWorkerClient::pause`]; [`Error::BadResponse`] when no `version` is returned.
    pub async fn get_weight_version(&self) -> Result<String, Error> {
        let r = self.call("get_weight_version", json!({})).await?;
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
        self.call("resume_generation", json!({})).await
    }
}
