//! The adapters against an HTTP server on loopback that follows the engines' contracts exactly
//! (vLLM and SGLang cannot run on this machine): field names, status codes and bodies as in
//! DESIGN.md. Every call's request body is recorded and asserted.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use mx_adapters::dynamo::{DynamoClient, DynamoWorkerClient, PauseMode};
use mx_adapters::sglang::SglangClient;
use mx_adapters::Error;
use serde_json::{json, Value};

#[derive(Default)]
struct Engine {
    /// What `GET /v1/rl/workers` answers: (status, body).
    discovery: Option<(u16, Value)>,
    /// Calls received: (route, body).
    calls: Vec<(String, Value)>,
    /// Resident version.
    version: String,
    /// Fail update_weights_from_disk with this message.
    fail_update: Option<String>,
    /// SGLang: pause/continue allowlisted.
    allowlisted: bool,
    /// Dynamo routes never answer (a hung worker).
    hang: bool,
}

type Shared = Arc<Mutex<Engine>>;

async fn discovery(State(s): State<Shared>) -> (StatusCode, Json<Value>) {
    let (code, body) = s.lock().unwrap().discovery.clone().unwrap();
    (StatusCode::from_u16(code).unwrap(), Json(body))
}

async fn dynamo_route(
    State(s): State<Shared>,
    Path(route): Path<String>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let hang = s.lock().unwrap().hang;
    if hang {
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let mut e = s.lock().unwrap();
    e.calls.push((route.clone(), body.clone()));
    match route.as_str() {
        "update_weights_from_disk" => {
            if let Some(m) = e.fail_update.clone() {
                return (
                    StatusCode::OK,
                    Json(json!({"status": "error", "message": m, "version": e.version})),
                );
            }
            e.version = body["weight_version"].as_str().unwrap().to_string();
            (
                StatusCode::OK,
                Json(json!({"status": "ok", "message": "loaded", "version": e.version})),
            )
        }
        "get_weight_version" | "pause_generation" | "resume_generation" => (
            StatusCode::OK,
            Json(json!({"status": "ok", "message": route, "version": e.version})),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            Json(json!({"status": "error", "message": "no such route"})),
        ),
    }
}

async fn sglang_route(
    State(s): State<Shared>,
    Path(route): Path<String>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let mut e = s.lock().unwrap();
    e.calls.push((route.clone(), body.clone()));
    match route.as_str() {
        "update_weights_from_disk" => match e.fail_update.clone() {
            Some(m) => (
                StatusCode::BAD_REQUEST,
                Json(json!({"success": false, "message": m, "num_paused_requests": 0})),
            ),
            None => (
                StatusCode::OK,
                Json(json!({"success": true, "message": "ok", "num_paused_requests": 3})),
            ),
        },
        "pause_generation" | "continue_generation" if e.allowlisted => {
            (StatusCode::OK, Json(json!({"success": true})))
        }
        _ => (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))),
    }
}

async fn serve(engine: Engine) -> (String, Shared) {
    let shared = Arc::new(Mutex::new(engine));
    let app = Router::new()
        .route("/v1/rl/workers", get(discovery))
        .route("/engine/control/{route}", post(sglang_route))
        .route("/engine/{route}", post(dynamo_route))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), shared)
}

fn worker(url: &str, routes: &[&str]) -> Value {
    json!({
        "namespace": "dynamo", "component": "backend", "endpoint": "generate",
        "instance_id": 7587888, "transport": "tcp", "request_plane_url": "tcp://127.0.0.1:1",
        "system_url": url, "model": "SmolLM2-135M", "routes": routes, "world_size": 3,
    })
}

const ALL: [&str; 4] = [
    "pause_generation",
    "update_weights_from_disk",
    "get_weight_version",
    "resume_generation",
];

#[tokio::test]
async fn dynamo_discovery_and_a_full_update_round() {
    let (url, eng) = serve(Engine {
        version: "v1".into(),
        ..Engine::default()
    })
    .await;
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 1, "namespace": "dynamo", "workers": [worker(&url, &ALL)]}),
    ));
    let c = DynamoClient::new(&url, Duration::from_secs(2));
    let d = c.discover().await.unwrap();
    assert_eq!(d.namespace, "dynamo");
    assert_eq!(d.workers.len(), 1);
    assert_eq!(d.workers[0].instance_id, "7587888");
    assert_eq!(d.workers[0].world_size, Some(3));
    let w = c.worker(&d.workers[0]).unwrap();
    w.pause(PauseMode::Abort, true).await.unwrap();
    let r = w
        .update_weights_from_disk("mx://abc", "step-2")
        .await
        .unwrap();
    assert_eq!(r.version.as_deref(), Some("step-2"));
    assert_eq!(w.get_weight_version().await.unwrap(), "step-2");
    w.resume().await.unwrap();
    let calls = eng.lock().unwrap().calls.clone();
    assert_eq!(
        calls,
        vec![
            (
                "pause_generation".to_string(),
                json!({"mode": "abort", "clear_cache": true})
            ),
            (
                "update_weights_from_disk".to_string(),
                json!({"model_path": "mx://abc", "weight_version": "step-2"})
            ),
            ("get_weight_version".to_string(), json!({})),
            ("resume_generation".to_string(), json!({})),
        ]
    );
}

