//! High availability on etcd (work in progress, issue 17): one leader among the control-plane
//! replicas by etcd's election service, and fencing by epoch.
//!
//! A replica campaigns on the election `name` with a lease of `lease_ttl_s` seconds, kept alive
//! while the process lives. The leader's epoch is the create revision of its election key
//! (etcd revisions only grow, so a later leader always has a higher epoch). Every write the
//! leader makes goes through [`Leadership::fenced_put`]: an etcd transaction that applies only
//! while the election key of this epoch still exists, so a deposed leader (its lease expired, a
//! newer leader elected) cannot write anything, whatever it still believes. Engine calls and
//! worker commands carry the epoch so that engines refuse a lower one (not yet wired).

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, LeaderKey, Txn, TxnOp};
use tokio::sync::watch;

use crate::Error;

/// A leader's epoch: the etcd create revision of its election key (> 0, increasing across
/// leaders).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch(pub i64);

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch {}", self.0)
    }
}

/// Where the replicas meet: etcd endpoints (`host:port` or `http://host:port`), the election's
/// name and the leader lease.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// etcd client endpoints (every member, so any one of them may be down).
    pub endpoints: Vec<String>,
    /// Election name, e.g. `mx/control/leader`.
    pub election: String,
    /// Leader lease, seconds: a leader that stops renewing is deposed this long after.
    pub lease_ttl_s: i64,
    /// Where manifests and snapshots go instead of etcd ([`crate::blobs`]); `None` journals
    /// manifests whole (each record then fits one etcd entry, at most [`MAX_ENTRY_BYTES`]).
    pub blobs: Option<crate::blobs::BlobStore>,
}

fn etcd_err(what: &str) -> impl FnOnce(etcd_client::Error) -> Error + '_ {
    move |e| Error::Config {
        what: format!("etcd {what}"),
        reason: e.to_string(),
    }
}

/// This replica's leadership, won by [`Leadership::campaign`].
pub struct Leadership {
    client: Client,
    key: LeaderKey,
    lease: i64,
    /// Becomes `true` once the lease could not be renewed (leadership is then lost).
    lost: watch::Receiver<bool>,
    keepalive: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Leadership({}, lease {:#x})", self.epoch(), self.lease)
    }
}

impl Leadership {
    /// Connects to etcd, grants a lease, keeps it alive and campaigns with `value` (this
    /// replica's advertised URL, what followers name as the leader); returns once elected.
    ///
    /// # Errors
    /// [`Error::Config`] naming the etcd call that failed (connect, lease, campaign).
    pub async fn campaign(cfg: &EtcdConfig, value: &str) -> Result<Leadership, Error> {
        let client = Client::connect(&cfg.endpoints, None)
            .await
            .map_err(etcd_err("connect"))?;
        let lease = client
            .lease_client()
            .grant(cfg.lease_ttl_s, None)
            .await
            .map_err(etcd_err("lease grant"))?
            .id();
        let (mut keeper, mut stream) = client
            .lease_client()
            .keep_alive(lease)
            .await
            .map_err(etcd_err("lease keep-alive"))?;
        let (tx, lost) = watch::channel(false);
        let period = Duration::from_millis(u64::try_from(cfg.lease_ttl_s).unwrap_or(1) * 1000 / 3);
        let keepalive = tokio::spawn(async move {
            loop {
                let renewed = match keeper.keep_alive().await {
                    Ok(()) => matches!(stream.message().await, Ok(Some(r)) if r.ttl() > 0),
                    Err(_) => false,
                };
                if !renewed {
                    let _ = tx.send(true);
                    return;
                }
                tokio::time::sleep(period).await;
            }
        });
        let resp = client
            .election_client()
            .campaign(cfg.election.as_bytes(), value.as_bytes(), lease)
            .await
            .map_err(etcd_err("campaign"))?;
        let key = resp.leader().cloned().ok_or_else(|| Error::Config {
            what: "etcd campaign".into(),
            reason: "elected without a leader key".into(),
        })?;
        Ok(Leadership {
            client,
            key,
            lease,
            lost,
            keepalive,
        })
    }

    /// This leader's epoch.
    pub fn epoch(&self) -> Epoch {
        Epoch(self.key.rev())
    }

