//! The integration tests of mx-worker: real engines, control planes and NIXL publishers.
//! Each file is a module of this one test binary
//! (`cargo test -p mx-worker --test integration <file>::`), so the whole stack is linked
//! once instead of once per file.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

mod common;
mod engine_http;
mod engine_memory;
mod fanout;
mod over_nixl;
#[path = "../../../product/publisher/tests/support/trainer.rs"]
mod trainer;
