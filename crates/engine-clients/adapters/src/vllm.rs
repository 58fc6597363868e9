//! Client for vLLM's native RL routes on one OpenAI-compatible server (vLLM 0.32.0, started
//! with `VLLM_SERVER_DEV_MODE=1`; no discovery, one client per server).
//!
//! The contract, from vLLM 0.32.0's `vllm/entrypoints/rl/online/api_router.py` and
//! `vllm/entrypoints/serve/dev/cache/api_router.py` (routes at the server's root):
//!
//! - `POST /pause?mode=keep|wait|abort&clear_cache=false`, no body: 200 `{"status": "paused"}`.
//! - `POST /start_weight_update`, no body: 200 `{"message": "Weight update started"}`.
//! - `POST /update_weights` with `{"update_info": {"version_id": "mx:<64 hex>"}}`: 200
//!   `{"message": "Weights updated"}`.
//! - `POST /finish_weight_update` with `{"weight_version": "mx:<64 hex>"}`: 200
//!   `{"message": "Weight update finished"}`.
//! - `GET /weight_info`: 200 `{"weight_version": "<str>" | null}` (the read-back).
//! - `POST /reset_prefix_cache?reset_running_requests=true`, no body: 200 `{"success": bool}`.
//!   mx sends `reset_running_requests=true`: requests held by a `keep` pause computed their KV
//!   with the old weights, so the scheduler preempts them (they are recomputed with the new
//!   weights on resume) and the reset cannot be refused for blocks they hold.
//! - `POST /resume`, no body: 200 `{"status": "resumed"}`.
//! - `GET /is_paused`: 200 `{"is_paused": bool}`.
//! - `POST /v1/completions` with `{"prompt": [token ids], "max_tokens": n, "temperature": 0,
//!   "return_token_ids": true, "ignore_eos": true}` (no `model`: optional on a server serving
//!   one): 200 `{"choices": [{"token_ids": [token ids], ...}], ...}` with exactly one choice.
//!
//! Failures: `/pause` answers 400 `{"error": msg}` for a bad mode and 500 `{"error": msg}` when
//! the engine fails; the weight-update routes let an engine exception through, which FastAPI
//! answers with HTTP 500 (plain text `Internal Server Error`, or JSON `{"detail": ...}` /
//! `{"error": ...}`). Every non-200 answer is [`Error::Status`] carrying the body's first 512
//! bytes, whatever its shape. A 200 whose body lacks a required field (or, for `/pause` and
//! `/resume`, carries another `status`) is [`Error::BadResponse`]; fields the contract does not
//! name are ignored, since servers add some. `/reset_prefix_cache` answers `success: false`
//! while KV blocks are still held (running requests, in-flight offloads): it is retried
//! [`RESET_PREFIX_CACHE_TRIES`] times, [`RESET_PREFIX_CACHE_RETRY`] apart, within the call's
//! deadline, then reported as [`Error::Engine`].
//!
//! When `update_weights` raises, vLLM's worker aborts the weight-update session itself: no
//! cleanup call is needed before a retry. The `update_info` payload is handed as-is to the
//! weight-transfer backend the server was started with; mx's backend must read `version_id`.
//!
//! Every call has the client's timeout as its deadline ([`Error::Timeout`]). The wire values
//! both sides use are in [`wire`].

pub mod wire;

use std::time::Duration;

use crate::engine::{Answer, ApplyAnswer, EngineClient, PauseMode, StepTime};
use crate::generate::Generation;
use crate::identity::wire::{CollectiveRpcRequest, CollectiveRpcResponse};
use crate::identity::Proof;
use crate::{post_typed, send_typed, Error};
use mx_layout::ResidentVersion;
use wire::{
    CompletionRequest, CompletionResponse, FinishWeightUpdateRequest, IsPausedResponse,
    MessageResponse, ResetPrefixCacheResponse, StatusResponse, UpdateInfo, UpdateWeightsRequest,
    WeightInfoResponse,
};

/// How many times [`VllmClient::reset_prefix_cache`] asks before giving up.
pub const RESET_PREFIX_CACHE_TRIES: u32 = 5;
/// The pause between two of those tries.
pub const RESET_PREFIX_CACHE_RETRY: Duration = Duration::from_millis(100);

/// One vLLM server's RL and completion routes.
#[derive(Debug, Clone)]
pub struct VllmClient {
    http: reqwest::Client,
    base_url: String,
    timeout: Duration,
}

impl VllmClient {
    /// A client for the server at `base_url` (e.g. `http://127.0.0.1:8000`); every call has
    /// `timeout` as its deadline.
    pub fn new(base_url: &str, timeout: Duration) -> VllmClient {
        VllmClient::with_client(reqwest::Client::new(), base_url, timeout)
    }

