//! The Dynamo client against a loopback server that answers with bodies captured from a real
//! ai-dynamo 1.6.1 frontend and `dynamo.vllm` worker (`fixtures/dynamo-1.6.1.json`; the
//! pytest `python/tests/test_dynamo.py` checks a running Dynamo against the same file, so the
//! fixtures cannot drift from the real server). Every request body the client sends is recorded
//! and asserted; answers carry `content-type: text/plain` as the real system server's do.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use mx_adapters::dynamo::{DynamoClient, DynamoWorkerClient, Frontend};
use mx_adapters::{EngineClient, Error, PauseMode};
use mx_layout::ResidentVersion;
use serde_json::{json, Value};

/// The captured answers, by name.
fn fixture(name: &str) -> (u16, Value) {
    let all: Value =
        serde_json::from_str(include_str!("fixtures/dynamo-1.6.1.json")).expect("fixture JSON");
    let e = &all[name];
    let status = e["status"].as_u64().expect("status") as u16;
    (status, e["body"].clone())
}

/// The instance id of the captured listing (a u64 above 2^53).
const INSTANCE: u64 = 10_355_313_756_097_947_880;

#[derive(Default)]
struct Worker {
    /// The listing: the captured one, or another for a test.
    listing: Option<(u16, Value)>,
    calls: Vec<(String, Value)>,
    paused: bool,
    version: Option<String>,
    /// Fail the next install with the captured rpc failure.
    fail_install: bool,
}

type Shared = Arc<Mutex<Worker>>;

/// A body as the system server sends it: JSON text under `text/plain`.
fn answer(status: u16, body: &Value) -> Response {
    (
        StatusCode::from_u16(status).unwrap(),
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.to_string(),
    )
        .into_response()
}

async fn listing(State(s): State<Shared>) -> Response {
    let (status, body) = s.lock().unwrap().listing.clone().unwrap();
    answer(status, &body)
}

/// The worker's routes, following what 1.6.1 does (handlers.py at the file:lines of the
/// client's module docs).
async fn engine(State(s): State<Shared>, Path(route): Path<String>, raw: String) -> Response {
    let Ok(body) = serde_json::from_str::<Value>(&raw) else {
        let (st, b) = fixture("invalid_json");
        return answer(st, &b);
    };
    let mut w = s.lock().unwrap();
    w.calls.push((route.clone(), body.clone()));
    if !body.is_object() {
        let (st, b) = fixture("not_an_object");
        return answer(st, &b);
    }
    let (status, mut reply) = match route.as_str() {
        "pause_generation" => {
            w.paused = true;
            let (st, mut b) = fixture("pause_ok");
            b["mode"] = body.get("mode").cloned().unwrap_or(json!("keep"));
            b["clear_cache"] = body.get("clear_cache").cloned().unwrap_or(json!(false));
            (st, b)
        }
        "update_weights_from_distributed" if !w.paused => fixture("update_not_paused"),
        "update_weights_from_distributed" if w.fail_install => {
            w.fail_install = false;
            fixture("update_rpc_failed")
        }
        "update_weights_from_distributed" => {
            w.version = body["weight_version"].as_str().map(String::from);
            fixture("update_ok")
        }
        "get_weight_version" => match &w.version {
            None => fixture("version_initial"),
            Some(_) => fixture("version_v1"),
        },
        "resume_generation" => {
            w.paused = false;
            fixture("resume_ok")
        }
        _ => {
            let (st, mut b) = fixture("route_not_found");
            b["message"] = json!(format!("Route /engine/{route} not found"));
            return answer(st, &b);
        }
    };
    if reply.get("version").is_some_and(|v| !v.is_null()) {
        reply["version"] = json!(w.version);
    }
    answer(status, &reply)
}

/// The frontend's completions route: the captured answer for the known instance, 400 for any
/// other.
async fn completions(State(s): State<Shared>, raw: String) -> Response {
    let body: Value = serde_json::from_str(&raw).unwrap();
    s.lock()
        .unwrap()
        .calls
        .push(("v1/completions".into(), body.clone()));
    if body["nvext"]["backend_instance_id"].as_u64() == Some(INSTANCE) {
        let (st, b) = fixture("completion");
        answer(st, &b)
    } else {
        let (st, b) = fixture("completion_unknown_instance");
        answer(st, &b)
    }
}

