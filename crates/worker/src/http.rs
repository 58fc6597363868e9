//! The HTTP server: both engine weight-update contracts (Dynamo vLLM RL and SGLang), SGLang-style
//! `/generate`, the read-only `GET /mx/live_digests`, and the failpoints. Field names follow the
//! contracts exactly; every body is parsed by hand so a bad field is answered with a JSON error
//! naming it.
//!
//! `GET /mx/live_digests` (mx's own, not an engine contract) answers what is live, hashed from
//! the live bytes at the time of the request: `{"version": "<resident version id>", "ranks":
//! [{"rank": r, "tensors": {"<parameter>": "<blake3 hex of its live bytes>"}}]}` in the order of
//! the ranks held, or 503 `{"status": "error", "message": ...}` while no weights are live.
//! Orchestrators check live bytes with it (`mx demo` compares them with slices of the
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
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

use crate::gate::PauseMode;
use crate::instance::{ApplySource, FinishReason, GenerateRequest, Instance};
use crate::Error;

/// Routes every Dynamo worker lists in discovery.
pub const DYNAMO_ROUTES: [&str; 4] = [
    "pause_generation",
    "update_weights_from_disk",
    "get_weight_version",
    "resume_generation",
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
}

/// Binds `addr` and serves `inst`'s routes on it until the returned server is shut down.
///
/// # Errors
/// [`Error::Bind`] when the address cannot be bound.
pub async fn serve(inst: Instance, addr: SocketAddr) -> Result<HttpServer, Error> {
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
    };
    let mut router = Router::new()
        .route("/v1/rl/workers", get(discovery))
        .route("/engine/pause_generation", post(dynamo_pause))
        .route("/engine/update_weights_from_disk", post(dynamo_update))
        .route(
            "/engine/get_weight_version",
            post(dynamo_version).get(dynamo_version),
        )
        .route("/engine/resume_generation", post(dynamo_resume))
        .route(
            "/engine/control/update_weights_from_disk",
            post(sglang_update),
        )
        .route("/engine/control/pause_generation", post(sglang_pause))
        .route("/engine/control/continue_generation", post(sglang_continue))
        .route("/generate", post(generate))
        .route("/mx/live_digests", get(live_digests));
    if failpoints {
        router = router.route("/mx/failpoints", get(failpoints_get).post(failpoints_set));
    }
    let router = router
        .route_layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            refuse_when_retired,
        ))
        .with_state(ctx);
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
        Error::Engine(mx_engine::Error::BadRequest { .. }) => StatusCode::BAD_REQUEST,
        Error::Puller(mx_puller::Error::UnknownVersion { .. }) => StatusCode::NOT_FOUND,
        Error::GenerationUnavailable { .. } => StatusCode::CONFLICT,
        Error::Displaced { .. } => StatusCode::GONE,
        Error::NoWeights | Error::Paused | Error::Aborted => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

// ---- body parsing -------------------------------------------------------------------------

/// The body as a JSON object; an empty body is `{}`.
fn object(body: &Bytes) -> Result<Map<String, Value>, Error> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(Error::BadRequest {
            field: "body".into(),
            reason: format!("must be a JSON object, got {}", kind(&other)),
        }),
        Err(e) => Err(Error::BadRequest {
            field: "body".into(),
            reason: format!("is not JSON: {e}"),
        }),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn bad(field: &str, reason: impl Into<String>) -> Error {
    Error::BadRequest {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn opt_str(m: &Map<String, Value>, field: &str) -> Result<Option<String>, Error> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad(field, format!("must be a string, got {}", kind(v)))),
    }
}

fn opt_bool(m: &Map<String, Value>, field: &str) -> Result<Option<bool>, Error> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(field, format!("must be a boolean, got {}", kind(v)))),
    }
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
    Json(json!({
        "protocol_version": 1,
        "namespace": "mx",
        "workers": [{
            "namespace": "mx",
            "component": "worker",
            "endpoint": "generate",
            "instance_id": instance_id(&cfg.worker_id),
            "transport": "http",
            "request_plane_url": format!("{}/generate", ctx.url),
            "system_url": ctx.url.as_str(),
            "model": crate::instance::model_name(&cfg.model_dir),
            "routes": DYNAMO_ROUTES,
            "world_size": cfg.layout.world_size,
        }],
    }))
    .into_response()
}

