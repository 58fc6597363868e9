//! Control plane over real loopback gRPC: an ephemeral port, a real journal in a temp dir. A
//! refit runs against a fake engine on loopback that answers the Dynamo routes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mx_control::client::{CommandStream, ControlClient};
use mx_control::{
    spawn, Action, Command, ControlPlaneConfig, EngineApi, EngineEndpoint, Error, Outcome,
    PauseMode, RefitSpec, Registration, ServerHandle, StagedReport, VersionState, WorkerState,
};
use mx_layout::{
    version_digest, DType, DestPiece, Digest, LayoutSpec, MemDevice, RankDigests, ResidentVersion,
    Scheme, ShardEntry, SourceManifest, TensorBox, TensorSpec, VersionId,
};

const FSDP2: LayoutSpec = LayoutSpec {
    scheme: Scheme::Fsdp,
    world_size: 2,
};
const TP2: LayoutSpec = LayoutSpec {
    scheme: Scheme::VllmTp,
    world_size: 2,
};
const REP1: LayoutSpec = LayoutSpec {
    scheme: Scheme::Replicated,
    world_size: 1,
};
const T: Duration = Duration::from_secs(10);

async fn start(journal: &Path) -> (ControlClient, ServerHandle) {
    let (addr, handle) = spawn(ControlPlaneConfig {
        compaction: Default::default(),
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: journal.to_path_buf(),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .unwrap();
    assert_ne!(addr.port(), 0);
    let client = ControlClient::connect(&addr.to_string()).await.unwrap();
    (client, handle)
}

fn tensors() -> Vec<TensorSpec> {
    vec![
        TensorSpec {
            name: "embed.weight".into(),
            dtype: DType::BF16,
            shape: vec![8, 4],
        },
        TensorSpec {
            name: "norm.weight".into(),
            dtype: DType::F32,
            shape: vec![4],
        },
    ]
}

/// Synthetic bytes for a box of a tensor, so every shard has a distinct real digest.
fn shard(t: &TensorSpec, off: &[u64], shape: &[u64], addr: u64) -> ShardEntry {
    let b = TensorBox {
        global_offset: off.to_vec(),
        local_shape: shape.to_vec(),
    };
    let len = b.numel().unwrap() * t.dtype.size_bytes();
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u8) ^ (off[0] as u8).wrapping_mul(31) ^ t.name.len() as u8)
        .collect();
    ShardEntry {
        tensor: t.name.clone(),
        dtype: t.dtype,
        global_shape: t.shape.clone(),
        shard: b,
        addr,
        len,
        device: MemDevice::Dram,
        digest: Digest::of(&bytes),
    }
}

/// FSDP over 2 slots: rows 0..4 / 4..8 of embed, 0..2 / 2..4 of norm.
fn manifest(slot: u32) -> SourceManifest {
    let ts = tensors();
    let r = u64::from(slot);
    let embed = shard(&ts[0], &[4 * r, 0], &[4, 4], 0x1000 + 0x10000 * r);
    let norm = shard(&ts[1], &[2 * r], &[2], 0x2000 + 0x10000 * r);
    let piece = DestPiece {
        layout: TP2,
        dest_rank: slot,
        tensor: embed.tensor.clone(),
        region: embed.shard.clone(),
        digest: embed.digest,
        packed_addr: Some(0x9000 + r),
    };
    SourceManifest {
        slot,
        layout: FSDP2,
        agent_name: format!("trainer-{slot}"),
        agent_metadata: vec![0xA5, slot as u8, 7],
        shards: vec![embed, norm],
        pieces: vec![piece],
        pack_seconds: 0.125,
    }
}

fn rpc_err(e: Error) -> (tonic::Code, String) {
    match e {
        Error::Rpc { code, message, .. } => (code, message),
        other => panic!("expected an RPC error, got {other}"),
    }
}

async fn next_cmd(s: &mut CommandStream) -> Command {
    tokio::time::timeout(T, s.next())
        .await
        .expect("command within the timeout")
        .unwrap()
        .expect("stream open")
}

fn staged(worker: &str, label: &str, rank: u32) -> StagedReport {
    StagedReport {
        worker_id: worker.into(),
        label: label.into(),
        ok: true,
        error: String::new(),
        ranks: vec![RankDigests {
            rank,
            tensors: [("embed.weight".to_string(), Digest::of(worker.as_bytes()))].into(),
        }],
        bytes: 96,
        descriptors: 3,
        seconds: 0.1 + f64::from(rank) / 3.0,
        strategies: [("exact".to_string(), 2), ("packed".to_string(), 1)].into(),
        source: "artifact_delta".into(),
        wire_bytes: 4096 + u64::from(rank),
    }
}

/// A fake engine answering the Dynamo routes like the contract says: it records every call,
/// installs whatever `update_weights_from_distributed` names, and holds `pause_generation`
/// while `hold_pause` is set.
#[derive(Default)]
struct FakeEngine {
    version: String,
    calls: Vec<(String, serde_json::Value)>,
    hold_pause: bool,
    /// Answer `update_weights_from_distributed` without the `version` field (older releases).
    versionless_update: bool,
}

type Fake = Arc<Mutex<FakeEngine>>;

