//! The HTTP server: both engine weight-update contracts (Dynamo vLLM RL and SGLang), SGLang-style
//! `/generate`, the read-only `GET /mx/live_digests`, and the failpoints. Field names follow the
//! contracts exactly: requests are parsed into, and answers written from, the same wire values
//! mx's clients use (`mx_adapters::{dynamo, dynamo_sglang, generate}::wire`), and a bad field is
//! answered with a JSON error naming its path.
//!
//! `GET /mx/live_digests` (mx's own, not an engine contract) answers what is live, hashed from
//! the live bytes at the time of the request: `{"version": "<resident version id>", "ranks":
//! [{"rank": r, "tensors": {"<parameter>": "<blake3 hex of its live bytes>"}}]}` in the order of
//! the ranks held, or 503 `{"status": "error", "message": ...}` while no weights are live.
//! Orchestrators check live bytes with it (`mx-lab demo` compares them with slices of the
//! checkpoint); it changes nothing, and holds the version store while it hashes (an apply waits).
//!
//! Once the instance is retired (its worker was displaced: another process holds its worker id,
//! see [`Instance::retire`]) every route answers 410 Gone naming the worker and why.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use mx_adapters::dynamo::wire::{
    self as dynamo_wire, EngineResponse, InstanceId, WorkerInfo, WorkersResponse,
};
use mx_adapters::dynamo_sglang::wire::{self as sglang_wire, UpdateWeightsResponse};
use mx_adapters::generate::wire::{
    self as generate_wire, ErrorBody, ErrorResponse, GenerateResponse, MetaInfo,
};
use mx_adapters::identity::wire::IdentityResponse;
use mx_adapters::sglang::wire::UpdateFromTensorRequest;
use mx_adapters::EngineIdentity;
use mx_control::client::ControlClient;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

use crate::gate::PauseMode;
use crate::instance::{ApplySource, FinishReason, GenerateRequest, Instance};
use crate::Error;

/// Routes this worker lists in discovery: the Dynamo vLLM routes it serves (those mx's client
/// requires, and `update_weights_from_disk`), sorted as Dynamo lists them.
pub const DYNAMO_ROUTES: [&str; 5] = [
    "get_weight_version",
    "pause_generation",
    "resume_generation",
    "update_weights_from_disk",
    "update_weights_from_distributed",
];

/// `max_new_tokens` when a `/generate` request leaves it out (SGLang's default).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// A running HTTP server; dropping it (or [`HttpServer::shutdown`]) stops it.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl HttpServer {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL, `http://host:port` (the engine routes' `system_url`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets requests in progress finish, and waits for the server to end.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

#[derive(Clone)]
struct Ctx {
    inst: Instance,
    url: Arc<String>,
    /// `Bearer <token>` every request must carry, when set.
    token: Option<Arc<String>>,
    /// Whose engine this is, as `GET /mx/identity` answers (`None`: not following a control
    /// plane; the route answers 404).
    identity: Option<Arc<EngineIdentity>>,
    /// Where an install through mx's SGLang loader is reported (`None`: nowhere).
    reporter: Option<Arc<Reporter>>,
    /// Whether a Dynamo SGLang weight-update session is open (`begin_weight_update`).
    session: Arc<std::sync::atomic::AtomicBool>,
}

/// Where this engine reports what its ranks hold after an install through SGLang's tensor
/// route (`ReportResident`): SGLang answers that route with success whatever mx's loader did,
/// and mx's loader in each rank tells the control plane the outcome before it returns; mx's
/// reference worker does the same, as worker `worker_id` of incarnation `incarnation`.
#[derive(Debug, Clone)]
pub struct Reporter {
    /// The control plane (a lazily connected client).
    pub client: ControlClient,
    /// The worker id this engine follows the control plane as.
    pub worker_id: String,
    /// Its process's incarnation.
    pub incarnation: u64,
}

