//! The fleet can contradict the journal (issue 29, item 3).
//!
//! A journal shortened inside a line reads exactly like one whose last write a crash tore
//! ([`crate::journal`]): the journal alone cannot tell. The workers can: each knows what is
//! resident in its engine and which refit last called it. Every registration carries that
//! [`Testimony`]; the control plane compares it with the journal ([`judge`]) and, on any
//! [`Contradiction`], stops acting on the fleet ([`Halt`]): no refit starts, an open refit's
//! driver stops before its next phase or engine call (a refit recovered after a restart waits
//! for its workers' testimony first, [`crate::snapshot::Compaction::testimony_wait`]), and the
//! journal is not compacted. `GetStatus` says why and what to do, until an operator either
//! restores the journal and restarts, or accepts the journal as it stands (`AcceptJournal`, a
//! journaled record: the versions it could not name are accepted as unknown, refit ids go on
//! above the highest any worker saw, and an open refit is then settled as a restart would).
//!
//! What a worker can contradict:
//! - a resident mx version (`mx:<digest>`) no version of the journal has (its declaration is
//!   gone): the journal lost at least that version's records;
//! - a refit id above the journal's last refit (carried to engines in
//!   [`mx_adapters::REFIT_HEADER`]; mx's own routes remember the highest): the journal lost
//!   that refit;
//! - a leader epoch above this leader's ([`mx_adapters::EPOCH_HEADER`]): the store this leader
//!   read is older than one another leader wrote (an etcd restored from a backup), or this
//!   leader is deposed.
//!
//! What it cannot: a journal cut inside the refit that last called the fleet (the worker's
//! testimony matches the journal's open refit, which is then settled as after a crash), and
//! engines mx does not run (vLLM's HTTP server passes no header to the mx backend, so a vLLM
//! worker testifies its resident version but no refit id).

use mx_layout::{ResidentVersion, VersionId};

use crate::state::State;

/// What a registering worker says it has seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Testimony {
    /// The worker.
    pub worker_id: String,
    /// What is resident in its engine (`None`: nothing yet).
    pub resident: Option<ResidentVersion>,
    /// The highest refit id that called its engine (0: none, or an engine that cannot tell).
    pub last_refit: u64,
    /// The highest control-plane leader epoch it has seen (0: none).
    pub epoch: u64,
}

/// One way a worker's testimony contradicts the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contradiction {
    /// The worker holds an mx version the journal never declared.
    UnknownResident {
        /// The worker.
        worker_id: String,
        /// Its resident version.
        version: VersionId,
    },
    /// A refit called the worker's engine that the journal does not hold.
    RefitBeyond {
        /// The worker.
        worker_id: String,
        /// The refit id it saw.
        seen: u64,
        /// The journal's last refit id (0: none).
        journal: u64,
    },
    /// The worker saw a leader epoch above this leader's.
    EpochBeyond {
        /// The worker.
        worker_id: String,
        /// The epoch it saw.
        seen: u64,
        /// This leader's.
        ours: u64,
    },
}

impl Contradiction {
    /// The worker that testified.
    pub fn worker_id(&self) -> &str {
        match self {
            Contradiction::UnknownResident { worker_id, .. }
            | Contradiction::RefitBeyond { worker_id, .. }
            | Contradiction::EpochBeyond { worker_id, .. } => worker_id,
        }
    }
}

impl std::fmt::Display for Contradiction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Contradiction::UnknownResident { worker_id, version } => write!(
                f,
                "worker {worker_id} holds {version}, a version this journal never declared"
            ),
            Contradiction::RefitBeyond {
                worker_id,
                seen,
                journal,
            } => write!(
                f,
                "worker {worker_id} was called by refit {seen}; this journal's last refit is {journal}"
            ),
            Contradiction::EpochBeyond {
                worker_id,
                seen,
                ours,
            } => write!(
                f,
                "worker {worker_id} has seen leader epoch {seen}; this leader's is {ours}"
            ),
        }
    }
}

/// Compares `t` with the journal's state `s` (and this leader's `epoch`, when highly
/// available); every contradiction found, none when the testimony fits the journal.
pub fn judge(s: &State, epoch: Option<u64>, t: &Testimony) -> Vec<Contradiction> {
    let mut out = Vec::new();
    if let Some(v) = t.resident.as_ref().and_then(ResidentVersion::mx) {
        if !s.knows_version(v) {
            out.push(Contradiction::UnknownResident {
                worker_id: t.worker_id.clone(),
                version: v,
            });
        }
    }
    let last = s.next_refit_id() - 1;
    if t.last_refit > last {
        out.push(Contradiction::RefitBeyond {
            worker_id: t.worker_id.clone(),
            seen: t.last_refit,
            journal: last,
        });
    }
    if let Some(ours) = epoch {
        if t.epoch > ours {
            out.push(Contradiction::EpochBeyond {
                worker_id: t.worker_id.clone(),
                seen: t.epoch,
                ours,
            });
        }
    }
    out
}

/// What to tell an operator of a halted control plane.
pub const WHAT_TO_DO: &str = "nothing is staged, applied, committed or rolled back until an operator decides: restore the journal (a backup, or the lines a `.torn-*` file beside it holds) and restart the control plane, or accept the journal as it stands with `mx accept-journal --reason TEXT` (the workers' versions stay as they are, unknown to it, until a refit installs one)";

