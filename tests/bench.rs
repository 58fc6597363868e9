//! `mx-lab bench` parts at small scale: each runs real processes and checks what it reports (the
//! disk part also proves that the disk path and mx leave identical live bytes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use serde_json::Value;

/// Runs `mx-lab bench <args> --json <tmp>` and returns the JSON it wrote.
fn bench(args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_mx-lab"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(&json)
        .env("UCX_MODULES", "^efa")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mx bench {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[test]
fn control_bench_commits_every_round_on_a_simulated_fleet() {
    let r = bench(&[
        "control",
        "--workers",
        "120",
        "--procs",
        "2",
        "--rounds",
        "3",
        "--rollback",
    ]);
    assert_eq!(r["workers"], 120);
    // The bench itself checks that the refit with a failing APPLY ended ROLLED_BACK with every
    // worker back on the version it ran before.
    assert!(r["rollback_ms"].as_f64().unwrap() > 0.0);
    let rounds = r["rounds"].as_array().unwrap();
    // The first round is reported apart, as warm-up.
    assert_eq!(rounds.len(), 2);
    assert!(r["warmup"].is_object());
    for x in rounds {
        assert!(x["commit_ms"].as_f64().unwrap() > 0.0);
        // Every worker's pause/apply/read-back/resume intent and result is journaled.
        let per_worker = x["commit_journal_bytes"].as_f64().unwrap() / 120.0;
        assert!(per_worker > 800.0, "{per_worker} journal bytes per worker");
        let phases: Vec<&str> = x["phases_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[0].as_str().unwrap())
            .collect();
        assert_eq!(
            phases,
            ["STAGE", "PREPARE", "APPLY", "VERIFY", "RESUME", "COMMIT"]
        );
    }
    assert!(r["commit_cpu_us_per_worker"].as_f64().unwrap() > 0.0);
    // Every RPC of the round was authenticated, and the control plane's memory is reported.
    assert_eq!(r["auth"], "bearer tokens");
    let (rss, peak) = (
        r["control_rss_mb"].as_f64().unwrap(),
        r["control_peak_rss_mb"].as_f64().unwrap(),
    );
    assert!(rss > 1.0 && peak >= rss, "{rss} {peak}");
}

#[test]
fn disk_bench_leaves_the_same_bytes_as_mx() {
    if common::model("smollm2-135m").is_none() {
        return;
    }
    let r = bench(&["disk", "--reps", "1"]);
    let pairs = r["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 1);
    assert_eq!(pairs[0]["same_bytes"], true);
    assert_eq!(pairs[0]["version"], 2);
    assert!(r["disk_s"].as_f64().unwrap() > 0.0 && r["mx_s"].as_f64().unwrap() > 0.0);
    let want = r["disk_s"].as_f64().unwrap() / r["mx_s"].as_f64().unwrap();
    assert!((r["refit_vs_disk_speedup"].as_f64().unwrap() - want).abs() < 1e-9);
    // The whole SmolLM2 checkpoint (bf16) was written by the disk path.
    assert!(r["checkpoint_bytes"].as_u64().unwrap() > 250_000_000);
}

#[test]
fn pull_bench_reports_layout_and_identity_against_memcpy() {
    if common::model("smollm2-135m").is_none() {
        return;
    }
    let r = bench(&["pull", "--quick", "--reps", "1"]);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0]["layout"], "fsdp:4 -> tp:3");
    assert_eq!(rows[1]["layout"], "fsdp:4 -> fsdp:4");
    for row in rows {
        assert!(row["descriptors"].as_u64().unwrap() > 0);
        assert!(row["pull_gbps"].as_f64().unwrap() > 0.0);
        assert!(row["memcpy_gbps"].as_f64().unwrap() > 0.0);
    }
    // The identity layout moves exactly the checkpoint's bytes, no more.
    assert_eq!(rows[1]["useful_bytes"], rows[1]["wire_bytes"]);
    assert_eq!(r["pull_vs_memcpy"], rows[0]["ratio"]);
}

/// Runs `mx-lab bench control` on 30 workers for two rounds with `flags`; the engine calls its
/// journal holds, by action.
fn journaled_calls(flags: &[&str]) -> std::collections::BTreeMap<String, usize> {
    let mut args = vec![
        "control",
        "--workers",
        "30",
        "--procs",
        "1",
        "--rounds",
        "2",
        "--keep",
    ];
    args.extend_from_slice(flags);
    let r = bench(&args);
    assert_eq!(r["orchestrator_gated"], true);
    let journal = std::path::PathBuf::from(r["journal_path"].as_str().unwrap());
    let records = mx_control::journal::read_records(&journal).unwrap();
    std::fs::remove_dir_all(journal.parent().unwrap()).unwrap();
    let mut calls = std::collections::BTreeMap::<String, usize>::new();
    for e in &records {
        let v = serde_json::to_value(&e.record).unwrap();
        // Intents are journaled in batches, one record per action.
        if v["op"] == "worker_calls" {
            *calls
                .entry(v["action"]["call"].as_str().unwrap().to_string())
                .or_default() += v["worker_ids"].as_array().unwrap().len();
        }
    }
    calls
}

#[test]
fn orchestrator_gated_commit_makes_no_pause_or_resume_calls() {
    let calls = journaled_calls(&["--orchestrator-gated"]);
    // Two refits of 30 workers: an apply and a read-back each, nothing else.
    assert_eq!(calls.get("apply"), Some(&60), "{calls:?}");
    assert_eq!(calls.get("read_version"), Some(&60), "{calls:?}");
    assert_eq!(calls.len(), 2, "{calls:?}");
    // With the versions taken from the APPLY answers, the applies are the only calls.
    let calls = journaled_calls(&["--orchestrator-gated", "--verify-from-apply-answer"]);
    assert_eq!(calls.get("apply"), Some(&60), "{calls:?}");
    assert_eq!(calls.len(), 1, "{calls:?}");
}

#[test]
fn sources_bench_stages_one_rank_from_each_source() {
    if common::model("smollm2-135m").is_none() || mx_harness::s3::moto_binary().is_none() {
        assert!(
            std::env::var("MX_REQUIRE_NIXL").as_deref() != Ok("1"),
            "the model or moto_server is missing (run scripts/setup.sh)"
        );
        return;
    }
    let r = bench(&["sources", "--reps", "1"]);
    let row = |s: &str| r[s].clone();
    let useful = row("trainer")["useful_bytes"].as_u64().unwrap();
    assert!(useful > 0);
    for s in ["trainer", "peer", "artifact_canonical", "artifact_delta"] {
        // The same rank staged the same version (the bench checks each stage's source).
        assert_eq!(row(s)["useful_bytes"].as_u64(), Some(useful), "{s}");
        assert!(row(s)["stage_s"].as_f64().unwrap() > 0.0, "{s}");
        assert!(row(s)["wire_bytes"].as_u64().unwrap() > 0, "{s}");
    }
    // Trainer ranks and the peer serve exactly the rank's bytes over NIXL.
    assert_eq!(row("trainer")["wire_bytes"].as_u64(), Some(useful));
    assert_eq!(row("peer")["wire_bytes"].as_u64(), Some(useful));
    // The canonical artifact's ranged reads cover at least the rank's bytes; the delta of a
    // 0.5% step is a small fraction of them.
    assert!(row("artifact_canonical")["wire_bytes"].as_u64().unwrap() >= useful);
    let delta = row("artifact_delta")["wire_bytes"].as_u64().unwrap();
    assert!(delta * 10 < useful, "delta read {delta} of {useful} bytes");
    let changed = r["changed_elements"].as_f64().unwrap();
    assert!((0.004..0.006).contains(&changed), "{changed}");
}