    /// The etcd lease its election key is attached to.
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// True once the lease could not be renewed: this replica must stop acting as leader.
    pub fn lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// A future that completes with `true` once the lease could not be renewed, or with `false`
    /// once this leadership was dropped (stepped down deliberately); it holds no reference to
    /// the leadership.
    pub fn deposed(&self) -> impl std::future::Future<Output = bool> + Send + 'static {
        let mut rx = self.lost.clone();
        // The keep-alive task sends `true` before it ends by itself; an aborted one (the
        // leadership dropped) closes the channel without it.
        async move { rx.wait_for(|lost| *lost).await.is_ok() }
    }

    /// Writes `puts` (key, value) in one etcd transaction that applies only while this epoch's
    /// election key exists: the fencing of a deposed leader.
    ///
    /// # Errors
    /// [`Error::Fenced`] when this replica is no longer the leader of its epoch (nothing was
    /// written); [`Error::Config`] when etcd cannot be reached.
    pub async fn fenced_put(&self, puts: Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), Error> {
        let ops = puts.into_iter().map(|(k, v)| TxnOp::put(k, v, None));
        self.fenced_txn(Vec::new(), ops.collect(), || {
            "this replica's election key is gone: another replica leads".into()
        })
        .await
    }

    /// Runs `ops` in one etcd transaction guarded by this epoch's election key (it must still
    /// exist with this epoch's create revision) and by `also`.
    ///
    /// # Errors
    /// [`Error::Fenced`] with `refused()` as the reason when a guard fails (nothing was
    /// written); [`Error::Config`] when etcd cannot be reached.
    async fn fenced_txn(
        &self,
        also: Vec<Compare>,
        ops: Vec<TxnOp>,
        refused: impl FnOnce() -> String,
    ) -> Result<(), Error> {
        if ops.len() > MAX_TXN_OPS {
            return Err(Error::InvalidField {
                field: "etcd transaction".into(),
                reason: format!(
                    "{} operations, at most {MAX_TXN_OPS} (etcd's --max-txn-ops default)",
                    ops.len()
                ),
            });
        }
        let mut guards = vec![Compare::create_revision(
            self.key.key().to_vec(),
            CompareOp::Equal,
            self.key.rev(),
        )];
        guards.extend(also);
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(etcd_err("txn"))?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(Error::Fenced {
                epoch: self.key.rev(),
                reason: refused(),
            })
        }
    }

    /// Appends entry `seq` (`bytes`: a group commit's journal lines) to the log under `prefix`
    /// as key `<prefix><seq as 20 digits>`, fenced by this epoch and refused when that key
    /// exists already (a log is written once, in order).
    ///
    /// # Errors
    /// [`Error::InvalidField`] for an entry over [`MAX_ENTRY_BYTES`]; [`Error::Fenced`] when
    /// this replica no longer leads or the entry exists; [`Error::Config`] when etcd cannot be
    /// reached.
    pub async fn append(&self, prefix: &str, seq: u64, bytes: Vec<u8>) -> Result<(), Error> {
        if bytes.len() > MAX_ENTRY_BYTES {
            return Err(Error::InvalidField {
                field: format!("log entry {seq}"),
                reason: format!(
                    "{} bytes, at most {MAX_ENTRY_BYTES} (etcd's request limit)",
                    bytes.len()
                ),
            });
        }
        let key = log_key(prefix, seq);
        let absent = Compare::version(key.clone(), CompareOp::Equal, 0);
        self.fenced_txn(vec![absent], vec![TxnOp::put(key, bytes, None)], || {
            format!("log entry {seq} not written: another replica leads, or the entry exists")
        })
        .await
    }

    /// Installs `snapshot` (the encoded state after journal record `seq`,
    /// [`crate::snapshot::encode`]) as the log's snapshot and deletes the log entries it
    /// includes: every entry before `first_entry`, the entry the next append writes.
    ///
    /// The snapshot goes in chunks of at most [`MAX_ENTRY_BYTES`] under
    /// `<prefix>snapshot/<seq>/`, each in its own fenced transaction; then one fenced
    /// transaction writes `<prefix>snapshot/head` ([`SnapshotHead`]), deletes the compacted
    /// entries and the chunks of older snapshots. Until that transaction the log is whole and
    /// the chunks unread; after it, the head names complete chunks: a crash or a deposition at
    /// any point loses nothing (chunks left by an attempt that did not finish are deleted by
    /// the next one that does).
    ///
    /// etcd keeps the history of deleted keys until the cluster compacts its own history: run
    /// etcd with `--auto-compaction-retention` (as etcd recommends), or its quota fills.
    ///
    /// # Errors
    /// [`Error::Fenced`] when this replica no longer leads (the head is not written);
    /// [`Error::Config`] when etcd cannot be reached; [`Error::InvalidField`] for a snapshot of
    /// more than [`MAX_SNAPSHOT_CHUNKS`] chunks.
    pub async fn install_snapshot(
        &self,
        prefix: &str,
        seq: u64,
        first_entry: u64,
        body: SnapshotBody<'_>,
    ) -> Result<(), Error> {
        let (snapshot, blob) = match body {
            SnapshotBody::Bytes(b) => (b, None),
            SnapshotBody::Blob(r) => (&[][..], Some(r.clone())),
        };
        let chunks: Vec<&[u8]> = snapshot.chunks(MAX_ENTRY_BYTES).collect();
        if chunks.len() > MAX_SNAPSHOT_CHUNKS {
            return Err(Error::InvalidField {
                field: format!("snapshot at seq {seq}"),
                reason: format!(
                    "{} bytes in {} chunks, at most {MAX_SNAPSHOT_CHUNKS} chunks of {MAX_ENTRY_BYTES} bytes",
                    snapshot.len(),
                    chunks.len()
                ),
            });
        }
        for (i, chunk) in chunks.iter().enumerate() {
            let key = chunk_key(prefix, seq, i);
            self.fenced_txn(
                Vec::new(),
                vec![TxnOp::put(key, chunk.to_vec(), None)],
                || format!("snapshot chunk {i} of seq {seq} not written: another replica leads"),
            )
            .await?;
        }
        let head = SnapshotHead {
            seq,
            chunks: chunks.len(),
            bytes: blob.as_ref().map_or(snapshot.len() as u64, |r| r.bytes),
            first_entry,
            blob,
        };
        let head = serde_json::to_vec(&head).map_err(|e| Error::InvalidField {
            field: "snapshot head".into(),
            reason: e.to_string(),
        })?;
        let range = |from: Vec<u8>, to: Vec<u8>| {
            TxnOp::delete(from, Some(etcd_client::DeleteOptions::new().with_range(to)))
        };
        let ops = vec![
            TxnOp::put(head_key(prefix), head, None),
            range(log_key(prefix, 0), log_key(prefix, first_entry)),
            range(chunk_dir(prefix, 0), chunk_dir(prefix, seq)),
        ];
        self.fenced_txn(Vec::new(), ops, || {
            format!("snapshot at seq {seq} not installed: another replica leads")
        })
        .await
    }

    /// Gives up leadership now (revokes the lease: the election key goes with it).
    ///
    /// # Errors
    /// [`Error::Config`] when etcd cannot be reached (the lease then expires by itself).
    pub async fn resign(self) -> Result<(), Error> {
        self.keepalive.abort();
        self.client
            .lease_client()
            .revoke(self.lease)
            .await
            .map_err(etcd_err("lease revoke"))?;
        Ok(())
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

/// The most bytes one log entry may hold: etcd refuses requests over 1.5 MiB by default.
pub const MAX_ENTRY_BYTES: usize = 1 << 20;

/// Most operations in one etcd transaction (etcd's `--max-txn-ops` default).
const MAX_TXN_OPS: usize = 128;

/// Most chunks of one snapshot kept in etcd (64 GiB of [`MAX_ENTRY_BYTES`] chunks: far past
/// etcd's own 8 GiB storage limit, so only a corrupt head names more).
pub const MAX_SNAPSHOT_CHUNKS: usize = 1 << 16;

fn log_key(prefix: &str, seq: u64) -> Vec<u8> {
    format!("{prefix}{seq:020}").into_bytes()
}

/// The end of the log's keys: `<prefix>` and 20 digits sort below `<prefix>:`, and the
/// snapshot's keys (`<prefix>snapshot/...`) above it.
fn log_end(prefix: &str) -> Vec<u8> {
    format!("{prefix}:").into_bytes()
}

fn head_key(prefix: &str) -> Vec<u8> {
    format!("{prefix}snapshot/head").into_bytes()
}

/// The keys of the chunks of the snapshot at `seq` start with this (and the head's key,
/// `snapshot/head`, sorts above every one of them).
fn chunk_dir(prefix: &str, seq: u64) -> Vec<u8> {
    format!("{prefix}snapshot/{seq:020}/").into_bytes()
}

fn chunk_key(prefix: &str, seq: u64, i: usize) -> Vec<u8> {
    let mut k = chunk_dir(prefix, seq);
    k.extend_from_slice(format!("{i:06}").as_bytes());
    k
}

/// What `<prefix>snapshot/head` says: the snapshot of the log under `prefix`
/// ([`Leadership::install_snapshot`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotHead {
    /// The last journal record the snapshot includes.
    pub seq: u64,
    /// Chunks under `<prefix>snapshot/<seq>/`, numbered from 0.
    pub chunks: usize,
    /// The snapshot's length in bytes, its chunks together.
    pub bytes: u64,
    /// The first log entry after the snapshot (earlier ones were deleted with it).
    pub first_entry: u64,
    /// Where the snapshot is when it is in the blob store ([`crate::blobs`]; no chunks then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob: Option<crate::blobs::BlobRef>,
}

