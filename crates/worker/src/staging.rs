//! Staging over NIXL: plan, pull into registered arenas (one per source), verify every pulled
//! region against its source's digest, and later copy the staged bytes out into new live
//! buffers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mx_layout::plan::{plan, CostModel, Plan};
use mx_layout::{Digest, RankDigests, RankLayout, SourceManifest, TensorBox};
use mx_nixl::{Agent, Arena, ReadOp, ReadOptions};
use rayon::prelude::*;

use crate::Error;

/// Timings and counts of one stage.
#[derive(Debug, Clone, Default)]
pub struct StageStats {
    /// Seconds from the stage's start until the plan was at hand: loading the sources' NIXL
    /// metadata, the cost probe (first stage only), then planning, or checking that the previous
    /// plan still holds ([`StageStats::plan_reused`]).
    pub plan_s: f64,
    /// Whether the previous stage's plan was reused: same destination ranks and manifests of
    /// the same geometry ([`mx_layout::geometry_digest`]), as when the trainer
    /// publishes a new version from the same arenas.
    pub plan_reused: bool,
    /// Seconds in NIXL reads.
    pub pull_s: f64,
    /// Seconds verifying digests (the tail not overlapped with pulls).
    pub verify_s: f64,
    /// Read descriptors.
    pub descriptors: u64,
    /// Wire bytes.
    pub wire_bytes: u64,
    /// Useful destination bytes.
    pub useful_bytes: u64,
}

/// What a stage returns: timings, strategy counts, and per rank the digest of what was pulled for
/// each checkpoint tensor (blake3 over the verified region digests, in region order).
pub type StageOutcome = (StageStats, BTreeMap<String, u64>, Vec<RankDigests>);

/// A version pulled and verified into the staging arenas.
#[derive(Debug)]
pub(crate) struct Pulled {
    /// Version label.
    pub(crate) label: String,
    /// Version digest.
    pub(crate) digest: Digest,
    /// The plan that pulled it (its copies say where each staged byte goes live).
    pub(crate) plan: Arc<Plan>,
}

/// The last plan made, kept for the next version: it holds while the destination ranks and the
/// manifests' geometry are unchanged (the cost model is measured once per [`Staging`]). Only the
/// digests differ between versions, and a plan's checks look those up in the manifests at hand.
struct PlanCache {
    dest: Vec<RankLayout>,
    geometry: Digest,
    plan: Arc<Plan>,
}

/// One source's staging arena: (source index, first staging offset, arena).
type SourceArena = (usize, u64, Arena);

/// The staging side of a worker: its NIXL agent, the arenas (kept across versions) and what
/// they hold.
pub(crate) struct Staging {
    agent: Option<Agent>,
    /// Pull lanes: the main agent, then one more agent per extra lane (created at the first
    /// stage). Sources are pulled concurrently, one lane per thread: a NIXL agent's transfers
    /// progress on one UCX worker, so one agent pulls on one core (`mx bench pull` measures
    /// ~1.5x with two lanes on two cores), however many threads call it.
    lanes: Vec<Agent>,
    /// One registered arena per source: (source index, first staging offset, arena), so
    /// verification of one source's bytes runs while the next source is pulled.
    arenas: Vec<SourceArena>,
    /// The version the arenas hold, once verified.
    pulled: Option<Pulled>,
    cost: Option<CostModel>,
    /// The last plan, reused while its geometry holds.
    plan_cache: Option<PlanCache>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("has_agent", &self.agent.is_some())
            .field("arenas", &self.arenas.len())
            .field("pulled", &self.pulled.as_ref().map(|p| &p.label))
            .finish_non_exhaustive()
    }
}

impl Staging {
    /// Staging through `agent`; without one every stage fails with [`Error::NoDataPlane`].
    pub(crate) fn new(agent: Option<Agent>) -> Staging {
        Staging {
            agent,
            lanes: Vec::new(),
            arenas: Vec::new(),
            pulled: None,
            cost: None,
            plan_cache: None,
        }
    }

    /// The version held in the arenas, if one was pulled and verified.
    pub(crate) fn pulled(&self) -> Option<&Pulled> {
        self.pulled.as_ref()
    }

    /// Forgets the pulled version (its arenas stay allocated for reuse).
    pub(crate) fn release(&mut self) {
        self.pulled = None;
    }

