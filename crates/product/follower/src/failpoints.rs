//! Fault injection for fleet tests: named failpoints set over HTTP (`POST /mx/failpoints`, only
//! when the worker runs with `mx-lab worker --failpoints`) and read where the fault happens.
//!
//! Only a fault-injection harness turns them on: it calls [`arm`] before starting workers, and
//! the command line then serves the route ([`armed`]). The `mx` binary, the Python package and
//! the C library never arm them.
//!
//! | name | value | effect |
//! |---|---|---|
//! | `apply.sleep_ms` | milliseconds | the next apply sleeps this long before installing (a worker that hangs once, past its caller's deadline, then completes); the failpoint clears itself when it fires |
//! | `apply.skip_cache_clear` | `true` | apply installs the weights but leaves every cache tier, while still reporting the tiers as cleared (a lying worker) |
//! | `pause.sleep_ms` | milliseconds | the next pause sleeps this long before answering (a worker that can be killed while the control plane is in PREPARE); clears itself when it fires |
//! | `generate.fail` | `true` | `/generate` answers HTTP 500 |
//! | `stage.sleep_between_sources_ms` | milliseconds | stage pulls one source at a time and sleeps this long after each source's bytes |

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::Error;

static ARMED: AtomicBool = AtomicBool::new(false);

/// Workers this process starts from its command line serve `/mx/failpoints` from now on
/// (`mx-lab worker --failpoints`).
pub fn arm() {
    ARMED.store(true, Ordering::SeqCst);
}

/// Whether [`arm`] was called in this process.
pub fn armed() -> bool {
    ARMED.load(Ordering::SeqCst)
}

/// The failpoints that are set. All off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailpointValues {
    /// `apply.sleep_ms`: the next apply sleeps this long before installing (one shot).
    pub apply_sleep: Option<Duration>,
    /// `apply.skip_cache_clear`: install without clearing the caches, reporting them cleared.
    pub apply_skip_cache_clear: bool,
    /// `pause.sleep_ms`: the next pause sleeps this long before answering (one shot).
    pub pause_sleep: Option<Duration>,
    /// `generate.fail`: `/generate` answers HTTP 500.
    pub generate_fail: bool,
    /// `stage.sleep_between_sources_ms`: sleep after pulling each source's bytes.
    pub stage_sleep_between_sources: Option<Duration>,
}

/// Thread-safe failpoint set.
#[derive(Debug, Default)]
pub(crate) struct Failpoints {
    values: Mutex<FailpointValues>,
}

fn millis(name: &str, v: &Value) -> Result<Option<Duration>, Error> {
    match v {
        Value::Null => Ok(None),
        _ => v
            .as_u64()
            .map(|ms| Some(Duration::from_millis(ms)))
            .ok_or_else(|| Error::BadRequest {
                field: name.to_string(),
                reason: format!("must be a number of milliseconds or null, got {v}"),
            }),
    }
}

fn flag(name: &str, v: &Value) -> Result<bool, Error> {
    match v {
        Value::Null => Ok(false),
        Value::Bool(b) => Ok(*b),
        _ => Err(Error::BadRequest {
            field: name.to_string(),
            reason: format!("must be true, false or null, got {v}"),
        }),
    }
}

impl Failpoints {
    /// The current values.
    pub(crate) fn get(&self) -> FailpointValues {
        *self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes `apply.sleep_ms` (it fires once): the sleep the current apply must do, if any.
    pub(crate) fn take_apply_sleep(&self) -> Option<Duration> {
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .apply_sleep
            .take()
    }

    /// Takes `pause.sleep_ms` (it fires once): the sleep the current pause must do, if any.
    pub(crate) fn take_pause_sleep(&self) -> Option<Duration> {
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pause_sleep
            .take()
    }

    /// Sets the failpoints named in `body` (`null` clears one); names not in `body` keep their
    /// value. All-or-nothing: on error nothing changes.
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming an unknown failpoint or a value of the wrong type.
    pub(crate) fn set(&self, body: &Map<String, Value>) -> Result<FailpointValues, Error> {
        let mut next = self.get();
        for (name, v) in body {
            match name.as_str() {
                "apply.sleep_ms" => next.apply_sleep = millis(name, v)?,
                "apply.skip_cache_clear" => next.apply_skip_cache_clear = flag(name, v)?,
                "pause.sleep_ms" => next.pause_sleep = millis(name, v)?,
                "generate.fail" => next.generate_fail = flag(name, v)?,
                "stage.sleep_between_sources_ms" => {
                    next.stage_sleep_between_sources = millis(name, v)?;
                }
                other => {
                    return Err(Error::BadRequest {
                        field: other.to_string(),
                        reason: "unknown failpoint (known: apply.sleep_ms, apply.skip_cache_clear, pause.sleep_ms, generate.fail, stage.sleep_between_sources_ms)".into(),
                    })
                }
            }
        }
        *self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(next)
    }
}

impl FailpointValues {
    /// The values as `GET /mx/failpoints` lists them (`null` when off).
    pub fn to_json(&self) -> Value {
        let ms = |d: Option<Duration>| {
            d.map_or(Value::Null, |d| {
                Value::from(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            })
        };
        let on = |b: bool| if b { Value::Bool(true) } else { Value::Null };
        serde_json::json!({
            "apply.sleep_ms": ms(self.apply_sleep),
            "apply.skip_cache_clear": on(self.apply_skip_cache_clear),
            "pause.sleep_ms": ms(self.pause_sleep),
            "generate.fail": on(self.generate_fail),
            "stage.sleep_between_sources_ms": ms(self.stage_sleep_between_sources),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn set_clear_and_refuse() {
        let f = Failpoints::default();
        let body = serde_json::json!({"apply.sleep_ms": 250, "generate.fail": true});
        let v = f.set(body.as_object().unwrap()).unwrap();
        assert_eq!(v.apply_sleep, Some(Duration::from_millis(250)));
        assert!(v.generate_fail);
        let v = f
            .set(
                serde_json::json!({"apply.sleep_ms": null})
                    .as_object()
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(v.apply_sleep, None);
        assert!(v.generate_fail, "names not in the body keep their value");
        let e = f
            .set(
                serde_json::json!({"nope": 1, "generate.fail": false})
                    .as_object()
                    .unwrap(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        assert!(f.get().generate_fail, "a refused body changes nothing");
        let e = f
            .set(
                serde_json::json!({"apply.sleep_ms": "x"})
                    .as_object()
                    .unwrap(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("apply.sleep_ms"), "{e}");
        assert_eq!(f.get().to_json()["generate.fail"], true);
        f.set(
            serde_json::json!({"apply.sleep_ms": 5})
                .as_object()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(f.take_apply_sleep(), Some(Duration::from_millis(5)));
        assert_eq!(f.take_apply_sleep(), None, "apply.sleep_ms fires once");
    }
}
