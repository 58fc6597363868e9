//! The vLLM adapter against an HTTP server on loopback impersonating vLLM 0.32.0's RL and
//! completion routes (`vllm/entrypoints/rl/online/api_router.py`,
//! `vllm/entrypoints/serve/dev/cache/api_router.py`): every request's method, path, query and
//! body is recorded and asserted; answers follow the contract unless a test scripts others.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::Router;
use mx_adapters::vllm::{VllmClient, RESET_PREFIX_CACHE_TRIES};
use mx_adapters::Error;
use mx_adapters::PauseMode;
use serde_json::{json, Value};

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    method: String,
    path: String,
    query: Option<String>,
    /// The JSON body, `Null` when there was none.
    body: Value,
}

fn call(method: &str, path: &str, query: Option<&str>, body: Value) -> Call {
    Call {
        method: method.into(),
        path: path.into(),
        query: query.map(str::to_string),
        body,
    }
}

#[derive(Default)]
struct Vllm {
    calls: Vec<Call>,
    paused: bool,
    weight_version: Option<String>,
    /// Answers to give instead of the contract's, per path, in order: (status, content type,
    /// body).
    script: HashMap<&'static str, VecDeque<(u16, &'static str, String)>>,
    /// Never answer (a hung server).
    hang: bool,
}

type Shared = Arc<Mutex<Vllm>>;

const JSON: &str = "application/json";

fn ok(v: Value) -> (u16, &'static str, String) {
    (200, JSON, v.to_string())
}

async fn route(
    State(s): State<Shared>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
    let hang = s.lock().unwrap().hang;
    if hang {
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap()
    };
    let path = uri.path().to_string();
    let mut e = s.lock().unwrap();
    e.calls.push(Call {
        method: method.to_string(),
        path: path.clone(),
        query: uri.query().map(str::to_string),
        body: body.clone(),
    });
    let scripted = e
        .script
        .get_mut(path.as_str())
        .and_then(VecDeque::pop_front);
    let (status, ctype, text) =
        scripted.unwrap_or_else(|| match (method.as_str(), path.as_str()) {
            ("POST", "/pause") => {
                let mode = uri.query().unwrap_or_default();
                if ["mode=keep", "mode=wait", "mode=abort"]
                    .iter()
                    .any(|m| mode.starts_with(m))
                {
                    e.paused = true;
                    ok(json!({"status": "paused"}))
                } else {
                    (400, JSON, json!({"error": "bad mode"}).to_string())
                }
            }
            ("POST", "/resume") => {
                e.paused = false;
                ok(json!({"status": "resumed"}))
            }
            ("GET", "/is_paused") => ok(json!({"is_paused": e.paused})),
            ("POST", "/start_weight_update") => ok(json!({"message": "Weight update started"})),
            ("POST", "/update_weights") => ok(json!({"message": "Weights updated"})),
            ("POST", "/finish_weight_update") => {
                e.weight_version = body["weight_version"].as_str().map(str::to_string);
                ok(json!({"message": "Weight update finished"}))
            }
            ("GET", "/weight_info") => ok(json!({"weight_version": e.weight_version})),
            ("POST", "/reset_prefix_cache") => ok(json!({"success": true})),
            ("POST", "/v1/completions") => {
                let n = body["max_tokens"].as_u64().unwrap();
                let ids: Vec<u64> = (0..n).map(|i| 100 + i).collect();
                ok(json!({
                    "id": "cmpl-1", "object": "text_completion", "created": 1,
                    "model": "smollm2-135m",
                    "choices": [{
                        "index": 0, "text": " Paris.", "logprobs": null, "finish_reason": "length",
                        "stop_reason": null, "token_ids": ids, "prompt_logprobs": null,
                        "prompt_token_ids": null, "routed_experts": null,
                    }],
                    "service_tier": null, "system_fingerprint": null,
                    "usage": {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n,
                              "prompt_tokens_details": {"cached_tokens": 2}},
                    "kv_transfer_params": null,
                }))
            }
            _ => (404, JSON, json!({"detail": "Not Found"}).to_string()),
        });
    (
        StatusCode::from_u16(status).unwrap(),
        [(header::CONTENT_TYPE, ctype)],
        text,
    )
}

async fn serve() -> (String, Shared) {
    let shared = Arc::new(Mutex::new(Vllm::default()));
    let app = Router::new().fallback(route).with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), shared)
}

fn script(eng: &Shared, path: &'static str, answers: Vec<(u16, &'static str, String)>) {
    eng.lock().unwrap().script.insert(path, answers.into());
}

const V: &str = "mx:1111111111111111111111111111111111111111111111111111111111111111";