    /// Plans, pulls and verifies version `label` (`digest`) from `manifests` for the ranks
    /// `dest`. Sleeps `sleep_between_sources` after each source's bytes are in (failpoint).
    ///
    /// # Errors
    /// [`Error::NoDataPlane`], planning ([`Error::Layout`]), NIXL ([`Error::Nixl`],
    /// [`Error::Pull`]) and verification ([`Error::Verify`]) errors. Whatever was pulled before
    /// is released first, so a failed stage leaves nothing staged.
    pub(crate) fn stage(
        &mut self,
        dest: &[RankLayout],
        label: &str,
        digest: Digest,
        manifests: &[SourceManifest],
        sleep_between_sources: Option<Duration>,
    ) -> Result<StageOutcome, Error> {
        // The arenas are about to be overwritten.
        self.pulled = None;
        let Some(agent) = self.agent.as_ref() else {
            return Err(Error::NoDataPlane);
        };
        let mut stats = StageStats::default();
        let t = Instant::now();
        // Load every source's agent metadata (idempotent per agent name).
        let mut remotes = Vec::with_capacity(manifests.len());
        for m in manifests {
            remotes.push(load_source(agent, m)?);
        }
        if self.cost.is_none() {
            self.cost = Some(measure_costs(agent, manifests, &remotes));
        }
        let cost = self.cost.unwrap_or_default();
        let load_s = t.elapsed().as_secs_f64();
        tracing::info!(load_s, "loaded remote metadata");
        let geometry = mx_layout::geometry_digest(manifests);
        let cached = self
            .plan_cache
            .as_ref()
            .filter(|c| c.geometry == geometry && c.dest.as_slice() == dest)
            .map(|c| Arc::clone(&c.plan));
        stats.plan_reused = cached.is_some();
        let p = match cached {
            Some(p) => p,
            None => {
                // A failed plan leaves no stale cache behind.
                self.plan_cache = None;
                let p = Arc::new(plan(dest, manifests, &cost)?);
                self.plan_cache = Some(PlanCache {
                    dest: dest.to_vec(),
                    geometry,
                    plan: Arc::clone(&p),
                });
                p
            }
        };
        stats.plan_s = t.elapsed().as_secs_f64();
        // Each source's reads occupy one contiguous range of staging (reads are ordered by
        // source).
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        for r in &p.reads {
            match ranges.last_mut() {
                Some(last) if last.0 == r.source => last.2 = last.2.max(r.staging_offset + r.len),
                _ => ranges.push((r.source, r.staging_offset, r.staging_offset + r.len)),
            }
        }
        // One lane per core, at most one per source; lane k pulls ranges k, k + L, ... The
        // between-sources failpoint pulls on one lane, so "between sources" is one moment.
        let want = if sleep_between_sources.is_some() {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(ranges.len())
                .max(1)
        };
        if self.lanes.is_empty() {
            self.lanes.push(agent.clone());
        }
        while self.lanes.len() < want {
            let name = format!("{}-lane{}", agent.name(), self.lanes.len());
            self.lanes.push(Agent::new(&name)?);
        }
        let lanes = &self.lanes[..want];
        let lane_of = |k: usize| k % lanes.len();
        let fits =
            self.arenas.len() == ranges.len()
                && self.arenas.iter().zip(&ranges).enumerate().all(
                    |(k, ((_, _, a), (_, lo, hi)))| {
                        a.len() >= hi - lo && a.agent().name() == lanes[lane_of(k)].name()
                    },
                );
        if !fits {
            self.arenas.clear();
            for (k, &(s, lo, hi)) in ranges.iter().enumerate() {
                self.arenas
                    .push((s, lo, Arena::new(&lanes[lane_of(k)], (hi - lo).max(1))?));
            }
        }
        for (slot, &(s, lo, _)) in self.arenas.iter_mut().zip(&ranges) {
            slot.0 = s;
            slot.1 = lo;
        }
        // Every lane loads the metadata of the sources it pulls (idempotent per agent).
        let mut lane_remotes: Vec<Vec<String>> = vec![Vec::new(); lanes.len()];
        for (l, lane) in lanes.iter().enumerate() {
            lane_remotes[l] = if l == 0 {
                remotes.clone()
            } else {
                manifests
                    .iter()
                    .map(|m| load_source(lane, m))
                    .collect::<Result<_, _>>()?
            };
        }
        let mut items: Vec<Vec<&mx_layout::plan::VerifyItem>> = vec![Vec::new(); ranges.len()];
        for v in &p.verify {
            if let Some(k) = ranges.iter().position(|r| r.0 == v.source) {
                items[k].push(v);
            }
        }
        let t = Instant::now();
        let opts = ReadOptions::default();
        let arenas = &mut self.arenas;
        // Pull the sources on the lanes concurrently; a verifier thread checks each source's
        // regions as soon as its bytes are in, while the next sources are pulled.
        let (descriptors, pull_s, verify_tail_s, bad) = std::thread::scope(
            |sc| -> Result<_, Error> {
                let (tx, rx) = std::sync::mpsc::channel::<(usize, &Arena)>();
                let items = &items;
                let ranges_ref = &ranges;
                let verifier = sc.spawn(move || {
                    for (k, arena) in rx {
                        let lo = ranges_ref[k].1;
                        let buf = arena.as_slice();
                        let bad = items[k].par_iter().find_any(|v| {
                            // Every run of every (strided) segment, in order, against the
                            // digest the source published for the piece.
                            let segs = v
                                .byte_ranges()
                                .map(|(o, l)| &buf[(o - lo) as usize..(o - lo + l) as usize]);
                            let expected = v.published(manifests).map(|d| d.digest);
                            Some(mx_layout::digest_segments(segs)) != expected
                        });
                        if let Some(v) = bad {
                            return Some(*v);
                        }
                    }
                    None
                });
                // Lane l pulls arenas l, l + L, ... in order, on its own thread and agent.
                let mut per_lane: Vec<Vec<(usize, &mut SourceArena)>> =
                    (0..lanes.len()).map(|_| Vec::new()).collect();
                for (k, slot) in arenas.iter_mut().enumerate() {
                    per_lane[lane_of(k)].push((k, slot));
                }
                let p = &p;
                let pullers: Vec<_> = per_lane
                    .into_iter()
                    .enumerate()
                    .map(|(l, mine)| {
                        let tx = tx.clone();
                        let lane = &lanes[l];
                        let remotes = &lane_remotes[l];
                        let opts = &opts;
                        sc.spawn(move || -> Result<u64, Error> {
                            let mut descriptors = 0;
                            for (k, (s, lo, arena)) in mine {
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
                                let st = lane.read(&remotes[*s], &ops, arena, opts).map_err(
                                    |source| Error::Pull {
                                        slot: manifests[*s].slot,
                                        agent: remotes[*s].clone(),
                                        source,
                                    },
                                )?;
                                descriptors += st.descriptors;
                                if let Some(d) = sleep_between_sources {
                                    tracing::warn!(
                                        slot = manifests[*s].slot,
                                        ms = d.as_millis(),
                                        "failpoint stage.sleep_between_sources_ms: sleeping after this source's bytes"
                                    );
                                    std::thread::sleep(d);
                                }
                                let shared: &Arena = arena;
                                if tx.send((k, shared)).is_err() {
                                    break; // the verifier already found a bad region
                                }
                            }
                            Ok(descriptors)
                        })
                    })
                    .collect();
                let mut descriptors = 0;
                let mut failed = None;
                for h in pullers {
                    match h.join() {
                        Ok(Ok(d)) => descriptors += d,
                        Ok(Err(e)) => {
                            failed.get_or_insert(e);
                        }
                        Err(_) => {
                            failed.get_or_insert(Error::Task("pull thread panicked".into()));
                        }
                    }
                }
                if let Some(e) = failed {
                    return Err(e);
                }
                let pull_s = t.elapsed().as_secs_f64();
                drop(tx);
                let t_tail = Instant::now();
                let bad = verifier
                    .join()
                    .map_err(|_| Error::Task("verifier thread panicked".into()))?;
                Ok((descriptors, pull_s, t_tail.elapsed().as_secs_f64(), bad))
            },
        )?;
        stats.descriptors = descriptors;
        stats.pull_s = pull_s;
        stats.verify_s = verify_tail_s;
        if let Some(v) = bad {
            return Err(Error::Verify {
                tensor: p.tensor_name(v.tensor).to_string(),
                region: v
                    .published(manifests)
                    .map_or_else(|| format!("piece {}", v.piece), |d| d.region.to_string()),
                rank: v.dest_rank,
                slot: manifests.get(v.source).map(|m| m.slot).unwrap_or(u32::MAX),
            });
        }
        stats.wire_bytes = p.wire_bytes;
        stats.useful_bytes = p.useful_bytes;
        let strategies = p.strategy_counts();
        let pulled = pulled_digests(dest, &p, manifests);
        self.pulled = Some(Pulled {
            label: label.to_string(),
            digest,
            plan: p,
        });
        Ok((stats, strategies, pulled))
    }

