//! mx's data plane: one-sided NIXL READs between processes, over `nixl-sys` 1.5.1.
//!
//! This is the only crate of mx with `unsafe` code; everything it exports is safe and RAII.
//! Layering (after cudarc): `nixl-sys` (raw FFI, resolved with `dlopen` at run time) -> one
//! private `check(call, result)` that turns every NIXL failure into [`Error::Nixl`] naming the
//! call -> the safe RAII types here. The `unsafe` blocks are the `dlopen` of the library, the
//! arena's `mmap`/`madvise`/`munmap` and its slices, the slice over a [`ForeignMemory`], and (feature `cuda`) the libcuda probe.
//!
//! Main types:
//! - [`Agent`]: one NIXL agent with the UCX backend and the progress thread OFF (transfers are
//!   driven by polling `get_xfer_status`, which measured 3-10x faster than the progress thread on
//!   small machines). Cheap to clone (an `Arc` inside); `Send + Sync`. An agent that serves READs
//!   (a publisher) must still progress now and then so peers can connect to it: keep a
//!   [`Agent::spawn_progress`] guard alive (a 1 ms interval is plenty), or call
//!   [`Agent::progress`] from an existing loop. Without it peers' READs stay pending forever.
//! - [`Arena`]: one huge-page-backed DRAM buffer (anonymous `mmap`, 2 MiB aligned, `MADV_HUGEPAGE`,
//!   pre-faulted) registered with the agent. Register one large arena per process rather than one
//!   region per tensor. Dropping it deregisters first, then unmaps.
//! - [`ForeignMemory`]: memory the caller owns (a trainer's tensors), registered through an
//!   `unsafe` constructor whose contract (valid for reads while registered, not written while mx
//!   reads it or peers may READ it) makes its safe methods sound; host ranges always, CUDA device
//!   pointers with feature `cuda` (read back for digesting in chunked device-to-host copies).
//!   [`HostBuffer`] is an unregistered huge-page buffer for callers without memory of their own.
//! - [`Agent::read`]: executes a list of [`ReadOp`]s (remote address, length -> local offset) as
//!   batched NIXL READ descriptor lists, several requests in flight, every op validated before
//!   anything is posted.
//! - [`probe_costs`]: measures the per-descriptor cost and wire bandwidth against a remote, the
//!   inputs to the planner's cost model ([`CostModel`]); [`memcpy_gbps`] measures the local copy
//!   bandwidth to report beside pull bandwidth.
//! - `vram` (feature `cuda`): device memory through cudarc, registered as NIXL VRAM.
//!
//! What it leaves out: planning (which bytes to read), metadata exchange (the caller moves
//! [`Agent::local_metadata`] bytes through its own control plane), WRITE operations and
//! notifications, and async: calls block the calling thread (use `spawn_blocking` under tokio).
//!
//! # Finding the NIXL libraries
//!
//! `nixl-sys` is built with its `stub-api` feature: the binary links no NIXL at all and
//! `dlopen`s `libnixl_capi.so` on first use. `scripts/install-nixl.sh` unpacks the PyPI wheel
//! `nixl-cu12==1.5.1` into `$REPO/.mx/nixl` (the libraries find each other, the UCX plugin in
//! `plugins/` and the bundled UCX 1.23 through their `$ORIGIN` rpaths). Before the first NIXL call
//! this crate loads `libnixl_capi.so` from, in order:
//! 1. `$MX_NIXL_DIR/libnixl_capi.so` when `MX_NIXL_DIR` is set (and nothing else then);
//! 2. the dynamic loader's search path (`LD_LIBRARY_PATH=$REPO/.mx/nixl`, an rpath, ldconfig);
//! 3. `$REPO/.mx/nixl/libnixl_capi.so`, `$REPO` being the checkout this crate was compiled in.
//!
//! So in a checkout where the script ran, nothing needs to be set. The environment NIXL processes
//! should have, and what it is for:
//! - `UCX_MODULES=^efa`: where the system has rdma-core, processes otherwise crash at exit in the
//!   bundled libnl. This crate sets it itself, when unset, before it loads NIXL
//!   ([`nixl_available`]; call it early in `main`, before other threads start).
//! - `NIXL_PLUGIN_DIR=$REPO/.mx/nixl/plugins`: optional; NIXL finds `plugins/` next to
//!   `libnixl.so` on its own.
//! - `LD_LIBRARY_PATH=$REPO/.mx/nixl`: only for binaries moved out of the checkout (or use
//!   `MX_NIXL_DIR`).
//!
//! When NIXL cannot be loaded, [`nixl_available`] and [`Agent::new`] return
//! [`Error::NixlMissing`] explaining how to install it; they never abort the process (the raw
//! stubs call `abort()` when used without the library).
//!
//! # Measured (2-core VM, kernel 6.18, UCX 1.23 over CMA, huge pages, progress thread off)
//!
//! `cargo test -p mx-nixl --release --test read -- --ignored --nocapture bench` prints:
//! 256 MiB contiguous READ 5.9 GB/s median (6.0 best) where a 1-thread memcpy does 10-11 GB/s
//! and a bare `process_vm_readv` loop in C does 4.4 GB/s on the same VM (CMA is the limit, not
//! this crate). Strided runs (one descriptor per run, TP=3 row slice of 192 MiB):
//! 384 B 0.35 GB/s, 1 KiB 0.81, 4 KiB 2.3, 16 KiB 3.7, 64 KiB 4.1, 256 KiB 4.7 GB/s.
//! [`probe_costs`] fits about 1.3-1.5 us per descriptor and 5.3-5.9 GB/s there.

