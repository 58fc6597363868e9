//! Journal bytes -> mx_control::journal::parse_records (checksums, sequence, strict JSON) ->
//! replay into a fresh state machine, as the control plane does when it starts. Accepted entries
//! written back one per line parse to the same entries, and replaying them again gives the
//! same fleet status.
//!
//! Snapshots too: input starting with `S` is a snapshot file (its first line, decoded by
//! mx_control::snapshot::decode: checksum, strict JSON) followed by the journal after it. An
//! accepted snapshot encoded again decodes to the same state, and the journal replays onto it
//! alike from the bytes and from the entries written back.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/journal_replay.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use std::path::Path;

use mx_control::journal::{parse_records, parse_records_after, replay, Loaded};
use mx_control::snapshot;

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let path = Path::new("journal.jsonl");
    if let Some(rest) = data.strip_prefix(b"S") {
        snapshot_then_journal(path, rest);
        return;
    }
    let Ok(entries) = parse_records(path, data) else {
        return;
    };
    let back = parse_records(path, &written_back(&entries)).expect("entries written back parse");
    assert_eq!(back, entries);
    let first = replay(path, entries.clone()).map(|s| s.fleet_status());
    let second = replay(path, back).map(|s| s.fleet_status());
    same(first, second);
}

fn written_back(entries: &[mx_control::journal::Entry]) -> Vec<u8> {
    let mut text = Vec::new();
    for e in entries {
        serde_json::to_writer(&mut text, e).expect("an entry serializes");
        text.push(b'\n');
    }
    text
}

fn same<T: PartialEq + std::fmt::Debug>(
    first: Result<T, mx_control::Error>,
    second: Result<T, mx_control::Error>,
) {
    match (first, second) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("replay differs: {a:?} / {b:?}"),
    }
}

fn snapshot_then_journal(path: &Path, data: &[u8]) {
    let split = data
        .iter()
        .position(|&b| b == b'\n')
        .map_or(data.len(), |i| i + 1);
    let (snap_bytes, journal) = data.split_at(split);
    let Ok(snap) = snapshot::decode(Path::new("journal.jsonl.snapshot"), snap_bytes) else {
        return;
    };
    let again = snapshot::encode(path, snap.seq, snap.unix_ms, &snap.state).expect("encodes");
    let back = snapshot::decode(path, &again).expect("a snapshot encoded again decodes");
    assert_eq!(back.state, snap.state);
    assert_eq!((back.seq, back.unix_ms), (snap.seq, snap.unix_ms));
    let Ok(entries) = parse_records_after(path, journal, snap.seq) else {
        return;
    };
    let replayed = |entries| {
        Loaded {
            snapshot: Some(snap.clone()),
            entries,
            skipped: 0,
        }
        .replay(path)
        .map(|s| s.fleet_status())
    };
    let text = written_back(&entries);
    let back = parse_records_after(path, &text, snap.seq).expect("entries written back parse");
    assert_eq!(back, entries);
    same(replayed(entries), replayed(back));
}
