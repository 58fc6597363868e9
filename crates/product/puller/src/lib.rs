//! mx-puller: the library an inference rank embeds to move to a new policy version.
//!
//! An engine registers the memory its parameters live in ([`Puller::register_param`], each in
//! the engine's own layout: vLLM's fused `qkv_proj` / `gate_up_proj` with GQA kv-head
//! replication, vocab-parallel padding, ...; or one buffer per rank with
//! [`Puller::register_rank`]) and then, per version:
//! - [`Puller::stage`]: checks that the manifests are the version's (the Merkle root of their
//!   shards is the [`mx_layout::VersionId`]), plans the exact byte ranges its ranks need
//!   ([`mx_layout::plan`]), pulls them with one-sided NIXL READs into staging, and verifies every
//!   pulled region against the digest its source published, without touching the live weights;
//! - [`Puller::stage_proven`]: the same from only the manifests its plan reads
//!   ([`Puller::want`], as a control plane answers a worker), checked with the answer's Merkle
//!   proof ([`mx_layout::merkle::VersionProof`]) instead of the root over every manifest;
//! - [`Puller::apply`] (at the orchestrator's safe point): copies the staged bytes into the
//!   registered memory **in place**; addresses never change (CUDA graphs keep pointing at them);
//! - [`Puller::rollback`]: restores the retained copy of the version applied before;
//! - [`Puller::staged_tensors`]: hands the staged bytes, piece by piece, to engines that install
//!   weights through their own loaders instead.
//!
//! **Memory, stated**: staging holds at most the held ranks' own bytes (the planner drops
//! superset reads that would exceed it, [`mx_layout::plan::plan_within`]; the buffers stay
//! registered across versions); with [`PullerConfig::retain`] a host copy of the previous
//! version (1x the ranks' bytes) serves rollback without any source (a trainer that updates its
//! weights in place no longer holds V-1). Nothing else: 2x the ranks' bytes beside the engine's
//! own weights with retention, 1x without. The retained copy is refreshed from staging at the
//! start of the next stage, off the safe point; only the first apply (or one after
//! [`Puller::install`]) copies the resident weights into it during the apply.
//!
//! **One executor**: [`exec::Executor`] is the only code that carries out a plan: the puller
//! runs it over NIXL ([`exec::NixlLanes`]), property tests and benchmarks over memory of their
//! own process ([`exec::MemorySources`]).
//!
//! The puller is synchronous: stage and apply block the calling thread (run them under
//! `spawn_blocking` in async code) and take `&mut self` (one operation at a time; wrap it in a
//! mutex to share it).
//!
//! Left out: the control plane (fetching manifests, reporting STAGED: `mx-follower` and the
//! bindings do that), generation and caches (the engine's), device memory copies themselves
//! (a [`DestMemory`] for device memory implements its own `read`/`write`).
//!
//! `unsafe` is denied except in `dest::HostRegion` (raw host pointers from the C ABI and the
//! Python package) and the NIXL registration of the live memory served to peers
//! (`peer.rs`), where each block says why it holds.
//!
//! Map: `puller` ([`Puller`]: ranks, destination memory, staging, apply, rollback) · `dest`
//! (destination memory: host ranges, device pointers) · [`exec`] (the one plan executor) · `costs`
//! (the measured cost model) · `peer` (serving the resident version to peers) · `error`.
#![deny(unsafe_code)]

mod costs;
mod dest;
mod error;
pub mod exec;
mod peer;
mod puller;

pub use dest::{DestMemory, DestTensor, HostRegion};
pub use error::Error;
pub use exec::{ExecOptions, ExecStats};
pub use puller::{
    digests_of, ApplyKind, ApplyReport, MemoryReport, Puller, PullerConfig, StageReport,
    StagedPiece, Versions,
};
