//! The control plane's state machine: pure, synchronous, no I/O.
//!
//! Every mutating call is a [`Record`]. [`State::check`] validates a record against the current
//! state without changing it and says whether it would change anything; [`State::apply`] checks
//! and then changes the state, all or nothing. The server checks, writes the record to the
//! journal (fsync), then applies it; a restarted server replays the journal through `apply`, so
//! the state it rebuilds is exactly the one it had.

use std::collections::{BTreeMap, BTreeSet};

use mx_layout::{
    version_digest, Digest, LayoutSpec, ResidentVersion, SourceManifest, TensorBox, TensorSpec,
    VersionId,
};
use serde::{Deserialize, Serialize};

use crate::fanout::Sources;
use crate::refit::{Action, EngineEndpoint, Outcome, Phase, Refit, Rejoined, WorkerCall};
use crate::types::{ArtifactKind, ArtifactRecord, PeerSource, Release};
use crate::types::{
    Command, CoverageGap, FleetStatus, FleetVersion, Gate, PublisherStatus, StagedReport,
    VersionInfo, VersionState, VersionSummary, WorkerState, WorkerStatus,
};
use crate::Error;

pub use crate::record::Record;

mod coverage;
mod sources;
mod transitions;

#[cfg(test)]
use coverage::first_gap;

/// What [`State::check`] decided about a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The record changes nothing (an identical re-declare, a stale staged report): do not
    /// journal.
    Noop,
    /// The record changes the state: journal it, then apply it.
    Apply,
}

/// What applying a record changed that others must hear about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    /// Workers whose pending command may have changed (wake their command streams).
    pub workers: Vec<String>,
}

/// A position to resume a scan at: a cache beside the state, so any two are equal (a state
/// rebuilt from the journal equals the live one whatever scans each ran) and it is never
/// serialized.
#[derive(Debug, Clone, Copy, Default)]
struct ScanHint(usize);

impl PartialEq for ScanHint {
    fn eq(&self, _: &ScanHint) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Version {
    order: u64,
    trainer_layout: LayoutSpec,
    tensors: Vec<TensorSpec>,
    slots: BTreeMap<u32, SourceManifest>,
    state: VersionState,
    digest: Option<Digest>,
    missing_tensors: Vec<String>,
    gaps: Vec<CoverageGap>,
    commit_set: Vec<String>,
    /// State before the open refit began (restored when it does not commit).
    before_refit: Option<VersionState>,
    /// Slots whose memory a later version of the same NIXL agent was published in (slot ->
    /// that version's label): this version can no longer be pulled from them.
    retired: BTreeMap<u32, String>,
    /// The worker set of the last Stage of it, sorted (a refit's STAGE journals one too).
    stage_set: Vec<String>,
    /// Where [`State::note_staged`] resumes its scan of `stage_set` (a cache, not state).
    #[serde(skip)]
    stage_probe: ScanHint,
    /// Whether its sources may stop serving it (the first reason reached sticks).
    release: Option<Release>,
    /// Its artifacts in object storage, in registration order.
    artifacts: Vec<ArtifactRecord>,
    /// Workers serving it from their memory: worker id -> manifest.
    peers: BTreeMap<String, SourceManifest>,
    /// Bumped by every publish into it (a cache over `slots` is stale once it moved).
    revision: u64,
    /// The outputs its trainer expects of it ([`Record::ExpectedOutputs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expected: Option<crate::check::GenerationCheck>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Worker {
    instance: String,
    ranks: Vec<u32>,
    layout: LayoutSpec,
    state: WorkerState,
    label: Option<String>,
    digest: Option<Digest>,
    last_error: Option<String>,
    last_staged: Option<StagedReport>,
    engine: Option<EngineEndpoint>,
    /// Version id resident in its live weights, as last learned (its registration, or a refit's
    /// APPLY answer or read-back). Admission is computed from it on every read
    /// ([`State::admission`]), never stored, so it cannot go stale.
    resident_id: Option<ResidentVersion>,
    /// The refit that fenced it (could not bring it back), until it registers again or a later
    /// refit of it commits or rolls back cleanly: what is resident is unknown meanwhile.
    fenced_by: Option<u64>,
    /// The refit it left (command stream closed, not back within the grace period) before
    /// that refit could settle it, until a later refit of it commits or rolls back cleanly:
    /// gated meanwhile, registrations included (its engine may still be paused).
    departed_from: Option<u64>,
    /// Increases every time a command is issued to this worker (kept across re-registration), so
    /// a command stream knows whether the pending command is new to it.
    command_seq: u64,
    /// The socket addresses its engine URL reaches ([`Record::Register`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    addresses: Vec<String>,
    /// A refit of other workers called an engine at an address its engine shares: what its
    /// engine holds is unknown until the control plane reads it back ([`Record::ReadBack`]) or
    /// a refit of it commits or rolls back cleanly. Gated meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shares_engine: Option<SharedEngine>,
}

/// Why a worker's engine must be read back before the worker is trusted again: refit `refit`
/// called worker `with`'s engine, which reaches `address` as this worker's does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SharedEngine {
    pub(crate) refit: u64,
    pub(crate) with: String,
    pub(crate) address: String,
}

pub use crate::observe::Tallies;

