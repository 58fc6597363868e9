//! End-to-end: the real `mx-lab demo` (control plane, publishers and workers as separate processes,
//! NIXL READs over UCX shared memory) on real checkpoints, with the live bytes checked here too.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::Path;
use std::process::Command;

mod common;

use common::{model, repo, Kids};
use mx_checkpoint::Checkpoint;
use mx_layout::Digest;

fn demo(args: &[&str], report: &Path) -> (bool, String, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_mx-lab"))
        .arg("demo")
        .args(args)
        .arg("--report")
        .arg(report)
        .output()
        .expect("running mx demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let json = std::fs::read_to_string(report)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    (out.status.success(), text, json)
}

/// Rows `[a, b)` of a 2-D tensor's bytes.
fn rows(data: &[u8], shape: &[u64], a: u64, b: u64, es: u64) -> Vec<u8> {
    let row = (shape[1] * es) as usize;
    data[a as usize * row..b as usize * row].to_vec()
}

#[test]
fn demo_refits_smollm2_fsdp4_to_two_tp3_instances() {
    let Some(dir) = model("smollm2-135m") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("r.json");
    let (ok, text, j) = demo(&["--runs", "1"], &report);
    assert!(ok, "mx-lab demo failed:\n{text}");
    assert_eq!(j["all_verified"], true, "{text}");
    assert_eq!(
        j["model_dir"].as_str().unwrap(),
        dir.canonicalize().unwrap().to_str().unwrap()
    );
    let digests = j["version_digests"].as_array().unwrap();
    assert_eq!(digests.len(), 2);
    assert_ne!(
        digests[0], digests[1],
        "the training step must change the version digest"
    );
    assert!(j["pull_gbps"].as_f64().unwrap() > 0.0 && j["memcpy_gbps"].as_f64().unwrap() > 0.0);
    let workers = j["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2);

    // Our own check of one fused parameter of version 2 on rank 1: vLLM qkv_proj =
    // [q heads 3..6; kv head 1 of k; kv head 1 of v] (9 heads, 3 kv heads, head_dim 64, tp=3).
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut expect = Vec::new();
    for (t, a, b) in [
        ("q_proj", 192, 384),
        ("k_proj", 64, 128),
        ("v_proj", 64, 128),
    ] {
        let v = ckpt
            .tensor(&format!("model.layers.7.self_attn.{t}.weight"))
            .unwrap();
        let mut part = rows(v.data, &v.shape, a, b, 2);
        mx_layout::update::training_step(v.dtype, &mut part, 2);
        expect.extend(part);
    }
    let want = Digest::of(&expect).to_string();
    for w in workers {
        assert_eq!(w["verified"], true);
        let ranks = w["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 3);
        let r1 = ranks.iter().find(|r| r["rank"] == 1).unwrap();
        assert_eq!(
            r1["tensors"]["model.layers.7.self_attn.qkv_proj.weight"]
                .as_str()
                .unwrap(),
            want
        );
        // per layer: qkv_proj, o_proj, gate_up_proj, down_proj and two norms; plus embed_tokens and norm.
        assert_eq!(r1["tensors"].as_object().unwrap().len(), 30 * 6 + 2);
    }
}

#[test]
fn demo_on_bert_minilm_f32_fsdp3_to_tp2_one_process_per_rank() {
    let Some(_) = model("minilm-l6") else { return };
    let dir = repo().join(".mx/models/minilm-l6");
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("r.json");
    let (ok, text, j) = demo(
        &[
            "--model",
            dir.to_str().unwrap(),
            "--trainer-layout",
            "fsdp:3",
            "--inference-layout",
            "tp:2",
            "--workers",
            "1",
            "--process-per-rank",
            "--runs",
            "1",
        ],
        &report,
    );
    assert!(ok, "mx-lab demo on MiniLM failed:\n{text}");
    assert_eq!(j["all_verified"], true, "{text}");
    // Our own check: the fused qkv bias of layer 0 on rank 0 of version 2 (F32, 12 heads of 32).
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut expect = Vec::new();
    for t in ["query", "key", "value"] {
        let v = ckpt
            .tensor(&format!("encoder.layer.0.attention.self.{t}.bias"))
            .unwrap();
        let mut part = v.data[..192 * 4].to_vec();
        mx_layout::update::training_step(v.dtype, &mut part, 2);
        expect.extend(part);
    }
    let r0 = &j["workers"][0]["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rank"] == 0)
        .unwrap()["tensors"];
    assert_eq!(
        r0["encoder.layer.0.attention.self.qkv_proj.bias"]
            .as_str()
            .unwrap(),
        Digest::of(&expect).to_string()
    );
}

#[test]
fn demo_refuses_tp2_over_nine_heads_before_starting_anything() {
    let Some(_) = model("smollm2-135m") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (ok, text, _) = demo(&["--inference-layout", "tp:2"], &tmp.path().join("r.json"));
    assert!(!ok);
    assert!(
        text.contains("9 attention heads are not divisible by tp=2"),
        "{text}"
    );
    assert!(text.contains("q_proj"), "{text}");
}

fn mx(args: &[&str]) -> (bool, String) {
    let out = Command::new(common::exe(args)).args(args).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn spawn(args: &[&str]) -> std::process::Child {
    Command::new(common::exe(args))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Starts `mx control` on an ephemeral port with its journal in `dir`; returns it and its URL.
fn start_control(dir: &Path) -> (Kids, String) {
    let addr_file = dir.join("addr");
    let journal = dir.join("j.jsonl");
    let kids = Kids(vec![spawn(&[
        "control",
        "--insecure-loopback",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        journal.to_str().unwrap(),
        "--addr-file",
        addr_file.to_str().unwrap(),
    ])]);
    let t = std::time::Instant::now();
    while !addr_file.exists() {
        assert!(t.elapsed().as_secs() < 30, "control plane did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let a = format!("http://{}", std::fs::read_to_string(&addr_file).unwrap());
    (kids, a)
}

/// Polls `mx status --json` until `pred` holds of it (`what` names the wait in the failure).
fn wait_status(a: &str, what: &str, secs: u64, pred: impl Fn(&serde_json::Value) -> bool) {
    let t = std::time::Instant::now();
    loop {
        let (_, s) = mx(&["status", "--control", a, "--json"]);
        let j: serde_json::Value = serde_json::from_str(&s).unwrap_or_default();
        if pred(&j) {
            return;
        }
        assert!(
            t.elapsed().as_secs() < secs,
            "status never showed {what}: {s}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The status's workers (none when absent).
fn workers(j: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    j["workers"].as_array().into_iter().flatten()
}

/// Whether a version of the status is READY.
fn any_ready(j: &serde_json::Value) -> bool {
    j["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| v["state"] == "Ready")
}

#[test]
fn a_flipped_byte_in_a_source_fails_the_stage_and_the_worker_is_not_admitted() {
    let Some(dir) = model("smollm2-135m") else {
        return;
    };
    let md = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (mut kids, a) = start_control(tmp.path());
    kids.0.push(spawn(&[
        "worker",
        "--control",
        &a,
        "--model",
        md,
        "--layout",
        "tp:3",
        "--id",
        "w",
    ]));
    wait_status(&a, "worker w", 60, |j| {
        workers(j).any(|w| w["worker_id"] == "w")
    });
    let (ok, out) = mx(&[
        "declare",
        "--control",
        &a,
        "--model",
        md,
        "--trainer-layout",
        "fsdp:2",
        "--label",
        "step-1",
    ]);
    assert!(ok, "{out}");
    kids.0.push(spawn(&[
        "publish",
        "--control",
        &a,
        "--model",
        md,
        "--layout",
        "fsdp:2",
        "--rank",
        "0",
    ]));
    // Source slot 1 flips one byte of its embedding shard right after publishing its digests.
    kids.0.push(spawn(&[
        "publish",
        "--control",
        &a,
        "--model",
        md,
        "--layout",
        "fsdp:2",
        "--rank",
        "1",
        "--fault-flip-byte",
        "model.embed_tokens.weight",
    ]));
    wait_status(&a, "a READY version", 120, any_ready);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (ok, out) = mx(&[
        "stage",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w",
    ]);
    assert!(!ok, "a corrupted source must fail the stage: {out}");
    assert!(
        out.contains("verification failed")
            && out.contains("model.embed_tokens.weight")
            && out.contains("slot 1"),
        "{out}"
    );
    // Not admitted: commit is refused naming the worker, and nothing is resident.
    let (ok, out) = mx(&[
        "commit",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w",
    ]);
    assert!(
        !ok && out.contains("\"w\"")
            && out.contains("FAILED")
            && out.contains("verification failed"),
        "{out}"
    );
    let (_, s) = mx(&["status", "--control", &a]);
    assert!(
        s.contains("FAILED")
            && s.contains("GATED (no_weights)")
            && s.contains("no weights resident: `mx refit --label LABEL --workers"),
        "{s}"
    );
}

#[test]
fn individual_commands_complete_a_refit_by_hand() {
    let Some(dir) = model("smollm2-135m") else {
        return;
    };
    let md = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("j.jsonl");
    let (mut kids, a) = start_control(tmp.path());
    // Regression: a stale registration of a layout this model cannot take (a MiniLM worker at
    // tp:2, then replaced) must not block the SmolLM publishers.
    if let Some(minilm) = model("minilm-l6") {
        let ml = minilm.to_str().unwrap();
        let stale_args = [
            "worker",
            "--control",
            &a,
            "--model",
            ml,
            "--layout",
            "tp:2",
            "--id",
            "stale",
        ];
        let mut stale = spawn(&stale_args);
        let t = std::time::Instant::now();
        while !mx(&["status", "--control", &a]).1.contains("stale") {
            assert!(t.elapsed().as_secs() < 60, "stale worker did not register");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        // Regression (issue 13): a second worker under the live id used to take it over; it
        // is refused and exits with the documented status 3, and the first one keeps it.
        let second = Command::new(common::exe(&stale_args))
            .args(stale_args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&second.stderr);
        assert_eq!(second.status.code(), Some(3), "{err}");
        assert!(err.contains("held by another process"), "{err}");
        assert_eq!(
            stale.try_wait().unwrap(),
            None,
            "the live worker must keep its id"
        );
        // The stale registration stays once its process is gone.
        let _ = stale.kill();
        let _ = stale.wait();
    }
    // One worker holding only TP rank 1 (one process per rank), registered before publishing.
    kids.0.push(spawn(&[
        "worker",
        "--control",
        &a,
        "--model",
        md,
        "--layout",
        "tp:3",
        "--ranks",
        "1",
        "--id",
        "w1",
    ]));
    let t = std::time::Instant::now();
    loop {
        let (_, s) = mx(&["status", "--control", &a]);
        if s.contains("w1") {
            break;
        }
        assert!(t.elapsed().as_secs() < 60, "worker did not register: {s}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let (ok, out) = mx(&[
        "declare",
        "--control",
        &a,
        "--model",
        md,
        "--trainer-layout",
        "fsdp:2",
        "--label",
        "step-1",
    ]);
    assert!(ok, "{out}");
    for r in ["0", "1"] {
        kids.0.push(spawn(&[
            "publish",
            "--control",
            &a,
            "--model",
            md,
            "--layout",
            "fsdp:2",
            "--rank",
            r,
        ]));
    }
    let t = std::time::Instant::now();
    loop {
        let (_, s) = mx(&["status", "--control", &a]);
        if s.contains("READY") {
            break;
        }
        assert!(t.elapsed().as_secs() < 120, "version never READY: {s}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Commit before staging is refused, naming the worker.
    let (ok, out) = mx(&[
        "commit",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w1",
    ]);
    assert!(!ok && out.contains("w1"), "{out}");
    let (ok, out) = mx(&[
        "stage",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w1",
    ]);
    assert!(ok && out.contains("STAGED"), "{out}");
    let (ok, out) = mx(&[
        "commit",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w1",
    ]);
    assert!(ok && out.contains("COMMITTED"), "{out}");
    // The commit was a refit: the rank-1 worker cannot generate, so no CHECK phase.
    assert!(
        out.contains("phases: STAGE -> PREPARE -> APPLY -> VERIFY -> RESUME -> COMMIT"),
        "{out}"
    );
    let digest = committed_digest(&out);
    let (_, s) = mx(&["status", "--control", &a, "--json"]);
    let j: serde_json::Value = serde_json::from_str(&s).unwrap();
    let w1 = workers(&j).find(|w| w["worker_id"] == "w1").unwrap();
    assert_eq!(w1["resident_version"], digest.as_str(), "{s}");
    assert_eq!(w1["resident_label"], "step-1", "{s}");
    assert_eq!(w1["admitted"], true, "{s}");
    assert!(w1["gate"].is_null(), "{s}");
    let (_, s) = mx(&["status", "--control", &a]);
    assert!(
        s.lines()
            .any(|l| l.starts_with("w1 ") && l.contains(" step-1 ") && l.ends_with(" admitted")),
        "{s}"
    );
    // The journal has every mutating call: declare, 2 publishes, stage, staged, then the refit
    // (its own stage, and each engine call's intent and result), and no record of the retired
    // Commit / ReportApplied path.
    let (ok, j) = mx(&["journal", journal.to_str().unwrap()]);
    assert!(ok);
    let ops: Vec<String> = j
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["record"]["op"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let ops: Vec<&str> = ops
        .iter()
        .map(String::as_str)
        .filter(|o| *o != "register")
        .collect();
    // `mx commit` after `mx stage`: the refit does not pull again (the worker is STAGED for it),
    // it goes straight to PREPARE.
    assert_eq!(
        ops[..7],
        [
            "declare",
            "publish",
            "publish",
            "stage",
            "staged",
            "refit_begin",
            "refit_phase"
        ],
        "{j}"
    );
    assert_eq!(ops.iter().filter(|o| **o == "stage").count(), 1, "{j}");
    // Regression (issue 28): the refit ends the journal but for the worker's offer of its new
    // version as a peer, which it sends on its own once it saw the commit: it may be journaled
    // before or after `refit_end`, and only it may follow.
    let end = ops.iter().position(|o| *o == "refit_end");
    let end = end.unwrap_or_else(|| panic!("no refit_end: {j}"));
    assert!(ops[end + 1..].iter().all(|o| *o == "peer"), "{j}");
    let ops: Vec<&str> = ops.into_iter().filter(|o| *o != "peer").collect();
    assert_eq!(ops.last(), Some(&"refit_end"), "{j}");
    // One worker: each batch of intents (results) names it alone.
    let calls = ops.iter().filter(|o| **o == "worker_calls").count();
    let done = ops.iter().filter(|o| **o == "worker_results").count();
    assert_eq!(
        (calls, done),
        (4, 4),
        "pause, apply, read_version, resume: {j}"
    );
    assert!(
        !ops.iter().any(|o| *o == "commit" || *o == "applied"),
        "{j}"
    );
}

/// Spawns `mx ARGS` with its stderr in `log`.
fn spawn_logged(args: &[&str], log: &Path) -> std::process::Child {
    Command::new(common::exe(args))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until `log` has a line containing `needle`; returns that line.
fn wait_log(log: &Path, needle: &str, secs: u64) -> String {
    let t = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(needle)) {
            return l.to_string();
        }
        assert!(
            t.elapsed().as_secs() < secs,
            "{} never said {needle:?}:\n{text}",
            log.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// One HTTP/1.1 POST of a JSON `body` to `url` (`http://host:port/path`): (status, body), or
/// `None` when nothing listens there.
fn http_post(url: &str, body: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(host).ok()?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|x| x.1.to_string())?;
    Some((code, body))
}

/// Starts `mx control` on `listen` with `journal` (a restart on the same address).
fn control_at(journal: &Path, listen: &str) -> std::process::Child {
    let c = spawn(&[
        "control",
        "--insecure-loopback",
        "--listen",
        listen,
        "--journal",
        journal.to_str().unwrap(),
    ]);
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(listen).is_err() {
        assert!(
            t.elapsed().as_secs() < 30,
            "control plane did not come back"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    c
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Regression (issue 13): a worker that could not reach the control plane for 60 s exited and
/// inference stopped with it; a publisher exited when its version did not commit within
/// `--wait-s`, even with `--stay`; a registration under a connected worker's id took it over,
/// the old process did not exit and the refit "committed" on the wrong engine.
#[test]
fn nothing_stops_serving_while_the_control_plane_is_away_and_a_live_worker_keeps_its_id() {
    let Some(dir) = model("smollm2-135m") else {
        return;
    };
    let md = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("j.jsonl");
    let (mut cp, a) = start_control(tmp.path());
    let listen = a.trim_start_matches("http://").to_string();
    let wlog = tmp.path().join("w.log");
    let worker = |load: bool| {
        let mut v = vec![
            "worker",
            "--control",
            &a,
            "--model",
            md,
            "--layout",
            "tp:3",
            "--id",
            "w",
        ];
        if load {
            v.extend(["--load", md, "--load-version", "boot"]);
        }
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let args = worker(true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut kids = Kids(vec![spawn_logged(&args, &wlog)]);
    let line = wait_log(&wlog, "serving the engine routes at", 120);
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .to_string();
    wait_status(&a, "resident boot", 60, |j| {
        workers(j).any(|w| w["resident_id"] == "boot")
    });
    let (ok, out) = mx(&[
        "declare",
        "--control",
        &a,
        "--model",
        md,
        "--trainer-layout",
        "fsdp:2",
        "--label",
        "step-1",
    ]);
    assert!(ok, "{out}");
    for r in ["0", "1"] {
        kids.0.push(spawn_logged(
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
                "--wait-s",
                "1",
                "--stay",
            ],
            &tmp.path().join(format!("p{r}.log")),
        ));
    }
    wait_status(&a, "a READY version", 120, any_ready);
    // Past --wait-s nothing committed: the publishers warn and keep serving.
    wait_log(&tmp.path().join("p0.log"), "still waiting", 30);
    let alive = |kids: &mut Kids, i: usize| kids.0[i].try_wait().unwrap().is_none();
    assert!(
        alive(&mut kids, 1) && alive(&mut kids, 2),
        "a publisher exited"
    );

    // The control plane dies; for 4 s the worker answers its version and generates, and
    // nobody exits.
    let _ = cp.0[0].kill();
    let _ = cp.0[0].wait();
    let version = format!("{url}/engine/get_weight_version");
    let t = std::time::Instant::now();
    while t.elapsed().as_secs() < 4 {
        let (code, v) = http_post(&version, "{}").unwrap();
        assert_eq!(code, 200, "{v}");
        assert!(v.contains("\"boot\""), "{v}");
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let gen = r#"{"input_ids":[504,3575,282,4649,314],"sampling_params":{"max_new_tokens":2,"temperature":0}}"#;
    let (code, v) = http_post(&format!("{url}/generate"), gen).unwrap();
    assert_eq!(code, 200, "{v}");
    assert!(v.contains("[7042,30]"), "{v}");
    for i in 0..3 {
        assert!(
            alive(&mut kids, i),
            "process {i} exited with the control plane"
        );
    }

    // Back on the same address and journal: the worker re-registers with its resident version.
    cp.0[0] = control_at(&journal, &listen);
    wait_status(&a, "connected, IDLE, resident boot", 30, |j| {
        workers(j)
            .any(|w| w["connected"] == true && w["state"] == "Idle" && w["resident_id"] == "boot")
    });

    // A second process under the live id is refused (status 3) and the id keeps its engine:
    // the refit lands on the original worker, pulling from publishers past their --wait-s.
    let second = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(worker(false))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(3), "{err}");
    assert!(err.contains("\"w\" is held by another process"), "{err}");
    assert!(alive(&mut kids, 0));
    let (ok, out) = mx(&[
        "stage",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = mx(&[
        "commit",
        "--control",
        &a,
        "--label",
        "step-1",
        "--workers",
        "w",
    ]);
    assert!(ok && out.contains("COMMITTED"), "{out}");
    let digest = committed_digest(&out);
    let (code, v) = http_post(&version, "{}").unwrap();
    assert_eq!(code, 200);
    assert!(
        v.contains(&format!("mx:{digest}")),
        "the refit went elsewhere: {v}"
    );

    // The worker is frozen while the control plane restarts and a new process takes the id
    // (its stream is gone). Thawed, the old one learns it was displaced and exits with 3.
    signal(&kids.0[0], "-STOP");
    let _ = cp.0[0].kill();
    let _ = cp.0[0].wait();
    cp.0[0] = control_at(&journal, &listen);
    let args = worker(false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    kids.0.push(spawn_logged(&args, &tmp.path().join("w2.log")));
    wait_status(&a, "connected, IDLE, nothing resident", 60, |j| {
        workers(j)
            .any(|w| w["connected"] == true && w["state"] == "Idle" && w["resident_id"].is_null())
    });
    signal(&kids.0[0], "-CONT");
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(s) = kids.0[0].try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed().as_secs() < 30,
            "the displaced worker kept running"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(3));
    wait_log(&wlog, "was displaced", 5);
    assert!(
        http_post(&version, "{}").is_none(),
        "the displaced engine still answers"
    );
    assert!(alive(&mut kids, 3), "the new worker must keep the id");
}

/// The version digest `mx commit` printed on its `<label> COMMITTED on ...: version <hex>` line.
fn committed_digest(out: &str) -> String {
    out.lines()
        .find(|l| l.contains(" COMMITTED on "))
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or_else(|| panic!("no COMMITTED line: {out}"))
        .to_string()
}

/// The demo's independent reference slicing (`mx_harness::slice`, none of the planner's code):
/// a 2-D box of a row-major tensor, row by row.
#[test]
fn the_reference_slicing_takes_a_2d_box_row_by_row() {
    // A 3x4 matrix of u8 0..12; rows 1..3, columns 1..3.
    let full: Vec<u8> = (0..12).collect();
    let region = mx_layout::TensorBox {
        global_offset: vec![1, 1],
        local_shape: vec![2, 2],
    };
    let mut out = Vec::new();
    mx_harness::slice::slice_into(&full, &[3, 4], &region, 1, &mut out);
    assert_eq!(out, vec![5, 6, 9, 10]);
}