#[tokio::test]
async fn dynamo_discovery_refusals_name_what_is_wrong() {
    let (url, eng) = serve(Engine::default()).await;
    let c = DynamoClient::new(&url, Duration::from_secs(2));
    // Older listeners name the list system_routes: accepted.
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 1, "namespace": "n", "system_routes": [worker(&url, &ALL)]}),
    ));
    assert_eq!(c.discover().await.unwrap().workers.len(), 1);
    // Protocol 2.
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 2, "namespace": "n", "workers": []}),
    ));
    assert!(matches!(
        c.discover().await,
        Err(Error::Protocol { found: 2, .. })
    ));
    // A worker without get_weight_version.
    let routes = [
        "pause_generation",
        "update_weights_from_disk",
        "resume_generation",
    ];
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 1, "namespace": "n", "workers": [worker(&url, &routes)]}),
    ));
    match c.discover().await {
        Err(Error::MissingRoute {
            instance, route, ..
        }) => assert_eq!(
            (instance.as_str(), route),
            ("7587888", "get_weight_version")
        ),
        other => panic!("{other:?}"),
    }
    // Discovery failure.
    eng.lock().unwrap().discovery = Some((
        500,
        json!({"error": "discovery_failed", "message": "etcd unreachable"}),
    ));
    match c.discover().await {
        Err(Error::DiscoveryFailed { message, .. }) => assert_eq!(message, "etcd unreachable"),
        other => panic!("{other:?}"),
    }
    // A worker the listener could not describe.
    let mut w = worker(&url, &ALL);
    w["error"] = json!("no system server");
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 1, "namespace": "n", "workers": [w]}),
    ));
    assert!(
        matches!(c.discover().await, Err(Error::Engine { message, .. }) if message.contains("no system server"))
    );
}

#[tokio::test]
async fn dynamo_checks_status_and_body_and_times_out() {
    let (url, eng) = serve(Engine {
        fail_update: Some("shape mismatch in qkv_proj".into()),
        ..Engine::default()
    })
    .await;
    let w = DynamoWorkerClient::new(&url, Duration::from_millis(300));
    // HTTP 200 with status "error" is a failure, with the engine's message.
    match w.update_weights_from_disk("/ckpt", "v2").await {
        Err(Error::Engine { message, .. }) => assert_eq!(message, "shape mismatch in qkv_proj"),
        other => panic!("{other:?}"),
    }
    // HTTP 404 (a system server without the engine routes).
    let c = DynamoWorkerClient::new(&format!("{url}/nope"), Duration::from_millis(300));
    assert!(matches!(
        c.resume().await,
        Err(Error::Status { status: 404, .. })
    ));
    // HTTP 200 whose body is not the contract's.
    eng.lock().unwrap().discovery = Some((
        200,
        json!({"protocol_version": 1, "namespace": "n", "workers": [{"namespace": "n"}]}),
    ));
    let d = DynamoClient::new(&url, Duration::from_secs(1));
    assert!(
        matches!(d.discover().await, Err(Error::BadResponse { reason, .. }) if reason.contains("component"))
    );
}

#[tokio::test]
async fn sglang_update_pause_and_allowlist_detection() {
    let (url, eng) = serve(Engine::default()).await;
    let s = SglangClient::new(&url, Duration::from_secs(2));
    let r = s
        .update_weights_from_disk("/ckpt/step-2", "step-2", true, false)
        .await
        .unwrap();
    assert_eq!(r.num_paused_requests, 3);
    assert_eq!(
        eng.lock().unwrap().calls[0],
        (
            "update_weights_from_disk".to_string(),
            json!({"model_path": "/ckpt/step-2", "weight_version": "step-2", "flush_cache": true, "keep_pause": false})
        )
    );
    // Not allowlisted: the framework must gate generation itself.
    let err = s.pause_generation().await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::RouteNotAllowlisted {
                route: "pause_generation",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("must gate generation itself"));
    eng.lock().unwrap().allowlisted = true;
    s.pause_generation().await.unwrap();
    s.continue_generation(true).await.unwrap();
    assert_eq!(
        eng.lock().unwrap().calls.last().unwrap().1,
        json!({"torch_empty_cache": true})
    );
    // success: false is a failure even with a body, status checked too.
    eng.lock().unwrap().fail_update = Some("load failed".into());
    match s.update_weights_from_disk("/x", "v3", true, false).await {
        Err(Error::Engine { message, .. }) => assert_eq!(message, "load failed"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_hung_engine_is_a_timeout_not_a_hang() {
    let (url, eng) = serve(Engine::default()).await;
    eng.lock().unwrap().hang = true;
    let w = DynamoWorkerClient::new(&url, Duration::from_millis(200));
    let t = std::time::Instant::now();
    let err = w.resume().await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
