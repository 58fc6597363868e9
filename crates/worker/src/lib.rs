//! mx-worker: an inference instance that pulls the ranges its own layout needs and applies them.
//!
//! A [`Worker`] holds one or more ranks of an inference layout (one process holding its TP ranks,
//! like an engine's executor). It registers its layout with the control plane when it starts, then
//! follows the commands on its stream:
//! - **Stage**: fetch the version's manifests, measure the data plane's cost model once
//!   ([`mx_nixl::probe_costs`], plus the local per-segment cost), plan
//!   ([`mx_layout::plan::plan`]), pull with NIXL READs into staging (one registered huge-page
//!   arena per source, kept across versions), verify every pulled region against the digest its
//!   source published (no extra bytes on the wire) on a second thread while the next source is
//!   pulled, report STAGED with per-rank digests of what was verified. Live weights are not
//!   touched.
//! - **Apply**: copy staged bytes into the live buffers in place (engines' CUDA graphs hold fixed
//!   addresses, so live buffers never move), zero-fill vocab padding, read back digests of the
//!   live bytes, report APPLIED with the resident version digest.
//!
//! Left out (later issues): pause/resume of generation, cache clearing, rollback to a pinned
//! previous version, the HTTP engine contracts.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mx_checkpoint::Checkpoint;
use mx_control::client::ControlClient;
use mx_control::{AppliedReport, Command, StagedReport};
use mx_layout::plan::{plan, CostModel, Plan};
use mx_layout::{rank_layout, Digest, LayoutSpec, ModelInfo, RankDigests, RankLayout};
use mx_nixl::{Agent, Arena, ReadOp, ReadOptions};
use rayon::prelude::*;

/// Errors of the worker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the model config failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] mx_checkpoint::Error),
    /// Layout or planning failed.
    #[error(transparent)]
    Layout(#[from] mx_layout::Error),
    /// The data plane failed.
    #[error("nixl: {0}")]
    Nixl(#[from] mx_nixl::Error),
    /// The control plane failed.
    #[error("control plane: {0}")]
    Control(#[from] mx_control::Error),
    /// A NIXL READ from one source failed.
    #[error("pull from source slot {slot} (agent {agent}) failed: {source}")]
    Pull {
        /// Source slot.
        slot: u32,
        /// Its NIXL agent.
        agent: String,
        /// The data-plane error.
        source: mx_nixl::Error,
    },
    /// A pulled region did not match its source's digest.
    #[error("verification failed: tensor {tensor} region {region} for rank {rank} from source slot {slot}")]
    Verify {
        /// Tensor.
        tensor: String,
        /// Region.
        region: String,
        /// Destination rank.
        rank: u32,
        /// Source slot.
        slot: u32,
    },
    /// Apply asked for a version that is not staged.
    #[error("apply of {label} ({digest}) but staged is {staged}")]
    NotStaged {
        /// Requested label.
        label: String,
        /// Requested digest.
        digest: Digest,
        /// What is staged.
        staged: String,
    },
    /// The checkpoint dir has no config.json.
    #[error("model dir {dir} has no config.json")]
    NoConfig {
        /// Directory.
        dir: PathBuf,
    },
    /// The control plane ended this worker's command stream: another worker registered with the
    /// same id, or the control plane stopped.
    #[error(
        "the control plane closed the command stream of worker {worker_id:?} (another worker registered with the same id, or the control plane stopped)"
    )]
    StreamClosed {
        /// This worker's id.
        worker_id: String,
    },
    /// A background task died.
    #[error("task failed: {0}")]
    Task(String),
}

/// What a worker needs to start.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Control plane address, `http://host:port`.
    pub control: String,
    /// Model directory: its config.json and safetensors header give the tensor list (no weights
    /// are read).
    pub model_dir: PathBuf,
    /// Inference layout.
    pub layout: LayoutSpec,
    /// Ranks of `layout` this instance holds.
    pub ranks: Vec<u32>,
    /// Worker id (unique in the fleet).
    pub worker_id: String,
    /// Instance name.
    pub instance: String,
}

/// Timings and counts of one stage.
#[derive(Debug, Clone, Default)]
pub struct StageStats {
    /// Seconds planning.
    pub plan_s: f64,
    /// Seconds in NIXL reads.
    pub pull_s: f64,
    /// Seconds verifying digests.
    pub verify_s: f64,
    /// Read descriptors.
    pub descriptors: u64,
    /// Wire bytes.
    pub wire_bytes: u64,
    /// Useful destination bytes.
    pub useful_bytes: u64,
}

struct Staged {
    label: String,
    digest: Digest,
    plan: Plan,
}