/// The whole control-plane state: versions by label, workers by id. Serialized whole in a
/// snapshot ([`crate::snapshot`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    versions: BTreeMap<String, Version>,
    next_order: u64,
    workers: BTreeMap<String, Worker>,
    pub(crate) refits: BTreeMap<u64, Refit>,
    next_refit: u64,
    /// The version the fleet last committed: (label, version id).
    fleet_version: Option<(String, VersionId)>,
    /// How many times each (version, slot) was published again with a different manifest
    /// (bounded by [`crate::limits::MAX_REPUBLISHES`]).
    #[serde(with = "crate::snapshot::pair_map")]
    republishes: BTreeMap<(String, u32), u32>,
    /// How many times each (version, slot) was extended with pieces for more destination
    /// layouts (bounded by [`crate::limits::MAX_PIECE_EXTENSIONS`]).
    #[serde(with = "crate::snapshot::pair_map")]
    extensions: BTreeMap<(String, u32), u32>,
    /// Resident mx versions an operator accepted as unknown when the fleet contradicted the
    /// journal ([`Record::AcceptJournal`]): they contradict it no more.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    accepted_unknown: BTreeSet<VersionId>,
    /// How many ended refits keep their per-worker detail (configuration, not state).
    #[serde(skip)]
    pub(crate) detail: crate::history::RefitDetail,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::InvalidField {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Refuses an empty or duplicated worker list; returns it sorted.
fn worker_set(worker_ids: &[String]) -> Result<Vec<String>, Error> {
    if worker_ids.is_empty() {
        return Err(invalid("worker_ids", "empty worker set"));
    }
    let mut seen = BTreeSet::new();
    for (i, w) in worker_ids.iter().enumerate() {
        if w.is_empty() {
            return Err(invalid(format!("worker_ids[{i}]"), "empty worker id"));
        }
        if !seen.insert(w.as_str()) {
            return Err(invalid(
                format!("worker_ids[{i}]"),
                format!("duplicate worker {w:?}"),
            ));
        }
    }
    Ok(seen.into_iter().map(str::to_string).collect())
}

fn shape_str(shape: &[u64]) -> String {
    format!("{shape:?}")
}

impl State {
    /// An empty state.
    pub fn new() -> State {
        State::default()
    }

    /// Validates `rec` against the current state without changing it.
    ///
    /// # Errors
    /// The error the call is refused with: [`Error::InvalidField`], [`Error::UnknownVersion`],
    /// [`Error::VersionExists`], [`Error::UnknownWorker`], [`Error::UndeclaredTensor`],
    /// [`Error::Mismatch`], [`Error::BadManifest`], [`Error::VersionState`] or
    /// [`Error::WorkerState`], each naming what is at fault.
    pub fn check(&self, rec: &Record) -> Result<Check, Error> {
        match rec {
            Record::PublishRef { label, .. } | Record::PeerRef { label, .. } => {
                Err(Error::InvalidField {
                    field: "record".into(),
                    reason: format!(
                        "a manifest reference of {label}: the journal resolves it against its blob store before the state sees it"
                    ),
                })
            }
            Record::Declare {
                label,
                trainer_layout,
                tensors,
            } => self.check_declare(label, trainer_layout, tensors),
            Record::Publish { label, manifest } => self.check_publish(label, manifest),
            Record::Release { label, slot } => {
                let v = self.version(label)?;
                if *slot >= v.trainer_layout.world_size {
                    return Err(invalid(
                        "slot",
                        format!(
                            "slot {slot} is out of range 0..{} of trainer layout {}",
                            v.trainer_layout.world_size, v.trainer_layout
                        ),
                    ));
                }
                Ok(if v.release.is_some() {
                    Check::Noop
                } else {
                    Check::Apply
                })
            }
            Record::Artifact { label, artifact } => self.check_artifact(label, artifact),
            Record::ExpectedOutputs { label, outputs } => {
                let v = self.version(label)?;
                outputs
                    .validate()
                    .map_err(|(f, reason)| invalid(format!("outputs.{f}"), reason))?;
                match &v.expected {
                    None => Ok(Check::Apply),
                    Some(had) if had == outputs => Ok(Check::Noop),
                    Some(_) => Err(Error::VersionState {
                        label: label.clone(),
                        state: v.state,
                        reason: "its expected outputs are already published, and a version's expected outputs do not change: publish the new weights as a new version".into(),
                    }),
                }
            }
            Record::Peer {
                label,
                worker_id,
                manifest,
            } => self.check_peer(label, worker_id, manifest),
            Record::PeerWithdraw { worker_id, label } => {
                Ok(if self.serving(worker_id, label.as_deref()) {
                    Check::Apply
                } else {
                    Check::Noop
                })
            }
            Record::Register {
                worker_id,
                ranks,
                layout,
                ..
            } => check_register(worker_id, ranks, layout),
            Record::Retire {
                worker_id, reason, ..
            } => self.check_retire(worker_id, reason),
            Record::ReadBack {
                worker_id, refit, ..
            } => self.check_read_back(worker_id, *refit),
            Record::TokensReloaded { file_digest, .. } => {
                if file_digest.len() == 64 && file_digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(Check::Apply)
                } else {
                    Err(invalid("file_digest", "not 64 hex digits"))
                }
            }
            Record::AcceptJournal {
                versions, reason, ..
            } => {
                crate::limits::text("reason", reason)?;
                if reason.is_empty() {
                    return Err(invalid("reason", "empty: say why the journal stands"));
                }
                if versions.len() > crate::limits::MAX_ACCEPTED_VERSIONS {
                    return Err(invalid(
                        "versions",
                        format!(
                            "{} versions: at most {} are accepted at once",
                            versions.len(),
                            crate::limits::MAX_ACCEPTED_VERSIONS
                        ),
                    ));
                }
                Ok(Check::Apply)
            }
            Record::Stage { label, worker_ids } => self.check_stage(label, worker_ids),
            Record::Staged { report } => self.check_staged(report),
            Record::RefitBegin { refit } => self.check_refit_begin(refit),
            Record::RefitPhase { id, phase, .. } => {
                let r = self.open_refit(*id)?;
                if phase_follows(r, *phase) {
                    Ok(Check::Apply)
                } else {
                    Err(Error::Refit {
                        id: *id,
                        reason: format!("phase {} cannot follow {}", phase, r.phase),
                    })
                }
            }
            Record::WorkerCalls { .. } | Record::WorkerResults { .. } => {
                rec.check_batch()?;
                for one in rec.per_worker().unwrap_or_default() {
                    self.check(&one)?;
                }
                Ok(Check::Apply)
            }
            Record::WorkerCall { id, worker_id, .. } => {
                let r = self.open_refit(*id)?;
                let w = refit_worker(r, worker_id)?;
                if w.calls.last().is_some_and(|c| c.result.is_none()) {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("worker {worker_id} already has a call in flight"),
                    });
                }
                Ok(Check::Apply)
            }
            Record::WorkerDone { id, worker_id, .. } => {
                let r = self.open_refit(*id)?;
                let w = refit_worker(r, worker_id)?;
                if w.calls.last().is_none_or(|c| c.result.is_some()) {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("worker {worker_id} has no call in flight"),
                    });
                }
                Ok(Check::Apply)
            }
            Record::RefitEnd {
                id,
                outcome,
                fenced,
                departed,
                ..
            } => {
                let r = self.open_refit(*id)?;
                if let Some(w) = departed.iter().find(|w| !r.workers.contains_key(*w)) {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("departed worker {w} is not in the refit's set"),
                    });
                }
                if !fenced.is_empty() && *outcome != Outcome::Fenced {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("outcome {outcome} fences no worker"),
                    });
                }
                if let Some(w) = fenced.iter().find(|w| !r.workers.contains_key(*w)) {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("fenced worker {w} is not in the refit's set"),
                    });
                }
                let fits = match outcome {
                    Outcome::Committed => r.phase == Phase::Commit,
                    Outcome::Aborted => r.phase == Phase::Abort,
                    Outcome::RolledBack => r.phase == Phase::Rollback,
                    Outcome::Fenced => matches!(r.phase, Phase::Abort | Phase::Rollback),
                };
                if !fits {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("outcome {outcome} cannot end phase {}", r.phase),
                    });
                }
                if let Some((w, _)) = r
                    .workers
                    .iter()
                    .find(|(_, w)| w.calls.last().is_some_and(|c| c.result.is_none()))
                {
                    return Err(Error::Refit {
                        id: *id,
                        reason: format!("worker {w} still has a call in flight"),
                    });
                }
                Ok(Check::Apply)
            }
        }
    }

    /// Checks `rec` and applies it: all or nothing.
    ///
    /// # Errors
    /// As [`State::check`]; on error the state is unchanged.
    pub fn apply(&mut self, rec: Record) -> Result<Effects, Error> {
        if self.check(&rec)? == Check::Noop {
            return Ok(Effects::default());
        }
        let effects = match rec {
            // Refused by the check above.
            Record::PublishRef { .. } | Record::PeerRef { .. } => Effects::default(),
            // Checked whole above, and no worker twice: each per-worker record passes its own.
            r @ (Record::WorkerCalls { .. } | Record::WorkerResults { .. }) => {
                for one in r.per_worker().unwrap_or_default() {
                    self.apply(one)?;
                }
                Effects::default()
            }
            Record::Declare {
                label,
                trainer_layout,
                tensors,
            } => self.apply_declare(label, trainer_layout, tensors),
            Record::Publish { label, manifest } => self.apply_publish(label, manifest),
            Record::Release { label, slot } => {
                if let Some(v) = self.versions.get_mut(&label) {
                    v.release.get_or_insert(Release::Source { slot });
                }
                Effects::default()
            }
            Record::Artifact { label, artifact } => {
                if let Some(v) = self.versions.get_mut(&label) {
                    if !v.artifacts.iter().any(|a| a.url == artifact.url) {
                        v.artifacts.push(artifact);
                    }
                }
                Effects::default()
            }
            Record::ExpectedOutputs { label, outputs } => {
                if let Some(v) = self.versions.get_mut(&label) {
                    v.expected = Some(outputs);
                }
                Effects::default()
            }
            Record::Peer {
                label,
                worker_id,
                manifest,
            } => {
                if let Some(v) = self.versions.get_mut(&label) {
                    v.peers.insert(worker_id, manifest);
                }
                Effects::default()
            }
            Record::PeerWithdraw { worker_id, label } => {
                self.withdraw_peer(&worker_id, label.as_deref());
                Effects::default()
            }
            r @ Record::Register { .. } => self.apply_register(r),
            Record::ReadBack {
                worker_id,
                resident_version,
                ..
            } => {
                if let Some(w) = self.workers.get_mut(&worker_id) {
                    w.shares_engine = None;
                    w.resident_id = resident_version;
                }
                Effects {
                    workers: vec![worker_id],
                }
            }
            Record::Retire { worker_id, .. } => {
                self.withdraw_peer(&worker_id, None);
                self.workers.remove(&worker_id);
                Effects {
                    workers: vec![worker_id],
                }
            }
            // Who may call changed; the fleet's state did not (the record is the audit trail).
            Record::TokensReloaded { .. } => Effects::default(),
            Record::AcceptJournal {
                versions,
                refit_floor,
                ..
            } => {
                self.accepted_unknown.extend(versions);
                self.next_refit = self.next_refit.max(refit_floor.saturating_add(1));
                Effects::default()
            }
            Record::Stage { label, worker_ids } => {
                let digest = self.versions.get(&label).and_then(|v| v.digest);
                if let Some(v) = self.versions.get_mut(&label) {
                    let mut set = worker_ids.clone();
                    set.sort();
                    v.stage_set = set;
                    v.stage_probe = ScanHint::default();
                }
                for id in &worker_ids {
                    if let Some(w) = self.workers.get_mut(id) {
                        w.state = WorkerState::Staging;
                        w.label = Some(label.clone());
                        w.digest = digest;
                        w.last_error = None;
                        w.command_seq += 1;
                    }
                }
                Effects {
                    workers: worker_ids,
                }
            }
            Record::Staged { report } => self.apply_staged(report),
            Record::RefitBegin { refit } => {
                let refit = *refit;
                self.next_refit = refit.id + 1;
                if let Some(v) = self.versions.get_mut(&refit.spec.label) {
                    v.before_refit = Some(v.state);
                    v.state = VersionState::Committing;
                    v.commit_set = refit.spec.worker_ids.clone();
                }
                self.mark_shared_engines(&refit);
                self.refits.insert(refit.id, refit);
                Effects::default()
            }
            Record::RefitPhase {
                id,
                phase,
                at_ms,
                reason,
                recovered,
            } => self.apply_refit_phase(id, phase, at_ms, reason, recovered),
            Record::WorkerCall {
                id,
                worker_id,
                action,
            } => {
                // Its memory is about to change: it stops being a source first.
                if matches!(action, Action::Apply { .. }) {
                    self.withdraw_peer(&worker_id, None);
                }
                if let Some(r) = self.refits.get_mut(&id) {
                    let phase = r.phase;
                    if let Some(w) = r.workers.get_mut(&worker_id) {
                        w.calls.push(WorkerCall {
                            action,
                            phase,
                            result: None,
                        });
                    }
                }
                Effects::default()
            }
            Record::WorkerDone {
                id,
                worker_id,
                result,
            } => self.apply_worker_done(id, worker_id, result),
            Record::RefitEnd {
                id,
                outcome,
                reason,
                at_ms,
                recovered,
                fenced,
                departed,
            } => {
                let Some(r) = self.refits.get_mut(&id) else {
                    return Ok(Effects::default());
                };
                r.outcome = Some(outcome);
                r.recovered |= recovered;
                r.ended_ms = Some(at_ms);
                // A committed refit has no reason (the phases' notes, such as its check's
                // summary, were progress, not why it ended).
                if outcome == Outcome::Committed || !reason.is_empty() {
                    r.reason = reason;
                }
                let label = r.spec.label.clone();
                let target = r.target;
                let set = r.spec.worker_ids.clone();
                if outcome == Outcome::Committed {
                    self.fleet_version = Some((label.clone(), target));
                }
                self.note_refit_end(&label, id, outcome);
                if let Some(v) = self.versions.get_mut(&label) {
                    let before = v.before_refit.take().unwrap_or(VersionState::Ready);
                    v.state = if outcome == Outcome::Committed {
                        VersionState::Committed
                    } else {
                        before
                    };
                }
                let settled = matches!(outcome, Outcome::Committed | Outcome::RolledBack);
                self.settle_workers(id, &set, settled, &fenced, &departed);
                crate::history::trim(&mut self.refits, self.detail);
                Effects::default()
            }
        };
        Ok(effects)
    }

    /// After a staged report for `label`: when every worker of its last Stage is STAGED for it,
    /// its sources are released ([`Release::Staged`], with the open refit staging it, if any).
    fn note_staged(&mut self, label: &str) {
        let Some(v) = self.versions.get(label) else {
            return;
        };
        if v.release.is_some() || v.stage_set.is_empty() {
            return;
        }
        // Every member is checked before the version is called staged, starting where the
        // last scan found one that was not: as reports arrive that member is usually still
        // pulling, so a report costs O(1) and the whole stage O(set) instead of O(set^2).
        let n = v.stage_set.len();
        let start = v.stage_probe.0 % n;
        let pending = (start..n).chain(0..start).find(|&i| {
            !self.workers.get(&v.stage_set[i]).is_some_and(|w| {
                w.state == WorkerState::Staged && w.label.as_deref() == Some(label)
            })
        });
        if let Some(i) = pending {
            if let Some(v) = self.versions.get_mut(label) {
                v.stage_probe = ScanHint(i);
            }
            return;
        }
        let refit = self
            .refits
            .values()
            .find(|r| r.outcome.is_none() && r.phase == Phase::Stage && r.spec.label == label)
            .map(|r| r.id);
        let workers = v.stage_set.clone();
        if let Some(v) = self.versions.get_mut(label) {
            v.release = Some(Release::Staged { refit, workers });
        }
    }

    /// After refit `id` to `label` ended with `outcome`: a refit that did not commit releases
    /// the version (unless a stage of it completed before); a commit supersedes every version
    /// declared before it.
    fn note_refit_end(&mut self, label: &str, id: u64, outcome: Outcome) {
        let Some(order) = self.versions.get(label).map(|v| v.order) else {
            return;
        };
        if outcome == Outcome::Committed {
            for v in self.versions.values_mut().filter(|v| v.order < order) {
                v.release.get_or_insert_with(|| Release::Superseded {
                    by: label.to_string(),
                });
            }
        } else if let Some(v) = self.versions.get_mut(label) {
            v.release
                .get_or_insert(Release::RefitEnded { refit: id, outcome });
        }
    }

    /// Whether (and why) the sources of `label` may stop serving it; `None` when not declared
    /// or not released.
    pub fn release_of(&self, label: &str) -> Option<Release> {
        self.versions.get(label)?.release.clone()
    }

    /// Whether worker `worker_id` may take rollouts as far as the durable state knows, and why
    /// not: [`State::gate`] as (admitted, reason).
    pub fn admission(&self, worker_id: &str) -> (bool, String) {
        match self.gate(worker_id) {
            None => (true, String::new()),
            Some((_, why)) => (false, why),
        }
    }

    /// Why worker `worker_id` may not take rollouts as far as the durable state knows (`None`
    /// when it may): the invariant, recomputed on every read. A worker is admitted only when its
    /// resident version (as its engine last reported it) is the fleet's committed version, no
    /// open refit holds it, and no refit fenced it. Connectivity is not state: the server also
    /// requires an open command stream ([`FleetStatus`] as served, [`Gate::Disconnected`]).
    /// Every reason names the command that clears it. An unregistered id is
    /// [`Gate::NoWeights`].
    pub fn gate(&self, worker_id: &str) -> Option<(Gate, String)> {
        let Some(w) = self.workers.get(worker_id) else {
            return Some((
                Gate::NoWeights,
                format!("worker {worker_id} is not registered"),
            ));
        };
        let (resident, fenced_by) = (w.resident_id.as_ref(), w.fenced_by);
        // The command that brings it to the fleet's version (every gated state names it).
        let join = match &self.fleet_version {
            Some((label, _)) => format!("mx refit --label {label} --workers {worker_id} --join"),
            None => format!("mx refit --label LABEL --workers {worker_id}"),
        };
        if let Some(r) = self.open_refit_of(worker_id) {
            return Some((
                Gate::InRefit,
                format!(
                    "refit {} to {} in progress (mx status shows its phase)",
                    r.id, r.spec.label
                ),
            ));
        }
        if let Some(id) = w.departed_from {
            return Some((
                Gate::Departed,
                format!(
                    "left during refit {id} before it could be settled (its engine may still be paused); admitted again once a refit of it commits or rolls back cleanly: `{join}`"
                ),
            ));
        }
        if let Some(s) = &w.shares_engine {
            let when = if self
                .refits
                .get(&s.refit)
                .is_some_and(|r| r.outcome.is_none())
            {
                "once the refit ends, the control plane reads its engine's version back".to_string()
            } else {
                format!("the control plane reads its engine's version back when the worker registers again; or `{join}`")
            };
            return Some((
                Gate::EngineUnread,
                format!(
                    "refit {} called the engine of worker {}, which reaches {} as this worker's engine does: what its engine holds is unknown until it is read back ({when})",
                    s.refit, s.with, s.address
                ),
            ));
        }
        if let Some(id) = fenced_by {
            return Some((
                Gate::Fenced,
                format!(
                    "fenced by refit {id}: it could not be brought back, so what is resident is unknown; admitted again when it registers anew (restart it) reporting the committed version, or `{join}`"
                ),
            ));
        }
        match (&self.fleet_version, resident) {
            (_, None) => Some((Gate::NoWeights, format!("no weights resident: `{join}`"))),
            (None, Some(v)) => Some((
                Gate::Stale,
                format!("stale: resident {v}, but the fleet has committed no version: `{join}`"),
            )),
            (Some((_, fleet)), Some(v)) if v.is(*fleet) => None,
            (Some((label, fleet)), Some(v)) => Some((
                Gate::Stale,
                format!("stale: resident {v}, the fleet committed {label} ({fleet}): `{join}`"),
            )),
        }
    }

    /// The open refit whose set holds `worker_id`.
    fn open_refit_of(&self, worker_id: &str) -> Option<&Refit> {
        self.refits
            .values()
            .find(|r| r.outcome.is_none() && r.workers.contains_key(worker_id))
    }

    fn open_refit(&self, id: u64) -> Result<&Refit, Error> {
        match self.refits.get(&id) {
            Some(r) if r.outcome.is_none() => Ok(r),
            Some(r) => Err(Error::Refit {
                id,
                reason: format!(
                    "already ended {}",
                    r.outcome.map_or_else(String::new, |o| o.to_string())
                ),
            }),
            None => Err(Error::Refit {
                id,
                reason: "no such refit".to_string(),
            }),
        }
    }

    fn check_refit_begin(&self, r: &Refit) -> Result<Check, Error> {
        if let Some(open) = self.refits.values().find(|r| r.outcome.is_none()) {
            return Err(Error::Refit {
                id: r.id,
                reason: format!(
                    "refit {} to {} is still open (one refit at a time)",
                    open.id, open.spec.label
                ),
            });
        }
        if r.id != self.next_refit.max(1) {
            return Err(Error::Refit {
                id: r.id,
                reason: format!("refit ids go in order: expected {}", self.next_refit.max(1)),
            });
        }
        let v = self.version(&r.spec.label)?;
        if !matches!(v.state, VersionState::Ready | VersionState::Committed)
            || v.digest != Some(r.digest)
        {
            return Err(Error::VersionState {
                label: r.spec.label.clone(),
                state: v.state,
                reason: "a refit needs a READY (or once committed) version with this digest"
                    .to_string(),
            });
        }
        if r.workers.is_empty() {
            return Err(Error::Refit {
                id: r.id,
                reason: "empty worker set: a refit that commits on no worker would leave every worker stale".into(),
            });
        }
        for id in r.workers.keys() {
            self.worker(id)?;
        }
        Ok(Check::Apply)
    }

    /// The open refit, if any.
    pub fn open_refit_id(&self) -> Option<u64> {
        self.refits
            .values()
            .find(|r| r.outcome.is_none())
            .map(|r| r.id)
    }

    /// A refit by id.
    pub fn refit(&self, id: u64) -> Option<&Refit> {
        self.refits.get(&id)
    }

    /// The id the next refit must have.
    pub fn next_refit_id(&self) -> u64 {
        self.next_refit.max(1)
    }

    /// Every refit, ascending id.
    pub fn refits(&self) -> impl Iterator<Item = &Refit> {
        self.refits.values()
    }

    /// The version the fleet last committed: (label, version id).
    pub fn fleet_version(&self) -> Option<&(String, VersionId)> {
        self.fleet_version.as_ref()
    }

    /// When `label` can no longer be pulled from its sources: (slot, label of the version whose
    /// publication reused that slot's memory), the lowest such slot. Workers still holding the
    /// version (resident or pinned) can stage it without a pull, so this is not a refusal: a
    /// failed stage of such a version says why.
    pub fn retired_by(&self, label: &str) -> Option<(u32, String)> {
        self.versions
            .get(label)?
            .retired
            .iter()
            .next()
            .map(|(s, by)| (*s, by.clone()))
    }

    /// Whether `worker_id` is registered and admitted to rollouts (see [`State::admission`]).
    pub fn worker_admitted(&self, worker_id: &str) -> bool {
        self.admission(worker_id).0
    }

    /// Counts for the control plane's gauges: workers by stage state, how many of them
    /// `connected` says have a command stream open, how many of those are admitted
    /// ([`State::admission`]) and every other worker by its [`Gate`], and versions by state. Reads the state only (no copies of
    /// records), so a scrape of a 10,000-worker fleet stays cheap.
    pub fn tallies(&self, connected: impl Fn(&str) -> bool) -> Tallies {
        let mut t = Tallies::default();
        for (id, w) in &self.workers {
            *t.workers.entry(w.state).or_default() += 1;
            let gate = self.gate(id).map(|(g, _)| g);
            // As the served status judges it: a gate the state holds first, then the stream.
            let gate = if connected(id) {
                t.connected += 1;
                gate
            } else {
                Some(gate.unwrap_or(Gate::Disconnected))
            };
            match gate {
                None => t.admitted += 1,
                Some(g) => *t.gated.entry(g).or_default() += 1,
            }
        }
        for v in self.versions.values() {
            *t.versions.entry(v.state).or_default() += 1;
        }
        t.refit_open = self.open_refit_id().is_some();
        t
    }

    /// A worker's engine endpoint and resident version id.
    pub fn worker_engine(
        &self,
        worker_id: &str,
    ) -> Option<(Option<EngineEndpoint>, Option<ResidentVersion>)> {
        self.workers
            .get(worker_id)
            .map(|w| (w.engine.clone(), w.resident_id.clone()))
    }

    /// Checks a [`Record::Retire`]: the worker is registered and in no open refit (the refit
    /// settles it first); the reason is printable.
    fn check_retire(&self, worker_id: &str, reason: &str) -> Result<Check, Error> {
        if !self.workers.contains_key(worker_id) {
            return Err(Error::UnknownWorker {
                worker_id: worker_id.to_string(),
            });
        }
        if let Some(r) = self.open_refit_of(worker_id) {
            return Err(Error::Refit {
                id: r.id,
                reason: format!(
                    "worker {worker_id} is in this open refit to {}: it is retired only once the refit ended",
                    r.spec.label
                ),
            });
        }
        if !reason.is_empty() {
            crate::limits::text("reason", reason)?;
        }
        Ok(Check::Apply)
    }

    /// True when `v` is the version id of a declared version (READY once), or one an operator
    /// accepted as unknown ([`Record::AcceptJournal`]).
    pub fn knows_version(&self, v: VersionId) -> bool {
        self.accepted_unknown.contains(&v) || self.versions.values().any(|x| x.digest == Some(v.0))
    }

    /// The ids of every registered worker (ascending).
    pub fn worker_ids(&self) -> Vec<String> {
        self.workers.keys().cloned().collect()
    }

    /// The inference instance `worker_id` registered in, if it is registered.
    pub fn worker_instance(&self, worker_id: &str) -> Option<&str> {
        self.workers.get(worker_id).map(|w| w.instance.as_str())
    }

    fn version(&self, label: &str) -> Result<&Version, Error> {
        self.versions
            .get(label)
            .ok_or_else(|| Error::UnknownVersion {
                label: label.to_string(),
            })
    }

    fn worker(&self, worker_id: &str) -> Result<&Worker, Error> {
        self.workers
            .get(worker_id)
            .ok_or_else(|| Error::UnknownWorker {
                worker_id: worker_id.to_string(),
            })
    }

    fn check_declare(
        &self,
        label: &str,
        trainer_layout: &LayoutSpec,
        tensors: &[TensorSpec],
    ) -> Result<Check, Error> {
        crate::limits::declaration(label, trainer_layout, tensors)?;
        let mut names = BTreeSet::new();
        for (i, t) in tensors.iter().enumerate() {
            if t.name.is_empty() {
                return Err(invalid(format!("tensors[{i}].name"), "empty tensor name"));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(
                    format!("tensors[{i}].name"),
                    format!("duplicate tensor {}", t.name),
                ));
            }
        }
        match self.versions.get(label) {
            None => Ok(Check::Apply),
            Some(v) if v.trainer_layout == *trainer_layout && v.tensors == tensors => {
                Ok(Check::Noop)
            }
            Some(v) => Err(Error::VersionExists {
                label: label.to_string(),
                reason: if v.trainer_layout != *trainer_layout {
                    format!(
                        "trainer layout {} (declared) vs {}",
                        v.trainer_layout, trainer_layout
                    )
                } else {
                    "different tensor list".to_string()
                },
            }),
        }
    }

    fn check_stage(&self, label: &str, worker_ids: &[String]) -> Result<Check, Error> {
        let v = self.version(label)?;
        // COMMITTING: a refit stages it; COMMITTED: a refit back to it (or a late worker).
        if !matches!(
            v.state,
            VersionState::Ready | VersionState::Committing | VersionState::Committed
        ) {
            return Err(Error::VersionState {
                label: label.to_string(),
                state: v.state,
                reason: "stage needs a READY version".to_string(),
            });
        }
        worker_set(worker_ids)?;
        for id in worker_ids {
            self.worker(id)?;
        }
        Ok(Check::Apply)
    }

    fn check_staged(&self, r: &StagedReport) -> Result<Check, Error> {
        let w = self.worker(&r.worker_id)?;
        let ok_state = matches!(w.state, WorkerState::Staging | WorkerState::Staged);
        if ok_state && w.label.as_deref() != Some(r.label.as_str()) {
            // A newer Stage superseded this one while the worker was pulling: the late report
            // is dropped (not journaled); the worker is sent the newer Stage next.
            tracing::info!(
                worker = r.worker_id,
                label = r.label,
                "stale staged report dropped"
            );
            return Ok(Check::Noop);
        }
        if !ok_state || w.label.as_deref() != Some(r.label.as_str()) {
            return Err(w.state_error(
                &r.worker_id,
                &format!(
                    "a staged report for {:?} needs the worker STAGING it",
                    r.label
                ),
            ));
        }
        self.version(&r.label)?;
        Ok(Check::Apply)
    }

    /// The command outstanding for a worker, with its sequence number: `Stage` while STAGING,
    /// none otherwise (or when unknown).
    pub fn pending_command(&self, worker_id: &str) -> Option<(u64, Command)> {
        let w = self.workers.get(worker_id)?;
        if w.state != WorkerState::Staging {
            return None;
        }
        let cmd = Command::Stage {
            label: w.label.clone()?,
            version_digest: w.digest?,
        };
        Some((w.command_seq, cmd))
    }

    /// The open refit whose worker set holds `worker_id`, if any: `(refit id, label)`.
    pub fn open_refit_of_worker(&self, worker_id: &str) -> Option<(u64, String)> {
        self.open_refit_of(worker_id)
            .map(|r| (r.id, r.spec.label.clone()))
    }

    /// True when `worker_id` is registered.
    pub fn has_worker(&self, worker_id: &str) -> bool {
        self.workers.contains_key(worker_id)
    }

    /// The label of mx version `version`, `None` for another label or when no declared version
    /// has that digest.
    pub fn label_of(&self, version: &ResidentVersion) -> Option<String> {
        let d = version.mx()?.digest();
        self.versions
            .iter()
            .find(|(_, v)| v.digest == Some(d))
            .map(|(l, _)| l.clone())
    }

    /// The state of a version, `None` when not declared.
    pub fn version_state(&self, label: &str) -> Option<VersionState> {
        self.versions.get(label).map(|v| v.state)
    }

    /// Everything known about a version, `None` when not declared. Its `missing_slots` has at
    /// most `world_size` entries, which [`State::check`] bounds by
    /// [`crate::limits::MAX_WORLD_SIZE`].
    pub fn version_info(&self, label: &str) -> Option<VersionInfo> {
        let (mut info, sources) = self.version_sources(label)?;
        info.manifests = sources.slots.values().cloned().collect();
        info.peers = sources
            .peers
            .iter()
            .map(|(w, m)| PeerSource {
                worker_id: w.clone(),
                manifest: m.clone(),
            })
            .collect();
        Some(info)
    }

    /// The outputs `label`'s trainer published for the post-update check, if any.
    pub fn expected_outputs(&self, label: &str) -> Option<&crate::check::GenerationCheck> {
        self.versions.get(label)?.expected.as_ref()
    }

    /// [`State::version_info`] with its manifests and peers left empty, and those by
    /// reference, for an answer that selects from them ([`crate::fanout`]).
    pub(crate) fn version_sources(&self, label: &str) -> Option<(VersionInfo, Sources<'_>)> {
        let v = self.versions.get(label)?;
        let published_slots: Vec<u32> = v.slots.keys().copied().collect();
        let missing_slots = (0..v.trainer_layout.world_size)
            .filter(|s| !v.slots.contains_key(s))
            .collect();
        let info = VersionInfo {
            label: label.to_string(),
            state: v.state,
            trainer_layout: v.trainer_layout,
            tensors: v.tensors.clone(),
            version_digest: v.digest,
            published_slots,
            missing_slots,
            missing_tensors: v.missing_tensors.clone(),
            coverage_gaps: v.gaps.clone(),
            manifests: Vec::new(),
            commit_workers: v.commit_set.clone(),
            release: v.release.clone(),
            artifacts: v.artifacts.clone(),
            peers: Vec::new(),
            proof: None,
            expected_outputs: v.expected.clone(),
        };
        let sources = Sources {
            revision: v.revision,
            slots: &v.slots,
            peers: &v.peers,
        };
        Some((info, sources))
    }

    /// (state, label) of a worker, `None` when not registered: [`State::worker_brief`] without
    /// copies, for probes that run after every change.
    pub fn worker_stage(&self, worker_id: &str) -> Option<(WorkerState, Option<&str>)> {
        self.workers
            .get(worker_id)
            .map(|w| (w.state, w.label.as_deref()))
    }

    /// (state, label, last error) of a worker, `None` when not registered.
    pub fn worker_brief(
        &self,
        worker_id: &str,
    ) -> Option<(WorkerState, Option<String>, Option<String>)> {
        self.workers
            .get(worker_id)
            .map(|w| (w.state, w.label.clone(), w.last_error.clone()))
    }

    /// The fleet status's line of every version (only those not yet released when
    /// `unreleased_only`: what the publisher gauges count), in declaration order; publishers'
    /// liveness unknown (not state).
    pub fn version_summaries(&self, unreleased_only: bool) -> Vec<VersionSummary> {
        let mut versions: Vec<(u64, VersionSummary)> = self
            .versions
            .iter()
            .filter(|(_, v)| !unreleased_only || v.release.is_none())
            .map(|(label, v)| (v.order, version_summary(label, v)))
            .collect();
        versions.sort_by_key(|(o, _)| *o);
        versions.into_iter().map(|(_, s)| s).collect()
    }

    /// The fleet's status. Publishers' liveness is the server's to fill in (it is not state):
    /// here every publisher is [`crate::Liveness::Unknown`].
    pub fn fleet_status(&self) -> FleetStatus {
        let labels: BTreeMap<Digest, &str> = self
            .versions
            .iter()
            .filter_map(|(l, v)| Some((v.digest?, l.as_str())))
            .collect();
        FleetStatus {
            versions: self.version_summaries(false),
            workers: self
                .workers
                .iter()
                .map(|(id, w)| (id, w, self.gate(id)))
                .map(|(id, w, gate)| WorkerStatus {
                    worker_id: id.clone(),
                    instance: w.instance.clone(),
                    ranks: w.ranks.clone(),
                    layout: w.layout,
                    state: w.state,
                    label: w.label.clone(),
                    version_digest: w.digest,
                    resident_version: w
                        .resident_id
                        .as_ref()
                        .and_then(ResidentVersion::mx)
                        .map(|v| v.digest()),
                    last_error: w.last_error.clone(),
                    last_staged: w.last_staged.clone(),
                    engine: w.engine.clone(),
                    resident_id: w.resident_id.clone(),
                    resident_label: w
                        .resident_id
                        .as_ref()
                        .and_then(ResidentVersion::mx)
                        .and_then(|v| labels.get(&v.digest()))
                        .map(|l| (*l).to_string()),
                    admitted: gate.is_none(),
                    admission: gate
                        .as_ref()
                        .map(|(_, why)| why.clone())
                        .unwrap_or_default(),
                    gate: gate.map(|(g, _)| g),
                    // Known to the server only (streams are not state).
                    connected: false,
                })
                .collect(),
            fleet_version: self.fleet_version.as_ref().map(|(label, id)| FleetVersion {
                label: label.clone(),
                version_id: *id,
            }),
            open_refit: self.open_refit_id(),
            halted: None,
        }
    }

    /// The distinct layouts of registered workers, sorted.
    pub fn layouts(&self) -> Vec<LayoutSpec> {
        let set: BTreeSet<LayoutSpec> = self.workers.values().map(|w| w.layout).collect();
        set.into_iter().collect()
    }
}

