//! The journaled records: every mutating call of the control plane is one [`Record`], checked
//! and applied by [`crate::state::State`] and written as one journal line ([`crate::journal`]).

use mx_layout::{LayoutSpec, ResidentVersion, SourceManifest, TensorSpec, VersionId};
use serde::{Deserialize, Serialize};

use crate::refit::{Action, CallResult, EngineEndpoint, Outcome, Phase, Refit};
use crate::types::{ArtifactRecord, StagedReport};

/// One mutating call, as journaled (one JSON object per journal line, tagged by `op`).
///
/// A version is committed only by a refit (`Refit*` and `Worker*` records). The `commit` and
/// `applied` records of the retired Commit / ReportApplied path are not records any more: a journal
/// holding them is refused on replay, naming the line ([`crate::journal`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Record {
    /// The orchestrator declares a version: source slots `0..trainer_layout.world_size` and the
    /// tensor list.
    Declare {
        /// Version label.
        label: String,
        /// Layout of the sources.
        trainer_layout: LayoutSpec,
        /// Declared tensors.
        tensors: Vec<TensorSpec>,
    },
    /// A source publishes (or republishes) its slot's manifest.
    Publish {
        /// Version label.
        label: String,
        /// The manifest (its `slot` names the slot).
        manifest: SourceManifest,
    },
    /// [`Record::Publish`] as a journal in etcd with a blob store holds it
    /// ([`crate::blobs`]): the manifest is in the blob store. Resolved into the publish it
    /// stands for when the journal is read; the state refuses it unresolved.
    PublishRef {
        /// Version label.
        label: String,
        /// The slot published.
        slot: u32,
        /// Where the manifest is.
        manifest: crate::blobs::BlobRef,
    },
    /// [`Record::Peer`] as a journal in etcd with a blob store holds it (see
    /// [`Record::PublishRef`]).
    PeerRef {
        /// Version label.
        label: String,
        /// The serving worker.
        worker_id: String,
        /// Where its manifest is.
        manifest: crate::blobs::BlobRef,
    },
    /// A source says it no longer serves a version (its memory may hold other bytes now).
    Release {
        /// Version label.
        label: String,
        /// The releasing slot.
        slot: u32,
    },
    /// An artifact of a READY version was written to object storage.
    Artifact {
        /// Version label.
        label: String,
        /// Where, its manifest's digest, and its base for a delta.
        artifact: ArtifactRecord,
    },
    /// The outputs a version's trainer expects of it ([`crate::check`]): every refit of the
    /// version checks against them unless it brings a check of its own or asks for none.
    ExpectedOutputs {
        /// Version label.
        label: String,
        /// The probes, their expected tokens and margins, and the tolerance.
        outputs: crate::check::GenerationCheck,
    },
    /// A worker that holds a version resident serves it from its memory.
    Peer {
        /// Version label.
        label: String,
        /// The serving worker.
        worker_id: String,
        /// Its manifest (its shards: regions of the version's record; its pieces).
        manifest: SourceManifest,
    },
    /// A worker stops serving a version (`label`), or every version (`None`), from its memory.
    PeerWithdraw {
        /// The worker.
        worker_id: String,
        /// The version; `None`: all.
        #[serde(default)]
        label: Option<String>,
    },
    /// A worker registers (or re-registers, which resets it to IDLE).
    Register {
        /// Worker id.
        worker_id: String,
        /// Instance name.
        instance: String,
        /// Ranks of `layout` it holds.
        ranks: Vec<u32>,
        /// Its inference layout.
        layout: LayoutSpec,
        /// Its engine routes (absent in journals written before engines were known).
        #[serde(default)]
        engine: Option<EngineEndpoint>,
        /// The version id resident in its live weights.
        #[serde(default)]
        resident_version: Option<ResidentVersion>,
        /// The socket addresses its engine URL reaches, as the control plane resolved them at
        /// registration (`host:port/path`, every spelling of one address one key; empty without
        /// an engine or in journals written before addresses were kept): which workers share an
        /// engine is state, so a refit's reach is known after a restart too.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        addresses: Vec<String>,
    },
    /// The control plane read a worker's engine's version back after refit `refit` called an
    /// engine at an address the worker's engine shares (another worker id's, issue 29): the
    /// worker is trusted again with what its engine answered.
    ReadBack {
        /// Worker id.
        worker_id: String,
        /// The refit whose engine calls reached an address of its engine.
        refit: u64,
        /// What the engine answered (`None`: it holds no version).
        #[serde(default)]
        resident_version: Option<ResidentVersion>,
        /// Unix ms.
        at_ms: u64,
    },
    /// A worker id is retired: its registration, admission and peer offers are forgotten (by
    /// the worker on clean exit, by an orchestrator, or by the retention rule for ids departed
    /// longer than the control plane's `retire_departed_after`).
    Retire {
        /// Worker id.
        worker_id: String,
        /// Why.
        reason: String,
        /// Unix ms.
        at_ms: u64,
    },
    /// The control plane read its token file again (`mx control` on SIGHUP): who may call it
    /// changed from here on. No secret is journaled.
    TokensReloaded {
        /// Principals in the file now in force.
        principals: u64,
        /// blake3 of that file (hex, 64 digits).
        file_digest: String,
        /// Unix ms.
        at_ms: u64,
    },
    /// An operator accepts the journal as it stands after the fleet contradicted it
    /// ([`crate::testimony`]): the versions workers hold that it never declared are taken as
    /// unknown (they contradict it no more), and refit ids go on above `refit_floor`.
    AcceptJournal {
        /// Resident mx versions accepted as unknown.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        versions: Vec<VersionId>,
        /// The highest refit id a worker saw (0: none beyond the journal's).
        #[serde(default)]
        refit_floor: u64,
        /// What was contradicted and why the operator accepted it, in words.
        reason: String,
        /// Unix ms.
        at_ms: u64,
    },
    /// The orchestrator asks workers to stage a READY version.
    Stage {
        /// Version label.
        label: String,
        /// Target workers.
        worker_ids: Vec<String>,
    },
    /// A worker reports a stage result.
    Staged {
        /// The report.
        report: StagedReport,
    },
    /// A refit begins (phase STAGE): the whole plan, every worker's previous version.
    RefitBegin {
        /// The refit as it starts.
        refit: Box<Refit>,
    },
    /// A refit enters a phase.
    RefitPhase {
        /// Refit id.
        id: u64,
        /// The new phase.
        phase: Phase,
        /// Unix ms.
        at_ms: u64,
        /// Why (for ABORT and ROLLBACK: the failure).
        #[serde(default)]
        reason: String,
        /// Entered by a control plane that recovered the refit after a restart.
        #[serde(default)]
        recovered: bool,
    },
    /// The control plane is about to call a worker's engine (written before the call).
    WorkerCall {
        /// Refit id.
        id: u64,
        /// Worker.
        worker_id: String,
        /// The call.
        action: Action,
    },
    /// The result of the worker's last call without one.
    WorkerDone {
        /// Refit id.
        id: u64,
        /// Worker.
        worker_id: String,
        /// The result.
        result: CallResult,
    },
    /// The control plane is about to make the same call to several workers' engines (written
    /// before the calls): [`Record::WorkerCall`] for each, in one record (issue 17: one line per
    /// batch instead of one per worker). At most [`MAX_BATCH_WORKERS`] workers.
    WorkerCalls {
        /// Refit id.
        id: u64,
        /// The call.
        action: Action,
        /// The workers, each at most once.
        worker_ids: Vec<String>,
    },
    /// The results of several workers' last calls: [`Record::WorkerDone`] for each, in one
    /// record. At most [`MAX_BATCH_WORKERS`] workers.
    WorkerResults {
        /// Refit id.
        id: u64,
        /// Each worker's result, each worker at most once.
        results: Vec<WorkerResult>,
    },
    /// A refit ends.
    RefitEnd {
        /// Refit id.
        id: u64,
        /// How.
        outcome: Outcome,
        /// Why it did not commit.
        #[serde(default)]
        reason: String,
        /// Unix ms.
        at_ms: u64,
        /// Ended by a control plane that recovered the refit after a restart.
        #[serde(default)]
        recovered: bool,
        /// FENCED only: the workers that could not be brought back. They stay gated (not
        /// admitted) until they register again and report what is resident.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        fenced: Vec<String>,
        /// Workers that left (their command stream closed and they did not register again
        /// within the grace period) before they could be settled: a process that is gone serves
        /// nothing, so they do not make the refit FENCED, but they stay gated (their engine
        /// may still be paused) until a later refit of them commits or rolls back cleanly.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        departed: Vec<String>,
    },
}

