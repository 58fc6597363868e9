//! The fuzz targets' stored corpus as a regression test: every input under `fuzz/corpus/<target>/`
//! (and `fuzz/seeds/<target>/` where it exists) goes through the same check the fuzz target runs
//! (`fuzz/checks/<target>.rs`), compiled with the rest of the test suite (no sanitizer build, no
//! cargo-fuzz). A check that panics fails the test naming the input file. New inputs come from
//! the long runs of `scripts/fuzz.sh` (`MX_FUZZ_MERGE=1` keeps those that add coverage).
//!
//! Built with the test profile's settings (release in `scripts/test.sh`: no overflow checks), so
//! an arithmetic overflow that only a debug-assertion build turns into a panic is found by
//! `scripts/fuzz.sh`, not here.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // tests: panics are failures

use std::path::{Path, PathBuf};

// The checks, shared with the fuzz targets (which use them as modules of their own).
#[path = "../fuzz/checks/config_json.rs"]
mod config_json;
#[path = "../fuzz/checks/journal_replay.rs"]
mod journal_replay;
#[path = "../fuzz/checks/manifest.rs"]
mod manifest;
#[path = "../fuzz/checks/safetensors_header.rs"]
mod safetensors_header;
#[path = "../fuzz/checks/safetensors_index.rs"]
mod safetensors_index;
#[path = "../fuzz/checks/wire.rs"]
mod wire;

/// Every stored input of `target` (corpus and seeds), sorted.
fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut out = Vec::new();
    for dir in [
        root.join("corpus").join(target),
        root.join("seeds").join(target),
    ] {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Runs `check` over every stored input of `target`; fails naming each input that panicked.
fn replay(target: &str, check: fn(&[u8])) {
    let files = inputs(target);
    assert!(
        !files.is_empty(),
        "no stored inputs for the fuzz target {target} under fuzz/corpus or fuzz/seeds"
    );
    // The panics are the result: keep their messages out of the log until the summary.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut failed = Vec::new();
    for f in &files {
        let data = std::fs::read(f).unwrap();
        if let Err(e) = std::panic::catch_unwind(|| check(&data)) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            failed.push(format!("{}: {msg}", f.display()));
        }
    }
    std::panic::set_hook(hook);
    assert!(
        failed.is_empty(),
        "{target}: {} of {} stored inputs fail their check:\n{}",
        failed.len(),
        files.len(),
        failed.join("\n")
    );
    eprintln!("{target}: {} stored inputs pass", files.len());
}

// One test per target; they run in one process, so the panic hook is swapped under a lock.
static HOOK: std::sync::Mutex<()> = std::sync::Mutex::new(());

macro_rules! corpus_test {
    ($name:ident) => {
        #[test]
        fn $name() {
            let _g = HOOK.lock().unwrap_or_else(|e| e.into_inner());
            replay(stringify!($name), $name::check);
        }
    };
}

corpus_test!(safetensors_header);
corpus_test!(safetensors_index);
corpus_test!(config_json);
corpus_test!(manifest);
corpus_test!(wire);
corpus_test!(journal_replay);

/// A check that panics is reported naming the input (the replay itself can fail).
#[test]
fn a_failing_input_is_named() {
    let _g = HOOK.lock().unwrap_or_else(|e| e.into_inner());
    let r = std::panic::catch_unwind(|| {
        replay("wire", |d| assert!(d.len() > usize::MAX - 1, "too short"));
    });
    let msg = *r.unwrap_err().downcast::<String>().unwrap();
    assert!(msg.contains("fuzz/corpus/wire/"), "{msg}");
    assert!(msg.contains("too short"), "{msg}");
}
