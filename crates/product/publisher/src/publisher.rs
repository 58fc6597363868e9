//! [`Publisher`]: registered memory, shard specs, publishes, and the hand-back of a version.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mx_control::client::{ClientAuth, ControlClient};
use mx_control::{Release, VersionState};
use mx_layout::{
    rank_layouts, LayoutSpec, MemDevice, ModelInfo, ShardEntry, SourceManifest, VersionId,
};
use mx_nixl::{Agent, Arena, ForeignMemory, MemoryKind, ProgressThread};
use rayon::prelude::*;

use crate::spec::{validate, MemoryId, ShardSpec};
use crate::work::{cut_all, cut_pieces, digest_shards, packed_bytes, Cuts, DestLayout};
use crate::{persist, Error, Patience, SNAPSHOT_RING, WATCH_INTERVAL};

/// What a publisher needs to connect.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Control plane address, `http://host:port`.
    pub control: String,
    /// This source's slot: its rank in the trainer layout.
    pub slot: u32,
    /// The trainer layout (goes into every manifest; the version's declaration must match).
    pub layout: LayoutSpec,
    /// The model: tensor names, dtypes and global shapes shards are checked against, and the
    /// geometry destination layouts are cut with.
    pub model: ModelInfo,
    /// Pack strided destination regions contiguously (source-side packing).
    pub pack: bool,
}

/// How one publish runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishOptions {
    /// Snapshot the shards into an mx arena first, so the caller may write its memory as soon
    /// as `publish` returns (costs one copy of the rank's bytes; see [`crate::SNAPSHOT_RING`]).
    pub copy: bool,
    /// How long to wait for the declaration, a free snapshot and READY.
    pub patience: Patience,
}

impl Default for PublishOptions {
    /// In place, giving up after 600 s.
    fn default() -> Self {
        PublishOptions {
            copy: false,
            patience: Patience::GiveUpAfter(Duration::from_secs(600)),
        }
    }
}

/// What a publish did.
#[derive(Debug, Clone)]
pub struct Published {
    /// The version's label.
    pub label: String,
    /// The version's id: the Merkle root of every slot's shards (known once READY).
    pub version: VersionId,
    /// This slot's manifest as published.
    pub manifest: SourceManifest,
    /// Bytes of this rank's shards.
    pub shard_bytes: u64,
    /// Seconds copying the shards into the snapshot (copy mode; 0 in place), not counting
    /// finding or mapping the snapshot arena.
    pub copy_s: f64,
    /// Seconds hashing the shards.
    pub digest_s: f64,
    /// Seconds cutting, digesting and packing the destination regions.
    pub cut_s: f64,
    /// Seconds of packing copies alone (summed over threads), as in the manifest.
    pub pack_s: f64,
    /// Destination layouts cut for.
    pub layouts: Vec<LayoutSpec>,
}

/// Refuses at once to wait for a label the control plane does not know (a typo would otherwise
/// wait out the whole timeout); any other answer, an outage included, lets the wait go on.
///
/// # Errors
/// [`Error::Control`] for which [`mx_control::Error::is_unknown_version`] holds.
async fn refuse_unknown(client: &ControlClient, label: &str) -> Result<(), Error> {
    match client.get_version(label).await {
        Err(e) if e.is_unknown_version() => Err(Error::Control(e)),
        _ => Ok(()),
    }
}

/// Where a served version's shard bytes are: `(memory index, offset, len)` of the caller's
/// regions, or ranges of a snapshot arena.
enum Held {
    InPlace {
        memories: Vec<Arc<ForeignMemory>>,
        locs: Vec<(usize, u64, u64)>,
    },
    Snapshot {
        arena: Arc<Mutex<Arena>>,
        ranges: Vec<(u64, u64)>,
    },
}

/// The current version while its bytes are held: extended for late layouts.
struct Served {
    label: String,
    manifest: SourceManifest,
    held: Held,
    /// Layouts cut for (or found unable to place the model).
    layouts: BTreeSet<LayoutSpec>,
    /// An extension not yet accepted by the control plane.
    unsent: bool,
}

