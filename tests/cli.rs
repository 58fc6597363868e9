//! The `mx` binary's offline commands on the real checkpoint (no NIXL needed).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::PathBuf;
use std::process::Command;

fn smollm() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".mx/models/smollm2-135m");
    if dir.join("config.json").exists() {
        return Some(dir);
    }
    if std::env::var("MX_REQUIRE_NIXL").as_deref() == Ok("1") {
        panic!("{} missing: run scripts/setup.sh", dir.display());
    }
    eprintln!("skipping: {} missing (run scripts/setup.sh)", dir.display());
    None
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let dir = smollm().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(["plan", "--json", "--model", dir.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn strategy_of<'a>(j: &'a serde_json::Value, tensor: &str) -> &'a serde_json::Value {
    &j["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tensor"] == tensor)
        .unwrap()["strategies"]
}

#[test]
fn plan_packs_row_parallel_slices_for_a_single_rank_worker() {
    if smollm().is_none() {
        return;
    }
    // One TP rank of o_proj [576, 576]: 192-column (384 B) runs from each of 576 rows. Exact
    // would be 576 descriptors; the publishers pack them, one descriptor per source.
    let j = plan_json(&["--ranks", "1"]);
    let o = strategy_of(&j, "model.layers.0.self_attn.o_proj.weight");
    assert_eq!(o["packed"], 4, "{o}");
    let q = strategy_of(&j, "model.layers.0.self_attn.q_proj.weight");
    assert!(q.get("exact").is_some(), "{q}");
    assert_eq!(j["useful_bytes"], j["wire_bytes"]);
}

#[test]
fn plan_for_a_worker_holding_every_tp_rank_weighs_descriptors_against_segments() {
    if smollm().is_none() {
        return;
    }
    // FSDP-4 sources, nothing packed: the three TP ranks together need every byte of each
    // shard, so each source is one read.
    let j = plan_json(&["--no-pack"]);
    assert_eq!(j["reads"], 4, "{}", j["reads"]);
    // With packing and the local per-segment cost counted, row-parallel weights come packed
    // (one segment per rank instead of one per row) at the price of a few more descriptors.
    let j = plan_json(&[]);
    assert_eq!(
        strategy_of(&j, "model.layers.0.mlp.down_proj.weight")["packed"],
        4
    );
    assert!(
        j["apply_copies"].as_u64().unwrap() < 5_000,
        "{}",
        j["apply_copies"]
    );
    let j0 = plan_json(&["--per-segment-ns", "0"]);
    assert_eq!(j0["reads"], 4, "free segments: whole rows again");
    // Replicated norms are pulled once and copied to the three ranks.
    assert!(j["useful_bytes"].as_u64().unwrap() > j["wire_bytes"].as_u64().unwrap());
}

