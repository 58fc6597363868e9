//! Serving the resident version as a peer source: another worker READs it from this process's
//! live memory over NIXL, like a trainer rank.
//!
//! The shards a peer offers are the regions of the version's record it verified when it staged:
//! every piece the trainers cut for this worker's layout and ranks, located in the live memory
//! (where the region is contiguous there, which it is for the row splits of FSDP and vLLM's tp
//! layouts), with the digest the record holds, so the control plane can check every one against
//! the record. For every registered destination layout it cuts pieces from those shards
//! ([`mx_layout::plan::cut_for_layout`]); a piece the record holds already keeps the record's
//! digest, the others are digested from the live bytes.

use std::collections::{HashMap, HashSet};

use mx_layout::plan::{cut_for_layout, decompose};
use mx_layout::{
    digest_segments, DestPiece, Digest, LayoutSpec, MemDevice, RankLayout, ShardEntry,
    SourceManifest, TensorBox, VersionId,
};
use mx_nixl::ForeignMemory;

use crate::{Error, Puller};

/// Where a shard's bytes are: (rank index, layout offset).
type Located = (usize, u64);

impl Puller {
    /// Registers the live memory of every held rank with this puller's NIXL agent (once), so
    /// peers can READ it.
    ///
    /// # Errors
    /// [`Error::NoDataPlane`]; [`Error::Task`] for device memory (not served yet);
    /// [`Error::Nixl`] when NIXL refuses.
    #[allow(unsafe_code)] // one registration call; its contract is argued at the block
    fn register_live(&mut self) -> Result<(), Error> {
        if !self.peer_regs.is_empty() {
            return Ok(());
        }
        let Some(exec) = self.exec.as_ref() else {
            return Err(Error::NoDataPlane);
        };
        let agent = exec.transport().agent().clone();
        let mut regs = Vec::new();
        for (m, rl) in self.memory.iter().zip(&self.dest) {
            let spans = m.host_spans().ok_or_else(|| {
                Error::Task(format!(
                    "rank {}: device memory is not served to peers yet",
                    rl.rank
                ))
            })?;
            for (addr, len) in spans {
                // SAFETY: the span is memory the engine registered with this puller
                // (`register_param` / `register_rank`), which it keeps mapped at that address
                // while the puller lives; the guard is dropped before the puller's memory (the
                // `peer_regs` field is declared before `memory`). NIXL only reads it, on
                // behalf of peers; a peer reading while an apply writes gets torn bytes, which
                // its verification refuses (the control plane stops offering the memory before
                // an apply).
                regs.push(unsafe { ForeignMemory::register_host(&agent, addr, len)? });
            }
        }
        self.peer_regs = regs;
        self.peer_progress = Some(agent.spawn_progress(std::time::Duration::from_millis(1)));
        Ok(())
    }

    /// Describes the resident version `version` as a peer source: its shards are the pieces of
    /// `record` (the version's trainer manifests) cut for this puller's layout and ranks, located
    /// in the live memory, with the record's digests; its pieces are cut for every layout of
    /// `layouts` (all ranks of each), the record's digest where it has one, else the live bytes'.
    /// Registers the live memory with NIXL on first use.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] when `version` is not resident; [`Error::Task`] when a region
    /// is not contiguous in the live memory or lies in device memory; [`Error::NoDataPlane`];
    /// NIXL and memory errors.
    pub fn peer_manifest(
        &mut self,
        version: VersionId,
        record: &[SourceManifest],
        layouts: &[Vec<RankLayout>],
    ) -> Result<SourceManifest, Error> {
        if !self.is_resident(version) {
            return Err(self.versions().unknown(version));
        }
        self.check_registered()?;
        self.register_live()?;
        let layout = self
            .dest
            .first()
            .map(|d| d.layout)
            .ok_or(Error::NoDataPlane)?;
        let (shards, located) = self.live_shards(layout, record)?;
        let known: HashMap<(LayoutSpec, u32, &str, &TensorBox), Digest> = record
            .iter()
            .flat_map(|m| m.pieces.iter())
            .map(|p| {
                (
                    (p.layout, p.dest_rank, p.tensor.as_str(), &p.region),
                    p.digest,
                )
            })
            .collect();
        let mut pieces = Vec::new();
        for dest in layouts {
            let Some(l) = dest.first().map(|d| d.layout) else {
                continue;
            };
            for c in cut_for_layout(&shards, dest)? {
                let digest = match known.get(&(l, c.dest_rank, c.tensor.as_str(), &c.region)) {
                    Some(d) => *d,
                    None => {
                        let (ri, at) = located[c.shard];
                        let mut segs = Vec::with_capacity(c.run_offsets.len());
                        for &o in &c.run_offsets {
                            let mut b = vec![0u8; c.run_bytes as usize];
                            self.memory[ri].read(at + o, &mut b)?;
                            segs.push(b);
                        }
                        digest_segments(segs.iter().map(Vec::as_slice))
                    }
                };
                pieces.push(DestPiece {
                    layout: l,
                    dest_rank: c.dest_rank,
                    tensor: c.tensor,
                    region: c.region,
                    digest,
                    packed_addr: None,
                });
            }
        }
        let exec = self.exec.as_ref().ok_or(Error::NoDataPlane)?;
        let agent = exec.transport().agent();
        Ok(SourceManifest {
            slot: 0,
            layout,
            agent_name: agent.name().to_string(),
            agent_metadata: agent.local_metadata()?,
            shards,
            pieces,
            pack_seconds: 0.0,
        })
    }

