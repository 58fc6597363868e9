//! mx-harness: everything around the product that proves and measures it, built on the product
//! libraries as any user would build on them.
//!
//! - [`demo`]: `mx demo`, a local fleet (control plane, trainer ranks, inference workers as
//!   processes) refitted through two versions, every byte checked against the checkpoint;
//! - [`validate`]: `mx validate`, the refit fault matrix and the chaos run;
//! - [`bench`]: `mx bench`, pull/disk/plan/control benchmarks side by side in one run;
//! - [`trainer`]: the demo trainer rank (`mx publish`): this rank's shards of a checkpoint in
//!   memory it owns, published through mx-publisher, a synthetic training step between
//!   versions, and the fault-injection byte flip;
//! - [`fleet`]: spawning and watching those processes; [`refits`]: waiting for and printing
//!   refits; [`report`]: every JSON report names the build that produced it; [`s3`]: an
//!   S3-compatible server (moto) on loopback for tests and benchmarks.
//!
//! No product library depends on this crate; the `mx` binary dispatches into it.

pub mod bench;
pub mod demo;
pub mod fleet;
pub mod refits;
pub mod report;
pub mod s3;
mod slice;
pub mod trainer;
pub mod validate;

/// The tokio runtime a command runs on: two worker threads (the machines this runs on have two
/// cores; NIXL transfers block their own threads).
///
/// # Errors
/// When tokio cannot start.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting tokio")
}
