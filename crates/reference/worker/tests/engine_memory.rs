//! mx-puller inside an engine's own memory, against a real control plane (in process, on
//! loopback) and real publishers (fsdp:2 trainer ranks over memory they own) pulling over NIXL:
//! every parameter of a vLLM-style tp:3 layout (fused qkv / gate_up, GQA) registered as its own
//! buffer, applies written in place (addresses never change), rollback from the retained host
//! copy, the staged pieces handed to an engine's own loader, refused registrations, and an
//! engine that declares no model refitted by the control plane (its post-update generation
//! skipped). Passes with a message when NIXL or `.mx/models/smollm2-135m` is missing
//! (`MX_REQUIRE_NIXL=1` turns a missing NIXL into a failure).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use crate::common;
use crate::trainer;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{control_plane, disk_reference, model_dir, tp3};
use mx_checkpoint::Checkpoint;
use mx_control::client::ControlClient;
use mx_control::{EngineApi, GenerationCheck, Outcome, RefitSpec, VersionState};
use mx_layout::plan::decompose;
use mx_layout::{DType, Digest, LayoutSpec, RankDigests, SourceManifest, TensorBox, VersionId};
use mx_nixl::Agent;
use mx_publisher::Patience;
use mx_puller::{ApplyKind, DestTensor, ExecOptions, Puller, PullerConfig, Versions};
use mx_worker::{ApplySource, Instance, Worker, WorkerConfig};
use trainer::TestTrainer;

const WAIT: Duration = Duration::from_secs(180);

/// Declares and publishes `label` from the fsdp:2 trainers; returns its version once READY.
async fn publish(
    client: &ControlClient,
    pubs: &mut [TestTrainer],
    specs: &[mx_layout::TensorSpec],
    label: &str,
) -> VersionId {
    let fsdp2: LayoutSpec = "fsdp:2".parse().unwrap();
    client.declare_version(label, fsdp2, specs).await.unwrap();
    trainer::publish_all(pubs, label, false).await;
    let d = client
        .wait_version(label, VersionState::Ready, WAIT)
        .await
        .unwrap()
        .version_digest
        .unwrap();
    VersionId(d)
}

/// A puller for `ranks` of tp:3 with every parameter in its own buffer (as an engine holds its
/// parameters), pulling through a fresh agent.
fn engine_puller(dir: &Path, name: &str, ranks: &[u32]) -> Puller {
    let agent = Agent::new(&format!("{name}-{}", std::process::id())).unwrap();
    let mut p = Puller::new(
        PullerConfig {
            model: trainer::model(dir),
            layout: tp3(),
            ranks: ranks.to_vec(),
            retain: true,
        },
        Some(agent),
    )
    .unwrap();
    let layouts = p.rank_layouts().to_vec();
    for rl in &layouts {
        for param in &rl.params {
            p.register_param(
                rl.rank,
                &param.name,
                DestTensor {
                    dtype: param.dtype,
                    shape: param.shape.clone(),
                    memory: Box::new(vec![0u8; param.len as usize]),
                },
            )
            .unwrap();
        }
    }
    p
}