#[tokio::test]
async fn vllm_full_update_round_sends_the_exact_contract() {
    let (url, eng) = serve().await;
    let c = VllmClient::new(&format!("{url}/"), Duration::from_secs(2));
    assert_eq!(c.base_url(), url);
    assert_eq!(c.weight_version().await.unwrap(), None);
    c.pause(PauseMode::Keep).await.unwrap();
    assert!(c.is_paused().await.unwrap());
    assert_eq!(
        c.start_weight_update().await.unwrap(),
        "Weight update started"
    );
    assert_eq!(c.update_weights(V).await.unwrap(), "Weights updated");
    assert_eq!(
        c.finish_weight_update(V).await.unwrap(),
        "Weight update finished"
    );
    c.reset_prefix_cache().await.unwrap();
    assert_eq!(c.weight_version().await.unwrap().as_deref(), Some(V));
    c.resume().await.unwrap();
    assert!(!c.is_paused().await.unwrap());
    let g = c.complete(&[1, 2, 3], 4).await.unwrap();
    assert_eq!(g.output_ids, vec![100, 101, 102, 103]);
    assert_eq!(g.weight_version, None);
    assert_eq!(g.cached_tokens, 2);
    let calls = eng.lock().unwrap().calls.clone();
    assert_eq!(
        calls,
        vec![
            call("GET", "/weight_info", None, Value::Null),
            call(
                "POST",
                "/pause",
                Some("mode=keep&clear_cache=false"),
                Value::Null
            ),
            call("GET", "/is_paused", None, Value::Null),
            call("POST", "/start_weight_update", None, Value::Null),
            call(
                "POST",
                "/update_weights",
                None,
                json!({"update_info": {"version_id": V}})
            ),
            call(
                "POST",
                "/finish_weight_update",
                None,
                json!({"weight_version": V})
            ),
            call(
                "POST",
                "/reset_prefix_cache",
                Some("reset_running_requests=true"),
                Value::Null
            ),
            call("GET", "/weight_info", None, Value::Null),
            call("POST", "/resume", None, Value::Null),
            call("GET", "/is_paused", None, Value::Null),
            call(
                "POST",
                "/v1/completions",
                None,
                json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                       "return_token_ids": true, "ignore_eos": true})
            ),
        ]
    );
}

#[tokio::test]
async fn vllm_pause_modes_and_error_statuses_carry_the_body() {
    let (url, eng) = serve().await;
    let c = VllmClient::new(&url, Duration::from_secs(2));
    c.pause(PauseMode::Wait).await.unwrap();
    c.pause(PauseMode::Abort).await.unwrap();
    let queries: Vec<Option<String>> = eng
        .lock()
        .unwrap()
        .calls
        .iter()
        .map(|c| c.query.clone())
        .collect();
    assert_eq!(
        queries,
        vec![
            Some("mode=wait&clear_cache=false".into()),
            Some("mode=abort&clear_cache=false".into())
        ]
    );
    // /pause: 400 {"error"} for a mode the server rejects, 500 {"error"} when the engine fails.
    script(
        &eng,
        "/pause",
        vec![
            (
                400,
                JSON,
                json!({"error": "Invalid pause mode"}).to_string(),
            ),
            (
                500,
                JSON,
                json!({"error": "Failed to pause generation: boom"}).to_string(),
            ),
        ],
    );
    match c.pause(PauseMode::Keep).await {
        Err(Error::Status {
            status: 400, body, ..
        }) => {
            assert!(body.contains("Invalid pause mode"), "{body}")
        }
        other => panic!("{other:?}"),
    }
    match c.pause(PauseMode::Keep).await {
        Err(Error::Status {
            status: 500, body, ..
        }) => assert!(body.contains("boom"), "{body}"),
        other => panic!("{other:?}"),
    }
    // An engine exception in a weight-update route: FastAPI's plain-text 500, or JSON.
    script(
        &eng,
        "/start_weight_update",
        vec![(500, "text/plain", "Internal Server Error".into())],
    );
    let err = c.start_weight_update().await.unwrap_err();
    assert!(
        matches!(&err, Error::Status { status: 500, body, url } if body == "Internal Server Error" && url.ends_with("/start_weight_update")),
        "{err:?}"
    );
    script(
        &eng,
        "/update_weights",
        vec![(
            500,
            JSON,
            json!({"detail": "shape mismatch in qkv_proj"}).to_string(),
        )],
    );
    let err = c.update_weights(V).await.unwrap_err();
    assert!(
        err.to_string().contains("shape mismatch in qkv_proj"),
        "{err}"
    );
    // A server without the RL routes (not started with VLLM_SERVER_DEV_MODE=1).
    script(
        &eng,
        "/finish_weight_update",
        vec![(404, JSON, json!({"detail": "Not Found"}).to_string())],
    );
    assert!(matches!(
        c.finish_weight_update(V).await,
        Err(Error::Status { status: 404, .. })
    ));
}

