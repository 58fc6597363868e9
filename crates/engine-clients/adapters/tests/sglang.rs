//! The client of SGLang's own server against a loopback server that answers with bodies
//! captured from a real SGLang 0.5.23 (`fixtures/sglang-0.5.23.json`; the pytest
//! `python/tests/test_sglang_harness.py` checks a running SGLang against the same file). It
//! keeps SGLang's session rules (one session open at a time, tensor updates only inside one)
//! and its flush rule (refused while an `in_place` pause holds requests). Every request body the
//! client sends is recorded and asserted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::Engine as _;
use mx_adapters::sglang::{marker, marker_name, SglangClient, LOADER};
use mx_adapters::{EngineClient, Error, PauseMode};
use mx_layout::ResidentVersion;
use serde_json::{json, Value};

/// The captured answers, by name.
fn fixture(name: &str) -> (u16, Value) {
    let all: Value =
        serde_json::from_str(include_str!("fixtures/sglang-0.5.23.json")).expect("fixture JSON");
    let e = &all[name];
    let status = e["status"].as_u64().expect("status") as u16;
    (status, e["body"].clone())
}

#[derive(Default)]
struct Server {
    calls: Vec<(String, Value)>,
    session: bool,
    /// Requests an `in_place` pause holds (the flush is refused while any are held).
    held_in_place: bool,
    weight_version: Option<String>,
    /// Answer the next update with a failure.
    fail_update: bool,
}

type Shared = Arc<Mutex<Server>>;

fn answer(status: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap();
    match body {
        Value::String(text) => (status, text.clone()).into_response(),
        other => (status, axum::Json(other.clone())).into_response(),
    }
}

async fn route(State(s): State<Shared>, Path(route): Path<String>, body: Bytes) -> Response {
    let mut e = s.lock().unwrap();
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap()
    };
    e.calls.push((route.clone(), body.clone()));
    let (status, out) = match route.as_str() {
        "pause_generation" => match body["mode"].as_str() {
            Some("retract") => {
                e.held_in_place = false;
                fixture("pause_retract")
            }
            Some("in_place") => {
                e.held_in_place = true;
                fixture("pause_in_place")
            }
            Some("abort") => fixture("pause_abort"),
            _ => fixture("pause_bad_mode"),
        },
        "continue_generation" => fixture("continue_ok"),
        "begin_weight_update" if e.session => fixture("begin_already_open"),
        "begin_weight_update" => {
            e.session = true;
            fixture("begin_ok")
        }
        "end_weight_update" if !e.session => fixture("end_no_session"),
        "end_weight_update" => {
            e.session = false;
            fixture("end_ok")
        }
        "update_weights_from_tensor" if !e.session => fixture("tensor_outside_session"),
        "update_weights_from_tensor" if e.fail_update => {
            e.fail_update = false;
            (400, json!({"success": false, "message": "load failed"}))
        }
        "update_weights_from_tensor" => {
            let v = body["weight_version"].as_str().unwrap().to_string();
            e.weight_version = Some(v.clone());
            (
                200,
                json!({"success": true, "message": format!("Success Weight version updated to {v}.")}),
            )
        }
        "flush_cache" if e.held_in_place => (
            400,
            json!("Cache not flushed: requests are still running or waiting.\n"),
        ),
        "flush_cache" => fixture("flush_cache"),
        "model_info" => {
            let (status, mut info) = fixture("model_info");
            if let Some(v) = &e.weight_version {
                info["weight_version"] = json!(v);
            }
            (status, info)
        }
        "server_info" => (200, json!({"tp_size": 2, "dp_size": 1})),
        other => panic!("unexpected route {other}"),
    };
    answer(status, &out)
}

async fn serve() -> (String, Shared) {
    let shared = Shared::default();
    let app = Router::new()
        .route("/{route}", post(route).get(route))
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), shared)
}

fn routes(s: &Shared) -> Vec<String> {
    s.lock()
        .unwrap()
        .calls
        .iter()
        .map(|(r, _)| r.clone())
        .collect()
}

const T: Duration = Duration::from_secs(5);

fn version(n: u8) -> ResidentVersion {
    ResidentVersion::parse(&format!("mx:{}", format!("{n:02x}").repeat(32)))
}

