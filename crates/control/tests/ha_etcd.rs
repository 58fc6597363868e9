//! Leadership and fencing on a real 3-member etcd cluster on loopback (Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mx_control::ha::{leader, read_log, EtcdConfig, Leadership};

/// A 3-member etcd cluster, killed on drop.
struct Etcd {
    kids: Vec<Child>,
    endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for c in &mut self.kids {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts 3 members, or `None` (with a message) when etcd is not installed and not required.
fn etcd_cluster() -> Option<Etcd> {
    if Command::new("etcd").arg("--version").output().is_err() {
        assert!(
            std::env::var("MX_REQUIRE_ETCD").as_deref() != Ok("1"),
            "etcd missing and MX_REQUIRE_ETCD=1: apt-get install etcd-server"
        );
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let cluster: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
        .collect();
    let mut kids = Vec::new();
    for (i, (client, peer)) in ports.iter().enumerate() {
        let log = std::fs::File::create(dir.path().join(format!("e{i}.log"))).unwrap();
        kids.push(
            Command::new("etcd")
                .args([
                    "--name",
                    &format!("e{i}"),
                    "--data-dir",
                    dir.path().join(format!("d{i}")).to_str().unwrap(),
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &cluster.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    "mx-test",
                ])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }
    Some(Etcd {
        kids,
        endpoints: ports
            .iter()
            .map(|(c, _)| format!("http://127.0.0.1:{c}"))
            .collect(),
        _dir: dir,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_and_a_deposed_leader_cannot_write() {
    let Some(etcd) = etcd_cluster() else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/leader".into(),
        lease_ttl_s: 2,
    };
    // The cluster takes a moment to elect its own raft leader.
    let t = Instant::now();
    let a = loop {
        match tokio::time::timeout(
            Duration::from_secs(5),
            Leadership::campaign(&cfg, "http://replica-a:7700"),
        )
        .await
        {
            Ok(Ok(l)) => break l,
            _ if t.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("no leadership within 30 s: {other:?}"),
        }
    };
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
    let (journal, entries) =
        mx_control::journal::Journal::open_etcd(&cfg, b.clone(), "/mx/journal/", rt.clone())
            .await
            .unwrap();
    assert!(entries.is_empty());
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
    let (_, entries) = mx_control::journal::Journal::open_etcd(&cfg, b.clone(), "/mx/journal/", rt)
        .await
        .unwrap();
    let got: Vec<_> = entries.into_iter().map(|e| e.record).collect();
    assert_eq!(got, recs);
    drop(etcd);
}

/// Two control-plane replicas over one etcd: the first leads and journals a declaration into
/// etcd; once it stops, the second is elected and serves the same state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_serves_the_state_the_old_one_journaled() {
    let Some(etcd) = etcd_cluster() else {
        return;
    };
    let cfg = EtcdConfig {
        endpoints: etcd.endpoints.clone(),
        election: "mx/control/leader".into(),
        lease_ttl_s: 2,
    };
    let dir = tempfile::tempdir().unwrap();
    let unused = dir.path().to_path_buf();
    let replica = move |name: &str, port: u16| mx_control::ControlPlaneConfig {
        compaction: Default::default(),
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        journal_path: unused.join(format!("{name}-unused.jsonl")),
        security: mx_control::Security::insecure_loopback(),
    };
    // The etcd cluster elects its own raft leader first.
    let t = Instant::now();
    let (addr_a, a) = loop {
        match tokio::time::timeout(
            Duration::from_secs(5),
            mx_control::spawn_ha(replica("a", 0), &cfg, "http://replica-a", "/mx/journal/"),
        )
        .await
        {
            Ok(Ok(x)) => break x,
            _ if t.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("replica a not elected within 30 s: {other:?}"),
        }
    };
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
        .list_layouts(mx_control::pb::ListLayoutsRequest {})
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
