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

fn log_key(prefix: &str, seq: u64) -> Vec<u8> {
    format!("{prefix}{seq:020}").into_bytes()
}

/// Every entry of the log under `prefix`, in order: `(seq, bytes)`.
///
/// # Errors
/// [`Error::Config`] when etcd cannot be reached; [`Error::InvalidField`] for a key under
/// `prefix` that is not a 20-digit sequence number, or a gap in the sequence.
pub async fn read_log(cfg: &EtcdConfig, prefix: &str) -> Result<Vec<(u64, Vec<u8>)>, Error> {
    let mut client = Client::connect(&cfg.endpoints, None)
        .await
        .map_err(etcd_err("connect"))?;
    // A range answer must stay under the client's 4 MiB message limit: at most
    // `PAGE_ENTRIES` entries of at most `MAX_ENTRY_BYTES` each per request.
    let end = etcd_client::GetOptions::new()
        .with_sort(etcd_client::SortTarget::Key, etcd_client::SortOrder::Ascend)
        .with_limit(PAGE_ENTRIES);
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut from = prefix.as_bytes().to_vec();
    loop {
        let opts = end.clone().with_range(prefix_end(prefix.as_bytes()));
        let resp = client
            .get(from.clone(), Some(opts))
            .await
            .map_err(etcd_err("range"))?;
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
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
            out.push((seq, kv.value().to_vec()));
        }
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

/// Entries per range request of [`read_log`].
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
