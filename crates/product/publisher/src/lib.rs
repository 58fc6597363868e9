//! mx-publisher: the library a trainer rank embeds to publish the weight shards it holds, from
//! memory it owns.
//!
//! A trainer rank connects ([`Publisher::connect`]: a NIXL agent, its progress thread, a
//! control-plane client), registers its memory once ([`Publisher::register`] takes a
//! [`ForeignMemory`], made by the caller through mx-nixl's `unsafe` constructor, whose contract
//! is the one this crate relies on), describes the shards it holds ([`Publisher::set_shards`]:
//! tensor, dtype, global shape, the box it owns and where its row-major bytes are, validated
//! against the model), and publishes each version ([`Publisher::publish`]). Every publish hashes
//! the bytes again (an optimizer step changed them in place), lists the destination layouts
//! registered at the control plane, cuts and digests the regions each needs
//! ([`mx_layout::plan::cut_for_layout`]), packs the strided ones contiguously (source-side
//! packing), and publishes a typed [`SourceManifest`]; it answers the version's id
//! ([`VersionId`], the Merkle root of every slot's shards) once the version is READY.
//!
//! When may the trainer write its memory again? In place (the default), only once the version
//! was handed back: [`Publisher::wait_staged`] (every worker of the version's stage holds it, or
//! the version will not be staged any more: see [`mx_control::Release`]),
//! [`Publisher::wait_committed`] or [`Publisher::release`]. With `copy: true`
//! ([`PublishOptions`]) the shards are first copied into an mx snapshot arena, and the trainer
//! may write as soon as `publish` returns; at most [`SNAPSHOT_RING`] snapshots are kept, a
//! snapshot is reused only once its version was released, and a publish that finds all of them
//! still needed waits (with its [`Patience`]).
//!
//! Destination layouts that register after a publish are served: while the current version's
//! bytes are held (copy mode, or in place until handed back), a background task polls the
//! registered layouts every [`WATCH_INTERVAL`] and republishes the manifest with the pieces of a
//! new layout appended (unpacked; the next publish packs for it). The control plane accepts such
//! an extension because shards, agent and metadata are unchanged.
//!
//! A control plane that is away (restarting, or gone for a while) never ends a publisher: every
//! call to it is retried with capped, jittered backoff, and waits ride out restarts, bounded by
//! [`Patience`].
//!
//! Left out: loading checkpoints and training (the demo trainer in the `mx` binary does that, as
//! any trainer would), packing for device memory (device shards are digested through host
//! copies and served unpacked unless snapshotted), unregistering memory before the publisher is
//! dropped, and peer re-publishing by workers.
//!
//! Map: `publisher` ([`Publisher`]: registered memory, publishes, the hand-back) · `spec` (the
//! caller's shard specs, validated) · `work` (digest, cut and pack per destination layout) ·
//! `export` (a published version to object storage).
#![forbid(unsafe_code)]

mod export;
mod publisher;
mod spec;
mod work;

use std::future::Future;
use std::time::{Duration, Instant};

use mx_control::client::Backoff;
pub use mx_control::Release;
pub use mx_layout::VersionId;
use mx_layout::{DType, LayoutSpec, TensorBox};
pub use mx_nixl::ForeignMemory;

pub use export::{export_version, ExportBase, ExportSpec};
pub use mx_artifact::{ArtifactUrl, ExportOptions, Exported, StoreOptions, WholeTensor};
pub use publisher::{PublishOptions, Published, Publisher, PublisherConfig};
pub use spec::{MemoryId, ShardSpec};

/// How many snapshot arenas copy mode keeps at most: 2 (the version being staged and the next
/// one). A copy-mode publish that finds both still needed waits until one's version is released.
pub const SNAPSHOT_RING: usize = 2;

/// How often the publisher looks for destination layouts registered after its last publish.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(mx_control::types::PUBLISHER_PING_MS);