/// Every parameter's data pointer, per rank.
fn addresses(p: &Puller) -> Vec<Vec<(String, u64)>> {
    p.rank_layouts()
        .iter()
        .map(|rl| p.addresses(rl.rank).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_parameter_engine_memory_is_written_in_place_and_rolled_back() {
    if !mx_nixl::nixl_or_skip("per_parameter_engine_memory") {
        return;
    }
    let Some(dir) = model_dir("per_parameter_engine_memory") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let client = ControlClient::connect(&control).await.unwrap();
    // The engine's layout is registered before the trainers start, as a fleet's workers are.
    client
        .register_worker("engine", "engine", &[0, 1, 2], tp3())
        .await
        .unwrap();
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(&control, &dir, "fsdp:2".parse().unwrap(), rank).await);
    }
    let specs = Checkpoint::open(&dir).unwrap().specs();
    let disk = disk_reference(&dir).await;
    let mut puller = engine_puller(&dir, "engine-mem", &[0, 1, 2]);
    let before = addresses(&puller);
    assert_eq!(before[0].len(), puller.rank_layouts()[0].params.len());

    // step-1: staged over NIXL, then applied in place: byte-identical to the disk slicing.
    let v1 = publish(&client, &mut pubs, &specs, "step-1").await;
    let info = client.get_version("step-1").await.unwrap();
    let r = puller
        .stage(v1, &info.manifests, &ExecOptions::default())
        .unwrap();
    assert!(r.useful_bytes > 0 && r.descriptors > 0, "{r:?}");
    let rank_bytes: u64 = puller.rank_layouts().iter().map(|d| d.total_bytes).sum();
    assert!(r.staging_bytes <= rank_bytes, "{r:?}");
    assert_eq!(puller.versions().staged, Some(v1));
    assert_eq!(puller.versions().resident, None, "staging touched nothing");

    // The staged pieces as an engine's own loader would take them: each is the row-major box of
    // its checkpoint tensor.
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut pieces = 0;
    let mut fused: BTreeMap<String, usize> = BTreeMap::new();
    puller
        .staged_tensors(|piece| {
            let t = ckpt.tensor(piece.tensor).unwrap();
            let es = piece.dtype.size_bytes();
            let (run, starts) = decompose(piece.region, &TensorBox::full(&t.shape));
            let rb = (run * es) as usize;
            let mut want = Vec::with_capacity(piece.bytes.len());
            for s in starts {
                let s = (s * es) as usize;
                want.extend_from_slice(&t.data[s..s + rb]);
            }
            assert!(
                want == piece.bytes,
                "rank {} {} <- {} {}",
                piece.rank,
                piece.param,
                piece.tensor,
                piece.region
            );
            *fused.entry(piece.param.to_string()).or_default() += 1;
            pieces += 1;
            Ok(())
        })
        .unwrap();
    assert!(pieces > 0);
    assert_eq!(
        fused["model.layers.0.self_attn.qkv_proj.weight"], 9,
        "q, k and v pieces on each of 3 ranks"
    );

    // Each rank of the staged version copied out into memory of the engine's (what an engine
    // prepares from while it serves another version): the bytes apply installs, nothing moved.
    let copied: Vec<_> = puller
        .rank_layouts()
        .to_vec()
        .iter()
        .map(|rl| {
            let mut buf = vec![0xa5u8; rl.total_bytes as usize];
            puller.copy_staged_rank(v1, rl.rank, 0, &mut buf).unwrap();
            // The same bytes window by window (one parameter at a time, as an engine prepares
            // one decoder layer at a time), into windows first filled with garbage.
            let mut windowed = vec![0u8; buf.len()];
            for p in &rl.params {
                let (lo, hi) = (p.offset as usize, (p.offset + p.len) as usize);
                let mut w = vec![0x5au8; hi - lo];
                puller
                    .copy_staged_rank(v1, rl.rank, p.offset, &mut w)
                    .unwrap();
                windowed[lo..hi].copy_from_slice(&w);
            }
            let covered: u64 = rl.params.iter().map(|p| p.len).sum();
            if covered == rl.total_bytes {
                assert_eq!(
                    windowed, buf,
                    "rank {}: windows differ from the whole",
                    rl.rank
                );
            }
            mx_puller::digests_of(rl, &windowed)
        })
        .collect();
    assert_eq!(copied, disk, "the staged copy differs from the checkpoint");
    let wrong = VersionId(Digest::of(b"another version"));
    let e = puller.copy_staged_rank(wrong, 0, 0, &mut []).unwrap_err();
    assert!(matches!(e, mx_puller::Error::UnknownVersion { .. }), "{e}");
    // Windows reaching past the layout's end, or whose end overflows, are refused.
    let total = puller.rank_layouts()[0].total_bytes;
    for (offset, len) in [(total - 3, 7usize), (total + 1, 0), (u64::MAX - 2, 7)] {
        let e = puller
            .copy_staged_rank(v1, 0, offset, &mut vec![0u8; len])
            .unwrap_err();
        assert!(
            matches!(e, mx_puller::Error::BadDestination { .. }),
            "{offset}+{len}: {e}"
        );
    }
    let e = puller.copy_staged_rank(v1, 9, 0, &mut []).unwrap_err();
    assert!(
        matches!(e, mx_puller::Error::UnknownRank { rank: 9, .. }),
        "{e}"
    );
    assert_eq!(puller.versions().staged, Some(v1));
    assert_eq!(
        puller.versions().resident,
        None,
        "copying out touched nothing"
    );

    let a = puller.apply(v1).unwrap();
    assert_eq!(a.kind, ApplyKind::Staged);
    let d1 = puller.live_digests().unwrap();
    assert_eq!(
        d1, disk,
        "step-1 applied in place differs from the checkpoint"
    );
    assert_eq!(addresses(&puller), before, "apply moved a parameter");

    // Engines keeping their retained version in staging. Holding all three ranks, the plan
    // copies each replicated norm from one staging range to three ranks: it applies by copy,
    // retaining nothing.
    let mut copier = engine_puller(&dir, "engine-copy", &[0, 1, 2]);
    copier.retain_in_staging().unwrap();
    copier
        .stage(v1, &info.manifests, &ExecOptions::default())
        .unwrap();
    assert_eq!(copier.apply(v1).unwrap().kind, ApplyKind::Staged);
    assert_eq!(copier.live_digests().unwrap(), d1);
    let v = copier.versions();
    assert_eq!(
        (v.retained, v.staged),
        (None, Some(v1)),
        "copied, not exchanged"
    );
    drop(copier);
    // Holding rank 1 alone (a vLLM worker's one rank), step-1 is exchanged in.
    let mut swapper = engine_puller(&dir, "engine-swap", &[1]);
    swapper.retain_in_staging().unwrap();
    swapper
        .stage(v1, &info.manifests, &ExecOptions::default())
        .unwrap();
    assert_eq!(swapper.apply(v1).unwrap().kind, ApplyKind::Staged);
    assert_eq!(swapper.live_digests().unwrap(), d1[1..2]);
    assert_eq!(
        swapper.versions(),
        Versions {
            resident: Some(v1.into()),
            retained: None,
            staged: None
        },
        "nothing was resident before: nothing is retained, and staging no longer holds step-1"
    );

    // step-2 after one in-place training step (the trainers hand step-1 back first).
    for t in &mut pubs {
        t.publisher
            .release("step-1", Patience::GiveUpAfter(WAIT))
            .await
            .unwrap();
        t.train_step(2);
    }
    let v2 = publish(&client, &mut pubs, &specs, "step-2").await;
    let info = client.get_version("step-2").await.unwrap();
    let r2 = puller
        .stage(v2, &info.manifests, &ExecOptions::default())
        .unwrap();
    assert!(r2.plan_reused, "{r2:?}");
    let a = puller.apply(v2).unwrap();
    assert_eq!(
        (a.kind, a.retained.clone()),
        (ApplyKind::Staged, Some(v1.into()))
    );
    let d2 = puller.live_digests().unwrap();
    assert_ne!(d2, d1);
    assert_eq!(addresses(&puller), before, "apply moved a parameter");
    let mem = puller.memory_report();
    assert!(mem.staging_bytes_peak <= rank_bytes, "{mem:?}");
    assert_eq!(mem.retained_bytes, rank_bytes, "{mem:?}");

    let one_rank = puller.rank_layouts()[1].total_bytes;
    swapped_retention(
        &mut swapper,
        v1,
        v2,
        &info.manifests,
        (&d1[1..2], &d2[1..2]),
        one_rank,
    );

    // Rollback: the retained copy of step-1, with no source involved.
    let rb = puller.rollback().unwrap();
    assert_eq!(
        (rb.kind, rb.version.clone()),
        (ApplyKind::Restored, v1.into())
    );
    assert_eq!(puller.live_digests().unwrap(), d1);
    assert_eq!(addresses(&puller), before);
    // Forward again from staging, then a version nobody holds is refused naming all three.
    puller.apply(v2).unwrap();
    assert_eq!(puller.live_digests().unwrap(), d2);
    let unknown = VersionId(Digest([9; 32]));
    let e = puller.apply(unknown).unwrap_err().to_string();
    for needle in [
        unknown.to_string(),
        format!("staged: {v2}"),
        format!("retained: {v1}"),
        format!("resident: {v2}"),
    ] {
        assert!(e.contains(&needle), "{needle:?} not in {e}");
    }
    // Manifests of another version are refused before anything is pulled.
    let e = puller
        .stage(v1, &info.manifests, &ExecOptions::default())
        .unwrap_err();
    assert!(matches!(e, mx_puller::Error::WrongManifests { .. }), "{e}");
    assert_eq!(
        puller.live_digests().unwrap(),
        d2,
        "a refused stage changed memory"
    );
    server.shutdown().await.unwrap();
}

