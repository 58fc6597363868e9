//! The plan executor: the one place a [`Plan`] is carried out. It pulls a plan's reads into
//! staging (one buffer per source, the sources spread over lanes that pull concurrently),
//! verifies every pulled region against the digest its source published while the next source
//! is pulled, and copies staged bytes out to any [`RankTarget`] (an engine's registered memory,
//! the retained host copy, a scratch buffer).
//!
//! Where bytes come from is a [`Transport`]: [`NixlLanes`] (one-sided NIXL READs, what pullers
//! use) or [`MemorySources`] (memory of this process, for property tests and planner benchmarks
//! that check plans without NIXL). Both go through the same staging, verification and apply code.

use std::time::{Duration, Instant};

use mx_layout::plan::{Plan, VerifyItem};
use mx_layout::SourceManifest;
use mx_nixl::{Agent, Arena, ReadOp, ReadOptions};
use rayon::prelude::*;

use crate::Error;

/// Staged bytes of one source, readable once pulled.
pub trait StagingBuffer: Send + Sync {
    /// The bytes (at least the length asked for when allocated).
    fn bytes(&self) -> &[u8];
    /// The same bytes, writable (no transfer is in flight while the executor is borrowed
    /// mutably).
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl StagingBuffer for Arena {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl StagingBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Where a plan's reads are served from.
pub trait Transport: Sync {
    /// One source's staging buffer.
    type Buffer: StagingBuffer;

    /// Makes ready to pull from `sources` on up to `lanes` lanes (loads their metadata); returns
    /// how many lanes to use (at least 1).
    ///
    /// # Errors
    /// [`Error::SourceUnreachable`] when a source cannot be reached; transport errors.
    fn prepare(&mut self, sources: &[SourceManifest], lanes: usize) -> Result<usize, Error>;

    /// A new staging buffer of `len` bytes (> 0) for `lane`.
    ///
    /// # Errors
    /// Allocation or registration errors.
    fn alloc(&self, lane: usize, len: u64) -> Result<Self::Buffer, Error>;

    /// True when `buf` may receive `lane`'s reads (it was allocated for that lane).
    fn serves(&self, lane: usize, buf: &Self::Buffer) -> bool;

    /// Executes `ops` (offsets relative to `into`) from source `source` (an index into the
    /// sources given to [`Transport::prepare`]) on `lane`; returns the descriptors posted.
    /// Called concurrently for distinct lanes.
    ///
    /// # Errors
    /// [`Error::Pull`] / [`Error::SourceRange`] naming the source.
    fn pull(
        &self,
        lane: usize,
        source: usize,
        ops: &[ReadOp],
        into: &mut Self::Buffer,
    ) -> Result<u64, Error>;
}

/// NIXL READs on one agent per lane: a NIXL agent's transfers progress on one UCX worker, so
/// one agent pulls on one core however many threads call it (`mx-lab bench pull` measured ~1.5x
/// with two lanes on two cores). The first lane is the puller's own agent; more are created
/// on first use and kept, with their staging arenas.
#[derive(Debug)]
pub struct NixlLanes {
    lanes: Vec<Agent>,
    /// Per lane, per source: the remote agent's name as loaded into that lane.
    remotes: Vec<Vec<String>>,
    /// Per source: (slot, agent name) for errors.
    names: Vec<(u32, String)>,
    opts: ReadOptions,
    huge_pages: bool,
    /// Per source of the current stage: an object-storage source read instead of NIXL.
    objects: Vec<Option<ObjectLane>>,
}

/// A source of a stage read from object storage rather than a NIXL agent: an artifact chain,
/// and, for one that XORs deltas onto a base, the base's bytes for the source's staging range
/// (indexed like its staging buffer).
#[derive(Debug, Clone)]
pub struct ObjectLane {
    /// The artifact chain.
    pub source: std::sync::Arc<mx_artifact::ArtifactSource>,
    /// The base bytes under every read (`None`: the reads give whole bytes).
    pub base: Option<std::sync::Arc<Vec<u8>>>,
}

impl NixlLanes {
    /// Lanes whose first agent is `agent`; READs batched as `opts`; staging arenas on huge
    /// pages when `huge_pages`.
    pub fn new(agent: Agent, opts: ReadOptions, huge_pages: bool) -> NixlLanes {
        NixlLanes::with_agents(agent, Vec::new(), opts, huge_pages)
    }

    /// As [`NixlLanes::new`] with the agents of lanes 1.. given (e.g. agents configured for a
    /// benchmark, or the same agent again to share it); more are created as needed.
    pub fn with_agents(
        first: Agent,
        more: Vec<Agent>,
        opts: ReadOptions,
        huge_pages: bool,
    ) -> NixlLanes {
        let mut lanes = vec![first];
        lanes.extend(more);
        NixlLanes {
            lanes,
            remotes: Vec::new(),
            names: Vec::new(),
            opts,
            huge_pages,
            objects: Vec::new(),
        }
    }

    /// Sets which sources of the next stages are read from object storage (by source index;
    /// `None` or past the end: NIXL).
    pub fn set_objects(&mut self, objects: Vec<Option<ObjectLane>>) {
        self.objects = objects;
    }

    fn object(&self, source: usize) -> Option<&ObjectLane> {
        self.objects.get(source).and_then(Option::as_ref)
    }

    /// The first lane's agent (the puller's own).
    pub fn agent(&self) -> &Agent {
        &self.lanes[0]
    }

    /// The remote name of source `source` as loaded into the first lane (after
    /// [`Transport::prepare`]).
    pub fn remote(&self, source: usize) -> Option<&str> {
        self.remotes.first()?.get(source).map(String::as_str)
    }
}

/// Loads source `m`'s NIXL metadata into `agent`; a failure names the slot and agent.
fn load_source(agent: &Agent, m: &SourceManifest) -> Result<String, Error> {
    agent
        .load_remote(&m.agent_metadata)
        .map_err(|source| Error::SourceUnreachable {
            slot: m.slot,
            agent: m.agent_name.clone(),
            source,
        })
}

impl Transport for NixlLanes {
    type Buffer = Arena;

    fn prepare(&mut self, sources: &[SourceManifest], lanes: usize) -> Result<usize, Error> {
        let want = lanes.max(1);
        while self.lanes.len() < want {
            let name = format!("{}-lane{}", self.lanes[0].name(), self.lanes.len());
            self.lanes.push(Agent::new(&name)?);
        }
        let objects = &self.objects;
        self.remotes = self.lanes[..want]
            .iter()
            .map(|lane| {
                sources
                    .iter()
                    .enumerate()
                    .map(|(i, m)| match objects.get(i) {
                        Some(Some(_)) => Ok(String::new()),
                        _ => load_source(lane, m),
                    })
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        self.names = sources
            .iter()
            .map(|m| (m.slot, m.agent_name.clone()))
            .collect();
        Ok(want)
    }

    fn alloc(&self, lane: usize, len: u64) -> Result<Arena, Error> {
        let agent = self.lanes.get(lane).unwrap_or(&self.lanes[0]);
        Ok(Arena::with_pages(agent, len.max(1), self.huge_pages)?)
    }

    fn serves(&self, lane: usize, buf: &Arena) -> bool {
        self.lanes
            .get(lane)
            .is_some_and(|a| a.name() == buf.agent().name())
    }

    fn pull(
        &self,
        lane: usize,
        source: usize,
        ops: &[ReadOp],
        into: &mut Arena,
    ) -> Result<u64, Error> {
        if let Some(o) = self.object(source) {
            return pull_object(o, ops, into.as_mut_slice());
        }
        let (slot, agent) = self.names.get(source).cloned().unwrap_or_default();
        let remote = self
            .remotes
            .get(lane)
            .and_then(|r| r.get(source))
            .ok_or_else(|| Error::Task(format!("lane {lane} has no remote for source {source}")))?;
        let st = self.lanes[lane]
            .read(remote, ops, into, &self.opts)
            .map_err(|e| Error::Pull {
                slot,
                agent,
                source: e,
            })?;
        Ok(st.descriptors)
    }
}

/// Reads `ops` from an object-storage source into `into`: the base bytes first where the source
/// XORs onto them, then the source's bytes.
fn pull_object(o: &ObjectLane, ops: &[ReadOp], into: &mut [u8]) -> Result<u64, Error> {
    let url = || o.source.manifest().agent_name.clone();
    let fail = |e: mx_artifact::Error| Error::ObjectRead {
        url: url(),
        source: Box::new(e),
    };
    let mut reads = Vec::with_capacity(ops.len());
    for op in ops {
        let (tensor, offset) = o.source.locate(op.remote_addr, op.len).map_err(fail)?;
        let range = usize::try_from(op.local_offset)
            .ok()
            .zip(usize::try_from(op.len).ok())
            .and_then(|(lo, n)| Some(lo..lo.checked_add(n)?))
            .filter(|r| r.end <= into.len());
        let Some(range) = range else {
            return Err(Error::ObjectRead {
                url: url(),
                source: format!(
                    "read {}+{} is outside its staging buffer",
                    op.local_offset, op.len
                )
                .into(),
            });
        };
        if let Some(base) = &o.base {
            let src = base.get(range.clone()).ok_or_else(|| Error::ObjectRead {
                url: url(),
                source: "the base bytes do not cover a read".into(),
            })?;
            into[range].copy_from_slice(src);
        }
        reads.push(mx_artifact::ByteRead {
            tensor,
            offset,
            len: op.len,
            local: op.local_offset,
        });
    }
    o.source.read(&reads, into).map_err(fail)?;
    Ok(ops.len() as u64)
}

/// The bytes of source `source` at `addr..addr + len`, for [`MemorySources`].
pub type SourceMemory<'a> = dyn Fn(usize, u64, u64) -> Option<&'a [u8]> + Sync + 'a;

/// Sources in this process's memory: `read(source, addr, len)` returns the bytes a READ would
/// bring. For property tests and planner benchmarks; one lane, buffers are plain vectors.
pub struct MemorySources<'a> {
    read: Box<SourceMemory<'a>>,
    slots: Vec<u32>,
}

impl std::fmt::Debug for MemorySources<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemorySources").finish_non_exhaustive()
    }
}

impl<'a> MemorySources<'a> {
    /// Sources read through `read(source index, address, length)`.
    pub fn new(read: impl Fn(usize, u64, u64) -> Option<&'a [u8]> + Sync + 'a) -> Self {
        MemorySources {
            read: Box::new(read),
            slots: Vec::new(),
        }
    }
}

impl Transport for MemorySources<'_> {
    type Buffer = Vec<u8>;

