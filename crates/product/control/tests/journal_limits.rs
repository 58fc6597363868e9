//! Bounded input and a journal that cannot grow without bound (issue 13), over real loopback gRPC
//! with a real journal in a temp dir.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use std::path::Path;

use mx_control::client::ControlClient;
use mx_control::journal::Journal;
use mx_control::limits::{MAX_REPUBLISHES, MAX_TENSORS, MAX_WORLD_SIZE};
use mx_control::state::Record;
use mx_control::{spawn, ControlPlaneConfig, Error, ServerHandle, VersionState};
use mx_layout::{
    DType, Digest, LayoutSpec, MemDevice, Scheme, ShardEntry, SourceManifest, TensorBox, TensorSpec,
};

const FSDP2: LayoutSpec = LayoutSpec {
    scheme: Scheme::Fsdp,
    world_size: 2,
};

fn cfg(journal: &Path) -> ControlPlaneConfig {
    ControlPlaneConfig {
        compaction: Default::default(),
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: journal.to_path_buf(),
        security: mx_control::Security::insecure_loopback(),
    }
}

async fn start(journal: &Path) -> (ControlClient, ServerHandle) {
    let (addr, handle) = spawn(cfg(journal)).await.unwrap();
    let client = ControlClient::connect(&addr.to_string()).await.unwrap();
    (client, handle)
}

fn rpc_err(e: Error) -> (tonic::Code, String) {
    match e {
        Error::Rpc { code, message, .. } => (code, message),
        other => panic!("expected an RPC error, got {other}"),
    }
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

fn tensors() -> Vec<TensorSpec> {
    vec![TensorSpec {
        name: "embed.weight".into(),
        dtype: DType::BF16,
        shape: vec![8, 4],
    }]
}

/// Slot `slot` of 2: rows `4 * slot .. 4 * slot + 4` of the one tensor.
fn manifest(slot: u32, agent_metadata: Vec<u8>) -> SourceManifest {
    let r = u64::from(slot);
    SourceManifest {
        slot,
        layout: FSDP2,
        agent_name: format!("trainer-{slot}"),
        agent_metadata,
        shards: vec![ShardEntry {
            tensor: "embed.weight".into(),
            dtype: DType::BF16,
            global_shape: vec![8, 4],
            shard: TensorBox {
                global_offset: vec![4 * r, 0],
                local_shape: vec![4, 4],
            },
            addr: 0x1000 + 0x10000 * r,
            len: 32,
            device: MemDevice::Dram,
            digest: Digest::of(&[slot as u8]),
        }],
        pieces: Vec::new(),
        pack_seconds: 0.0,
    }
}

/// Regression: a version declared with an FSDP world size of 2^32-1, then read with GetVersion,
/// aborted the control plane on a 4 GiB allocation (and the declaration replayed at every start).
#[tokio::test]
async fn regression_a_world_size_of_u32_max_is_refused_at_the_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    let huge = LayoutSpec {
        scheme: Scheme::Fsdp,
        world_size: u32::MAX,
    };
    let (code, msg) = rpc_err(c.declare_version("v", huge, &tensors()).await.unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert_eq!(
        msg,
        "invalid field trainer_layout.world_size: world size 4294967295 is over the limit of 65536"
    );
    let (code, _) = rpc_err(c.get_version("v").await.unwrap_err());
    assert_eq!(code, tonic::Code::NotFound);
    assert_eq!(size(&path), 0, "nothing journaled");

    // The largest world size allowed is served: every slot is listed as missing.
    let max = LayoutSpec {
        scheme: Scheme::Fsdp,
        world_size: MAX_WORLD_SIZE,
    };
    c.declare_version("v", max, &tensors()).await.unwrap();
    let info = c.get_version("v").await.unwrap();
    assert_eq!(info.missing_slots.len(), 65_536);
    assert_eq!(info.missing_slots.last(), Some(&65_535));
    h.shutdown().await.unwrap();
}

/// The same declaration already in a journal (written by an older control plane) is refused at
/// replay, naming its line, instead of being acted on; with or without a checksum.
#[tokio::test]
async fn regression_an_absurd_declaration_in_the_journal_is_refused_at_replay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (mut j, _) = Journal::open(&path).unwrap();
    j.append(&Record::Declare {
        label: "ok".into(),
        trainer_layout: FSDP2,
        tensors: tensors(),
    })
    .unwrap();
    j.append(&Record::Declare {
        label: "huge".into(),
        trainer_layout: LayoutSpec {
            scheme: Scheme::Fsdp,
            world_size: u32::MAX,
        },
        tensors: tensors(),
    })
    .unwrap();
    drop(j);
    let replay_err = |err: Error| match err {
        Error::Replay { line, source, .. } => match *source {
            Error::InvalidField { field, reason } => (line, field, reason),
            other => panic!("expected InvalidField, got {other}"),
        },
        other => panic!("expected Replay, got {other}"),
    };
    let err = spawn(cfg(&path)).await.map(|_| ()).unwrap_err();
    assert_eq!(
        replay_err(err),
        (
            2,
            "trainer_layout.world_size".to_string(),
            "world size 4294967295 is over the limit of 65536".to_string()
        )
    );

    // A journal from before checksums holding it.
    std::fs::write(
        &path,
        concat!(
            r#"{"seq":1,"unix_ms":1,"record":{"op":"declare","label":"huge","trainer_layout":{"scheme":"Fsdp","world_size":4294967295},"tensors":[]}}"#,
            "\n"
        ),
    )
    .unwrap();
    let mut legacy = cfg(&path);
    legacy.compaction.accept_unchecked_lines = true;
    let err = spawn(legacy).await.map(|_| ()).unwrap_err();
    assert_eq!(replay_err(err).0, 1);
}

