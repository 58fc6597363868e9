//! The adapters against an HTTP server on loopback that follows the engines' contracts exactly
//! (vLLM and SGLang cannot run on this machine): field names, status codes and bodies as in
//! DESIGN.md. Every call's request body is recorded and asserted; the fake engines answer with
//! the contracts' wire values (`mx_adapters::{dynamo, sglang}::wire`), and bodies off the
//! contract are written out by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use mx_adapters::dynamo::wire::{
    DiscoveryError, EngineResponse, InstanceId, UpdateWeightsRequest, WorkerInfo, WorkersResponse,
};
use mx_adapters::dynamo::{DynamoClient, DynamoWorkerClient};
use mx_adapters::sglang::wire::{ControlResponse, UpdateWeightsResponse};
use mx_adapters::sglang::SglangClient;
use mx_adapters::Error;
use mx_adapters::PauseMode;
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
) -> (StatusCode, Json<EngineResponse>) {
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
                    Json(EngineResponse::error(m, Some(e.version.clone()))),
                );
            }
            let req: UpdateWeightsRequest = serde_json::from_value(body).unwrap();
            e.version = req.weight_version.unwrap();
            (
                StatusCode::OK,
                Json(EngineResponse::ok("loaded", Some(e.version.clone()))),
            )
        }
        "get_weight_version" | "pause_generation" | "resume_generation" => (
            StatusCode::OK,
            Json(EngineResponse::ok(route, Some(e.version.clone()))),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            Json(EngineResponse::error("no such route", None)),
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
    let update = |success: bool, message: String, paused: u64| UpdateWeightsResponse {
        num_paused_requests: Some(paused),
        ..UpdateWeightsResponse::new(success, message)
    };
    let (status, answer) = match route.as_str() {
        "update_weights_from_disk" => match e.fail_update.clone() {
            Some(m) => (StatusCode::BAD_REQUEST, json!(update(false, m, 0))),
            None => (StatusCode::OK, json!(update(true, "ok".into(), 3))),
        },
        "pause_generation" | "continue_generation" if e.allowlisted => (
            StatusCode::OK,
            json!(ControlResponse {
                success: Some(true),
                message: String::new(),
            }),
        ),
        // FastAPI's answer to a route it does not serve (off the contract: written out).
        _ => (StatusCode::NOT_FOUND, json!({"detail": "Not Found"})),
    };
    (status, Json(answer))
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

fn worker(url: &str, routes: &[&str]) -> WorkerInfo {
    WorkerInfo {
        namespace: "dynamo".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        instance_id: InstanceId::Number(7587888.into()),
        transport: "tcp".into(),
        request_plane_url: "tcp://127.0.0.1:1".into(),
        system_url: Some(url.into()),
        admin_base_url: None,
        model: Some("SmolLM2-135M".into()),
        routes: routes.iter().map(|r| r.to_string()).collect(),
        world_size: Some(3),
        error: None,
    }
}

/// A discovery answer of protocol `version` in `namespace` listing `workers`, under
/// `system_routes` as older releases name the list when `older`.
fn listing(version: u64, namespace: &str, workers: Vec<WorkerInfo>, older: bool) -> Value {
    let mut r = WorkersResponse {
        protocol_version: Some(version),
        namespace: namespace.into(),
        ..WorkersResponse::default()
    };
    if older {
        r.system_routes = Some(workers);
    } else {
        r.workers = Some(workers);
    }
    serde_json::to_value(r).unwrap()
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
    eng.lock().unwrap().discovery =
        Some((200, listing(1, "dynamo", vec![worker(&url, &ALL)], false)));
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
    eng.lock().unwrap().discovery = Some((200, listing(1, "n", vec![worker(&url, &ALL)], true)));
    assert_eq!(c.discover().await.unwrap().workers.len(), 1);
    // Protocol 2.
    eng.lock().unwrap().discovery = Some((200, listing(2, "n", vec![], false)));
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
    eng.lock().unwrap().discovery =
        Some((200, listing(1, "n", vec![worker(&url, &routes)], false)));
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
        serde_json::to_value(DiscoveryError {
            error: DiscoveryError::DISCOVERY_FAILED.into(),
            message: "etcd unreachable".into(),
        })
        .unwrap(),
    ));
    match c.discover().await {
        Err(Error::DiscoveryFailed { message, .. }) => assert_eq!(message, "etcd unreachable"),
        other => panic!("{other:?}"),
    }
    // A worker the listener could not describe.
    let mut w = worker(&url, &ALL);
    w.error = Some("no system server".into());
    eng.lock().unwrap().discovery = Some((200, listing(1, "n", vec![w], false)));
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
        // Off the contract (a worker with only a namespace): written out.
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
