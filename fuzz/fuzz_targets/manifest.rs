//! A source manifest as JSON (as journal records hold it, parsed strictly) -> SourceManifest;
//! an accepted one round-trips through JSON, and through its wire message when the control
//! plane's checks accept it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mx_control::wire::{manifest_from_wire, manifest_to_wire};
use mx_layout::{strict_json, SourceManifest};

fuzz_target!(|data: &[u8]| {
    let Ok(m) = strict_json::from_slice::<SourceManifest>(data) else {
        return;
    };
    let json = serde_json::to_vec(&m).expect("a manifest serializes");
    let back: SourceManifest = strict_json::from_slice(&json).expect("JSON round trip");
    assert_eq!(back, m);
    if let Ok(w) = manifest_from_wire(&manifest_to_wire(&m)) {
        assert_eq!(w, m, "wire round trip");
    }
});