/// Binds `addr` and serves `inst`'s routes on it until the returned server is shut down;
/// `identity` is the worker it follows the control plane as (`GET /mx/identity`, see
/// [`mx_adapters::identity`]), `None` for an instance served without a control plane;
/// `reporter` where installs through the SGLang tensor route are reported.
///
/// # Errors
/// [`Error::Bind`] when the address cannot be bound.
pub async fn serve(
    inst: Instance,
    addr: SocketAddr,
    token: Option<String>,
    identity: Option<EngineIdentity>,
    reporter: Option<Reporter>,
) -> Result<HttpServer, Error> {
    if token.is_none() && !addr.ip().is_loopback() {
        return Err(Error::BadRequest {
            field: "http".into(),
            reason: format!(
                "engine routes on {addr} without a token: give --http-token-file \
                 (MX_ENGINE_TOKEN_FILE) or bind a loopback address"
            ),
        });
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    let failpoints = inst.config().failpoints;
    let ctx = Ctx {
        inst,
        url: Arc::new(format!("http://{addr}")),
        token: token.map(|t| Arc::new(format!("Bearer {t}"))),
        identity: identity.map(Arc::new),
        reporter: reporter.map(Arc::new),
        session: Arc::default(),
    };
    let mut router = Router::new()
        .route("/v1/rl/workers", get(discovery))
        .route("/engine/pause_generation", post(dynamo_pause))
        .route("/engine/update_weights_from_disk", post(dynamo_update))
        .route(
            "/engine/update_weights_from_distributed",
            post(dynamo_update_distributed),
        )
        .route(
            "/engine/get_weight_version",
            post(dynamo_version).get(dynamo_version),
        )
        .route("/engine/resume_generation", post(dynamo_resume))
        .route(
            "/engine/control/update_weights_from_disk",
            post(sglang_update),
        )
        .route(
            "/engine/control/update_weights_from_tensor",
            post(sglang_update_tensor),
        )
        // SGLang's weight-update session, as a Dynamo SGLang deployment configures it
        // (`--engine-route begin_weight_update:tm --engine-route end_weight_update:tm`).
        .route("/engine/begin_weight_update", post(sglang_begin))
        .route("/engine/end_weight_update", post(sglang_end))
        // A Dynamo SGLang worker's default native routes (its pause is Dynamo's route above,
        // which takes SGLang's modes too).
        .route("/engine/continue_generation", post(sglang_continue))
        .route("/generate", post(generate))
        .route("/mx/live_digests", get(live_digests))
        .route("/mx/identity", get(identity_route));
    if failpoints {
        router = router.route("/mx/failpoints", get(failpoints_get).post(failpoints_set));
    }
    let router = router
        .route_layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            refuse_when_retired,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            refuse_stale_epoch,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            require_token,
        ))
        .with_state(ctx.clone())
        // Probes and the scrape answer without the engine token (as probers and scrapers
        // expect); they expose counts, durations and readiness only.
        .merge(mx_control::observe::router(Arc::new(WorkerProbe {
            inst: ctx.inst,
        })));
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let res = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = res {
            tracing::error!("HTTP server on {addr} failed: {e}");
        }
    });
    Ok(HttpServer {
        addr,
        stop: Some(tx),
        task: Some(task),
    })
}

/// The worker's readiness: ready while it holds resident weights and is not retired.
struct WorkerProbe {
    inst: Instance,
}

impl mx_control::observe::Probe for WorkerProbe {
    fn ready(&self) -> Result<(), String> {
        if let Some(why) = self.inst.retired() {
            return Err(format!("retired: {why}"));
        }
        match self.inst.resident_version() {
            Some(_) => Ok(()),
            None => Err("no resident weights yet (nothing applied)".into()),
        }
    }
}

/// Refuses a call whose [`mx_adapters::EPOCH_HEADER`] is below the highest epoch seen (409: a
/// newer control-plane leader took over; the caller is deposed). A call without the header is
/// let through (clients other than a control plane); a malformed one is refused (400). An
/// admitted call's [`mx_adapters::REFIT_HEADER`] raises the highest refit id seen (400 when
/// malformed).
async fn refuse_stale_epoch(
    State(ctx): State<Ctx>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let shared = &ctx.inst.shared;
    let verdict = epoch_verdict(&shared.epoch, req.headers().get(mx_adapters::EPOCH_HEADER))
        .and_then(|()| {
            refit_seen(
                &shared.last_refit,
                req.headers().get(mx_adapters::REFIT_HEADER),
            )
        });
    match verdict {
        Ok(()) => next.run(req).await,
        Err((code, why)) => (code, Json(json!({"error": why}))).into_response(),
    }
}

/// The decimal `u64` of header `name` (`None` when absent), or 400 naming it and `what`.
fn header_u64(
    header: Option<&axum::http::HeaderValue>,
    name: &str,
    what: &str,
) -> Result<Option<u64>, (StatusCode, String)> {
    let Some(h) = header else {
        return Ok(None);
    };
    h.to_str()
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            (
                StatusCode::BAD_REQUEST,
                format!("{name}: not a decimal {what}: {h:?}"),
            )
        })
}

/// Raises `highest` to the refit id in `header` (absent: nothing to note).
fn refit_seen(
    highest: &std::sync::atomic::AtomicU64,
    header: Option<&axum::http::HeaderValue>,
) -> Result<(), (StatusCode, String)> {
    if let Some(id) = header_u64(header, mx_adapters::REFIT_HEADER, "refit id")? {
        highest.fetch_max(id, std::sync::atomic::Ordering::SeqCst);
    }
    Ok(())
}

