//! The integration tests of mx-adapters: each engine client against a server that answers its contract.
//! Each file is a module of this one test binary
//! (`cargo test -p mx-adapters --test integration <file>::`), so the whole stack is linked
//! once instead of once per file.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

mod contracts;
mod dynamo;
mod sglang;
mod vllm;
