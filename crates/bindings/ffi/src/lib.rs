//! mx-ffi: the C ABI of mx. `libmx.so` plus the header `include/mx.h`, generated from this crate
//! by cbindgen (build.rs) and checked against the checked-in copy by `tests/header.rs`.
//!
//! What it exposes, over the Rust libraries (each behind an opaque handle):
//! - `mx_model`: a model description (an HF checkpoint directory, or a config.json text plus
//!   tensor specs) that publishers, pullers and declarations are checked against;
//! - `mx_publisher` (mx-publisher): a trainer rank registers host memory it owns, describes its
//!   shards, publishes versions in place or as a snapshot, and learns when it may write again;
//! - `mx_puller` (mx-puller): an inference rank registers each parameter's host memory, stages
//!   versions over NIXL (from the control plane's manifests), applies them in place, rolls back,
//!   and may be served as a control-plane-driven worker (mx-follower's HTTP contracts, no
//!   generation);
//! - `mx_control` (mx-control's client): declare versions, run refits, read status;
//!   `mx_control_plane`: a control plane in this process.
//!
//! Conventions, the same for every function:
//! - every function returns an [`Status`] (`MX_OK` = 0) except the `*_free` functions, the
//!   static-string queries and `mx_last_error`;
//! - on error, `mx_last_error` returns the message (`function: error: cause: ...`, naming the
//!   argument, tensor, parameter or version at fault) until the next call on the same thread;
//! - no panic crosses the boundary: it becomes `MX_ERR_PANIC`, and the handle it happened on
//!   refuses further calls;
//! - NULL handles, NULL strings, strings that are not UTF-8, NULL arrays with a non-zero length
//!   and NULL output pointers are refused with `MX_ERR_INVALID_ARGUMENT`; lengths and offsets
//!   are checked against the model and the registered memory before anything is read;
//! - strings the library returns through `char **` are owned by the caller and freed with
//!   `mx_string_free`; pointers inside info structs stay valid until their handle is freed;
//! - handles are thread-safe: calls on one handle from several threads serialize on its lock
//!   (a blocking call holds it). A `*_free` must not race with another call on the same handle.
//! - blocking calls block the calling thread on a runtime the library owns (two worker threads,
//!   started on first use); never call them from a thread of that runtime (there is no
//!   callback, so C code cannot).
//!
//! Left out: CUDA device memory (host memory only), `staged_tensors` for engines with their own
//! loaders, and publishing from a puller as a peer source.
//!
//! Map: `control` (`mx_control_*`: the orchestrator's client and an in-process control plane) ·
//! `model` (`mx_model_*`) · `publisher` (`mx_publisher_*`) · `puller` (`mx_puller_*`, optionally
//! served to the control plane) · `util` (the panic guard, the per-thread last error, checked
//! pointers).
#![deny(unsafe_op_in_unsafe_fn)]

// The header lists lib.rs's items, then these modules' in this order.
pub mod control;
pub mod model;
pub mod publisher;
pub mod puller;
mod util;

use std::ffi::c_char;

pub use control::*;
pub use model::*;
pub use publisher::*;
pub use puller::*;

/// A status code: `MX_OK` (0) or one of the `MX_ERR_*` codes.
pub type Status = i32;