    /// As [`VllmClient::new`], sharing `http` (and its kept-alive connections) with other
    /// clients.
    pub fn with_client(http: reqwest::Client, base_url: &str, timeout: Duration) -> VllmClient {
        VllmClient {
            http,
            base_url: base_url.trim_end_matches('/').to_string(),
            timeout,
        }
    }

    /// The server's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    fn url(&self, route: &str) -> String {
        format!("{}/{route}", self.base_url)
    }

    /// `POST {url}` without a body, requiring `{"status": want}`.
    async fn post_status(&self, url: &str, want: &str) -> Result<(), Error> {
        let r: StatusResponse = self.post_empty(url).await?;
        if r.status == want {
            Ok(())
        } else {
            Err(Error::BadResponse {
                url: url.to_string(),
                reason: format!("status is {:?}, not {want:?}", r.status),
            })
        }
    }

    /// `POST {url}` without a body.
    async fn post_empty<Resp: serde::de::DeserializeOwned>(
        &self,
        url: &str,
    ) -> Result<Resp, Error> {
        send_typed(url, self.http.post(url), self.timeout).await
    }

    /// `POST /pause?mode=<mode>&clear_cache=false`: gates generation; `mode` says what happens to
    /// in-flight requests.
    ///
    /// # Errors
    /// [`Error::Status`] for a non-200 answer (400 for a mode the server rejects, 500 when the
    /// engine fails), [`Error::BadResponse`] unless the body is `{"status": "paused"}`,
    /// [`Error::Timeout`], [`Error::Http`].
    pub async fn pause(&self, mode: PauseMode) -> Result<(), Error> {
        let mode = mode.keep_wait_abort();
        let url = self.url(&format!("pause?mode={}&clear_cache=false", mode.as_str()));
        self.post_status(&url, "paused").await
    }

    /// `POST /resume`.
    ///
    /// # Errors
    /// As [`VllmClient::pause`], the body being `{"status": "resumed"}`.
    pub async fn resume(&self) -> Result<(), Error> {
        self.post_status(&self.url("resume"), "resumed").await
    }

    /// `GET /is_paused`.
    ///
    /// # Errors
    /// As [`VllmClient::pause`], the body being `{"is_paused": bool}`.
    pub async fn is_paused(&self) -> Result<bool, Error> {
        let url = self.url("is_paused");
        let r: IsPausedResponse = send_typed(&url, self.http.get(&url), self.timeout).await?;
        Ok(r.is_paused)
    }

    /// `POST /start_weight_update`: opens a weight-update session; returns the engine's message.
    ///
    /// # Errors
    /// [`Error::Status`] with the body for a non-200 answer (an engine exception is HTTP 500),
    /// [`Error::BadResponse`] when the body has no `message`, [`Error::Timeout`],
    /// [`Error::Http`].
    pub async fn start_weight_update(&self) -> Result<String, Error> {
        let r: MessageResponse = self.post_empty(&self.url("start_weight_update")).await?;
        Ok(r.message)
    }

    /// `POST /update_weights` with `{"update_info": {"version_id": version}}`: the server's
    /// weight-transfer backend installs `version` (an `mx:<hex>` version id); returns the
    /// engine's message.
    ///
    /// # Errors
    /// As [`VllmClient::start_weight_update`].
    pub async fn update_weights(&self, version: &str) -> Result<String, Error> {
        let body = UpdateWeightsRequest {
            update_info: UpdateInfo {
                version_id: version.to_string(),
            },
        };
        let r: MessageResponse =
            post_typed(&self.http, &self.url("update_weights"), &body, self.timeout).await?;
        Ok(r.message)
    }

    /// `POST /finish_weight_update` with `{"weight_version": version}`: closes the session and
    /// records `version` as the engine's weight version; returns the engine's message.
    ///
    /// # Errors
    /// As [`VllmClient::start_weight_update`].
    pub async fn finish_weight_update(&self, version: &str) -> Result<String, Error> {
        let body = FinishWeightUpdateRequest {
            weight_version: version.to_string(),
        };
        let url = self.url("finish_weight_update");
        let r: MessageResponse = post_typed(&self.http, &url, &body, self.timeout).await?;
        Ok(r.message)
    }

    /// `POST /finish_weight_update` with `{}`: closes a weight-update session that an earlier
    /// caller opened and never closed (a control plane that died between its
    /// `start_weight_update` and `finish_weight_update`), leaving the engine's weight version
    /// as it is; returns the engine's message.
    ///
    /// # Errors
    /// As [`VllmClient::start_weight_update`].
    pub async fn close_open_session(&self) -> Result<String, Error> {
        let url = self.url("finish_weight_update");
        let r: MessageResponse =
            post_typed(&self.http, &url, &serde_json::json!({}), self.timeout).await?;
        Ok(r.message)
    }

    /// `GET /weight_info`: the weight version the engine reports (`None` when it has none).
    ///
    /// # Errors
    /// As [`VllmClient::pause`]; [`Error::BadResponse`] when `weight_version` is absent or
    /// neither a string nor null.
    pub async fn weight_version(&self) -> Result<Option<String>, Error> {
        let url = self.url("weight_info");
        let r: WeightInfoResponse = send_typed(&url, self.http.get(&url), self.timeout).await?;
        Ok(r.weight_version)
    }

    /// `POST /reset_prefix_cache?reset_running_requests=true` (held requests are preempted: their
    /// KV came from the old weights), asked again while the engine
    /// answers `success: false` (blocks still held), up to [`RESET_PREFIX_CACHE_TRIES`] times
    /// [`RESET_PREFIX_CACHE_RETRY`] apart and within the client's deadline.
    ///
    /// # Errors
    /// [`Error::Engine`] when every try answered `success: false`; as [`VllmClient::pause`]
    /// otherwise ([`Error::Timeout`] when the deadline passes during a try).
    pub async fn reset_prefix_cache(&self) -> Result<(), Error> {
        let url = self.url("reset_prefix_cache?reset_running_requests=true");
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut tries = 0;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let r: ResetPrefixCacheResponse = send_typed(&url, self.http.post(&url), left).await?;
            tries += 1;
            if r.success {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if tries >= RESET_PREFIX_CACHE_TRIES || left <= RESET_PREFIX_CACHE_RETRY {
                return Err(Error::Engine {
                    url,
                    message: format!(
                        "the prefix cache was not reset after {tries} tries (success: false: \
                         blocks are still held by running requests or transfers)"
                    ),
                });
            }
            tokio::time::sleep(RESET_PREFIX_CACHE_RETRY).await;
        }
    }

    /// Greedy decoding of `max_tokens` after `prompt` over `POST /v1/completions`
    /// (`ignore_eos`, so exactly `max_tokens` come back unless a stop condition of the server
    /// applies). `weight_version` is `None` (the answer does not carry it); `cached_tokens` is
    /// `usage.prompt_tokens_details.cached_tokens` where the server reports it, else 0.
    ///
    /// # Errors
    /// [`Error::Status`] for a non-200 answer, [`Error::BadResponse`] unless the answer has
    /// exactly one choice whose `token_ids` are u32 token ids, [`Error::Timeout`],
    /// [`Error::Http`].
    pub async fn complete(&self, prompt: &[u32], max_tokens: u32) -> Result<Generation, Error> {
        let url = self.url("v1/completions");
        let body = CompletionRequest {
            prompt: prompt.to_vec(),
            max_tokens,
            temperature: 0.0,
            return_token_ids: true,
            ignore_eos: true,
        };
        let r: CompletionResponse = post_typed(&self.http, &url, &body, self.timeout).await?;
        let cached_tokens = r
            .usage
            .and_then(|u| u.prompt_tokens_details)
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0);
        let n = r.choices.len();
        let mut choices = r.choices.into_iter();
        match (choices.next(), n) {
            (Some(c), 1) => Ok(Generation {
                output_ids: c.token_ids,
                weight_version: None,
                cached_tokens,
            }),
            _ => Err(Error::BadResponse {
                url,
                reason: format!("{n} choices, the request asks for exactly one"),
            }),
        }
    }
}

