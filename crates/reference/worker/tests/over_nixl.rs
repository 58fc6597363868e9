//! The worker against a real control plane (in process, on loopback) and real publishers
//! pulling over NIXL: the version store's stage / apply / rollback / idempotent / unknown-version
//! semantics checked byte for byte, and reconnection when the control plane restarts. Each test
//! passes with a message when NIXL or `.mx/models/smollm2-135m` is missing (`MX_REQUIRE_NIXL=1`
//! turns a missing NIXL into a failure).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use crate::common;
use crate::trainer;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    control_plane, generate, ids, model_dir, paused_update, post, tp3, PARIS, PROMPT,
};
use mx_control::client::ControlClient;
use mx_control::{EngineApi, GenerationCheck, Outcome, PauseMode, RefitSpec, VersionState};
use mx_layout::{Digest, LayoutSpec, RankDigests};
use mx_worker::{Error, Instance, Worker, WorkerConfig};
use serde_json::json;
use trainer::TestTrainer;

const WAIT: Duration = Duration::from_secs(180);

fn worker_config(control: &str, dir: &Path, id: &str) -> WorkerConfig {
    WorkerConfig {
        control: control.to_string(),
        http_token: None,
        model_dir: dir.to_path_buf(),
        layout: tp3(),
        ranks: vec![0, 1, 2],
        worker_id: id.to_string(),
        instance: id.to_string(),
        http: "127.0.0.1:0".parse().unwrap(),
        engine_api: EngineApi::Dynamo,
        failpoints: false,
        reconnect_timeout: None,
        load: None,
        load_version: None,
        serve_peers: false,
        engine: Some(mx_worker::reference_engine()),
        on_staged: None,
    }
}

/// Declares and publishes `label` from the fsdp:2 trainers `pubs`; returns its version digest
/// once READY.
async fn publish(
    client: &ControlClient,
    pubs: &mut [TestTrainer],
    specs: &[mx_layout::TensorSpec],
    label: &str,
) -> Digest {
    let fsdp2: LayoutSpec = "fsdp:2".parse().unwrap();
    client.declare_version(label, fsdp2, specs).await.unwrap();
    let published = trainer::publish_all(pubs, label, false).await;
    let d = client
        .wait_version(label, VersionState::Ready, WAIT)
        .await
        .unwrap()
        .version_digest
        .unwrap();
    assert!(published.iter().all(|p| p.version.digest() == d));
    d
}

/// Hands `label` back on every trainer (it was staged everywhere), then applies training step
/// `step` in place.
async fn train(pubs: &mut [TestTrainer], label: &str, step: u32) {
    for p in pubs {
        let why = p.publisher.wait_staged(label, WAIT).await.unwrap();
        assert!(matches!(why, mx_control::Release::Staged { .. }), "{why}");
        p.train_step(step);
    }
}

/// Declares and publishes (both fsdp:2 publishers) `label`, then commits it on worker `w` with a
/// refit (STAGE over NIXL, PREPARE, APPLY, VERIFY, RESUME and CHECK over the worker's Dynamo
/// routes, COMMIT); the post-update generation of 2 tokens after [`PROMPT`] must give `golden`
/// (any 2 tokens when empty). Returns the version digest.
async fn refit(
    client: &ControlClient,
    pubs: &mut [TestTrainer],
    specs: &[mx_layout::TensorSpec],
    label: &str,
    golden: &[u32],
) -> Digest {
    let digest = publish(client, pubs, specs, label).await;
    let id = client
        .refit(&RefitSpec {
            no_check: false,
            label: label.into(),
            worker_ids: vec!["w".into()],
            pause_mode: PauseMode::Wait,
            allow_partial: false,
            check: Some(GenerationCheck::tokens(PROMPT.to_vec(), 2, golden.to_vec())),
            framework_step: 0,
            stage_timeout_ms: 180_000,
            call_timeout_ms: 60_000,
            apply_parallelism: 0,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        })
        .await
        .unwrap();
    let (ended, r) = client.wait_refit(id, WAIT).await.unwrap();
    let r = r.unwrap();
    assert!(ended, "refit {id} to {label} did not end");
    assert_eq!(r.outcome, Some(Outcome::Committed), "{}", r.reason);
    let tokens = r.workers["w"]
        .calls
        .iter()
        .filter(|c| c.action == mx_control::Action::Generate)
        .filter_map(|c| c.result.as_ref())
        .map(|x| x.tokens.clone())
        .next_back();
    assert_eq!(tokens.map(|t| t.len()), Some(2), "one CHECK generation");
    assert_eq!(
        client.get_version(label).await.unwrap().state,
        VersionState::Committed
    );
    digest
}