/// A version's line of the fleet status (its publishers' liveness unknown: not state).
fn version_summary(label: &str, v: &Version) -> VersionSummary {
    VersionSummary {
        label: label.to_string(),
        state: v.state,
        version_digest: v.digest,
        slots: v.trainer_layout.world_size,
        publishers: v
            .slots
            .iter()
            .map(|(slot, m)| PublisherStatus {
                slot: *slot,
                agent_name: m.agent_name.clone(),
                retired_by: v.retired.get(slot).cloned(),
                last_seen_ms: None,
                liveness: crate::types::Liveness::Unknown,
            })
            .collect(),
        peers: v.peers.keys().cloned().collect(),
        artifacts: v.artifacts.iter().map(|a| a.url.clone()).collect(),
        release: v.release.clone(),
    }
}

fn check_register(worker_id: &str, ranks: &[u32], layout: &LayoutSpec) -> Result<Check, Error> {
    if worker_id.is_empty() {
        return Err(invalid("worker_id", "empty worker id"));
    }
    if layout.world_size == 0 {
        return Err(invalid("layout.world_size", "must be >= 1"));
    }
    if ranks.is_empty() {
        return Err(invalid("ranks", "a worker holds at least one rank"));
    }
    let mut seen = BTreeSet::new();
    for (i, &r) in ranks.iter().enumerate() {
        if r >= layout.world_size {
            return Err(invalid(
                format!("ranks[{i}]"),
                format!("rank {r} is out of range for layout {layout}"),
            ));
        }
        if !seen.insert(r) {
            return Err(invalid(
                format!("ranks[{i}]"),
                format!("duplicate rank {r}"),
            ));
        }
    }
    Ok(Check::Apply)
}