#[tokio::test]
async fn apply_is_one_session_naming_the_version_then_a_flush() {
    let (url, s) = serve().await;
    let c = SglangClient::new(&url, T);
    let v = version(1);
    let a = c.pause(PauseMode::Keep).await.unwrap();
    assert_eq!(a.message, "paused (retract)");
    let a = c.apply(&v).await.unwrap();
    assert_eq!(a.message, format!("Success Weight version updated to {v}."));
    assert_eq!(a.cache_tiers_cleared, ["radix_cache", "kv_cache"]);
    assert_eq!(
        routes(&s),
        [
            "pause_generation",
            "server_info",
            "begin_weight_update",
            "update_weights_from_tensor",
            "end_weight_update",
            "flush_cache"
        ]
    );
    let calls = s.lock().unwrap().calls.clone();
    assert_eq!(calls[0].1, json!({"mode": "retract"}));
    assert_eq!(calls[2].1, json!({"selector": "all"}));
    let update = &calls[3].1;
    let m = marker(&v.to_string()).unwrap();
    assert_eq!(
        update,
        &json!({
            "serialized_named_tensors": [m, m],
            "load_format": LOADER,
            "flush_cache": false,
            "weight_version": v.to_string(),
        })
    );
    // The marker carries the version id, nothing else of size.
    let raw = base64::engine::general_purpose::STANDARD
        .decode(&m)
        .unwrap();
    assert_eq!(raw.len(), 517);
    // ...which mx's reference worker reads back, and nothing but a marker passes for one.
    assert_eq!(marker_name(&m).unwrap(), v.to_string());
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut cut = raw.clone();
    cut.truncate(raw.len() - 1);
    let mut renamed = raw.clone();
    renamed[10] = 0xff; // the name's first byte: no longer UTF-8
    let mut long = raw.clone();
    long[6..10].copy_from_slice(&5000u32.to_le_bytes());
    for (bad, why) in [
        (b64.encode(&cut), "empty uint8 tensor"),
        (b64.encode(&renamed), "UTF-8"),
        (b64.encode(&long), "5000 bytes"),
        (b64.encode(b"\x80\x02]q\x00X\x01"), "cut short"),
        ("not base64!".to_string(), "not base64"),
    ] {
        let e = marker_name(&bad).unwrap_err();
        assert!(e.contains(why), "{why}: {e}");
    }
    assert_eq!(calls[4].1, json!({}));
    assert_eq!(calls[5].1, Value::Null, "flush_cache has no body");
    // The read-back is /model_info's weight_version.
    assert_eq!(c.read_version().await.unwrap().version, Some(v));
    c.resume().await.unwrap();
    assert_eq!(
        s.lock().unwrap().calls.last().unwrap(),
        &(
            "continue_generation".to_string(),
            json!({"torch_empty_cache": false})
        )
    );
}

#[tokio::test]
async fn an_in_place_pause_is_retracted_before_the_flush() {
    let (url, s) = serve().await;
    let c = SglangClient::new(&url, T);
    assert_eq!(
        c.pause(PauseMode::InPlace).await.unwrap().message,
        "paused (in_place)"
    );
    c.apply(&version(2)).await.unwrap();
    let r = routes(&s);
    assert_eq!(
        r[r.len() - 3..],
        ["flush_cache", "pause_generation", "flush_cache"]
    );
    assert_eq!(
        s.lock().unwrap().calls[r.len() - 2].1,
        json!({"mode": "retract"})
    );
}

#[tokio::test]
async fn failures_name_the_step_and_leave_no_session_open() {
    let (url, s) = serve().await;
    let c = SglangClient::new(&url, T);
    // SGLang has no pause that lets requests finish: mx's wait (its default) holds them.
    assert_eq!(
        c.pause(PauseMode::Wait).await.unwrap().message,
        "paused (retract)"
    );
    s.lock().unwrap().calls.clear();
    // A session a crashed apply left open is closed and begun again.
    s.lock().unwrap().session = true;
    c.apply(&version(3)).await.unwrap();
    assert_eq!(
        routes(&s)[..4],
        [
            "server_info",
            "begin_weight_update",
            "end_weight_update",
            "begin_weight_update"
        ]
    );
    // A failed update: the session is closed, the update's error reported.
    s.lock().unwrap().fail_update = true;
    let e = c.apply(&version(4)).await.unwrap_err();
    match &e {
        Error::ApplyStep { step, source, .. } => {
            assert_eq!(*step, "update_weights_from_tensor");
            assert!(
                matches!(**source, Error::Engine { ref message, .. } if message == "load failed")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!s.lock().unwrap().session, "the session was closed");
    assert_eq!(routes(&s).last().unwrap(), "end_weight_update");
    // Outside a session: SGLang's message, as an engine error.
    let e = c.end_weight_update().await.unwrap_err();
    assert!(
        matches!(&e, Error::Engine { message, .. } if message.starts_with("no weight-update session is open")),
        "{e}"
    );
}