    fn prepare(&mut self, sources: &[SourceManifest], _lanes: usize) -> Result<usize, Error> {
        self.slots = sources.iter().map(|m| m.slot).collect();
        Ok(1)
    }

    fn alloc(&self, _lane: usize, len: u64) -> Result<Vec<u8>, Error> {
        let n = usize::try_from(len).map_err(|_| Error::Task(format!("{len} bytes")))?;
        Ok(vec![0u8; n])
    }

    fn serves(&self, _lane: usize, _buf: &Vec<u8>) -> bool {
        true
    }

    fn pull(
        &self,
        _lane: usize,
        source: usize,
        ops: &[ReadOp],
        into: &mut Vec<u8>,
    ) -> Result<u64, Error> {
        let slot = self.slots.get(source).copied().unwrap_or(u32::MAX);
        for op in ops {
            let bad = || Error::SourceRange {
                slot,
                addr: op.remote_addr,
                len: op.len,
            };
            let src = (self.read)(source, op.remote_addr, op.len).ok_or_else(bad)?;
            let lo = usize::try_from(op.local_offset).map_err(|_| bad())?;
            let dst = lo
                .checked_add(src.len())
                .and_then(|hi| into.get_mut(lo..hi))
                .ok_or_else(bad)?;
            if src.len() as u64 != op.len {
                return Err(bad());
            }
            dst.copy_from_slice(src);
        }
        Ok(ops.len() as u64)
    }
}