/// Checks `header` against the highest epoch seen and raises it (see [`refuse_stale_epoch`]).
fn epoch_verdict(
    highest: &std::sync::atomic::AtomicU64,
    header: Option<&axum::http::HeaderValue>,
) -> Result<(), (StatusCode, String)> {
    let Some(epoch) = header_u64(header, mx_adapters::EPOCH_HEADER, "epoch")? else {
        return Ok(());
    };
    if let Err(seen) = crate::instance::admit_epoch(highest, epoch) {
        return Err((
            StatusCode::CONFLICT,
            format!(
                "control-plane epoch {epoch} is older than epoch {seen} already seen: a newer leader took over and this caller is deposed"
            ),
        ));
    }
    Ok(())
}

/// Refuses a request without the configured bearer token (401, before anything else runs).
async fn require_token(
    State(ctx): State<Ctx>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(want) = &ctx.token else {
        return next.run(req).await;
    };
    let got = req.headers().get(axum::http::header::AUTHORIZATION);
    // Compared through blake3 so the time taken does not depend on where they differ.
    let same = got.is_some_and(|g| blake3::hash(g.as_bytes()) == blake3::hash(want.as_bytes()));
    if same {
        next.run(req).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            Json(serde_json::json!({
                "error": "this worker's engine routes require `authorization: Bearer <token>` \
                          (MX_ENGINE_TOKEN_FILE on the control plane)"
            })),
        )
            .into_response()
    }
}

/// Every route answers 410 Gone once the instance is retired (another process holds its worker
/// id): `{"status": "error", "message": "worker ... was displaced: ..."}`.
async fn refuse_when_retired(
    State(ctx): State<Ctx>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match ctx.inst.retired() {
        Some(reason) => error_reply(&Error::Displaced {
            worker_id: ctx.inst.config().worker_id.clone(),
            reason: reason.to_string(),
        }),
        None => next.run(req).await,
    }
}