fn dynamo_reply(inst: &Instance, res: Result<(String, Extra), (Error, Extra)>) -> Response {
    let version = inst.resident_version().unwrap_or_default();
    match res {
        Ok((message, extra)) => {
            let mut body = json!({"status": "ok", "message": message, "version": version});
            if let Value::Object(m) = &mut body {
                m.extend(extra);
            }
            (StatusCode::OK, Json(body)).into_response()
        }
        Err((e, extra)) => {
            let mut body = json!({"status": "error", "message": e.to_string(), "version": version});
            if let Value::Object(m) = &mut body {
                m.extend(extra);
            }
            (status_of(&e), Json(body)).into_response()
        }
    }
}

/// Extra fields of a Dynamo answer.
type Extra = Map<String, Value>;

fn no_extra(e: Error) -> (Error, Extra) {
    (e, Extra::new())
}

async fn dynamo_pause(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let m = object(&body)?;
        let mode = match opt_str(&m, "mode")? {
            Some(s) => crate::gate::parse_mode(&s)?,
            None => PauseMode::Abort,
        };
        let clear = opt_bool(&m, "clear_cache")?.unwrap_or(true);
        let out = ctx.inst.pause(mode, clear).await?;
        Ok::<_, Error>((
            format!(
                "generation paused (mode {}): {} request(s) were in flight, {} held{}",
                mode.as_str(),
                out.in_flight,
                out.held,
                if clear { ", caches cleared" } else { "" }
            ),
            Extra::new(),
        ))
    }
    .await;
    dynamo_reply(&ctx.inst, res.map_err(no_extra))
}

async fn dynamo_update(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let res = async {
        let m = object(&body)?;
        let path = opt_str(&m, "model_path")?.unwrap_or_default();
        let wv = opt_str(&m, "weight_version")?.unwrap_or_default();
        let source = ApplySource::from_model_path(&path, &wv)?;
        let out = ctx.inst.apply(source).await?;
        let mut extra = Extra::new();
        extra.insert("cache_tiers_cleared".into(), json!(out.cache_tiers_cleared));
        extra.insert("apply_seconds".into(), json!(out.seconds));
        Ok::<_, Error>((
            format!("weights updated to {} ({:?})", out.version, out.kind),
            extra,
        ))
    }
    .await;
    let res = res.map_err(|e| {
        let mut extra = Extra::new();
        extra.insert("cache_tiers_cleared".into(), json!([]));
        extra.insert("apply_seconds".into(), json!(t0.elapsed().as_secs_f64()));
        (e, extra)
    });
    dynamo_reply(&ctx.inst, res)
}

async fn dynamo_version(State(ctx): State<Ctx>) -> Response {
    let message = match ctx.inst.resident_version() {
        Some(v) => format!("resident version {v}"),
        None => "no weights resident".to_string(),
    };
    dynamo_reply(&ctx.inst, Ok((message, Extra::new())))
}

async fn dynamo_resume(State(ctx): State<Ctx>) -> Response {
    ctx.inst.resume();
    dynamo_reply(&ctx.inst, Ok(("generation resumed".into(), Extra::new())))
}

// ---- SGLang -------------------------------------------------------------------------------

fn sglang_reply(res: Result<Map<String, Value>, Error>) -> Response {
    match res {
        Ok(m) => (StatusCode::OK, Json(Value::Object(m))).into_response(),
        Err(e) => (
            status_of(&e),
            Json(json!({"success": false, "message": e.to_string()})),
        )
            .into_response(),
    }
}

fn ok_message(message: String) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("success".into(), Value::Bool(true));
    m.insert("message".into(), Value::String(message));
    m
}

async fn sglang_update(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let m = object(&body)?;
        let path = opt_str(&m, "model_path")?.unwrap_or_default();
        let wv = opt_str(&m, "weight_version")?.unwrap_or_default();
        let flush = opt_bool(&m, "flush_cache")?.unwrap_or(true);
        let keep_pause = opt_bool(&m, "keep_pause")?.unwrap_or(false);
        let abort = opt_bool(&m, "abort_all_requests")?.unwrap_or(false);
        let source = ApplySource::from_model_path(&path, &wv)?;
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
        let mut reply = ok_message(format!(
            "weights updated to {} ({:?})",
            out.version, out.kind
        ));
        reply.insert("num_paused_requests".into(), json!(paused_requests));
        reply.insert("cache_tiers_cleared".into(), json!(out.cache_tiers_cleared));
        Ok::<_, Error>(reply)
    }
    .await;
    sglang_reply(res)
}

