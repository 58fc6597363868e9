//! Client for a Dynamo SGLang worker (`python -m dynamo.sglang`, ai-dynamo 1.6.1 on sglang
//! 0.5.21): its system server's fixed `/engine/control/*` routes and the default native routes
//! beside them (no discovery: the worker does not register with the RL listener, its system URL
//! comes from the deployment; no version read-back); the wire values both sides use are in
//! [`wire`].
//!
//! Routes (`dynamo/sglang/request_handlers/handler_base.py`, `engine_routes.py` at 1.6.1):
//! - `POST {system_url}/engine/control/update_weights_from_disk` with `{model_path,
//!   weight_version, flush_cache, keep_pause}` (SGLang's `UpdateWeightFromDiskReqInput`): HTTP
//!   200 `{success, message, num_paused_requests}`, **200 also when `success` is false**; a
//!   field SGLang does not know is a `TypeError` in the handler, answered HTTP 500
//!   `{"error": "Handler error", "message": ...}`.
//! - `POST {system_url}/engine/pause_generation` with `{mode: abort|retract|in_place}` and
//!   `POST {system_url}/engine/continue_generation` with `{torch_empty_cache}`: registered by
//!   default (SGLang's tokenizer-manager methods), HTTP 200 `{"status": "ok"}`; while paused the
//!   worker is taken out of the frontend's routing. A deployment that replaced them
//!   (`--engine-route`) may serve neither: a 404 there is [`Error::RouteNotAllowlisted`], and
//!   the framework must gate generation itself.
//!
//! SGLang 0.5.21 asserts on a cache flush refused after an update (requests still running:
//! an `in_place` pause), which kills the scheduler: pause with `abort` or `retract` here.

pub mod wire;

use std::time::Duration;

use crate::engine::{mx_model_path, Answer, ApplyAnswer, EngineClient, PauseMode, SglangPause};
use crate::generate::Generation;
use crate::{send, snippet, Error};
use mx_layout::ResidentVersion;
use wire::{
    ContinueRequest, ControlResponse, PauseRequest, UpdateWeightsRequest, UpdateWeightsResponse,
};

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

/// One Dynamo SGLang worker's routes under `{system_url}/engine/`.
#[derive(Debug, Clone)]
pub struct DynamoSglangClient {
    http: reqwest::Client,
    system_url: String,
    timeout: Duration,
}

impl DynamoSglangClient {
    /// A client for the server at `system_url`; every call has `timeout` as its deadline.
    pub fn new(system_url: &str, timeout: Duration) -> DynamoSglangClient {
        DynamoSglangClient::with_client(reqwest::Client::new(), system_url, timeout)
    }

