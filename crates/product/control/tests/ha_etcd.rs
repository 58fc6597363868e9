//! Leadership and fencing on a real 3-member etcd cluster on loopback (Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use std::time::{Duration, Instant};

use mx_control::ha::{leader, read_log, EtcdConfig, Leadership};
use mx_control::local_etcd::LocalEtcd;

/// A 3-member etcd cluster ([`LocalEtcd`]) and its directory, killed on drop.
struct Etcd {
    _cluster: LocalEtcd,
    endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts 3 members, or `None` (with a message) when etcd is not installed and not required.
async fn etcd_cluster() -> Option<Etcd> {
    if !mx_control::local_etcd::installed() {
        assert!(
            std::env::var("MX_REQUIRE_ETCD").as_deref() != Ok("1"),
            "etcd missing and MX_REQUIRE_ETCD=1: apt-get install etcd-server"
        );
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalEtcd::start(dir.path(), 3).unwrap();
    cluster.wait_ready(Duration::from_secs(60)).await.unwrap();
    Some(Etcd {
        endpoints: cluster.endpoints().to_vec(),
        _cluster: cluster,
        _dir: dir,
    })
}

/// `attempt()` again every 200 ms (each try at most 5 s) until it succeeds: the etcd cluster
/// elects its own raft leader first. Panics naming `what` after 30 s.
async fn until_elected<T, E: std::fmt::Debug, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let t = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), attempt()).await {
            Ok(Ok(x)) => return x,
            _ if t.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(e)) => panic!("{what} not elected within 30 s: {e:?}"),
            Err(_) => panic!("{what} not elected within 30 s: the last try timed out"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_and_a_deposed_leader_cannot_write() {
    let Some(etcd) = etcd_cluster().await else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/leader".into(),
        lease_ttl_s: 2,
        blobs: None,
    };
    let a = until_elected("replica a", || {
        Leadership::campaign(&cfg, "http://replica-a:7700")
    })
    .await;
    let ea = a.epoch();
    assert!(ea.0 > 0);
    assert_eq!(
        leader(&cfg).await.unwrap(),
        Some(("http://replica-a:7700".to_string(), ea))
    );
    a.fenced_put(vec![(b"/mx/test/k".to_vec(), b"from-a".to_vec())])
        .await
        .unwrap();
    a.append("/mx/log/", 1, b"one".to_vec()).await.unwrap();
    a.append("/mx/log/", 2, b"two".to_vec()).await.unwrap();

    // B campaigns and waits while A leads.
    let cfg_b = cfg.clone();
    let b =
        tokio::spawn(async move { Leadership::campaign(&cfg_b, "http://replica-b:7700").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b.is_finished(), "B was elected while A leads");

    // A's lease is revoked (as when its process dies and the lease runs out): B is elected with
    // a higher epoch, and a write guarded by A's epoch is refused.
    let etcd_client = etcd_client::Client::connect(&cfg.endpoints, None)
        .await
        .unwrap();
    etcd_client
        .lease_client()
        .revoke(a.lease_id())
        .await
        .unwrap();
    let b = tokio::time::timeout(Duration::from_secs(10), b)
        .await
        .expect("B elected within 10 s")
        .unwrap()
        .unwrap();
    assert!(b.epoch() > ea, "{:?} after {ea}", b.epoch());
    assert_eq!(
        leader(&cfg).await.unwrap(),
        Some(("http://replica-b:7700".to_string(), b.epoch()))
    );
    // The log: A wrote entries 1 and 2 while it led; deposed, it cannot write 3; B reads 1 and
    // 2 and writes 3; entry 3 cannot be written twice.
    let e = a.append("/mx/log/", 3, b"late".to_vec()).await.unwrap_err();
    assert!(matches!(e, mx_control::Error::Fenced { .. }), "{e}");
    let log = read_log(&cfg, "/mx/log/").await.unwrap();
    assert_eq!(
        log,
        vec![(1, b"one".to_vec()), (2, b"two".to_vec())],
        "{log:?}"
    );
    b.append("/mx/log/", 3, b"three".to_vec()).await.unwrap();
    let e = b
        .append("/mx/log/", 3, b"again".to_vec())
        .await
        .unwrap_err();
    assert!(matches!(e, mx_control::Error::Fenced { .. }), "{e}");
    assert_eq!(read_log(&cfg, "/mx/log/").await.unwrap().len(), 3);
    let e = b
        .append("/mx/log/", 4, vec![0; mx_control::ha::MAX_ENTRY_BYTES + 1])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("etcd's request limit"), "{e}");

    let e = a
        .fenced_put(vec![(b"/mx/test/k".to_vec(), b"from-deposed-a".to_vec())])
        .await
        .unwrap_err();
    assert!(
        matches!(e, mx_control::Error::Fenced { epoch, .. } if epoch == ea.0),
        "{e}"
    );
    b.fenced_put(vec![(b"/mx/test/k".to_vec(), b"from-b".to_vec())])
        .await
        .unwrap();

    // The control plane's journal kept in etcd by the leader: records written, read back and
    // replayed as from a file.
    let b = std::sync::Arc::new(b);
    let rt = tokio::runtime::Handle::current();
    let (journal, loaded) = mx_control::journal::Journal::open_etcd(
        &cfg,
        b.clone(),
        "/mx/journal/",
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    assert!(loaded.entries.is_empty() && loaded.snapshot.is_none());
    let declare = |label: &str| mx_control::state::Record::Declare {
        label: label.into(),
        trainer_layout: "fsdp:2".parse().unwrap(),
        tensors: vec![mx_layout::TensorSpec {
            name: "w".into(),
            dtype: mx_layout::DType::BF16,
            shape: vec![4, 8],
        }],
    };
    let recs = vec![declare("v1"), declare("v2")];
    let written = recs.clone();
    tokio::task::spawn_blocking(move || {
        let mut journal = journal;
        for r in &written {
            journal.append(r).unwrap();
        }
    })
    .await
    .unwrap();
    let (_, loaded) = mx_control::journal::Journal::open_etcd(
        &cfg,
        b.clone(),
        "/mx/journal/",
        rt,
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    let got: Vec<_> = loaded.entries.into_iter().map(|e| e.record).collect();
    assert_eq!(got, recs);
    drop(etcd);
}

/// Two control-plane replicas over one etcd: the first leads and journals a declaration into
/// etcd; once it stops, the second is elected and serves the same state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_serves_the_state_the_old_one_journaled() {
    let Some(etcd) = etcd_cluster().await else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/leader".into(),
        lease_ttl_s: 2,
        blobs: None,
    };
    let dir = tempfile::tempdir().unwrap();
    let unused = dir.path().to_path_buf();
    let replica = move |name: &str, port: u16| mx_control::ControlPlaneConfig {
        compaction: Default::default(),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        journal_path: unused.join(format!("{name}-unused.jsonl")),
        security: mx_control::Security::insecure_loopback(),
    };
    let (addr_a, a) = until_elected("replica a", || {
        mx_control::spawn_ha(replica("a", 0), &cfg, "http://replica-a", "/mx/journal/")
    })
    .await;
    let tensors = vec![mx_layout::TensorSpec {
        name: "w".into(),
        dtype: mx_layout::DType::BF16,
        shape: vec![4, 8],
    }];
    let c = mx_control::client::ControlClient::connect(&format!("http://{addr_a}"))
        .await
        .unwrap();
    c.declare_version("v1", "fsdp:2".parse().unwrap(), &tensors)
        .await
        .unwrap();
    assert_eq!(
        leader(&cfg).await.unwrap().map(|(url, _)| url).as_deref(),
        Some("http://replica-a")
    );
    // B campaigns; meanwhile it answers every RPC UNAVAILABLE, naming the leader.
    let port_b = free_port();
    let cfg_b = cfg.clone();
    let b_task = tokio::spawn(async move {
        mx_control::spawn_ha(
            replica("b", port_b),
            &cfg_b,
            "http://replica-b",
            "/mx/journal/",
        )
        .await
    });
    let follower = format!("http://127.0.0.1:{port_b}");
    let t = Instant::now();
    let e = loop {
        match mx_control::client::ControlClient::connect(&follower).await {
            Ok(c) => break c.get_status().await.unwrap_err(),
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("follower not listening: {e}"),
        }
    };
    assert!(
        matches!(&e, mx_control::Error::Rpc { code: tonic::Code::Unavailable, message, .. }
            if message.contains("is a follower: the leader is http://replica-a")),
        "{e}"
    );
    // The leader's URL is in the answer's metadata too, for clients to follow.
    let mut raw =
        mx_control::pb::control_plane_client::ControlPlaneClient::connect(follower.clone())
            .await
            .unwrap();
    let st = raw
        .list_layouts(mx_control::pb::ListLayoutsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unavailable);
    assert_eq!(
        st.metadata()
            .get(mx_control::client::LEADER_HEADER)
            .and_then(|v| v.to_str().ok()),
        Some("http://replica-a")
    );
    // A client given both replicas finds the leader.
    let both = format!("{follower},http://{addr_a}");
    let c = mx_control::client::ControlClient::connect(&both)
        .await
        .unwrap();
    c.declare_version("v0", "fsdp:2".parse().unwrap(), &tensors)
        .await
        .unwrap();
    a.shutdown().await.unwrap();

    let (addr_b, b) = tokio::time::timeout(Duration::from_secs(15), b_task)
        .await
        .expect("replica b elected once a's lease ran out")
        .unwrap()
        .unwrap();
    assert_eq!(addr_b.port(), port_b);
    let c = mx_control::client::ControlClient::connect(&format!("http://{addr_b}"))
        .await
        .unwrap();
    let s = c.get_status().await.unwrap();
    let labels: Vec<&str> = s.versions.iter().map(|v| v.label.as_str()).collect();
    assert_eq!(labels, ["v1", "v0"]);
    assert_eq!(
        leader(&cfg).await.unwrap().map(|(url, _)| url).as_deref(),
        Some("http://replica-b")
    );
    // The new leader keeps journaling into the same log.
    c.declare_version("v2", "fsdp:2".parse().unwrap(), &tensors)
        .await
        .unwrap();
    b.shutdown().await.unwrap();
    let log = read_log(&cfg, "/mx/journal/").await.unwrap();
    assert_eq!(log.len(), 3, "one entry per group commit");
    drop(etcd);
}

