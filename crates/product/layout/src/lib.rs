//! mx-layout: tensor layouts and transfer planning. Pure: no I/O, no threads, deterministic.
//!
//! Main types: [`DType`], [`TensorBox`] (an N-d box of a global tensor), [`LayoutSpec`] (a scheme
//! over N ranks), [`ModelLayout`] (for every rank of a layout, the parameters it holds and which
//! boxes of which checkpoint tensors they are made of), [`SourceManifest`] (what a source
//! publishes) and [`plan::Plan`] (for one destination rank set, the coalesced NIXL reads, the
//! staging layout and the apply copies, with a proof that every destination byte is written once).
//!
//! Map: [`model`] (model layouts from HF configs: which boxes of which tensors each rank holds),
//! `manifest` (what a source publishes, the version digest), [`plan`] (the cost-model planner
//! and its coverage proof), [`want`] (the regions a worker's plan reads), [`merkle`] (proofs of
//! a version's shards), [`update`] (the deterministic training step of the demo and tests),
//! [`frontier`] (DeepSeek-V3 / Kimi-K2 layouts for benchmarks), [`strict_json`] (duplicate keys
//! are errors), `types` and `dtype` (the typed values every seam uses).
//!
//! Left out: moving bytes (mx-nixl), reading files (mx-checkpoint), talking to peers (mx-control).
#![forbid(unsafe_code)]

mod dtype;
mod error;
pub mod fp8;
pub mod frontier;
mod manifest;
pub mod megatron;
pub mod merkle;
pub mod model;
pub mod moe;
pub mod plan;
#[cfg(test)]
mod plan_reference;
pub mod strict_json;
#[cfg(test)]
mod test_util;
mod types;
pub mod update;
pub mod want;

pub use dtype::DType;
pub use error::Error;
pub use manifest::{
    digest_segments, geometry_digest, version_digest, DestPiece, MemDevice, RankDigests,
    ShardEntry, SourceManifest, TensorSpec,
};
pub use model::{rank_layout, rank_layouts, ModelInfo, Param, Piece, RankLayout};
pub use strict_json::JsonError;
pub use types::{Digest, LayoutSpec, MegatronDims, ResidentVersion, Scheme, TensorBox, VersionId};
pub use want::Want;
