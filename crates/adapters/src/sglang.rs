//! Client for SGLang's weight-update routes (no discovery, no version read-back).

use std::time::Duration;

use serde_json::{json, Value};

use crate::{post_json, snippet, Error};

/// The answer of a successful `update_weights_from_disk`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SglangUpdate {
    /// The engine's message.
    pub message: String,
    /// Requests that were paused during the update.
    pub num_paused_requests: u64,
    /// Cache tiers the engine says it cleared (`cache_tiers_cleared`, an mx extension).
    pub cache_tiers_cleared: Vec<String>,
}

/// One SGLang server's control routes under `{system_url}/engine/control/`.
#[derive(Debug, Clone)]
pub struct SglangClient {
    http: reqwest::Client,
    system_url: String,
    timeout: Duration,
}

impl SglangClient {
    /// A client for the server at `system_url`; every call has `timeout` as its deadline.
    pub fn new(system_url: &str, timeout: Duration) -> SglangClient {
        SglangClient::with_client(reqwest::Client::new(), system_url, timeout)
    }

    /// As [`SglangClient::new`], sharing `http` (and its kept-alive connections) with other
    /// clients.
    pub fn with_client(http: reqwest::Client, system_url: &str, timeout: Duration) -> SglangClient {
        SglangClient {
            http,
            system_url: system_url.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    fn url(&self, route: &str) -> String {
        format!("{}/engine/control/{route}", self.system_url)
    }

    /// `update_weights_from_disk` with `{model_path, weight_version, flush_cache, keep_pause}`;
    /// requires HTTP 200 AND `success: true`.
    ///
    /// # Errors
    /// [`Error::Engine`] with the engine's message when `success` is false, [`Error::Status`],
    /// [`Error::BadResponse`], [`Error::Timeout`], [`Error::Http`].
    pub async fn update_weights_from_disk(
        &self,
        model_path: &str,
        weight_version: &str,
        flush_cache: bool,
        keep_pause: bool,
    ) -> Result<SglangUpdate, Error> {
        let url = self.url("update_weights_from_disk");
        let body = json!({
            "model_path": model_path,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "keep_pause": keep_pause,
        });
        let (status, json, raw) = post_json(&self.http, &url, &body, self.timeout).await?;
        let message = json
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        match (status, json.get("success").and_then(Value::as_bool)) {
            (200, Some(true)) => Ok(SglangUpdate {
                message,
                num_paused_requests: json
                    .get("num_paused_requests")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
                cache_tiers_cleared: crate::string_list(&json, "cache_tiers_cleared"),
            }),
            (_, Some(false)) => Err(Error::Engine { url, message }),
            (200, None) => Err(Error::BadResponse {
                url,
                reason: format!("no success field: {}", snippet(&raw)),
            }),
            (status, _) => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
        }
    }

    async fn optional_route(&self, route: &'static str, body: Value) -> Result<(), Error> {
        let url = self.url(route);
        let (status, json, raw) = post_json(&self.http, &url, &body, self.timeout).await?;
        match status {
            404 | 405 => Err(Error::RouteNotAllowlisted { url, route }),
            200 if json.get("success").and_then(Value::as_bool) == Some(false) => {
                Err(Error::Engine {
                    url,
                    message: json
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
            }
            200 => Ok(()),
            status => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
        }
    }

    /// `pause_generation`, where the deployment allowlists it.
    ///
    /// # Errors
    /// [`Error::RouteNotAllowlisted`] on HTTP 404/405 (the framework must gate generation
    /// itself), else as [`SglangClient::update_weights_from_disk`].
    pub async fn pause_generation(&self) -> Result<(), Error> {
        self.optional_route("pause_generation", json!({})).await
    }

    /// `continue_generation` with `{torch_empty_cache}`, where allowlisted.
    ///
    /// # Errors
    /// As [`SglangClient::pause_generation`].
    pub async fn continue_generation(&self, torch_empty_cache: bool) -> Result<(), Error> {
        self.optional_route(
            "continue_generation",
            json!({"torch_empty_cache": torch_empty_cache}),
        )
        .await
    }
}