/// Where staged bytes are copied to: a rank's memory laid out as its
/// [`mx_layout::RankLayout`] (offsets are the layout's "live" offsets).
pub trait RankTarget {
    /// Writes `bytes` at `offset`.
    ///
    /// # Errors
    /// [`Error::Memory`] when the memory refuses.
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error>;

    /// Zeroes `len` bytes at `offset` (vocab padding rows).
    ///
    /// # Errors
    /// As [`RankTarget::write`].
    fn zero(&mut self, offset: u64, len: u64) -> Result<(), Error>;
}

/// A host buffer laid out as one rank ([`mx_layout::RankLayout::total_bytes`] long).
impl RankTarget for [u8] {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let dst = usize::try_from(offset)
            .ok()
            .and_then(|lo| Some(lo..lo.checked_add(bytes.len())?))
            .and_then(|r| self.get_mut(r))
            .ok_or_else(|| out_of_range(offset, bytes.len() as u64))?;
        dst.copy_from_slice(bytes);
        Ok(())
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        let dst = usize::try_from(offset)
            .ok()
            .zip(usize::try_from(len).ok())
            .and_then(|(lo, n)| Some(lo..lo.checked_add(n)?))
            .and_then(|r| self.get_mut(r))
            .ok_or_else(|| out_of_range(offset, len))?;
        dst.fill(0);
        Ok(())
    }
}

