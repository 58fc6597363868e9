//! The journal thread: group commit of the records the RPC handlers and refit drivers send
//! ([`committer`]), and compaction of the journal into a snapshot when it grows past the
//! configured [`Compaction`] thresholds ([`crate::snapshot`]), at start and between batches.

use std::sync::{Mutex, MutexGuard};

use tokio::sync::{oneshot, watch};

use crate::journal::{CompactFailure, Journal, Loaded};
use crate::limits::MAX_BATCH_BYTES;
use crate::observe;
use crate::snapshot::Compaction;
use crate::state::{Check, Effects, Record, State};
use crate::Error;

/// The state and how far it has been applied. The journal itself belongs to the journal thread
/// ([`committer`]).
pub(crate) struct Core {
    pub(crate) state: State,
    /// Sequence number of the last record applied to `state` (durable or not yet).
    pub(crate) applied_seq: u64,
}

/// Records waiting for the group commit (one caller's, journaled in order), and where their
/// outcome goes: the effects of the records applied (`None` when all were no-ops), or the first
/// record's error (the records after it are not applied).
pub(crate) struct Pending {
    /// Each record, with the form it is journaled in when that differs (a manifest stored in
    /// the blob store beforehand, [`crate::blobs`]).
    pub(crate) recs: Vec<(Record, Option<Record>)>,
    pub(crate) reply: oneshot::Sender<Result<Option<Effects>, Error>>,
}

/// Most callers one group commit takes (one write + one `fdatasync`).
const MAX_GROUP: usize = 8192;