/// Serves the worker's system routes, the listener and the frontend on one loopback port.
async fn serve(worker: Worker) -> (String, Shared) {
    let shared = Arc::new(Mutex::new(worker));
    let app = Router::new()
        .route("/v1/rl/workers", get(listing))
        .route("/v1/completions", post(completions))
        .route("/engine/{route}", post(engine))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let url = format!("http://{addr}");
    // The captured listing, its worker's system server being this one.
    let (st, mut body) = fixture("workers");
    body["workers"][0]["system_url"] = json!(url);
    shared.lock().unwrap().listing = Some((st, body));
    (url, shared)
}

#[tokio::test]
async fn a_refit_round_on_the_captured_contract() {
    let (url, w) = serve(Worker::default()).await;
    let d = DynamoClient::new(&url, Duration::from_secs(2))
        .discover()
        .await
        .unwrap();
    assert_eq!(d.namespace, "dynamo");
    assert!(d.left_out.is_empty(), "{:?}", d.left_out);
    let found = &d.workers[0];
    assert_eq!(found.instance_id, INSTANCE.to_string());
    assert_eq!(
        found.transport,
        r#"{"tcp":"192.0.2.2:36501/8fb576ff11ef28e8/dynamo/backend/rl"}"#
    );
    assert_eq!(found.system_url.as_deref(), Some(url.as_str()));
    assert_eq!(
        (found.model.as_deref(), found.world_size),
        (Some("smol"), Some(1))
    );
    assert_eq!(found.routes.len(), 12);

    let frontend = Frontend {
        url: format!("{url}/"),
        model: "smol".into(),
        instance_id: INSTANCE,
    };
    let c = DynamoWorkerClient::new(&url, Duration::from_secs(2)).with_frontend(Some(frontend));
    // Before any declared update the worker reports no version.
    assert!(matches!(
        c.read_version().await,
        Err(Error::NoVersion { .. })
    ));
    let v = ResidentVersion::parse(&format!("mx:{}", "ab".repeat(32)));
    EngineClient::pause(&c, PauseMode::Keep).await.unwrap();
    let a = c.apply(&v).await.unwrap();
    assert_eq!(a.version.as_ref(), Some(&v));
    assert_eq!(a.cache_tiers_cleared, ["prefix_cache"]);
    assert_eq!(c.read_version().await.unwrap().version.as_ref(), Some(&v));
    EngineClient::resume(&c).await.unwrap();
    let g = c.generate(&[19556, 905], 5).await.unwrap();
    assert_eq!(g.output_ids, [282, 260, 1774, 30, 198]);

    let calls = w.lock().unwrap().calls.clone();
    let id = v.to_string();
    assert_eq!(
        calls,
        [
            ("get_weight_version".to_string(), json!({})),
            (
                "pause_generation".into(),
                json!({"mode": "keep", "clear_cache": false})
            ),
            (
                "update_weights_from_distributed".into(),
                json!({"engine_rpc": "mx_install", "weight_version": id, "reset_prefix_cache": true, "version_id": id})
            ),
            ("get_weight_version".into(), json!({})),
            ("resume_generation".into(), json!({})),
            (
                "v1/completions".into(),
                json!({"model": "smol", "prompt": [19556, 905], "max_tokens": 5, "temperature": 0,
                       "ignore_eos": true,
                       "nvext": {"backend_instance_id": INSTANCE, "extra_fields": ["engine_data"]}})
            ),
        ]
    );
    // The request the client sends is the one captured from the real frontend, field for field
    // (the instance id exact, not through a float).
    let all: Value = serde_json::from_str(include_str!("fixtures/dynamo-1.6.1.json")).unwrap();
    let mut sent = calls[5].1.clone();
    sent["prompt"] = json!([19556, 905]);
    assert_eq!(sent, all["completion"]["request"]);
}

