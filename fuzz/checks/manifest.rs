//! A source manifest as JSON (as journal records hold it, parsed strictly) -> SourceManifest;
//! an accepted one round-trips through JSON, and through its wire message when the control
//! plane's checks accept it.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/manifest.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use mx_control::wire::{manifest_from_wire, manifest_to_wire};
use mx_layout::{strict_json, SourceManifest};

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let Ok(m) = strict_json::from_slice::<SourceManifest>(data) else {
        return;
    };
    let json = serde_json::to_vec(&m).expect("a manifest serializes");
    let back: SourceManifest = strict_json::from_slice(&json).expect("JSON round trip");
    assert_eq!(back, m);
    if let Ok(w) = manifest_from_wire(&manifest_to_wire(&m)) {
        assert_eq!(w, m, "wire round trip");
    }
}
