//! [`Owned`]: a Rust object a Python object owns (a publisher, a puller), with the lock that
//! serializes calls on it, the tokio runtime it runs on and the process that made it.

use std::sync::Mutex;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::control::same_process;
use crate::errors::mx_error;
use crate::ForkSafe;

/// `value` behind a lock until closed, on its own runtime. Calls release the GIL before they
/// take the lock (a call in flight on another thread may need the GIL to check for signals).
/// In a `fork` child every call is refused and nothing is dropped (see [`ForkSafe`]).
pub(crate) struct Owned<T> {
    // Dropped in this order: the value, then the runtime it ran on.
    inner: Mutex<Option<T>>,
    rt: ForkSafe<Runtime>,
    pid: u32,
    what: &'static str,
}

impl<T: Send> Owned<T> {
    /// Owns `value`, run on `rt`; `what` names it in errors (`"Publisher"`).
    pub(crate) fn new(value: T, rt: Runtime, what: &'static str) -> Owned<T> {
        Owned {
            inner: Mutex::new(Some(value)),
            rt: ForkSafe::new(rt),
            pid: std::process::id(),
            what,
        }
    }

    /// Runs `f` on the value with the GIL released.
    ///
    /// # Errors
    /// `MxError` (FailedPrecondition) in a fork child or once closed.
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut T, &Runtime) -> R + Send,
    ) -> PyResult<R> {
        same_process(py, self.pid, self.what)?;
        let r = py.detach(|| {
            let mut g = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            g.as_mut().map(|v| f(v, &self.rt))
        });
        r.ok_or_else(|| {
            mx_error(
                py,
                format!("this {} is closed", self.what),
                Some("FailedPrecondition"),
            )
        })
    }

    /// Takes the value out and hands it to `finish` (inside the runtime) with the GIL
    /// released. Idempotent: once closed, `finish` is not called.
    ///
    /// # Errors
    /// `MxError` (FailedPrecondition) in a fork child.
    pub(crate) fn close(
        &self,
        py: Python<'_>,
        finish: impl FnOnce(T, &Runtime) + Send,
    ) -> PyResult<()> {
        same_process(py, self.pid, self.what)?;
        py.detach(|| {
            let value = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(v) = value {
                let _guard = self.rt.enter();
                finish(v, &self.rt);
            }
        });
        Ok(())
    }

    /// True until closed.
    pub(crate) fn is_open(&self) -> bool {
        self.inner.lock().map(|g| g.is_some()).unwrap_or(false)
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        let value = self
            .inner
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if std::process::id() != self.pid {
            // A fork child: the value's threads (NIXL agent, runtime tasks) live only in the
            // parent; dropping it here would wait for them forever.
            std::mem::forget(value);
            return;
        }
        let _guard = self.rt.enter();
        drop(value);
    }
}
