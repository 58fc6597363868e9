//! Sources besides the trainer, process by process: `mx control`, `mx-lab publish` trainer ranks,
//! `mx worker`s of two layouts and `mx export` to a real S3-compatible server (moto on
//! loopback). Once every publisher is SIGKILLed, refits still commit from the artifacts: with the
//! delta corrupted a worker falls back to the canonical artifact; with no source left a refit
//! aborts before anything is applied; a worker holding the base stages the delta; a worker that
//! joins afterwards is brought to the committed version from the canonical artifact, never from
//! the trainer. Peers: workers serve the committed version from their memory; joining workers of
//! their layout, of another layout, and of a layout registered after the version was published
//! stage from them with every publisher dead; a peer SIGKILLed mid-pull is dropped and another
//! layout's peers serve the version. Every live byte is checked against slices of the checkpoint
//! computed here, and the post-update generation against golden tokens.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{demo_version, free_port, model, reference_rank, rt, Kids};
use mx_control::client::ControlClient;
use mx_harness::s3::LoopbackS3;
use mx_layout::{rank_layouts, ModelInfo};
use object_store::ObjectStoreExt as _;

/// `mx ARGS` with the S3 variables; (success, stdout + stderr).
fn mx(s3: &LoopbackS3, args: &[&str]) -> (bool, String) {
    let out = Command::new(common::exe(args))
        .args(args)
        .envs(s3.vars())
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn spawn(s3: &LoopbackS3, args: &[&str], log: &Path) -> Child {
    Command::new(common::exe(args))
        .args(args)
        .envs(s3.vars())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until `log` has a line containing `needle`; returns that line.
fn wait_log(log: &Path, needle: &str, secs: u64) -> String {
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(needle)) {
            return l.to_string();
        }
        assert!(
            t.elapsed().as_secs() < secs,
            "{} never logged {needle:?}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until `f` holds (polling the control plane), up to `secs`.
fn wait_for(
    rt: &tokio::runtime::Runtime,
    c: &ControlClient,
    what: &str,
    secs: u64,
    f: impl Fn(&mx_control::FleetStatus) -> bool,
) {
    let t = Instant::now();
    loop {
        let s = rt.block_on(c.get_status()).unwrap();
        if f(&s) {
            return;
        }
        if t.elapsed().as_secs() >= secs {
            let ws: Vec<String> = s
                .workers
                .iter()
                .map(|w| format!("{} connected={} {:?}", w.worker_id, w.connected, w.state))
                .collect();
            panic!("{what} never happened: workers {ws:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The worker's live digests (its own route) equal those of slices of demo version `step`.
fn check_live(http: &str, model: &ModelInfo, layout: &str, dir: &Path, step: u32) {
    let (specs, bytes) = demo_version(dir, step);
    let body: serde_json::Value = {
        let out = Command::new("curl")
            .args(["-sf", &format!("{http}/mx/live_digests")])
            .output()
            .unwrap();
        assert!(out.status.success(), "GET {http}/mx/live_digests failed");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for (rl, live) in rank_layouts(model, layout.parse().unwrap())
        .unwrap()
        .iter()
        .zip(body["ranks"].as_array().unwrap())
    {
        let want = mx_puller::digests_of(rl, &reference_rank(rl, &specs, &bytes));
        assert_eq!(live["rank"], rl.rank);
        for (name, d) in &want.tensors {
            assert_eq!(
                live["tensors"][name].as_str(),
                Some(d.to_string().as_str()),
                "{http} rank {} parameter {name} differs from version {step}",
                rl.rank
            );
        }
    }
}

/// A local fleet of `mx` processes around one control plane, all with the S3 variables.
struct Fleet {
    s3: LoopbackS3,
    dir: std::path::PathBuf,
    md: String,
    tmp: tempfile::TempDir,
    a: String,
    rt: tokio::runtime::Runtime,
    c: ControlClient,
    info: ModelInfo,
    kids: Kids,
    /// The name of each process of `kids`, in order.
    ids: Vec<String>,
}

impl Fleet {
    /// Starts moto and `mx control`; `None` when the model (or NIXL) is missing and not required.
    fn start() -> Option<Fleet> {
        let dir = model("smollm2-135m")?;
        let s3 = LoopbackS3::start().expect("moto_server (run scripts/setup.sh)");
        let tmp = tempfile::tempdir().unwrap();
        let addr_file = tmp.path().join("addr");
        let journal = tmp.path().join("j.jsonl");
        let kids = Kids(vec![spawn(
            &s3,
            &[
                "control",
                "--insecure-loopback",
                "--listen",
                "127.0.0.1:0",
                "--journal",
                journal.to_str().unwrap(),
                "--addr-file",
                addr_file.to_str().unwrap(),
            ],
            &tmp.path().join("control.log"),
        )]);
        let t = Instant::now();
        while !addr_file.exists() {
            assert!(t.elapsed().as_secs() < 30, "control plane did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let a = format!("http://{}", std::fs::read_to_string(&addr_file).unwrap());
        let rt = rt();
        let c = rt.block_on(ControlClient::connect(&a)).unwrap();
        let ck = mx_checkpoint::Checkpoint::open(&dir).unwrap();
        let info = ModelInfo::from_hf_config(ck.config().unwrap(), ck.specs()).unwrap();
        Some(Fleet {
            md: dir.to_str().unwrap().to_string(),
            dir,
            s3,
            tmp,
            a,
            rt,
            c,
            info,
            kids,
            ids: vec!["control".into()],
        })
    }

    fn log(&self, name: &str) -> std::path::PathBuf {
        self.tmp.path().join(format!("{name}.log"))
    }

    fn mx(&self, args: &[&str]) -> (bool, String) {
        mx(&self.s3, args)
    }

    /// Starts `mx worker` `id` of `layout` (plus `extra` flags); returns its HTTP port.
    fn worker(&mut self, id: &str, layout: &str, extra: &[&str]) -> u16 {
        let port = free_port();
        let http = format!("127.0.0.1:{port}");
        let mut args = vec![
            "worker",
            "--control",
            &self.a,
            "--model",
            &self.md,
            "--layout",
            layout,
            "--id",
            id,
            "--http",
            &http,
        ];
        args.extend_from_slice(extra);
        let child = spawn(&self.s3, &args, &self.log(id));
        self.kids.0.push(child);
        self.ids.push(id.to_string());
        port
    }

    fn wait_for(&self, what: &str, secs: u64, f: impl Fn(&mx_control::FleetStatus) -> bool) {
        wait_for(&self.rt, &self.c, what, secs, f);
    }

    /// Waits until workers `ids` are connected; on a timeout the panic shows their logs' tails.
    fn wait_connected(&self, ids: &[&str]) {
        let t = Instant::now();
        loop {
            let s = self.rt.block_on(self.c.get_status()).unwrap();
            if ids
                .iter()
                .all(|id| s.workers.iter().any(|w| w.worker_id == *id && w.connected))
            {
                return;
            }
            if t.elapsed().as_secs() >= 120 {
                let logs: Vec<String> = ids
                    .iter()
                    .map(|id| {
                        let log = std::fs::read_to_string(self.log(id)).unwrap_or_default();
                        let tail = log[log.len().saturating_sub(3000)..].to_string();
                        format!("--- {id}:\n{tail}")
                    })
                    .collect();
                panic!("workers {ids:?} not connected:\n{}", logs.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn declare(&self, label: &str) {
        let (ok, out) = self.mx(&[
            "declare",
            "--control",
            &self.a,
            "--model",
            &self.md,
            "--trainer-layout",
            "fsdp:2",
            "--label",
            label,
        ]);
        assert!(ok, "{out}");
    }

    /// Two `fsdp:2` trainer ranks publishing versions step-1..=step-`steps`.
    fn publishers(&self, steps: &str) -> Kids {
        Kids(
            ["0", "1"]
                .iter()
                .map(|r| {
                    spawn(
                        &self.s3,
                        &[
                            "publish",
                            "--control",
                            &self.a,
                            "--model",
                            &self.md,
                            "--layout",
                            "fsdp:2",
                            "--rank",
                            r,
                            "--steps",
                            steps,
                        ],
                        &self.log(&format!("publish{r}")),
                    )
                })
                .collect(),
        )
    }

    fn wait_ready(&self, label: &str) {
        self.wait_for(&format!("{label} READY"), 120, |s| {
            s.versions
                .iter()
                .any(|v| v.label == label && v.version_digest.is_some())
        });
    }

    /// `mx refit` to `label` of the comma-separated `workers`, golden-checked.
    fn refit(&self, label: &str, workers: &str, golden: &str) -> (bool, String) {
        self.refit_with(label, &["--workers", workers], golden)
    }

    /// `mx refit --join` to `label` (every connected worker not running it), golden-checked.
    fn join(&self, label: &str, golden: &str) -> (bool, String) {
        self.refit_with(label, &["--join"], golden)
    }

    fn refit_with(&self, label: &str, target: &[&str], golden: &str) -> (bool, String) {
        let mut args = vec!["refit", "--control", &self.a, "--label", label];
        args.extend_from_slice(target);
        args.extend_from_slice(&["--golden-model", &self.md, "--golden-version", golden]);
        self.mx(&args)
    }

    fn worker_status(&self, id: &str) -> mx_control::WorkerStatus {
        let st = self.rt.block_on(self.c.get_status()).unwrap();
        st.workers
            .iter()
            .find(|w| w.worker_id == id)
            .unwrap()
            .clone()
    }

    fn source_of(&self, id: &str) -> mx_control::StagedReport {
        self.worker_status(id).last_staged.unwrap()
    }

    /// Waits until exactly `ids` serve `label` as peers.
    fn wait_peers(&self, label: &str, ids: &[&str]) {
        let t = Instant::now();
        loop {
            let v = self.rt.block_on(self.c.get_version(label)).unwrap();
            let have: Vec<String> = v.peers.into_iter().map(|p| p.worker_id).collect();
            if have == ids {
                return;
            }
            assert!(
                t.elapsed().as_secs() < 60,
                "peers of {label}: {have:?}, want {ids:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sets failpoints (a JSON object) on the worker serving HTTP on `port`.
    fn failpoint(&self, port: u16, body: &str) {
        let out = Command::new("curl")
            .args([
                "-sf",
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-d",
                body,
            ])
            .arg(format!("http://127.0.0.1:{port}/mx/failpoints"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "POST failpoints {body} to :{port} failed"
        );
    }

    /// The process of worker `id` (started by [`Fleet::worker`]), no longer killed on drop.
    fn take(&mut self, id: &str) -> Child {
        let i = self.ids.iter().position(|x| x == id).unwrap();
        self.ids.remove(i);
        self.kids.0.remove(i)
    }

    fn check_live(&self, port: u16, layout: &str, step: u32) {
        check_live(
            &format!("http://127.0.0.1:{port}"),
            &self.info,
            layout,
            &self.dir,
            step,
        );
    }
}

/// SIGKILLs every process of `k`.
fn kill_all(k: &mut Kids) {
    for mut p in std::mem::take(&mut k.0) {
        p.kill().unwrap();
        p.wait().unwrap();
    }
}

#[test]
fn publishers_dead_the_fleet_refits_and_a_new_worker_joins_from_artifacts() {
    let Some(mut f) = Fleet::start() else {
        return;
    };
    f.s3.bucket("mx-e2e").unwrap();
    // Two workers of two layouts, registered before anything is published; not serving peers
    // (only the artifacts are under test here).
    let pa = f.worker("a", "tp:3", &["--no-peer"]);
    let pb = f.worker("b", "tp:1", &["--no-peer"]);
    f.wait_connected(&["a", "b"]);

    // Two trainer ranks publish step-1, then step-2 once step-1 is committed and declared.
    f.declare("step-1");
    let mut publishers = f.publishers("2");
    f.wait_ready("step-1");
    let (ok, out) = f.refit("step-1", "a,b", "1");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let (ok, out) = f.mx(&[
        "export",
        "--control",
        &f.a,
        "--label",
        "step-1",
        "--checkpoint",
        &f.md,
        "--to",
        "s3://mx-e2e/run/step-1",
    ]);
    assert!(ok, "{out}");
    f.declare("step-2");
    f.wait_ready("step-2");
    let (ok, delta) = f.mx(&[
        "export",
        "--control",
        &f.a,
        "--label",
        "step-2",
        "--checkpoint",
        &f.md,
        "--step",
        "2",
        "--base",
        "step-1",
        "--to",
        "s3://mx-e2e/run/step-2",
        "--json",
    ]);
    assert!(ok, "{delta}");
    let (ok, full) = f.mx(&[
        "export",
        "--control",
        &f.a,
        "--label",
        "step-2",
        "--checkpoint",
        &f.md,
        "--step",
        "2",
        "--to",
        "s3://mx-e2e/run/step-2-full",
        "--json",
    ]);
    assert!(ok, "{full}");
    let delta: serde_json::Value = serde_json::from_str(delta.lines().last().unwrap()).unwrap();
    assert_eq!(delta["kind"], "delta");
    let v2 = f.rt.block_on(f.c.get_version("step-2")).unwrap();
    assert_eq!(v2.artifacts.len(), 2);
    assert_eq!(
        v2.artifacts[0].base,
        f.rt.block_on(f.c.get_version("step-1"))
            .unwrap()
            .version_digest,
        "the delta's lineage names step-1"
    );

    // Every publisher SIGKILLed: nothing can be pulled from a trainer any more.
    kill_all(&mut publishers);

    // The delta's first object corrupted (one flipped byte): worker a drops the delta, naming
    // the chunk, and stages from the canonical artifact instead.
    let store = mx_artifact::Store::from_vars(
        &"s3://mx-e2e".parse().unwrap(),
        mx_artifact::StoreOptions::default(),
        f.s3.vars(),
    )
    .unwrap();
    let os = store.object_store();
    let delta_obj = object_store::path::Path::from("run/step-2/delta-00000.bin");
    let full_manifest = object_store::path::Path::from("run/step-2-full/mx-artifact.json");
    let good =
        f.rt.block_on(async { os.get(&delta_obj).await?.bytes().await })
            .unwrap();
    let mut bad = good.to_vec();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x10;
    f.rt.block_on(os.put(&delta_obj, bad.into())).unwrap();
    let (ok, out) = f.refit("step-2", "a", "2");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    assert_eq!(f.source_of("a").source, "artifact_canonical");
    assert!(wait_log(&f.log("a"), "chunk", 10).contains("blake3"));

    // With the canonical artifact gone too, no source is left: b's refit aborts before anything
    // is applied, naming every source tried; b stays on step-1, its bytes untouched.
    let full_bytes =
        f.rt.block_on(async { os.get(&full_manifest).await?.bytes().await })
            .unwrap();
    f.rt.block_on(os.delete(&full_manifest)).unwrap();
    let (ok, out) = f.refit("step-2", "b", "2");
    assert!(!ok && out.contains("ABORTED"), "{out}");
    let r = f.source_of("b");
    assert!(
        !r.ok && r.error.contains("no source could stage step-2"),
        "{r:?}"
    );
    assert!(
        r.error.contains("trainer ranks") && r.error.contains("run/step-2-full"),
        "{r:?}"
    );
    f.check_live(pb, "tp:1", 1);

    // Both put back: b stages the delta onto its resident step-1.
    f.rt.block_on(os.put(&delta_obj, good.into())).unwrap();
    f.rt.block_on(os.put(&full_manifest, full_bytes.into()))
        .unwrap();
    let (ok, out) = f.refit("step-2", "b", "2");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    for id in ["a", "b"] {
        assert!(f.worker_status(id).admitted, "{id} not admitted");
    }
    let r = f.source_of("b");
    assert_eq!(r.source, "artifact_delta", "{r:?}");
    // Only delta ranges were read (the demo's synthetic step changes every element, so they are
    // most of it here; real optimizer steps: examples/delta_vs_full.py).
    let delta_bytes = delta["data_bytes"].as_u64().unwrap();
    assert!(
        r.wire_bytes > 0 && r.wire_bytes <= delta_bytes,
        "b fetched {} bytes, the delta has {delta_bytes}",
        r.wire_bytes
    );
    f.check_live(pa, "tp:3", 2);
    f.check_live(pb, "tp:1", 2);

    // A worker joins the running fleet: brought to step-2 from the canonical artifact (it holds
    // nothing a delta applies to), then admitted.
    let pd = f.worker("d", "tp:3", &["--no-peer"]);
    f.wait_connected(&["d"]);
    let (ok, out) = f.join("step-2", "2");
    assert!(out.contains(r#"on ["d"]"#), "{out}");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    assert_eq!(f.source_of("d").source, "artifact_canonical");
    assert!(f.worker_status("d").admitted);
    f.check_live(pd, "tp:3", 2);
    // The fleet kept serving: a and b stayed admitted through d's join.
    for id in ["a", "b"] {
        assert!(f.worker_status(id).admitted);
    }
}

#[test]
fn peers_bring_joining_workers_of_any_layout_to_the_committed_version() {
    let Some(mut f) = Fleet::start() else {
        return;
    };
    let _pa = f.worker("a", "tp:3", &[]);
    let _pb = f.worker("b", "tp:1", &[]);
    f.wait_connected(&["a", "b"]);
    f.declare("step-1");
    let mut publishers = f.publishers("1");
    f.wait_ready("step-1");
    let (ok, out) = f.refit("step-1", "a,b", "1");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    assert_eq!(f.source_of("a").source, "trainer");
    // Both serve step-1 from their memory once it is resident.
    f.wait_peers("step-1", &["a", "b"]);
    // Every publisher SIGKILLed; no artifact exists: only peers can serve step-1 now.
    kill_all(&mut publishers);

    // A tp:3 worker joins: staged from its own layout's peer (a), committed, admitted; it serves
    // step-1 in turn.
    let pd = f.worker("d", "tp:3", &[]);
    f.wait_connected(&["d"]);
    let (ok, out) = f.join("step-1", "1");
    assert!(out.contains(r#"on ["d"]"#), "{out}");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let r = f.source_of("d");
    assert_eq!(r.source, "peer", "{r:?}");
    assert!(f.worker_status("d").admitted);
    f.check_live(pd, "tp:3", 1);
    f.wait_peers("step-1", &["a", "b", "d"]);

    // Another tp:3 worker joins, pulling from the tp:3 peers a (slot 0) then d (slot 1) with a
    // pause between them; d is SIGKILLed in that pause: the pull from d fails, the tp:3 group is
    // dropped and the tp:1 peer b (another layout: pieces it cut for tp:3 from its verified
    // memory) serves the whole version instead.
    let pe = f.worker("e", "tp:3", &["--failpoints"]);
    f.wait_connected(&["e"]);
    f.failpoint(pe, r#"{"stage.sleep_between_sources_ms": 3000}"#);
    let mut d = Kids(vec![f.take("d")]);
    let refit = std::thread::scope(|s| {
        let h = s.spawn(|| f.refit("step-1", "e", "1"));
        wait_log(&f.log("e"), "sleeping after this source's bytes", 60);
        kill_all(&mut d);
        h.join().unwrap()
    });
    let (ok, out) = refit;
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let r = f.source_of("e");
    assert_eq!(r.source, "peer", "{r:?}");
    let log = wait_log(&f.log("e"), "peer sources failed", 10);
    assert!(log.contains("mx-worker-d"), "{log}");
    f.check_live(pe, "tp:3", 1);
    assert!(f.worker_status("e").admitted);

    // A worker of a layout registered only now (replicated:1, checkpoint names: the version's record has no pieces for
    // it) joins: the peers re-offer step-1 with pieces cut for it, and it stages from them.
    let pg = f.worker("g", "replicated:1", &[]);
    f.wait_connected(&["g"]);
    f.wait_for("peers re-offered with replicated:1 pieces", 60, |_| {
        let v = f.rt.block_on(f.c.get_version("step-1")).unwrap();
        v.peers.iter().any(|p| {
            p.worker_id == "a"
                && p.manifest
                    .pieces
                    .iter()
                    .any(|x| x.layout.to_string() == "replicated:1")
        })
    });
    let (ok, out) = f.refit("step-1", "g", "1");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    assert_eq!(f.source_of("g").source, "peer");
    f.check_live(pg, "replicated:1", 1);
}
