//! How each record changes the state: the larger transitions of [`State::apply`], one method
//! per record kind, each called only after [`State::check`] accepted the record.

use std::collections::HashMap;

use super::sources::is_extension;
use super::*;
use crate::refit::CallResult;

impl State {
    /// A version is declared: its layout and tensors, no sources yet.
    pub(super) fn apply_declare(
        &mut self,
        label: String,
        trainer_layout: LayoutSpec,
        tensors: Vec<TensorSpec>,
    ) -> Effects {
        let order = self.next_order;
        self.next_order += 1;
        self.versions.insert(
            label,
            Version {
                order,
                trainer_layout,
                tensors,
                slots: BTreeMap::new(),
                state: VersionState::Declared,
                digest: None,
                missing_tensors: Vec::new(),
                gaps: Vec::new(),
                commit_set: Vec::new(),
                before_refit: None,
                retired: BTreeMap::new(),
                stage_set: Vec::new(),
                stage_probe: ScanHint::default(),
                release: None,
                artifacts: Vec::new(),
                peers: BTreeMap::new(),
                revision: 0,
                expected: None,
            },
        );
        Effects::default()
    }

    /// A source's manifest for its slot (a first publish, an extension or a republish);
    /// older versions it overwrote in place are retired.
    pub(super) fn apply_publish(&mut self, label: String, manifest: SourceManifest) -> Effects {
        self.retire_overwritten(&label, &manifest);
        if let Some(v) = self.versions.get_mut(&label) {
            if let Some(held) = v.slots.get(&manifest.slot) {
                let counter = if is_extension(held, &manifest) {
                    &mut self.extensions
                } else {
                    &mut self.republishes
                };
                *counter.entry((label.clone(), manifest.slot)).or_default() += 1;
            }
            v.slots.insert(manifest.slot, manifest);
            v.revision = v.revision.wrapping_add(1);
            v.evaluate();
        }
        Effects::default()
    }

    /// A worker (a new or restarted process) registers: it serves nothing as a peer until
    /// it offers again, and the open refit holding it learns that it came back.
    pub(super) fn apply_register(&mut self, rec: Record) -> Effects {
        let Record::Register {
            worker_id,
            instance,
            ranks,
            layout,
            engine,
            resident_version,
            addresses,
        } = rec
        else {
            return Effects::default();
        };
        // A new process (or a restarted one) serves nothing it has not offered again.
        self.withdraw_peer(&worker_id, None);
        let command_seq = self.workers.get(&worker_id).map_or(0, |w| w.command_seq);
        let departed_from = self.workers.get(&worker_id).and_then(|w| w.departed_from);
        // What a worker reports is not what its engine was shown to hold: an engine another
        // worker id's refit reached stays unknown until it is read back, unless the worker
        // now registers another engine.
        let shares_engine = self
            .workers
            .get(&worker_id)
            .and_then(|w| w.shares_engine.clone())
            .filter(|s| addresses.contains(&s.address));
        // A new registration reports what is resident: a fence ends here, and the open
        // refit holding the worker learns that it re-registered (its staged copy and
        // its pinned previous version may be gone).
        if let Some(r) = self
            .refits
            .values_mut()
            .find(|r| r.outcome.is_none() && r.workers.contains_key(&worker_id))
        {
            if let Some(rw) = r.workers.get_mut(&worker_id) {
                rw.reregistered = Some(Rejoined {
                    resident: resident_version.clone(),
                });
            }
        }
        self.workers.insert(
            worker_id.clone(),
            Worker {
                instance,
                ranks,
                layout,
                state: WorkerState::Idle,
                label: None,
                digest: None,
                last_error: None,
                last_staged: None,
                engine,
                resident_id: resident_version,
                fenced_by: None,
                // A departed worker's engine may still be paused (it left before it was
                // resumed): registering again does not lift this; a settled refit does.
                departed_from,
                command_seq,
                addresses,
                shares_engine,
            },
        );
        Effects {
            workers: vec![worker_id],
        }
    }