/// A follower speaks TLS when the leader does: a client configured with the fleet's CA reaches
/// it and is told (in the message and in `x-mx-leader`) where the leader is; a plaintext client
/// gets no answer from it. It authenticates as the leader does (issue 29): a caller without a
/// token, or with an unknown one, is answered UNAUTHENTICATED and not told where the leader is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_speaks_tls_as_the_leader_does() {
    let Some(etcd) = etcd_cluster().await else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/tls-leader".into(),
        lease_ttl_s: 2,
        blobs: None,
    };
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let replica = |name: &str, port: u16| mx_control::ControlPlaneConfig {
        compaction: Default::default(),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        journal_path: dir.path().join(format!("{name}-unused.jsonl")),
        security: mx_control::Security {
            tls: Some(mx_control::TlsIdentity::load(&cert, &key).unwrap()),
            tokens: Some(std::sync::Arc::new(
                mx_control::auth::TokenTable::parse("tok-reader-0123456789abcdef,reader,dash\n")
                    .unwrap(),
            )),
            ..mx_control::Security::insecure_loopback()
        },
    };
    let (_, a) = until_elected("replica a", || {
        mx_control::spawn_ha(replica("a", 0), &cfg, "https://replica-a", "/mx/tls/")
    })
    .await;
    let port_b = free_port();
    let (cfg_b, replica_b) = (cfg.clone(), replica("b", port_b));
    let b_task = tokio::spawn(async move {
        mx_control::spawn_ha(replica_b, &cfg_b, "https://replica-b", "/mx/tls/").await
    });
    let anonymous =
        mx_control::client::ClientAuth::default().with_ca_pem(ck.cert.pem().into_bytes());
    let auth = anonymous
        .clone()
        .with_token("tok-reader-0123456789abcdef")
        .unwrap();
    let follower = format!("https://localhost:{port_b}");
    let t = Instant::now();
    let e = loop {
        match mx_control::client::ControlClient::connect_with(&follower, &auth).await {
            Ok(c) => break c.get_status().await.unwrap_err(),
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("follower not answering over TLS: {e}"),
        }
    };
    assert!(
        matches!(&e, mx_control::Error::Rpc { code: tonic::Code::Unavailable, message, .. }
            if message.contains("is a follower: the leader is https://replica-a")),
        "{e}"
    );
    // Without a token, or with a wrong one: UNAUTHENTICATED, the leader not named.
    for who in [
        anonymous.clone(),
        anonymous.clone().with_token("not-a-token").unwrap(),
    ] {
        let c = mx_control::client::ControlClient::connect_with(&follower, &who)
            .await
            .unwrap();
        let e = c.get_status().await.unwrap_err();
        assert!(
            matches!(&e, mx_control::Error::Rpc { code: tonic::Code::Unauthenticated, message, .. }
                if !message.contains("replica-a")),
            "{e}"
        );
    }
    // Plaintext to the follower gets no gRPC answer at all.
    let plain =
        mx_control::client::ControlClient::connect(&format!("http://127.0.0.1:{port_b}")).await;
    let refused = match plain {
        Err(e) => e,
        Ok(c) => c.get_status().await.unwrap_err(),
    };
    assert!(
        !refused.to_string().contains("is a follower"),
        "a plaintext client was answered: {refused}"
    );
    a.shutdown().await.unwrap();
    let (_, b) = tokio::time::timeout(Duration::from_secs(15), b_task)
        .await
        .expect("replica b elected once a's lease ran out")
        .unwrap()
        .unwrap();
    let c = mx_control::client::ControlClient::connect_with(&follower, &auth)
        .await
        .unwrap();
    c.get_status().await.unwrap();
    b.shutdown().await.unwrap();
    drop(etcd);
}