struct Core {
    agent: Agent,
    dest: Vec<RankLayout>,
    live: Vec<Vec<u8>>,
    /// Staging, one registered arena per source (source index, first staging offset, arena),
    /// so verification of one source's bytes runs while the next source is pulled.
    staging: Vec<(usize, u64, Arena)>,
    staged: Option<Staged>,
    cost: Option<CostModel>,
    resident: Option<Digest>,
}

/// One inference instance.
pub struct Worker {
    cfg: WorkerConfig,
    client: ControlClient,
    core: Arc<Mutex<Core>>,
}

fn lock(core: &Mutex<Core>) -> std::sync::MutexGuard<'_, Core> {
    core.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Worker {
    /// Computes the layout of its ranks, allocates live buffers, creates the NIXL agent and
    /// registers with the control plane.
    ///
    /// # Errors
    /// [`Error::Layout`] when the layout cannot place the model (e.g. tp=2 over 9 heads),
    /// [`Error::Nixl`] when NIXL is missing, [`Error::Control`].
    pub async fn start(cfg: WorkerConfig) -> Result<Worker, Error> {
        mx_nixl::nixl_available()?;
        let ckpt = Checkpoint::open(&cfg.model_dir)?;
        let config = ckpt.config().ok_or_else(|| Error::NoConfig {
            dir: cfg.model_dir.clone(),
        })?;
        let model = ModelInfo::from_hf_config(config, ckpt.specs())?;
        let dest = cfg
            .ranks
            .iter()
            .map(|&r| rank_layout(&model, cfg.layout, r))
            .collect::<Result<Vec<_>, _>>()?;
        let live = dest
            .iter()
            .map(|d| vec![0u8; d.total_bytes as usize])
            .collect();
        let agent = Agent::new(&format!(
            "mx-worker-{}-{}",
            cfg.worker_id,
            std::process::id()
        ))?;
        let client = ControlClient::connect(&cfg.control).await?;
        client
            .register_worker(&cfg.worker_id, &cfg.instance, &cfg.ranks, cfg.layout)
            .await?;
        tracing::info!(worker = cfg.worker_id, layout = %cfg.layout, ranks = ?cfg.ranks, "registered");
        Ok(Worker {
            cfg,
            client,
            core: Arc::new(Mutex::new(Core {
                agent,
                dest,
                live,
                staging: Vec::new(),
                staged: None,
                cost: None,
                resident: None,
            })),
        })
    }

    /// Follows the command stream until it ends.
    ///
    /// # Errors
    /// [`Error::Control`] when the stream fails, [`Error::StreamClosed`] when the control plane
    /// ends it. Stage/apply failures are reported to the control
    /// plane, not returned.
    pub async fn run(&self) -> Result<(), Error> {
        let mut stream = self.client.watch_commands(&self.cfg.worker_id).await?;
        while let Some(cmd) = stream.next().await? {
            match cmd {
                Command::Stage {
                    label,
                    version_digest,
                } => {
                    let t0 = Instant::now();
                    let res = self.stage(&label, version_digest).await;
                    let report = match res {
                        Ok((stats, strategies, ranks)) => {
                            tracing::info!(
                                worker = self.cfg.worker_id,
                                label,
                                pull_s = stats.pull_s,
                                verify_s = stats.verify_s,
                                plan_s = stats.plan_s,
                                descriptors = stats.descriptors,
                                "staged"
                            );
                            StagedReport {
                                worker_id: self.cfg.worker_id.clone(),
                                label: label.clone(),
                                ok: true,
                                error: String::new(),
                                ranks,
                                bytes: stats.useful_bytes,
                                descriptors: stats.descriptors,
                                seconds: t0.elapsed().as_secs_f64(),
                                strategies,
                            }
                        }
                        Err(e) => {
                            tracing::error!(
                                worker = self.cfg.worker_id,
                                label,
                                "stage failed: {e}"
                            );
                            StagedReport {
                                worker_id: self.cfg.worker_id.clone(),
                                label: label.clone(),
                                ok: false,
                                error: e.to_string(),
                                seconds: t0.elapsed().as_secs_f64(),
                                ..StagedReport::default()
                            }
                        }
                    };
                    if let Err(e) = self.client.report_staged(&report).await {
                        // A refused report (e.g. a newer Stage superseded this one) is not fatal:
                        // the control plane sends whatever it wants next on the stream.
                        tracing::warn!(worker = self.cfg.worker_id, "staged report refused: {e}");
                    }
                }
                Command::Apply {
                    label,
                    version_digest,
                } => {
                    let report = match self.apply(&label, version_digest).await {
                        Ok(ranks) => AppliedReport {
                            worker_id: self.cfg.worker_id.clone(),
                            label: label.clone(),
                            ok: true,
                            error: String::new(),
                            resident_version: Some(version_digest),
                            ranks,
                        },
                        Err(e) => AppliedReport {
                            worker_id: self.cfg.worker_id.clone(),
                            label: label.clone(),
                            ok: false,
                            error: e.to_string(),
                            resident_version: lock(&self.core).resident,
                            ranks: Vec::new(),
                        },
                    };
                    if let Err(e) = self.client.report_applied(&report).await {
                        tracing::warn!(worker = self.cfg.worker_id, "applied report refused: {e}");
                    }
                }
            }
        }
        Err(Error::StreamClosed {
            worker_id: self.cfg.worker_id.clone(),
        })
    }

    /// Plans, pulls and verifies `label` into staging.
    ///
    /// # Errors
    /// Planning, NIXL and verification errors; nothing live is touched.
    pub async fn stage(&self, label: &str, digest: Digest) -> Result<StageOutcome, Error> {
        let t = Instant::now();
        let info = self.client.get_version(label).await?;
        tracing::info!(
            label,
            fetch_s = t.elapsed().as_secs_f64(),
            "fetched manifests"
        );
        let core = self.core.clone();
        let label = label.to_string();
        tokio::task::spawn_blocking(move || {
            let mut c = lock(&core);
            stage_blocking(&mut c, &label, digest, &info.manifests)
        })
        .await
        .map_err(|e| Error::Task(e.to_string()))?
    }

    /// Applies the staged version to the live buffers and returns digests of the live bytes.
    ///
    /// # Errors
    /// [`Error::NotStaged`] when a different version (or none) is staged.
    pub async fn apply(&self, label: &str, digest: Digest) -> Result<Vec<RankDigests>, Error> {
        let core = self.core.clone();
        let label = label.to_string();
        tokio::task::spawn_blocking(move || {
            let mut c = lock(&core);
            apply_blocking(&mut c, &label, digest)
        })
        .await
        .map_err(|e| Error::Task(e.to_string()))?
    }
}

