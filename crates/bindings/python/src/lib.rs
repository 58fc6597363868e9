//! mx-python: the PyO3 extension module `mx._mx` behind the Python package `mx`
//! (`python/mx/`, built by maturin from the root `pyproject.toml`).
//!
//! This crate is deliberately thin: it turns Python arguments into mx types, runs the Rust call
//! with the GIL released and a deadline, and turns the answer into JSON text or plain tuples that
//! the pure-Python layer (`python/mx/_types.py`) makes into typed, documented objects. What is
//! idiomatic in Python (dataclasses, accepting torch tensors or numpy arrays as tensor
//! descriptions, locating NIXL inside the installed `nixl-cu12` wheel) lives in Python.
//!
//! Main types:
//! - [`control::ControlPlane`]: the Rust control plane (`mx_control::spawn`) on its own tokio
//!   runtime inside the Python process.
//! - [`control::ControlClient`]: the orchestrator's client (declare, refit, wait, status).
//! - [`errors`]: `mx.MxError`, the one exception type every Rust error becomes, carrying the
//!   whole error chain as its message and the gRPC status name as `code`.
//! - `nixl_status`: whether the NIXL libraries load in this process, and from where.
//!
//! - [`model::Model`]: the model description shards and parameters are checked against.
//! - [`publisher::Publisher`]: a trainer rank's publisher over memory it owns (addresses and
//!   lengths; `python/mx/_publisher.py` takes them from torch tensors, numpy arrays and buffers
//!   and keeps those alive).
//! - [`puller::Puller`]: an engine's puller over its parameter memory
//!   (`mx_follower::embedded::EmbeddedPuller`), optionally served to the control plane.
//!
//! What it leaves out (for now): CUDA memory (the Rust libraries take it behind the `cuda`
//! feature; the Python layer refuses device tensors with a message saying so).
//!
//! No panic crosses into Python: PyO3 turns one into `pyo3_runtime.PanicException`, and the code
//! here returns errors instead of panicking (the workspace lints forbid `unwrap`/`expect`).
//!
//! Map: `control` (the embedded control plane and the orchestrator's client) · `errors`
//! (`mx.MxError`) · `model` · `publisher` · `puller` (over `mx_follower::embedded`) · `owned` (a
//! Rust object a Python object owns, with its lock).

mod control;
mod errors;
mod model;
mod owned;
mod publisher;
mod puller;

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A value that is dropped only in the process that made it. Runtimes, NIXL agents and gRPC
/// channels own threads that a `fork` child does not have: dropping them there waits for those
/// threads forever (the child would hang at exit). In a fork child it is leaked instead.
pub(crate) struct ForkSafe<T> {
    value: std::mem::ManuallyDrop<T>,
    pid: u32,
}

impl<T> ForkSafe<T> {
    pub(crate) fn new(value: T) -> ForkSafe<T> {
        ForkSafe {
            value: std::mem::ManuallyDrop::new(value),
            pid: std::process::id(),
        }
    }
}

impl<T> std::ops::Deref for ForkSafe<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Drop for ForkSafe<T> {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            // SAFETY: `value` is dropped exactly once, here, and never used again (this is
            // the owner's drop); in a fork child it is never dropped (leaked on purpose).
            unsafe { std::mem::ManuallyDrop::drop(&mut self.value) }
        }
    }
}

/// How often a long call checks for a pending Python signal (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// `fut`, checking every [`SIGNAL_POLL`] for a pending Python signal: it takes the GIL briefly
/// to run the signal handlers, and a handler that raises (Ctrl-C's `KeyboardInterrupt`) drops
/// `fut` and is returned. Await it with the GIL released. Signals reach only the main thread,
/// so elsewhere this is `fut` itself.
pub(crate) async fn interruptible<T>(fut: impl std::future::Future<Output = T>) -> PyResult<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            out = &mut fut => return Ok(out),
            () = tokio::time::sleep(SIGNAL_POLL) => {
                Python::attach(|py| py.check_signals())?;
            }
        }
    }
}

/// The longest deadline accepted anywhere, in seconds (about 115 days): larger values are almost
/// certainly a unit mistake.
const MAX_SECONDS: f64 = 1e7;

/// A positive, finite number of seconds as a [`Duration`].
///
/// # Errors
/// `ValueError` naming the argument for a negative, zero, NaN, infinite or absurd value.
pub(crate) fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= MAX_SECONDS) {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds (at most {MAX_SECONDS:e}), got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

/// Whether the NIXL C API can be loaded in this process, and from where.
///
/// Returns `(available, loaded_from, reason)`: `loaded_from` is the library path (or
/// "loader search path") when it loaded, `reason` says what was tried when it did not. With
/// `probe`, it also creates (and drops) a NIXL agent with the UCX backend, which loads the UCX
/// plugin and the bundled UCX libraries, so a broken plugin directory shows up here too. The
/// library is searched once per process (see `mx_nixl::nixl_available`): set `MX_NIXL_DIR`
/// before the first call.
#[pyfunction]
#[pyo3(signature = (probe = false))]
fn nixl_status(py: Python<'_>, probe: bool) -> (bool, Option<String>, Option<String>) {
    py.detach(|| {
        if let Err(e) = mx_nixl::nixl_available() {
            return (false, None, Some(errors::chain(&e)));
        }
        let from = mx_nixl::loaded_from().map(str::to_string);
        if probe {
            if let Err(e) = mx_nixl::Agent::new("mx-python-probe") {
                return (false, from, Some(errors::chain(&e)));
            }
        }
        (true, from, None)
    })
}

/// The extension module `mx._mx`. Its names are re-exported (and documented) by the package
/// `mx`; import that instead.
#[pymodule]
fn _mx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let mx_error = py.get_type::<errors::MxError>();
    // The gRPC status name of the failure, when there is one (see errors::mx_error).
    mx_error.setattr("code", py.None())?;
    m.add("MxError", mx_error)?;
    m.add_function(wrap_pyfunction!(nixl_status, m)?)?;
    m.add_class::<control::ControlPlane>()?;
    m.add_class::<control::ControlClient>()?;
    m.add_class::<model::Model>()?;
    m.add_class::<publisher::Publisher>()?;
    m.add_class::<puller::Puller>()?;
    Ok(())
}
