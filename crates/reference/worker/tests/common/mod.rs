//! Helpers shared by the worker's integration tests: the real SmolLM2 checkpoint, a control
//! plane in process, the checkpoint's tp:3 digests sliced from disk, an instance serving HTTP on
//! loopback, and raw JSON calls.
#![allow(dead_code, reason = "each test binary uses a subset")]

use std::path::PathBuf;

use mx_layout::{LayoutSpec, RankDigests};
use mx_worker::http::HttpServer;
use mx_worker::{ApplySource, Instance, InstanceConfig};
use serde_json::Value;

/// "The capital of France is" in SmolLM2's vocabulary.
pub(crate) const PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];
/// " Paris."
pub(crate) const PARIS: [u32; 2] = [7042, 30];

/// The SmolLM2-135M checkpoint dir, or `None` (with a message) when setup has not run.
pub(crate) fn model_dir(test: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../.mx/models/smollm2-135m");
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    eprintln!(
        "SKIPPED {test}: {} is missing (run scripts/setup.sh)",
        dir.display()
    );
    None
}

/// `tp:3`.
pub(crate) fn tp3() -> LayoutSpec {
    "tp:3".parse().expect("tp:3 parses")
}

/// A control plane in this process listening on `listen`, journaling into `dir`; its URL.
pub(crate) async fn control_plane(
    dir: &std::path::Path,
    listen: &str,
) -> (String, mx_control::ServerHandle) {
    let (addr, handle) = mx_control::spawn(mx_control::ControlPlaneConfig {
        compaction: Default::default(),
        listen: listen.parse().expect("listen address parses"),
        journal_path: dir.join("journal.jsonl"),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .expect("control plane starts");
    (format!("http://{addr}"), handle)
}

/// Live digests of tp:3 ranks 0..3 of the checkpoint at `dir`, sliced from disk by an
/// independent instance (no mx pull involved).
pub(crate) async fn disk_reference(dir: &std::path::Path) -> Vec<RankDigests> {
    let reference = Instance::open(
        InstanceConfig {
            model_dir: dir.to_path_buf(),
            layout: tp3(),
            ranks: vec![0, 1, 2],
            failpoints: false,
            worker_id: "reference".into(),
        },
        None,
        Some(mx_worker::reference_engine()),
    )
    .expect("reference instance opens");
    reference
        .apply(ApplySource::Disk {
            path: dir.to_path_buf(),
            version: "disk".into(),
        })
        .await
        .expect("disk load");
    reference
        .live_digests()
        .await
        .expect("digests")
        .expect("weights are live")
        .1
}

/// An instance without NIXL holding `ranks` of tp:3, serving HTTP on 127.0.0.1:0.
pub(crate) async fn serve(
    dir: &std::path::Path,
    ranks: &[u32],
    failpoints: bool,
) -> (Instance, HttpServer) {
    let inst = Instance::open(
        InstanceConfig {
            model_dir: dir.to_path_buf(),
            layout: tp3(),
            ranks: ranks.to_vec(),
            failpoints,
            worker_id: "test-worker".into(),
        },
        None,
        Some(mx_worker::reference_engine()),
    )
    .expect("instance opens");
    let http = mx_worker::http::serve(
        inst.clone(),
        "127.0.0.1:0".parse().expect("addr"),
        None,
        None,
        None,
    )
    .await
    .expect("HTTP binds");
    (inst, http)
}

/// POSTs `body` to `url` and returns (status, JSON body).
pub(crate) async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// GETs `url` and returns (status, JSON body).
/// `POST {base}/engine/{route}` with `body` the way Dynamo requires an update: inside a
/// `pause_generation` (mode keep), followed by `resume_generation`; the update's answer.
pub(crate) async fn paused_update(base: &str, route: &str, body: Value) -> (u16, Value) {
    let (status, r) = post(
        &format!("{base}/engine/pause_generation"),
        serde_json::json!({"mode": "keep"}),
    )
    .await;
    assert_eq!((status, &r["status"]), (200, &Value::from("ok")), "{r}");
    let answer = post(&format!("{base}/engine/{route}"), body).await;
    let (status, r) = post(
        &format!("{base}/engine/resume_generation"),
        serde_json::json!({}),
    )
    .await;
    assert_eq!((status, &r["status"]), (200, &Value::from("ok")), "{r}");
    answer
}

/// Dynamo's `update_weights_from_disk` of `path` as `version`, inside a pause (as
/// [`paused_update`]), through mx-adapters' client; its answer.
pub(crate) async fn load(
    dynamo: &mx_adapters::dynamo::DynamoWorkerClient,
    path: &str,
    version: &str,
) -> Result<mx_adapters::dynamo::EngineReply, mx_adapters::Error> {
    dynamo.pause(mx_adapters::PauseMode::Keep, false).await?;
    let r = dynamo.update_weights_from_disk(path, version).await;
    dynamo.resume().await?;
    r
}

pub(crate) async fn get(url: &str) -> (u16, Value) {
    let r = reqwest::get(url).await.expect("request sent");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `/generate` of `max_new` tokens after `prompt`.
pub(crate) async fn generate(base: &str, prompt: &[u32], max_new: usize) -> (u16, Value) {
    post(
        &format!("{base}/generate"),
        serde_json::json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}),
    )
    .await
}

/// The `output_ids` of a `/generate` answer.
pub(crate) fn ids(v: &Value) -> Vec<u32> {
    v["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}