/// The HTTP status an error answers with.
pub fn status_of(e: &Error) -> StatusCode {
    match e {
        Error::BadRequest { .. } | Error::DiskMismatch { .. } | Error::Checkpoint(_) => {
            StatusCode::BAD_REQUEST
        }
        Error::Engine(crate::EngineError::BadRequest(_)) => StatusCode::BAD_REQUEST,
        Error::Puller(mx_puller::Error::UnknownVersion { .. }) => StatusCode::NOT_FOUND,
        Error::GenerationUnavailable { .. } => StatusCode::CONFLICT,
        Error::Displaced { .. } => StatusCode::GONE,
        Error::NoWeights | Error::Paused | Error::Aborted => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

// ---- body parsing -------------------------------------------------------------------------

/// The body as a JSON object; an empty body is `{}` (the failpoints route).
fn object(body: &Bytes) -> Result<Map<String, Value>, Error> {
    parse(body)
}

/// The body parsed into the contract's request type `T`; an empty body is `{}`. A field of the
/// wrong type is refused naming its path (e.g. `sampling_params.stop_token_ids[1]`); a body
/// that is not JSON, or not an object, is refused naming `body`.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Error> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    // serde reads a struct from an array too: the contracts want an object.
    if text.trim_ascii_start().first() != Some(&b'{') {
        return Err(match serde_json::from_slice::<Value>(text) {
            Ok(v) => bad(
                "body",
                format!(
                    "must be a JSON object, got {}",
                    mx_layout::strict_json::kind(&v)
                ),
            ),
            Err(e) => bad("body", format!("is not JSON: {e}")),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if !inner.is_data() {
            bad("body", format!("is not JSON: {inner}"))
        } else if path == "." {
            bad("body", inner.to_string())
        } else {
            bad(&path, inner.to_string())
        }
    })?;
    de.end()
        .map_err(|e| bad("body", format!("is not JSON: {e}")))?;
    Ok(value)
}

fn bad(field: &str, reason: impl Into<String>) -> Error {
    Error::BadRequest {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// `body` serialized as JSON with `status`.
fn reply(status: StatusCode, body: &impl Serialize) -> Response {
    (status, Json(body)).into_response()
}

// ---- Dynamo vLLM RL -----------------------------------------------------------------------

/// A stable JSON-safe (< 2^53) number for this worker's id.
fn instance_id(worker_id: &str) -> u64 {
    let h = blake3::hash(worker_id.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b) & ((1 << 53) - 1)
}

async fn discovery(State(ctx): State<Ctx>) -> Response {
    let cfg = ctx.inst.config();
    let worker = WorkerInfo {
        namespace: "dynamo".into(),
        component: "worker".into(),
        endpoint: "generate".into(),
        instance_id: InstanceId::Number(instance_id(&cfg.worker_id).into()),
        transport: "http".into(),
        request_plane_url: format!("{}/generate", ctx.url),
        system_url: Some(ctx.url.to_string()),
        admin_base_url: None,
        model: Some(crate::instance::model_name(&cfg.model_dir)),
        routes: DYNAMO_ROUTES.map(String::from).to_vec(),
        world_size: Some(u64::from(cfg.layout.world_size)),
        error: None,
    };
    let answer = WorkersResponse {
        protocol_version: Some(1),
        namespace: "dynamo".into(),
        workers: Some(vec![worker]),
        system_routes: None,
    };
    reply(StatusCode::OK, &answer)
}

/// A Dynamo answer as ai-dynamo 1.6.1 gives it: HTTP 200 with `{"status": "ok", "message",
/// "version", "version_declared"}` or `{"status": "error", "message", ...}` (the version is
/// `null` with `version_declared: false` while none is resident). Only mx's own refusals keep
/// their status: a displaced worker (410), a fenced leader (409).
fn dynamo_answer(inst: &Instance, res: Result<String, Error>) -> Response {
    let version = inst.resident_version().map(|v| v.to_string());
    let answer = match res {
        Ok(message) => EngineResponse::ok(message, version),
        Err(e @ Error::Displaced { .. }) => {
            return reply(
                status_of(&e),
                &EngineResponse::error(e.to_string(), version),
            )
        }
        Err(e) => EngineResponse::error(e.to_string(), version),
    };
    reply(StatusCode::OK, &with_declared(answer))
}

/// `version_declared`: whether the answer names a version.
fn with_declared(mut a: EngineResponse) -> EngineResponse {
    a.version_declared = Some(a.version.is_some());
    a
}

/// Dynamo refuses an update unless the worker is paused (`allow_unpaused` aside).
fn require_paused(inst: &Instance, allow_unpaused: bool) -> Result<(), Error> {
    if inst.paused().is_some() || allow_unpaused {
        return Ok(());
    }
    Err(Error::BadRequest {
        field: "pause_generation".into(),
        reason: "Worker must be paused via pause_generation() before updating weights. Call \
                 pause_generation() first, then update, then resume_generation()."
            .into(),
    })
}

async fn dynamo_pause(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let r: dynamo_wire::PauseRequest = parse(&body)?;
        // Dynamo 1.6.1's defaults.
        let mode = r.mode.unwrap_or(PauseMode::Keep);
        let clear = r.clear_cache.unwrap_or(false);
        let out = ctx.inst.pause(mode, clear).await?;
        Ok::<_, Error>(format!(
            "generation paused (mode {}): {} request(s) were in flight, {} held{}",
            mode.as_str(),
            out.in_flight,
            out.held,
            if clear { ", caches cleared" } else { "" }
        ))
    }
    .await;
    dynamo_answer(&ctx.inst, res)
}

/// The answer of an update: [`dynamo_answer`] plus mx's `cache_tiers_cleared` and
/// `apply_seconds`.
async fn dynamo_apply(ctx: &Ctx, source: Result<ApplySource, Error>) -> Response {
    let t0 = Instant::now();
    let res = match source {
        Ok(source) => ctx.inst.apply(source).await,
        Err(e) => Err(e),
    };
    let version = ctx.inst.resident_version().map(|v| v.to_string());
    let mut answer = match res {
        Ok(out) => {
            let mut a = EngineResponse::ok(
                format!("weights updated to {} ({:?})", out.version, out.kind),
                version,
            );
            a.cache_tiers_cleared = Some(out.cache_tiers_cleared);
            a.apply_seconds = Some(out.seconds);
            a
        }
        Err(e @ Error::Displaced { .. }) => {
            return reply(
                status_of(&e),
                &EngineResponse::error(e.to_string(), version),
            )
        }
        Err(e) => {
            let mut a = EngineResponse::error(e.to_string(), version);
            a.cache_tiers_cleared = Some(Vec::new());
            a.apply_seconds = Some(t0.elapsed().as_secs_f64());
            a
        }
    };
    answer = with_declared(answer);
    reply(StatusCode::OK, &answer)
}

async fn dynamo_update(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let source = parse::<dynamo_wire::UpdateWeightsRequest>(&body).and_then(|r| {
        require_paused(&ctx.inst, false)?;
        ApplySource::from_model_path(
            r.model_path.as_deref().unwrap_or_default(),
            r.weight_version.as_deref().unwrap_or_default(),
        )
    });
    dynamo_apply(&ctx, source).await
}

/// `update_weights_from_distributed` with `engine_rpc: "mx_install"` (the only rpc this worker
/// has): installs `version_id`, as mx's vLLM plugin does inside a Dynamo worker.
async fn dynamo_update_distributed(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let source = parse::<Map<String, Value>>(&body).and_then(|mut o| {
        let allow_unpaused = match o.remove("allow_unpaused") {
            None => false,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(Error::BadRequest {
                    field: "allow_unpaused".into(),
                    reason: "'allow_unpaused' must be a boolean".into(),
                })
            }
        };
        require_paused(&ctx.inst, allow_unpaused)?;
        let r: dynamo_wire::UpdateFromDistributedRequest = serde_json::from_value(Value::Object(o))
            .map_err(|e| Error::BadRequest {
                field: "body".into(),
                reason: e.to_string(),
            })?;
        let rpc = r
            .engine_rpc
            .as_deref()
            .unwrap_or("update_weights_from_path");
        if rpc != dynamo_wire::MX_INSTALL_RPC {
            return Err(Error::BadRequest {
                field: "engine_rpc".into(),
                reason: format!(
                    "Call to collective_rpc method failed: Method {rpc} is not implemented."
                ),
            });
        }
        let id = r.version_id.unwrap_or_default();
        ApplySource::from_version_id(&id, r.weight_version.as_deref().unwrap_or_default())
    });
    dynamo_apply(&ctx, source).await
}

async fn dynamo_version(State(ctx): State<Ctx>) -> Response {
    let message = match ctx.inst.resident_version() {
        Some(v) => format!("resident version {v}"),
        None => "no weights resident".to_string(),
    };
    dynamo_answer(&ctx.inst, Ok(message))
}

async fn dynamo_resume(State(ctx): State<Ctx>) -> Response {
    ctx.inst.resume();
    dynamo_answer(&ctx.inst, Ok("generation resumed".into()))
}

// ---- SGLang -------------------------------------------------------------------------------

/// A Dynamo SGLang answer as ai-dynamo 1.6.1 gives it: HTTP 200 with the success given, or
/// with `{success: false, message}` (SGLang's failures are in the body); only mx's own refusal
/// keeps its status: a displaced worker (410).
fn sglang_reply(res: Result<UpdateWeightsResponse, Error>) -> Response {
    match res {
        Ok(answer) => reply(StatusCode::OK, &answer),
        Err(e @ Error::Displaced { .. }) => reply(
            status_of(&e),
            &UpdateWeightsResponse::new(false, e.to_string()),
        ),
        Err(e) => reply(
            StatusCode::OK,
            &UpdateWeightsResponse::new(false, e.to_string()),
        ),
    }
}

async fn sglang_update(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let r: sglang_wire::UpdateWeightsRequest = parse(&body)?;
        let flush = r.flush_cache.unwrap_or(true);
        let keep_pause = r.keep_pause.unwrap_or(false);
        let abort = r.abort_all_requests.unwrap_or(false);
        let source = ApplySource::from_model_path(
            r.model_path.as_deref().unwrap_or_default(),
            r.weight_version.as_deref().unwrap_or_default(),
        )?;
        // The update runs paused: requests in flight are held (or aborted) meanwhile.
        let was_paused = ctx.inst.paused().is_some();
        let paused_requests = if was_paused {
            ctx.inst.shared.gate.held()
        } else {
            let mode = if abort {
                PauseMode::Abort
            } else {
                PauseMode::Keep
            };
            ctx.inst.pause(mode, false).await?.held
        };
        let res = ctx.inst.apply_with(source, flush).await;
        if !was_paused && !keep_pause {
            ctx.inst.resume();
        }
        let out = res?;
        Ok::<_, Error>(UpdateWeightsResponse {
            num_paused_requests: Some(paused_requests),
            cache_tiers_cleared: Some(out.cache_tiers_cleared),
            ..UpdateWeightsResponse::new(
                true,
                format!("weights updated to {} ({:?})", out.version, out.kind),
            )
        })
    }
    .await;
    sglang_reply(res)
}

/// `POST /engine/begin_weight_update`: opens the session (`{success: false}` when one is open).
async fn sglang_begin(State(ctx): State<Ctx>, body: Bytes) -> Response {
    use std::sync::atomic::Ordering;
    let res = parse::<Map<String, Value>>(&body).map(|_| {
        if ctx.session.swap(true, Ordering::SeqCst) {
            UpdateWeightsResponse::new(
                false,
                "a weight-update session is already open; call end_weight_update() first",
            )
        } else {
            UpdateWeightsResponse::new(true, "Success")
        }
    });
    sglang_reply(res)
}

/// `POST /engine/end_weight_update`: closes the session (`{success: false}` when none is open).
async fn sglang_end(State(ctx): State<Ctx>, body: Bytes) -> Response {
    use std::sync::atomic::Ordering;
    let res = parse::<Map<String, Value>>(&body).map(|_| {
        if ctx.session.swap(false, Ordering::SeqCst) {
            UpdateWeightsResponse::new(true, "Success")
        } else {
            UpdateWeightsResponse::new(
                false,
                "no weight-update session is open; call begin_weight_update() first",
            )
        }
    });
    sglang_reply(res)
}

/// The version a Dynamo SGLang `update_weights_from_tensor` names to mx's loader: each held
/// rank reads its own element of `serialized_named_tensors` (as SGLang's ranks do), and they
/// must agree (this process installs one version for all its ranks).
fn tensor_update_source(
    inst: &Instance,
    r: &UpdateFromTensorRequest,
) -> Result<ApplySource, Error> {
    let loader = mx_adapters::sglang::LOADER;
    if r.load_format.as_deref() != Some(loader) {
        return Err(bad(
            "load_format",
            format!(
                "{:?}: this engine installs only through mx's loader ({loader})",
                r.load_format
            ),
        ));
    }
    let mut name: Option<String> = None;
    for &rank in &inst.config().ranks {
        let field = format!("serialized_named_tensors[{rank}]");
        let one = r
            .serialized_named_tensors
            .get(rank as usize)
            .ok_or_else(|| {
                bad(
                    &field,
                    format!(
                        "missing: {} given, one per tensor-parallel rank",
                        r.serialized_named_tensors.len()
                    ),
                )
            })?;
        let this = mx_adapters::sglang::marker_name(one).map_err(|e| bad(&field, e))?;
        match &name {
            Some(n) if *n != this => {
                return Err(bad(&field, format!("names {this:?}, another rank {n:?}")))
            }
            _ => name = Some(this),
        }
    }
    let name = name.ok_or_else(|| bad("serialized_named_tensors", "this worker holds no rank"))?;
    ApplySource::from_version_id(&name, r.weight_version.as_deref().unwrap_or_default())
}

/// `POST /engine/control/update_weights_from_tensor` with mx's loader, as a Dynamo SGLang worker
/// runs it, inside a weight-update session: the named version is installed (pausing meanwhile unless paused, as SGLang holds its
/// model-update lock), the cache flushed when `flush_cache` (default true), and the route
/// answers `{success: true, message: "Success"}` whatever the install did, as SGLang does with a
/// custom loader; what the ranks hold, and why an install failed, goes to the control plane
/// first ([`Reporter`]). A body mx's loader could not read is refused (`success: false`).
async fn sglang_update_tensor(State(ctx): State<Ctx>, body: Bytes) -> Response {
    if !ctx.session.load(std::sync::atomic::Ordering::SeqCst) {
        return sglang_reply(Ok(UpdateWeightsResponse::new(
            false,
            "update_weights_from_tensor must run between begin_weight_update() and \
             end_weight_update()",
        )));
    }
    let parsed = parse::<UpdateFromTensorRequest>(&body).and_then(|r| {
        Ok((
            tensor_update_source(&ctx.inst, &r)?,
            r.flush_cache.unwrap_or(true),
        ))
    });
    let (source, flush) = match parsed {
        Ok(p) => p,
        Err(e) => return sglang_reply(Err(e)),
    };
    let before = ctx.inst.resident_version();
    let was_paused = ctx.inst.paused().is_some();
    let res = async {
        if !was_paused {
            ctx.inst.pause(PauseMode::Keep, false).await?;
        }
        let res = ctx.inst.apply_with(source, flush).await;
        if !was_paused {
            ctx.inst.resume();
        }
        res
    }
    .await;
    let error = match res {
        Ok(_) => String::new(),
        Err(e) => {
            let holds = ctx
                .inst
                .resident_version()
                .map_or_else(|| "none".to_string(), |v| v.to_string());
            let before = before.map_or_else(|| "none".to_string(), |v| v.to_string());
            format!("installing failed: {e}; it holds {holds} (held {before} before)")
        }
    };
    if let Some(r) = &ctx.reporter {
        let resident = ctx.inst.resident_version();
        let report =
            r.client
                .report_resident(&r.worker_id, r.incarnation, resident.as_ref(), &error);
        match tokio::time::timeout(std::time::Duration::from_secs(10), report).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(worker = %r.worker_id, "reporting what it holds: {e}"),
            Err(_) => {
                tracing::warn!(worker = %r.worker_id, "reporting what it holds: no answer in 10 s")
            }
        }
    }
    if !error.is_empty() {
        tracing::warn!("update_weights_from_tensor: {error}");
    }
    sglang_reply(Ok(UpdateWeightsResponse::new(true, "Success")))
}