struct Shared {
    client: ControlClient,
    /// The NIXL agent's name (its pings name it).
    agent_name: String,
    model: ModelInfo,
    served: Mutex<Option<Served>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The bytes of each `(memory, offset, len)`: borrowed from host memory, copied from device
/// memory.
fn region_bytes<'a>(
    memories: &'a [Arc<ForeignMemory>],
    locs: &[(usize, u64, u64)],
) -> Result<Vec<Cow<'a, [u8]>>, Error> {
    locs.iter()
        .map(|&(m, off, len)| {
            let mem = &memories[m];
            match mem.as_slice() {
                Some(s) => Ok(Cow::Borrowed(&s[off as usize..(off + len) as usize])),
                None => {
                    let mut v = vec![0u8; len as usize];
                    mem.read_into(off, &mut v)?;
                    Ok(Cow::Owned(v))
                }
            }
        })
        .collect()
}

impl Shared {
    /// Appends pieces for layouts in `layouts` the served version was not cut for, and returns
    /// the manifest to republish (also when an earlier extension was not accepted yet).
    fn extend(&self, layouts: &[LayoutSpec]) -> Result<Option<(String, SourceManifest)>, Error> {
        let mut g = lock(&self.served);
        let Some(s) = g.as_mut() else {
            return Ok(None);
        };
        let mut dests = Vec::new();
        let new: Vec<LayoutSpec> = layouts
            .iter()
            .filter(|l| !s.layouts.contains(l))
            .copied()
            .collect();
        for l in new {
            s.layouts.insert(l);
            match rank_layouts(&self.model, l) {
                Ok(ranks) => dests.push(DestLayout {
                    layout: l,
                    ranks,
                    rank_sets: Vec::new(),
                }),
                Err(e) => tracing::warn!(layout = %l, "not cutting for registered layout {l}: {e}"),
            }
        }
        if !dests.is_empty() {
            let cuts = cut_all(&s.manifest.shards, &dests, false)?;
            let pieces = match &s.held {
                Held::InPlace { memories, locs } => {
                    let bytes = region_bytes(memories, locs)?;
                    let views: Vec<&[u8]> = bytes.iter().map(|c| &**c).collect();
                    cut_pieces(&views, &cuts, &mut [], 0).0
                }
                Held::Snapshot { arena, ranges } => {
                    let a = lock(arena);
                    let all = a.as_slice();
                    let views: Vec<&[u8]> = ranges
                        .iter()
                        .map(|&(o, l)| &all[o as usize..(o + l) as usize])
                        .collect();
                    cut_pieces(&views, &cuts, &mut [], 0).0
                }
            };
            tracing::info!(
                label = s.label,
                layouts = ?dests.iter().map(|d| d.layout.to_string()).collect::<Vec<_>>(),
                pieces = pieces.len(),
                "extending the served version for layouts registered after its publish"
            );
            s.manifest.pieces.extend(pieces);
            s.unsent = true;
        }
        Ok(s.unsent.then(|| (s.label.clone(), s.manifest.clone())))
    }

    /// Marks an extension of `label` with `pieces` pieces accepted.
    fn sent(&self, label: &str, pieces: usize) {
        if let Some(s) = lock(&self.served).as_mut() {
            if s.label == label && s.manifest.pieces.len() == pieces {
                s.unsent = false;
            }
        }
    }

    /// Stops serving `label` from the held bytes (the caller may write them again).
    fn hand_back(&self, label: &str) {
        let mut g = lock(&self.served);
        if g.as_ref().is_some_and(|s| s.label == label) {
            *g = None;
        }
    }
}

/// Watches the registered layouts and extends the served version for new ones.
async fn watch(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(WATCH_INTERVAL).await;
        if lock(&shared.served).is_none() {
            continue;
        }
        // Naming the agent tells the control plane this publisher is alive (`mx status`).
        let Ok(layouts) = shared.client.list_layouts_as(&shared.agent_name).await else {
            continue;
        };
        let s = Arc::clone(&shared);
        let r = tokio::task::spawn_blocking(move || s.extend(&layouts)).await;
        let (label, m) = match r {
            Ok(Ok(Some(x))) => x,
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "extending the served version failed");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "extension task failed");
                continue;
            }
        };
        match shared.client.publish(&label, &m).await {
            Ok(_) => shared.sent(&label, m.pieces.len()),
            Err(e) => {
                tracing::warn!(label, error = %e, "republishing with more pieces failed; retrying")
            }
        }
    }
}

