//! mx-publisher: a trainer rank that publishes the weight shards it holds.
//!
//! [`Publisher::start`] loads only this rank's shards (per the trainer layout) from an HF
//! checkpoint into one registered NIXL [`Arena`], as a trainer's shard memory would be. For each
//! version it then digests every shard, cuts and digests the regions every registered destination
//! layout needs from it ([`mx_layout::plan::cut_for_layout`]), packs the strided ones contiguously
//! after the shards (source-side packing, shared by every worker of that layout), and publishes a
//! typed [`SourceManifest`] with its NIXL agent metadata. [`Publisher::run_steps`] drives several
//! versions, applying [`mx_layout::update::training_step`] between them as a training step would.
//!
//! A control plane that is away (restarting, or gone for a while) never ends a publisher: every
//! call to it is retried with capped, jittered backoff, and waits ride out restarts. How long a
//! publisher waits for a version to be declared or committed is its [`Patience`]: give up after
//! a bound ([`Error::Timeout`]), or warn and keep waiting while its registered memory stays
//! served (`mx publish --stay`).
//!
//! Left out: the training itself, GPU memory (the arena is DRAM), and peer re-publishing.
#![forbid(unsafe_code)]

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mx_checkpoint::Checkpoint;
use mx_control::client::{Backoff, ControlClient};
use mx_control::VersionState;
use mx_layout::plan::{cut_for_layout, decompose, pack_marks, Cut};
use mx_layout::{
    rank_layout, rank_layouts, DestPiece, Digest, LayoutSpec, ModelInfo, RankLayout,
    SourceManifest, TensorBox,
};
use mx_nixl::{Agent, Arena, ProgressThread};
use rayon::prelude::*;

