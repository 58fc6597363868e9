//! The fuzz target of `fuzz/checks/safetensors_header.rs` (what it checks is documented there).
#![no_main]

#[path = "../checks/safetensors_header.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