/// Why a control plane stopped acting on its fleet, from the first contradiction on.
#[derive(Debug, Clone, Default)]
pub struct Halt {
    /// Every contradiction heard, each once, in arrival order.
    pub contradictions: Vec<Contradiction>,
    /// When the first was heard, Unix ms.
    pub since_ms: u64,
    /// The open refit whose driver stopped for it (it goes on once the journal is accepted).
    pub stopped_refit: Option<u64>,
}

impl Halt {
    /// True while there is something to decide.
    pub fn halted(&self) -> bool {
        !self.contradictions.is_empty()
    }

    /// Adds `found` (each contradiction once); true when the halt begins with them.
    pub fn add(&mut self, found: Vec<Contradiction>, now_ms: u64) -> bool {
        let began = !self.halted() && !found.is_empty();
        if began {
            self.since_ms = now_ms;
        }
        for c in found {
            if !self.contradictions.contains(&c) {
                self.contradictions.push(c);
            }
        }
        began
    }

    /// The status line: what contradicts the journal and what to do (`None` when acting).
    pub fn reason(&self) -> Option<String> {
        if !self.halted() {
            return None;
        }
        let what: Vec<String> = self
            .contradictions
            .iter()
            .map(ToString::to_string)
            .collect();
        Some(format!(
            "the fleet contradicts the journal ({}): {WHAT_TO_DO}",
            what.join("; ")
        ))
    }

    /// The mx versions an acceptance of the journal takes as unknown, and the highest refit id
    /// any worker saw (refit ids go on above it).
    pub fn accepted(&self) -> (Vec<VersionId>, u64) {
        let mut versions = Vec::new();
        let mut refit = 0;
        for c in &self.contradictions {
            match c {
                Contradiction::UnknownResident { version, .. } => {
                    if !versions.contains(version) {
                        versions.push(*version);
                    }
                }
                Contradiction::RefitBeyond { seen, .. } => refit = refit.max(*seen),
                Contradiction::EpochBeyond { .. } => {}
            }
        }
        (versions, refit)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;
    use mx_layout::Digest;

    fn t(resident: Option<&str>, last_refit: u64, epoch: u64) -> Testimony {
        Testimony {
            worker_id: "w0".into(),
            resident: resident.map(ResidentVersion::parse),
            last_refit,
            epoch,
        }
    }

    #[test]
    fn only_what_the_journal_cannot_hold_contradicts_it() {
        let s = State::new();
        let unknown = VersionId(Digest([7; 32])).to_string();
        // Nothing resident, a label, no refit, no epoch: nothing to contradict.
        assert!(judge(&s, None, &t(None, 0, 0)).is_empty());
        assert!(judge(&s, None, &t(Some("boot"), 0, 0)).is_empty());
        // An epoch is compared only with a leader's.
        assert!(judge(&s, None, &t(None, 0, 9)).is_empty());
        assert!(judge(&s, Some(9), &t(None, 0, 9)).is_empty());
        let found = judge(&s, Some(4), &t(Some(&unknown), 3, 9));
        assert_eq!(
            found,
            vec![
                Contradiction::UnknownResident {
                    worker_id: "w0".into(),
                    version: VersionId(Digest([7; 32])),
                },
                Contradiction::RefitBeyond {
                    worker_id: "w0".into(),
                    seen: 3,
                    journal: 0,
                },
                Contradiction::EpochBeyond {
                    worker_id: "w0".into(),
                    seen: 9,
                    ours: 4,
                },
            ]
        );
        assert_eq!(
            found[1].to_string(),
            "worker w0 was called by refit 3; this journal's last refit is 0"
        );
        let mut h = Halt::default();
        assert!(h.reason().is_none());
        assert!(h.add(found.clone(), 5));
        assert!(
            !h.add(found, 6),
            "the same contradictions again add nothing"
        );
        assert_eq!(h.contradictions.len(), 3);
        assert_eq!(h.since_ms, 5);
        let why = h.reason().unwrap();
        assert!(
            why.contains("a version this journal never declared"),
            "{why}"
        );
        assert!(why.contains("mx accept-journal"), "{why}");
        assert_eq!(h.accepted(), (vec![VersionId(Digest([7; 32]))], 3));
    }

    #[test]
    fn an_accepted_journal_takes_the_versions_and_refit_ids_it_lost() {
        use crate::record::Record;
        let mut s = State::new();
        let lost = VersionId(Digest([7; 32]));
        let accept = |reason: &str| Record::AcceptJournal {
            versions: vec![lost],
            refit_floor: 3,
            reason: reason.into(),
            at_ms: 1,
        };
        assert!(s.check(&accept("")).is_err(), "a reason is required");
        assert!(s.check(&accept("cut\nby hand")).is_err(), "printable only");
        s.apply(accept("cut by hand")).unwrap();
        assert!(s.knows_version(lost));
        assert_eq!(s.next_refit_id(), 4, "refit ids go on above the ones lost");
        let back = t(Some(&lost.to_string()), 3, 0);
        assert!(
            judge(&s, None, &back).is_empty(),
            "the same testimony again"
        );
        assert_eq!(
            judge(&s, None, &t(None, 4, 0)),
            vec![Contradiction::RefitBeyond {
                worker_id: "w0".into(),
                seen: 4,
                journal: 3
            }]
        );
    }
}