async fn fake_route(
    axum::extract::State(f): axum::extract::State<Fake>,
    axum::extract::Path(route): axum::extract::Path<String>,
    body: axum::body::Bytes,
) -> axum::Json<serde_json::Value> {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    f.lock().unwrap().calls.push((route.clone(), body.clone()));
    if route == "pause_generation" {
        while f.lock().unwrap().hold_pause {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let mut e = f.lock().unwrap();
    let mut reply = serde_json::json!({"status": "ok", "message": route});
    if route == "update_weights_from_distributed" {
        assert_eq!(body["engine_rpc"], "mx_install", "{body}");
        assert_eq!(body["version_id"], body["weight_version"], "{body}");
        e.version = body["weight_version"].as_str().unwrap().to_string();
        reply["cache_tiers_cleared"] = serde_json::json!(["kv_cache"]);
    }
    if !(route == "update_weights_from_distributed" && e.versionless_update) {
        reply["version"] = serde_json::Value::String(e.version.clone());
    }
    axum::Json(reply)
}

/// Serves a fake engine on loopback; returns it and its system URL.
async fn fake_engine(version: &str) -> (Fake, String) {
    let fake: Fake = Arc::new(Mutex::new(FakeEngine {
        version: version.into(),
        ..FakeEngine::default()
    }));
    let app = axum::Router::new()
        .route(
            "/engine/{route}",
            axum::routing::post(fake_route).get(fake_route),
        )
        .with_state(Arc::clone(&fake));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (fake, url)
}

#[tokio::test]
async fn ready_only_when_every_slot_published_and_every_tensor_covered() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;

    c.declare_version("step-1", FSDP2, &tensors())
        .await
        .unwrap();
    let info = c.get_version("step-1").await.unwrap();
    assert_eq!(info.state, VersionState::Declared);
    assert_eq!(info.missing_slots, vec![0, 1]);

    // A waiter started before READY wakes when the last slot lands.
    let waiter = {
        let c = c.clone();
        tokio::spawn(async move { c.wait_version("step-1", VersionState::Ready, T).await })
    };

    let m0 = manifest(0);
    let m1 = manifest(1);
    let out = c.publish("step-1", &m0).await.unwrap();
    assert_eq!(out.state, VersionState::Publishing);
    assert_eq!(out.version_digest, None);
    let info = c.get_version("step-1").await.unwrap();
    assert_eq!(info.published_slots, vec![0]);
    assert_eq!(info.missing_slots, vec![1]);
    assert_eq!(info.version_digest, None);
    let e = c
        .wait_version("step-1", VersionState::Ready, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::WaitNotReached { current, .. } if current.0 == Some(VersionState::Publishing)),
        "{e}"
    );

    let out = c.publish("step-1", &m1).await.unwrap();
    let want = version_digest(m0.shards.iter().chain(&m1.shards));
    assert_eq!(out.state, VersionState::Ready);
    assert_eq!(out.version_digest, Some(want));
    let woke = waiter.await.unwrap().unwrap();
    assert_eq!(woke.state, VersionState::Ready);
    assert_eq!(woke.version_digest, Some(want));

    let info = c.get_version("step-1").await.unwrap();
    assert_eq!(info.state, VersionState::Ready);
    assert!(info.missing_slots.is_empty() && info.missing_tensors.is_empty());
    // Manifests round-trip through proto unchanged.
    assert_eq!(info.manifests, vec![m0.clone(), m1.clone()]);

    // A declared tensor that no manifest holds: never READY, named in missing_tensors.
    let mut with_head = tensors();
    with_head.push(TensorSpec {
        name: "lm_head.weight".into(),
        dtype: DType::BF16,
        shape: vec![8, 4],
    });
    c.declare_version("step-2", FSDP2, &with_head)
        .await
        .unwrap();
    c.publish("step-2", &m0).await.unwrap();
    let out = c.publish("step-2", &m1).await.unwrap();
    assert_eq!(out.state, VersionState::Publishing);
    let info = c.get_version("step-2").await.unwrap();
    assert_eq!(info.state, VersionState::Publishing);
    assert!(info.missing_slots.is_empty());
    assert_eq!(info.missing_tensors, vec!["lm_head.weight".to_string()]);
    assert_eq!(info.version_digest, None);
    let (code, msg) = rpc_err(c.stage("step-2", &["w"]).await.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("PUBLISHING"), "{msg}");

    // A tensor covered only in part: the gap is reported with its region.
    c.declare_version("step-3", FSDP2, &tensors())
        .await
        .unwrap();
    c.publish("step-3", &m0).await.unwrap();
    let mut m1_short = m1.clone();
    m1_short.shards.retain(|s| s.tensor != "embed.weight");
    c.publish("step-3", &m1_short).await.unwrap();
    let info = c.get_version("step-3").await.unwrap();
    assert_eq!(info.state, VersionState::Publishing);
    assert!(info.missing_tensors.is_empty());
    assert_eq!(info.coverage_gaps.len(), 1);
    assert_eq!(info.coverage_gaps[0].tensor, "embed.weight");
    assert_eq!(
        info.coverage_gaps[0].region,
        TensorBox {
            global_offset: vec![4, 0],
            local_shape: vec![4, 4]
        }
    );
    // The restarted rank republishes its slot whole: READY.
    let out = c.publish("step-3", &m1).await.unwrap();
    assert_eq!(out.state, VersionState::Ready);
    assert_eq!(out.version_digest, Some(want));

    let status = c.get_status().await.unwrap();
    let states: Vec<_> = status
        .versions
        .iter()
        .map(|v| (v.label.as_str(), v.state))
        .collect();
    assert_eq!(
        states,
        vec![
            ("step-1", VersionState::Ready),
            ("step-2", VersionState::Publishing),
            ("step-3", VersionState::Ready)
        ]
    );
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_manifests_and_declarations_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    c.declare_version("v", FSDP2, &tensors()).await.unwrap();
    // Identical re-declare is fine; a different one is AlreadyExists.
    c.declare_version("v", FSDP2, &tensors()).await.unwrap();
    let (code, msg) = rpc_err(c.declare_version("v", TP2, &tensors()).await.unwrap_err());
    assert_eq!(code, tonic::Code::AlreadyExists);
    assert!(msg.contains("\"v\""), "{msg}");

    let mut bad = manifest(0);
    bad.shards[0].dtype = DType::F16;
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("embed.weight") && msg.contains("dtype mismatch"),
        "{msg}"
    );
    assert!(msg.contains("F16") && msg.contains("BF16"), "{msg}");

    let mut bad = manifest(1);
    bad.shards[1].global_shape = vec![5];
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("norm.weight") && msg.contains("shape mismatch"),
        "{msg}"
    );

    let mut bad = manifest(0);
    bad.shards[0].tensor = "ghost.weight".into();
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("ghost.weight") && msg.contains("not declared"),
        "{msg}"
    );

    let mut bad = manifest(0);
    bad.shards[0].len -= 2;
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("embed.weight") && msg.contains("len 30"),
        "{msg}"
    );

    let mut bad = manifest(1);
    bad.shards[0].shard.global_offset = vec![6, 0];
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("embed.weight") && msg.contains("does not fit"),
        "{msg}"
    );

    let mut bad = manifest(0);
    bad.slot = 2;
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(msg.contains("slot 2"), "{msg}");

    let mut bad = manifest(0);
    bad.shards[0].digest = Digest::default();
    bad.pieces[0].region.local_shape = vec![9, 4];
    let (code, msg) = rpc_err(c.publish("v", &bad).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("embed.weight") && msg.contains("region"),
        "{msg}"
    );

    let (code, _) = rpc_err(c.publish("nope", &manifest(0)).await.unwrap_err());
    assert_eq!(code, tonic::Code::NotFound);

    // Nothing refused was recorded: no slot published, and only the one declare in the journal.
    let info = c.get_version("v").await.unwrap();
    assert_eq!(info.state, VersionState::Declared);
    assert!(info.published_slots.is_empty());
    h.shutdown().await.unwrap();
    let records = mx_control::journal::read_records(&dir.path().join("journal.jsonl")).unwrap();
    assert_eq!(records.len(), 1);
}