#[tokio::test]
async fn repeated_publishes_cannot_grow_the_journal_without_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    c.declare_version("v", FSDP2, &tensors()).await.unwrap();
    let md = vec![7u8; 4096];
    c.publish("v", &manifest(0, md.clone())).await.unwrap();
    let once = size(&path);
    for _ in 0..5 {
        let out = c.publish("v", &manifest(0, md.clone())).await.unwrap();
        assert_eq!(out.state, VersionState::Publishing);
    }
    assert_eq!(size(&path), once, "identical republishes are not journaled");

    // A restarted publisher republishes with new metadata: journaled, up to the limit.
    for i in 0..MAX_REPUBLISHES {
        c.publish("v", &manifest(0, vec![i as u8; 4096]))
            .await
            .unwrap();
    }
    let full = size(&path);
    assert!(full > once);
    let (code, msg) = rpc_err(
        c.publish("v", &manifest(0, vec![0xEE; 4096]))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains(
            "slot 0 was already published again 32 times with a different manifest, the limit"
        ),
        "{msg}"
    );
    assert_eq!(size(&path), full);
    // The version still completes: other slots are not affected.
    let out = c.publish("v", &manifest(1, md.clone())).await.unwrap();
    assert_eq!(out.state, VersionState::Ready);
    h.shutdown().await.unwrap();

    // The count is replayed: the limit holds after a restart.
    let (c, h) = start(&path).await;
    let (code, _) = rpc_err(
        c.publish("v", &manifest(0, vec![0xEE; 4096]))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, tonic::Code::FailedPrecondition);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn over_limit_labels_counts_and_sizes_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let (c, h) = start(&path).await;
    let refused = |r: Result<(), Error>| {
        let (code, msg) = rpc_err(r.unwrap_err());
        assert_eq!(code, tonic::Code::InvalidArgument, "{msg}");
        msg
    };
    let long = "x".repeat(257);
    assert_eq!(
        refused(c.declare_version(&long, FSDP2, &tensors()).await),
        "invalid field label: length in bytes 257 is over the limit of 256"
    );
    c.declare_version(&long[..256], FSDP2, &tensors())
        .await
        .unwrap();
    let many: Vec<TensorSpec> = (0..=MAX_TENSORS)
        .map(|i| TensorSpec {
            name: format!("t{i}"),
            dtype: DType::U8,
            shape: vec![1],
        })
        .collect();
    assert_eq!(
        refused(c.declare_version("many", FSDP2, &many).await),
        "invalid field tensors: count 1048577 is over the limit of 1048576"
    );
    let deep = vec![TensorSpec {
        name: "t".into(),
        dtype: DType::U8,
        shape: vec![1; 17],
    }];
    assert_eq!(
        refused(c.declare_version("deep", FSDP2, &deep).await),
        "invalid field tensors[0].shape: number of dims 17 is over the limit of 16"
    );
    let before = size(&path);
    c.declare_version("v", FSDP2, &tensors()).await.unwrap();
    let declared = size(&path);
    assert!(declared > before);
    let fat = manifest(0, vec![0; (16 << 20) + 1]);
    assert_eq!(
        refused(c.publish("v", &fat).await.map(|_| ())),
        "invalid field manifest.agent_metadata: length in bytes 16777217 is over the limit of 16777216"
    );
    assert_eq!(
        refused(c.publish(&long, &manifest(0, Vec::new())).await.map(|_| ())),
        "invalid field label: length in bytes 257 is over the limit of 256"
    );
    assert_eq!(size(&path), declared, "nothing refused was journaled");
    h.shutdown().await.unwrap();
}
