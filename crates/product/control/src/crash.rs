//! Crash points for tests of recovery, armed only by a harness: a process that called [`arm`]
//! (`mx-lab control`) SIGKILLs itself, with a real `kill -9`, when the refit driver reaches the
//! point named by `MX_CONTROL_CRASH_AT`:
//! - a phase name right after the phase is journaled (`stage`, `prepare`, `apply`, `verify`,
//!   `resume`, `check`, `commit`) or `end` after the refit's end is journaled;
//! - `apply:<n>` after `n` apply calls finished (so `apply:1` is between the APPLY of the first
//!   and the second worker);
//! - `apply-sent:<n>` right after the intent of apply call `n` is journaled but before it is
//!   sent.
//!
//! Nothing else arms them: the `mx` binary, the Python package and the C library ignore the
//! variable.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static ARMED: AtomicBool = AtomicBool::new(false);

/// Honours `MX_CONTROL_CRASH_AT` in this process from now on (fault-injection harnesses only).
pub fn arm() {
    ARMED.store(true, Ordering::SeqCst);
}

/// Whether [`arm`] was called in this process.
pub fn armed() -> bool {
    ARMED.load(Ordering::SeqCst)
}

/// The driver reached `point`: dies there when armed and `MX_CONTROL_CRASH_AT` names it.
pub(crate) fn at(point: &str) {
    if !armed() {
        return;
    }
    if std::env::var("MX_CONTROL_CRASH_AT").is_ok_and(|p| p == point) {
        tracing::warn!(point, "crash point: the control plane SIGKILLs itself");
        let pid = std::process::id().to_string();
        // A real SIGKILL, delivered by the kernel like any other: no destructor or flush runs.
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid])
            .status();
        std::thread::sleep(Duration::from_secs(3600));
    }
}
