//! Client for SGLang's weight-update routes (no discovery, no version read-back); the wire
//! values both sides use are in [`wire`].

pub mod wire;

use std::time::Duration;

use crate::engine::{mx_model_path, Answer, ApplyAnswer, EngineClient, PauseMode};
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

    /// `POST` to a route that exists only where allowlisted: 404/405 is
    /// [`Error::RouteNotAllowlisted`], a 200 whose body says `success: false` is
    /// [`Error::Engine`].
    async fn optional_route<Req: serde::Serialize>(
        &self,
        route: &'static str,
        body: &Req,
    ) -> Result<(), Error> {
        let url = self.url(route);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        match status {
            404 | 405 => Err(Error::RouteNotAllowlisted { url, route }),
            200 => match serde_json::from_str::<ControlResponse>(&raw) {
                Ok(ControlResponse {
                    success: Some(false),
                    message,
                }) => Err(Error::Engine { url, message }),
                _ => Ok(()),
            },
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
        self.optional_route("pause_generation", &PauseRequest::default())
            .await
    }

    /// `continue_generation` with `{torch_empty_cache}`, where allowlisted.
    ///
    /// # Errors
    /// As [`SglangClient::pause_generation`].
    pub async fn continue_generation(&self, torch_empty_cache: bool) -> Result<(), Error> {
        let body = ContinueRequest {
            torch_empty_cache: Some(torch_empty_cache),
        };
        self.optional_route("continue_generation", &body).await
    }
}

/// The refit's calls over SGLang's control routes: pause and continue where allowlisted (else
/// answered with "the framework must gate generation itself"), apply as
/// `update_weights_from_disk` of `mx://<hex>` with the cache flushed and generation kept
/// paused, no read-back (answered, without a version), generation over the native
/// `/generate`.
#[async_trait::async_trait]
impl EngineClient for SglangClient {
    async fn pause(&self, _mode: PauseMode) -> Result<Answer, Error> {
        match self.pause_generation().await {
            Ok(()) => Ok(Answer::default()),
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
