//! Tests of [`perform`] against an engine on loopback: the vLLM arms (one weight-update session
//! per APPLY, the read-back, generation over `/v1/completions`).
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use serde_json::{json, Value};

use super::*;
use crate::refit::{GenerationCheck, PauseMode};

const V: &str = "mx:2222222222222222222222222222222222222222222222222222222222222222";

#[derive(Default)]
struct FakeVllm {
    /// `METHOD /path?query` of each request, in order.
    calls: Vec<String>,
    /// Paths answered with HTTP 500 `{"detail": ...}`.
    fail: Vec<&'static str>,
    weight_version: Option<String>,
}

type Shared = Arc<Mutex<FakeVllm>>;

async fn route(
    State(s): State<Shared>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> (StatusCode, String) {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut e = s.lock().unwrap();
    e.calls.push(format!("{method} {uri}"));
    if e.fail.contains(&uri.path()) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"detail": "engine raised"}).to_string(),
        );
    }
    let answer = match uri.path() {
        "/pause" => json!({"status": "paused"}),
        "/resume" => json!({"status": "resumed"}),
        "/start_weight_update" => json!({"message": "Weight update started"}),
        "/update_weights" => json!({"message": "Weights updated"}),
        "/finish_weight_update" => {
            e.weight_version = body["weight_version"].as_str().map(str::to_string);
            json!({"message": "Weight update finished"})
        }
        "/reset_prefix_cache" => json!({"success": true}),
        "/weight_info" => json!({"weight_version": e.weight_version}),
        "/v1/completions" => json!({"choices": [{"index": 0, "text": "", "token_ids": [7, 8]}]}),
        _ => return (StatusCode::NOT_FOUND, "Not Found".into()),
    };
    (StatusCode::OK, answer.to_string())
}

async fn serve() -> (Box<dyn EngineClient>, Shared) {
    let shared = Arc::new(Mutex::new(FakeVllm::default()));
    let app = axum::Router::new()
        .fallback(route)
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let ep = EngineEndpoint {
        api: EngineApi::Vllm,
        system_url: format!("http://{addr}"),
        no_model: false,
        frontend: None,
    };
    let engine = client_for(
        ep.api,
        &reqwest::Client::new(),
        &ep.system_url,
        None,
        1,
        Duration::from_secs(2),
    );
    (engine, shared)
}

fn spec(expected_tokens: Vec<u32>) -> RefitSpec {
    RefitSpec {
        no_check: false,
        label: "step-2".into(),
        worker_ids: vec!["w0".into()],
        pause_mode: PauseMode::Abort,
        allow_partial: false,
        check: Some(GenerationCheck::tokens(vec![1, 2, 3], 2, expected_tokens)),
        framework_step: 0,
        stage_timeout_ms: 1000,
        call_timeout_ms: 2000,
        apply_parallelism: 0,
        orchestrator_gated: false,
        verify_from_apply_answer: false,
    }
}

async fn run(engine: &dyn EngineClient, action: Action, spec: &RefitSpec) -> CallResult {
    perform(engine, &action, spec).await
}

fn apply() -> Action {
    Action::Apply {
        version: ResidentVersion::parse(V),
    }
}

#[tokio::test]
async fn vllm_apply_is_one_weight_update_session_then_a_prefix_cache_reset() {
    let (engine, vllm) = serve().await;
    let spec = spec(vec![7, 8]);
    let r = run(&*engine, Action::Pause, &spec).await;
    assert!(r.ok, "{}", r.error);
    let r = run(&*engine, apply(), &spec).await;
    assert!(r.ok, "{}", r.error);
    assert_eq!(r.version, Some(ResidentVersion::parse(V)));
    assert_eq!(r.cache_tiers_cleared, vec!["prefix_cache".to_string()]);
    assert!(r.message.contains("finish_weight_update"), "{}", r.message);
    let r = run(&*engine, Action::ReadVersion, &spec).await;
    assert!(r.ok, "{}", r.error);
    assert_eq!(r.version, Some(ResidentVersion::parse(V)));
    let r = run(&*engine, Action::Resume, &spec).await;
    assert!(r.ok, "{}", r.error);
    let r = run(&*engine, Action::Generate, &spec).await;
    assert!(r.ok, "{}", r.error);
    assert_eq!(r.tokens, vec![7, 8]);
    assert_eq!(r.version, None);
    assert_eq!(
        vllm.lock().unwrap().calls,
        vec![
            "POST /pause?mode=abort&clear_cache=false",
            "POST /start_weight_update",
            "POST /update_weights",
            "POST /finish_weight_update",
            "POST /reset_prefix_cache?reset_running_requests=true",
            "GET /weight_info",
            "POST /resume",
            "POST /v1/completions",
        ]
    );
}

