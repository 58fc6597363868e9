//! The Dynamo SGLang adapter against an HTTP server on loopback that follows the contract exactly:
//! field names, status codes and bodies as in DESIGN.md (the Dynamo client's tests, on bodies
//! captured from a real Dynamo, are in `dynamo.rs`). Every call's request body is recorded and asserted; the fake engines answer with
//! the contracts' wire values (`mx_adapters::{dynamo, dynamo_sglang}::wire`), and bodies off the
//! contract are written out by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use mx_adapters::dynamo::DynamoWorkerClient;
use mx_adapters::dynamo_sglang::wire::UpdateWeightsResponse;
use mx_adapters::dynamo_sglang::DynamoSglangClient;
use mx_adapters::{Error, SglangPause};
use serde_json::{json, Value};

#[derive(Default)]
struct Engine {
    /// Calls received: (route, body).
    calls: Vec<(String, Value)>,
    /// Fail update_weights_from_disk with this message.
    fail_update: Option<String>,
    /// Dynamo SGLang: pause/continue served (a deployment may replace them).
    allowlisted: bool,
    /// Dynamo routes never answer (a hung worker).
    hang: bool,
}

type Shared = Arc<Mutex<Engine>>;

/// A worker's native `/engine/{route}`: Dynamo SGLang's pause/continue where served (`{"status":
/// "ok"}`); any other route answers only after 5 s while `hang` is set (a hung worker).
async fn native_route(
    State(s): State<Shared>,
    Path(route): Path<String>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let (hang, allowlisted) = {
        let mut e = s.lock().unwrap();
        e.calls.push((route.clone(), body.clone()));
        (e.hang, e.allowlisted)
    };
    match route.as_str() {
        "pause_generation" | "continue_generation" if allowlisted => {
            (StatusCode::OK, Json(json!({"status": "ok"})))
        }
        // What a system server answers for a route it does not serve (S0.1 of the plan).
        "pause_generation" | "continue_generation" => (
            StatusCode::NOT_FOUND,
            Json(
                json!({"error": "Route not found", "message": format!("Route /engine/{route} not found")}),
            ),
        ),
        _ => {
            if hang {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            (StatusCode::OK, Json(json!({"status": "ok"})))
        }
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
    // Dynamo's control routes answer 200 also when `success` is false.
    let (status, answer) = match route.as_str() {
        "update_weights_from_disk" => match e.fail_update.clone() {
            Some(m) => (StatusCode::OK, json!(update(false, m, 0))),
            None => (StatusCode::OK, json!(update(true, "ok".into(), 3))),
        },
        _ => (
            StatusCode::NOT_FOUND,
            json!({"error": "Route not found", "message": format!("Route /engine/control/{route} not found")}),
        ),
    };
    (status, Json(answer))
}

async fn serve(engine: Engine) -> (String, Shared) {
    let shared = Arc::new(Mutex::new(engine));
    let app = Router::new()
        .route("/engine/control/{route}", post(sglang_route))
        .route("/engine/{route}", post(native_route))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), shared)
}

#[tokio::test]
async fn dynamo_sglang_update_pause_and_allowlist_detection() {
    let (url, eng) = serve(Engine::default()).await;
    let s = DynamoSglangClient::new(&url, Duration::from_secs(2));
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
    // Not served: the framework must gate generation itself.
    let err = s.pause_generation(SglangPause::Retract).await.unwrap_err();
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
    s.pause_generation(SglangPause::InPlace).await.unwrap();
    assert_eq!(
        eng.lock().unwrap().calls.last().unwrap(),
        &("pause_generation".to_string(), json!({"mode": "in_place"}))
    );
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