#[test]
fn plan_reports_impossible_layouts_by_tensor() {
    let Some(dir) = smollm() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args([
            "plan",
            "--model",
            dir.to_str().unwrap(),
            "--inference-layout",
            "tp:4",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("q_proj") && err.contains("tp=4"), "{err}");
}

#[test]
fn a_journal_of_the_retired_commit_path_is_refused_naming_the_line() {
    // Before refits were the only commit path, `mx commit` journaled `commit` and workers'
    // reports `applied`; such a journal cannot be replayed. Both `mx journal` and `mx control`
    // refuse it, naming the line, instead of rebuilding a state without those commits.
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("j.jsonl");
    std::fs::write(
        &journal,
        concat!(
            r#"{"seq":1,"unix_ms":1,"record":{"op":"stage","label":"v","worker_ids":["w"]}}"#,
            "\n",
            r#"{"seq":2,"unix_ms":2,"record":{"op":"commit","label":"v","worker_ids":["w"]}}"#,
            "\n"
        ),
    )
    .unwrap();
    let control = |unchecked: bool| {
        let mut a = vec![
            "control",
            "--insecure-loopback",
            "--listen",
            "127.0.0.1:0",
            "--journal",
            journal.to_str().unwrap(),
        ];
        if unchecked {
            a.push("--accept-unchecked-journal-lines");
        }
        a
    };
    // A control plane refuses lines without a checksum unless told the journal predates them
    // (issue 29), naming the first line and the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(control(false))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("line 1") && err.contains("--accept-unchecked-journal-lines"),
        "{err}"
    );
    for args in [vec!["journal", journal.to_str().unwrap()], control(true)] {
        let out = Command::new(env!("CARGO_BIN_EXE_mx"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(
            err.contains("line 2") && err.contains("`commit`") && err.contains("retired Commit"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_reader_that_stops_reading_ends_mx_journal_quietly() {
    // Issue 30, item 7: `mx journal FILE | head` panicked ("failed printing to stdout: Broken
    // pipe") with a backtrace. It now ends as `cat` does: SIGPIPE, nothing on stderr.
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("j.jsonl");
    let lines: String = (1..=20_000)
        .map(|i| {
            format!(
                r#"{{"seq":{i},"unix_ms":{i},"record":{{"op":"register","worker_id":"w{i}","instance":"w{i}","ranks":[0],"layout":{{"scheme":"VllmTp","world_size":1}}}}}}"#
            ) + "\n"
        })
        .collect();
    std::fs::write(&journal, lines).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(["journal", journal.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 64];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap(); // then the pipe closes
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("panicked") && !err.contains("Broken pipe"),
        "{err}"
    );
    const SIGPIPE: i32 = 13; // Linux
    assert_eq!(
        out.status.signal(),
        Some(SIGPIPE),
        "{:?}: {err}",
        out.status
    );
    assert!(String::from_utf8_lossy(&first).starts_with(r#"{"seq":1"#));
}

#[test]
fn sighup_reloads_the_token_file_without_a_restart() {
    // Issue 30, item 5: adding a principal needed a control-plane restart.
    use std::io::Read;
    let tmp = tempfile::tempdir().unwrap();
    let (tokens, journal, addr) = (
        tmp.path().join("tokens"),
        tmp.path().join("j.jsonl"),
        tmp.path().join("addr"),
    );
    let (old, new) = (
        "reader-old-0123456789abcdef01234",
        "reader-new-0123456789abcdef01234",
    );
    std::fs::write(&tokens, format!("{old},reader,dash\n")).unwrap();
    let log = std::fs::File::create(tmp.path().join("cp.log")).unwrap();
    let mut cp = Command::new(env!("CARGO_BIN_EXE_mx"))
        .args(["control", "--listen", "127.0.0.1:0", "--journal"])
        .arg(&journal)
        .arg("--tokens")
        .arg(&tokens)
        .arg("--addr-file")
        .arg(&addr)
        .stderr(log)
        .spawn()
        .unwrap();
    let wait_for = |what: &dyn Fn() -> bool| {
        let t0 = std::time::Instant::now();
        while !what() {
            assert!(t0.elapsed().as_secs() < 30, "timed out");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait_for(&|| std::fs::read_to_string(&addr).is_ok_and(|a| !a.is_empty()));
    let url = format!("http://{}", std::fs::read_to_string(&addr).unwrap());
    let status = |token: &str| {
        Command::new(env!("CARGO_BIN_EXE_mx"))
            .args(["status", "--control", &url])
            .env("MX_CONTROL_TOKEN", token)
            .output()
            .unwrap()
            .status
            .code()
    };
    let cp_log = || {
        let mut s = String::new();
        std::fs::File::open(tmp.path().join("cp.log"))
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    let hup = || {
        let ok = Command::new("kill")
            .args(["-HUP", &cp.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    };
    assert_eq!((status(old), status(new)), (Some(0), Some(77)));
    // The new principal replaces the old one.
    std::fs::write(&tokens, format!("{new},reader,dash\n")).unwrap();
    hup();
    wait_for(&|| cp_log().contains("token file reloaded: 1 principals"));
    assert_eq!((status(old), status(new)), (Some(77), Some(0)));
    // A file that does not parse changes nothing.
    std::fs::write(&tokens, "short,reader,dash\n").unwrap();
    hup();
    wait_for(&|| cp_log().contains("the tokens in force stay"));
    assert!(cp_log().contains("line 1"), "{}", cp_log());
    assert_eq!(status(new), Some(0));
    cp.kill().unwrap();
    cp.wait().unwrap();
    let records = std::fs::read_to_string(&journal).unwrap();
    assert_eq!(
        records.matches(r#""op":"tokens_reloaded""#).count(),
        1,
        "{records}"
    );
}