/// Errors of the publisher; each wraps the failing layer's error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] mx_checkpoint::Error),
    /// The layout cannot place the model.
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// The data plane failed.
    #[error("nixl: {0}")]
    Nixl(#[from] mx_nixl::Error),
    /// The control plane refused or failed.
    #[error("control plane: {0}")]
    Control(#[from] mx_control::Error),
    /// The checkpoint has no config.json.
    #[error("checkpoint {dir} has no config.json")]
    NoConfig {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A version did not reach the state waited for within the publisher's bound
    /// ([`Patience::GiveUpAfter`]); control-plane outages during the wait were ridden out.
    #[error("version {label:?} did not become {wanted} within {seconds:.0} s: {last}")]
    Timeout {
        /// Version label.
        label: String,
        /// The state waited for (DECLARED before publishing, COMMITTED after).
        wanted: VersionState,
        /// Seconds waited.
        seconds: f64,
        /// The last answer (or error) of the control plane.
        last: String,
    },
    /// Rank outside the layout.
    #[error("rank {rank} is outside layout {layout}")]
    BadRank {
        /// The rank.
        rank: u32,
        /// The layout.
        layout: LayoutSpec,
    },
}

/// How long a publisher waits for a version to be declared (before publishing it) or committed
/// (before training the next step). Control-plane outages never end a wait early: they are
/// retried with backoff either way.
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

/// Calls `call(time_left)` until it succeeds. Transient control-plane errors (unreachable,
/// restarting) and long polls that ended early (the server shut down mid-wait) are retried with
/// backoff; other errors are returned. Once `patience`'s period has passed: an
/// [`Error::Timeout`] for `label`/`wanted` ([`Patience::GiveUpAfter`]), or a warning and
/// another period ([`Patience::WarnEvery`]).
async fn persist<T, Fut>(
    label: &str,
    wanted: VersionState,
    patience: Patience,
    mut call: impl FnMut(Duration) -> Fut,
) -> Result<T, Error>
where
    Fut: Future<Output = Result<T, mx_control::Error>>,
{
    let t0 = Instant::now();
    let mut deadline = t0 + patience.period();
    let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    let mut away_since: Option<Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = match call(left).await {
            Ok(v) => {
                if let Some(t) = away_since {
                    tracing::warn!(
                        label,
                        away_s = t.elapsed().as_secs_f64(),
                        "control plane reachable again"
                    );
                }
                return Ok(v);
            }
            Err(e) => e,
        };
        let transient = e.is_transient();
        if !transient && !matches!(e, mx_control::Error::WaitNotReached { .. }) {
            return Err(e.into());
        }
        if Instant::now() >= deadline {
            match patience {
                Patience::GiveUpAfter(_) => {
                    return Err(Error::Timeout {
                        label: label.to_string(),
                        wanted,
                        seconds: t0.elapsed().as_secs_f64(),
                        last: e.to_string(),
                    })
                }
                Patience::WarnEvery(p) => {
                    tracing::warn!(
                        label,
                        waited_s = t0.elapsed().as_secs_f64(),
                        "version {label} is not {wanted} yet ({e}); still waiting, and serving what was published"
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
                    "control plane unreachable ({e}); retrying with backoff"
                );
            }
            tokio::time::sleep(backoff.next_wait()).await;
        } else {
            // A long poll that ended before its time: the server shut down mid-wait.
            tokio::time::sleep(FIRST_BACKOFF).await;
        }
    }
}

/// What a publisher needs to start.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Control plane address, `http://host:port`.
    pub control: String,
    /// HF checkpoint directory (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Trainer layout.
    pub layout: LayoutSpec,
    /// This trainer rank.
    pub rank: u32,
    /// Pack strided destination regions contiguously (source-side packing).
    pub pack: bool,
    /// Fault injection for tests: after each publish, flip one byte of this tensor's shard.
    pub fault_flip_byte: Option<String>,
}

/// One trainer rank's registered shard memory and its connection to the control plane.
pub struct Publisher {
    cfg: PublisherConfig,
    agent: Agent,
    arena: Arena,
    rank_layout: RankLayout,
    model: ModelInfo,
    client: ControlClient,
    /// Bytes of the rank buffer (shards); packed regions follow.
    shard_bytes: u64,
    /// Destination layouts packed for: (layout, its rank layouts).
    dest: Vec<(LayoutSpec, Vec<RankLayout>)>,
    /// Cuts per destination layout, each marked when it is packed.
    cuts: Vec<(LayoutSpec, Vec<Cut>, Vec<bool>)>,
    /// Polls the agent so pullers can connect (READs are one-sided, connection set-up is not).
    _progress: ProgressThread,
}

/// Copies `region` of a full row-major tensor `full` (shape `shape`) into `out`, row-major.
fn copy_box(full: &[u8], shape: &[u64], region: &TensorBox, elem: u64, out: &mut [u8]) {
    let (run, starts) = decompose(region, &TensorBox::full(shape));
    let rb = (run * elem) as usize;
    for (i, s) in starts.iter().enumerate() {
        let s = (*s * elem) as usize;
        out[i * rb..(i + 1) * rb].copy_from_slice(&full[s..s + rb]);
    }
}

impl Publisher {
    /// Loads this rank's shards into a registered arena, sized for packing every destination
    /// layout registered at the control plane right now (workers register when they start).
    ///
    /// # Errors
    /// [`Error::Checkpoint`], [`Error::Layout`] (e.g. the trainer layout cannot split a tensor),
    /// [`Error::Nixl`] (NIXL missing: the message says how to install it), [`Error::Control`].
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, Error> {
        if cfg.rank >= cfg.layout.world_size {
            return Err(Error::BadRank {
                rank: cfg.rank,
                layout: cfg.layout,
            });
        }
        mx_nixl::nixl_available()?;
        let ckpt = Checkpoint::open(&cfg.model_dir)?;
        let config = ckpt.config().ok_or_else(|| Error::NoConfig {
            dir: cfg.model_dir.clone(),
        })?;
        let model = ModelInfo::from_hf_config(config, ckpt.specs())?;
        let rl = rank_layout(&model, cfg.layout, cfg.rank)?;
        let client = ControlClient::connect(&cfg.control).await?;
        let mut dest = Vec::new();
        for l in client.list_layouts().await? {
            // A worker registered for another model (or a stale registration) must not block
            // this publisher: skip layouts that cannot place this model, saying which.
            match rank_layouts(&model, l) {
                Ok(rls) => dest.push((l, rls)),
                Err(e) => tracing::warn!(layout = %l, "not cutting for registered layout {l}: {e}"),
            }
        }
        // Shard entries with addresses filled in once the arena exists.
        let proto_shards = rl.shard_entries(0);
        let mut cuts = Vec::new();
        let mut packed = 0u64;
        let fleet = client.get_status().await?;
        for (l, rls) in &dest {
            let c = cut_for_layout(&proto_shards, rls)?;
            let rank_sets: Vec<Vec<u32>> = fleet
                .workers
                .iter()
                .filter(|w| w.layout == *l)
                .map(|w| w.ranks.clone())
                .collect();
            let marks = if cfg.pack {
                pack_marks(&c, &rank_sets)
            } else {
                vec![false; c.len()]
            };
            packed += c
                .iter()
                .zip(&marks)
                .filter(|(_, m)| **m)
                .map(|(c, _)| c.bytes())
                .sum::<u64>();
            cuts.push((*l, c, marks));
        }
        let agent = Agent::new(&format!(
            "mx-pub-{}-{}-{}",
            cfg.layout,
            cfg.rank,
            std::process::id()
        ))?;
        let mut arena = Arena::new(&agent, (rl.total_bytes + packed).max(1))?;
        // Load only this rank's boxes from the checkpoint.
        {
            let buf = arena.as_mut_slice();
            for p in &rl.params {
                for piece in &p.pieces {
                    let t = ckpt.tensor(&piece.tensor)?;
                    let elem = piece.dtype.size_bytes();
                    let len = (piece.region.numel().unwrap_or(0) * elem) as usize;
                    let o = piece.offset as usize;
                    copy_box(t.data, &t.shape, &piece.region, elem, &mut buf[o..o + len]);
                }
            }
        }
        let progress = agent.spawn_progress(Duration::from_millis(1));
        Ok(Publisher {
            _progress: progress,
            shard_bytes: rl.total_bytes,
            cfg,
            agent,
            arena,
            rank_layout: rl,
            model,
            client,
            dest,
            cuts,
        })
    }

    /// The model this publisher serves.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    /// Fault injection: flips one byte (the middle one) of this rank's shard of `tensor` in the
    /// registered memory, after its digests were published, as a memory error or a racing
    /// optimizer step would. Returns the flipped address, or `None` when this rank holds none of
    /// `tensor`.
    pub fn flip_byte(&mut self, tensor: &str) -> Option<u64> {
        let base = self.arena.addr();
        let piece = self
            .rank_layout
            .params
            .iter()
            .flat_map(|p| p.pieces.iter())
            .find(|p| p.tensor == tensor)?;
        let len = piece.region.numel()? * piece.dtype.size_bytes();
        if len == 0 {
            return None;
        }
        let at = piece.offset + len / 2;
        let b = self.arena.as_mut_slice().get_mut(at as usize)?;
        *b ^= 0x01;
        tracing::warn!(tensor, addr = base + at, "fault injected: flipped one byte");
        Some(base + at)
    }

    /// Applies `training_step(step)` to every shard in place.
    pub fn train_step(&mut self, step: u32) {
        let rl = &self.rank_layout;
        let buf = &mut self.arena.as_mut_slice()[..self.shard_bytes as usize];
        let mut rest: &mut [u8] = buf;
        let mut chunks = Vec::new();
        let mut pos = 0u64;
        for p in &rl.params {
            let (_, tail) = rest.split_at_mut((p.offset - pos) as usize);
            let (mine, tail) = tail.split_at_mut(p.len as usize);
            chunks.push((p.dtype, mine));
            rest = tail;
            pos = p.offset + p.len;
        }
        chunks
            .into_par_iter()
            .for_each(|(dt, b)| mx_layout::update::training_step(dt, b, step));
    }

    /// Digests, packs and publishes the current shard bytes as version `label` (which the
    /// orchestrator must have declared; waits up to `wait` for the declaration). A control
    /// plane that is away or restarting is retried with backoff within `wait`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the version is not declared in time, [`Error::Control`] when the
    /// manifest is refused.
    pub async fn publish(&mut self, label: &str, wait: Duration) -> Result<SourceManifest, Error> {
        self.publish_with(label, Patience::GiveUpAfter(wait)).await
    }

    /// [`Publisher::publish`] waiting for the declaration with `patience`.
    ///
    /// # Errors
    /// As [`Publisher::publish`].
    pub async fn publish_with(
        &mut self,
        label: &str,
        patience: Patience,
    ) -> Result<SourceManifest, Error> {
        let client = self.client.clone();
        persist(label, VersionState::Declared, patience, |left| {
            let client = client.clone();
            async move {
                client
                    .wait_version(label, VersionState::Declared, left)
                    .await
            }
        })
        .await?;
        let t0 = Instant::now();
        let base = self.arena.addr();
        let mut shards = self.rank_layout.shard_entries(base);
        let shard_bytes = self.shard_bytes as usize;
        let (mem, packed_area) = self.arena.as_mut_slice().split_at_mut(shard_bytes);
        let mem: &[u8] = mem;
        shards.par_iter_mut().for_each(|s| {
            let o = (s.addr - base) as usize;
            s.digest = Digest::of(&mem[o..o + s.len as usize]);
        });
        // Pack and digest the destination regions.
        let mut pieces = Vec::new();
        let mut jobs: Vec<(LayoutSpec, &Cut, Option<u64>)> = Vec::new();
        let mut cursor = 0u64;
        for (l, cuts, marks) in &self.cuts {
            for (c, &mark) in cuts.iter().zip(marks) {
                let packed = if mark {
                    let a = cursor;
                    cursor += c.bytes();
                    Some(a)
                } else {
                    None
                };
                jobs.push((*l, c, packed));
            }
        }
        // Split the packed area into disjoint slices, one per packed cut, for parallel packing.
        let mut slots: Vec<Option<&mut [u8]>> = Vec::with_capacity(jobs.len());
        let mut rest: &mut [u8] = packed_area;
        for (_, c, p) in &jobs {
            if p.is_some() {
                let (a, b) = rest.split_at_mut(c.bytes() as usize);
                slots.push(Some(a));
                rest = b;
            } else {
                slots.push(None);
            }
        }
        let shard_list = &shards;
        let digest_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let pack_nanos = std::sync::atomic::AtomicU64::new(0);
        let digests: Vec<Digest> = jobs
            .par_iter()
            .zip(slots.into_par_iter())
            .map(|((_, c, _), slot)| {
                let s = &shard_list[c.shard];
                let so = (s.addr - base) as usize;
                let rb = c.run_bytes as usize;
                match slot {
                    Some(out) => {
                        let tp = Instant::now();
                        for (i, &o) in c.run_offsets.iter().enumerate() {
                            let o = so + o as usize;
                            out[i * rb..(i + 1) * rb].copy_from_slice(&mem[o..o + rb]);
                        }
                        let ns = u64::try_from(tp.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        pack_nanos.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
                        Digest::of(out)
                    }
                    None => mx_layout::digest_segments(c.run_offsets.iter().map(|&o| {
                        let o = so + o as usize;
                        &mem[o..o + rb]
                    })),
                }
            })
            .collect();
        let packed_base = base + self.shard_bytes;
        for ((l, c, p), d) in jobs.iter().zip(digests) {
            pieces.push(DestPiece {
                layout: *l,
                dest_rank: c.dest_rank,
                tensor: c.tensor.clone(),
                region: c.region.clone(),
                digest: d,
                packed_addr: p.map(|a| packed_base + a),
            });
        }
        let manifest = SourceManifest {
            slot: self.cfg.rank,
            layout: self.cfg.layout,
            agent_name: self.agent.name().to_string(),
            agent_metadata: self.agent.local_metadata()?,
            shards,
            pieces,
            // Copy time of the packing itself (summed over threads), not the digests every
            // publish computes anyway.
            pack_seconds: pack_nanos.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9,
        };
        tracing::info!(
            label,
            shard_digest_s = digest_s,
            cut_digest_and_pack_s = t1.elapsed().as_secs_f64(),
            pack_s = manifest.pack_seconds,
            "digested and packed"
        );
        // Republishing the same manifest is idempotent, so a publish the control plane may
        // have journaled just before it went away is simply sent again.
        persist(label, VersionState::Publishing, patience, |_| {
            let (client, manifest) = (&client, &manifest);
            async move { client.publish(label, manifest).await }
        })
        .await?;
        tracing::info!(
            label,
            slot = self.cfg.rank,
            pack_s = manifest.pack_seconds,
            "published"
        );
        Ok(manifest)
    }

    /// Publishes `steps` versions labelled `{prefix}{k}` for k in 1..=steps; before version k > 1
    /// waits until version k-1 is COMMITTED, then applies training step k. Returns after the last
    /// version is COMMITTED (so its bytes stay served until every worker staged them). Every
    /// wait (declaration, commit) follows `patience`; the control plane going away or
    /// restarting meanwhile is ridden out.
    ///
    /// # Errors
    /// As [`Publisher::publish`]; [`Error::Timeout`] when a version does not commit within
    /// [`Patience::GiveUpAfter`].
    pub async fn run_steps(
        &mut self,
        prefix: &str,
        steps: u32,
        patience: Patience,
    ) -> Result<(), Error> {
        self.run_steps_from(prefix, 1, steps, patience).await
    }

    /// [`Publisher::run_steps`] starting at version `first` (>= 1): training steps 2..=`first`
    /// are applied without publishing (a trainer that joins at a later step), then versions
    /// `first..=steps` are published as there. `first > steps` publishes nothing.
    ///
    /// # Errors
    /// As [`Publisher::run_steps`].
    pub async fn run_steps_from(
        &mut self,
        prefix: &str,
        first: u32,
        steps: u32,
        patience: Patience,
    ) -> Result<(), Error> {
        let first = first.max(1);
        for k in 2..=first.min(steps) {
            self.train_step(k);
        }
        for k in first..=steps {
            if k > first {
                let prev = format!("{prefix}{}", k - 1);
                self.wait_committed(&prev, patience).await?;
                self.train_step(k);
            }
            self.publish_with(&format!("{prefix}{k}"), patience).await?;
            if let Some(t) = self.cfg.fault_flip_byte.clone() {
                self.flip_byte(&t);
            }
        }
        if first > steps {
            return Ok(());
        }
        self.wait_committed(&format!("{prefix}{steps}"), patience)
            .await
    }

    /// Waits until `label` is COMMITTED, riding out control-plane restarts (a failed long poll
    /// is retried with backoff), so a publisher keeps serving its bytes while the control plane
    /// recovers from its journal.
    ///
    /// # Errors
    /// [`Error::Timeout`] past [`Patience::GiveUpAfter`]; [`Error::Control`] when the control
    /// plane refuses the wait.
    pub async fn wait_committed(&self, label: &str, patience: Patience) -> Result<(), Error> {
        let client = self.client.clone();
        persist(label, VersionState::Committed, patience, |left| {
            let client = client.clone();
            async move {
                client
                    .wait_version(label, VersionState::Committed, left)
                    .await
            }
        })
        .await?;
        Ok(())
    }

    /// Destination layouts this publisher cuts and packs for.
    pub fn dest_layouts(&self) -> Vec<LayoutSpec> {
        self.dest.iter().map(|(l, _)| *l).collect()
    }
}