#[tokio::test]
async fn stage_commands_reports_and_the_long_poll() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    c.declare_version("step-7", FSDP2, &tensors())
        .await
        .unwrap();
    c.publish("step-7", &manifest(0)).await.unwrap();
    let digest = c
        .publish("step-7", &manifest(1))
        .await
        .unwrap()
        .version_digest
        .unwrap();

    c.register_worker("w0", "inst-0", &[0, 1], TP2)
        .await
        .unwrap();
    c.register_worker("w1", "inst-1", &[0], REP1).await.unwrap();
    assert_eq!(c.list_layouts().await.unwrap(), vec![REP1, TP2]);
    let (code, _) = rpc_err(c.register_worker("bad", "i", &[2], TP2).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);

    let mut s0 = c.watch_commands("w0").await.unwrap();

    let (code, msg) = rpc_err(c.stage("step-7", &["w0", "ghost"]).await.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("ghost"), "{msg}");

    c.stage("step-7", &["w0", "w1"]).await.unwrap();
    let stage = Command::Stage {
        label: "step-7".into(),
        version_digest: digest,
    };
    assert_eq!(next_cmd(&mut s0).await, stage);
    // w1 had no stream when the Stage was issued: it gets it when it connects.
    let mut s1 = c.watch_commands("w1").await.unwrap();
    assert_eq!(next_cmd(&mut s1).await, stage);

    c.report_staged(&staged("w0", "step-7", 0)).await.unwrap();
    // A report for a version the worker is not staging (e.g. superseded by a newer Stage) is
    // dropped: it changes nothing, and the worker stays STAGING step-7.
    c.report_staged(&staged("w1", "step-8", 0)).await.unwrap();
    // The long poll does not report STAGED while w1 is still staging...
    let (reached, briefs) = c
        .wait_workers(
            "step-7",
            &["w0", "w1"],
            WorkerState::Staged,
            Duration::from_millis(100),
        )
        .await
        .unwrap();
    assert!(!reached);
    assert_eq!(briefs[0].state, WorkerState::Staged);
    assert_eq!(briefs[1].state, WorkerState::Staging);
    // ...answers as soon as it is, without waiting out its timeout...
    let waiter = {
        let c = c.clone();
        tokio::spawn(async move {
            let t = std::time::Instant::now();
            let r = c
                .wait_workers(
                    "step-7",
                    &["w0", "w1"],
                    WorkerState::Staged,
                    Duration::from_secs(30),
                )
                .await
                .unwrap();
            (r, t.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.report_staged(&staged("w1", "step-7", 1)).await.unwrap();
    let ((reached, _), waited) = waiter.await.unwrap();
    assert!(reached && waited < Duration::from_secs(5), "{waited:?}");
    // ...and counts an unregistered worker as FAILED.
    let (reached, briefs) = c
        .wait_workers(
            "step-7",
            &["nobody"],
            WorkerState::Staged,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(!reached);
    assert_eq!(briefs[0].state, WorkerState::Failed);

    // Staging commits nothing: the version stays READY, nothing is resident, no command is
    // outstanding.
    assert_eq!(
        c.get_version("step-7").await.unwrap().state,
        VersionState::Ready
    );
    let status = c.get_status().await.unwrap();
    assert_eq!(status.workers.len(), 2);
    let w1 = &status.workers[1];
    assert_eq!(w1.worker_id, "w1");
    assert_eq!(w1.instance, "inst-1");
    assert_eq!(w1.layout, REP1);
    assert_eq!(w1.state, WorkerState::Staged);
    assert_eq!(w1.label.as_deref(), Some("step-7"));
    assert_eq!(w1.version_digest, Some(digest));
    assert_eq!(w1.resident_version, None);
    // Per-tensor digests on request only.
    let mut brief = staged("w1", "step-7", 1);
    assert!(!brief.ranks.is_empty());
    brief.ranks.clear();
    assert_eq!(w1.last_staged.as_ref(), Some(&brief));
    let full = c.get_status_with(true).await.unwrap();
    assert_eq!(
        full.workers[1].last_staged.as_ref(),
        Some(&staged("w1", "step-7", 1))
    );
    assert_eq!(w1.gate, Some(mx_control::Gate::NoWeights));
    assert!(w1.connected);
    assert_eq!(status.workers[0].ranks, vec![0, 1]);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), s1.next())
            .await
            .is_err(),
        "no command after STAGED"
    );

    // A failed stage is FAILED with the worker's error, and ends the long poll at once.
    c.stage("step-7", &["w1"]).await.unwrap();
    assert_eq!(next_cmd(&mut s1).await, stage);
    let mut bad = staged("w1", "step-7", 0);
    bad.ok = false;
    bad.error = "verification failed: tensor embed.weight".into();
    c.report_staged(&bad).await.unwrap();
    let (reached, briefs) = c
        .wait_workers("step-7", &["w1"], WorkerState::Staged, T)
        .await
        .unwrap();
    assert!(!reached);
    assert_eq!(briefs[0].state, WorkerState::Failed);
    assert!(briefs[0].error.as_deref().unwrap().contains("embed.weight"));

    // A new stream for w0 replaces the old one, which ends.
    let _s0b = c.watch_commands("w0").await.unwrap();
    let ended = tokio::time::timeout(T, s0.next()).await.unwrap().unwrap();
    assert_eq!(ended, None);
    h.shutdown().await.unwrap();
}

/// Registers worker `id` (its own instance, rank 0 of `REP1`, resident `disk:/ckpt`) with a
/// Dynamo engine at `url`.
async fn register_dynamo(c: &ControlClient, id: &str, url: &str) {
    c.register(&Registration {
        worker_id: id.into(),
        instance: id.into(),
        ranks: vec![0],
        layout: REP1,
        engine: Some(EngineEndpoint {
            api: EngineApi::Dynamo,
            system_url: url.to_string(),
            no_model: false,
            frontend: None,
        }),
        resident_version: Some(ResidentVersion::parse("disk:/ckpt")),
        model_limits: None,
        seen: Default::default(),
    })
    .await
    .unwrap();
}

/// Declares `step-7` and publishes both of its slots; its digest and version id.
async fn declare_and_publish_step7(c: &ControlClient) -> (Digest, VersionId) {
    c.declare_version("step-7", FSDP2, &tensors())
        .await
        .unwrap();
    c.publish("step-7", &manifest(0)).await.unwrap();
    let digest = c
        .publish("step-7", &manifest(1))
        .await
        .unwrap()
        .version_digest
        .unwrap();
    (digest, VersionId(digest))
}

/// A full-lifecycle refit of worker `w` to `step-7`, each engine call given `call_timeout_ms`.
fn step7_on_w(call_timeout_ms: u64) -> RefitSpec {
    RefitSpec {
        no_check: false,
        label: "step-7".into(),
        worker_ids: vec!["w".into()],
        pause_mode: PauseMode::Wait,
        allow_partial: false,
        check: None,
        framework_step: 7,
        stage_timeout_ms: 10_000,
        call_timeout_ms,
        apply_parallelism: 0,
        orchestrator_gated: false,
        verify_from_apply_answer: false,
    }
}

#[tokio::test]
async fn a_refit_is_the_only_commit_and_a_stage_waits_for_it_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    let (digest, target) = declare_and_publish_step7(&c).await;
    let (fake, url) = fake_engine("disk:/ckpt").await;
    fake.lock().unwrap().hold_pause = true;
    register_dynamo(&c, "w", &url).await;
    let mut s = c.watch_commands("w").await.unwrap();

    let spec = step7_on_w(10_000);
    let id = c.refit(&spec).await.unwrap();
    // STAGE goes over the command stream, like any stage.
    assert_eq!(
        next_cmd(&mut s).await,
        Command::Stage {
            label: "step-7".into(),
            version_digest: digest,
        }
    );
    c.report_staged(&staged("w", "step-7", 0)).await.unwrap();
    // PREPARE: the engine holds the pause; the refit is open.
    let t = std::time::Instant::now();
    while fake.lock().unwrap().calls.is_empty() {
        assert!(t.elapsed() < T, "the refit never paused the engine");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        c.get_version("step-7").await.unwrap().state,
        VersionState::Committing
    );
    // Staging a worker of an open refit from outside is refused, naming the refit.
    let (code, msg) = rpc_err(c.stage("step-7", &["w"]).await.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains(&format!("refit {id}")) && msg.contains("worker w"),
        "{msg}"
    );
    let (ended, r) = c.wait_refit(id, Duration::from_millis(50)).await.unwrap();
    assert!(!ended && r.unwrap().outcome.is_none());

    fake.lock().unwrap().hold_pause = false;
    let (ended, r) = c.wait_refit(id, T).await.unwrap();
    let r = r.unwrap();
    assert!(ended, "{r:?}");
    assert_eq!(r.outcome, Some(Outcome::Committed), "{}", r.reason);
    let actions: Vec<Action> = r.workers["w"]
        .calls
        .iter()
        .map(|c| c.action.clone())
        .collect();
    assert_eq!(
        actions,
        [
            Action::Pause,
            Action::Apply {
                version: target.into()
            },
            Action::ReadVersion,
            Action::Resume
        ]
    );
    let calls = fake.lock().unwrap().calls.clone();
    assert_eq!(calls[1].0, "update_weights_from_distributed");
    let id = mx_layout::VersionId(digest).to_string();
    assert_eq!(
        calls[1].1,
        serde_json::json!({"engine_rpc": "mx_install", "version_id": id, "weight_version": id,
                           "reset_prefix_cache": true})
    );

    // The version is COMMITTED, the worker runs it and is admitted.
    let info = c.get_version("step-7").await.unwrap();
    assert_eq!(info.state, VersionState::Committed);
    assert_eq!(info.commit_workers, vec!["w".to_string()]);
    let status = c.get_status().await.unwrap();
    assert_eq!(
        status.fleet_version,
        Some(mx_control::FleetVersion {
            label: "step-7".to_string(),
            version_id: target
        })
    );
    let w = &status.workers[0];
    assert_eq!(w.resident_id, Some(target.into()));
    assert_eq!(w.resident_version, Some(digest));
    assert!(w.admitted, "{}", w.admission);
    // Once the refit ended, staging is accepted again.
    c.stage("step-7", &["w"]).await.unwrap();
    h.shutdown().await.unwrap();

    // The journal holds only the refit's records for the commit, and replays to the same state.
    let ops: Vec<String> = mx_control::journal::read_records(&path)
        .unwrap()
        .iter()
        .map(|e| {
            serde_json::to_value(&e.record).unwrap()["op"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(
        !ops.iter().any(|o| o == "commit" || o == "applied"),
        "{ops:?}"
    );
    assert!(ops.iter().any(|o| o == "refit_end"), "{ops:?}");
    let (c, h) = start(&path).await;
    let again = c.get_status().await.unwrap();
    assert_eq!(again.fleet_version, status.fleet_version);
    assert_eq!(again.workers[0].resident_version, Some(digest));
    assert_eq!(
        c.get_version("step-7").await.unwrap().state,
        VersionState::Committed
    );
    h.shutdown().await.unwrap();
}

/// An engine call in flight fails at once when its worker registers again (the process called
/// is not the one registered now): the refit does not wait for the call's timeout.
#[tokio::test]
async fn a_call_in_flight_fails_at_once_when_its_worker_registers_again() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    declare_and_publish_step7(&c).await;
    let (fake, url) = fake_engine("disk:/ckpt").await;
    fake.lock().unwrap().hold_pause = true;
    register_dynamo(&c, "w", &url).await;
    let mut s = c.watch_commands("w").await.unwrap();
    let spec = step7_on_w(60_000);
    let id = c.refit(&spec).await.unwrap();
    next_cmd(&mut s).await;
    c.report_staged(&staged("w", "step-7", 0)).await.unwrap();
    let t = std::time::Instant::now();
    while fake.lock().unwrap().calls.is_empty() {
        assert!(t.elapsed() < T, "the refit never paused the engine");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The pause is held by the engine; the worker's process restarts meanwhile (its stream
    // closes, the new process registers).
    drop(s);
    wait_connected(&c, "w", false).await;
    register_dynamo(&c, "w", &url).await;
    let _s = c.watch_commands("w").await.unwrap();
    let (ended, r) = c.wait_refit(id, T).await.unwrap();
    let r = r.unwrap();
    assert!(ended, "the refit waited for the held call: {r:?}");
    assert_ne!(r.outcome, Some(Outcome::Committed));
    let pause = &r.workers["w"].calls[0];
    assert_eq!(pause.action, Action::Pause);
    let result = pause.result.as_ref().unwrap();
    assert!(
        !result.ok && result.error.contains("registered again during the call"),
        "{result:?}"
    );
    fake.lock().unwrap().hold_pause = false;
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn verify_takes_the_version_from_apply_answers_and_reads_back_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    let (_, target) = declare_and_publish_step7(&c).await;
    // `a` reports its version in the APPLY answer, `b` does not.
    let (fake_a, url_a) = fake_engine("disk:/ckpt").await;
    let (fake_b, url_b) = fake_engine("disk:/ckpt").await;
    fake_b.lock().unwrap().versionless_update = true;
    let mut streams = Vec::new();
    for (w, url) in [("a", &url_a), ("b", &url_b)] {
        register_dynamo(&c, w, url).await;
        streams.push(c.watch_commands(w).await.unwrap());
    }
    let spec = RefitSpec {
        no_check: false,
        label: "step-7".into(),
        worker_ids: vec!["a".into(), "b".into()],
        pause_mode: PauseMode::Keep,
        allow_partial: false,
        check: None,
        framework_step: 7,
        stage_timeout_ms: 10_000,
        call_timeout_ms: 10_000,
        apply_parallelism: 0,
        orchestrator_gated: true,
        verify_from_apply_answer: true,
    };
    let id = c.refit(&spec).await.unwrap();
    for (w, s) in ["a", "b"].iter().zip(&mut streams) {
        assert!(matches!(next_cmd(s).await, Command::Stage { .. }));
        c.report_staged(&staged(w, "step-7", 0)).await.unwrap();
    }
    let (ended, r) = c.wait_refit(id, T).await.unwrap();
    let r = r.unwrap();
    assert!(ended, "{r:?}");
    assert_eq!(r.outcome, Some(Outcome::Committed), "{}", r.reason);
    let actions = |w: &str| -> Vec<Action> {
        r.workers[w]
            .calls
            .iter()
            .map(|c| c.action.clone())
            .collect()
    };
    let apply = Action::Apply {
        version: target.into(),
    };
    // Orchestrator-gated: no pause or resume; `a`'s answer stood for its read-back.
    assert_eq!(actions("a").as_slice(), std::slice::from_ref(&apply));
    assert_eq!(actions("b"), [apply, Action::ReadVersion]);
    for w in ["a", "b"] {
        assert_eq!(r.workers[w].resident, Some(target.into()));
    }
    let routes = |f: &Fake| -> Vec<String> {
        f.lock()
            .unwrap()
            .calls
            .iter()
            .map(|c| c.0.clone())
            .collect()
    };
    assert_eq!(routes(&fake_a), ["update_weights_from_distributed"]);
    assert_eq!(
        routes(&fake_b),
        ["update_weights_from_distributed", "get_weight_version"]
    );
    h.shutdown().await.unwrap();
    // The VERIFY phase says where the versions came from.
    let reasons: Vec<String> = mx_control::journal::read_records(&path)
        .unwrap()
        .iter()
        .map(|e| serde_json::to_value(&e.record).unwrap())
        .filter(|v| v["op"] == "refit_phase" && v["phase"] == "verify")
        .map(|v| v["reason"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        reasons,
        ["1 of 2 resident versions taken from the APPLY answers"]
    );
}

#[tokio::test]
async fn a_journal_of_the_retired_commit_path_is_refused_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"seq":1,"unix_ms":1,"record":{"op":"applied","report":{"worker_id":"w","label":"v","ok":true,"error":"","resident_version":null,"ranks":[]}}}"#,
            "\n"
        ),
    )
    .unwrap();
    let err = spawn(ControlPlaneConfig {
        compaction: Default::default(),
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: path.clone(),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::JournalCorrupt { line: 1, .. })
            && msg.contains("`applied`")
            && msg.contains("ReportApplied"),
        "{msg}"
    );
    // Nothing was cut or appended.
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
}

