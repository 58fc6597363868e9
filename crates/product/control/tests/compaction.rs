//! Journal compaction in a running control plane: past the configured thresholds the journal
//! thread snapshots the state and truncates the journal, sequence numbers go on across the
//! snapshot, and a restarted control plane (which also compacts at start when due) serves the
//! same state from snapshot + journal.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use mx_control::client::ControlClient;
use mx_control::snapshot::{snapshot_path, Compaction};
use mx_control::{spawn, ControlPlaneConfig};
use mx_layout::{LayoutSpec, Scheme};

const TP1: LayoutSpec = LayoutSpec {
    scheme: Scheme::VllmTp,
    world_size: 1,
};

fn cfg(journal: &std::path::Path, max_journal_records: u64) -> ControlPlaneConfig {
    ControlPlaneConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        journal_path: journal.to_path_buf(),
        security: mx_control::Security::insecure_loopback(),
        compaction: Compaction {
            max_journal_bytes: 0,
            max_journal_records,
            refit_detail: 8,
            retire_departed_after: None,
            ..Default::default()
        },
    }
}

async fn worker_ids(client: &ControlClient) -> Vec<String> {
    let status = client.get_status().await.unwrap();
    let mut ids: Vec<String> = status.workers.iter().map(|w| w.worker_id.clone()).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_is_compacted_past_its_threshold_and_replays_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.jsonl");
    let (addr, handle) = spawn(cfg(&journal, 10)).await.unwrap();
    let client = ControlClient::connect(&addr.to_string()).await.unwrap();
    // One at a time: each is its own group commit, so compaction runs after the 11th.
    for i in 0..25 {
        client
            .register_worker(&format!("w{i:02}"), &format!("i{i:02}"), &[0], TP1)
            .await
            .unwrap();
    }
    let before = worker_ids(&client).await;
    assert_eq!(before.len(), 25);
    handle.shutdown().await.unwrap();

    // Snapshots at 11 and 22; the journal holds 23..=25.
    let loaded = mx_control::journal::load(&journal).unwrap();
    let snap = loaded.snapshot.as_ref().unwrap();
    assert_eq!(snap.seq, 22);
    let seqs: Vec<u64> = loaded.entries.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![23, 24, 25]);
    let on_disk = std::fs::metadata(snapshot_path(&journal)).unwrap().len();
    assert_eq!(snap.bytes, on_disk);

    // A restart with a lower threshold compacts at start, before serving; sequence numbers go
    // on from 25.
    let (addr, handle) = spawn(cfg(&journal, 2)).await.unwrap();
    let client = ControlClient::connect(&addr.to_string()).await.unwrap();
    assert_eq!(worker_ids(&client).await, before);
    let loaded = mx_control::journal::load(&journal).unwrap();
    assert_eq!(loaded.snapshot.as_ref().unwrap().seq, 25);
    assert!(loaded.entries.is_empty());
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), 0);
    client
        .register_worker("w99", "i99", &[0], TP1)
        .await
        .unwrap();
    handle.shutdown().await.unwrap();
    let loaded = mx_control::journal::load(&journal).unwrap();
    assert_eq!(loaded.entries[0].seq, 26);

    // Without compaction (thresholds 0): the same state from snapshot + journal.
    let never = Compaction {
        max_journal_bytes: 0,
        max_journal_records: 0,
        refit_detail: 8,
        retire_departed_after: None,
        ..Default::default()
    };
    let mut c = cfg(&journal, 0);
    c.compaction = never;
    let (addr, handle) = spawn(c).await.unwrap();
    let client = ControlClient::connect(&addr.to_string()).await.unwrap();
    let mut want = before.clone();
    want.push("w99".into());
    assert_eq!(worker_ids(&client).await, want);
    handle.shutdown().await.unwrap();
    assert_eq!(
        mx_control::journal::load(&journal).unwrap().entries.len(),
        1,
        "not compacted"
    );
}