/// Worker "w" (tp:3 over the whole model, Dynamo routes) following `control` and two fsdp:2
/// trainers holding the checkpoint at `dir`.
struct Started {
    worker: Arc<Worker>,
    runner: tokio::task::JoinHandle<Result<(), Error>>,
    inst: Instance,
    url: String,
    client: ControlClient,
    pubs: Vec<TestTrainer>,
    specs: Vec<mx_layout::TensorSpec>,
}

async fn start_worker_and_trainers(control: &str, dir: &Path) -> Started {
    let w = Arc::new(
        Worker::start(worker_config(control, dir, "w"))
            .await
            .unwrap(),
    );
    let runner = tokio::spawn({
        let w = Arc::clone(&w);
        async move { w.run().await }
    });
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(control, dir, "fsdp:2".parse().unwrap(), rank).await);
    }
    Started {
        runner,
        inst: w.instance().clone(),
        worker: Arc::clone(&w),
        url: w.http_url(),
        client: ControlClient::connect(control).await.unwrap(),
        pubs,
        specs: mx_checkpoint::Checkpoint::open(dir).unwrap().specs(),
    }
}

async fn digests(inst: &Instance) -> (String, Vec<RankDigests>) {
    let (id, d) = inst.live_digests().await.unwrap().unwrap();
    (id.to_string(), d)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_pinned_and_live_versions_apply_swap_and_refuse_byte_exactly() {
    if !mx_nixl::nixl_or_skip("staged_pinned_and_live_versions_apply_swap_and_refuse") {
        return;
    }
    let Some(dir) = model_dir("staged_pinned_and_live_versions") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let Started {
        worker: w,
        runner,
        inst,
        url: base,
        client,
        mut pubs,
        specs,
    } = start_worker_and_trainers(&control, &dir).await;

    // Reference: the same checkpoint sliced from disk by an independent instance.
    let disk = common::disk_reference(&dir).await;

    // step-1 over NIXL, applied by a refit: byte-identical to the disk slicing, and the same
    // bytes the worker's GET /mx/live_digests reports.
    let d1 = refit(&client, &mut pubs, &specs, "step-1", &PARIS).await;
    let (id1, v1) = digests(&inst).await;
    assert_eq!(id1, mx_layout::VersionId(d1).to_string());
    assert_eq!(
        v1, disk,
        "step-1 pulled over NIXL differs from the checkpoint"
    );
    let (status, live) = common::get(&format!("{base}/mx/live_digests")).await;
    assert_eq!(status, 200, "{live}");
    assert_eq!(live["version"], id1);
    let ranks = live["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (got, want) in ranks.iter().zip(&v1) {
        assert_eq!(got["rank"], want.rank);
        let tensors = got["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), want.tensors.len());
        for (name, d) in &want.tensors {
            assert_eq!(tensors[name], d.to_string(), "rank {} {name}", want.rank);
        }
    }
    // The refit's CHECK generated " Paris." with the new weights (so its KV cache holds that).
    assert!(inst.cached_positions().unwrap() > 0);
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(ids(&body), PARIS, "{body}");
    assert_eq!(body["meta_info"]["weight_version"], id1);

    // step-2 (one training step later): step-1 becomes the pinned version.
    train(&mut pubs, "step-1", 2).await;
    let d2 = refit(&client, &mut pubs, &specs, "step-2", &[]).await;
    let (id2, v2) = digests(&inst).await;
    assert_eq!(id2, mx_layout::VersionId(d2).to_string());
    assert_ne!(v2, v1);
    assert_eq!(
        inst.versions().pinned.map(|v| v.to_string()),
        Some(id1.clone())
    );
    let (_, body) = generate(&base, &PROMPT, 4).await;
    let out2 = ids(&body);
    assert_eq!(body["meta_info"]["weight_version"], id2);

    // Rollback over the Dynamo route (mx_install, as mx's plugin inside a Dynamo worker): the
    // retained copy of step-1 is written back in place, byte-exact, at the same addresses.
    let addrs = inst.live_addresses().await;
    let update = |id: String| {
        let base = base.clone();
        async move {
            paused_update(
                &base,
                "update_weights_from_distributed",
                json!({"engine_rpc": "mx_install", "version_id": id}),
            )
            .await
        }
    };
    let (status, r) = update(id1.clone()).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["version"], id1);
    assert_eq!(
        r["cache_tiers_cleared"],
        json!(["kv_cache", "prefix_cache"])
    );
    assert_eq!(digests(&inst).await, (id1.clone(), v1.clone()));
    assert_eq!(
        inst.live_addresses().await,
        addrs,
        "apply moved the live weights"
    );
    // The retained copy is the live version now; step-2 stays staged.
    assert_eq!(inst.versions().pinned, None);
    assert_eq!(
        inst.versions().staged.map(|v| v.to_string()),
        Some(id2.clone())
    );
    assert_eq!(inst.cached_positions(), Some(0));
    let (_, body) = generate(&base, &PROMPT, 2).await;
    assert_eq!(ids(&body), PARIS);

    // Applying the live version again is a no-op success.
    let (status, r) = update(mx_layout::VersionId(d1).to_string()).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["version"], id1);
    assert_eq!(digests(&inst).await, (id1.clone(), v1.clone()));

    // And forward again, from staging (step-1 is retained).
    let (status, r) = update(mx_layout::VersionId(d2).to_string()).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(digests(&inst).await, (id2.clone(), v2.clone()));
    assert_eq!(
        inst.versions().pinned.map(|v| v.to_string()),
        Some(id1.clone())
    );
    assert_eq!(
        inst.live_addresses().await,
        addrs,
        "apply moved the live weights"
    );
    let (_, body) = generate(&base, &PROMPT, 4).await;
    assert_eq!(ids(&body), out2, "step-2 generates as before the rollback");

    // An unknown version is refused, naming what is staged, retained and live; nothing changes.
    let unknown = Digest([7u8; 32]);
    let (status, r) = update(mx_layout::VersionId(unknown).to_string()).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "error");
    assert_eq!(r["version"], id2);
    let msg = r["message"].as_str().unwrap();
    for needle in [
        mx_layout::VersionId(unknown).to_string(),
        format!("staged: {id2}"),
        format!("retained: {id1}"),
        format!("resident: {id2}"),
    ] {
        assert!(msg.contains(&needle), "{needle:?} not in {msg}");
    }
    assert_eq!(digests(&inst).await, (id2.clone(), v2.clone()));
    assert_eq!(
        inst.versions().pinned.map(|v| v.to_string()),
        Some(id1.clone())
    );

    // Staging a version that is already retained reports at once, without pulling (staging
    // keeps step-2), and applying it then restores it.
    let t = Instant::now();
    let stats = w.stage("step-1", d1).await.unwrap();
    assert!(stats.resident, "{stats:?}");
    assert_eq!((stats.descriptors, stats.useful_bytes), (0, 0));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(
        stats.digests, v1,
        "the retained copy's digests are step-1's live digests"
    );
    assert_eq!(
        inst.versions().staged.map(|v| v.to_string()),
        Some(id2.clone())
    );
    let (status, r) = update(mx_layout::VersionId(d1).to_string()).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(digests(&inst).await, (id1.clone(), v1.clone()));

    // step-3, published from the same arenas: the stage keeps step-2's plan (same geometry,
    // new digests). Every region it pulls is checked against step-3's digests (the stage fails
    // otherwise), and applying it makes step-3 live, with bytes unlike step-1's and step-2's.
    train(&mut pubs, "step-2", 3).await;
    let d3 = publish(&client, &mut pubs, &specs, "step-3").await;
    let stats = w.stage("step-3", d3).await.unwrap();
    assert!(stats.plan_reused, "{stats:?}");
    assert!(stats.descriptors > 0 && stats.useful_bytes > 0, "{stats:?}");
    assert_eq!(stats.digests.len(), 3);
    // Staging stays within the ranks' own bytes; the retained copy is one more copy of them.
    let mem = inst.memory_report().await;
    let rank_bytes: u64 = mem.rank_bytes.iter().map(|r| r.1).sum();
    assert!(mem.staging_bytes_peak <= rank_bytes, "{mem:?}");
    assert_eq!(mem.retained_bytes, rank_bytes, "{mem:?}");
    let (status, r) = update(mx_layout::VersionId(d3).to_string()).await;
    assert_eq!(status, 200, "{r}");
    let (id3, v3) = digests(&inst).await;
    assert_eq!(id3, mx_layout::VersionId(d3).to_string());
    assert_ne!(v3, v1);
    assert_ne!(v3, v2);
    assert_eq!(
        inst.live_addresses().await,
        addrs,
        "apply moved the live weights"
    );

    runner.abort();
    server.shutdown().await.unwrap();
}

