//! model.safetensors.index.json text -> mx_checkpoint::parse_index. An accepted weight_map
//! names only plain file names, and written back as `{"weight_map": ...}` parses to itself.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/safetensors_index.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use std::path::Path;

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let path = Path::new("model.safetensors.index.json");
    let Ok(map) = mx_checkpoint::parse_index(path, data) else {
        return;
    };
    for file in map.values() {
        assert!(!file.is_empty() && !file.contains('/') && file != ".." && file != ".");
    }
    let text = serde_json::json!({ "weight_map": map }).to_string();
    let back = mx_checkpoint::parse_index(path, text.as_bytes()).expect("written back parses");
    assert_eq!(back, map);
}
