//! The fuzz target of `fuzz/checks/manifest.rs` (what it checks is documented there).
#![no_main]

#[path = "../checks/manifest.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