    /// New live buffers for `dest` holding the pulled version: every apply copy of its plan
    /// from staging, vocab padding zero-filled. The planner proved every live byte is written
    /// exactly once, so `spare` buffers of the right sizes (a retired version's) are reused as
    /// they are, without clearing; otherwise fresh ones are allocated. `None` when nothing is
    /// pulled.
    pub(crate) fn copy_out(
        &self,
        dest: &[RankLayout],
        spare: Option<Vec<Vec<u8>>>,
    ) -> Option<Vec<Vec<u8>>> {
        let p = &self.pulled.as_ref()?.plan;
        let staging = &self.arenas;
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
        let fits = spare.as_ref().is_some_and(|s| {
            s.len() == dest.len()
                && s.iter()
                    .zip(dest)
                    .all(|(b, d)| b.len() as u64 == d.total_bytes)
        });
        let mut live: Vec<Vec<u8>> = match spare {
            Some(s) if fits => s,
            _ => dest
                .iter()
                .map(|d| vec![0u8; d.total_bytes as usize])
                .collect(),
        };
        // Copies per rank in parallel.
        live.par_iter_mut().enumerate().for_each(|(ri, live)| {
            for cp in p.copies.iter().filter(|cp| cp.rank_index == ri) {
                // `count` rows at their strides (one row for a contiguous copy).
                for (s, l) in cp.rows() {
                    copy_out(s, &mut live[l as usize..(l + cp.len) as usize]);
                }
            }
            for z in p.zero_fills.iter().filter(|z| z.rank_index == ri) {
                live[z.live_offset as usize..(z.live_offset + z.len) as usize].fill(0);
            }
        });
        Some(live)
    }
}

