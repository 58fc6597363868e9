//! The generation gate: `pause_generation` / `resume_generation` and the requests in flight.
//!
//! A request is admitted before it runs and checks the gate between tokens. While paused, new
//! requests wait for resume (modes keep and wait) or are refused (abort). Requests in flight:
//! abort stops them between tokens, keep holds them between tokens until resume (their engine
//! state is dropped, so they continue on whatever weights are live after resume), wait lets
//! them finish. A pause returns once no admitted request is running (each has finished, been
//! aborted or is held): that is the safe point at which weights may be swapped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

use crate::Error;

/// What `pause_generation` does with requests in flight: hold them between tokens and continue
/// after resume (`Keep`), let them finish before the pause returns (`Wait`), or stop them between
/// tokens with HTTP 503 (`Abort`).
pub use mx_control::PauseMode;

#[derive(Debug, Clone, Copy, Default)]
struct GateState {
    paused: Option<PauseMode>,
    /// Admitted requests not yet finished.
    in_flight: u64,
    /// Of those, requests held between tokens (pause mode keep).
    held: u64,
}

/// What a request does at a token boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Go on decoding.
    Go,
    /// Stop here and wait for resume (pause mode keep).
    Hold,
    /// Stop here and fail (pause mode abort).
    Abort,
}

/// What a pause found and left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseOutcome {
    /// Requests in flight when the pause was asked for.
    pub in_flight: u64,
    /// Requests held (pause mode keep) once the pause returned.
    pub held: u64,
}

/// The gate, shared by every request and the control routes.
#[derive(Debug)]
pub(crate) struct Gate {
    tx: watch::Sender<GateState>,
}

/// An admitted request; dropping it ends the request (and stops its decode at the next token).
#[derive(Debug)]
pub(crate) struct Admission<'a> {
    gate: &'a Gate,
    /// Set when the request is gone (its HTTP connection closed): the decode stops.
    pub(crate) cancelled: Arc<AtomicBool>,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.gate.tx.send_modify(|s| s.in_flight -= 1);
    }
}

/// Counts a held request while it waits; uncounts it however the wait ends.
struct HeldGuard<'a>(&'a Gate);

impl Drop for HeldGuard<'_> {
    fn drop(&mut self) {
        self.0.tx.send_modify(|s| s.held -= 1);
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            tx: watch::Sender::new(GateState::default()),
        }
    }
}

impl Gate {
    /// Admits a new request: at once when not paused, after resume when paused with keep or
    /// wait.
    ///
    /// # Errors
    /// [`Error::Paused`] when paused with abort (also when the mode becomes abort while waiting).
    pub(crate) async fn admit(&self) -> Result<Admission<'_>, Error> {
        let mut rx = self.tx.subscribe();
        loop {
            let paused = rx.borrow_and_update().paused;
            match paused {
                Some(PauseMode::Abort) => return Err(Error::Paused),
                Some(_) => {
                    if rx.changed().await.is_err() {
                        return Err(Error::Paused);
                    }
                }
                None => {
                    // Count the request only if no pause slipped in since the check: a pause
                    // sent after this point waits for it through `in_flight`.
                    let admitted = self.tx.send_if_modified(|s| {
                        let ok = s.paused.is_none();
                        if ok {
                            s.in_flight += 1;
                        }
                        ok
                    });
                    if admitted {
                        return Ok(Admission {
                            gate: self,
                            cancelled: Arc::new(AtomicBool::new(false)),
                        });
                    }
                }
            }
        }
    }

    /// What an admitted request does at a token boundary.
    pub(crate) fn step(&self) -> Step {
        match self.tx.borrow().paused {
            None | Some(PauseMode::Wait) => Step::Go,
            // Never stored: `pause` keeps only keep, wait and abort.
            Some(PauseMode::Keep | PauseMode::Retract | PauseMode::InPlace) => Step::Hold,
            Some(PauseMode::Abort) => Step::Abort,
        }
    }

    /// Holds an admitted request until resume.
    ///
    /// # Errors
    /// [`Error::Aborted`] when the pause mode becomes abort while it is held.
    pub(crate) async fn hold(&self, _req: &Admission<'_>) -> Result<(), Error> {
        let mut rx = self.tx.subscribe();
        self.tx.send_modify(|s| s.held += 1);
        let _held = HeldGuard(self);
        let s = rx
            .wait_for(|s| !matches!(s.paused, Some(PauseMode::Keep) | Some(PauseMode::Wait)))
            .await
            .map(|s| s.paused)
            .map_err(|_| Error::Aborted)?;
        match s {
            Some(PauseMode::Abort) => Err(Error::Aborted),
            _ => Ok(()),
        }
    }

    /// Pauses generation with `mode` and returns once no admitted request is running.
    pub(crate) async fn pause(&self, mode: PauseMode) -> PauseOutcome {
        // SGLang's retract and in_place hold requests as keep does (this gate has no KV).
        let mode = mode.keep_wait_abort();
        let mut rx = self.tx.subscribe();
        let mut in_flight = 0;
        self.tx.send_modify(|s| {
            s.paused = Some(mode);
            in_flight = s.in_flight;
        });
        let held = match rx.wait_for(|s| s.in_flight == s.held).await {
            Ok(s) => s.held,
            Err(_) => 0,
        };
        PauseOutcome { in_flight, held }
    }

    /// Resumes generation: waiting and held requests continue.
    pub(crate) fn resume(&self) {
        self.tx.send_modify(|s| s.paused = None);
    }

    /// The current pause mode, `None` when generating.
    pub(crate) fn paused(&self) -> Option<PauseMode> {
        self.tx.borrow().paused
    }

    /// Admitted requests not yet finished (held ones included).
    pub(crate) fn in_flight(&self) -> u64 {
        self.tx.borrow().in_flight
    }

    /// Requests held between tokens right now.
    pub(crate) fn held(&self) -> u64 {
        self.tx.borrow().held
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn abort_refuses_keep_waits_and_pause_waits_for_running_requests() {
        let g = Gate::default();
        let a = g.admit().await.unwrap();
        // A pause (any mode) waits while the request runs.
        let p = tokio::time::timeout(Duration::from_millis(50), g.pause(PauseMode::Keep)).await;
        assert!(p.is_err(), "pause returned while a request was running");
        assert_eq!(g.step(), Step::Hold);
        // The request holds: now the pause returns, counting it.
        let held = async {
            g.hold(&a).await.unwrap();
        };
        let pause = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let out = g.pause(PauseMode::Keep).await;
            assert_eq!(
                out,
                PauseOutcome {
                    in_flight: 1,
                    held: 1
                }
            );
            // New requests wait while paused with keep.
            assert!(tokio::time::timeout(Duration::from_millis(30), g.admit())
                .await
                .is_err());
            g.resume();
        };
        tokio::join!(held, pause);
        assert_eq!(g.held(), 0);
        drop(a);
        g.pause(PauseMode::Abort).await;
        assert!(matches!(g.admit().await, Err(Error::Paused)));
        g.resume();
        assert!(g.paused().is_none());
        let _b = g.admit().await.unwrap();
    }
}
