//! The fuzz target of `fuzz/checks/wire.rs` (what it checks is documented there).
#![no_main]

#[path = "../checks/wire.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