/// A snapshot for [`Leadership::install_snapshot`]: its bytes (stored in chunks in etcd), or
/// its reference in the blob store.
#[derive(Debug, Clone, Copy)]
pub enum SnapshotBody<'a> {
    /// The encoded snapshot.
    Bytes(&'a [u8]),
    /// The encoded snapshot, already in the blob store.
    Blob(&'a crate::blobs::BlobRef),
}

/// A journal kept in etcd as read back: its snapshot (head and bytes; no bytes when the head
/// names a blob), if it has one, and the log entries after it, `(entry, bytes)` in order.
#[derive(Debug, Clone, Default)]
pub struct EtcdLog {
    /// The snapshot and its bytes.
    pub snapshot: Option<(SnapshotHead, Vec<u8>)>,
    /// The log entries after the snapshot.
    pub entries: Vec<(u64, Vec<u8>)>,
}

/// The journal kept in etcd under `prefix`: its snapshot and its log. Read while no leader
/// writes it (a new leader reads it once elected; the deposed one's writes are fenced).
///
/// # Errors
/// [`Error::Config`] when etcd cannot be reached; [`Error::InvalidField`] naming the key at
/// fault: a head that does not parse (strictly: unknown or repeated fields are refused),
/// chunks missing or of the wrong total length, a log that does not start where the head (or,
/// without one, entry 1) says, or a gap in it.
pub async fn read_journal(cfg: &EtcdConfig, prefix: &str) -> Result<EtcdLog, Error> {
    let mut client = Client::connect(&cfg.endpoints, None)
        .await
        .map_err(etcd_err("connect"))?;
    let head = client
        .get(head_key(prefix), None)
        .await
        .map_err(etcd_err("get"))?;
    let head_name = || String::from_utf8_lossy(&head_key(prefix)).into_owned();
    let snapshot = match head.kvs().first() {
        None => None,
        Some(kv) => {
            let h: SnapshotHead = mx_layout::strict_json::from_slice(kv.value()).map_err(|e| {
                Error::InvalidField {
                    field: format!("etcd key {}", head_name()),
                    reason: e.to_string(),
                }
            })?;
            let dir = chunk_dir(prefix, h.seq);
            let chunks = read_range(&mut client, dir.clone(), prefix_end(&dir)).await?;
            let mut bytes = Vec::new();
            for (i, (key, chunk)) in chunks.iter().enumerate().take(h.chunks) {
                if *key != chunk_key(prefix, h.seq, i) {
                    return Err(Error::InvalidField {
                        field: format!("etcd key {}", head_name()),
                        reason: format!(
                            "snapshot chunk {i} of seq {} is missing ({} found instead)",
                            h.seq,
                            String::from_utf8_lossy(key)
                        ),
                    });
                }
                bytes.extend_from_slice(chunk);
            }
            if h.blob.is_none() && (bytes.len() as u64 != h.bytes || chunks.len() < h.chunks) {
                return Err(Error::InvalidField {
                    field: format!("etcd key {}", head_name()),
                    reason: format!(
                        "the snapshot of seq {} should be {} bytes in {} chunks; {} chunks hold {} bytes",
                        h.seq,
                        h.bytes,
                        h.chunks,
                        chunks.len().min(h.chunks),
                        bytes.len()
                    ),
                });
            }
            Some((h, bytes))
        }
    };
    let entries = log_entries(&mut client, prefix).await?;
    let first = snapshot.as_ref().map_or(1, |(h, _)| h.first_entry);
    if let Some((seq, _)) = entries.first() {
        if *seq != first {
            return Err(Error::InvalidField {
                field: String::from_utf8_lossy(&log_key(prefix, *seq)).into_owned(),
                reason: format!("the log starts at entry {seq}; entry {first} expected"),
            });
        }
    }
    Ok(EtcdLog { snapshot, entries })
}

/// Every key and value in `[from, to)`, in key order, read in pages that stay under the
/// client's 4 MiB message limit (values are at most [`MAX_ENTRY_BYTES`]).
async fn read_range(
    client: &mut Client,
    mut from: Vec<u8>,
    to: Vec<u8>,
) -> Result<Vec<(Vec<u8>, Vec<u8>)>, Error> {
    let page = etcd_client::GetOptions::new()
        .with_sort(etcd_client::SortTarget::Key, etcd_client::SortOrder::Ascend)
        .with_limit(PAGE_ENTRIES);
    let mut out = Vec::new();
    loop {
        let resp = client
            .get(from.clone(), Some(page.clone().with_range(to.clone())))
            .await
            .map_err(etcd_err("range"))?;
        out.extend(
            resp.kvs()
                .iter()
                .map(|kv| (kv.key().to_vec(), kv.value().to_vec())),
        );
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                // The next page starts right after the last key read.
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(out),
        }
    }
}