impl VllmClient {
    /// `POST /collective_rpc` with `{"method": "mx_engine_identity"}`: the mx workers of every
    /// tensor-parallel rank ([`crate::identity`]). A server without dev mode (404), or whose
    /// workers lack the method (vLLM answers 500 naming it "not implemented": the mx plugin is
    /// not loaded), or whose ranks all answer `null` (their weight-transfer backend is not
    /// mx's) is [`Proof::NotOffered`].
    ///
    /// # Errors
    /// [`Error::Status`] for any other non-200 answer, [`Error::BadResponse`] for a body that
    /// is not `{"results": [identity | null, ...]}`.
    pub async fn engine_identity(&self) -> Result<Proof, Error> {
        let url = self.url("collective_rpc");
        let body = CollectiveRpcRequest {
            method: crate::identity::wire::VLLM_METHOD,
        };
        let (status, raw) =
            crate::send(&url, self.http.post(&url).json(&body), self.timeout).await?;
        let r: CollectiveRpcResponse = match crate::identity::read_answer(
            &url,
            status,
            &raw,
            "no collective_rpc route (start vLLM with VLLM_SERVER_DEV_MODE=1)",
            Some((
                "not implemented",
                "vLLM's workers have no mx_engine_identity (the mx plugin is not loaded)",
            )),
        )? {
            Ok(r) => r,
            Err(proof) => return Ok(proof),
        };
        let ranks: Vec<_> = r.results.into_iter().flatten().collect();
        if ranks.is_empty() {
            return Ok(Proof::NotOffered(format!(
                "{url}: no rank's weight-transfer backend is mx's"
            )));
        }
        Ok(Proof::Proven(ranks))
    }
}

