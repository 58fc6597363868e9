//! The publisher over memory the test owns, against a real control plane (in process, on an
//! ephemeral port) and real inference instances pulling over NIXL: byte-exact stages, in-place
//! and copy-mode publishes, hand-back, late layouts and every refused shard spec. Passes with a
//! message when NIXL or `.mx/models/smollm2-135m` is missing (`MX_REQUIRE_NIXL=1` turns a
//! missing NIXL into a failure).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

#[path = "support/trainer.rs"]
mod trainer;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mx_control::client::ControlClient;
use mx_control::{ControlPlaneConfig, Release};
use mx_follower::{ApplySource, Instance, InstanceConfig};
use mx_layout::{DType, Digest, LayoutSpec, RankDigests, TensorBox};
use mx_nixl::{Agent, ForeignMemory, HostBuffer};
use mx_publisher::{
    Error, MemoryId, Patience, PublishOptions, Publisher, PublisherConfig, ShardProblem, ShardSpec,
};
use trainer::TestTrainer;

/// Whether a refusal is the expected kind.
type IsProblem = fn(&ShardProblem) -> bool;

const WAIT: Duration = Duration::from_secs(120);

fn model_dir(test: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../.mx/models/smollm2-135m");
    if dir.join("config.json").exists() {
        return Some(dir);
    }
    eprintln!(
        "SKIPPED {test}: {} is missing (run scripts/setup.sh)",
        dir.display()
    );
    None
}

async fn control_plane(dir: &Path) -> (String, mx_control::ServerHandle) {
    let (addr, handle) = mx_control::spawn(ControlPlaneConfig {
        compaction: Default::default(),
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: dir.join("journal.jsonl"),
        security: mx_control::Security::insecure_loopback(),
    })
    .await
    .unwrap();
    (format!("http://{addr}"), handle)
}

fn layout(s: &str) -> LayoutSpec {
    s.parse().unwrap()
}

fn instance(dir: &Path, l: &str, ranks: Vec<u32>, agent: Option<Agent>) -> Instance {
    Instance::open(
        InstanceConfig {
            model_dir: dir.to_path_buf(),
            layout: layout(l),
            ranks,
            failpoints: false,
            worker_id: format!("test-{l}"),
        },
        agent,
        None,
    )
    .unwrap()
}

/// Stages `label` on `inst` from the control plane's manifests and applies it; returns the live
/// digests.
async fn stage_and_apply(client: &ControlClient, inst: &Instance, label: &str) -> Vec<RankDigests> {
    let info = client.get_version(label).await.unwrap();
    let d = info.version_digest.unwrap();
    let stats = inst.stage(label, d, info.manifests).await.unwrap();
    assert!(stats.useful_bytes > 0, "{stats:?}");
    inst.apply(ApplySource::Version(d)).await.unwrap();
    let (id, live) = inst.live_digests().await.unwrap().unwrap();
    assert_eq!(id, mx_layout::VersionId(d).into());
    live
}