fn out_of_range(offset: u64, len: u64) -> Error {
    Error::Memory {
        rank: u32::MAX,
        offset,
        len,
        reason: "outside the buffer".into(),
    }
}

/// Knobs of one [`Executor::stage`].
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// Most lanes to pull on (`None`: one per core). At most one per source is used.
    pub max_lanes: Option<usize>,
    /// Failpoint: sleep this long after each source's bytes are in (then one lane pulls, so
    /// "between sources" is one moment).
    pub sleep_between_sources: Option<Duration>,
    /// Split every read into descriptors of at most this many bytes (`None`: as planned). For
    /// benchmarks of the per-descriptor cost.
    pub max_read_bytes: Option<u64>,
    /// Verify every pulled region (default). Only benchmarks that time the data plane alone
    /// turn it off; [`crate::Puller::stage`] always verifies.
    pub verify: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            max_lanes: None,
            sleep_between_sources: None,
            max_read_bytes: None,
            verify: true,
        }
    }
}

/// What one [`Executor::stage`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExecStats {
    /// READ descriptors posted.
    pub descriptors: u64,
    /// Seconds from the first READ until every lane finished.
    pub pull_s: f64,
    /// Seconds of verification after the last READ (the part not overlapped with pulling).
    pub verify_tail_s: f64,
    /// Lanes used.
    pub lanes: usize,
}

/// The buffers one lane pulls, with their indices.
type LaneWork<'s, B> = Vec<(usize, &'s mut SourceBuffer<B>)>;

/// One source's staging range and buffer.
#[derive(Debug)]
struct SourceBuffer<B> {
    source: usize,
    /// First staging offset of the range.
    lo: u64,
    /// One past the last staging offset of the range.
    hi: u64,
    buf: B,
}

/// Carries out plans over a [`Transport`]: stages (pull + verify) into per-source buffers that
/// are kept for the next plan when they fit, and copies staged bytes out.
#[derive(Debug)]
pub struct Executor<T: Transport> {
    transport: T,
    buffers: Vec<SourceBuffer<T::Buffer>>,
    /// Bytes of the buffers held at most, over this executor's life.
    peak_bytes: u64,
}

