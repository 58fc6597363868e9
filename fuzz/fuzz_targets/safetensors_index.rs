//! model.safetensors.index.json text -> mx_checkpoint::parse_index. An accepted weight_map
//! names only plain file names, and written back as `{"weight_map": ...}` parses to itself.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});