/// What a stage returns: timings, strategy counts, and per rank the digest of what was pulled for
/// each checkpoint tensor (blake3 over the verified region digests, in region order).
pub type StageOutcome = (StageStats, BTreeMap<String, u64>, Vec<RankDigests>);

fn stage_blocking(
    c: &mut Core,
    label: &str,
    digest: Digest,
    manifests: &[mx_layout::SourceManifest],
) -> Result<StageOutcome, Error> {
    let mut stats = StageStats::default();
    let t = Instant::now();
    // Load every source's agent metadata (idempotent per agent name).
    let mut remotes = Vec::with_capacity(manifests.len());
    for m in manifests {
        remotes.push(c.agent.load_remote(&m.agent_metadata)?);
    }
    if c.cost.is_none() {
        c.cost = Some(measure_costs(c, manifests, &remotes));
    }
    let cost = c.cost.unwrap_or_default();
    let load_s = t.elapsed().as_secs_f64();
    let p = plan(&c.dest, manifests, &cost)?;
    tracing::info!(load_s, "loaded remote metadata");
    stats.plan_s = t.elapsed().as_secs_f64();
    // Each source's reads occupy one contiguous range of staging (reads are ordered by source).
    let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
    for r in &p.reads {
        match ranges.last_mut() {
            Some(last) if last.0 == r.source => last.2 = last.2.max(r.staging_offset + r.len),
            _ => ranges.push((r.source, r.staging_offset, r.staging_offset + r.len)),
        }
    }
    let fits = c.staging.len() == ranges.len()
        && c.staging
            .iter()
            .zip(&ranges)
            .all(|((_, _, a), (_, lo, hi))| a.len() >= hi - lo);
    if !fits {
        c.staging.clear();
        for &(s, lo, hi) in &ranges {
            c.staging
                .push((s, lo, Arena::new(&c.agent, (hi - lo).max(1))?));
        }
    }
    for (slot, &(s, lo, _)) in c.staging.iter_mut().zip(&ranges) {
        slot.0 = s;
        slot.1 = lo;
    }
    let mut items: Vec<Vec<&mx_layout::plan::VerifyItem>> = vec![Vec::new(); ranges.len()];
    for v in &p.verify {
        if let Some(k) = ranges.iter().position(|r| r.0 == v.source) {
            items[k].push(v);
        }
    }
    let t = Instant::now();
    let opts = ReadOptions::default();
    let agent = &c.agent;
    let arenas = &mut c.staging;
    // Pull source by source; a verifier thread checks each source's regions as soon as its
    // bytes are in, while the next source is pulled.
    let (descriptors, pull_s, verify_tail_s, bad) = std::thread::scope(|sc| -> Result<_, Error> {
        let (tx, rx) = std::sync::mpsc::channel::<(usize, &Arena)>();
        let items = &items;
        let ranges_ref = &ranges;
        let verifier = sc.spawn(move || {
            for (k, arena) in rx {
                let lo = ranges_ref[k].1;
                let buf = arena.as_slice();
                let bad = items[k].par_iter().find_any(|v| {
                    let segs = v
                        .segments
                        .iter()
                        .map(|&(o, l)| &buf[(o - lo) as usize..(o - lo + l) as usize]);
                    mx_layout::digest_segments(segs) != v.digest
                });
                if let Some(v) = bad {
                    return Some(*v);
                }
            }
            None
        });
        let mut descriptors = 0;
        for (k, (s, lo, arena)) in arenas.iter_mut().enumerate() {
            let ops: Vec<ReadOp> = p
                .reads
                .iter()
                .filter(|r| r.source == *s)
                .map(|r| ReadOp {
                    remote_addr: r.src_addr,
                    len: r.len,
                    local_offset: r.staging_offset - *lo,
                })
                .collect();
            let st = agent
                .read(&remotes[*s], &ops, arena, &opts)
                .map_err(|source| Error::Pull {
                    slot: manifests[*s].slot,
                    agent: remotes[*s].clone(),
                    source,
                })?;
            descriptors += st.descriptors;
            let shared: &Arena = arena;
            if tx.send((k, shared)).is_err() {
                break; // the verifier already found a bad region
            }
        }
        let pull_s = t.elapsed().as_secs_f64();
        drop(tx);
        let t_tail = Instant::now();
        let bad = verifier
            .join()
            .map_err(|_| Error::Task("verifier thread panicked".into()))?;
        Ok((descriptors, pull_s, t_tail.elapsed().as_secs_f64(), bad))
    })?;
    stats.descriptors = descriptors;
    stats.pull_s = pull_s;
    stats.verify_s = verify_tail_s;
    if let Some(v) = bad {
        c.staged = None;
        return Err(Error::Verify {
            tensor: v.tensor.clone(),
            region: v.region.to_string(),
            rank: v.dest_rank,
            slot: manifests.get(v.source).map(|m| m.slot).unwrap_or(u32::MAX),
        });
    }
    stats.wire_bytes = p.wire_bytes;
    stats.useful_bytes = p.useful_bytes;
    let strategies = p.strategy_counts();
    let pulled = pulled_digests(&c.dest, &p);
    c.staged = Some(Staged {
        label: label.to_string(),
        digest,
        plan: p,
    });
    Ok((stats, strategies, pulled))
}

