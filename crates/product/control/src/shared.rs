//! The state every RPC handler and refit driver shares: the state machine behind its lock, the
//! journal's committer and durable sequence number, each worker's mailbox (command-stream
//! wake-ups, which process holds the id), the engine index, the engine-call HTTP client and the
//! fan-out cache. The tonic service (`crate::server`) and the refit driver (`crate::driver`)
//! both use it; it uses neither.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify};
use tonic::Status;

use crate::commit::{committer, lock, Core, Pending};
use crate::journal::Journal;
use crate::refit::ModelLimits;
use crate::state::{Record, State};
use crate::Error;

/// Longest `WaitVersion` long poll (one day), in milliseconds.
pub(crate) const MAX_WAIT_MS: u64 = 24 * 3600 * 1000;

/// Per-worker wake-up for its command stream, and which process holds the id.
#[derive(Default)]
pub(crate) struct Mailbox {
    pub(crate) notify: Notify,
    /// Bumped by every new stream; an older stream sees a different value and ends.
    pub(crate) stream_gen: AtomicU64,
    /// Command streams open now (a worker with none is not connected).
    pub(crate) open_streams: AtomicU64,
    /// The process that registered the id last (in memory only: after a restart every worker
    /// registers again, and the first registration of an id takes it).
    pub(crate) owner: Mutex<Owner>,
    /// Held by a registration from its checks until its owner is recorded, so two
    /// registrations of one id cannot both pass the checks (other ids are not held up).
    pub(crate) registering: tokio::sync::Mutex<()>,
}

/// The process holding a worker id, from its last accepted registration.
#[derive(Default, Clone)]
pub(crate) struct Owner {
    /// Its incarnation (0: an older client that sends none).
    pub(crate) incarnation: u64,
    /// Its engine URL, if it registered one.
    pub(crate) system_url: Option<String>,
    /// The socket addresses that URL reaches (`crate::identity::engine_addresses`; empty
    /// without an engine).
    pub(crate) addresses: Vec<String>,
    /// Its inference instance and the ranks it holds: workers of one instance (the ranks of a
    /// tensor-parallel engine, each its own process) share the engine URL.
    pub(crate) instance: String,
    pub(crate) ranks: Vec<u32>,
}

/// Counts an open command stream for as long as it lives.
pub(crate) struct StreamGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) mailbox: Arc<Mailbox>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.mailbox.open_streams.fetch_sub(1, Ordering::SeqCst);
        self.shared.changes.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// The state, journal and wake-ups shared by the RPC handlers and refit drivers.
