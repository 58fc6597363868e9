//! Sources besides the trainer, process by process: `mx control`, `mx publish` trainer ranks,
//! `mx worker`s of two layouts and `mx export` to a real S3-compatible server (moto on
//! loopback). Once every publisher is SIGKILLed, refits still commit from the artifacts: with the
//! delta corrupted a worker falls back to the canonical artifact; with no source left a refit
//! aborts before anything is applied; a worker holding the base stages the delta; a worker that
//! joins afterwards is brought to the committed version from the canonical artifact, never from
//! the trainer. Every live byte is checked against slices of the checkpoint computed here, and
//! the post-update generation against golden tokens.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{demo_version, model, reference_rank, rt};
use mx_control::client::ControlClient;
use mx_harness::s3::LoopbackS3;
use mx_layout::{rank_layouts, ModelInfo};
use object_store::ObjectStoreExt as _;

/// Children killed (SIGKILL) on drop.
struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `mx ARGS` with the S3 variables; (success, stdout + stderr).
fn mx(s3: &LoopbackS3, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
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
    Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(args)
        .envs(s3.vars())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
        assert!(t.elapsed().as_secs() < secs, "{what} never happened: {s:?}");
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

#[test]
fn publishers_dead_the_fleet_refits_and_a_new_worker_joins_from_artifacts() {
    let Some(dir) = model("smollm2-135m") else {
        return;
    };
    let s3 = LoopbackS3::start().expect("moto_server (run scripts/setup.sh)");
    s3.bucket("mx-e2e").unwrap();
    let md = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let log = |n: &str| tmp.path().join(format!("{n}.log"));
    let addr_file = tmp.path().join("addr");
    let journal = tmp.path().join("j.jsonl");
    let mut kids = Kids(vec![spawn(
        &s3,
        &[
            "control",
            "--listen",
            "127.0.0.1:0",
            "--journal",
            journal.to_str().unwrap(),
            "--addr-file",
            addr_file.to_str().unwrap(),
        ],
        &log("control"),
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

    // Two workers of two layouts, registered before anything is published.
    let worker = |id: &str, layout: &str, port: u16| -> Child {
        spawn(
            &s3,
            &[
                "worker",
                "--control",
                &a,
                "--model",
                md,
                "--layout",
                layout,
                "--id",
                id,
                "--http",
                &format!("127.0.0.1:{port}"),
            ],
            &log(id),
        )
    };
    let (pa, pb, pd) = (free_port(), free_port(), free_port());
    kids.0.push(worker("a", "tp:3", pa));
    kids.0.push(worker("b", "tp:1", pb));
    wait_for(&rt, &c, "workers a and b connected", 120, |s| {
        ["a", "b"]
            .iter()
            .all(|id| s.workers.iter().any(|w| w.worker_id == *id && w.connected))
    });

    // Two trainer ranks publish step-1, then step-2 once step-1 is committed and declared.
    let (ok, out) = mx(
        &s3,
        &[
            "declare",
            "--control",
            &a,
            "--model",
            md,
            "--trainer-layout",
            "fsdp:2",
            "--label",
            "step-1",
        ],
    );
    assert!(ok, "{out}");
    let mut publishers = Kids(
        ["0", "1"]
            .iter()
            .map(|r| {
                spawn(
                    &s3,
                    &[
                        "publish",
                        "--control",
                        &a,
                        "--model",
                        md,
                        "--layout",
                        "fsdp:2",
                        "--rank",
                        r,
                        "--steps",
                        "2",
                    ],
                    &log(&format!("publish{r}")),
                )
            })
            .collect(),
    );
    let ready = |label: &'static str| {
        move |s: &mx_control::FleetStatus| {
            s.versions
                .iter()
                .any(|v| v.label == label && v.version_digest.is_some())
        }
    };
    wait_for(&rt, &c, "step-1 READY", 120, ready("step-1"));
    let refit = |label: &str, workers: &str, golden: &str| {
        mx(
            &s3,
            &[
                "refit",
                "--control",
                &a,
                "--label",
                label,
                "--workers",
                workers,
                "--golden-model",
                md,
                "--golden-version",
                golden,
            ],
        )
    };
    let (ok, out) = refit("step-1", "a,b", "1");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let (ok, out) = mx(
        &s3,
        &[
            "export",
            "--control",
            &a,
            "--label",
            "step-1",
            "--checkpoint",
            md,
            "--to",
            "s3://mx-e2e/run/step-1",
        ],
    );
    assert!(ok, "{out}");

    let (ok, out) = mx(
        &s3,
        &[
            "declare",
            "--control",
            &a,
            "--model",
            md,
            "--trainer-layout",
            "fsdp:2",
            "--label",
            "step-2",
        ],
    );
    assert!(ok, "{out}");
    wait_for(&rt, &c, "step-2 READY", 120, ready("step-2"));
    let (ok, delta) = mx(
        &s3,
        &[
            "export",
            "--control",
            &a,
            "--label",
            "step-2",
            "--checkpoint",
            md,
            "--step",
            "2",
            "--base",
            "step-1",
            "--to",
            "s3://mx-e2e/run/step-2",
            "--json",
        ],
    );
    assert!(ok, "{delta}");
    let (ok, full) = mx(
        &s3,
        &[
            "export",
            "--control",
            &a,
            "--label",
            "step-2",
            "--checkpoint",
            md,
            "--step",
            "2",
            "--to",
            "s3://mx-e2e/run/step-2-full",
            "--json",
        ],
    );
    assert!(ok, "{full}");
    let delta: serde_json::Value = serde_json::from_str(delta.lines().last().unwrap()).unwrap();
    assert_eq!(delta["kind"], "delta");
    let v2 = rt.block_on(c.get_version("step-2")).unwrap();
    assert_eq!(v2.artifacts.len(), 2);
    assert_eq!(
        v2.artifacts[0].base,
        rt.block_on(c.get_version("step-1")).unwrap().version_digest,
        "the delta's lineage names step-1"
    );

    // Every publisher SIGKILLed: nothing can be pulled from a trainer any more.
    drop(
        std::mem::take(&mut publishers.0)
            .into_iter()
            .map(|mut p| {
                p.kill().unwrap();
                p.wait().unwrap()
            })
            .collect::<Vec<_>>(),
    );

    // The delta's first object corrupted (one flipped byte): worker a drops the delta, naming
    // the chunk, and stages from the canonical artifact instead.
    let store = mx_artifact::Store::from_vars(
        &"s3://mx-e2e".parse().unwrap(),
        mx_artifact::StoreOptions::default(),
        s3.vars(),
    )
    .unwrap();
    let os = store.object_store();
    let delta_obj = object_store::path::Path::from("run/step-2/delta-00000.bin");
    let full_manifest = object_store::path::Path::from("run/step-2-full/mx-artifact.json");
    let good = rt
        .block_on(async { os.get(&delta_obj).await?.bytes().await })
        .unwrap();
    let mut bad = good.to_vec();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x10;
    rt.block_on(os.put(&delta_obj, bad.into())).unwrap();
    let (ok, out) = refit("step-2", "a", "2");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let source_of = |id: &str| {
        let st = rt.block_on(c.get_status()).unwrap();
        let w = st
            .workers
            .iter()
            .find(|w| w.worker_id == id)
            .unwrap()
            .clone();
        (w.last_staged.clone().unwrap(), w.admitted)
    };
    assert_eq!(source_of("a").0.source, "artifact_canonical");
    assert!(wait_log(&log("a"), "chunk", 10).contains("blake3"));

    // With the canonical artifact gone too, no source is left: b's refit aborts before anything
    // is applied, naming every source tried; b stays on step-1, its bytes untouched.
    let full_bytes = rt
        .block_on(async { os.get(&full_manifest).await?.bytes().await })
        .unwrap();
    rt.block_on(os.delete(&full_manifest)).unwrap();
    let (ok, out) = refit("step-2", "b", "2");
    assert!(!ok && out.contains("ABORTED"), "{out}");
    let (r, _) = source_of("b");
    assert!(
        !r.ok && r.error.contains("no source could stage step-2"),
        "{r:?}"
    );
    assert!(
        r.error.contains("trainer ranks") && r.error.contains("run/step-2-full"),
        "{r:?}"
    );
    check_live(&format!("http://127.0.0.1:{pb}"), &info, "tp:1", &dir, 1);

    // Both put back: b stages the delta onto its resident step-1.
    rt.block_on(os.put(&delta_obj, good.into())).unwrap();
    rt.block_on(os.put(&full_manifest, full_bytes.into()))
        .unwrap();
    let (ok, out) = refit("step-2", "b", "2");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let st = rt.block_on(c.get_status()).unwrap();
    for id in ["a", "b"] {
        let w = st.workers.iter().find(|w| w.worker_id == id).unwrap();
        assert!(w.admitted, "{id} not admitted: {w:?}");
    }
    let (r, _) = source_of("b");
    assert_eq!(r.source, "artifact_delta", "{r:?}");
    // Only delta ranges were read (the demo's synthetic step changes every element, so they are
    // most of it here; real optimizer steps: examples/delta_vs_full.py).
    let delta_bytes = delta["data_bytes"].as_u64().unwrap();
    assert!(
        r.wire_bytes > 0 && r.wire_bytes <= delta_bytes,
        "b fetched {} bytes, the delta has {delta_bytes}",
        r.wire_bytes
    );
    check_live(&format!("http://127.0.0.1:{pa}"), &info, "tp:3", &dir, 2);
    check_live(&format!("http://127.0.0.1:{pb}"), &info, "tp:1", &dir, 2);

    // A worker joins the running fleet: brought to step-2 from the canonical artifact (it holds
    // nothing a delta applies to), then admitted.
    kids.0.push(worker("d", "tp:3", pd));
    wait_for(&rt, &c, "worker d connected", 120, |s| {
        s.workers.iter().any(|w| w.worker_id == "d" && w.connected)
    });
    let (ok, out) = refit("step-2", "d", "2");
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let st = rt.block_on(c.get_status()).unwrap();
    let d = st.workers.iter().find(|w| w.worker_id == "d").unwrap();
    assert_eq!(d.last_staged.as_ref().unwrap().source, "artifact_canonical");
    assert!(d.admitted, "{d:?}");
    check_live(&format!("http://127.0.0.1:{pd}"), &info, "tp:3", &dir, 2);
    // The fleet kept serving: a and b stayed admitted through d's join.
    for id in ["a", "b"] {
        assert!(
            st.workers
                .iter()
                .find(|w| w.worker_id == id)
                .unwrap()
                .admitted
        );
    }
}