#[tokio::test]
async fn restart_replays_the_journal_to_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    c.declare_version("a", FSDP2, &tensors()).await.unwrap();
    c.publish("a", &manifest(0)).await.unwrap();
    let digest = c
        .publish("a", &manifest(1))
        .await
        .unwrap()
        .version_digest
        .unwrap();
    c.declare_version("b", FSDP2, &tensors()).await.unwrap();
    c.publish("b", &manifest(1)).await.unwrap();
    c.register_worker("w0", "inst-0", &[0, 1], TP2)
        .await
        .unwrap();
    c.register_worker("w1", "inst-1", &[0], REP1).await.unwrap();
    c.stage("a", &["w0", "w1"]).await.unwrap();
    c.report_staged(&staged("w0", "a", 0)).await.unwrap();
    let status = c.get_status().await.unwrap();
    let va = c.get_version("a").await.unwrap();
    let vb = c.get_version("b").await.unwrap();
    h.shutdown().await.unwrap();
    assert_eq!(mx_control::journal::read_records(&path).unwrap().len(), 9);

    // A crash mid-write leaves a torn last line: tolerated.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"{\"seq\":10,\"unix_ms\":17,\"record\":{\"op\":\"reg")
        .unwrap();

    let (c, h) = start(&path).await;
    // What a restart keeps: everything but the publishers' liveness (heard again when they
    // ping; these did not).
    let heard_from = |mut s: mx_control::FleetStatus| {
        for p in s.versions.iter_mut().flat_map(|v| v.publishers.iter_mut()) {
            p.last_seen_ms = None;
            p.liveness = mx_control::Liveness::Unknown;
        }
        s
    };
    assert_eq!(
        heard_from(c.get_status().await.unwrap()),
        heard_from(status.clone())
    );
    assert_eq!(c.get_version("a").await.unwrap(), va);
    assert_eq!(c.get_version("b").await.unwrap(), vb);
    assert_eq!(va.state, VersionState::Ready);
    assert_eq!(status.workers[0].state, WorkerState::Staged);
    assert_eq!(status.workers[1].state, WorkerState::Staging);

    // The outstanding command is re-sent to the reconnecting worker; its stage completes.
    let mut s1 = c.watch_commands("w1").await.unwrap();
    assert_eq!(
        next_cmd(&mut s1).await,
        Command::Stage {
            label: "a".into(),
            version_digest: digest
        }
    );
    c.report_staged(&staged("w1", "a", 1)).await.unwrap();
    let (reached, _) = c
        .wait_workers("a", &["w0", "w1"], WorkerState::Staged, T)
        .await
        .unwrap();
    assert!(reached);
    h.shutdown().await.unwrap();
    // The torn line was cut off; the new record follows the last good one.
    let records = mx_control::journal::read_records(&path).unwrap();
    assert_eq!(records.len(), 10);
    assert_eq!(records[9].seq, 10);

    // A garbled line that is not the last one is an error naming it.
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[4] = "{\"seq\":5,\"garbage";
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let err = spawn(ControlPlaneConfig {
        compaction: Default::default(),
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: path.clone(),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .unwrap_err();
    assert!(
        matches!(err, Error::JournalCorrupt { line: 5, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn bad_worker_ids_are_refused_and_a_stage_of_an_overwritten_version_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let (c, _h) = start(&dir.path().join("journal.jsonl")).await;
    declare_and_publish_step7(&c).await;
    let (_fake, url) = fake_engine("disk:/ckpt").await;
    register_dynamo(&c, "w", &url).await;
    // A worker id with a space and a slash is refused, naming the field.
    let (code, msg) = rpc_err(
        c.register_worker("w 9/../x", "i", &[0], REP1)
            .await
            .unwrap_err(),
    );
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("invalid field worker_id") && msg.contains("' '"),
        "{msg}"
    );
    // The publisher of slot 0 applies a training step in place and publishes step-8 from the
    // same memory. A worker that still holds step-7 could stage it without a pull, so the stage
    // is not refused; a worker that pulls it fails verification, and its error says why.
    c.declare_version("step-8", FSDP2, &tensors())
        .await
        .unwrap();
    c.publish("step-8", &manifest(0)).await.unwrap();
    let mut s = c.watch_commands("w").await.unwrap();
    // Stages `label` on w, which reports `error`; w's error as the control plane then lists it.
    async fn stage_fails(
        c: &ControlClient,
        s: &mut CommandStream,
        label: &str,
        error: &str,
    ) -> String {
        c.stage(label, &["w"]).await.unwrap();
        assert!(matches!(next_cmd(s).await, Command::Stage { .. }));
        let mut failed = staged("w", label, 0);
        failed.ok = false;
        failed.error = error.into();
        c.report_staged(&failed).await.unwrap();
        let st = c.get_status().await.unwrap();
        let w = st.workers.iter().find(|w| w.worker_id == "w").unwrap();
        assert_eq!(w.state, WorkerState::Failed);
        w.last_error.clone().unwrap_or_default()
    }
    let err = stage_fails(
        &c,
        &mut s,
        "step-7",
        "verification failed: tensor embed.weight region [0..4, 0..4]",
    )
    .await;
    assert!(
        err.starts_with("verification failed: tensor embed.weight")
            && err.contains("version step-7 can no longer be pulled: source slot 0 now holds version step-8 in the same memory"),
        "{err}"
    );
    // step-8's own stage failures carry no such note.
    c.publish("step-8", &manifest(1)).await.unwrap();
    assert_eq!(
        stage_fails(&c, &mut s, "step-8", "pull failed").await,
        "pull failed"
    );
}

#[tokio::test]
async fn a_post_update_check_the_engines_would_refuse_is_refused_before_anything_pauses() {
    let dir = tempfile::tempdir().unwrap();
    let (c, _h) = start(&dir.path().join("journal.jsonl")).await;
    declare_and_publish_step7(&c).await;
    let (fake, url) = fake_engine("disk:/ckpt").await;
    c.register(&Registration {
        worker_id: "w".into(),
        instance: "w".into(),
        ranks: vec![0],
        layout: REP1,
        engine: Some(EngineEndpoint {
            api: EngineApi::Dynamo,
            system_url: url.clone(),
            no_model: false,
            frontend: None,
        }),
        resident_version: Some(ResidentVersion::parse("disk:/ckpt")),
        model_limits: Some(mx_control::ModelLimits {
            vocab_size: 49152,
            max_positions: 8192,
        }),
        seen: Default::default(),
    })
    .await
    .unwrap();
    let spec = |prompt: Vec<u32>, new: u32| RefitSpec {
        no_check: false,
        label: "step-7".into(),
        worker_ids: vec!["w".into()],
        pause_mode: PauseMode::Wait,
        allow_partial: false,
        check: Some(mx_control::GenerationCheck::tokens(prompt, new, vec![])),
        framework_step: 7,
        stage_timeout_ms: 10_000,
        call_timeout_ms: 10_000,
        apply_parallelism: 0,
        orchestrator_gated: false,
        verify_from_apply_answer: false,
    };
    let (code, msg) = rpc_err(c.refit(&spec(vec![1, 99_999_999], 4)).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("invalid field check.probes[0].prompt_tokens[1]: token id 99999999 is outside the vocabulary of 49152 of worker w; nothing was paused"),
        "{msg}"
    );
    let (code, msg) = rpc_err(c.refit(&spec(vec![1, 2], 8191)).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        msg.contains("check.max_new_tokens: 8191: give 1 to 1024"),
        "{msg}"
    );
    // No refit began and the engine got no call.
    let (_, refit) = c.wait_refit(0, Duration::ZERO).await.unwrap();
    assert!(refit.is_none(), "{refit:?}");
    assert!(fake.lock().unwrap().calls.is_empty());
    // Re-registered without limits (unknown), the same check is left to the engine.
    register_dynamo(&c, "w", &url).await;
    let id = c.refit(&spec(vec![1, 99_999_999], 4)).await.unwrap();
    assert_eq!(id, 1);
}

/// Registers `id` as incarnation `inc` with a Dynamo engine at `url`.
async fn register_as(c: &ControlClient, id: &str, inc: u64, url: &str) -> Result<(), Error> {
    c.clone()
        .with_incarnation(inc)
        .register(&Registration {
            worker_id: id.into(),
            instance: id.into(),
            ranks: vec![0],
            layout: REP1,
            engine: Some(EngineEndpoint {
                api: EngineApi::Dynamo,
                system_url: url.to_string(),
                no_model: false,
                frontend: None,
            }),
            resident_version: Some(ResidentVersion::parse("disk:/ckpt")),
            model_limits: None,
            seen: Default::default(),
        })
        .await
}

/// The engine URL the control plane holds for `id` (what a refit of it calls).
async fn engine_of(c: &ControlClient, id: &str) -> Option<String> {
    let s = c.get_status().await.unwrap();
    let w = s.workers.into_iter().find(|w| w.worker_id == id)?;
    w.engine.map(|e| e.system_url)
}

/// Regression (issue 13): a registration under a connected worker's id with another worker's
/// `system_url` was accepted, and the next refit went to the wrong engine.
#[tokio::test]
async fn a_registration_cannot_take_over_a_live_worker_id_or_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    let (a, b) = ("http://127.0.0.1:9001", "http://127.0.0.1:9002");
    register_as(&c, "w0", 0xa, a).await.unwrap();
    let s0 = c
        .clone()
        .with_incarnation(0xa)
        .watch_commands("w0")
        .await
        .unwrap();
    wait_connected(&c, "w0", true).await;

    // Another process (incarnation 0xb) under the live id: refused, ALREADY_EXISTS, naming the
    // id and why; the id keeps its engine.
    let e = register_as(&c, "w0", 0xb, b).await.unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    assert!(
        matches!(
            &e,
            Error::Rpc {
                code: tonic::Code::AlreadyExists,
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("\"w0\"") && msg.contains("command stream is connected"),
        "{msg}"
    );
    assert_eq!(engine_of(&c, "w0").await.as_deref(), Some(a));
    // An older client without an incarnation counts as another process too.
    let e = register_as(&c, "w0", 0, b).await.unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    // Another id claiming w0's engine: refused, naming w0.
    let e = register_as(&c, "w1", 0xc, a).await.unwrap_err();
    assert!(
        e.is_worker_id_in_use() && e.to_string().contains("\"w0\""),
        "{e}"
    );
    // Nor can the other process follow w0's commands.
    let e = c
        .clone()
        .with_incarnation(0xb)
        .watch_commands("w0")
        .await
        .unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    // The same process registering again (a reconnect the server has not noticed yet) is fine.
    register_as(&c, "w0", 0xa, a).await.unwrap();
    assert!(!e.is_transient());

    // Once the old stream is gone (its process died), a new incarnation takes the id over; the
    // old one, coming back, is refused both ways and learns it was displaced.
    drop(s0);
    wait_connected(&c, "w0", false).await;
    register_as(&c, "w0", 0xb, b).await.unwrap();
    assert_eq!(engine_of(&c, "w0").await.as_deref(), Some(b));
    let e = c
        .clone()
        .with_incarnation(0xa)
        .watch_commands("w0")
        .await
        .unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    let _s1 = c
        .clone()
        .with_incarnation(0xb)
        .watch_commands("w0")
        .await
        .unwrap();
    wait_connected(&c, "w0", true).await;
    let e = register_as(&c, "w0", 0xa, a).await.unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    assert_eq!(engine_of(&c, "w0").await.as_deref(), Some(b));
    // The freed engine URL can be registered by another id now.
    register_as(&c, "w1", 0xc, a).await.unwrap();
    h.shutdown().await.unwrap();
}

/// Registers `id` as rank `rank` of instance `instance` with a vLLM engine at `url`.
async fn register_rank(
    c: &ControlClient,
    id: &str,
    instance: &str,
    rank: u32,
    url: &str,
) -> Result<(), Error> {
    c.clone()
        .with_incarnation(0x100 + u64::from(rank))
        .register(&Registration {
            worker_id: id.into(),
            instance: instance.into(),
            ranks: vec![rank],
            layout: mx_layout::LayoutSpec {
                scheme: mx_layout::Scheme::VllmTp,
                world_size: 3,
            },
            engine: Some(EngineEndpoint {
                api: EngineApi::Vllm,
                system_url: url.to_string(),
                no_model: false,
                frontend: None,
            }),
            resident_version: Some(ResidentVersion::parse("disk:/ckpt")),
            model_limits: None,
            seen: Default::default(),
        })
        .await
}

/// The tensor-parallel ranks of one vLLM server are one process each and share its URL: they
/// register side by side; another instance, or a second worker for a held rank, may not.
#[tokio::test]
async fn the_ranks_of_one_engine_share_its_url_and_nobody_else_does() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    let url = "http://127.0.0.1:9101";
    let mut streams = Vec::new();
    for r in 0..2u32 {
        let id = format!("v-tp{r}");
        register_rank(&c, &id, "v", r, url).await.unwrap();
        streams.push(
            c.clone()
                .with_incarnation(0x100 + u64::from(r))
                .watch_commands(&id)
                .await
                .unwrap(),
        );
        wait_connected(&c, &id, true).await;
    }
    register_rank(&c, "v-tp2", "v", 2, url).await.unwrap();
    assert_eq!(engine_of(&c, "v-tp2").await.as_deref(), Some(url));
    // Another instance claiming the engine: refused, naming a holder.
    let e = register_rank(&c, "other-tp0", "other", 0, url)
        .await
        .unwrap_err();
    assert!(
        e.is_worker_id_in_use() && e.to_string().contains("\"v-tp"),
        "{e}"
    );
    // A second worker for rank 0 of the same instance: refused too.
    let e = register_rank(&c, "v-tp0-again", "v", 0, url)
        .await
        .unwrap_err();
    assert!(
        e.is_worker_id_in_use() && e.to_string().contains("\"v-tp0\""),
        "{e}"
    );
    h.shutdown().await.unwrap();
}

async fn wait_connected(c: &ControlClient, id: &str, want: bool) {
    let t = std::time::Instant::now();
    loop {
        let s = c.get_status().await.unwrap();
        if s.workers
            .iter()
            .any(|w| w.worker_id == id && w.connected == want)
        {
            return;
        }
        assert!(t.elapsed() < T, "{id} never became connected={want}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The ids the control plane lists, ascending.
async fn listed(c: &ControlClient) -> Vec<String> {
    let mut ids: Vec<String> = c
        .get_status()
        .await
        .unwrap()
        .workers
        .into_iter()
        .map(|w| w.worker_id)
        .collect();
    ids.sort();
    ids
}

/// Issue 29, item 2: ids registered once stayed forever, and ten junk ids made every default
/// refit abort. A worker retires its own id; an orchestrator retires a departed one (not a
/// connected one); retirements are journaled (a restart keeps them); the retention rule retires
/// ids departed longer than `retire_departed_after` and leaves the connected ones.
#[tokio::test]
async fn worker_ids_are_retired_by_their_process_an_orchestrator_or_retention() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.jsonl");
    let (c, h) = start(&journal).await;
    register_as(&c, "w0", 0xa, "http://127.0.0.1:9301")
        .await
        .unwrap();
    let s0 = c
        .clone()
        .with_incarnation(0xa)
        .watch_commands("w0")
        .await
        .unwrap();
    wait_connected(&c, "w0", true).await;
    for i in 0..10 {
        register_as(
            &c,
            &format!("x{i}"),
            0x100 + i,
            &format!("http://10.0.0.{i}:1"),
        )
        .await
        .unwrap();
    }
    assert_eq!(listed(&c).await.len(), 11);
    // An orchestrator may not retire a connected id, nor another process the live one.
    let e = c.retire_worker("w0", "cleanup").await.unwrap_err();
    assert!(
        e.is_worker_id_in_use() && e.to_string().contains("command stream is connected"),
        "{e}"
    );
    let e = c
        .clone()
        .with_incarnation(0xb)
        .retire_worker("w0", "")
        .await
        .unwrap_err();
    assert!(e.is_worker_id_in_use(), "{e}");
    let e = c.retire_worker("nobody", "").await.unwrap_err();
    assert!(e.to_string().contains("nobody"), "{e}");
    let e = c.retire_worker("x0", "bad\nreason").await.unwrap_err();
    assert!(e.to_string().contains("printable ASCII"), "{e}");
    // A departed id is retired by an orchestrator; the live worker retires its own id.
    c.retire_worker("x0", "departed").await.unwrap();
    c.clone()
        .with_incarnation(0xa)
        .retire_worker("w0", "clean exit")
        .await
        .unwrap();
    drop(s0);
    let left = listed(&c).await;
    assert_eq!(left.len(), 9, "{left:?}");
    assert!(!left.contains(&"w0".to_string()) && !left.contains(&"x0".to_string()));
    // w0's engine address is free again: another id may register it.
    register_as(&c, "w9", 0xc, "http://localhost:9301")
        .await
        .unwrap();
    h.shutdown().await.unwrap();

    // Journaled: a restart lists the same ids; with retention, the departed ones go and the
    // connected one stays.
    let (addr, h) = spawn(ControlPlaneConfig {
        compaction: mx_control::snapshot::Compaction {
            retire_departed_after: Some(Duration::from_millis(300)),
            ..Default::default()
        },
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: journal.clone(),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .unwrap();
    let c = ControlClient::connect(&addr.to_string()).await.unwrap();
    assert_eq!(listed(&c).await.len(), 10);
    register_as(&c, "w9", 0xd, "http://127.0.0.1:9301")
        .await
        .unwrap();
    let _s9 = c
        .clone()
        .with_incarnation(0xd)
        .watch_commands("w9")
        .await
        .unwrap();
    let t = std::time::Instant::now();
    while listed(&c).await != ["w9"] {
        assert!(t.elapsed() < T, "still listed: {:?}", listed(&c).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.shutdown().await.unwrap();
    let lines = std::fs::read_to_string(&journal).unwrap();
    let retired = lines
        .lines()
        .filter(|l| l.contains("\"op\":\"retire\""))
        .count();
    assert_eq!(retired, 2 + 9, "{retired} retire records");
}

/// `ReportResident` is accepted only from the process of the worker's last registration, with
/// a printable error of bounded size.
#[tokio::test]
async fn a_rank_reports_what_it_holds_only_as_its_own_process() {
    let dir = tempfile::tempdir().unwrap();
    let (c, h) = start(&dir.path().join("journal.jsonl")).await;
    register_as(&c, "w", 7, "http://127.0.0.1:9").await.unwrap();
    let v = ResidentVersion::parse(&format!("mx:{}", "ab".repeat(32)));
    c.report_resident("w", 7, Some(&v), "").await.unwrap();
    c.report_resident("w", 7, None, "installing x failed; restored none")
        .await
        .unwrap();
    let (code, msg) = rpc_err(c.report_resident("w", 8, Some(&v), "").await.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition, "{msg}");
    assert!(msg.contains("incarnation 0x8"), "{msg}");
    let (code, _) = rpc_err(
        c.report_resident("w", 7, Some(&v), "a\nb")
            .await
            .unwrap_err(),
    );
    assert_eq!(code, tonic::Code::InvalidArgument);
    let (code, _) = rpc_err(
        c.report_resident("w", 7, Some(&v), &"x".repeat(1025))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, tonic::Code::InvalidArgument);
    let (code, _) = rpc_err(c.report_resident("nobody", 7, None, "").await.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    h.shutdown().await.unwrap();
}
