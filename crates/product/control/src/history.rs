//! How much refit history the state keeps (issue 17, item 5): every refit's per-worker detail
//! (each engine call and its result) grows the control plane by tens of megabytes per refit of
//! ten thousand workers. The last [`RefitDetail`] refits that ended keep it; older ones keep
//! their summary: id, label, target, outcome, phases and their times, reason, and the counts
//! of [`Trimmed`].
//!
//! Trimming happens when a refit ends ([`crate::state::State::apply`] of its END) and when the
//! limit is set ([`State::set_refit_detail`]), so replaying the journal rebuilds the same
//! history as the control plane kept live.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::refit::Refit;
use crate::state::State;

/// How many ended refits keep their per-worker detail (at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefitDetail(usize);

impl Default for RefitDetail {
    fn default() -> RefitDetail {
        RefitDetail(crate::snapshot::DEFAULT_REFIT_DETAIL)
    }
}

impl RefitDetail {
    /// Keeps the detail of the last `n` ended refits (`n` below 1 counts as 1: the refit that
    /// just ended is always told in full).
    pub fn new(n: usize) -> RefitDetail {
        RefitDetail(n.max(1))
    }

    /// How many.
    pub fn get(self) -> usize {
        self.0
    }
}

/// What a refit whose per-worker detail was dropped still counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trimmed {
    /// Workers in its set.
    pub workers: u64,
    /// Engine calls made.
    pub calls: u64,
    /// Calls that failed (or had no result).
    pub failed_calls: u64,
    /// Workers left out when it began (not connected).
    pub dropped: u64,
}

impl Trimmed {
    /// The counts of `r`'s detail.
    fn of(r: &Refit) -> Trimmed {
        let calls = r.workers.values().flat_map(|w| &w.calls);
        Trimmed {
            workers: r.workers.len() as u64,
            calls: calls.clone().count() as u64,
            failed_calls: calls
                .filter(|c| !c.result.as_ref().is_some_and(|x| x.ok))
                .count() as u64,
            dropped: r.dropped.len() as u64,
        }
    }
}

/// Drops the per-worker detail of every ended refit but the last `keep` (newest first; stops at
/// the first one already trimmed, as every older one is too).
pub(crate) fn trim(refits: &mut BTreeMap<u64, Refit>, keep: RefitDetail) {
    let mut ended = 0usize;
    for r in refits.values_mut().rev() {
        if r.outcome.is_none() {
            continue;
        }
        ended += 1;
        if ended <= keep.get() {
            continue;
        }
        if r.trimmed.is_some() {
            break;
        }
        r.trimmed = Some(Trimmed::of(r));
        r.workers = BTreeMap::new();
        r.spec.worker_ids = Vec::new();
        r.dropped = Vec::new();
    }
}

impl State {
    /// Keeps the per-worker detail of the last `keep` ended refits from now on, and drops it
    /// from older ones now.
    pub fn set_refit_detail(&mut self, keep: RefitDetail) {
        self.detail = keep;
        trim(&mut self.refits, keep);
    }
}