/// step-2 into the engine keeping its retained version in staging (step-1 resident): the
/// apply exchanges them, so staging holds step-1 (digests from there equal its live ones) and
/// no retained buffer exists; a rollback is the exchange back (step-2 staged again), applying
/// step-2 again the same exchange; a new stage overwrites the retained step-1.
fn swapped_retention(
    p: &mut Puller,
    v1: VersionId,
    v2: VersionId,
    manifests: &[SourceManifest],
    (d1, d2): (&[RankDigests], &[RankDigests]),
    rank_bytes: u64,
) {
    let before = addresses(p);
    p.stage(v2, manifests, &ExecOptions::default()).unwrap();
    let a = p.apply(v2).unwrap();
    assert_eq!(
        (a.kind, a.retained.clone()),
        (ApplyKind::Staged, Some(v1.into()))
    );
    assert_eq!(&p.live_digests().unwrap(), d2);
    let held =
        |resident: VersionId, retained: Option<VersionId>, staged: Option<VersionId>| Versions {
            resident: Some(resident.into()),
            retained: retained.map(Into::into),
            staged,
        };
    assert_eq!(p.versions(), held(v2, Some(v1), None));
    assert_eq!(p.resident_digests(v1).unwrap().as_deref(), Some(d1));
    let mem = p.memory_report();
    assert_eq!(mem.retained_bytes, 0, "{mem:?}");
    assert!(
        0 < mem.staging_bytes && mem.staging_bytes <= rank_bytes,
        "{mem:?}"
    );
    // A rollback: the exchange back.
    let rb = p.rollback().unwrap();
    assert_eq!((rb.kind, rb.version), (ApplyKind::Restored, v1.into()));
    assert_eq!(&p.live_digests().unwrap(), d1);
    assert_eq!(p.versions(), held(v1, None, Some(v2)));
    // Forward again: the same exchange; then the retained step-1 is applied by id.
    p.apply(v2).unwrap();
    assert_eq!(&p.live_digests().unwrap(), d2);
    assert_eq!(p.apply(v1).unwrap().kind, ApplyKind::Restored);
    assert_eq!(&p.live_digests().unwrap(), d1);
    p.apply(v2).unwrap();
    assert_eq!(addresses(p), before, "an exchange moved a parameter");
    // A new stage overwrites staging: step-1 is no longer retained.
    p.stage(v2, manifests, &ExecOptions::default()).unwrap();
    assert_eq!(p.versions(), held(v2, None, Some(v2)));
    let e = p.rollback().unwrap_err();
    assert!(matches!(e, mx_puller::Error::NoRollback { .. }), "{e}");
    assert_eq!(&p.live_digests().unwrap(), d2);
}