/// The journal kept in etcd is compacted as a file is: a snapshot larger than one etcd entry
/// goes in chunks, the log entries it includes are deleted, and a reopen replays the snapshot
/// and the entries after it. A head that does not parse strictly or names missing chunks is
/// refused, naming its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_etcd_journal_replays_its_snapshot_and_the_log_after_it() {
    use mx_control::journal::Journal;
    use mx_control::state::{Record, State};
    let Some(etcd) = etcd_cluster().await else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/compact".into(),
        lease_ttl_s: 2,
        blobs: None,
    };
    let leader_a =
        std::sync::Arc::new(until_elected("a", || Leadership::campaign(&cfg, "a")).await);
    let prefix = "/mx/compact/";
    let rt = tokio::runtime::Handle::current();
    let (journal, _) = Journal::open_etcd(
        &cfg,
        leader_a.clone(),
        prefix,
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    // Four declarations of 6,000 tensors each: each one journal line under 1 MiB, the state
    // that holds them all over 1 MiB (a snapshot of two chunks or more).
    let declare = |label: &str, tensors: usize| Record::Declare {
        label: label.into(),
        trainer_layout: "fsdp:2".parse().unwrap(),
        tensors: (0..tensors)
            .map(|i| mx_layout::TensorSpec {
                name: format!("model.layers.{i}.mlp.down_proj.weight"),
                dtype: mx_layout::DType::BF16,
                shape: vec![64, 128],
            })
            .collect(),
    };
    let big: Vec<Record> = (0..4).map(|i| declare(&format!("v{i}"), 6000)).collect();
    let (journal, state, compacted) = tokio::task::spawn_blocking(move || {
        let mut journal = journal;
        let mut state = State::default();
        for r in big {
            journal.append(&r).unwrap();
            state.apply(r).unwrap();
        }
        let c = journal.compact(&state).unwrap();
        let tail = declare("v4", 1);
        journal.append(&tail).unwrap();
        state.apply(tail).unwrap();
        (journal, state, c)
    })
    .await
    .unwrap();
    assert_eq!(compacted.seq, 4);
    assert!(
        compacted.snapshot_bytes > mx_control::ha::MAX_ENTRY_BYTES as u64,
        "{compacted:?}"
    );
    assert_eq!(journal.snapshot_seq(), 4);
    drop(journal);
    // Only the entry written after the snapshot is left in the log.
    let log = read_log(&cfg, prefix).await.unwrap();
    assert_eq!(
        log.len(),
        1,
        "{:?}",
        log.iter().map(|(e, _)| e).collect::<Vec<_>>()
    );
    let (reopened, loaded) = Journal::open_etcd(
        &cfg,
        leader_a.clone(),
        prefix,
        rt.clone(),
        mx_control::journal::Unchecked::Refuse,
    )
    .await
    .unwrap();
    let snap = loaded.snapshot.expect("the snapshot is read back");
    assert_eq!(snap.seq, 4);
    let mut replayed = snap.state;
    let tail: Vec<Record> = loaded.entries.into_iter().map(|e| e.record).collect();
    assert_eq!(tail, vec![declare("v4", 1)]);
    for r in tail {
        replayed.apply(r).unwrap();
    }
    assert_eq!(replayed, state);
    assert_eq!(reopened.len(), 5);
    // A second compaction replaces the first: the old chunks go with the entries.
    let (reopened, c2) = tokio::task::spawn_blocking(move || {
        let mut j = reopened;
        let c = j.compact(&state).unwrap();
        (j, c)
    })
    .await
    .unwrap();
    assert_eq!(c2.seq, 5);
    drop(reopened);
    assert!(read_log(&cfg, prefix).await.unwrap().is_empty());
    let raw = etcd_client::Client::connect(&cfg.endpoints, None)
        .await
        .unwrap();
    let chunks = raw
        .kv_client()
        .get(
            format!("{prefix}snapshot/"),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let keys: Vec<String> = chunks
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    assert!(
        keys.iter()
            .all(|k| k.ends_with("/head") || k.contains("/00000000000000000005/")),
        "{keys:?}"
    );
    // A head with a field this build does not know, or naming chunks that are not there.
    for (head, says) in [
        (
            r#"{"seq":5,"chunks":2,"bytes":10,"first_entry":1,"extra":1}"#,
            "unknown field",
        ),
        (
            r#"{"seq":9,"chunks":1,"bytes":10,"first_entry":1}"#,
            "snapshot of seq 9 should be 10 bytes in 1 chunks",
        ),
    ] {
        raw.kv_client()
            .put(format!("{prefix}snapshot/head"), head, None)
            .await
            .unwrap();
        let e = Journal::open_etcd(
            &cfg,
            leader_a.clone(),
            prefix,
            rt.clone(),
            mx_control::journal::Unchecked::Refuse,
        )
        .await
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/mx/compact/snapshot/head") && msg.contains(says),
            "{msg}"
        );
    }
    drop(etcd);
}
