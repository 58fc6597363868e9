//! End-to-end: the real `mx demo` (control plane, publishers and workers as separate processes,
//! NIXL READs over UCX shared memory) on real checkpoints, with the live bytes checked here too.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::Path;
use std::process::Command;

mod common;

use common::{model, repo};
use mx_checkpoint::Checkpoint;
use mx_layout::Digest;

fn demo(args: &[&str], report: &Path) -> (bool, String, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
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
    assert!(ok, "mx demo failed:\n{text}");
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
    assert!(ok, "mx demo on MiniLM failed:\n{text}");
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

/// Kills child processes when dropped.
struct Kids(Vec<std::process::Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn mx(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(args)
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

fn spawn(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_mx"))
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

/// Polls `mx status` until its output contains `needle`.
fn wait_status(a: &str, needle: &str, secs: u64) {
    let t = std::time::Instant::now();
    loop {
        let (_, s) = mx(&["status", "--control", a]);
        if s.contains(needle) {
            return;
        }
        assert!(
            t.elapsed().as_secs() < secs,
            "status never showed {needle:?}: {s}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
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
    wait_status(&a, "worker  w ", 60);
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
    wait_status(&a, "Ready", 120);
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
        s.contains("Failed") && s.contains("gated (no weights resident)"),
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
        // Regression: a second worker with the same id replaces the first, which must exit
        // non-zero (it used to exit 0 silently).
        kids.0.push(spawn(&stale_args));
        let status = stale.wait().unwrap();
        assert!(!status.success(), "a replaced worker must not exit 0");
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
        if s.contains("Ready") {
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
    let digest = out.split_whitespace().last().unwrap().to_string();
    let (_, s) = mx(&["status", "--control", &a]);
    assert!(s.contains(&format!("resident {digest} admitted")), "{s}");
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
    assert_eq!(ops.last(), Some(&"refit_end"), "{j}");
    let calls = ops.iter().filter(|o| **o == "worker_call").count();
    let done = ops.iter().filter(|o| **o == "worker_done").count();
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