pub(crate) struct Shared {
    pub(crate) core: Arc<Mutex<Core>>,
    /// Where manifests go before their records are journaled by reference ([`crate::blobs`]).
    pub(crate) blobs: Option<crate::blobs::BlobStore>,
    /// Sequence number of the last record known to be on disk (fsync'd).
    pub(crate) durable: Arc<watch::Sender<u64>>,
    /// Records to commit, in arrival order (see [`committer`]).
    pub(crate) commits: Option<std::sync::mpsc::Sender<Pending>>,
    pub(crate) committer: Option<std::thread::JoinHandle<()>>,
    /// Bumped after every state change (for `WaitVersion`).
    pub(crate) changes: watch::Sender<u64>,
    /// Set when the server shuts down, so streams and waits end.
    pub(crate) closing: watch::Sender<bool>,
    pub(crate) mail: Mutex<HashMap<String, Arc<Mailbox>>>,
    /// Engine URL -> the ids registered with it (kept in step with each mailbox's owner).
    pub(crate) engines: Mutex<crate::takeover::EngineIndex>,
    /// Each worker's model limits from its last registration (not journaled: a worker registers
    /// again after a control-plane restart).
    pub(crate) limits: Mutex<HashMap<String, ModelLimits>>,
    /// The client of every engine call: one pool of kept-alive connections for the life of the
    /// control plane, so a refit of a thousand workers does not open a thousand connections.
    pub(crate) http: reqwest::Client,
    /// The leader's epoch of a highly available control plane ([`crate::ha`]): sent on every
    /// engine call and with every command stream ([`mx_adapters::EPOCH_HEADER`]).
    pub(crate) epoch: Option<u64>,
    /// Merkle trees and lookups of the versions workers asked for with a want.
    pub(crate) fanout: crate::fanout::Cache,
    /// Worker id -> (engine URL, incarnation) its engine answered for (or, without an identity
    /// route, could not answer for) before a refit called it (`crate::identity`). An engine
    /// restarts only with its worker process, which registers with a new incarnation, so the
    /// answer holds for as long as the pair matches: one question per worker process, not one
    /// per refit. Forgotten when the id is retired.
    pub(crate) proven: Mutex<HashMap<String, (String, u64)>>,
    /// [`crate::snapshot::Compaction::retire_departed_after`].
    pub(crate) retire_departed_after: Option<std::time::Duration>,
    /// What the fleet said that contradicts the journal (`crate::testimony`): while it holds
    /// anything, nothing acts on the fleet.
    pub(crate) halt: Mutex<crate::testimony::Halt>,
    /// The workers that registered since this control plane started (their testimony is in).
    pub(crate) testified: Mutex<std::collections::HashSet<String>>,
    /// Woken by every registration.
    pub(crate) testimony: Notify,
    /// [`crate::snapshot::Compaction::testimony_wait`].
    pub(crate) testimony_wait: Duration,
    /// Held by a refit request from its checks to its BEGIN (`crate::server`'s `start_refit`).
    pub(crate) starting: tokio::sync::Mutex<()>,
    /// When this control plane (this leader) started serving its state.
    pub(crate) started: tokio::time::Instant,
    /// The workers the journal held at the start: they come back after a restart or failover.
    pub(crate) returning: std::collections::HashSet<String>,
    /// NIXL agent name -> when a publisher naming it was last heard (`Publish`, `ListLayouts`
    /// with `agent_name`): the publishers' liveness in `GetStatus`. Not state (a restarted
    /// control plane hears every serving publisher again within one ping); self-declared, so
    /// it is shown, never acted on. Bounded by [`MAX_HEARD`].
    pub(crate) heard: Mutex<HashMap<String, tokio::time::Instant>>,
    /// What mx's code in each engine rank says the rank holds (`crate::ranks`).
    pub(crate) ranks: crate::ranks::RankReports,
}

/// The most agents [`Shared::heard`] remembers: past it, those not heard within
/// [`crate::types::SILENT_AFTER_MS`] ten times over are forgotten (they read as unknown).
pub(crate) const MAX_HEARD: usize = 16_384;

