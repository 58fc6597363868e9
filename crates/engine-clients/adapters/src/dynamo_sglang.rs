//! Client for a Dynamo SGLang worker (`python -m dynamo.sglang`, ai-dynamo 1.6.1, here on sglang
//! 0.5.23 with mx's loader in its scheduler processes: `--custom-weight-loader mx.sglang.load`):
//! its system server's fixed `/engine/control/*` routes and the default native routes beside
//! them. No discovery (the worker does not register with the RL listener: its system URL comes
//! from the deployment) and no version read-back route: the control plane takes the version
//! from what mx's loader in each rank reports ([`crate::EngineApi::resident_from_ranks`]). The
//! wire values both sides use are in [`wire`].
//!
//! Routes (`dynamo/sglang/request_handlers/handler_base.py`, `engine_routes.py` at 1.6.1),
//! checked against a running worker (python/tests/test_dynamo_sglang.py):
//! - SGLang 0.5.23 updates weights only inside a weight-update session, whose routes the worker
//!   serves only where the deployment configured them: `--engine-route begin_weight_update:tm
//!   --engine-route end_weight_update:tm` (or `DYN_SGLANG_ENGINE_ROUTES`). Then `POST
//!   {system_url}/engine/begin_weight_update` with `{selector: "all"}` and `POST
//!   {system_url}/engine/end_weight_update` with `{}` answer HTTP 200 `{success, message}` (the
//!   tokenizer manager's `(bool, str)`: `success: false` with "a weight-update session is already
//!   open; ..." or "no weight-update session is open; ..."); unconfigured, 404 `{"error": "Route
//!   not found"}`, which mx reports as [`Error::Unsupported`] naming the flags.
//! - `POST {system_url}/engine/control/update_weights_from_tensor` with SGLang's
//!   `UpdateWeightsFromTensorReqInput`, `{serialized_named_tensors: [one per TP rank],
//!   load_format: "mx.sglang.load", flush_cache: true, weight_version: V}`
//!   ([`crate::sglang::tensor_update`]): HTTP 200 `{success, message}` (`success: false`,
//!   "update_weights_from_tensor must run between begin_weight_update() and
//!   end_weight_update()", outside a session). As on SGLang's own server each rank's loader gets
//!   `[(name, empty tensor)]` whose *name* is the version to install (no weight bytes over
//!   HTTP), and answers success whatever it did (an exception there kills the scheduler): the
//!   rank reports the outcome to the control plane before the route returns. With `flush_cache:
//!   true` SGLang flushes its cache after the load and asserts that the flush succeeded, which
//!   it does not while an `in_place` pause holds requests: that mode is refused.
//! - `POST {system_url}/engine/control/update_weights_from_disk` with `{model_path,
//!   weight_version, flush_cache, keep_pause}` (SGLang's `UpdateWeightFromDiskReqInput`): HTTP
//!   200 `{success, message, num_paused_requests}`, **200 also when `success` is false**. mx
//!   does not install through it (it reads a checkpoint directory).
//! - Any route whose handler raised (a field SGLang does not know is a `TypeError`): HTTP 500
//!   `{"error": "Handler error", "message": ...}`; an unknown route 404 `{"error": "Route not
//!   found", ...}`.
//! - `POST {system_url}/engine/pause_generation` with `{mode: abort|retract|in_place}` and
//!   `POST {system_url}/engine/continue_generation` with `{torch_empty_cache}`: registered by
//!   default (SGLang's tokenizer-manager methods), HTTP 200 `{"status": "ok"}`; while paused the
//!   worker is taken out of the frontend's routing. A deployment that replaced them
//!   (`--engine-route`) may serve neither: a 404 there is [`Error::RouteNotAllowlisted`], and
//!   the framework must gate generation itself.
//! - Generation: through the frontend (`POST {frontend}/v1/completions` pinned by
//!   `nvext.backend_instance_id`, the worker's instance id as the frontend's `GET /health`
//!   lists it; [`crate::dynamo::generate_pinned`] reads the token ids from `logprobs`), or,
//!   without a frontend, SGLang's `/generate` at the system URL (mx's reference worker serves
//!   it; Dynamo's system server does not).

