//! Journal bytes -> mx_control::journal::parse_records (checksums, sequence, strict JSON) ->
//! replay into a fresh state machine, as the control plane does when it starts. Accepted entries
//! written back one per line parse to the same entries, and replaying them again gives the
//! same fleet status.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mx_control::journal::{parse_records, replay};

fuzz_target!(|data: &[u8]| {
    let path = Path::new("journal.jsonl");
    let Ok(entries) = parse_records(path, data) else {
        return;
    };
    let mut text = Vec::new();
    for e in &entries {
        serde_json::to_writer(&mut text, e).expect("an entry serializes");
        text.push(b'\n');
    }
    let back = parse_records(path, &text).expect("entries written back parse");
    assert_eq!(back, entries);
    let first = replay(path, entries.clone()).map(|s| s.fleet_status());
    let second = replay(path, back).map(|s| s.fleet_status());
    match (first, second) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("replay differs: {a:?} / {b:?}"),
    }
});