impl Drop for Shared {
    /// Stops the journal thread and waits for it, so the journal file (and its lock) is closed
    /// when the last handle on the state goes.
    fn drop(&mut self) {
        self.commits.take();
        if let Some(t) = self.committer.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    /// The shared state of a control plane whose journal is the file `journal_path`
    /// (recovered and replayed), compacted by `policy`; engine calls carry `engine_token`.
    pub(crate) fn open(
        journal_path: &std::path::Path,
        engine_token: Option<&str>,
        policy: crate::snapshot::Compaction,
    ) -> Result<Shared, Error> {
        let (journal, loaded) = Journal::recover_with(journal_path, policy.unchecked())?;
        Shared::from_journal(journal, loaded, engine_token, None, policy)
    }

    /// The shared state rebuilt from what `journal` holds (`loaded`), appending to it from now
    /// on (compacted by `policy`); engine calls carry `epoch` when set
    /// ([`mx_adapters::EPOCH_HEADER`]).
    pub(crate) fn from_journal(
        mut journal: Journal,
        loaded: crate::journal::Loaded,
        engine_token: Option<&str>,
        epoch: Option<u64>,
        policy: crate::snapshot::Compaction,
    ) -> Result<Shared, Error> {
        let journal_path = journal.path().to_path_buf();
        let journal_path = journal_path.as_path();
        let http =
            mx_adapters::http_client_with(engine_token, epoch).map_err(|reason| Error::Config {
                what: "engine token".into(),
                reason,
            })?;
        let state = crate::commit::rebuild(&mut journal, loaded, &policy)?;
        let returning = state.worker_ids().into_iter().collect();
        let blobs = journal.blobs().cloned();
        let applied_seq = journal.len();
        let core = Arc::new(Mutex::new(Core { state, applied_seq }));
        let durable = Arc::new(watch::Sender::new(applied_seq));
        let (tx, rx) = std::sync::mpsc::channel();
        let committer = {
            let core = Arc::clone(&core);
            let durable = Arc::clone(&durable);
            std::thread::Builder::new()
                .name("mx-journal".into())
                .spawn(move || committer(&core, journal, &durable, &rx, policy))
                .map_err(|source| Error::JournalIo {
                    path: journal_path.to_path_buf(),
                    what: "start the journal thread",
                    source,
                })?
        };
        Ok(Shared {
            core,
            durable,
            blobs,
            commits: Some(tx),
            committer: Some(committer),
            changes: watch::Sender::new(0),
            closing: watch::Sender::new(false),
            mail: Mutex::new(HashMap::new()),
            engines: Mutex::default(),
            limits: Mutex::new(HashMap::new()),
            http,
            epoch,
            fanout: crate::fanout::Cache::default(),
            proven: Mutex::default(),
            retire_departed_after: policy.retire_departed_after,
            halt: Mutex::default(),
            testified: Mutex::default(),
            testimony: Notify::new(),
            testimony_wait: policy.testimony_wait,
            starting: tokio::sync::Mutex::new(()),
            started: tokio::time::Instant::now(),
            returning,
            heard: Mutex::new(HashMap::new()),
            ranks: crate::ranks::RankReports::default(),
        })
    }

    /// `Ok` while the control plane acts on its fleet; [`Error::Halted`] (saying why and what
    /// to do) once the fleet contradicted the journal, until an operator accepts it.
    pub(crate) fn acting(&self) -> Result<(), Error> {
        match self.halt_reason() {
            None => Ok(()),
            Some(reason) => Err(Error::Halted { reason }),
        }
    }

    /// Why the control plane stopped acting on its fleet, if it did.
    pub(crate) fn halt_reason(&self) -> Option<String> {
        lock(&self.halt).reason()
    }

    /// Hears a registering worker's testimony: compares it with the journal and halts on any
    /// contradiction (logged at error level with what to do).
    pub(crate) fn testify(&self, t: &crate::testimony::Testimony) {
        let found = self.read(|s| crate::testimony::judge(s, self.epoch, t));
        if !found.is_empty() {
            for c in &found {
                tracing::error!(worker = %t.worker_id, "the fleet contradicts the journal: {c}");
            }
            let began = lock(&self.halt).add(found, crate::refit::now_ms());
            if began {
                tracing::error!("{}", crate::testimony::WHAT_TO_DO);
            }
        }
        lock(&self.testified).insert(t.worker_id.clone());
        self.testimony.notify_waiters();
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Waits until every worker of `ids` that the journal knew when this control plane started
    /// has registered again and opened its command stream, or [`Shared::testimony_wait`]
    /// passed since the start (a worker that is not back by then cannot testify; after that,
    /// this returns at once). Workers that first registered since are not waited for.
    pub(crate) async fn await_testimony(&self, ids: &[String]) {
        let deadline = self.started + self.testimony_wait;
        if tokio::time::Instant::now() >= deadline {
            return;
        }
        loop {
            let changed = self.testimony.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let missing: Vec<&String> = {
                let t = lock(&self.testified);
                ids.iter()
                    .filter(|w| self.returning.contains(*w))
                    .filter(|w| !t.contains(*w) || !self.connected(w))
                    .collect()
            };
            if missing.is_empty() {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                tracing::warn!(
                    ?missing,
                    wait = ?self.testimony_wait,
                    "workers did not register again in time after the control plane started: going on without their word"
                );
                return;
            }
        }
    }

    /// Retires `worker_id` (journals [`crate::record::Record::Retire`]) and forgets what the
    /// server keeps beside the state about it. The caller holds its mailbox's `registering`
    /// lock and has checked who may retire it.
    ///
    /// # Errors
    /// The record's check (unknown id, an open refit holds it, an unprintable reason) or the
    /// journal's.
    pub(crate) async fn retire(
        self: &Arc<Self>,
        worker_id: &str,
        reason: String,
    ) -> Result<(), Error> {
        self.mutate(Record::Retire {
            worker_id: worker_id.to_string(),
            reason,
            at_ms: crate::refit::now_ms(),
        })
        .await?;
        self.forget_worker(worker_id);
        Ok(())
    }

    /// Forgets what the server keeps beside the state about a retired worker id: its owner
    /// (incarnation, engine addresses), its place in the engine index and its model limits.
    pub(crate) fn forget_worker(&self, worker_id: &str) {
        let mailbox = self.mailbox(worker_id);
        let previous = std::mem::take(&mut *lock(&mailbox.owner));
        lock(&self.engines).set(worker_id, &previous.addresses, &[]);
        lock(&self.limits).remove(worker_id);
        lock(&self.proven).remove(worker_id);
        self.ranks.forget(worker_id);
    }

    /// Evaluates `check` now and after every change that concerns `worker_id` (its
    /// registration, a command for it) until it answers `Some`. Only this worker's waiters
    /// wake, where [`Shared::subscribe`] wakes every waiter on every change (thousands of
    /// engine calls in flight would each re-read the state after each batch of results).
    pub(crate) async fn until_worker<T>(
        &self,
        worker_id: &str,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let mailbox = self.mailbox(worker_id);
        loop {
            // Registered before the check, so a change between the check and the wait wakes it.
            let changed = mailbox.notify.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(v) = check() {
                return v;
            }
            changed.await;
        }
    }

    pub(crate) fn mailbox(&self, worker_id: &str) -> Arc<Mailbox> {
        lock(&self.mail)
            .entry(worker_id.to_string())
            .or_default()
            .clone()
    }

    /// Refuses a registration that would take over a live worker: `worker_id`'s command stream
    /// is connected and the caller is not the process that opened it (another incarnation, or
    /// an older client that sends none), or its engine (`system_url`, reaching `addresses`)
    /// shares an address with the engine of another connected worker id (a refit of either
    /// would land on the other's engine; every spelling of one address counts, issue 29) that is
    /// not another rank of the same instance (`instance`, disjoint `ranks`: the processes of
    /// one tensor-parallel engine, which refits call once for all).
    #[allow(clippy::too_many_arguments)]
    // reason: the registration's fields, each checked here; bundling them would only rename them.
    pub(crate) fn check_takeover(
        &self,
        worker_id: &str,
        mailbox: &Mailbox,
        incarnation: u64,
        system_url: Option<&str>,
        addresses: &[String],
        instance: &str,
        ranks: &[u32],
    ) -> Result<(), Error> {
        let owner = lock(&mailbox.owner).clone();
        let live = mailbox.open_streams.load(Ordering::SeqCst) > 0;
        if live && (incarnation == 0 || owner.incarnation != incarnation) {
            return Err(Error::WorkerIdInUse {
                worker_id: worker_id.to_string(),
                reason: format!(
                    "its command stream is connected (incarnation {:#x}; this registration is {}): a registration takes a worker id over only once the old process's stream is gone",
                    owner.incarnation,
                    if incarnation == 0 {
                        "an older client without one".to_string()
                    } else {
                        format!("incarnation {incarnation:#x}")
                    }
                ),
            });
        }
        let Some(url) = system_url else {
            return Ok(());
        };
        // Only the ids registered with this engine (issue 17: not every connected worker).
        let candidates = lock(&self.engines).others(addresses, worker_id);
        let other = candidates.into_iter().find_map(|id| {
            let m = self.mailbox(&id);
            let o = lock(&m.owner);
            let sibling = o.instance == instance && !o.ranks.iter().any(|r| ranks.contains(r));
            let shared = o.addresses.iter().find(|a| addresses.contains(a)).cloned();
            match shared {
                Some(a) if m.open_streams.load(Ordering::SeqCst) > 0 && !sibling => {
                    Some((id.clone(), o.system_url.clone().unwrap_or_default(), a))
                }
                _ => None,
            }
        });
        match other {
            Some((other, their_url, address)) => Err(Error::WorkerIdInUse {
                worker_id: worker_id.to_string(),
                reason: format!(
                    "its engine {url} is the engine of connected worker {other:?} ({their_url}; both reach {address}): one engine cannot serve two worker ids"
                ),
            }),
            None => Ok(()),
        }
    }

    /// True while `worker_id` has an open command stream.
    pub(crate) fn connected(&self, worker_id: &str) -> bool {
        self.mailbox(worker_id).open_streams.load(Ordering::SeqCst) > 0
    }

    /// Notes that the publisher with NIXL agent `agent_name` was heard from now.
    pub(crate) fn hear(&self, agent_name: &str) {
        if agent_name.is_empty() {
            return;
        }
        let now = tokio::time::Instant::now();
        let mut heard = lock(&self.heard);
        if heard.len() >= MAX_HEARD && !heard.contains_key(agent_name) {
            let keep = Duration::from_millis(crate::types::SILENT_AFTER_MS.saturating_mul(10));
            heard.retain(|_, t| now.duration_since(*t) <= keep);
            if heard.len() >= MAX_HEARD {
                return;
            }
        }
        heard.insert(agent_name.to_string(), now);
    }

    /// Fills in each publisher's liveness from [`Shared::hear`]'s record.
    pub(crate) fn fill_liveness(&self, versions: &mut [crate::types::VersionSummary]) {
        let now = tokio::time::Instant::now();
        let heard = lock(&self.heard);
        for p in versions.iter_mut().flat_map(|v| v.publishers.iter_mut()) {
            p.last_seen_ms = heard
                .get(&p.agent_name)
                .map(|t| u64::try_from(now.duration_since(*t).as_millis()).unwrap_or(u64::MAX));
            p.liveness = crate::types::Liveness::of(p.last_seen_ms);
        }
    }

    /// The ids of every worker with an open command stream.
    pub(crate) fn connected_ids(&self) -> std::collections::HashSet<String> {
        lock(&self.mail)
            .iter()
            .filter(|(_, m)| m.open_streams.load(Ordering::SeqCst) > 0)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// A receiver woken after every state or connection change.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Check, journal (fsync), apply; then wake whoever must hear about it. Records arriving
    /// together share one write and one `fdatasync` (group commit, see [`committer`]); each
    /// caller still returns only once its own record is durable and applied.
    pub(crate) async fn mutate(self: &Arc<Self>, rec: Record) -> Result<(), Error> {
        self.mutate_all(vec![rec]).await
    }

    /// [`Shared::mutate`] for several records at once, journaled in order in one group commit
    /// (a refit driver journals a phase's call intents, or the results that arrived together,
    /// this way). Returns once all are durable and applied.
    ///
    /// # Errors
    /// The first record's check error (the records after it are neither journaled nor applied;
    /// those before it are), or [`Error::Task`] when the journal thread has stopped.
    pub(crate) async fn mutate_all(self: &Arc<Self>, recs: Vec<Record>) -> Result<(), Error> {
        if recs.is_empty() {
            return Ok(());
        }
        // Manifests bound for the blob store go there first, here (not under the state lock,
        // which the journal thread holds while it encodes).
        let mut journaled = Vec::with_capacity(recs.len());
        for r in &recs {
            journaled.push(match &self.blobs {
                Some(b) => b.offload(r).await?,
                None => None,
            });
        }
        let recs = recs.into_iter().zip(journaled).collect();
        let (reply, answer) = oneshot::channel();
        let gone = || Error::Task {
            reason: "the journal thread has stopped".into(),
        };
        self.commits
            .as_ref()
            .ok_or_else(gone)?
            .send(Pending { recs, reply })
            .map_err(|_| gone())?;
        // Nothing to wake when every record was a no-op.
        if let Some(effects) = answer.await.map_err(|_| gone())?? {
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
            for w in &effects.workers {
                self.mailbox(w).notify.notify_waiters();
            }
        }
        Ok(())
    }

    /// A long poll: evaluates `probe` on the state now and after every change until it says done,
    /// `timeout_ms` (capped at a day) passes or the server shuts down; answers its last value.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the change channel closes (the server is going away).
    pub(crate) async fn long_poll<T>(
        &self,
        timeout_ms: u64,
        mut probe: impl FnMut(&State) -> (bool, T),
    ) -> Result<T, Status> {
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(timeout_ms.min(MAX_WAIT_MS));
        let mut changes = self.changes.subscribe();
        let mut closing = self.closing.subscribe();
        loop {
            changes.borrow_and_update();
            let (done, value) = self.read_durable(&mut probe).await;
            if done || tokio::time::Instant::now() >= deadline || *closing.borrow_and_update() {
                return Ok(value);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                r = changes.changed() => {
                    if r.is_err() {
                        return Err(Status::unavailable("control plane shutting down"));
                    }
                }
                _ = closing.changed() => {}
            }
        }
    }

    /// Reads the state as it is now, durable or not (for refit drivers, which journal before
    /// they act; see [`committer`]).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&lock(&self.core).state)
    }

    /// Reads the state, then waits until everything that read saw is on disk: what an RPC tells
    /// a client never depends on a record a crash could still lose.
    pub(crate) async fn read_durable<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        let (value, seq) = {
            let core = lock(&self.core);
            (f(&core.state), core.applied_seq)
        };
        let mut durable = self.durable.subscribe();
        // An error means the journal thread is gone (shutting down): nothing more will sync.
        let _ = durable.wait_for(|d| *d >= seq).await;
        value
    }
}