/// Most workers one [`Record::WorkerCalls`] or [`Record::WorkerResults`] names: a batch of
/// results stays far below the 1 MiB of one etcd entry ([`crate::ha::MAX_ENTRY_BYTES`]).
pub const MAX_BATCH_WORKERS: usize = 1024;

/// One worker's result in a [`Record::WorkerResults`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerResult {
    /// Worker.
    pub worker_id: String,
    /// The result of its last call.
    pub result: CallResult,
}

impl Record {
    /// A batched record as the per-worker records it stands for, in order (`None` for any
    /// other record).
    pub fn per_worker(&self) -> Option<Vec<Record>> {
        match self {
            Record::WorkerCalls {
                id,
                action,
                worker_ids,
            } => Some(
                worker_ids
                    .iter()
                    .map(|w| Record::WorkerCall {
                        id: *id,
                        worker_id: w.clone(),
                        action: action.clone(),
                    })
                    .collect(),
            ),
            Record::WorkerResults { id, results } => Some(
                results
                    .iter()
                    .map(|r| Record::WorkerDone {
                        id: *id,
                        worker_id: r.worker_id.clone(),
                        result: r.result.clone(),
                    })
                    .collect(),
            ),
            _ => None,
        }
    }

    /// The worker ids a batched record names, for its checks.
    fn batch_workers(&self) -> Vec<&str> {
        match self {
            Record::WorkerCalls { worker_ids, .. } => {
                worker_ids.iter().map(String::as_str).collect()
            }
            Record::WorkerResults { results, .. } => {
                results.iter().map(|r| r.worker_id.as_str()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Checks the shape of a batched record: not empty, at most [`MAX_BATCH_WORKERS`], no
    /// worker twice (the per-worker records are checked against the state by the caller).
    ///
    /// # Errors
    /// [`crate::Error::InvalidField`] naming the field at fault.
    pub(crate) fn check_batch(&self) -> Result<(), crate::Error> {
        let ids = self.batch_workers();
        let field = match self {
            Record::WorkerCalls { .. } => "worker_ids",
            _ => "results",
        };
        let invalid = |reason: String| crate::Error::InvalidField {
            field: field.into(),
            reason,
        };
        if ids.is_empty() || ids.len() > MAX_BATCH_WORKERS {
            return Err(invalid(format!(
                "{} workers in one batch: 1..={MAX_BATCH_WORKERS} expected",
                ids.len()
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for (i, w) in ids.iter().enumerate() {
            if !seen.insert(*w) {
                return Err(invalid(format!("[{i}]: worker {w:?} twice in one batch")));
            }
        }
        Ok(())
    }
}