/// The refit's calls over vLLM's RL routes. APPLY is one weight-update session:
/// `start_weight_update`, `update_weights`, `finish_weight_update` (which records the version),
/// then `reset_prefix_cache`; the first step that fails fails the call ([`Error::ApplyStep`]).
/// When `update_weights` raises, vLLM's worker aborts the session itself, so nothing is cleaned
/// up. Any non-empty version id is sent: mx's backend installs a staged `mx:` version or
/// restores one it retained (`disk:<dir>` for the checkpoint vLLM started from), and refuses
/// others. The read-back is `GET /weight_info`; generation is `POST /v1/completions`.
#[async_trait::async_trait]
impl EngineClient for VllmClient {
    async fn pause(&self, mode: PauseMode) -> Result<Answer, Error> {
        VllmClient::pause(self, mode).await?;
        Ok(Answer {
            message: format!("paused ({})", mode.keep_wait_abort().as_str()),
            version: None,
        })
    }

    async fn apply(&self, version: &ResidentVersion) -> Result<ApplyAnswer, Error> {
        if matches!(version, ResidentVersion::Label(l) if l.is_empty()) {
            return Err(Error::Unappliable {
                version: String::new(),
                reason: "no version to apply",
            });
        }
        let step = |step: &'static str, installed: bool| {
            let installed = installed.then(|| version.to_string());
            move |e: Error| Error::ApplyStep {
                step,
                installed,
                source: Box::new(e),
            }
        };
        let mut steps = Vec::new();
        let mut t = std::time::Instant::now();
        let mut lap = |step: &str| {
            steps.push(StepTime {
                step: step.into(),
                seconds: t.elapsed().as_secs_f64(),
            });
            t = std::time::Instant::now();
        };
        match self.start_weight_update().await {
            // A session an earlier caller opened and never closed (a control plane that died
            // inside APPLY): vLLM refuses a second one until it is finished. Finishing it
            // completes what that caller installed, if anything; this install then follows.
            Err(Error::Status {
                status: 500, body, ..
            }) if body.contains("already active") => {
                tracing::warn!(
                    url = %self.base_url,
                    "a weight-update session was left open (a caller died inside APPLY): finishing it first"
                );
                // vLLM's server may close the connection its 500 went out on: a request sent
                // on it fails before it is read, so it is sent once more.
                let closed = match self.close_open_session().await {
                    Err(Error::Http { .. }) => self.close_open_session().await,
                    r => r,
                };
                closed.map_err(step("finish_weight_update (the session left open)", false))?;
                self.start_weight_update()
                    .await
                    .map_err(step("start_weight_update", false))?;
            }
            r => {
                r.map_err(step("start_weight_update", false))?;
            }
        }
        lap("start_weight_update");
        let version = version.to_string();
        self.update_weights(&version)
            .await
            .map_err(step("update_weights", false))?;
        lap("update_weights");
        self.finish_weight_update(&version)
            .await
            .map_err(step("finish_weight_update", false))?;
        lap("finish_weight_update");
        self.reset_prefix_cache()
            .await
            .map_err(step("reset_prefix_cache", true))?;
        lap("reset_prefix_cache");
        Ok(ApplyAnswer {
            message:
                "start_weight_update, update_weights, finish_weight_update, reset_prefix_cache: ok"
                    .into(),
            version: Some(ResidentVersion::parse(&version)),
            cache_tiers_cleared: vec!["prefix_cache".into()],
            paused_requests: 0,
            steps,
        })
    }

    async fn read_version(&self) -> Result<Answer, Error> {
        match self.weight_version().await? {
            Some(v) => Ok(Answer {
                message: String::new(),
                version: Some(ResidentVersion::parse(&v)),
            }),
            None => Err(Error::NoVersion {
                url: self.url("weight_info"),
            }),
        }
    }

    async fn resume(&self) -> Result<Answer, Error> {
        VllmClient::resume(self).await?;
        Ok(Answer {
            message: "resumed".into(),
            version: None,
        })
    }

    async fn generate(&self, prompt: &[u32], max_new_tokens: u32) -> Result<Generation, Error> {
        self.complete(prompt, max_new_tokens).await
    }

    async fn identify(&self) -> Result<Proof, Error> {
        self.engine_identity().await
    }
}
