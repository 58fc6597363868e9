//! The fuzz target of `fuzz/checks/config_json.rs` (what it checks is documented there).
#![no_main]

#[path = "../checks/config_json.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