#[test]
fn bad_registrations_name_the_parameter_and_change_nothing() {
    let Some(dir) = model_dir("bad_registrations") else {
        return;
    };
    let mut p = Puller::new(
        PullerConfig {
            model: trainer::model(&dir),
            layout: tp3(),
            ranks: vec![1],
            retain: false,
        },
        None,
    )
    .unwrap();
    let qkv = "model.layers.0.self_attn.qkv_proj.weight";
    let param = p.rank_layouts()[0].param(qkv).unwrap().clone();
    let mem = |n: u64| -> Box<dyn mx_puller::DestMemory> { Box::new(vec![0u8; n as usize]) };
    let cases: Vec<(u32, &str, DestTensor, &str)> = vec![
        (
            1,
            qkv,
            DestTensor {
                dtype: DType::F32,
                shape: param.shape.clone(),
                memory: mem(param.len),
            },
            "dtype",
        ),
        (
            1,
            qkv,
            DestTensor {
                dtype: param.dtype,
                shape: vec![param.shape[0] + 1, param.shape[1]],
                memory: mem(param.len),
            },
            "shape",
        ),
        (
            1,
            qkv,
            DestTensor {
                dtype: param.dtype,
                shape: param.shape.clone(),
                memory: mem(param.len - 2),
            },
            "bytes of memory",
        ),
        (
            1,
            "model.layers.0.self_attn.q_proj.weight",
            DestTensor {
                dtype: param.dtype,
                shape: param.shape.clone(),
                memory: mem(param.len),
            },
            "no such parameter",
        ),
    ];
    for (rank, name, t, needle) in cases {
        let e = p.register_param(rank, name, t).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, mx_puller::Error::BadDestination { .. }),
            "{msg}"
        );
        assert!(
            msg.contains(name) && msg.contains(needle),
            "{needle:?} / {name} not in {msg}"
        );
    }
    let e = p
        .register_param(
            0,
            qkv,
            DestTensor {
                dtype: param.dtype,
                shape: param.shape.clone(),
                memory: mem(param.len),
            },
        )
        .unwrap_err();
    assert!(
        matches!(e, mx_puller::Error::UnknownRank { rank: 0, .. }),
        "{e}"
    );
    let ok = DestTensor {
        dtype: param.dtype,
        shape: param.shape.clone(),
        memory: mem(param.len),
    };
    p.register_param(1, qkv, ok).unwrap();
    let again = DestTensor {
        dtype: param.dtype,
        shape: param.shape.clone(),
        memory: mem(param.len),
    };
    let e = p.register_param(1, qkv, again).unwrap_err().to_string();
    assert!(e.contains("registered twice"), "{e}");
    // Nothing is complete until every parameter has memory; the first missing one is named.
    let e = p.check_registered().unwrap_err();
    assert!(
        matches!(e, mx_puller::Error::Unregistered { rank: 1, .. }),
        "{e}"
    );
    // Without a data plane a stage says so.
    let e = p
        .stage(VersionId(Digest([0; 32])), &[], &ExecOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            e,
            mx_puller::Error::WrongManifests { .. } | mx_puller::Error::NoDataPlane
        ),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_with_no_model_is_refitted_and_its_generation_skipped() {
    if !mx_nixl::nixl_or_skip("engine_with_no_model") {
        return;
    }
    let Some(dir) = model_dir("engine_with_no_model") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path(), "127.0.0.1:0").await;
    let client = ControlClient::connect(&control).await.unwrap();
    let puller = engine_puller(&dir, "engine-nomodel", &[0, 1, 2]);
    let before = addresses(&puller);
    let inst = Instance::over_puller(puller, trainer::model(&dir), "bare".into(), false).unwrap();
    let w = Arc::new(
        Worker::serve(
            WorkerConfig {
                control: control.clone(),
                http_token: None,
                model_dir: dir.clone(),
                layout: tp3(),
                ranks: vec![0, 1, 2],
                worker_id: "bare".into(),
                instance: "bare".into(),
                http: "127.0.0.1:0".parse().unwrap(),
                engine_api: EngineApi::Dynamo,
                failpoints: false,
                reconnect_timeout: None,
                load: None,
                load_version: None,
                serve_peers: false,
                engine: Some(mx_worker::reference_engine()),
                on_staged: None,
            },
            inst.clone(),
        )
        .await
        .unwrap(),
    );
    let runner = tokio::spawn({
        let w = Arc::clone(&w);
        async move { w.run().await }
    });
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(&control, &dir, "fsdp:2".parse().unwrap(), rank).await);
    }
    let specs = Checkpoint::open(&dir).unwrap().specs();
    let v1 = publish(&client, &mut pubs, &specs, "step-1").await;
    let id = client
        .refit(&RefitSpec {
            no_check: false,
            label: "step-1".into(),
            worker_ids: vec!["bare".into()],
            pause_mode: mx_control::PauseMode::Wait,
            allow_partial: false,
            // A check is asked for; the engine declared no model, so it is recorded as skipped.
            check: Some(GenerationCheck::tokens(
                common::PROMPT.to_vec(),
                2,
                common::PARIS.to_vec(),
            )),
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
    assert!(ended);
    assert_eq!(r.outcome, Some(Outcome::Committed), "{}", r.reason);
    let generate = r.workers["bare"]
        .calls
        .iter()
        .find(|c| c.action == mx_control::Action::Generate)
        .and_then(|c| c.result.clone())
        .unwrap();
    assert!(
        generate.ok && generate.message.contains("declared no model"),
        "{generate:?}"
    );
    assert!(generate.tokens.is_empty());
    let (live_id, live) = inst.live_digests().await.unwrap().unwrap();
    assert_eq!(live_id, v1.into());
    assert_eq!(live, disk_reference(&dir).await);
    assert_eq!(
        inst.with_puller(|p| addresses(p)),
        before,
        "apply moved a parameter"
    );
    // A disk load is refused: this engine loads its own checkpoints.
    let e = inst
        .apply(ApplySource::Disk {
            path: dir.clone(),
            version: "disk".into(),
        })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("declared no model"), "{e}");
    runner.abort();
    server.shutdown().await.unwrap();
}