impl<T: Transport> Executor<T> {
    /// An executor with no staging yet.
    pub fn new(transport: T) -> Executor<T> {
        Executor {
            transport,
            buffers: Vec::new(),
            peak_bytes: 0,
        }
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, to configure it between stages.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Bytes of staging held now (the buffers are kept across stages).
    pub fn staging_bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.hi - b.lo).sum()
    }

    /// The most staging bytes held at once so far.
    pub fn staging_bytes_peak(&self) -> u64 {
        self.peak_bytes
    }

    /// Frees every staging buffer (deregistering NIXL arenas).
    pub fn free(&mut self) {
        self.buffers.clear();
    }

    /// Pulls `plan`'s reads from `sources` (the manifests it was made from) into staging and
    /// verifies every region against its published digest, on a second thread while the next
    /// source is pulled. On any error the staged bytes are unspecified.
    ///
    /// # Errors
    /// Transport errors ([`Error::SourceUnreachable`], [`Error::Pull`], [`Error::SourceRange`]),
    /// [`Error::Verify`] naming the tensor, region, rank and source slot of the first region
    /// whose digest differs.
    pub fn stage(
        &mut self,
        plan: &Plan,
        sources: &[SourceManifest],
        opts: &ExecOptions,
    ) -> Result<ExecStats, Error> {
        let ranges = source_ranges(plan);
        let want = if opts.sleep_between_sources.is_some() {
            1
        } else {
            opts.max_lanes
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
                .min(ranges.len())
                .max(1)
        };
        let lanes = self.transport.prepare(sources, want)?.max(1);
        let lane_of = |k: usize| k % lanes;
        let fits = self.buffers.len() == ranges.len()
            && self
                .buffers
                .iter()
                .zip(&ranges)
                .enumerate()
                .all(|(k, (b, r))| {
                    b.buf.bytes().len() as u64 >= r.2 - r.1
                        && self.transport.serves(lane_of(k), &b.buf)
                });
        if !fits {
            self.buffers.clear();
            for (k, &(s, lo, hi)) in ranges.iter().enumerate() {
                let buf = self.transport.alloc(lane_of(k), (hi - lo).max(1))?;
                self.buffers.push(SourceBuffer {
                    source: s,
                    lo,
                    hi,
                    buf,
                });
            }
        }
        for (b, &(s, lo, hi)) in self.buffers.iter_mut().zip(&ranges) {
            (b.source, b.lo, b.hi) = (s, lo, hi);
        }
        self.peak_bytes = self.peak_bytes.max(self.staging_bytes());
        let mut items: Vec<Vec<&VerifyItem>> = vec![Vec::new(); ranges.len()];
        for v in &plan.verify {
            if let Some(k) = ranges.iter().position(|r| r.0 == v.source) {
                items[k].push(v);
            }
        }
        let t = Instant::now();
        let transport = &self.transport;
        let buffers = &mut self.buffers;
        let sleep = opts.sleep_between_sources;
        let max_read = opts.max_read_bytes;
        let verify = opts.verify;
        let (descriptors, pull_s, verify_tail_s, bad) =
            std::thread::scope(|sc| -> Result<_, Error> {
                let (tx, rx) = std::sync::mpsc::channel::<(usize, &SourceBuffer<T::Buffer>)>();
                let items = &items;
                let verifier = sc.spawn(move || {
                    for (k, b) in rx {
                        if !verify {
                            continue;
                        }
                        if let Some(v) = first_bad(items[k].as_slice(), b, sources) {
                            return Some(v);
                        }
                    }
                    None
                });
                let mut per_lane: Vec<LaneWork<'_, T::Buffer>> =
                    (0..lanes).map(|_| Vec::new()).collect();
                for (k, b) in buffers.iter_mut().enumerate() {
                    per_lane[lane_of(k)].push((k, b));
                }
                let pullers: Vec<_> = per_lane
                    .into_iter()
                    .enumerate()
                    .map(|(lane, mine)| {
                        let tx = tx.clone();
                        let work = LaneJob {
                            lane,
                            sleep,
                            max_read,
                        };
                        sc.spawn(move || pull_lane(transport, plan, sources, work, mine, &tx))
                    })
                    .collect();
                drop(tx);
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
                let pull_s = t.elapsed().as_secs_f64();
                let t_tail = Instant::now();
                let bad = verifier
                    .join()
                    .map_err(|_| Error::Task("verifier thread panicked".into()))?;
                if let Some(e) = failed {
                    return Err(e);
                }
                Ok((descriptors, pull_s, t_tail.elapsed().as_secs_f64(), bad))
            })?;
        if let Some(v) = bad {
            let published = v.published(sources);
            return Err(Error::Verify {
                tensor: plan.tensor_name(v.tensor).to_string(),
                region: published
                    .map_or_else(|| format!("piece {}", v.piece), |d| d.region.to_string()),
                rank: v.dest_rank,
                slot: sources.get(v.source).map_or(u32::MAX, |m| m.slot),
            });
        }
        Ok(ExecStats {
            descriptors,
            pull_s,
            verify_tail_s,
            lanes,
        })
    }

    /// The index of the staging buffer holding staging offset `off`.
    ///
    /// # Errors
    /// [`Error::Task`] when no buffer holds it (a plan not staged by this executor).
    fn buffer_at(&self, off: u64) -> Result<usize, Error> {
        let k = self
            .buffers
            .partition_point(|b| b.lo <= off)
            .saturating_sub(1);
        match self.buffers.get(k) {
            Some(b) if b.lo <= off && off < b.hi => Ok(k),
            _ => Err(Error::Task(format!("staging offset {off} is not staged"))),
        }
    }

    /// Calls `f` with the staged bytes at staging offsets `off..off + len`, in order (one slice,
    /// or two where the range crosses from one source's buffer into the next).
    ///
    /// # Errors
    /// [`Error::Task`] when the range is not staged (a plan not staged by this executor).
    fn staged_slices(
        &self,
        mut off: u64,
        len: u64,
        mut f: impl FnMut(u64, &[u8]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let end = off
            .checked_add(len)
            .ok_or_else(|| Error::Task("staging range overflows".into()))?;
        let mut done = 0u64;
        while off < end {
            let b = &self.buffers[self.buffer_at(off)?];
            let n = (end - off).min(b.hi - off);
            let from = (off - b.lo) as usize;
            let bytes =
                b.buf.bytes().get(from..from + n as usize).ok_or_else(|| {
                    Error::Task(format!("staging offset {off} is past its buffer"))
                })?;
            f(done, bytes)?;
            done += n;
            off += n;
        }
        Ok(())
    }

    /// Copies the staged bytes of `plan` for the rank at `rank_index` (an index into the ranks
    /// the plan was made for) into `target`: every apply copy, then every zero fill. The planner
    /// proved each byte of the rank is written exactly once, so `target` needs no clearing.
    ///
    /// # Errors
    /// [`Error::Memory`] from the target; [`Error::Task`] when `plan` is not the staged plan.
    pub fn apply_rank<R: RankTarget + ?Sized>(
        &self,
        plan: &Plan,
        rank_index: usize,
        target: &mut R,
    ) -> Result<(), Error> {
        for cp in plan.copies.iter().filter(|c| c.rank_index == rank_index) {
            for (s, l) in cp.rows() {
                self.staged_slices(s, cp.len, |done, bytes| target.write(l + done, bytes))?;
            }
        }
        zero_padding(plan, rank_index, target)
    }
}