/// Success.
pub const MX_OK: Status = 0;
/// An argument is NULL, not UTF-8, out of range, or does not fit the model, layout or
/// registered memory (the last error names it).
pub const MX_ERR_INVALID_ARGUMENT: Status = 1;
/// The data plane failed: NIXL is missing (the message says how to install it), a
/// registration was refused, or a source could not be read.
pub const MX_ERR_NIXL: Status = 2;
/// The control plane refused a call or could not be reached.
pub const MX_ERR_CONTROL: Status = 3;
/// Pulled bytes did not match their published digests, or manifests are not the version's.
pub const MX_ERR_VERIFY: Status = 4;
/// What was waited for did not happen within the timeout.
pub const MX_ERR_TIMEOUT: Status = 5;
/// A version (label or id) is unknown where it was looked for.
pub const MX_ERR_UNKNOWN_VERSION: Status = 6;
/// The layout cannot place the model, or planning failed (e.g. sources do not cover a tensor).
pub const MX_ERR_LAYOUT: Status = 7;
/// The call does not fit the handle's state (e.g. parameters still unregistered, nothing to
/// roll back to, no shards set, a version not READY).
pub const MX_ERR_STATE: Status = 8;
/// Reading a model directory failed.
pub const MX_ERR_IO: Status = 9;
/// An internal error (a bug: please report the message).
pub const MX_ERR_INTERNAL: Status = 10;
/// A panic was caught at the boundary (a bug: please report the message). The handle it
/// happened on refuses further calls.
pub const MX_ERR_PANIC: Status = 11;

/// The most dimensions of a shape passed to this library.
pub const MX_MAX_DIMS: usize = 8;

/// The message of the last failed call on this thread (empty after a successful call). The
/// pointer stays valid until the next call into this library on the same thread; copy it to
/// keep it. Never NULL. Thread-safe (per thread).
#[no_mangle]
pub extern "C" fn mx_last_error() -> *const c_char {
    util::last_error_ptr()
}

/// The name of a status code (`"MX_OK"`, `"MX_ERR_NIXL"`, ...; `"MX_ERR_UNKNOWN_STATUS"` for
/// others). A static string: never freed. Thread-safe.
#[no_mangle]
pub extern "C" fn mx_status_name(status: Status) -> *const c_char {
    let s: &'static std::ffi::CStr = match status {
        MX_OK => c"MX_OK",
        MX_ERR_INVALID_ARGUMENT => c"MX_ERR_INVALID_ARGUMENT",
        MX_ERR_NIXL => c"MX_ERR_NIXL",
        MX_ERR_CONTROL => c"MX_ERR_CONTROL",
        MX_ERR_VERIFY => c"MX_ERR_VERIFY",
        MX_ERR_TIMEOUT => c"MX_ERR_TIMEOUT",
        MX_ERR_UNKNOWN_VERSION => c"MX_ERR_UNKNOWN_VERSION",
        MX_ERR_LAYOUT => c"MX_ERR_LAYOUT",
        MX_ERR_STATE => c"MX_ERR_STATE",
        MX_ERR_IO => c"MX_ERR_IO",
        MX_ERR_INTERNAL => c"MX_ERR_INTERNAL",
        MX_ERR_PANIC => c"MX_ERR_PANIC",
        _ => c"MX_ERR_UNKNOWN_STATUS",
    };
    s.as_ptr()
}

/// The library's version (`"0.1.0"`). A static string: never freed. Thread-safe.
#[no_mangle]
pub extern "C" fn mx_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Frees a string this library returned through a `char **` output. NULL is ignored.
///
/// # Safety
/// `s` is NULL or a string this library returned that was not freed yet.
#[no_mangle]
pub unsafe extern "C" fn mx_string_free(s: *mut c_char) {
    util::call_void("mx_string_free", || {
        if !s.is_null() {
            // SAFETY: by the contract `s` came from CString::into_raw in this library and is
            // freed once.
            drop(unsafe { std::ffi::CString::from_raw(s) });
        }
    });
}

/// Sends the library's logs to stderr, filtered by `filter` (`tracing` env-filter syntax, e.g.
/// `"info"` or `"mx_puller=debug"`; NULL: the `RUST_LOG` variable, else `warn`). Only the first
/// call in a process installs the logger; later calls return `MX_OK` and change nothing.
///
/// # Safety
/// `filter` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mx_log_init(filter: *const c_char) -> Status {
    util::call("mx_log_init", || {
        // SAFETY: the caller's contract.
        let f = unsafe { util::opt_cstr(filter, "filter") }?;
        let filter = match f {
            Some(f) => tracing_subscriber::EnvFilter::try_new(f)
                .map_err(|e| util::FfiError::arg("filter", e))?,
            None => tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        };
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        Ok(())
    })
}