/// `POST /engine/continue_generation` (a Dynamo SGLang worker's): `{"status": "ok"}`.
async fn sglang_continue(State(ctx): State<Ctx>, body: Bytes) -> Response {
    // No GPU allocator here: torch_empty_cache is accepted (and type-checked) and has nothing
    // to free.
    let res = parse::<sglang_wire::ContinueRequest>(&body).map(|_| {
        ctx.inst.resume();
        "generation continued".to_string()
    });
    dynamo_answer(&ctx.inst, res)
}

// ---- generation ---------------------------------------------------------------------------

/// A `/generate` body as the engine's request: token ids only (no tokenizer), greedy only.
fn parse_generate(body: &Bytes) -> Result<GenerateRequest, Error> {
    let r: generate_wire::GenerateRequest = parse(body)?;
    let input_ids = match (r.input_ids, r.text) {
        (Some(ids), _) => ids,
        (None, Some(_)) => {
            return Err(bad(
                "text",
                "text prompts are not supported (this engine has no tokenizer): send input_ids",
            ))
        }
        (None, None) => return Err(bad("input_ids", "is missing")),
    };
    let sp = r.sampling_params.unwrap_or_default();
    let max_new_tokens = match sp.max_new_tokens {
        None => DEFAULT_MAX_NEW_TOKENS,
        Some(n) => usize::try_from(n).map_err(|_| {
            bad(
                "sampling_params.max_new_tokens",
                format!("{n} does not fit this machine's usize"),
            )
        })?,
    };
    if let Some(t) = sp.temperature.filter(|t| *t != 0.0) {
        return Err(bad(
            "sampling_params.temperature",
            format!("{t}: this engine decodes greedily only (temperature 0 or absent)"),
        ));
    }
    // The end-of-sequence token is never a default stop here, so ignore_eos changes nothing;
    // it is accepted (and type-checked) for SGLang clients that send it.
    Ok(GenerateRequest {
        input_ids,
        max_new_tokens,
        stop_token_ids: sp.stop_token_ids.unwrap_or_default(),
    })
}

