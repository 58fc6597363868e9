//! What mx's code inside an engine's ranks says each rank holds (`ReportResident`), for the
//! engines whose own read-back cannot be trusted to say it: SGLang's own server
//! ([`mx_adapters::EngineApi::resident_from_ranks`]). SGLang answers a weight update with
//! success whatever its custom loader did (an exception there would kill the server), and its
//! `/model_info` echoes the version the request named; mx's loader restores the previous
//! version itself when an install fails and reports what the rank holds before SGLang's route
//! returns. A registration counts as a report (what the rank loaded at start, after a
//! control-plane restart). In memory only: every worker registers again after a restart.

use std::collections::HashMap;
use std::sync::Mutex;

use mx_layout::ResidentVersion;

use crate::commit::lock;

/// The most bytes of a report's error kept.
pub(crate) const MAX_ERROR_BYTES: usize = 1024;

/// One rank's last report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankReport {
    /// The incarnation of the process that reported.
    pub(crate) incarnation: u64,
    /// What the rank holds.
    pub(crate) resident: Option<ResidentVersion>,
    /// Why its last install failed (empty: it succeeded, or it only registered).
    pub(crate) error: String,
}

/// Every worker's last report.
#[derive(Debug, Default)]
pub(crate) struct RankReports {
    reports: Mutex<HashMap<String, RankReport>>,
}

impl RankReports {
    /// Records `report` for `worker_id` (a registration, or a `ReportResident` already checked
    /// against the worker's registered incarnation).
    pub(crate) fn record(&self, worker_id: &str, report: RankReport) {
        lock(&self.reports).insert(worker_id.to_string(), report);
    }

    /// Forgets `worker_id` (retired).
    pub(crate) fn forget(&self, worker_id: &str) {
        lock(&self.reports).remove(worker_id);
    }

    /// The version the ranks `workers` of one engine hold, by their reports, checked against
    /// `engine_says` (the engine's own read-back).
    ///
    /// # Errors
    /// In words: a rank that never reported, a rank whose last install failed (its error),
    /// ranks that disagree, or an engine that names another mx version than its ranks hold.
    pub(crate) fn resident(
        &self,
        workers: &[String],
        engine_says: Option<&ResidentVersion>,
    ) -> Result<Option<ResidentVersion>, String> {
        let reports = lock(&self.reports);
        let mut held: Option<(&str, &Option<ResidentVersion>)> = None;
        for w in workers {
            let Some(r) = reports.get(w) else {
                return Err(format!(
                    "worker {w}: mx's code in the engine has not reported what the rank holds"
                ));
            };
            if !r.error.is_empty() {
                return Err(format!(
                    "worker {w}: the install failed in the engine ({}); it holds {}",
                    r.error,
                    shown(r.resident.as_ref())
                ));
            }
            match held {
                Some((first, v)) if v != &r.resident => {
                    return Err(format!(
                        "the ranks of one engine disagree: {first} holds {}, {w} holds {}",
                        shown(v.as_ref()),
                        shown(r.resident.as_ref())
                    ))
                }
                Some(_) => {}
                None => held = Some((w.as_str(), &r.resident)),
            }
        }
        let resident = held.and_then(|(_, v)| v.clone());
        if let Some(said) = engine_says {
            if said.mx().is_some() && Some(said) != resident.as_ref() {
                return Err(format!(
                    "the engine reports {said}, its ranks hold {}",
                    shown(resident.as_ref())
                ));
            }
        }
        Ok(resident)
    }
}

fn shown(v: Option<&ResidentVersion>) -> String {
    v.map_or_else(|| "none".to_string(), ToString::to_string)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn v(n: u8) -> ResidentVersion {
        ResidentVersion::parse(&format!("mx:{}", format!("{n:02x}").repeat(32)))
    }

    fn report(resident: Option<ResidentVersion>, error: &str) -> RankReport {
        RankReport {
            incarnation: 7,
            resident,
            error: error.into(),
        }
    }

    #[test]
    fn the_ranks_reports_decide_and_contradictions_are_named() {
        let r = RankReports::default();
        let ws = ["w-tp0".to_string(), "w-tp1".to_string()];
        let err = r.resident(&ws, None).unwrap_err();
        assert!(
            err.contains("w-tp0: mx's code in the engine has not reported"),
            "{err}"
        );
        r.record("w-tp0", report(Some(v(1)), ""));
        r.record("w-tp1", report(Some(v(1)), ""));
        assert_eq!(r.resident(&ws, Some(&v(1))), Ok(Some(v(1))));
        // SGLang's start-up label says nothing about mx versions.
        let default = ResidentVersion::parse("default");
        assert_eq!(r.resident(&ws, Some(&default)), Ok(Some(v(1))));
        // The engine echoes a version its ranks do not hold.
        let err = r.resident(&ws, Some(&v(2))).unwrap_err();
        assert!(err.contains(&format!(
            "the engine reports {}, its ranks hold {}",
            v(2),
            v(1)
        )));
        r.record("w-tp1", report(Some(v(2)), ""));
        let err = r.resident(&ws, None).unwrap_err();
        assert!(err.contains("disagree"), "{err}");
        r.record(
            "w-tp1",
            report(Some(v(1)), "installing v2 failed: boom; restored v1"),
        );
        let err = r.resident(&ws, None).unwrap_err();
        assert!(
            err.contains(
                "w-tp1: the install failed in the engine (installing v2 failed: boom; restored v1)"
            ),
            "{err}"
        );
        r.forget("w-tp1");
        assert!(r.resident(&ws, None).is_err());
        assert_eq!(r.resident(&ws[..1], None), Ok(Some(v(1))));
    }
}