impl<T: Transport> Executor<T> {
    /// Exchanges the bytes of `plan`'s copies for held rank `rank_index` between staging and
    /// `target` (the rank's memory): afterwards the target holds what [`Executor::apply_rank`]
    /// writes (padding zeroed), and staging, where the copies read, holds what the target held
    /// there. The same call again exchanges them back. Only for a plan whose copies read and
    /// write disjoint bytes ([`swappable`]); every staging range is checked before a byte moves.
    ///
    /// # Errors
    /// [`Error::Task`] when a range is not staged; the target's errors (a span not registered:
    /// bytes exchanged before it stay exchanged; the caller checks registration first).
    pub fn swap_rank<R: RankSwap + ?Sized>(
        &mut self,
        plan: &Plan,
        rank_index: usize,
        target: &mut R,
    ) -> Result<(), Error> {
        let copies = || plan.copies.iter().filter(|c| c.rank_index == rank_index);
        for cp in copies() {
            for (s, _) in cp.rows() {
                self.staged_slices(s, cp.len, |_, _| Ok(()))?;
            }
        }
        for cp in copies() {
            for (s, l) in cp.rows() {
                let (mut off, end) = (s, s + cp.len);
                while off < end {
                    let k = self.buffer_at(off)?;
                    let b = &mut self.buffers[k];
                    let n = (end - off).min(b.hi - off);
                    let from = (off - b.lo) as usize;
                    let bytes = &mut b.buf.bytes_mut()[from..from + n as usize];
                    target.swap(l + (off - s), bytes)?;
                    off += n;
                }
            }
        }
        zero_padding(plan, rank_index, target)
    }
}

/// Zeroes `plan`'s zero-filled ranges (vocab padding rows) of held rank `rank_index` in `target`.
fn zero_padding<R: RankTarget + ?Sized>(
    plan: &Plan,
    rank_index: usize,
    target: &mut R,
) -> Result<(), Error> {
    for z in plan
        .zero_fills
        .iter()
        .filter(|z| z.rank_index == rank_index)
    {
        target.zero(z.live_offset, z.len)?;
    }
    Ok(())
}

/// Where staged bytes are exchanged with: a rank's memory on the host.
pub trait RankSwap: RankTarget {
    /// Exchanges `bytes` with the target's bytes at `offset`.
    ///
    /// # Errors
    /// [`Error::Memory`] / [`Error::Unregistered`] when the range is not host memory of the
    /// rank's.
    fn swap(&mut self, offset: u64, bytes: &mut [u8]) -> Result<(), Error>;
}

impl RankSwap for [u8] {
    fn swap(&mut self, offset: u64, bytes: &mut [u8]) -> Result<(), Error> {
        let at = usize::try_from(offset).map_err(|_| Error::Task("offset overflows".into()))?;
        let dst = self
            .get_mut(at..at + bytes.len())
            .ok_or_else(|| Error::Task(format!("swap of {} bytes at {at}", bytes.len())))?;
        dst.swap_with_slice(bytes);
        Ok(())
    }
}