/// Every published shard digest is blake3 of that shard's bytes in the trainer's memory now.
fn assert_digests_match_memory(t: &TestTrainer, m: &mx_layout::SourceManifest) {
    let specs = t.publisher.shards();
    assert_eq!(specs.len(), m.shards.len());
    for (s, e) in specs.iter().zip(&m.shards) {
        let bytes = &t.buf.as_slice()[s.offset as usize..(s.offset + e.len) as usize];
        assert_eq!(e.digest, Digest::of(bytes), "{}", s.tensor);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn caller_owned_memory_is_published_in_place_and_copied_and_late_layouts_are_served() {
    if !mx_nixl::nixl_or_skip("caller_owned_memory_is_published") {
        return;
    }
    let Some(dir) = model_dir("caller_owned_memory_is_published") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path()).await;
    let client = ControlClient::connect(&control).await.unwrap();
    client
        .register_worker("w", "w", &[0, 1, 2], layout("tp:3"))
        .await
        .unwrap();
    let fsdp2 = layout("fsdp:2");
    let mut pubs = Vec::new();
    for rank in 0..2 {
        pubs.push(trainer::start(&control, &dir, fsdp2, rank).await);
    }
    let specs = trainer::model(&dir).tensors;
    let agent = Agent::new(&format!("mx-test-puller-{}", std::process::id())).unwrap();
    let inst = instance(&dir, "tp:3", vec![0, 1, 2], Some(agent));
    // Reference: the checkpoint sliced from disk by an independent instance.
    let reference = instance(&dir, "tp:3", vec![0, 1, 2], None);
    reference
        .apply(ApplySource::Disk {
            path: dir.clone(),
            version: "disk".into(),
        })
        .await
        .unwrap();
    let (_, disk) = reference.live_digests().await.unwrap().unwrap();
    drop(reference);

    // v1, in place: READY with one id on both slots; staged byte-exact against the checkpoint.
    client.declare_version("v1", fsdp2, &specs).await.unwrap();
    let p1 = trainer::publish_all(&mut pubs, "v1", false).await;
    assert_eq!(p1[0].version, p1[1].version);
    assert_eq!(p1[0].layouts, vec![layout("tp:3")]);
    assert!(p1[0]
        .manifest
        .pieces
        .iter()
        .any(|p| p.packed_addr.is_some()));
    let info = client.get_version("v1").await.unwrap();
    assert_eq!(info.version_digest, Some(p1[0].version.digest()));
    assert_eq!(stage_and_apply(&client, &inst, "v1").await, disk);

    // Nothing staged it through the control plane: wait_staged times out, and the version
    // stays held. Slot 0 releases it; slot 1's wait then answers that release.
    let e = pubs[0]
        .publisher
        .wait_staged("v1", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    pubs[0]
        .publisher
        .release("v1", Patience::GiveUpAfter(WAIT))
        .await
        .unwrap();
    let why = pubs[1].publisher.wait_staged("v1", WAIT).await.unwrap();
    assert_eq!(why, Release::Source { slot: 0 });
    assert_eq!(client.get_version("v1").await.unwrap().release, Some(why));

    // v2: the memory changed in place (an optimizer step), same registration: a new id, the
    // digests are those of the new bytes, and the stage verifies every byte against them.
    for t in &mut pubs {
        t.train_step(2);
    }
    client.declare_version("v2", fsdp2, &specs).await.unwrap();
    let p2 = trainer::publish_all(&mut pubs, "v2", false).await;
    assert_ne!(p2[0].version, p1[0].version);
    for (t, p) in pubs.iter().zip(&p2) {
        assert_digests_match_memory(t, &p.manifest);
    }
    let live2 = stage_and_apply(&client, &inst, "v2").await;
    assert_ne!(live2, disk);
    for t in &mut pubs {
        t.publisher
            .release("v2", Patience::GiveUpAfter(WAIT))
            .await
            .unwrap();
    }

    // v3 in copy mode: the trainer overwrites its memory as soon as publish returns; the
    // worker still stages the published bytes (verified against digests of the memory as it
    // was when published).
    for t in &mut pubs {
        t.train_step(3);
    }
    let before: Vec<Vec<Digest>> = pubs
        .iter()
        .map(|t| {
            t.publisher
                .shards()
                .iter()
                .map(|s| {
                    let len = s.byte_len().unwrap();
                    Digest::of(&t.buf.as_slice()[s.offset as usize..(s.offset + len) as usize])
                })
                .collect()
        })
        .collect();
    client.declare_version("v3", fsdp2, &specs).await.unwrap();
    let p3 = trainer::publish_all(&mut pubs, "v3", true).await;
    for t in &mut pubs {
        t.buf.as_mut_slice().fill(0xAB);
    }
    assert_ne!(p3[0].version, p2[0].version);
    assert!(p3[0].copy_s > 0.0);
    for (p, want) in p3.iter().zip(&before) {
        let got: Vec<Digest> = p.manifest.shards.iter().map(|s| s.digest).collect();
        assert_eq!(&got, want);
        // The shards point into the snapshot, not the trainer's buffer.
        assert!(p.manifest.shards.iter().all(|s| s.addr != 0));
    }
    let live3 = stage_and_apply(&client, &inst, "v3").await;
    assert_ne!(live3, live2);

    // A layout registered after v3 was published: the publishers extend v3 (still held in its
    // snapshot) with pieces for it, and a tp:1 instance stages it.
    client
        .register_worker("late", "late", &[0], layout("tp:1"))
        .await
        .unwrap();
    let t0 = Instant::now();
    loop {
        let info = client.get_version("v3").await.unwrap();
        let served = info
            .manifests
            .iter()
            .all(|m| m.pieces.iter().any(|p| p.layout == layout("tp:1")));
        if served {
            assert_eq!(info.version_digest, Some(p3[0].version.digest()));
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "v3 was never extended for tp:1"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late_agent = Agent::new(&format!("mx-test-late-{}", std::process::id())).unwrap();
    let late = instance(&dir, "tp:1", vec![0], Some(late_agent));
    stage_and_apply(&client, &late, "v3").await;
    eprintln!(
        "measured: in place digest {:.3} s, cut+pack {:.3} s; copy {:.3} s ({} shard bytes per rank)",
        p2[0].digest_s, p2[0].cut_s, p3[0].copy_s, p3[0].shard_bytes
    );
    drop(pubs);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_shard_specs_get_typed_errors_naming_the_tensor() {
    if !mx_nixl::nixl_or_skip("bad_shard_specs_get_typed_errors") {
        return;
    }
    let Some(dir) = model_dir("bad_shard_specs_get_typed_errors") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (control, server) = control_plane(tmp.path()).await;
    let model = trainer::model(&dir);
    let mut p = Publisher::connect(PublisherConfig {
        control: control.clone(),
        slot: 0,
        layout: layout("fsdp:1"),
        model: model.clone(),
        pack: true,
    })
    .await
    .unwrap();
    // A publish with no shards set.
    let e = p
        .publish("v1", PublishOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::NoShards { label } if label == "v1"),
        "{e}"
    );
    assert!(e.to_string().contains("set_shards"), "{e}");

    let buf = HostBuffer::new(1 << 20).unwrap();
    // SAFETY: `buf` outlives the publisher (dropped first, below) and is never written.
    let mem = unsafe { ForeignMemory::register_host(p.agent(), buf.addr(), buf.len()) }.unwrap();
    let id = p.register(mem).unwrap();
    let t = model
        .tensors
        .iter()
        .find(|t| t.name == "model.norm.weight")
        .unwrap()
        .clone();
    let good = ShardSpec {
        tensor: t.name.clone(),
        dtype: t.dtype,
        global_shape: t.shape.clone(),
        shard: TensorBox::full(&t.shape),
        memory: id,
        offset: 0,
    };
    p.set_shards(vec![good.clone()]).unwrap();
    // An id another publisher handed out (its second region): unknown to `p`.
    let mut q = Publisher::connect(PublisherConfig {
        control: control.clone(),
        slot: 0,
        layout: layout("fsdp:1"),
        model: model.clone(),
        pack: true,
    })
    .await
    .unwrap();
    let mut unknown_id: MemoryId = id;
    for _ in 0..2 {
        // SAFETY: as above; `q` is dropped before `buf`.
        let m = unsafe { ForeignMemory::register_host(q.agent(), buf.addr(), buf.len()) }.unwrap();
        unknown_id = q.register(m).unwrap();
    }
    assert_eq!(unknown_id.index(), 1);
    let half = |off: u64| TensorBox {
        global_offset: vec![off],
        local_shape: vec![t.shape[0] / 2 + 1],
    };
    let problem = |specs: Vec<ShardSpec>, p: &mut Publisher| match p.set_shards(specs) {
        Err(Error::BadShard {
            tensor, problem, ..
        }) => (tensor, problem),
        other => panic!("expected BadShard, got {other:?}"),
    };
    let cases: Vec<(Vec<ShardSpec>, &str, IsProblem)> = vec![
        (
            vec![ShardSpec {
                tensor: "no.such.tensor".into(),
                ..good.clone()
            }],
            "no.such.tensor",
            |p| matches!(p, ShardProblem::UnknownTensor),
        ),
        (
            vec![ShardSpec {
                dtype: DType::F32,
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::DType { .. }),
        ),
        (
            vec![ShardSpec {
                global_shape: vec![1, 576],
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::Shape { .. }),
        ),
        (
            vec![ShardSpec {
                shard: TensorBox {
                    global_offset: vec![500],
                    local_shape: vec![100],
                },
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::OutsideShape { .. }),
        ),
        (
            vec![ShardSpec {
                memory: unknown_id,
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::UnknownMemory { .. }),
        ),
        (
            vec![ShardSpec {
                offset: (1 << 20) - 10,
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::OutsideMemory { .. }),
        ),
        (
            vec![ShardSpec {
                offset: u64::MAX - 4,
                ..good.clone()
            }],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::OutsideMemory { .. }),
        ),
        (
            vec![
                ShardSpec {
                    shard: half(0),
                    ..good.clone()
                },
                ShardSpec {
                    shard: half(t.shape[0] / 2 - 1),
                    offset: 4096,
                    ..good.clone()
                },
            ],
            "model.norm.weight",
            |p| matches!(p, ShardProblem::Overlap { other: 0, .. }),
        ),
    ];
    for (specs, tensor, want) in cases {
        let (got_tensor, got) = problem(specs, &mut p);
        assert_eq!(got_tensor, tensor);
        assert!(want(&got), "{tensor}: {got}");
    }
    // Nothing was changed by the refusals.
    assert_eq!(p.shards(), &[good][..]);
    // Memory registered with another agent is refused.
    let other = Agent::new(&format!("mx-test-other-{}", std::process::id())).unwrap();
    // SAFETY: as above; dropped at once.
    let foreign = unsafe { ForeignMemory::register_host(&other, buf.addr(), buf.len()) }.unwrap();
    assert!(matches!(
        p.register(foreign),
        Err(Error::ForeignAgent { .. })
    ));
    drop(p);
    drop(q);
    drop(buf);
    server.shutdown().await.unwrap();
}