async fn generate(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let req = parse_generate(&body)?;
        ctx.inst.generate(req).await
    }
    .await;
    match res {
        Ok(out) => {
            let finish_reason = match out.finish_reason {
                FinishReason::Length(n) => generate_wire::FinishReason::Length { length: n as u64 },
                FinishReason::Stop(t) => generate_wire::FinishReason::Stop { matched: t },
            };
            let answer = GenerateResponse {
                output_ids: out.output_ids,
                meta_info: MetaInfo {
                    weight_version: out.weight_version.map(|v| v.to_string()),
                    prompt_tokens: Some(out.prompt_tokens as u64),
                    completion_tokens: Some(out.completion_tokens as u64),
                    cached_tokens: Some(out.cached_tokens as u64),
                    finish_reason: Some(finish_reason),
                },
            };
            reply(StatusCode::OK, &answer)
        }
        Err(e) => {
            let status = status_of(&e);
            let answer = ErrorResponse {
                error: ErrorBody {
                    message: e.to_string(),
                    code: status.as_u16(),
                },
            };
            reply(status, &answer)
        }
    }
}

// ---- identity -----------------------------------------------------------------------------

/// `GET /mx/identity`: the worker this engine serves (behind the engine token, like every
/// engine route); 404 when the instance follows no control plane.
async fn identity_route(State(ctx): State<Ctx>) -> Response {
    match &ctx.identity {
        Some(id) => Json(IdentityResponse {
            engines: vec![EngineIdentity::clone(id)],
        })
        .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"status": "error", "message": "this engine follows no control plane"})),
        )
            .into_response(),
    }
}