/// Per rank, per checkpoint tensor: blake3 over the digests of the regions pulled and verified for
/// it, in (tensor, region) order.
fn pulled_digests(dest: &[RankLayout], p: &Plan) -> Vec<RankDigests> {
    dest.iter()
        .map(|rl| {
            let mut items: Vec<(&str, &mx_layout::TensorBox, Digest)> = p
                .verify
                .iter()
                .filter(|v| v.dest_rank == rl.rank || v.shared_with.contains(&rl.rank))
                .map(|v| (v.tensor.as_str(), &v.region, v.digest))
                .collect();
            items.sort();
            let mut tensors: BTreeMap<String, blake3::Hasher> = BTreeMap::new();
            for (t, _, d) in items {
                tensors
                    .entry(t.to_string())
                    .or_default()
                    .update(d.as_bytes());
            }
            RankDigests {
                rank: rl.rank,
                tensors: tensors
                    .into_iter()
                    .map(|(k, h)| (k, h.finalize().into()))
                    .collect(),
            }
        })
        .collect()
}

/// Measures the cost model against the first source's largest shard; falls back to the
/// reference numbers when the probe cannot run (tiny models).
fn measure_costs(
    c: &mut Core,
    manifests: &[mx_layout::SourceManifest],
    remotes: &[String],
) -> CostModel {
    let Some((si, shard)) = manifests
        .iter()
        .enumerate()
        .flat_map(|(i, m)| m.shards.iter().map(move |s| (i, s)))
        .max_by_key(|(_, s)| s.len)
    else {
        return CostModel::default();
    };
    let scratch_len = shard.len.min(64 << 20);
    let Ok(mut scratch) = Arena::new(&c.agent, scratch_len.max(1)) else {
        return CostModel::default();
    };
    match mx_nixl::probe_costs(&c.agent, &remotes[si], shard.addr, shard.len, &mut scratch) {
        Ok(m) => {
            tracing::info!(
                per_descriptor_us = m.per_descriptor_s * 1e6,
                wire_gbps = m.wire_gbps,
                "measured data-plane costs"
            );
            CostModel {
                per_descriptor_s: m.per_descriptor_s,
                wire_gbps: m.wire_gbps,
                per_segment_s: measure_segment_cost(),
            }
        }
        Err(e) => {
            tracing::warn!("cost probe failed ({e}); using reference costs");
            CostModel::default()
        }
    }
}