/// The journal thread (group commit): takes every record waiting (up to [`MAX_GROUP`] callers, or
/// until the batch holds [`MAX_BATCH_BYTES`] of journal lines); under the
/// state lock checks each in arrival order, encodes it as the next journal line and applies it;
/// releases the lock; writes and syncs the whole batch with one `fdatasync`; publishes the new
/// durable sequence number; then answers every caller.
///
/// The lock is not held during the sync, so readers are never stalled by the disk; instead what
/// leaves the process is held back until it is durable: callers of [`Shared::mutate`] are answered
/// after the sync, and RPCs answer from [`Shared::read_durable`] / long polls, which wait for the
/// durable sequence to reach what they read. Internal readers (refit drivers) may see a record
/// before it is durable, but anything they do outside journals an intent first, which lands
/// after it in the same file.
///
/// A failed write or sync leaves the state ahead of the disk: the process exits (status 74)
/// rather than serve it, and a restart replays the journal, which holds exactly the records that
/// were made durable (PostgreSQL treats a failed fsync the same way).
pub(crate) fn committer(
    core: &Mutex<Core>,
    mut journal: Journal,
    durable: &watch::Sender<u64>,
    rx: &std::sync::mpsc::Receiver<Pending>,
    policy: Compaction,
) {
    let mut compactor = Compactor::new(policy);
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        let mut answers = Vec::new();
        let mut lines = Vec::new();
        let last = {
            let mut core = lock(core);
            while let Some(Pending { recs, reply }) = next.take() {
                let mut effects: Option<Effects> = None;
                let mut failure = None;
                for (rec, journaled) in recs {
                    let one = match core.state.check(&rec) {
                        Err(e) => Err(e),
                        Ok(Check::Noop) => Ok(None),
                        Ok(Check::Apply) => {
                            match journal.encode(journaled.as_ref().unwrap_or(&rec), &mut lines) {
                                Err(e) => Err(e),
                                Ok(seq) => {
                                    core.applied_seq = seq;
                                    core.state.apply(rec).map(Some)
                                }
                            }
                        }
                    };
                    match one {
                        Ok(Some(fx)) => effects
                            .get_or_insert_with(Effects::default)
                            .workers
                            .extend(fx.workers),
                        Ok(None) => {}
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    }
                }
                let outcome = match failure {
                    Some(e) => Err(e),
                    None => Ok(effects),
                };
                answers.push((reply, outcome));
                // Bounded batches bound what a crash can leave unsynced (a torn tail).
                if answers.len() < MAX_GROUP && lines.len() < MAX_BATCH_BYTES {
                    next = rx.try_recv().ok();
                }
            }
            core.applied_seq
        };
        let t = std::time::Instant::now();
        if let Err(e) = journal.write_synced(&lines) {
            tracing::error!(
                "journal write failed, the control plane stops (a restart replays the journal): {e}"
            );
            eprintln!("mx control: {e}; exiting so that a restart replays the durable journal");
            std::process::exit(74);
        }
        if !lines.is_empty() {
            metrics::counter!(observe::JOURNAL_BYTES_TOTAL).increment(lines.len() as u64);
            metrics::counter!(observe::JOURNAL_SYNCS_TOTAL).increment(1);
            metrics::histogram!(observe::JOURNAL_SYNC_SECONDS).record(t.elapsed().as_secs_f64());
        }
        durable.send_if_modified(|d| {
            let moved = *d != last;
            *d = last;
            moved
        });
        for (reply, outcome) in answers {
            // A caller that went away (its RPC was cancelled) needs no answer.
            let _ = reply.send(outcome);
        }
        compactor.maybe(core, &mut journal);
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the state half-changed (apply checks first and
    // mutates only infallibly), so a poisoned lock is still safe to use.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Rebuilds the state from what `journal` holds (`loaded`), applies the refit-detail limit of
/// `policy`, and compacts the journal when it is already due (at start, before anything is
/// appended).
///
/// # Errors
/// [`Error::Replay`] naming the line the state machine refuses; a failed compaction's error
/// when the journal could not be truncated after its snapshot.
pub(crate) fn rebuild(
    journal: &mut Journal,
    loaded: Loaded,
    policy: &Compaction,
) -> Result<State, Error> {
    let path = journal.path().to_path_buf();
    let from_snapshot = loaded.snapshot.as_ref().map(|s| (s.seq, s.bytes));
    let mut state = loaded.replay(&path)?;
    state.set_refit_detail(crate::history::RefitDetail::new(policy.refit_detail));
    tracing::info!(
        journal = %path.display(),
        last_seq = journal.len(),
        snapshot_seq = from_snapshot.map(|s| s.0),
        snapshot_bytes = from_snapshot.map(|s| s.1),
        records_after_snapshot = journal.records_since_snapshot(),
        bytes = journal.size_bytes(),
        "control plane state rebuilt from journal"
    );
    // A journal in etcd is compacted by the journal thread (its etcd calls block on the
    // runtime, which this async caller runs on).
    if journal.compactable()
        && !journal.in_etcd()
        && policy.due(journal.size_bytes(), journal.records_since_snapshot())
    {
        match journal.compact(&state) {
            Ok(c) => log_compacted(journal, &c, std::time::Duration::ZERO),
            Err(CompactFailure::Snapshot(e)) => {
                tracing::error!(
                    "journal compaction at start failed, the journal goes on whole: {e}"
                );
            }
            Err(CompactFailure::Truncate(e)) => return Err(e),
        }
    }
    Ok(state)
}

fn log_compacted(journal: &Journal, c: &crate::journal::Compacted, took: std::time::Duration) {
    metrics::counter!(observe::JOURNAL_COMPACTIONS_TOTAL).increment(1);
    tracing::info!(
        journal = %journal.path().display(),
        seq = c.seq,
        snapshot_bytes = c.snapshot_bytes,
        journal_bytes = c.journal_bytes,
        ms = took.as_secs_f64() * 1e3,
        "journal compacted into a snapshot"
    );
}

/// Decides when the journal thread compacts, and backs off after a failure.
struct Compactor {
    policy: Compaction,
    /// After a failed snapshot: no new try before the journal holds this many records.
    retry_at: u64,
}

impl Compactor {
    fn new(policy: Compaction) -> Compactor {
        Compactor {
            policy,
            retry_at: 0,
        }
    }

    /// Compacts `journal` when it is due: the snapshot is encoded under the state lock (the
    /// journal thread is the only writer, so the state is exactly the one after the journal's
    /// last record), then written and renamed, and the journal truncated, without the lock. A
    /// failed snapshot is logged (the journal goes on whole); a failed truncation stops the
    /// process (status 74), as a failed journal write does.
    fn maybe(&mut self, core: &Mutex<Core>, journal: &mut Journal) {
        if !journal.compactable()
            || journal.len() < self.retry_at
            || !self
                .policy
                .due(journal.size_bytes(), journal.records_since_snapshot())
        {
            return;
        }
        let t = std::time::Instant::now();
        let encoded = {
            let core = lock(core);
            crate::snapshot::encode(
                journal.path(),
                core.applied_seq,
                crate::refit::now_ms(),
                &core.state,
            )
            .map(|b| (core.applied_seq, b))
        };
        let done = encoded
            .map_err(CompactFailure::Snapshot)
            .and_then(|(seq, bytes)| journal.install_snapshot(seq, &bytes));
        match done {
            Ok(c) => log_compacted(journal, &c, t.elapsed()),
            Err(CompactFailure::Snapshot(e)) => {
                self.retry_at = journal.len().saturating_add(10_000);
                tracing::error!(
                    "journal compaction failed, the journal goes on whole (next try in 10000 records): {e}"
                );
            }
            Err(CompactFailure::Truncate(e)) => {
                tracing::error!("journal truncation after a snapshot failed, the control plane stops (a restart replays snapshot and journal): {e}");
                eprintln!("mx control: {e}; exiting so that a restart replays the durable snapshot and journal");
                std::process::exit(74);
            }
        }
    }
}
