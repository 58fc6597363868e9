//! mx-harness: everything around the product that proves and measures it, built on the product
//! libraries (and the product's command line, `mx-cli`) as any user would build on them. Its
//! binary is `mx-lab` (the root package's `src/bin/mx-lab.rs`): every `mx` command, plus
//!
//! - [`demo`]: `mx-lab demo`, a local fleet (control plane, trainer ranks, inference workers as
//!   processes) refitted through two versions, every byte checked against the checkpoint;
//! - [`validate`]: `mx-lab validate`, the refit fault matrix and the chaos run, with the fault
//!   injection only `mx-lab` arms (`--failpoints` on its workers, `MX_CONTROL_CRASH_AT` on its
//!   control planes);
//! - [`bench`]: `mx-lab bench`, pull/disk/plan/control benchmarks side by side in one run;
//! - [`trainer`]: the demo trainer rank (`mx-lab publish`): this rank's shards of a checkpoint
//!   in memory it owns, published through mx-publisher, a synthetic training step between
//!   versions, and the fault-injection byte flip;
//! - [`fleet`]: spawning and watching those processes; [`s3`]: an S3-compatible server (moto)
//!   on loopback for tests and benchmarks; [`lab`]: the `mx-lab` command line.
//!
//! No product library and no product binary depends on this crate.
//!
//! Map: [`lab`] (the `mx-lab` command line) · [`demo`] · [`validate`] (fault matrix, chaos,
//! restarts, HA) · [`bench`] · [`fleet`] (local child processes) · [`trainer`] (the demo trainer) ·
//! [`s3`] (a loopback S3 server) · `slice` (reference slicing for the demo's check).

pub mod bench;
pub mod demo;
pub mod fleet;
pub mod lab;
pub mod s3;
pub mod slice;
pub mod trainer;
pub mod validate;

pub use mx_cli::runtime;