/// Whether a refit in `r.phase` may enter `next`.
fn phase_follows(r: &Refit, next: Phase) -> bool {
    use Phase::*;
    match (r.phase, next) {
        (Stage, Prepare) | (Prepare, Apply) | (Apply, Verify) | (Verify, Resume) => true,
        (Resume, Check) | (Resume, Commit) | (Check, Commit) => true,
        (Stage, Verify) => r.verify_only(),
        (Stage | Prepare, Abort) => true,
        (Apply, Abort) => !r.past_no_return(),
        (Verify | Resume | Check, Abort) => r.verify_only() && !r.past_no_return(),
        (Apply | Verify | Resume | Check, Rollback) => true,
        _ => false,
    }
}

fn refit_worker<'a>(r: &'a Refit, worker_id: &str) -> Result<&'a crate::refit::RefitWorker, Error> {
    r.workers.get(worker_id).ok_or_else(|| Error::Refit {
        id: r.id,
        reason: format!("worker {worker_id} is not in the refit's set"),
    })
}

impl Worker {
    fn state_error(&self, worker_id: &str, reason: &str) -> Error {
        Error::WorkerState {
            worker_id: worker_id.to_string(),
            state: self.state,
            label: self.label.clone().unwrap_or_default(),
            reason: reason.to_string(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose
#[path = "state_tests.rs"]
mod tests;