/// Asserts `r` is a [`Error::BadResponse`] whose reason contains `want`.
fn bad<T: std::fmt::Debug>(r: Result<T, Error>, want: &str) {
    match r {
        Err(Error::BadResponse { reason, .. }) => assert!(reason.contains(want), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn vllm_bodies_off_contract_are_bad_responses() {
    let (url, eng) = serve().await;
    let c = VllmClient::new(&url, Duration::from_secs(2));
    script(&eng, "/pause", vec![ok(json!({"status": "ok"}))]);
    bad(c.pause(PauseMode::Wait).await, "\"ok\"");
    script(&eng, "/resume", vec![ok(json!({"message": "resumed"}))]);
    bad(c.resume().await, "status");
    script(&eng, "/start_weight_update", vec![ok(json!({}))]);
    bad(c.start_weight_update().await, "message");
    script(
        &eng,
        "/update_weights",
        vec![(200, "text/plain", "Weights updated".into())],
    );
    bad(c.update_weights(V).await, "Weights updated");
    script(&eng, "/is_paused", vec![ok(json!({"paused": true}))]);
    bad(c.is_paused().await, "is_paused");
    // weight_version is required; null is allowed and means "none".
    script(
        &eng,
        "/weight_info",
        vec![
            ok(json!({})),
            ok(json!({"weight_version": 3})),
            ok(json!({"weight_version": null, "extra": 1})),
        ],
    );
    bad(c.weight_version().await, "weight_version");
    bad(c.weight_version().await, "invalid type");
    assert_eq!(c.weight_version().await.unwrap(), None);
    script(&eng, "/reset_prefix_cache", vec![ok(json!({"ok": true}))]);
    bad(c.reset_prefix_cache().await, "success");
    // Completions: exactly one choice, token_ids present, non-null, u32.
    let choice = |ids: Value| json!({"index": 0, "text": "", "token_ids": ids});
    script(
        &eng,
        "/v1/completions",
        vec![
            ok(json!({"choices": [choice(json!([1])), choice(json!([2]))]})),
            ok(json!({"choices": []})),
            ok(json!({"choices": [{"index": 0, "text": "x"}]})),
            ok(json!({"choices": [choice(Value::Null)]})),
            ok(json!({"choices": [choice(json!([-1]))]})),
            ok(json!({"choices": [choice(json!([4294967296u64]))]})),
            ok(json!({"object": "error"})),
        ],
    );
    bad(c.complete(&[1], 1).await, "2 choices");
    bad(c.complete(&[1], 1).await, "0 choices");
    bad(c.complete(&[1], 1).await, "token_ids");
    bad(c.complete(&[1], 1).await, "token_ids is null");
    bad(c.complete(&[1], 1).await, "-1");
    bad(c.complete(&[1], 1).await, "4294967296");
    bad(c.complete(&[1], 1).await, "choices");
}

#[tokio::test]
async fn vllm_reset_prefix_cache_retries_while_blocks_are_held() {
    let (url, eng) = serve().await;
    let c = VllmClient::new(&url, Duration::from_secs(5));
    let refused = || ok(json!({"success": false}));
    // Refused twice, then reset: Ok after three tries.
    script(&eng, "/reset_prefix_cache", vec![refused(), refused()]);
    c.reset_prefix_cache().await.unwrap();
    let count = |eng: &Shared| {
        eng.lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.path == "/reset_prefix_cache")
            .count()
    };
    assert_eq!(count(&eng), 3);
    // Refused every time: an engine error after exactly RESET_PREFIX_CACHE_TRIES tries.
    eng.lock().unwrap().calls.clear();
    script(
        &eng,
        "/reset_prefix_cache",
        (0..10).map(|_| refused()).collect(),
    );
    match c.reset_prefix_cache().await {
        Err(Error::Engine { message, .. }) => assert!(message.contains("still held"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(count(&eng), RESET_PREFIX_CACHE_TRIES as usize);
    // The retries stay within the deadline: with 250 ms, fewer tries fit.
    eng.lock().unwrap().calls.clear();
    let short = VllmClient::new(&url, Duration::from_millis(250));
    let t = std::time::Instant::now();
    assert!(matches!(
        short.reset_prefix_cache().await,
        Err(Error::Engine { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(count(&eng) < RESET_PREFIX_CACHE_TRIES as usize);
}

#[tokio::test]
async fn vllm_hung_server_is_a_timeout_not_a_hang() {
    let (url, eng) = serve().await;
    eng.lock().unwrap().hang = true;
    let c = VllmClient::new(&url, Duration::from_millis(200));
    let t = std::time::Instant::now();
    let err = c.update_weights(V).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    let err = c.weight_version().await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