    /// A worker's stage report: its state, its error (noting a version whose sources were
    /// overwritten), and the transfer in the open refit staging it.
    pub(super) fn apply_staged(&mut self, report: StagedReport) -> Effects {
        let label_of_report = report.label.clone();
        let retired = self.retired_by(&report.label);
        if let Some(w) = self.workers.get_mut(&report.worker_id) {
            if report.ok {
                w.state = WorkerState::Staged;
                w.last_error = None;
            } else {
                w.state = WorkerState::Failed;
                let mut err = if report.error.is_empty() {
                    "stage failed (no error given)".to_string()
                } else {
                    report.error.clone()
                };
                // A digest mismatch against overwritten sources is not corruption.
                if let Some((slot, by)) = retired.as_ref() {
                    err.push_str(&format!(
                        " (note: version {} can no longer be pulled: source slot {slot} now holds version {by} in the same memory, as a publisher that trains in place serves only its newest version; only workers that still hold {} can stage it)",
                        report.label, report.label
                    ));
                }
                w.last_error = Some(err);
            }
            // The open refit staging this worker records the transfer too.
            if let Some(r) = self.refits.values_mut().find(|r| {
                r.outcome.is_none() && r.phase == Phase::Stage && r.spec.label == report.label
            }) {
                if let Some(rw) = r.workers.get_mut(&report.worker_id) {
                    rw.stage_seconds = report.seconds;
                    rw.stage_bytes = report.bytes;
                }
            }
            w.last_staged = Some(report);
        }
        self.note_staged(&label_of_report);
        Effects::default()
    }

    /// Refit `id` enters `phase` at `at_ms`; leaving STAGE for anything but ABORT releases
    /// the version's sources ([`Release::Staged`]).
    pub(super) fn apply_refit_phase(
        &mut self,
        id: u64,
        phase: Phase,
        at_ms: u64,
        reason: String,
        recovered: bool,
    ) -> Effects {
        let mut staged_by = None;
        if let Some(r) = self.refits.get_mut(&id) {
            if r.phase == Phase::Stage && phase != Phase::Abort {
                let mut set = r.spec.worker_ids.clone();
                set.sort();
                staged_by = Some((r.spec.label.clone(), set));
            }
            r.phase = phase;
            r.phases.push((phase, at_ms));
            if !reason.is_empty() {
                r.reason = reason;
            }
            r.recovered |= recovered;
        }
        // Leaving STAGE for anything but ABORT: every worker of the set holds it.
        if let Some((label, workers)) = staged_by {
            if let Some(v) = self.versions.get_mut(&label) {
                v.release.get_or_insert(Release::Staged {
                    refit: Some(id),
                    workers,
                });
            }
        }
        Effects::default()
    }

    /// A worker's engine call in refit `id` answered: the result, and the resident version
    /// it reports (an APPLY that succeeded without one installed what was asked, as SGLang
    /// answers).
    pub(super) fn apply_worker_done(
        &mut self,
        id: u64,
        worker_id: String,
        result: CallResult,
    ) -> Effects {
        let mut learned = None;
        if let Some(w) = self
            .refits
            .get_mut(&id)
            .and_then(|r| r.workers.get_mut(&worker_id))
        {
            if let Some(c) = w.calls.last_mut() {
                if result.ok {
                    learned = match &c.action {
                        // SGLang answers no version: an update that succeeded installed
                        // what was asked.
                        Action::Apply { version } => {
                            Some(result.version.clone().unwrap_or_else(|| version.clone()))
                        }
                        Action::ReadVersion => result.version.clone(),
                        _ => None,
                    };
                }
                c.result = Some(result);
            }
            if let Some(v) = &learned {
                w.resident = Some(v.clone());
            }
        }
        if let (Some(v), Some(w)) = (learned, self.workers.get_mut(&worker_id)) {
            w.resident_id = Some(v);
        }
        Effects::default()
    }