/// Regression (issue 13): a worker that could not reach the control plane for its reconnect
/// timeout exited, and inference stopped with it; a registration under a connected worker's
/// id took the id over and the old process kept serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_serves_while_the_control_plane_is_away_and_cannot_be_taken_over_while_live() {
    if !mx_nixl::nixl_or_skip("a_worker_serves_while_the_control_plane_is_away") {
        return;
    }
    let Some(dir) = model_dir("a_worker_serves_while_the_control_plane_is_away") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let listen = control.trim_start_matches("http://").to_string();
    let mut cfg = worker_config(&control, &dir, "w");
    cfg.load = Some(dir.clone());
    cfg.load_version = Some("boot".into());
    let w = Arc::new(Worker::start(cfg).await.unwrap());
    let url = w.http_url();
    let runner = tokio::spawn({
        let w = Arc::clone(&w);
        async move { w.run().await }
    });
    // Worker "w" once its command stream is connected.
    let registered = |control: String| async move {
        let t = Instant::now();
        loop {
            let status = async {
                let c = ControlClient::connect(&control).await.ok()?;
                c.get_status().await.ok()
            };
            if let Some(ws) = status.await.and_then(|s| {
                s.workers
                    .into_iter()
                    .find(|w| w.worker_id == "w" && w.connected)
            }) {
                return ws;
            }
            assert!(t.elapsed() < Duration::from_secs(15), "w never connected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let ws = registered(control.clone()).await;
    assert_eq!(
        ws.resident_id,
        Some(mx_worker::ResidentVersion::parse("boot"))
    );
    assert_eq!(ws.engine.map(|e| e.system_url), Some(url.clone()));

    // The control plane goes away for longer than the old 3 s limit of this test: the engine
    // keeps answering its version and generating.
    server.shutdown().await.unwrap();
    let away = Instant::now();
    while away.elapsed() < Duration::from_secs(4) {
        let (code, v) = post(&format!("{url}/engine/get_weight_version"), json!({})).await;
        assert_eq!((code, v["version"].as_str()), (200, Some("boot")), "{v}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (code, v) = generate(&url, &PROMPT, 2).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(ids(&v), PARIS);
    assert!(
        !runner.is_finished(),
        "the worker gave up on the control plane"
    );

    // The control plane comes back on the same address and journal: the worker re-registers
    // there with its resident version.
    let (control2, server2) = control_plane(tmp.path(), &listen).await;
    assert_eq!(control2, control);
    let ws = registered(control.clone()).await;
    assert_eq!(
        ws.resident_id,
        Some(mx_worker::ResidentVersion::parse("boot"))
    );

    // A second process under the live id is refused at start, and the id keeps its engine.
    let mut cfg2 = worker_config(&control, &dir, "w");
    cfg2.ranks = vec![1];
    let e = Worker::start(cfg2.clone()).await.unwrap_err();
    assert!(
        matches!(&e, Error::Displaced { worker_id, .. } if worker_id == "w"),
        "{e}"
    );
    let ws = registered(control.clone()).await;
    assert_eq!(ws.engine.map(|e| e.system_url), Some(url.clone()));

    // Once the first one's stream is gone, a new process takes the id over; the first, when it
    // comes back, is refused, retires its engine (410 on every route) and returns Displaced.
    runner.abort();
    let _ = runner.await;
    let t = Instant::now();
    let w2 = loop {
        match Worker::start(cfg2.clone()).await {
            Ok(w2) => break w2,
            Err(Error::Displaced { .. }) if t.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the id was not freed: {e}"),
        }
    };
    let runner2 = tokio::spawn(async move { w2.run().await });
    let e = tokio::time::timeout(Duration::from_secs(10), w.run())
        .await
        .expect("the displaced worker did not stop")
        .unwrap_err();
    assert!(matches!(e, Error::Displaced { .. }), "{e}");
    let (code, v) = generate(&url, &PROMPT, 2).await;
    assert_eq!(code, 410, "{v}");
    assert!(v["message"].as_str().unwrap().contains("displaced"), "{v}");
    let (code, _) = post(&format!("{url}/engine/get_weight_version"), json!({})).await;
    assert_eq!(code, 410);
    assert!(!runner2.is_finished());

    // An explicit reconnect timeout is still honoured.
    runner2.abort();
    server2.shutdown().await.unwrap();
    let mut cfg3 = worker_config(&control, &dir, "w3");
    cfg3.ranks = vec![2];
    cfg3.reconnect_timeout = Some(Duration::from_secs(2));
    let w3 = Worker::start(cfg3).await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(20), w3.run())
        .await
        .expect("the worker kept trying past its explicit timeout")
        .unwrap_err();
    assert!(matches!(e, Error::ReconnectTimeout { .. }), "{e}");
    assert!(e.to_string().contains(&control), "{e}");
}

/// Regression (issue 13): a publisher exited when the control plane restarted just as it
/// published, and refits then failed with an opaque NIXL load error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_rides_out_a_control_plane_restart_and_a_gone_source_is_named() {
    if !mx_nixl::nixl_or_skip("a_publish_rides_out_a_control_plane_restart") {
        return;
    }
    let Some(dir) = model_dir("a_publish_rides_out_a_control_plane_restart") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let listen = control.trim_start_matches("http://").to_string();
    let mut cfg = worker_config(&control, &dir, "w");
    cfg.ranks = vec![1];
    let w = Arc::new(Worker::start(cfg).await.unwrap());
    let runner = tokio::spawn({
        let w = Arc::clone(&w);
        async move { w.run().await }
    });
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(&control, &dir, "fsdp:2".parse().unwrap(), rank).await);
    }
    let specs = mx_checkpoint::Checkpoint::open(&dir).unwrap().specs();
    let client = ControlClient::connect(&control).await.unwrap();
    let fsdp2: LayoutSpec = "fsdp:2".parse().unwrap();
    client
        .declare_version("step-1", fsdp2, &specs)
        .await
        .unwrap();

    // The control plane is away when the publishers publish; it comes back 1.5 s later on the
    // same address and journal, and both publishes land.
    server.shutdown().await.unwrap();
    let publishing = tokio::spawn(async move {
        trainer::publish_all(&mut pubs, "step-1", false).await;
        pubs
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!publishing.is_finished());
    let (_, server2) = control_plane(tmp.path(), &listen).await;
    let pubs = tokio::time::timeout(Duration::from_secs(30), publishing)
        .await
        .expect("the publishes did not land after the restart")
        .unwrap();
    let info = client
        .wait_version("step-1", VersionState::Ready, WAIT)
        .await
        .unwrap();
    let digest = info.version_digest.unwrap();
    let agent0 = info.manifests[0].agent_name.clone();

    // Slot 0's publisher goes away: staging names the source rather than a bare NIXL call.
    drop(pubs);
    let e = w.stage("step-1", digest).await.unwrap_err().to_string();
    assert!(
        e.contains("source slot 0") && e.contains(&agent0),
        "the error must name the source: {e}"
    );
    runner.abort();
    server2.shutdown().await.unwrap();
}

/// The control plane's status, polled until `done` says so (at most 30 s).
async fn status_until(
    control: &str,
    what: &str,
    done: impl Fn(&mx_control::FleetStatus) -> bool,
) -> mx_control::FleetStatus {
    let t = Instant::now();
    loop {
        if let Ok(c) = ControlClient::connect(control).await {
            if let Ok(s) = c.get_status().await {
                if done(&s) {
                    return s;
                }
            }
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 29, item 3: a journal cut inside a line reads like a write torn by a crash. Cut inside
/// refit 1's COMMIT (the fleet had gone on to step-3 by refit 3), a restarted control plane
/// reopened refit 1 and rolled the fleet back. Now the worker's registration (resident step-3,
/// called by refit 3) contradicts the journal: the control plane stops acting (no rollback,
/// no new refit; status says why and what to do) until an operator accepts the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_journal_the_fleet_contradicts_stops_the_control_plane_until_an_operator_decides() {
    if !mx_nixl::nixl_or_skip("a_journal_the_fleet_contradicts") {
        return;
    }
    let Some(dir) = model_dir("a_journal_the_fleet_contradicts") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("journal.jsonl");
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let listen = control.trim_start_matches("http://").to_string();
    let Started {
        runner,
        inst,
        url,
        client,
        mut pubs,
        specs,
        ..
    } = start_worker_and_trainers(&control, &dir).await;
    refit(&client, &mut pubs, &specs, "step-1", &PARIS).await;
    train(&mut pubs, "step-1", 2).await;
    refit(&client, &mut pubs, &specs, "step-2", &[]).await;
    train(&mut pubs, "step-2", 3).await;
    let d3 = refit(&client, &mut pubs, &specs, "step-3", &[]).await;
    let step3 = mx_layout::VersionId(d3).to_string();
    assert_eq!(digests(&inst).await.0, step3);
    assert_eq!(inst.seen().refit, 3, "the engine saw refits 1 to 3");
    drop(pubs);
    server.shutdown().await.unwrap();

    // Cut the journal inside the line that enters refit 1's COMMIT.
    let bytes = std::fs::read(&journal).unwrap();
    let text = String::from_utf8(bytes.clone()).unwrap();
    let mut at = 0;
    let line = text
        .lines()
        .find(|l| {
            let hit = l.contains("\"op\":\"refit_phase\",\"id\":1,\"phase\":\"commit\"");
            if !hit {
                at += l.len() + 1;
            }
            hit
        })
        .expect("refit 1's commit line");
    std::fs::write(&journal, &bytes[..at + line.len() / 2]).unwrap();
    let kept = mx_control::journal::read_records(&journal).unwrap().len();

    // Restarted on the cut journal: refit 1 is open again; the worker comes back and testifies.
    let (control2, server2) = control_plane(tmp.path(), &listen).await;
    assert_eq!(control2, control);
    let s = status_until(&control, "the control plane halts", |s| s.halted.is_some()).await;
    let why = s.halted.unwrap();
    assert!(
        why.contains(&format!(
            "worker w holds {step3}, a version this journal never declared"
        )),
        "{why}"
    );
    assert!(
        why.contains("worker w was called by refit 3; this journal's last refit is 1"),
        "{why}"
    );
    assert!(why.contains("mx accept-journal"), "{why}");
    assert_eq!(s.open_refit, Some(1), "refit 1 stays open, not settled");
    // Nothing acted: after the testimony wait, the journal gained registrations only, and the
    // engine still serves step-3, unpaused.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = mx_control::journal::read_records(&journal).unwrap();
    for e in &after[kept..] {
        assert!(
            matches!(e.record, mx_control::record::Record::Register { .. }),
            "acted while halted: {:?}",
            e.record
        );
    }
    let (code, v) = post(&format!("{url}/engine/get_weight_version"), json!({})).await;
    assert_eq!((code, v["version"].as_str()), (200, Some(step3.as_str())));
    let (code, v) = generate(&url, &PROMPT, 2).await;
    assert_eq!(code, 200, "the engine was left paused: {v}");
    // No refit starts while halted.
    let client = ControlClient::connect(&control).await.unwrap();
    let e = client
        .refit(&RefitSpec {
            no_check: false,
            label: "step-1".into(),
            worker_ids: vec!["w".into()],
            pause_mode: PauseMode::Wait,
            allow_partial: false,
            check: None,
            framework_step: 0,
            stage_timeout_ms: 10_000,
            call_timeout_ms: 10_000,
            apply_parallelism: 0,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        })
        .await
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains("FailedPrecondition") && shown.contains("the control plane is halted"),
        "{shown}"
    );

    // The operator accepts the journal as it stands: journaled, refit 1 is settled as after a
    // restart, and refit ids go on above 3.
    let (accepted, resumed) = client
        .accept_journal("cut on purpose by this test")
        .await
        .unwrap();
    assert_eq!(accepted.len(), 2, "{accepted:?}");
    assert_eq!(resumed, Some(1));
    let (ended, r) = client.wait_refit(1, WAIT).await.unwrap();
    assert!(ended, "refit 1 was not settled after the acceptance");
    let r = r.unwrap();
    assert!(r.recovered && r.outcome.is_some(), "{r:?}");
    assert!(client.get_status().await.unwrap().halted.is_none());
    let records = mx_control::journal::read_records(&journal).unwrap();
    assert!(records.iter().any(|e| matches!(
        &e.record,
        mx_control::record::Record::AcceptJournal { refit_floor: 3, versions, .. }
            if versions.iter().map(ToString::to_string).eq([step3.clone()])
    )));
    runner.abort();
    server2.shutdown().await.unwrap();
}