/// Local cost of one staged segment (seconds): verifying and applying 4096 segments of 384 bytes
/// against one contiguous 1.5 MiB piece, the difference per segment (median of 5, >= 0).
fn measure_segment_cost() -> f64 {
    const N: usize = 4096;
    const SEG: usize = 384;
    let src: Vec<u8> = (0..N * SEG).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; N * SEG];
    let mut diffs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let d1 = mx_layout::digest_segments(src.chunks(SEG));
        for (o, i) in dst.chunks_mut(SEG).zip(src.chunks(SEG)) {
            o.copy_from_slice(i);
        }
        let strided = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let d2 = Digest::of(&src);
        dst.copy_from_slice(&src);
        let whole = t.elapsed().as_secs_f64();
        if d1 == d2 {
            diffs.push(((strided - whole) / N as f64).max(0.0));
        }
    }
    diffs.sort_by(f64::total_cmp);
    let per = diffs.get(diffs.len() / 2).copied().unwrap_or(5e-8);
    tracing::info!(
        per_segment_ns = per * 1e9,
        "measured local per-segment cost"
    );
    per
}

fn apply_blocking(c: &mut Core, label: &str, digest: Digest) -> Result<Vec<RankDigests>, Error> {
    let ok = c
        .staged
        .as_ref()
        .is_some_and(|s| s.label == label && s.digest == digest);
    if !ok {
        return Err(Error::NotStaged {
            label: label.to_string(),
            digest,
            staged: c
                .staged
                .as_ref()
                .map(|s| format!("{} ({})", s.label, s.digest))
                .unwrap_or_else(|| "nothing".into()),
        });
    }
    let Some(staged) = c.staged.as_ref() else {
        return Err(Error::Task("staging lost".into()));
    };
    let staging = &c.staging;
    // Staged bytes at `off..off + len`, possibly across two sources' arenas.
    let copy_out = |mut off: u64, out: &mut [u8]| {
        let mut done = 0usize;
        while done < out.len() {
            let k = staging
                .partition_point(|(_, lo, _)| *lo <= off)
                .saturating_sub(1);
            let (_, lo, arena) = &staging[k];
            let buf = arena.as_slice();
            let from = (off - lo) as usize;
            // A reused arena may be longer than its source's range: stop at the next range.
            let range_end = staging.get(k + 1).map_or(u64::MAX, |next| next.1);
            let n = (out.len() - done)
                .min(buf.len() - from)
                .min(usize::try_from(range_end - off).unwrap_or(usize::MAX));
            out[done..done + n].copy_from_slice(&buf[from..from + n]);
            done += n;
            off += n as u64;
        }
    };
    // Copies per rank in parallel; each rank's live buffer is written in place.
    let p = &staged.plan;
    c.live.par_iter_mut().enumerate().for_each(|(ri, live)| {
        for cp in p.copies.iter().filter(|cp| cp.rank_index == ri) {
            copy_out(
                cp.staging_offset,
                &mut live[cp.live_offset as usize..(cp.live_offset + cp.len) as usize],
            );
        }
        for z in p.zero_fills.iter().filter(|z| z.rank_index == ri) {
            live[z.live_offset as usize..(z.live_offset + z.len) as usize].fill(0);
        }
    });
    c.resident = Some(digest);
    Ok(live_digests(&c.dest, &c.live))
}

/// blake3 of every parameter's live bytes, per rank.
pub fn live_digests(dest: &[RankLayout], live: &[Vec<u8>]) -> Vec<RankDigests> {
    dest.iter()
        .zip(live)
        .map(|(rl, buf)| RankDigests {
            rank: rl.rank,
            tensors: rl
                .params
                .par_iter()
                .map(|p| {
                    (
                        p.name.clone(),
                        Digest::of(&buf[p.offset as usize..(p.offset + p.len) as usize]),
                    )
                })
                .collect(),
        })
        .collect()
}

/// Waits a little between control-plane polls.
pub const POLL: Duration = Duration::from_millis(2);