/// `Ok` when `plan`'s copies can be exchanged instead of copied ([`Executor::swap_rank`]): no
/// staging byte is read by two copies, and no byte of a rank is written by two. Otherwise the
/// first overlap found.
///
/// # Errors
/// A message naming the overlapping ranges.
pub fn swappable(plan: &Plan) -> Result<(), String> {
    let mut staging: Vec<(u64, u64)> = Vec::new();
    let mut live: Vec<(usize, u64, u64)> = Vec::new();
    for cp in &plan.copies {
        for (s, l) in cp.rows() {
            staging.push((s, s.saturating_add(cp.len)));
            live.push((cp.rank_index, l, l.saturating_add(cp.len)));
        }
    }
    staging.sort_unstable();
    live.sort_unstable();
    if let Some(w) = staging.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(format!(
            "staging bytes {}..{} are read by two copies",
            w[1].0,
            w[0].1.min(w[1].1)
        ));
    }
    if let Some(w) = live
        .windows(2)
        .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
    {
        return Err(format!(
            "bytes {}..{} of held rank {} are written by two copies",
            w[1].1,
            w[0].2.min(w[1].2),
            w[0].0
        ));
    }
    Ok(())
}

/// Each source's reads occupy one contiguous staging range (the planner orders reads by
/// source): (source, lo, hi).
fn source_ranges(plan: &Plan) -> Vec<(usize, u64, u64)> {
    let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
    for r in &plan.reads {
        match ranges.last_mut() {
            Some(last) if last.0 == r.source => last.2 = last.2.max(r.staging_offset + r.len),
            _ => ranges.push((r.source, r.staging_offset, r.staging_offset + r.len)),
        }
    }
    ranges
}

/// The first region of `items` whose bytes in `b` do not digest to what its source published.
fn first_bad<'p, B: StagingBuffer>(
    items: &[&'p VerifyItem],
    b: &SourceBuffer<B>,
    sources: &[SourceManifest],
) -> Option<&'p VerifyItem> {
    let buf = b.buf.bytes();
    let lo = b.lo;
    items
        .par_iter()
        .find_any(|v| {
            let mut segs = Vec::new();
            for (o, l) in v.byte_ranges() {
                let Some(seg) = o
                    .checked_sub(lo)
                    .and_then(|from| buf.get(from as usize..(from + l) as usize))
                else {
                    return true;
                };
                segs.push(seg);
            }
            let expected = v.published(sources).map(|d| d.digest);
            Some(mx_layout::digest_segments(segs)) != expected
        })
        .copied()
}

/// How one lane pulls.
#[derive(Debug, Clone, Copy)]
struct LaneJob {
    lane: usize,
    sleep: Option<Duration>,
    max_read: Option<u64>,
}

/// Pulls the buffers of one lane in order, handing each to the verifier once its bytes are in.
fn pull_lane<'s, T: Transport>(
    transport: &T,
    plan: &Plan,
    sources: &[SourceManifest],
    job: LaneJob,
    mine: LaneWork<'s, T::Buffer>,
    tx: &std::sync::mpsc::Sender<(usize, &'s SourceBuffer<T::Buffer>)>,
) -> Result<u64, Error> {
    let LaneJob {
        lane,
        sleep,
        max_read,
    } = job;
    let mut descriptors = 0;
    for (k, b) in mine {
        let mut ops: Vec<ReadOp> = Vec::new();
        for r in plan.reads.iter().filter(|r| r.source == b.source) {
            let step = max_read.unwrap_or(r.len).max(1);
            let mut off = 0;
            while off < r.len {
                let len = step.min(r.len - off);
                ops.push(ReadOp {
                    remote_addr: r.src_addr + off,
                    len,
                    local_offset: r.staging_offset - b.lo + off,
                });
                off += len;
            }
        }
        descriptors += transport.pull(lane, b.source, &ops, &mut b.buf)?;
        if let Some(d) = sleep {
            tracing::warn!(
                slot = sources.get(b.source).map_or(u32::MAX, |m| m.slot),
                ms = d.as_millis(),
                "failpoint stage.sleep_between_sources_ms: sleeping after this source's bytes"
            );
            std::thread::sleep(d);
        }
        let shared: &SourceBuffer<T::Buffer> = b;
        if tx.send((k, shared)).is_err() {
            break; // the verifier already found a bad region
        }
    }
    Ok(descriptors)
}