// ---- live digests -------------------------------------------------------------------------

async fn live_digests(State(ctx): State<Ctx>) -> Response {
    match ctx.inst.live_digests().await {
        Ok(Some((version, ranks))) => {
            let ranks: Vec<Value> = ranks
                .iter()
                .map(|r| {
                    let tensors: Map<String, Value> = r
                        .tensors
                        .iter()
                        .map(|(k, d)| (k.clone(), Value::String(d.to_string())))
                        .collect();
                    json!({"rank": r.rank, "tensors": tensors})
                })
                .collect();
            Json(json!({"version": version, "ranks": ranks})).into_response()
        }
        Ok(None) => error_reply(&Error::NoWeights),
        Err(e) => error_reply(&e),
    }
}

fn error_reply(e: &Error) -> Response {
    (
        status_of(e),
        Json(json!({"status": "error", "message": e.to_string()})),
    )
        .into_response()
}

// ---- failpoints ---------------------------------------------------------------------------

async fn failpoints_get(State(ctx): State<Ctx>) -> Response {
    Json(ctx.inst.failpoints().to_json()).into_response()
}

async fn failpoints_set(State(ctx): State<Ctx>, body: Bytes) -> Response {
    match object(&body).and_then(|m| ctx.inst.shared.failpoints.set(&m)) {
        Ok(v) => {
            tracing::warn!(failpoints = %v.to_json(), "failpoints set");
            Json(json!({"status": "ok", "failpoints": v.to_json()})).into_response()
        }
        Err(e) => error_reply(&e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn obj(v: Value) -> Bytes {
        Bytes::from(v.to_string())
    }

    #[test]
    fn a_lower_epoch_is_refused_and_a_higher_one_raises_the_bar() {
        use axum::http::HeaderValue;
        let seen = std::sync::atomic::AtomicU64::new(0);
        assert!(epoch_verdict(&seen, None).is_ok());
        assert!(epoch_verdict(&seen, Some(&HeaderValue::from(7u64))).is_ok());
        assert!(epoch_verdict(&seen, Some(&HeaderValue::from(7u64))).is_ok());
        let (code, why) = epoch_verdict(&seen, Some(&HeaderValue::from(6u64))).unwrap_err();
        assert_eq!(code, StatusCode::CONFLICT);
        assert!(why.contains("epoch 6 is older than epoch 7"), "{why}");
        assert!(epoch_verdict(&seen, Some(&HeaderValue::from(9u64))).is_ok());
        assert!(epoch_verdict(&seen, Some(&HeaderValue::from(7u64))).is_err());
        // Without the header (not a control plane) the call goes through.
        assert!(epoch_verdict(&seen, None).is_ok());
        let (code, _) = epoch_verdict(&seen, Some(&HeaderValue::from_static("nine"))).unwrap_err();
        assert_eq!(code, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn generate_requests_are_checked_field_by_field() {
        let r = parse_generate(&obj(json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}))).unwrap();
        assert_eq!(
            r,
            GenerateRequest {
                input_ids: vec![1, 2],
                max_new_tokens: 3,
                stop_token_ids: vec![]
            }
        );
        let r = parse_generate(&obj(json!({"input_ids": [5]}))).unwrap();
        assert_eq!(r.max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        for (body, field) in [
            (json!({"input_ids": [1, -2]}), "input_ids[1]"),
            (json!({"input_ids": "hi"}), "input_ids"),
            (json!({"text": "hi"}), "text"),
            (json!({}), "input_ids"),
            (
                json!({"input_ids": [1], "sampling_params": {"temperature": 0.7}}),
                "sampling_params.temperature",
            ),
            (
                json!({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}),
                "sampling_params.max_new_tokens",
            ),
            (
                json!({"input_ids": [1], "sampling_params": {"stop_token_ids": [2, "x"]}}),
                "sampling_params.stop_token_ids[1]",
            ),
        ] {
            let e = parse_generate(&obj(body.clone())).unwrap_err();
            assert!(
                matches!(&e, Error::BadRequest { field: f, .. } if f == field),
                "{body}: {e}"
            );
        }
    }

    #[test]
    fn bodies_must_be_objects() {
        assert!(object(&Bytes::from_static(b"")).unwrap().is_empty());
        assert!(object(&Bytes::from_static(b"[1]")).is_err());
        assert!(object(&Bytes::from_static(b"{")).is_err());
        for body in [
            &b"[1]"[..],
            b"{",
            b"{} x",
            b"{\"mode\": \"keep\", \"mode\": \"wait\"}",
        ] {
            let e = parse::<dynamo_wire::PauseRequest>(&Bytes::copy_from_slice(body)).unwrap_err();
            assert!(
                matches!(&e, Error::BadRequest { field, .. } if field == "body"),
                "{e}"
            );
        }
        let e = parse::<dynamo_wire::PauseRequest>(&obj(json!({"mode": "fast"}))).unwrap_err();
        assert!(
            matches!(&e, Error::BadRequest { field, reason } if field == "mode" && reason.contains("keep, wait, abort")),
            "{e}"
        );
        let r: dynamo_wire::PauseRequest =
            parse(&obj(json!({"mode": "in_place", "unknown": 1}))).unwrap();
        assert_eq!(r.mode, Some(PauseMode::InPlace));
    }

    #[test]
    fn instance_ids_are_stable_and_json_safe() {
        assert_eq!(instance_id("w0"), instance_id("w0"));
        assert_ne!(instance_id("w0"), instance_id("w1"));
        assert!(instance_id("w0") < 1 << 53);
    }
}