mod agent;
mod arena;
mod foreign;
mod loader;
mod probe;
mod read;
#[cfg(feature = "cuda")]
pub mod vram;

pub use agent::{Agent, AgentOptions, ProgressThread};
pub use arena::Arena;
pub use foreign::{ForeignMemory, HostBuffer, MemoryKind, DTOH_CHUNK};
pub use loader::{loaded_from, nixl_available, nixl_or_skip, NIXL_DIR_ENV, REQUIRE_NIXL_ENV};
pub use probe::{memcpy_gbps, probe_costs, CostModel};
pub use read::{ReadOp, ReadOptions, XferStats};

use std::time::Duration;

/// Everything that can go wrong in the data plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The NIXL runtime library could not be loaded (or is only the stub).
    #[error(
        "NIXL is not available: {reason}. Install it with `scripts/install-nixl.sh` (unpacks the \
         nixl-cu12==1.5.1 wheel into {default_dir}); a binary outside the checkout needs \
         LD_LIBRARY_PATH={default_dir} or MX_NIXL_DIR={default_dir}"
    )]
    NixlMissing {
        /// What was tried and why it failed (dlopen errors included).
        reason: String,
        /// Where `scripts/install-nixl.sh` puts the libraries for this checkout.
        default_dir: String,
    },
    /// A NIXL call returned an error status.
    #[error("NIXL call `{call}` failed: {status}")]
    Nixl {
        /// The nixl-sys / C API call that failed.
        call: &'static str,
        /// The status NIXL reported.
        status: String,
    },
    /// An agent name NIXL cannot take (empty, or with a NUL byte).
    #[error("invalid NIXL agent name {name:?}: {reason}")]
    BadAgentName {
        /// The rejected name.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// A read op was rejected before anything was posted.
    #[error("read op {index} rejected: {reason}")]
    BadReadOp {
        /// Index of the op in the slice given to [`Agent::read`].
        index: usize,
        /// Why it was rejected (bounds, overflow, zero length).
        reason: String,
    },
    /// A [`ReadOptions`] field is out of range.
    #[error("invalid read option `{field}`: {reason}")]
    BadReadOptions {
        /// The field at fault.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The remote agent's metadata has not been loaded with [`Agent::load_remote`].
    #[error("remote agent {remote:?} is not loaded into agent {agent:?}")]
    UnknownRemote {
        /// The local agent.
        agent: String,
        /// The remote agent that was asked for.
        remote: String,
    },
    /// The local arena was registered with a different agent than the one reading into it.
    #[error("arena of agent {arena_agent:?} used with agent {agent:?}")]
    ForeignArena {
        /// The agent doing the read.
        agent: String,
        /// The agent the arena is registered with.
        arena_agent: String,
    },
    /// Requests were still in flight when the deadline passed.
    #[error(
        "READ from {remote:?} timed out after {waited:?}: {pending_requests} requests \
         ({pending_descriptors} descriptors) still in flight"
    )]
    Timeout {
        /// The remote agent.
        remote: String,
        /// How long the call waited.
        waited: Duration,
        /// Transfer requests not yet complete.
        pending_requests: usize,
        /// Descriptors in those requests plus those never posted.
        pending_descriptors: usize,
    },
    /// An arena length that cannot be mapped.
    #[error("invalid arena length {len}: {reason}")]
    BadLength {
        /// The requested length in bytes.
        len: u64,
        /// Why.
        reason: &'static str,
    },
    /// `mmap` (or `munmap` of the alignment slack) failed.
    #[error("mmap of {len} bytes failed: {source}")]
    Mmap {
        /// Bytes asked of the kernel.
        len: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// [`probe_costs`] cannot measure with the given region or scratch arena.
    #[error("cost probe: {reason}")]
    Probe {
        /// Why.
        reason: String,
    },
    /// The CUDA driver library (libcuda.so) is not present on this machine.
    #[error("CUDA driver library (libcuda.so) not found; VRAM registration needs a GPU machine")]
    CudaMissing,
    /// A CUDA driver call failed.
    #[error("CUDA call `{call}` failed: {status}")]
    Cuda {
        /// The cudarc call.
        call: &'static str,
        /// The driver's error.
        status: String,
    },
}