#[tokio::test]
async fn failures_answered_200_with_status_error_are_failures() {
    let (url, w) = serve(Worker::default()).await;
    let c = DynamoWorkerClient::new(&url, Duration::from_secs(2));
    let v = ResidentVersion::parse(&format!("mx:{}", "cd".repeat(32)));
    // Not paused: HTTP 200, status error, Dynamo's message.
    match c.apply(&v).await {
        Err(Error::Engine { message, .. }) => {
            assert!(message.starts_with("Worker must be paused"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // A failed install: the rpc's message.
    c.pause(PauseMode::Wait, false).await.unwrap();
    w.lock().unwrap().fail_install = true;
    match c.apply(&v).await {
        Err(Error::Engine { message, .. }) => {
            assert!(
                message.contains("collective_rpc method failed"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(w.lock().unwrap().version.is_none(), "nothing recorded");
    // A route the worker does not have: 404 with Dynamo's body.
    match DynamoWorkerClient::new(&format!("{url}/"), Duration::from_secs(2))
        .update_weights_from_disk("/ckpt", "v")
        .await
    {
        Err(Error::Status {
            status: 404, body, ..
        }) => {
            assert!(
                body.contains("Route /engine/update_weights_from_disk not found"),
                "{body}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Generation through a frontend that does not know the instance: HTTP 400.
    let stranger = Frontend {
        url: url.clone(),
        model: "smol".into(),
        instance_id: 7,
    };
    match c.generate_through(&stranger, &[1, 2], 3).await {
        Err(Error::Status {
            status: 400, body, ..
        }) => {
            assert!(body.contains("Invalid request"), "{body}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn discovery_leaves_out_what_cannot_be_refitted_and_keeps_the_rest() {
    let (url, w) = serve(Worker::default()).await;
    let c = DynamoClient::new(&url, Duration::from_secs(2));
    let (_, good) = fixture("workers");
    let mut good = good["workers"][0].clone();
    good["system_url"] = json!(url);
    let mut no_route = good.clone();
    no_route["instance_id"] = json!(2u64);
    no_route["routes"] = json!([
        "get_weight_version",
        "pause_generation",
        "resume_generation"
    ]);
    // The listener's own report of a worker whose probe failed.
    let mut probe_failed = good.clone();
    probe_failed["instance_id"] = json!(3u64);
    probe_failed["routes"] = json!([]);
    probe_failed["error"] = json!("worker discovery timed out after 30s");
    let mut no_system = good.clone();
    no_system["instance_id"] = json!(4u64);
    no_system.as_object_mut().unwrap().remove("system_url");
    w.lock().unwrap().listing = Some((
        200,
        json!({"protocol_version": 1, "namespace": "dynamo",
               "workers": [no_route, good, probe_failed, no_system]}),
    ));
    let d = c.discover().await.unwrap();
    assert_eq!(d.workers.len(), 1);
    assert_eq!(d.workers[0].instance_id, INSTANCE.to_string());
    let left: Vec<(String, String)> = d
        .left_out
        .iter()
        .map(|(w, why)| (w.instance_id.clone(), why.clone()))
        .collect();
    assert_eq!(
        left,
        [
            (
                "2".to_string(),
                "it does not expose route(s) update_weights_from_distributed".to_string()
            ),
            (
                "3".into(),
                "the listener reports an error: worker discovery timed out after 30s".into()
            ),
            ("4".into(), "it has no system_url".into()),
        ]
    );

    // Another protocol, a failed discovery, a body off the contract: errors.
    w.lock().unwrap().listing = Some((
        200,
        json!({"protocol_version": 2, "namespace": "dynamo", "workers": []}),
    ));
    assert!(matches!(
        c.discover().await,
        Err(Error::Protocol { found: 2, .. })
    ));
    w.lock().unwrap().listing = Some((
        500,
        json!({"error": "discovery_failed", "message": "etcd unreachable"}),
    ));
    match c.discover().await {
        Err(Error::DiscoveryFailed { message, .. }) => assert_eq!(message, "etcd unreachable"),
        other => panic!("{other:?}"),
    }
    w.lock().unwrap().listing = Some((
        200,
        json!({"protocol_version": 1, "namespace": "n", "workers": [{"namespace": "n"}]}),
    ));
    assert!(
        matches!(c.discover().await, Err(Error::BadResponse { reason, .. }) if reason.contains("component"))
    );
}