pub mod wire;

use std::time::Duration;

use crate::dynamo::Frontend;
use crate::engine::{Answer, ApplyAnswer, EngineClient, PauseMode, SglangPause};
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
    frontend: Option<Frontend>,
    tp_size: u32,
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
            frontend: None,
            tp_size: 1,
        }
    }

    /// Generation through `frontend` (the worker's instance id and served model there) instead
    /// of `/generate` at the system URL.
    pub fn with_frontend(self, frontend: Option<Frontend>) -> DynamoSglangClient {
        DynamoSglangClient { frontend, ..self }
    }

    /// The worker's tensor-parallel size (the number of mx workers registered for it): each
    /// rank reads its own element of `serialized_named_tensors`. Default 1.
    pub fn with_tp_size(self, tp_size: u32) -> DynamoSglangClient {
        DynamoSglangClient {
            tp_size: tp_size.max(1),
            ..self
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
        let a = judge_update(url, status, &raw)?;
        Ok(SglangUpdate {
            message: a.message,
            num_paused_requests: a.num_paused_requests.unwrap_or(0),
            cache_tiers_cleared: a.cache_tiers_cleared.unwrap_or_default(),
        })
    }

    /// `POST /engine/<route>` of a weight-update session route (`begin_weight_update`,
    /// `end_weight_update`); 200 with `success: true` is success.
    async fn session_route(
        &self,
        route: &'static str,
        body: &serde_json::Value,
    ) -> Result<String, Error> {
        let url = self.native_url(route);
        let (status, raw) = send(&url, self.http.post(&url).json(body), self.timeout).await?;
        if matches!(status, 404 | 405) {
            return Err(Error::Unsupported {
                what: format!(
                    "route {route} on the Dynamo SGLang worker at {} (HTTP {status}): start it \
                     with --engine-route begin_weight_update:tm --engine-route \
                     end_weight_update:tm (SGLang updates weights only inside a weight-update \
                     session)",
                    self.system_url
                ),
            });
        }
        Ok(judge_update(url, status, &raw)?.message)
    }

    /// `POST /engine/begin_weight_update` with `{selector: "all"}` (a configured route).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the deployment did not configure it (404), [`Error::Engine`]
    /// with SGLang's message when a session is open already, [`Error::Status`],
    /// [`Error::Timeout`], [`Error::Http`].
    pub async fn begin_weight_update(&self) -> Result<String, Error> {
        self.session_route(
            "begin_weight_update",
            &serde_json::json!({"selector": "all"}),
        )
        .await
    }

    /// `POST /engine/end_weight_update` with `{}` (a configured route).
    ///
    /// # Errors
    /// As [`DynamoSglangClient::begin_weight_update`] (no session open).
    pub async fn end_weight_update(&self) -> Result<String, Error> {
        self.session_route("end_weight_update", &serde_json::json!({}))
            .await
    }

    /// `control/update_weights_from_tensor` naming `version` to mx's loader in each of the
    /// worker's ranks, SGLang recording `version` and flushing its cache after the load;
    /// requires HTTP 200 AND `success: true` (which SGLang answers whatever the loader did: the
    /// ranks' reports say what they hold).
    ///
    /// # Errors
    /// [`Error::Unappliable`] for a version no marker can carry, else as
    /// [`DynamoSglangClient::update_weights_from_disk`] (HTTP 500 when the handler raised).
    pub async fn update_weights_from_tensor(&self, version: &str) -> Result<String, Error> {
        let url = self.url("update_weights_from_tensor");
        let body = crate::sglang::tensor_update(version, self.tp_size, true)?;
        let (status, raw) = send(&url, self.http.post(&url).json(&body), self.timeout).await?;
        Ok(judge_update(url, status, &raw)?.message)
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

/// SGLang's `{success, message, ...}` answer of an update or session route at `url`: HTTP 200
/// with `success: true` is the answer (SGLang answers its failures with HTTP 200 and `success:
/// false` here).
///
/// # Errors
/// [`Error::Engine`] with the engine's message when `success` is false (whatever the status),
/// [`Error::BadResponse`] for a 200 that is not such an answer, else [`Error::Status`].
fn judge_update(url: String, status: u16, raw: &str) -> Result<UpdateWeightsResponse, Error> {
    match (status, serde_json::from_str::<UpdateWeightsResponse>(raw)) {
        (200, Ok(a)) if a.success => Ok(a),
        (_, Ok(a)) if !a.success => Err(Error::Engine {
            url,
            message: a.message,
        }),
        (200, Err(e)) => Err(Error::BadResponse {
            url,
            reason: format!("{e}: {}", snippet(raw)),
        }),
        (status, _) => Err(Error::Status {
            url,
            status,
            body: snippet(raw),
        }),
    }
}

/// The refit's calls over a Dynamo SGLang worker's routes: pause (mx's `keep` is SGLang's
/// `retract`, and so is `wait`: SGLang has none; `in_place` is refused, see the module docs)
/// and continue where served (else answered with "the framework must gate generation itself"),
/// apply as one weight-update session (`begin_weight_update`,
/// `control/update_weights_from_tensor` naming the version to mx's loader with the cache
/// flushed, `end_weight_update`), no read-back of its own (answered without a version: the ranks' reports
/// decide), generation through the frontend when known, else `/generate`.
#[async_trait::async_trait]
impl EngineClient for DynamoSglangClient {
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error> {
        let mode = SglangPause::of(mode)?;
        if mode == SglangPause::InPlace {
            return Err(Error::Unsupported {
                what: "in_place pause on a Dynamo SGLang worker (its weight update flushes the \
                       cache, which SGLang refuses and asserts on while in_place holds running \
                       requests; the worker serves no cache flush of its own): pause with keep, \
                       retract or abort"
                    .into(),
            });
        }
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
        let v = version.to_string();
        crate::sglang::marker(&v)?;
        let step = |step: &'static str, installed: Option<String>| {
            move |e: Error| Error::ApplyStep {
                step,
                installed,
                source: Box::new(e),
            }
        };
        if let Err(e) = self.begin_weight_update().await {
            // A session a failed apply left open: close it and begin again, once.
            if !matches!(e, Error::Engine { .. }) {
                return Err(step("begin_weight_update", None)(e));
            }
            self.end_weight_update()
                .await
                .map_err(step("end_weight_update", None))?;
            self.begin_weight_update()
                .await
                .map_err(step("begin_weight_update", None))?;
        }
        let message = match self.update_weights_from_tensor(&v).await {
            Ok(m) => m,
            Err(e) => {
                // Close the session; the update's error is the one to report.
                let _ = self.end_weight_update().await;
                return Err(step("update_weights_from_tensor", None)(e));
            }
        };
        self.end_weight_update()
            .await
            .map_err(step("end_weight_update", Some(v)))?;
        Ok(ApplyAnswer {
            message,
            version: None,
            // `flush_cache: true`: SGLang's flush (its radix cache and KV pool), asserted there.
            cache_tiers_cleared: vec!["radix_cache".into(), "kv_cache".into()],
            paused_requests: 0,
            steps: Vec::new(),
        })
    }

    async fn read_version(&self) -> Result<Answer, Error> {
        Ok(Answer {
            message:
                "a Dynamo SGLang worker has no version read-back: the ranks report what they hold"
                    .into(),
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
        match &self.frontend {
            Some(f) => {
                let (http, t) = (&self.http, self.timeout);
                crate::dynamo::generate_pinned(http, f, prompt, max_new_tokens, true, t).await
            }
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
