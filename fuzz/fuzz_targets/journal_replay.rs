//! The fuzz target of `fuzz/checks/journal_replay.rs` (what it checks is documented there).
#![no_main]

#[path = "../checks/journal_replay.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