/// Errors of the publisher; each wraps the failing layer's error or names what is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The layout cannot place the model, or cutting failed.
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// The data plane failed.
    #[error("nixl: {0}")]
    Nixl(#[from] mx_nixl::Error),
    /// The control plane refused or failed.
    #[error("control plane: {0}")]
    Control(#[from] mx_control::Error),
    /// A version did not reach what was waited for within the publisher's bound
    /// ([`Patience::GiveUpAfter`]); control-plane outages during the wait were ridden out.
    #[error("version {label:?} did not become {wanted} within {seconds:.0} s: {last}")]
    Timeout {
        /// Version label.
        label: String,
        /// What was waited for: DECLARED, READY, COMMITTED, or "released" (staged everywhere
        /// or never to be staged).
        wanted: String,
        /// Seconds waited.
        seconds: f64,
        /// The last answer (or error) of the control plane.
        last: String,
    },
    /// The slot is outside the trainer layout.
    #[error("slot {slot} is outside trainer layout {layout}")]
    BadSlot {
        /// The slot (trainer rank).
        slot: u32,
        /// The layout.
        layout: LayoutSpec,
    },
    /// A [`ShardSpec`] does not fit the model or the registered memory.
    #[error("shard {index} of tensor {tensor:?}: {problem}")]
    BadShard {
        /// Index of the spec in the list given to [`Publisher::set_shards`].
        index: usize,
        /// The tensor it names.
        tensor: String,
        /// What is wrong.
        problem: ShardProblem,
    },
    /// [`Publisher::publish`] before any shard was set.
    #[error("no shards set: call set_shards before publishing {label:?}")]
    NoShards {
        /// The label that was to be published.
        label: String,
    },
    /// Memory registered with another agent than the publisher's ([`Publisher::agent`]).
    #[error("memory registered with agent {memory_agent:?}, not the publisher's {agent:?}")]
    ForeignAgent {
        /// The publisher's agent.
        agent: String,
        /// The agent the memory was registered with.
        memory_agent: String,
    },
    /// A background task failed to run (panicked or was cancelled).
    #[error("task failed: {0}")]
    Task(String),
    /// An export cannot start: the version (or its base) is not READY.
    #[error("exporting {label:?}: {reason}")]
    Export {
        /// The version's label.
        label: String,
        /// Why not.
        reason: String,
    },
    /// Writing or reading an artifact failed (bytes that are not the version, the object store).
    #[error(transparent)]
    Artifact(#[from] mx_artifact::Error),
}

/// What is wrong with one [`ShardSpec`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardProblem {
    /// The model has no tensor of that name.
    #[error("no such tensor in the model")]
    UnknownTensor,
    /// The dtype differs from the model's.
    #[error("dtype {given} differs from the model's {model}")]
    DType {
        /// The spec's dtype.
        given: DType,
        /// The model's.
        model: DType,
    },
    /// The global shape differs from the model's.
    #[error("global shape {given:?} differs from the model's {model:?}")]
    Shape {
        /// The spec's global shape.
        given: Vec<u64>,
        /// The model's.
        model: Vec<u64>,
    },
    /// The box is not inside the global shape (or has another number of dims).
    #[error("box {shard} is outside global shape {shape:?}")]
    OutsideShape {
        /// The box.
        shard: TensorBox,
        /// The global shape.
        shape: Vec<u64>,
    },
    /// The memory id was not returned by this publisher's [`Publisher::register`].
    #[error("unknown memory id {memory}")]
    UnknownMemory {
        /// The id.
        memory: usize,
    },
    /// The box's bytes do not lie inside the region (or their size overflows u64).
    #[error("bytes {offset}..{offset}+{len} are outside memory {memory} of {region_len} bytes")]
    OutsideMemory {
        /// The memory id.
        memory: usize,
        /// Offset of the first byte in the region.
        offset: u64,
        /// Bytes of the box (`u64::MAX` when the size overflows).
        len: u64,
        /// Bytes of the region.
        region_len: u64,
    },
    /// Another shard of the same tensor overlaps this one.
    #[error("overlaps shard {other} (box {other_box}) of the same tensor")]
    Overlap {
        /// Index of the other spec.
        other: usize,
        /// Its box.
        other_box: TensorBox,
    },
}

/// How long a publisher waits for a version to be declared, READY, committed or released, or
/// for a snapshot to free up. Control-plane outages never end a wait early: they are retried
/// with backoff either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// Give up with [`Error::Timeout`] after this long.
    GiveUpAfter(Duration),
    /// Never give up; say so at warn level after each such period. The publisher keeps
    /// serving what it published meanwhile.
    WarnEvery(Duration),
}

impl Patience {
    fn period(self) -> Duration {
        match self {
            Patience::GiveUpAfter(d) | Patience::WarnEvery(d) => d,
        }
    }
}

/// First wait before retrying the control plane; doubles (with jitter) up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between retries of an unreachable control plane.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Calls `call(time_left)` until it answers `Some`. Transient control-plane errors (unreachable,
/// restarting) are retried with backoff, `None` (not reached yet, or a long poll that ended
/// early) again at once; other errors are returned. Once `patience`'s period has passed: an
/// [`Error::Timeout`] for `label`/`wanted` ([`Patience::GiveUpAfter`]), or a warning and
/// another period ([`Patience::WarnEvery`]).
pub(crate) async fn persist<T, Fut>(
    label: &str,
    wanted: &str,
    patience: Patience,
    mut call: impl FnMut(Duration) -> Fut,
) -> Result<T, Error>
where
    Fut: Future<Output = Result<Option<T>, mx_control::Error>>,
{
    let t0 = Instant::now();
    let mut deadline = t0 + patience.period();
    let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    let mut away_since: Option<Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (transient, last) = match call(left).await {
            Ok(Some(v)) => {
                if let Some(t) = away_since {
                    tracing::warn!(
                        label,
                        away_s = t.elapsed().as_secs_f64(),
                        "control plane reachable again"
                    );
                }
                return Ok(v);
            }
            Ok(None) => (false, "not yet".to_string()),
            Err(e) if e.is_transient() => (true, e.to_string()),
            Err(mx_control::Error::WaitNotReached { .. }) => (false, "not yet".to_string()),
            Err(e) => return Err(e.into()),
        };
        if Instant::now() >= deadline {
            match patience {
                Patience::GiveUpAfter(_) => {
                    return Err(Error::Timeout {
                        label: label.to_string(),
                        wanted: wanted.to_string(),
                        seconds: t0.elapsed().as_secs_f64(),
                        last,
                    })
                }
                Patience::WarnEvery(p) => {
                    tracing::warn!(
                        label,
                        waited_s = t0.elapsed().as_secs_f64(),
                        "version {label} is not {wanted} yet ({last}); still waiting, and serving what was published"
                    );
                    deadline = Instant::now() + p;
                }
            }
        }
        if transient {
            if away_since.is_none() {
                away_since = Some(Instant::now());
                tracing::warn!(
                    label,
                    "control plane unreachable ({last}); retrying with backoff"
                );
            }
            tokio::time::sleep(backoff.next_wait()).await;
        } else {
            // A long poll that ended before its time: the server shut down mid-wait.
            tokio::time::sleep(FIRST_BACKOFF.min(left)).await;
        }
    }
}