    /// The record's pieces for `layout` and the held ranks, located in the live memory, once
    /// per (tensor, region).
    fn live_shards(
        &self,
        layout: LayoutSpec,
        record: &[SourceManifest],
    ) -> Result<(Vec<ShardEntry>, Vec<Located>), Error> {
        let mut seen: HashSet<(&str, &TensorBox)> = HashSet::new();
        let mut shards = Vec::new();
        let mut located = Vec::new();
        for p in record.iter().flat_map(|m| m.pieces.iter()) {
            if p.layout != layout || seen.contains(&(p.tensor.as_str(), &p.region)) {
                continue;
            }
            let Some(ri) = self.dest.iter().position(|d| d.rank == p.dest_rank) else {
                continue;
            };
            let rl = &self.dest[ri];
            let live = rl
                .params
                .iter()
                .flat_map(|x| x.pieces.iter())
                .find(|x| x.tensor == p.tensor && x.region.contains(&p.region))
                .ok_or_else(|| {
                    Error::Task(format!(
                        "rank {}: no live piece of {} holds region {}",
                        rl.rank, p.tensor, p.region
                    ))
                })?;
            let elem = live.dtype.size_bytes();
            let (run, starts) = decompose(&p.region, &live.region);
            let contiguous = starts
                .iter()
                .enumerate()
                .all(|(k, &s)| s == starts[0] + k as u64 * run);
            let numel = p.region.numel().unwrap_or(0);
            if !contiguous || starts.is_empty() {
                return Err(Error::Task(format!(
                    "rank {}: region {} of {} is not contiguous in the live memory",
                    rl.rank, p.region, p.tensor
                )));
            }
            let at = live.offset + starts[0] * elem;
            let len = numel * elem;
            let addr = self.memory[ri].host_addr(at, len).ok_or_else(|| {
                Error::Task(format!(
                    "rank {}: region {} of {} is not in one host span",
                    rl.rank, p.region, p.tensor
                ))
            })?;
            seen.insert((p.tensor.as_str(), &p.region));
            shards.push(ShardEntry {
                tensor: p.tensor.clone(),
                dtype: live.dtype,
                global_shape: live.global_shape.clone(),
                shard: p.region.clone(),
                addr,
                len,
                device: MemDevice::Dram,
                digest: p.digest,
            });
            located.push((ri, at));
        }
        Ok((shards, located))
    }

    /// Stages `version` from `manifests` whose digests the control plane checked against the
    /// version's record (peer sources: their shards are not the trainer's, so their Merkle root
    /// is not the version id). Otherwise as [`Puller::stage`].
    ///
    /// # Errors
    /// As [`Puller::stage`], without [`Error::WrongManifests`].
    pub fn stage_vouched(
        &mut self,
        version: VersionId,
        manifests: &[SourceManifest],
        opts: &crate::ExecOptions,
    ) -> Result<crate::StageReport, Error> {
        let mut r = self.stage_checked(version, manifests, opts, crate::puller::Check::Vouched)?;
        r.source = "peer".into();
        Ok(r)
    }
}