/// Every entry of the log under `prefix` (those after its snapshot, if it has one), in order:
/// `(entry, bytes)`.
///
/// # Errors
/// [`Error::Config`] when etcd cannot be reached; [`Error::InvalidField`] for a key under
/// `prefix` that is not a 20-digit sequence number, or a gap in the sequence.
pub async fn read_log(cfg: &EtcdConfig, prefix: &str) -> Result<Vec<(u64, Vec<u8>)>, Error> {
    let mut client = Client::connect(&cfg.endpoints, None)
        .await
        .map_err(etcd_err("connect"))?;
    log_entries(&mut client, prefix).await
}

/// [`read_log`] on a connected client.
async fn log_entries(client: &mut Client, prefix: &str) -> Result<Vec<(u64, Vec<u8>)>, Error> {
    let kvs = read_range(client, prefix.as_bytes().to_vec(), log_end(prefix)).await?;
    let mut out: Vec<(u64, Vec<u8>)> = Vec::with_capacity(kvs.len());
    for (key, value) in kvs {
        let key = String::from_utf8_lossy(&key);
        let seq = key
            .strip_prefix(prefix)
            .filter(|s| s.len() == 20)
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| Error::InvalidField {
                field: format!("etcd key {key}"),
                reason: format!("not {prefix}<20-digit sequence number>"),
            })?;
        if let Some((prev, _)) = out.last() {
            if Some(seq) != prev.checked_add(1) {
                return Err(Error::InvalidField {
                    field: format!("etcd key {key}"),
                    reason: format!("log entry {seq} follows {prev}: a gap"),
                });
            }
        }
        out.push((seq, value));
    }
    Ok(out)
}