async fn sglang_pause(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let m = object(&body)?;
        let mode = match opt_str(&m, "mode")? {
            Some(s) => crate::gate::parse_mode(&s)?,
            None => PauseMode::Abort,
        };
        let out = ctx.inst.pause(mode, false).await?;
        Ok::<_, Error>(ok_message(format!(
            "generation paused (mode {}): {} request(s) were in flight, {} held",
            mode.as_str(),
            out.in_flight,
            out.held
        )))
    }
    .await;
    sglang_reply(res)
}

async fn sglang_continue(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = object(&body).and_then(|m| {
        // No GPU allocator here: torch_empty_cache is accepted and has nothing to free.
        opt_bool(&m, "torch_empty_cache")?;
        ctx.inst.resume();
        Ok(ok_message("generation continued".into()))
    });
    sglang_reply(res)
}

// ---- generation ---------------------------------------------------------------------------

fn parse_generate(m: &Map<String, Value>) -> Result<GenerateRequest, Error> {
    let ids = match m.get("input_ids") {
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(bad(
                "input_ids",
                format!("must be an array of token ids, got {}", kind(v)),
            ))
        }
        None if m.contains_key("text") => {
            return Err(bad(
                "text",
                "text prompts are not supported (this engine has no tokenizer): send input_ids",
            ))
        }
        None => return Err(bad("input_ids", "is missing")),
    };
    let input_ids = ids
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(&format!("input_ids[{i}]"), format!("{v} is not a token id")))
        })
        .collect::<Result<Vec<u32>, Error>>()?;
    let sp = match m.get("sampling_params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => {
            return Err(bad(
                "sampling_params",
                format!("must be an object, got {}", kind(v)),
            ))
        }
    };
    let max_new_tokens = match sp.get("max_new_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_NEW_TOKENS,
        Some(v) => v
            .as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| {
                bad(
                    "sampling_params.max_new_tokens",
                    format!("{v} is not a non-negative integer"),
                )
            })?,
    };
    match sp.get("temperature") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_f64() == Some(0.0) => {}
        Some(v) => {
            return Err(bad(
                "sampling_params.temperature",
                format!("{v}: this engine decodes greedily only (temperature 0 or absent)"),
            ))
        }
    }
    let stop_token_ids = match sp.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| {
                        bad(
                            &format!("sampling_params.stop_token_ids[{i}]"),
                            format!("{v} is not a token id"),
                        )
                    })
            })
            .collect::<Result<Vec<u32>, Error>>()?,
        Some(v) => {
            return Err(bad(
                "sampling_params.stop_token_ids",
                format!("must be an array of token ids, got {}", kind(v)),
            ))
        }
    };
    // The end-of-sequence token is never a default stop here, so ignore_eos changes nothing;
    // it is accepted (and type-checked) for SGLang clients that send it.
    opt_bool(&sp, "ignore_eos").map_err(|_| {
        bad(
            "sampling_params.ignore_eos",
            "must be a boolean".to_string(),
        )
    })?;
    Ok(GenerateRequest {
        input_ids,
        max_new_tokens,
        stop_token_ids,
    })
}

async fn generate(State(ctx): State<Ctx>, body: Bytes) -> Response {
    let res = async {
        let m = object(&body)?;
        let req = parse_generate(&m)?;
        ctx.inst.generate(req).await
    }
    .await;
    match res {
        Ok(out) => {
            let finish = match out.finish_reason {
                FinishReason::Length(n) => json!({"type": "length", "length": n}),
                FinishReason::Stop(t) => json!({"type": "stop", "matched": t}),
            };
            Json(json!({
                "output_ids": out.output_ids,
                "meta_info": {
                    "weight_version": out.weight_version,
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens,
                    "finish_reason": finish,
                },
            }))
            .into_response()
        }
        Err(e) => {
            let status = status_of(&e);
            (
                status,
                Json(json!({"error": {"message": e.to_string(), "code": status.as_u16()}})),
            )
                .into_response()
        }
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

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
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
    }

    #[test]
    fn instance_ids_are_stable_and_json_safe() {
        assert_eq!(instance_id("w0"), instance_id("w0"));
        assert_ne!(instance_id("w0"), instance_id("w1"));
        assert!(instance_id("w0") < 1 << 53);
    }
}