    /// The end of refit `id` for its worker `set`: who is fenced (its memory unknown until it
    /// registers again) or departed (its engine may still be paused), and, once `settled`
    /// (committed or rolled back: every resident version was read back), who no longer is.
    /// Workers that left or are fenced serve nothing as peers.
    pub(super) fn settle_workers(
        &mut self,
        id: u64,
        set: &[String],
        settled: bool,
        fenced: &[String],
        departed: &[String],
    ) {
        // Committed and rolled back read every worker's resident version back; a fenced
        // worker's is unknown until it registers again. (Admission of every worker, in
        // the set or not, follows from the new fleet version: it is computed on read.)
        for wid in set {
            let Some(w) = self.workers.get_mut(wid) else {
                continue;
            };
            if fenced.contains(wid) {
                w.fenced_by = Some(id);
            } else if settled {
                w.fenced_by = None;
            }
            if departed.contains(wid) {
                w.departed_from = Some(id);
            } else if settled {
                w.departed_from = None;
            }
            if settled && !fenced.contains(wid) && !departed.contains(wid) {
                w.shares_engine = None;
            }
        }
        // A worker that left serves nothing; a fenced one's memory is unknown.
        for wid in departed.iter().chain(fenced) {
            self.withdraw_peer(wid, None);
        }
    }

    /// A refit begins: every worker outside its set whose engine shares an address with the
    /// engine of a worker in it is marked ([`SharedEngine`]): the refit's calls may change
    /// what that engine holds (one linear pass over the addresses).
    pub(super) fn mark_shared_engines(&mut self, refit: &Refit) {
        let mut reached: HashMap<&str, &str> = HashMap::new();
        for wid in refit.workers.keys() {
            if let Some(w) = self.workers.get(wid) {
                for a in &w.addresses {
                    reached.entry(a.as_str()).or_insert(wid.as_str());
                }
            }
        }
        if reached.is_empty() {
            return;
        }
        let marks: Vec<(String, SharedEngine)> = self
            .workers
            .iter()
            .filter(|(wid, _)| !refit.workers.contains_key(*wid))
            .filter_map(|(wid, w)| {
                w.addresses.iter().find_map(|a| {
                    reached.get(a.as_str()).map(|with| {
                        let mark = SharedEngine {
                            refit: refit.id,
                            with: (*with).to_string(),
                            address: a.clone(),
                        };
                        (wid.clone(), mark)
                    })
                })
            })
            .collect();
        for (wid, mark) in marks {
            if let Some(w) = self.workers.get_mut(&wid) {
                w.shares_engine = Some(mark);
            }
        }
    }

    /// Checks a [`Record::ReadBack`]: the worker is registered, and the refit that marked it
    /// has ended (a version read while it runs may change again). A read-back for an older
    /// mark, or for a worker no longer marked, changes nothing.
    pub(super) fn check_read_back(&self, worker_id: &str, refit: u64) -> Result<Check, Error> {
        let w = self.worker(worker_id)?;
        if w.shares_engine.as_ref().map(|s| s.refit) != Some(refit) {
            return Ok(Check::Noop);
        }
        if self.refits.get(&refit).is_some_and(|r| r.outcome.is_none()) {
            return Err(Error::Refit {
                id: refit,
                reason: format!(
                    "still open: worker {worker_id}'s engine is read back once it ends"
                ),
            });
        }
        Ok(Check::Apply)
    }

    /// The workers whose engines must be read back now ([`SharedEngine`], its refit ended),
    /// each with the refit that marked it; only those `refit` marked when given.
    pub fn read_backs_due(&self, refit: Option<u64>) -> Vec<(String, u64)> {
        self.workers
            .iter()
            .filter_map(|(wid, w)| {
                let s = w.shares_engine.as_ref()?;
                let open = self
                    .refits
                    .get(&s.refit)
                    .is_some_and(|r| r.outcome.is_none());
                (!open && refit.is_none_or(|r| r == s.refit)).then(|| (wid.clone(), s.refit))
            })
            .collect()
    }
}