/// One snapshot arena of copy mode and the version it holds.
struct Snapshot {
    arena: Arc<Mutex<Arena>>,
    label: Option<String>,
    /// Publish sequence number of its version (the oldest is waited for first).
    seq: u64,
}

/// What cuts depend on besides the shard specs: each destination layout and the rank sets of
/// its registered workers (which cuts are packed).
type CutKey = Vec<(LayoutSpec, Vec<Vec<u32>>)>;

/// Alignment of shards in a snapshot arena, in bytes.
const SNAPSHOT_ALIGN: u64 = 64;

/// One trainer rank: its NIXL agent, registered memory, shard specs and control-plane client.
///
/// Publishes take `&mut self`: one at a time. Dropping the publisher stops serving (its
/// registrations, snapshot and packing arenas go with it).
pub struct Publisher {
    cfg: PublisherConfig,
    agent: Agent,
    shared: Arc<Shared>,
    memories: Vec<Arc<ForeignMemory>>,
    specs: Vec<ShardSpec>,
    /// Cuts for the layouts (with their workers' rank sets) they were made for.
    cut_cache: Option<(CutKey, Vec<Cuts>)>,
    /// In-place mode's packing arena (grown by replacement).
    pack: Option<Arena>,
    ring: Vec<Snapshot>,
    seq: u64,
    watcher: tokio::task::JoinHandle<()>,
    _progress: ProgressThread,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("agent", &self.agent.name())
            .field("slot", &self.cfg.slot)
            .field("layout", &self.cfg.layout)
            .field("memories", &self.memories.len())
            .field("shards", &self.specs.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

static AGENTS: AtomicU64 = AtomicU64::new(0);

impl Publisher {
    /// Creates the NIXL agent (with a progress thread, so peers can connect) and connects to
    /// the control plane. Must run inside a tokio runtime (it starts the layout watcher).
    ///
    /// # Errors
    /// [`Error::BadSlot`] when `slot` is outside `layout`; [`Error::Nixl`] when NIXL is missing
    /// (the message says how to install it); [`Error::Control`] when the control plane cannot
    /// be reached.
    pub async fn connect(cfg: PublisherConfig) -> Result<Publisher, Error> {
        Publisher::connect_with(cfg, &ClientAuth::from_env()?).await
    }

    /// [`connect`](Self::connect) with explicit control-plane credentials (a process whose
    /// other clients hold other roles).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_with(cfg: PublisherConfig, auth: &ClientAuth) -> Result<Publisher, Error> {
        if cfg.slot >= cfg.layout.world_size {
            return Err(Error::BadSlot {
                slot: cfg.slot,
                layout: cfg.layout,
            });
        }
        mx_nixl::nixl_available()?;
        let client = ControlClient::connect_with(&cfg.control, auth).await?;
        let agent = Agent::new(&format!(
            "mx-pub-{}-{}-{}-{}",
            cfg.layout,
            cfg.slot,
            std::process::id(),
            AGENTS.fetch_add(1, Ordering::Relaxed)
        ))?;
        let progress = agent.spawn_progress(Duration::from_millis(1));
        let shared = Arc::new(Shared {
            client,
            agent_name: agent.name().to_string(),
            model: cfg.model.clone(),
            served: Mutex::new(None),
        });
        let watcher = tokio::spawn(watch(Arc::clone(&shared)));
        Ok(Publisher {
            cfg,
            agent,
            shared,
            memories: Vec::new(),
            specs: Vec::new(),
            cut_cache: None,
            pack: None,
            ring: Vec::new(),
            seq: 0,
            watcher,
            _progress: progress,
        })
    }

    /// The agent memory must be registered with ([`ForeignMemory::register_host`]).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The model shards are checked against.
    pub fn model(&self) -> &ModelInfo {
        &self.cfg.model
    }

    /// Exports a READY version to object storage from whole tensors the trainer assembled
    /// (typically on one rank, e.g. `DTensor.full_tensor()`), and records the artifact at the
    /// control plane: [`crate::export_version`] with this publisher's control plane and model.
    ///
    /// # Errors
    /// As [`crate::export_version`].
    pub async fn export(
        &self,
        spec: &crate::ExportSpec<'_>,
    ) -> Result<mx_artifact::Exported, Error> {
        crate::export_version(&self.shared.client, &self.cfg.model, spec).await
    }

    /// This publisher's slot (trainer rank).
    pub fn slot(&self) -> u32 {
        self.cfg.slot
    }

    /// Takes a registered region (one per tensor storage is fine; registering one large region
    /// is cheaper) and returns its id for [`ShardSpec::memory`]. The region stays registered
    /// until the publisher is dropped.
    ///
    /// # Errors
    /// [`Error::ForeignAgent`] when `mem` was registered with another agent than
    /// [`Publisher::agent`].
    pub fn register(&mut self, mem: ForeignMemory) -> Result<MemoryId, Error> {
        if mem.agent().name() != self.agent.name() {
            return Err(Error::ForeignAgent {
                agent: self.agent.name().to_string(),
                memory_agent: mem.agent().name().to_string(),
            });
        }
        self.memories.push(Arc::new(mem));
        Ok(MemoryId(self.memories.len() - 1))
    }

    /// Sets the shards this rank holds (replacing any set before). The caller's boxes are
    /// authoritative: the control plane's coverage check finds what no source holds.
    ///
    /// # Errors
    /// [`Error::BadShard`] naming the spec's index and tensor, for the first of: unknown
    /// tensor, dtype or global shape differing from the model, box outside the shape, unknown
    /// memory id, bytes outside the region, a box overlapping another of the same tensor.
    /// Nothing is changed on error.
    pub fn set_shards(&mut self, specs: Vec<ShardSpec>) -> Result<(), Error> {
        let regions: Vec<u64> = self.memories.iter().map(|m| m.len()).collect();
        validate(&specs, &self.cfg.model, &regions)?;
        self.specs = specs;
        self.cut_cache = None;
        Ok(())
    }

    /// The shards set.
    pub fn shards(&self) -> &[ShardSpec] {
        &self.specs
    }

    /// The destination layouts registered now (that can place the model), with their workers'
    /// rank sets; layouts that cannot are returned apart.
    async fn destinations(
        &self,
        label: &str,
        patience: Patience,
    ) -> Result<(Vec<DestLayout>, Vec<LayoutSpec>), Error> {
        let client = &self.shared.client;
        let (layouts, status) = persist(label, "listed", patience, |_| async move {
            Ok(Some((
                client.list_layouts().await?,
                client.get_status().await?,
            )))
        })
        .await?;
        let mut dests = Vec::new();
        let mut unplaced = Vec::new();
        for l in layouts {
            match rank_layouts(&self.cfg.model, l) {
                Ok(ranks) => dests.push(DestLayout {
                    layout: l,
                    ranks,
                    rank_sets: status
                        .workers
                        .iter()
                        .filter(|w| w.layout == l)
                        .map(|w| w.ranks.clone())
                        .collect(),
                }),
                Err(e) => {
                    tracing::warn!(layout = %l, "not cutting for registered layout {l}: {e}");
                    unplaced.push(l);
                }
            }
        }
        Ok((dests, unplaced))
    }

    /// Shard entries of the specs at their in-place addresses, digests unset.
    fn entries(&self) -> Vec<ShardEntry> {
        self.specs
            .iter()
            .map(|s| {
                let mem = &self.memories[s.memory.0];
                ShardEntry {
                    tensor: s.tensor.clone(),
                    dtype: s.dtype,
                    global_shape: s.global_shape.clone(),
                    shard: s.shard.clone(),
                    addr: mem.addr() + s.offset,
                    len: s.byte_len().unwrap_or(0),
                    device: match mem.kind() {
                        MemoryKind::Host => MemDevice::Dram,
                        MemoryKind::Cuda { device } => MemDevice::Vram(device),
                    },
                    digest: mx_layout::Digest([0; 32]),
                }
            })
            .collect()
    }

    fn cuts(&mut self, shards: &[ShardEntry], dests: &[DestLayout]) -> Result<Vec<Cuts>, Error> {
        let key: CutKey = dests
            .iter()
            .map(|d| (d.layout, d.rank_sets.clone()))
            .collect();
        if let Some((k, c)) = &self.cut_cache {
            if *k == key {
                return Ok(c.clone());
            }
        }
        let c = cut_all(shards, dests, self.cfg.pack)?;
        self.cut_cache = Some((key, c.clone()));
        Ok(c)
    }
}

impl Publisher {
    /// Publishes the current bytes of the shards as version `label` (which the orchestrator
    /// declares; waited for), and returns once the version is READY (every slot published),
    /// with its id.
    ///
    /// Every publish hashes the bytes again, lists the destination layouts registered now
    /// (cutting for new ones, growing the packing area as a new arena when needed), and stops
    /// extending the previous version. In place (`copy: false`) the caller must not write the
    /// memory until the version is handed back ([`Publisher::wait_staged`],
    /// [`Publisher::wait_committed`], [`Publisher::release`]); with `copy: true` it may write
    /// as soon as this returns.
    ///
    /// # Errors
    /// [`Error::NoShards`] before [`Publisher::set_shards`]; [`Error::Timeout`] when the
    /// declaration, a free snapshot or READY does not come within `opts.patience`;
    /// [`Error::Control`] when the manifest is refused (e.g. it disagrees with the
    /// declaration: the message names the tensor); [`Error::Nixl`] when an arena cannot be
    /// made.
    pub async fn publish(&mut self, label: &str, opts: PublishOptions) -> Result<Published, Error> {
        if self.specs.is_empty() {
            return Err(Error::NoShards {
                label: label.to_string(),
            });
        }
        let patience = opts.patience;
        let client = self.shared.client.clone();
        persist(label, "DECLARED", patience, |left| {
            let client = client.clone();
            async move {
                client
                    .wait_version(label, VersionState::Declared, left)
                    .await
                    .map(Some)
            }
        })
        .await?;
        // The previous version is not extended any more: its bytes are being replaced.
        *lock(&self.shared.served) = None;
        let (dests, unplaced) = self.destinations(label, patience).await?;
        let mut shards = self.entries();
        let cuts = self.cuts(&shards, &dests)?;
        let packed = packed_bytes(&cuts);
        let shard_bytes: u64 = shards.iter().map(|s| s.len).sum();
        let (held, digest_s, cut_s, pack_s, copy_s, pieces);
        if opts.copy {
            let mut offsets = Vec::with_capacity(shards.len());
            let mut end = 0u64;
            for s in &shards {
                offsets.push(end);
                end = (end + s.len).next_multiple_of(SNAPSHOT_ALIGN);
            }
            let slot = self.free_snapshot(label, end + packed, patience).await?;
            let t_copy = Instant::now();
            let arena = Arc::clone(&self.ring[slot].arena);
            let mut a = lock(&arena);
            let base = a.addr();
            {
                let bytes = region_bytes(&self.memories, &self.locs())?;
                let mut outs = Vec::with_capacity(shards.len());
                let mut rest: &mut [u8] = &mut a.as_mut_slice()[..end as usize];
                let mut at = 0u64;
                for (s, &o) in shards.iter().zip(&offsets) {
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut((o - at) as usize);
                    let (mine, tail) = tail.split_at_mut(s.len as usize);
                    outs.push(mine);
                    rest = tail;
                    at = o + s.len;
                }
                outs.into_par_iter()
                    .zip(bytes.par_iter())
                    .for_each(|(out, b)| out.copy_from_slice(b));
            }
            copy_s = t_copy.elapsed().as_secs_f64();
            let ranges: Vec<(u64, u64)> = shards
                .iter()
                .zip(&offsets)
                .map(|(s, &o)| (o, s.len))
                .collect();
            for (s, &o) in shards.iter_mut().zip(&offsets) {
                s.addr = base + o;
                s.device = MemDevice::Dram;
            }
            let (head, pack_area) = a.as_mut_slice().split_at_mut(end as usize);
            let head: &[u8] = head;
            let views: Vec<&[u8]> = ranges
                .iter()
                .map(|&(o, l)| &head[o as usize..(o + l) as usize])
                .collect();
            let t = Instant::now();
            digest_shards(&mut shards, &views);
            digest_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let (p, ps) = cut_pieces(&views, &cuts, &mut pack_area[..packed as usize], base + end);
            (cut_s, pack_s, pieces) = (t.elapsed().as_secs_f64(), ps, p);
            drop(a);
            self.ring[slot].label = Some(label.to_string());
            held = Held::Snapshot { arena, ranges };
        } else {
            copy_s = 0.0;
            if self.pack.as_ref().is_none_or(|a| a.len() < packed) && packed > 0 {
                // A new arena: the previous version (whose pieces may point into the old one)
                // was handed back before this publish, or is retired by it.
                self.pack = None;
                self.pack = Some(Arena::new(&self.agent, packed)?);
            }
            let locs = self.locs();
            let bytes = region_bytes(&self.memories, &locs)?;
            let views: Vec<&[u8]> = bytes.iter().map(|c| &**c).collect();
            let t = Instant::now();
            digest_shards(&mut shards, &views);
            digest_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let (area, addr) = match self.pack.as_mut() {
                Some(a) => {
                    let addr = a.addr();
                    (&mut a.as_mut_slice()[..packed as usize], addr)
                }
                None => (&mut [][..], 0),
            };
            let (p, ps) = cut_pieces(&views, &cuts, area, addr);
            (cut_s, pack_s, pieces) = (t.elapsed().as_secs_f64(), ps, p);
            held = Held::InPlace {
                memories: self.memories.clone(),
                locs,
            };
        }
        let manifest = SourceManifest {
            slot: self.cfg.slot,
            layout: self.cfg.layout,
            agent_name: self.agent.name().to_string(),
            agent_metadata: self.agent.local_metadata()?,
            shards,
            pieces,
            pack_seconds: pack_s,
        };
        tracing::info!(
            label,
            slot = self.cfg.slot,
            copy = opts.copy,
            copy_s,
            digest_s,
            cut_s,
            pack_s,
            "digested and packed"
        );
        // Republishing the same manifest is idempotent, so a publish the control plane may
        // have journaled just before it went away is simply sent again.
        let outcome = persist(label, "PUBLISHING", patience, |_| {
            let (client, manifest) = (&client, &manifest);
            async move { client.publish(label, manifest).await.map(Some) }
        })
        .await?;
        let layouts: Vec<LayoutSpec> = dests.iter().map(|d| d.layout).collect();
        *lock(&self.shared.served) = Some(Served {
            label: label.to_string(),
            manifest: manifest.clone(),
            held,
            layouts: layouts.iter().chain(&unplaced).copied().collect(),
            unsent: false,
        });
        let digest = match outcome.version_digest {
            Some(d) => d,
            None => {
                let info = persist(label, "READY", patience, |left| {
                    let client = client.clone();
                    async move {
                        client
                            .wait_version(label, VersionState::Ready, left)
                            .await
                            .map(|i| i.version_digest)
                    }
                })
                .await?;
                info
            }
        };
        tracing::info!(label, slot = self.cfg.slot, version = %VersionId(digest), "published");
        Ok(Published {
            label: label.to_string(),
            version: VersionId(digest),
            manifest,
            shard_bytes,
            copy_s,
            digest_s,
            cut_s,
            pack_s,
            layouts,
        })
    }

