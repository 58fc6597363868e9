//! Manifests of a highly available control plane kept out of etcd ([`mx_control::blobs`]): a
//! real 3-member etcd cluster and a real S3-compatible server (moto) on loopback. A manifest
//! too large for an etcd entry is journaled by digest and replayed from the store; a stored
//! body that changed is refused, naming it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use mx_artifact::{ArtifactUrl, Store, StoreOptions};
use mx_control::blobs::BlobStore;
use mx_control::ha::{read_log, Leadership};
use mx_control::journal::Journal;
use mx_control::local_etcd::LocalEtcd;
use mx_control::state::Record;
use mx_layout::SourceManifest;
use object_store::ObjectStoreExt as _;

fn ready(test: &str) -> bool {
    let missing = if !mx_control::local_etcd::installed() {
        "etcd is missing (apt-get install etcd-server)"
    } else if mx_harness::s3::moto_binary().is_none() {
        "moto_server is missing (run scripts/setup.sh)"
    } else {
        return true;
    };
    assert!(
        std::env::var("MX_REQUIRE_ETCD").as_deref() != Ok("1"),
        "{test}: MX_REQUIRE_ETCD=1 but {missing}"
    );
    eprintln!("SKIPPED {test}: {missing}");
    false
}

/// A manifest whose JSON is ~2.7 MiB (its NIXL metadata alone 2 MiB): more than one etcd entry.
fn big_manifest() -> SourceManifest {
    SourceManifest {
        slot: 0,
        layout: "fsdp:1".parse().unwrap(),
        agent_name: "trainer-0".into(),
        agent_metadata: (0..2u32 << 20).map(|i| (i % 251) as u8).collect(),
        shards: Vec::new(),
        pieces: Vec::new(),
        pack_seconds: 0.5,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_over_an_etcd_entry_is_journaled_by_digest_and_verified_on_replay() {
    if !ready("a_manifest_over_an_etcd_entry_is_journaled_by_digest_and_verified_on_replay") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = LocalEtcd::start(dir.path(), 3).unwrap();
    etcd.wait_ready(Duration::from_secs(60)).await.unwrap();
    let s3 = mx_harness::s3::LoopbackS3::start().unwrap();
    s3.bucket("mx-control").unwrap();
    let url: ArtifactUrl = "s3://mx-control/replicas".parse().unwrap();
    let store = Store::from_vars(&url, StoreOptions::default(), s3.vars()).unwrap();
    let with_store = mx_control::ha::EtcdConfig {
        blobs: Some(BlobStore::new(store.clone(), url.clone())),
        ..etcd.config("mx/control/leader", 2)
    };
    let leader = Arc::new(Leadership::campaign(&with_store, "a").await.unwrap());
    let rt = tokio::runtime::Handle::current();
    let publish = Record::Publish {
        label: "step-1".into(),
        manifest: big_manifest(),
    };
    // Without a store the record does not fit one etcd entry.
    let plain = etcd.config("mx/control/leader", 2);
    let (journal, _) = Journal::open_etcd(
        &plain,
        leader.clone(),
        "/mx/plain/",
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    let rec = publish.clone();
    let e = tokio::task::spawn_blocking(move || {
        let mut journal = journal;
        journal.append(&rec)
    })
    .await
    .unwrap()
    .unwrap_err();
    assert!(e.to_string().contains("etcd's request limit"), "{e}");

    // With a store the log holds the digest; the reopened journal holds the manifest.
    let (journal, _) = Journal::open_etcd(
        &with_store,
        leader.clone(),
        "/mx/refs/",
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    let rec = publish.clone();
    tokio::task::spawn_blocking(move || {
        let mut journal = journal;
        journal.append(&rec).unwrap();
    })
    .await
    .unwrap();
    let log = read_log(&with_store, "/mx/refs/").await.unwrap();
    let bytes: Vec<u8> = log.iter().flat_map(|(_, b)| b.clone()).collect();
    assert!(bytes.len() < 4096, "{} bytes in etcd", bytes.len());
    let raw = mx_control::journal::parse_records(std::path::Path::new("etcd"), &bytes).unwrap();
    let Record::PublishRef { slot, manifest, .. } = &raw[0].record else {
        panic!("{:?}", raw[0].record)
    };
    assert_eq!(*slot, 0);
    let (_, loaded) = Journal::open_etcd(
        &with_store,
        leader.clone(),
        "/mx/refs/",
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    assert_eq!(loaded.entries.len(), 1);
    assert_eq!(loaded.entries[0].record, publish);

    // A body that is not the one journaled is refused, naming it.
    let key = url.key(&format!("manifests/{}", manifest.blake3));
    store
        .object_store()
        .put(&key, b"not the manifest".to_vec().into())
        .await
        .unwrap();
    let e = Journal::open_etcd(
        &with_store,
        leader.clone(),
        "/mx/refs/",
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&manifest.blake3) && e.contains("the journal names"),
        "{e}"
    );
    // A replica without the store cannot replay it, and says why.
    let e = Journal::open_etcd(
        &plain,
        leader,
        "/mx/refs/",
        rt,
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("--manifest-store"), "{e}");
}
