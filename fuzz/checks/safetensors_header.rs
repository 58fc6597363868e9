//! A safetensors file's bytes -> mx_checkpoint::Header::parse. An accepted header keeps every
//! tensor inside the data section with dtype x shape bytes, and its canonical JSON, written back
//! in front of the same data section, parses to the same header.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/safetensors_header.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use std::path::Path;

use mx_checkpoint::Header;

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let path = Path::new("fuzz.safetensors");
    let Ok(h) = Header::parse(path, data) else {
        return;
    };
    for t in &h.tensors {
        assert!(
            t.begin <= t.end && t.end <= h.data_len,
            "{t:?} outside the data"
        );
        let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let bytes = numel.and_then(|n| n.checked_mul(t.dtype.size_bytes()));
        assert_eq!(bytes, Some(t.end - t.begin), "{t:?}");
    }
    let json = h.to_json();
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(json.as_bytes());
    file.extend_from_slice(&data[h.data_start as usize..]);
    let back = Header::parse(path, &file).expect("the canonical header parses");
    assert_eq!(back.tensors, h.tensors);
    assert_eq!(back.metadata, h.metadata);
    assert_eq!(back.data_len, h.data_len);
}
