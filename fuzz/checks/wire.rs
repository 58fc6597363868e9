//! Every message a peer sends the control plane or a client: the first byte picks the message,
//! the rest is its protobuf bytes -> prost decode -> the receiver's conversion -> encode. What is
//! accepted is canonical: converting it again gives the same bytes.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/wire.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use mx_control::wire::{canonical, WireMessage};

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let Some((&k, bytes)) = data.split_first() else {
        return;
    };
    let kind = WireMessage::ALL[usize::from(k) % WireMessage::ALL.len()];
    let Ok(c) = canonical(kind, bytes) else {
        return;
    };
    match canonical(kind, &c) {
        Ok(again) => assert_eq!(again, c, "{kind:?}: not a fixed point"),
        Err(e) => panic!("{kind:?}: the canonical encoding is refused: {e}"),
    }
}