/// Per rank, per checkpoint tensor: blake3 over the digests of the regions pulled and verified for
/// it, in (tensor, region) order. `manifests` are those `p` was made from.
fn pulled_digests(dest: &[RankLayout], p: &Plan, manifests: &[SourceManifest]) -> Vec<RankDigests> {
    dest.iter()
        .map(|rl| {
            let mut items: Vec<(&str, &TensorBox, Digest)> = p
                .verify
                .iter()
                .filter(|v| v.dest_rank == rl.rank || v.shared_with.contains(&rl.rank))
                .filter_map(|v| v.published(manifests))
                .map(|d| (d.tensor.as_str(), &d.region, d.digest))
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
/// Loads source `m`'s NIXL metadata into `agent`; a failure names the slot and agent (the
/// publisher behind them is gone or unreachable) instead of the bare NIXL call.
fn load_source(agent: &Agent, m: &SourceManifest) -> Result<String, Error> {
    agent
        .load_remote(&m.agent_metadata)
        .map_err(|source| Error::SourceUnreachable {
            slot: m.slot,
            agent: m.agent_name.clone(),
            source,
        })
}

fn measure_costs(agent: &Agent, manifests: &[SourceManifest], remotes: &[String]) -> CostModel {
    let Some((si, shard)) = manifests
        .iter()
        .enumerate()
        .flat_map(|(i, m)| m.shards.iter().map(move |s| (i, s)))
        .max_by_key(|(_, s)| s.len)
    else {
        return CostModel::default();
    };
    let scratch_len = shard.len.min(64 << 20);
    let Ok(mut scratch) = Arena::new(agent, scratch_len.max(1)) else {
        return CostModel::default();
    };
    match mx_nixl::probe_costs(agent, &remotes[si], shard.addr, shard.len, &mut scratch) {
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