    /// `(memory index, offset, len)` of every shard spec.
    fn locs(&self) -> Vec<(usize, u64, u64)> {
        self.specs
            .iter()
            .map(|s| (s.memory.0, s.offset, s.byte_len().unwrap_or(0)))
            .collect()
    }

    /// A snapshot slot of at least `need` bytes for `label`: an unused one, one whose version
    /// was released, a new one while fewer than [`SNAPSHOT_RING`] exist, or else the oldest
    /// once its version is released (waited for with `patience`).
    async fn free_snapshot(
        &mut self,
        label: &str,
        need: u64,
        patience: Patience,
    ) -> Result<usize, Error> {
        self.seq += 1;
        let mut free = self.ring.iter().position(|s| s.label.is_none());
        if free.is_none() {
            for (i, s) in self.ring.iter().enumerate() {
                let Some(l) = s.label.as_deref() else {
                    continue;
                };
                if let Ok(Some(_)) = self.shared.client.wait_released(l, Duration::ZERO).await {
                    free = Some(i);
                    break;
                }
            }
        }
        if free.is_none() && self.ring.len() < SNAPSHOT_RING {
            self.ring.push(Snapshot {
                arena: Arc::new(Mutex::new(Arena::new(&self.agent, need.max(1))?)),
                label: None,
                seq: self.seq,
            });
            free = Some(self.ring.len() - 1);
        }
        let i = match free {
            Some(i) => i,
            None => {
                let (i, oldest) = self
                    .ring
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, s)| s.seq)
                    .map(|(i, s)| (i, s.label.clone().unwrap_or_default()))
                    .ok_or_else(|| Error::Task("empty snapshot ring".into()))?;
                tracing::info!(
                    label,
                    waiting_for = oldest,
                    "every snapshot holds a version not yet released; waiting"
                );
                let client = self.shared.client.clone();
                persist(&oldest, "released", patience, |left| {
                    let (client, oldest) = (client.clone(), oldest.clone());
                    async move { client.wait_released(&oldest, left).await }
                })
                .await?;
                i
            }
        };
        let s = &mut self.ring[i];
        if let Some(l) = s.label.take() {
            self.shared.hand_back(&l);
        }
        s.seq = self.seq;
        if lock(&s.arena).len() < need {
            s.arena = Arc::new(Mutex::new(Arena::new(&self.agent, need)?));
        }
        Ok(i)
    }

    /// Frees what this publisher holds for `label`: no more extensions, its snapshot reusable.
    async fn hand_back(&mut self, label: &str) -> Result<(), Error> {
        let shared = Arc::clone(&self.shared);
        let l = label.to_string();
        tokio::task::spawn_blocking(move || shared.hand_back(&l))
            .await
            .map_err(|e| Error::Task(e.to_string()))?;
        for s in &mut self.ring {
            if s.label.as_deref() == Some(label) {
                s.label = None;
            }
        }
        Ok(())
    }

    /// Waits until version `label` was handed back by the control plane, and returns why
    /// ([`Release`]): every worker of its last stage staged it ([`Release::Staged`]: a refit
    /// to it left STAGE, or a plain Stage completed), a refit to it ended ABORTED,
    /// ROLLED_BACK or FENCED before any stage of it completed ([`Release::RefitEnded`]), a
    /// version declared after it was committed ([`Release::Superseded`]), or a source released
    /// it ([`Release::Source`]). After it returns, the memory may be written again (in place)
    /// and its snapshot is reused (copy mode); the version is no longer extended for new
    /// layouts. Control-plane restarts are ridden out.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing released it within `timeout` (the version stays held);
    /// [`Error::Control`] when the control plane refuses the wait.
    pub async fn wait_staged(&mut self, label: &str, timeout: Duration) -> Result<Release, Error> {
        let client = self.shared.client.clone();
        refuse_unknown(&client, label).await?;
        let r = persist(label, "released", Patience::GiveUpAfter(timeout), |left| {
            let client = client.clone();
            async move { client.wait_released(label, left).await }
        })
        .await?;
        self.hand_back(label).await?;
        Ok(r)
    }

    /// Waits until `label` is COMMITTED (which implies every worker of the refit staged it),
    /// then hands it back as [`Publisher::wait_staged`] does. Control-plane restarts are
    /// ridden out, so a publisher keeps serving while the control plane recovers.
    ///
    /// # Errors
    /// [`Error::Timeout`] past [`Patience::GiveUpAfter`]; [`Error::Control`] when the control
    /// plane refuses the wait.
    pub async fn wait_committed(&mut self, label: &str, patience: Patience) -> Result<(), Error> {
        let client = self.shared.client.clone();
        refuse_unknown(&client, label).await?;
        persist(label, "COMMITTED", patience, |left| {
            let client = client.clone();
            async move {
                client
                    .wait_version(label, VersionState::Committed, left)
                    .await
                    .map(Some)
            }
        })
        .await?;
        self.hand_back(label).await
    }

    /// Stops serving `label` from this slot: hands it back locally (as [`wait_staged`] does)
    /// and tells the control plane ([`Release::Source`], unless the version was already
    /// released): workers that have not staged it can no longer pull it whole.
    ///
    /// [`wait_staged`]: Publisher::wait_staged
    ///
    /// # Errors
    /// [`Error::Control`] (e.g. an undeclared label); [`Error::Timeout`] when the control plane
    /// stays away past `patience`.
    pub async fn release(&mut self, label: &str, patience: Patience) -> Result<(), Error> {
        self.hand_back(label).await?;
        let client = self.shared.client.clone();
        let slot = self.cfg.slot;
        persist(label, "released", patience, |_| {
            let client = client.clone();
            async move { client.release_version(label, slot).await.map(Some) }
        })
        .await
    }
}
