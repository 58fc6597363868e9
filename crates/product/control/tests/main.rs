//! The integration tests of mx-control: a real control plane in process (gRPC on loopback,
//! TLS and tokens, journals, etcd).
//! Each file is a module of this one test binary
//! (`cargo test -p mx-control --test integration <file>::`), so the whole stack is linked
//! once instead of once per file.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

mod auth;
mod compaction;
mod group_commit;
mod ha_etcd;
mod journal_limits;
mod loopback;