#[tokio::test]
async fn vllm_apply_stops_at_the_failing_step_and_names_it() {
    for (step, sent) in [
        ("/start_weight_update", 1),
        ("/update_weights", 2),
        ("/finish_weight_update", 3),
        ("/reset_prefix_cache", 4),
    ] {
        let (engine, vllm) = serve().await;
        vllm.lock().unwrap().fail = vec![step];
        let r = run(&*engine, apply(), &spec(vec![])).await;
        assert!(!r.ok, "{step}");
        assert_eq!(r.version, None, "{step}");
        assert!(r.cache_tiers_cleared.is_empty(), "{step}");
        assert!(r.error.starts_with(&step[1..]), "{step}: {}", r.error);
        assert!(r.error.contains("engine raised"), "{}", r.error);
        assert_eq!(vllm.lock().unwrap().calls.len(), sent, "{step}");
    }
    // A retained non-mx version (the checkpoint vLLM started from) is the backend's to restore:
    // the session is sent as for any version.
    let (engine, vllm) = serve().await;
    let r = run(
        &*engine,
        Action::Apply {
            version: ResidentVersion::parse("disk:/ckpt"),
        },
        &spec(vec![]),
    )
    .await;
    assert!(r.ok, "{}", r.error);
    assert_eq!(r.version, Some(ResidentVersion::parse("disk:/ckpt")));
    assert_eq!(vllm.lock().unwrap().calls.len(), 4);
    // No version at all: nothing is sent.
    let (engine, vllm) = serve().await;
    let r = run(
        &*engine,
        Action::Apply {
            version: ResidentVersion::Label(String::new()),
        },
        &spec(vec![]),
    )
    .await;
    assert!(!r.ok && r.error.contains("no version"), "{}", r.error);
    assert!(vllm.lock().unwrap().calls.is_empty());
}

#[tokio::test]
async fn vllm_read_back_of_no_version_and_a_wrong_generation_fail() {
    let (engine, _vllm) = serve().await;
    let r = run(&*engine, Action::ReadVersion, &spec(vec![])).await;
    assert!(!r.ok);
    assert!(
        r.error.contains("engine reports no weight version"),
        "{}",
        r.error
    );
    let r = run(&*engine, Action::Generate, &spec(vec![7, 9])).await;
    assert!(!r.ok);
    assert!(
        r.error
            .contains("probe 0: token 1 is 8 where 9 was expected")
            && r.error.contains("expected of step-2: [7, 9]"),
        "{}",
        r.error
    );
    let mut no_check = spec(vec![]);
    no_check.check = None;
    let r = run(&*engine, Action::Generate, &no_check).await;
    assert!(r.ok && r.message == "no check requested", "{r:?}");
}

fn endpoint(api: EngineApi, url: &str) -> Option<EngineEndpoint> {
    Some(EngineEndpoint {
        api,
        system_url: url.into(),
        no_model: false,
        frontend: None,
    })
}

#[test]
fn workers_sharing_an_engine_make_one_call() {
    let a = "http://127.0.0.1:1";
    let b = "http://127.0.0.1:2";
    let calls = vec![
        ("a-tp0".to_string(), Action::Pause),
        ("b-tp0".to_string(), Action::Pause),
        ("a-tp1".to_string(), Action::Pause),
        ("lone".to_string(), Action::Pause),
        ("a-tp2".to_string(), Action::Resume),
        ("a-tp2".to_string(), Action::Pause),
    ];
    let eps = vec![
        endpoint(EngineApi::Vllm, a),
        endpoint(EngineApi::Vllm, b),
        endpoint(EngineApi::Vllm, a),
        None,
        endpoint(EngineApi::Vllm, a),
        endpoint(EngineApi::Vllm, a),
    ];
    let groups: Vec<(Vec<String>, String)> = group_by_engine(calls, eps)
        .into_iter()
        .map(|c| (c.workers, c.action.to_string()))
        .collect();
    let names = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    assert_eq!(
        groups,
        vec![
            (
                names(&["a-tp0", "a-tp1", "a-tp2"]),
                Action::Pause.to_string()
            ),
            (names(&["b-tp0"]), Action::Pause.to_string()),
            (names(&["lone"]), Action::Pause.to_string()),
            (names(&["a-tp2"]), Action::Resume.to_string()),
        ]
    );
    // The same URL under another contract is another engine.
    let groups = group_by_engine(
        vec![
            ("x".to_string(), Action::Pause),
            ("y".to_string(), Action::Pause),
        ],
        vec![endpoint(EngineApi::Vllm, a), endpoint(EngineApi::Dynamo, a)],
    );
    assert_eq!(groups.len(), 2);
}