    /// As [`DynamoSglangClient::new`], sharing `http` (and its kept-alive connections) with other
    /// clients.
    pub fn with_client(
        http: reqwest::Client,
        system_url: &str,
        timeout: Duration,
    ) -> DynamoSglangClient {
        DynamoSglangClient {
            http,
            system_url: system_url.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    fn url(&self, route: &str) -> String {
        format!("{}/engine/control/{route}", self.system_url)
    }

    fn native_url(&self, route: &str) -> String {
        format!("{}/engine/{route}", self.system_url)
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
        let body = UpdateWeightsRequest {
            model_path: Some(model_path.to_string()),
            weight_version: Some(weight_version.to_string()),
            flush_cache: Some(flush_cache),
            keep_pause: Some(keep_pause),
            abort_all_requests: None,
        };
        let (status, raw) = send(&url, self.http.post(&url).json(&body), self.timeout).await?;
        match (status, serde_json::from_str::<UpdateWeightsResponse>(&raw)) {
            (200, Ok(a)) if a.success => Ok(SglangUpdate {
                message: a.message,
                num_paused_requests: a.num_paused_requests.unwrap_or(0),
                cache_tiers_cleared: a.cache_tiers_cleared.unwrap_or_default(),
            }),
            (_, Ok(a)) if !a.success => Err(Error::Engine {
                url,
                message: a.message,
            }),
            (200, Err(e)) => Err(Error::BadResponse {
                url,
                reason: format!("{e}: {}", snippet(&raw)),
            }),
            (status, _) => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
        }
    }

    /// `POST` to a native route the deployment may have replaced: 404/405 is
    /// [`Error::RouteNotAllowlisted`], a 200 whose body says `status: error` or `success: false`
    /// is [`Error::Engine`].
    async fn optional_route<Req: serde::Serialize>(
        &self,
        route: &'static str,
        body: &Req,
    ) -> Result<(), Error> {
        let url = self.native_url(route);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        match status {
            404 | 405 => Err(Error::RouteNotAllowlisted { url, route }),
            200 => match serde_json::from_str::<ControlResponse>(&raw) {
                Ok(ControlResponse {
                    success: Some(false),
                    message,
                    ..
                }) => Err(Error::Engine { url, message }),
                Ok(ControlResponse {
                    status: Some(s),
                    message,
                    ..
                }) if s == "error" => Err(Error::Engine { url, message }),
                _ => Ok(()),
            },
            status => Err(Error::Status {
                url,
                status,
                body: snippet(&raw),
            }),
        }
    }

    /// `POST /engine/pause_generation` with `{mode}` (SGLang's `abort`, `retract` or
    /// `in_place`).
    ///
    /// # Errors
    /// [`Error::RouteNotAllowlisted`] on HTTP 404/405 (the framework must gate generation
    /// itself), else as [`DynamoSglangClient::update_weights_from_disk`].
    pub async fn pause_generation(&self, mode: SglangPause) -> Result<(), Error> {
        let body = PauseRequest { mode: Some(mode) };
        self.optional_route("pause_generation", &body).await
    }

    /// `continue_generation` with `{torch_empty_cache}`, where allowlisted.
    ///
    /// # Errors
    /// As [`DynamoSglangClient::pause_generation`].
    pub async fn continue_generation(&self, torch_empty_cache: bool) -> Result<(), Error> {
        let body = ContinueRequest {
            torch_empty_cache: Some(torch_empty_cache),
        };
        self.optional_route("continue_generation", &body).await
    }
}

/// The refit's calls over a Dynamo SGLang worker's routes: pause (mx's `keep` is SGLang's
/// `retract`, and so is `wait`: SGLang has none) and continue where served (else answered
/// with "the framework must gate generation itself"), apply as
/// `update_weights_from_disk` of `mx://<hex>` with the cache flushed and generation kept
/// paused, no read-back (answered, without a version), generation over the native
/// `/generate`.
#[async_trait::async_trait]
impl EngineClient for DynamoSglangClient {
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error> {
        let mode = SglangPause::of(mode)?;
        match self.pause_generation(mode).await {
            Ok(()) => Ok(Answer {
                message: format!("paused ({})", mode.as_str()),
                version: None,
            }),
            Err(Error::RouteNotAllowlisted { .. }) => Ok(Answer {
                message:
                    "pause_generation is not allowlisted: the framework must gate generation itself"
                        .into(),
                version: None,
            }),
            Err(e) => Err(e),
        }
    }

    async fn apply(&self, version: &ResidentVersion) -> Result<ApplyAnswer, Error> {
        let model_path = mx_model_path(version)?;
        let a = self
            .update_weights_from_disk(&model_path, &version.to_string(), true, true)
            .await?;
        Ok(ApplyAnswer {
            message: a.message,
            version: None,
            cache_tiers_cleared: a.cache_tiers_cleared,
            paused_requests: a.num_paused_requests,
        })
    }

    async fn read_version(&self) -> Result<Answer, Error> {
        Ok(Answer {
            message: "SGLang has no version read-back: the control plane keeps the version and relies on the post-update generation".into(),
            version: None,
        })
    }

    async fn resume(&self) -> Result<Answer, Error> {
        match self.continue_generation(false).await {
            Ok(()) => Ok(Answer::default()),
            Err(Error::RouteNotAllowlisted { .. }) => Ok(Answer {
                message: "continue_generation is not allowlisted: the framework must gate generation itself".into(),
                version: None,
            }),
            Err(e) => Err(e),
        }
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