/// Keys per range request of [`read_range`].
const PAGE_ENTRIES: i64 = 3;

/// The end of the range of keys starting with `prefix` (etcd's convention: the prefix with its
/// last byte below 0xff incremented and what follows dropped; `\0` for "to the end").
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(&b) = end.last() {
        if b < 0xff {
            if let Some(l) = end.last_mut() {
                *l = b + 1;
            }
            return end;
        }
        end.pop();
    }
    vec![0]
}

/// The current leader of `cfg.election`: its value (advertised URL) and epoch; `None` when
/// nobody leads.
///
/// # Errors
/// [`Error::Config`] when etcd cannot be reached.
pub async fn leader(cfg: &EtcdConfig) -> Result<Option<(String, Epoch)>, Error> {
    let client = Client::connect(&cfg.endpoints, None)
        .await
        .map_err(etcd_err("connect"))?;
    match client
        .election_client()
        .leader(cfg.election.as_bytes())
        .await
    {
        Ok(r) => Ok(r.kv().map(|kv| {
            (
                String::from_utf8_lossy(kv.value()).into_owned(),
                Epoch(kv.create_revision()),
            )
        })),
        // etcd answers "election: no leader" as an error.
        Err(e) if e.to_string().contains("no leader") => Ok(None),
        Err(e) => Err(etcd_err("leader")(e)),
    }
}
