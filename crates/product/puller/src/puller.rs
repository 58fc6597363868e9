//! [`Puller`]: one inference process's ranks, their registered destination memory, staging and
//! the retained copy.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use mx_layout::merkle::VersionProof;
use mx_layout::plan::{plan_within, CostModel, Plan};
use mx_layout::{
    rank_layout, DType, Digest, LayoutSpec, ModelInfo, RankDigests, RankLayout, ResidentVersion,
    SourceManifest, TensorBox, VersionId, Want,
};
use mx_nixl::{Agent, ReadOptions};
use rayon::prelude::*;

use crate::dest::{DestMemory, DestTensor, HostSpans, RankMemory, Window};
use crate::exec::{ExecOptions, Executor, NixlLanes, ObjectLane};
use crate::{costs, Error};

/// What a [`Puller`] serves.
#[derive(Debug, Clone)]
pub struct PullerConfig {
    /// The model (its tensors, dtypes and shapes; the family's fused packings).
    pub model: ModelInfo,
    /// The inference layout, e.g. `tp:3` (vLLM-style fused qkv / gate_up).
    pub layout: LayoutSpec,
    /// The ranks of `layout` this process holds (one for a vLLM worker process).
    pub ranks: Vec<u32>,
    /// Keep a host copy of the version applied before the current one (1x the ranks' bytes),
    /// so [`Puller::rollback`] needs no source. Without it a rollback must stage the previous
    /// version again.
    pub retain: bool,
}

/// Timings, counts and digests of one [`Puller::stage`].
#[derive(Debug, Clone, Default)]
pub struct StageReport {
    /// Seconds until the plan was at hand (metadata, the first stage's cost probe, planning).
    pub plan_s: f64,
    /// The previous plan was reused (same ranks, manifests of the same geometry).
    pub plan_reused: bool,
    /// Seconds in READs.
    pub pull_s: f64,
    /// Seconds of verification after the last READ.
    pub verify_s: f64,
    /// READ descriptors.
    pub descriptors: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// Destination bytes among them.
    pub useful_bytes: u64,
    /// Staging bytes the plan uses (<= the ranks' bytes unless no plan fits; see
    /// [`mx_layout::plan::plan_within`]).
    pub staging_bytes: u64,
    /// Lanes pulled on.
    pub lanes: usize,
    /// Pieces per strategy (`exact`, `packed`, `superset`).
    pub strategies: BTreeMap<String, u64>,
    /// Per rank, per checkpoint tensor: blake3 over the digests of the regions verified for it,
    /// in (tensor, region) order.
    pub digests: Vec<RankDigests>,
    /// No pull: the version is resident or retained already (digests are of those bytes).
    pub resident: bool,
    /// What served the bytes: `trainer` (the publishers' NIXL agents), `artifact_canonical`,
    /// `artifact_delta`; empty when nothing was pulled.
    pub source: String,
}

/// How an apply installed its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyKind {
    /// Copied from staging into the destination memory.
    Staged,
    /// Copied from the retained host copy (a rollback).
    Restored,
    /// Already resident: nothing copied.
    AlreadyResident,
    /// Host copies given by the caller written in (e.g. a checkpoint read from disk).
    Installed,
}

/// What an apply did.
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyReport {
    /// The version resident now.
    pub version: ResidentVersion,
    /// How.
    pub kind: ApplyKind,
    /// The version retained now, if any.
    pub retained: Option<ResidentVersion>,
    /// Seconds copying the resident version into the retained copy first (the first apply
    /// after start or a disk load; later applies retain from staging, off the safe point).
    pub retain_s: f64,
    /// Seconds writing the destination memory.
    pub copy_s: f64,
}

/// The versions a puller holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Versions {
    /// In the destination memory.
    pub resident: Option<ResidentVersion>,
    /// In the retained host copy.
    pub retained: Option<ResidentVersion>,
    /// Pulled and verified in staging (always an mx version).
    pub staged: Option<VersionId>,
}

impl Versions {
    /// [`Error::UnknownVersion`] for `version`, naming what is held.
    pub(crate) fn unknown(&self, version: impl std::fmt::Display) -> Error {
        fn show(x: Option<&impl ToString>) -> String {
            x.map_or_else(|| "nothing".into(), ToString::to_string)
        }
        Error::UnknownVersion {
            version: version.to_string(),
            staged: show(self.staged.as_ref()),
            retained: show(self.retained.as_ref()),
            resident: show(self.resident.as_ref()),
        }
    }
}

/// Memory a puller holds beside the engine's own, by what each buffer serves, in bytes; and the
/// process's resident set, now and at its peak.
///
/// The roles: the registered memory (`rank_bytes`) holds the resident version, what peers pull
/// from, live digests read and a rollback restores into (the engine's own parameters where it
/// registered them, or a host copy of them an engine keeps for mx where it repacks its own);
/// staging holds the version being pulled and verified until it is applied (allocated at the
/// first stage and kept for the next); the retained copy holds the previous version, the source
/// of a rollback with nothing pulled (allocated when the puller is created with retention).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Per held rank: (rank, bytes of its layout): the registered memory.
    pub rank_bytes: Vec<(u32, u64)>,
    /// Staging buffers held now.
    pub staging_bytes: u64,
    /// The most staging held at once.
    pub staging_bytes_peak: u64,
    /// The retained host copy (0 without retention).
    pub retained_bytes: u64,
    /// The process's resident set size now (`VmRSS` of `/proc/self/status`; 0 where the
    /// platform has no such file).
    pub process_rss_bytes: u64,
    /// The process's peak resident set size so far (`VmHWM`; 0 likewise).
    pub process_rss_bytes_peak: u64,
}

/// `(VmRSS, VmHWM)` of this process in bytes, from `/proc/self/status` (Linux; `(0, 0)` where
/// that file or its fields are missing).
pub(crate) fn process_rss() -> (u64, u64) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map_or(0, |kb| kb.saturating_mul(1024))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// One staged piece handed to an engine that installs weights through its own loader:
/// the box `region` of checkpoint tensor `tensor` (row-major bytes of that box) for parameter
/// `param` of `rank`.
#[derive(Debug)]
pub struct StagedPiece<'a> {
    /// The rank.
    pub rank: u32,
    /// The engine parameter it lands in (e.g. `...qkv_proj.weight`).
    pub param: &'a str,
    /// The checkpoint tensor (HF name, e.g. `...k_proj.weight`).
    pub tensor: &'a str,
    /// Element type.
    pub dtype: DType,
    /// The checkpoint tensor's shape.
    pub global_shape: &'a [u64],
    /// The box of it these bytes are.
    pub region: &'a TensorBox,
    /// Row-major bytes of `region`.
    pub bytes: &'a [u8],
}

/// How a stage checks that its manifests are the version's.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Check<'a> {
    /// The Merkle root of every shard is the version id (the whole record).
    Root,
    /// The proof shows the shards are the version's (a control plane's fanned-out answer).
    Proof(&'a VersionProof),
    /// Not checked here: the control plane vouched for them (peers).
    Vouched,
}

/// A planning error of a proven stage: a coverage gap or a missing tensor means the control
/// plane left out a shard the ranks need.
fn incomplete(proven: bool, version: VersionId, e: mx_layout::Error) -> Error {
    match e {
        mx_layout::Error::CoverageGap { .. } | mx_layout::Error::MissingTensor { .. } if proven => {
            Error::Incomplete {
                version: version.to_string(),
                source: Box::new(e),
            }
        }
        e => Error::Layout(e),
    }
}

/// The version in staging and the plan that pulled it.
#[derive(Debug)]
struct Staged {
    version: VersionId,
    plan: Arc<Plan>,
}

/// The last plan, reused while the ranks and the manifests' geometry hold.
#[derive(Debug)]
struct PlanCache {
    geometry: Digest,
    plan: Arc<Plan>,
}

/// The retained host copy: one buffer per held rank, laid out as its layout.
#[derive(Debug)]
struct Retained {
    id: Option<ResidentVersion>,
    ranks: Vec<Vec<u8>>,
}

impl Retained {
    /// True when the copy holds mx version `v`.
    fn holds(&self, v: VersionId) -> bool {
        self.id.as_ref().is_some_and(|r| r.is(v))
    }
}

/// The planner's costs for an object store: a request is cheap next to its bytes here, since
/// the reader merges nearby ranges into one GET; ~1 GB/s per stream.
const OBJECT_STORE_COST: CostModel = CostModel {
    per_descriptor_s: 1e-6,
    wire_gbps: 1.0,
    per_segment_s: 2e-7,
};

/// An inference process's side of mx: stages versions into staging, verifies them, and applies
/// them in place into memory the engine registered. See the crate docs.
#[derive(Debug)]
pub struct Puller {
    pub(crate) dest: Vec<RankLayout>,
    /// NIXL registrations of the live memory, made once it is served to peers
    /// ([`Puller::peer_manifest`]). Declared before `memory` so they are dropped first.
    pub(crate) peer_regs: Vec<mx_nixl::ForeignMemory>,
    /// Progresses the agent while it serves peers (an agent that only serves READs must
    /// progress, or peers cannot connect; the puller itself polls only while it pulls).
    pub(crate) peer_progress: Option<mx_nixl::ProgressThread>,
    pub(crate) memory: Vec<RankMemory>,
    pub(crate) exec: Option<Executor<NixlLanes>>,
    cost: Option<CostModel>,
    plan_cache: Option<PlanCache>,
    staged: Option<Staged>,
    pub(crate) resident: Option<ResidentVersion>,
    retained: Option<Retained>,
    /// The retained version lives in staging ([`Puller::retain_in_staging`]): applies exchange
    /// staging and the registered memory instead of copying.
    in_staging: bool,
    /// After such an apply: what staging holds now.
    swapped: Option<Swapped>,
}

/// Staging after an exchanging apply: it holds `held` (the version resident before, laid out
/// by `plan`'s copies), the registered memory holds `applied`; the same exchange undoes it.
#[derive(Debug)]
struct Swapped {
    held: Option<ResidentVersion>,
    applied: VersionId,
    plan: Arc<Plan>,
}

impl Puller {
    /// A puller for `cfg.ranks` of `cfg.layout`, pulling through `agent` (without one, staging
    /// fails with [`Error::NoDataPlane`]; installs and rollbacks still work). No destination
    /// memory is registered yet.
    ///
    /// # Errors
    /// [`Error::Layout`] when the layout cannot place the model or a rank is outside it
    /// ([`mx_layout::Error::RankOutsideLayout`]); [`Error::BadRanks`] for a repeated rank or none.
    pub fn new(cfg: PullerConfig, agent: Option<Agent>) -> Result<Puller, Error> {
        let mut seen = cfg.ranks.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.is_empty() {
            return Err(Error::BadRanks {
                ranks: cfg.ranks,
                reason: "no rank given (a puller holds at least one)".into(),
            });
        }
        if seen.len() != cfg.ranks.len() {
            return Err(Error::BadRanks {
                ranks: cfg.ranks,
                reason: "a rank is given twice".into(),
            });
        }
        let dest = cfg
            .ranks
            .iter()
            .map(|&r| rank_layout(&cfg.model, cfg.layout, r))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Puller {
            peer_regs: Vec::new(),
            peer_progress: None,
            memory: dest.iter().map(RankMemory::new).collect(),
            retained: cfg.retain.then(|| Retained {
                id: None,
                ranks: Vec::new(),
            }),
            dest,
            exec: agent.map(|a| Executor::new(NixlLanes::new(a, ReadOptions::default(), true))),
            cost: None,
            plan_cache: None,
            staged: None,
            resident: None,
            in_staging: false,
            swapped: None,
        })
    }

    /// Keeps the retained version in staging instead of a copy of its own (one buffer of the
    /// ranks' bytes less): an apply from staging *exchanges* the staged bytes with the
    /// registered ones along the plan's copies, so staging then holds the version resident
    /// before, and a rollback to it is the same exchange back (after which staging holds the
    /// version rolled back from, staged again). The version staged next overwrites it, as the
    /// copy is brought up to the resident version before a stage today. Applies fall back to
    /// copying (with nothing retained) where a plan reads a staging byte twice or writes a byte
    /// twice, or where memory is on a device. An apply takes about one copy more in the pause.
    ///
    /// # Errors
    /// [`Error::NoRollback`] when the puller was made without retention.
    pub fn retain_in_staging(&mut self) -> Result<(), Error> {
        if self.retained.is_none() {
            return Err(Error::NoRollback {
                reason: "retention is off (PullerConfig::retain): nothing to keep in staging"
                    .into(),
            });
        }
        self.retained = Some(Retained {
            id: None,
            ranks: Vec::new(),
        });
        self.in_staging = true;
        Ok(())
    }

    /// The held ranks' layouts (parameter names, dtypes, shapes and offsets), in the order of
    /// [`PullerConfig::ranks`].
    pub fn rank_layouts(&self) -> &[RankLayout] {
        &self.dest
    }

    fn rank_index(&self, rank: u32) -> Result<usize, Error> {
        self.dest
            .iter()
            .position(|d| d.rank == rank)
            .ok_or_else(|| Error::UnknownRank {
                rank,
                held: self.dest.iter().map(|d| d.rank).collect(),
            })
    }

    /// Registers the engine's memory for parameter `name` of `rank`. The memory must stay at its
    /// address while the puller lives; applies write into it in place.
    ///
    /// # Errors
    /// [`Error::UnknownRank`]; [`Error::BadDestination`] naming the parameter when the rank has
    /// no such parameter, its dtype, shape or length differ from the layout's, or it is
    /// registered twice.
    pub fn register_param(&mut self, rank: u32, name: &str, t: DestTensor) -> Result<(), Error> {
        let i = self.rank_index(rank)?;
        self.check_disjoint(rank, name, t.memory.as_ref())?;
        self.memory[i].set_param(&self.dest[i], name, t)
    }

    /// Refuses memory that overlaps memory registered already (two parameters in one tensor
    /// would receive each other's bytes).
    fn check_disjoint(&self, rank: u32, name: &str, m: &dyn DestMemory) -> Result<(), Error> {
        let (lo, len) = (m.data_ptr(), m.len());
        if len == 0 {
            return Ok(());
        }
        let hi = lo.saturating_add(len);
        for (mem, rl) in self.memory.iter().zip(&self.dest) {
            if let Some((other, ..)) = mem.ranges().find(|&(_, a, b)| a < hi && lo < b) {
                return Err(Error::BadDestination {
                    rank,
                    param: name.to_string(),
                    reason: format!(
                        "its memory {lo:#x}+{len} overlaps rank {} parameter {other}'s, \
                         registered already (each parameter needs memory of its own)",
                        rl.rank
                    ),
                });
            }
        }
        Ok(())
    }

    /// Registers one buffer laid out as the whole [`RankLayout`] of `rank`.
    ///
    /// # Errors
    /// [`Error::UnknownRank`]; [`Error::BadDestination`] when its length is not the layout's or
    /// parameters of the rank are registered already.
    pub fn register_rank(&mut self, rank: u32, memory: Box<dyn DestMemory>) -> Result<(), Error> {
        let i = self.rank_index(rank)?;
        self.check_disjoint(rank, "(whole rank)", memory.as_ref())?;
        self.memory[i].set_whole(memory)
    }

    /// Checks that every parameter of every held rank has memory, and that it is still where it
    /// was registered ([`DestMemory::check`]).
    ///
    /// # Errors
    /// [`Error::Unregistered`] naming the first parameter without;
    /// [`Error::DestinationChanged`] naming one whose memory moved.
    pub fn check_registered(&self) -> Result<(), Error> {
        for (m, rl) in self.memory.iter().zip(&self.dest) {
            m.check_complete(rl)?;
        }
        Ok(())
    }

    /// Declares what the destination memory holds now (e.g. the weights the engine loaded at
    /// start): `id` is resident. Nothing is copied.
    pub fn set_resident(&mut self, id: Option<ResidentVersion>) {
        self.resident = id;
    }

    /// True when mx version `v` is in the destination memory.
    pub(crate) fn is_resident(&self, v: VersionId) -> bool {
        self.resident.as_ref().is_some_and(|r| r.is(v))
    }

    /// The versions held.
    pub fn versions(&self) -> Versions {
        Versions {
            resident: self.resident.clone(),
            retained: if self.in_staging {
                self.swapped.as_ref().and_then(|s| s.held.clone())
            } else {
                self.retained.as_ref().and_then(|r| r.id.clone())
            },
            staged: self.staged.as_ref().map(|s| s.version),
        }
    }

    /// The memory held beside the engine's own, by role, and the process's resident set.
    pub fn memory_report(&self) -> MemoryReport {
        let (rss, rss_peak) = process_rss();
        MemoryReport {
            rank_bytes: self.dest.iter().map(|d| (d.rank, d.total_bytes)).collect(),
            staging_bytes: self.exec.as_ref().map_or(0, Executor::staging_bytes),
            staging_bytes_peak: self.exec.as_ref().map_or(0, Executor::staging_bytes_peak),
            retained_bytes: self
                .retained
                .as_ref()
                .map_or(0, |r| r.ranks.iter().map(|b| b.len() as u64).sum()),
            process_rss_bytes: rss,
            process_rss_bytes_peak: rss_peak,
        }
    }

    /// (parameter, data pointer) of every registered memory of `rank`, in layout order.
    ///
    /// # Errors
    /// [`Error::UnknownRank`].
    pub fn addresses(&self, rank: u32) -> Result<Vec<(String, u64)>, Error> {
        Ok(self.memory[self.rank_index(rank)?].addresses())
    }

    /// The bytes of the held rank at `rank_index` when it was registered as one host buffer
    /// ([`Puller::register_rank`]).
    pub fn host_rank(&self, rank_index: usize) -> Option<&[u8]> {
        self.memory.get(rank_index)?.whole_host()
    }

    /// Releases the staged version (its buffers stay allocated for the next stage).
    pub fn release_staged(&mut self) {
        self.staged = None;
    }

    /// Frees the staging buffers (and deregisters them); the next stage allocates again.
    pub fn free_staging(&mut self) {
        self.staged = None;
        if let Some(e) = self.exec.as_mut() {
            e.free();
        }
    }

    /// When `version` is resident or retained: digests of those bytes (per rank, per
    /// parameter), and no pull is needed to apply it. `None` otherwise.
    ///
    /// # Errors
    /// [`Error::Memory`] reading device memory.
    pub fn resident_digests(&self, version: VersionId) -> Result<Option<Vec<RankDigests>>, Error> {
        if self.is_resident(version) {
            return self.live_digests().map(Some);
        }
        if let (Some(sw), Some(exec)) = (&self.swapped, &self.exec) {
            if sw.held.as_ref().is_some_and(|h| h.is(version)) {
                return param_digests(&self.dest, |i| {
                    let mut buf = vec![0u8; self.dest[i].total_bytes as usize];
                    exec.apply_rank(&sw.plan, i, buf.as_mut_slice())?;
                    Ok(buf)
                })
                .map(Some);
            }
        }
        match &self.retained {
            Some(r) if r.holds(version) => {
                Ok(Some(param_digests(&self.dest, |i| Ok(r.ranks[i].clone()))?))
            }
            _ => Ok(None),
        }
    }

    /// blake3 of every parameter's bytes in the destination memory, per rank.
    ///
    /// # Errors
    /// [`Error::Unregistered`], [`Error::Memory`].
    pub fn live_digests(&self) -> Result<Vec<RankDigests>, Error> {
        self.check_registered()?;
        param_digests(&self.dest, |i| {
            let rl = &self.dest[i];
            let mut buf = vec![0u8; rl.total_bytes as usize];
            self.memory[i].read(0, &mut buf)?;
            Ok(buf)
        })
    }

    /// Plans, pulls and verifies `version` from `manifests` into staging. The destination
    /// memory is not touched. The manifests must be `version`'s: the Merkle root of their shards
    /// is the version id. The plan keeps staging within the held ranks' bytes where any plan
    /// can. Before staging overwrites the previous version, a retained copy is brought up to the
    /// resident version when that version came from staging (off the safe point).
    ///
    /// # Errors
    /// [`Error::WrongManifests`], [`Error::NoDataPlane`], planning ([`Error::Layout`]), transport
    /// ([`Error::SourceUnreachable`], [`Error::Pull`]) and [`Error::Verify`] errors. A failed
    /// stage leaves nothing staged.
    pub fn stage(
        &mut self,
        version: VersionId,
        manifests: &[SourceManifest],
        opts: &ExecOptions,
    ) -> Result<StageReport, Error> {
        self.stage_checked(version, manifests, opts, Check::Root)
    }

    /// What this puller's plan reads of a version (the boxes of every tensor its ranks hold,
    /// and the pieces cut for them), to ask a control plane for only that
    /// (`mx_control`'s `get_version_for`).
    pub fn want(&self) -> Want {
        Want::for_ranks(&self.dest)
    }

    /// [`Puller::stage`] from only the manifests this puller's plan reads ([`Puller::want`]),
    /// as a control plane answers a worker: `proof` must show that their shards are
    /// `version`'s ([`VersionProof::verify`]), and they must cover every byte of the held
    /// ranks.
    ///
    /// # Errors
    /// [`Error::Unproven`] naming the shard whose tensor, box or digest is not the version's,
    /// or a proof that does not reach the version id; [`Error::Incomplete`] naming the
    /// parameter and bytes no shard sent covers (a shard left out); otherwise as
    /// [`Puller::stage`].
    pub fn stage_proven(
        &mut self,
        version: VersionId,
        manifests: &[SourceManifest],
        proof: &VersionProof,
        opts: &ExecOptions,
    ) -> Result<StageReport, Error> {
        self.stage_checked(version, manifests, opts, Check::Proof(proof))
    }

    /// [`Puller::stage`], checking the manifests as `check` says (peer sources are vouched
    /// for by the control plane instead).
    pub(crate) fn stage_checked(
        &mut self,
        version: VersionId,
        manifests: &[SourceManifest],
        opts: &ExecOptions,
        check: Check<'_>,
    ) -> Result<StageReport, Error> {
        match check {
            Check::Root => {
                let found = VersionId(mx_layout::version_digest(
                    manifests.iter().flat_map(|m| m.shards.iter()),
                ));
                if found != version {
                    return Err(Error::WrongManifests {
                        wanted: version.to_string(),
                        found: found.to_string(),
                    });
                }
            }
            Check::Proof(proof) => {
                let shards = manifests
                    .iter()
                    .flat_map(|m| m.shards.iter().map(move |s| (m.slot, s)));
                proof.verify(version, shards).map_err(|e| Error::Unproven {
                    version: version.to_string(),
                    source: Box::new(e),
                })?;
            }
            Check::Vouched => {}
        }
        let proven = matches!(check, Check::Proof(_));
        self.retain_from_staging()?;
        self.staged = None;
        let Some(exec) = self.exec.as_mut() else {
            return Err(Error::NoDataPlane);
        };
        let t = Instant::now();
        if self.cost.is_none() {
            // Loads the sources' metadata into the first lane for the probe.
            let lanes = exec.transport();
            self.cost = Some(costs::measure(lanes.agent(), manifests));
        }
        let cost = self.cost.unwrap_or_default();
        let geometry = mx_layout::geometry_digest(manifests);
        let cached = self
            .plan_cache
            .as_ref()
            .filter(|c| c.geometry == geometry)
            .map(|c| Arc::clone(&c.plan));
        let plan_reused = cached.is_some();
        let plan = match cached {
            Some(p) => p,
            None => {
                self.plan_cache = None;
                let bound = self.dest.iter().map(|d| d.total_bytes).sum();
                let p = plan_within(&self.dest, manifests, &cost, bound)
                    .map_err(|e| incomplete(proven, version, e))?;
                let p = Arc::new(p);
                if p.staging_bytes > bound {
                    tracing::warn!(
                        staging = p.staging_bytes,
                        ranks_bytes = bound,
                        "no plan stages within the ranks' bytes"
                    );
                }
                self.plan_cache = Some(PlanCache {
                    geometry,
                    plan: Arc::clone(&p),
                });
                p
            }
        };
        let plan_s = t.elapsed().as_secs_f64();
        let opts = ExecOptions {
            verify: true,
            ..opts.clone()
        };
        let st = exec.stage(&plan, manifests, &opts)?;
        let report = StageReport {
            plan_s,
            plan_reused,
            pull_s: st.pull_s,
            verify_s: st.verify_tail_s,
            descriptors: st.descriptors,
            wire_bytes: plan.wire_bytes,
            useful_bytes: plan.useful_bytes,
            staging_bytes: plan.staging_bytes,
            lanes: st.lanes,
            strategies: plan.strategy_counts(),
            digests: pulled_digests(&self.dest, &plan, manifests),
            resident: false,
            source: "trainer".into(),
        };
        self.staged = Some(Staged { version, plan });
        Ok(report)
    }

    /// Plans, reads and verifies `version` from an artifact chain in object storage into staging
    /// ([`mx_artifact::ArtifactSource`]): ranged reads of exactly the bytes the held ranks need
    /// (canonical) or of the delta ranges covering them, XORed onto the resident bytes (a chain
    /// that starts from the version held: that version must be resident, exactly). Every region
    /// is verified against the artifact's digests, as for any source. The destination memory is
    /// not touched.
    ///
    /// # Errors
    /// [`Error::WrongManifests`] when the artifact holds another version; [`Error::WrongBase`]
    /// when its deltas start from a version that is not resident; [`Error::NoDataPlane`];
    /// planning errors; [`Error::ObjectRead`] (a missing or corrupt object, a store that times
    /// out); [`Error::Verify`]. A failed stage leaves nothing staged.
    pub fn stage_artifact(
        &mut self,
        version: VersionId,
        source: Arc<mx_artifact::ArtifactSource>,
        opts: &ExecOptions,
    ) -> Result<StageReport, Error> {
        if source.version() != version {
            return Err(Error::WrongManifests {
                wanted: version.to_string(),
                found: source.version().to_string(),
            });
        }
        let url = source.manifest().agent_name.clone();
        if let Some(base) = source.base() {
            if !self.is_resident(base) {
                return Err(Error::WrongBase {
                    url,
                    version: version.to_string(),
                    base: base.to_string(),
                    held: self
                        .resident
                        .as_ref()
                        .map_or_else(|| "nothing".into(), ToString::to_string),
                });
            }
        }
        self.retain_from_staging()?;
        self.staged = None;
        if self.exec.is_none() {
            return Err(Error::NoDataPlane);
        }
        let t = Instant::now();
        let manifests = std::slice::from_ref(source.manifest());
        let bound = self.dest.iter().map(|d| d.total_bytes).sum();
        let plan = Arc::new(plan_within(
            &self.dest,
            manifests,
            &OBJECT_STORE_COST,
            bound,
        )?);
        let base = match source.base() {
            Some(_) => Some(Arc::new(self.base_bytes(&plan)?)),
            None => None,
        };
        let plan_s = t.elapsed().as_secs_f64();
        let (fetched, requests) = (source.fetched_bytes(), source.requests());
        let kind = source.kind();
        let Some(exec) = self.exec.as_mut() else {
            return Err(Error::NoDataPlane);
        };
        exec.transport_mut().set_objects(vec![Some(ObjectLane {
            source: Arc::clone(&source),
            base,
        })]);
        let opts = ExecOptions {
            verify: true,
            ..opts.clone()
        };
        let staged = exec.stage(&plan, manifests, &opts);
        exec.transport_mut().set_objects(Vec::new());
        let st = staged?;
        self.plan_cache = None;
        let report = StageReport {
            plan_s,
            plan_reused: false,
            pull_s: st.pull_s,
            verify_s: st.verify_tail_s,
            descriptors: source.requests() - requests,
            wire_bytes: source.fetched_bytes() - fetched,
            useful_bytes: plan.useful_bytes,
            staging_bytes: plan.staging_bytes,
            lanes: st.lanes,
            strategies: plan.strategy_counts(),
            digests: pulled_digests(&self.dest, &plan, manifests),
            resident: false,
            source: kind.into(),
        };
        tracing::info!(%version, url, kind, wire_bytes = report.wire_bytes, "staged from an artifact");
        self.staged = Some(Staged { version, plan });
        Ok(report)
    }

    /// The resident bytes under every staged byte `plan` copies to a rank, laid out as the
    /// plan's staging (bytes no copy reads stay zero: they are never verified or applied).
    fn base_bytes(&self, plan: &Plan) -> Result<Vec<u8>, Error> {
        let n =
            usize::try_from(plan.staging_bytes).map_err(|_| Error::Task("staging size".into()))?;
        let mut base = vec![0u8; n];
        for cp in &plan.copies {
            let mem = self
                .memory
                .get(cp.rank_index)
                .ok_or_else(|| Error::Task(format!("copy to rank index {}", cp.rank_index)))?;
            for (s, l) in cp.rows() {
                let dst = usize::try_from(s)
                    .ok()
                    .zip(usize::try_from(cp.len).ok())
                    .and_then(|(lo, len)| base.get_mut(lo..lo.checked_add(len)?))
                    .ok_or_else(|| {
                        Error::Task(format!("copy from staging {s}+{} outside the plan", cp.len))
                    })?;
                mem.read(l, dst)?;
            }
        }
        Ok(base)
    }

    /// When the resident version is the staged one (it was applied from staging) and the
    /// retained copy holds something else, copies staging into the retained copy: after this
    /// the retained copy is the resident version, ready to restore if the next apply fails.
    fn retain_from_staging(&mut self) -> Result<(), Error> {
        // Staging is about to be overwritten: a version retained in it goes (the resident one
        // is in the registered memory, and an exchanging apply retains it again).
        self.swapped = None;
        if self.in_staging {
            return Ok(());
        }
        let (Some(r), Some(s), Some(exec)) = (self.retained.as_mut(), &self.staged, &self.exec)
        else {
            return Ok(());
        };
        let id = s.version;
        if !self.resident.as_ref().is_some_and(|x| x.is(id)) || r.holds(id) {
            return Ok(());
        }
        let t = Instant::now();
        ensure_buffers(&mut r.ranks, &self.dest);
        r.id = None;
        for (i, buf) in r.ranks.iter_mut().enumerate() {
            exec.apply_rank(&s.plan, i, buf.as_mut_slice())?;
        }
        r.id = Some(id.into());
        tracing::info!(
            retain_s = t.elapsed().as_secs_f64(),
            version = %id,
            "retained the resident version from staging"
        );
        Ok(())
    }

    /// Copies the resident version into the retained copy unless it holds it already.
    fn retain_resident(&mut self) -> Result<f64, Error> {
        let Some(r) = self.retained.as_mut().filter(|_| !self.in_staging) else {
            return Ok(0.0);
        };
        if self.resident.is_none() || r.id == self.resident {
            return Ok(0.0);
        }
        let t = Instant::now();
        ensure_buffers(&mut r.ranks, &self.dest);
        r.id = None;
        for (m, buf) in self.memory.iter().zip(r.ranks.iter_mut()) {
            m.read(0, buf)?;
        }
        r.id.clone_from(&self.resident);
        Ok(t.elapsed().as_secs_f64())
    }

    /// `Ok` when [`Puller::apply`] of `version` would find it: resident, retained or staged.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] naming what is staged, retained and resident.
    pub fn can_apply(&self, version: VersionId) -> Result<(), Error> {
        let v = self.versions();
        if v.staged == Some(version)
            || [&v.resident, &v.retained]
                .iter()
                .any(|x| x.as_ref().is_some_and(|x| x.is(version)))
        {
            return Ok(());
        }
        Err(v.unknown(version))
    }

    /// Installs `version` into the destination memory in place: from staging, from the
    /// retained copy (a rollback), or nothing when it is resident already. Addresses never
    /// change. The version resident before is retained first (when retention is on).
    ///
    /// On [`Error::Memory`] mid-copy the destination holds a mix: restore with
    /// [`Puller::rollback`] (the retained copy is complete) or apply again.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] naming what is staged, retained and resident;
    /// [`Error::Unregistered`]; [`Error::Memory`].
    pub fn apply(&mut self, version: VersionId) -> Result<ApplyReport, Error> {
        if self.is_resident(version) {
            return Ok(self.report(version.into(), ApplyKind::AlreadyResident, 0.0, 0.0));
        }
        self.check_registered()?;
        if self.retained.as_ref().is_some_and(|r| r.holds(version)) {
            return self.restore();
        }
        if self
            .swapped
            .as_ref()
            .is_some_and(|s| s.held.as_ref().is_some_and(|h| h.is(version)))
        {
            return self.swap_back();
        }
        self.can_apply(version)?;
        let Some(s) = self.staged.as_ref().filter(|s| s.version == version) else {
            return Err(Error::Task("the staged version changed".into()));
        };
        let plan = Arc::clone(&s.plan);
        if self.in_staging {
            if let Some(why) = self.cannot_swap(&plan) {
                tracing::warn!(%version, why, "applying by copy: nothing retained");
            } else {
                return self.swap_in(version, plan);
            }
        }
        let retain_s = self.retain_resident()?;
        let t = Instant::now();
        self.resident = None;
        self.copy_staged(&plan)?;
        self.resident = Some(version.into());
        Ok(self.report(
            version.into(),
            ApplyKind::Staged,
            retain_s,
            t.elapsed().as_secs_f64(),
        ))
    }

    /// Writes the staged `plan` into every rank's destination memory: host memory directly,
    /// device memory one parameter at a time through a host window of that parameter's size.
    fn copy_staged(&mut self, plan: &Plan) -> Result<(), Error> {
        let Some(exec) = self.exec.as_ref() else {
            return Err(Error::NoDataPlane);
        };
        for (i, m) in self.memory.iter_mut().enumerate() {
            exec.apply_rank(plan, i, &mut HostSpans(m))?;
            for (lo, len) in m.device_spans() {
                let mut buf = vec![0u8; len as usize];
                exec.apply_rank(plan, i, &mut Window { lo, buf: &mut buf })?;
                m.write_span(lo, &buf)?;
            }
        }
        Ok(())
    }

    /// Restores the retained copy into the destination memory (a rollback to the version
    /// applied before the current one).
    ///
    /// # Errors
    /// [`Error::NoRollback`] when retention is off or nothing is retained; [`Error::Memory`].
    pub fn rollback(&mut self) -> Result<ApplyReport, Error> {
        self.check_registered()?;
        if self.swapped.as_ref().is_some_and(|s| s.held.is_some()) {
            return self.swap_back();
        }
        self.restore()
    }

    /// Why `plan` cannot be applied by exchange, if it cannot.
    fn cannot_swap(&self, plan: &Plan) -> Option<String> {
        if self.memory.iter().any(|m| !m.device_spans().is_empty()) {
            return Some("registered memory on a device".into());
        }
        crate::exec::swappable(plan).err()
    }

    /// Applies staged `version` by exchanging staging and the registered memory along `plan`:
    /// the version resident before is then retained in staging.
    fn swap_in(&mut self, version: VersionId, plan: Arc<Plan>) -> Result<ApplyReport, Error> {
        let t = Instant::now();
        let held = self.resident.take();
        self.staged = None;
        self.exchange(&plan)?;
        self.resident = Some(version.into());
        self.swapped = Some(Swapped {
            held,
            applied: version,
            plan,
        });
        Ok(self.report(
            version.into(),
            ApplyKind::Staged,
            0.0,
            t.elapsed().as_secs_f64(),
        ))
    }

    /// Undoes the exchanging apply: the retained version back in the registered memory, the
    /// version applied back in staging (staged again).
    fn swap_back(&mut self) -> Result<ApplyReport, Error> {
        let Some(sw) = self.swapped.take() else {
            return Err(Error::NoRollback {
                reason: "no version is retained yet".into(),
            });
        };
        let Some(held) = sw.held else {
            return Err(Error::NoRollback {
                reason: "nothing was resident before the version applied".into(),
            });
        };
        let t = Instant::now();
        self.resident = None;
        self.exchange(&sw.plan)?;
        self.resident = Some(held.clone());
        self.staged = Some(Staged {
            version: sw.applied,
            plan: sw.plan,
        });
        Ok(self.report(held, ApplyKind::Restored, 0.0, t.elapsed().as_secs_f64()))
    }

    /// Exchanges staging and every held rank's registered memory along `plan`.
    fn exchange(&mut self, plan: &Plan) -> Result<(), Error> {
        let Some(exec) = self.exec.as_mut() else {
            return Err(Error::NoDataPlane);
        };
        for (i, m) in self.memory.iter_mut().enumerate() {
            exec.swap_rank(plan, i, &mut HostSpans(m))?;
        }
        Ok(())
    }

    fn restore(&mut self) -> Result<ApplyReport, Error> {
        let Some(r) = self.retained.as_ref() else {
            return Err(Error::NoRollback {
                reason: "retention is off (PullerConfig::retain)".into(),
            });
        };
        let Some(id) = r.id.clone() else {
            return Err(Error::NoRollback {
                reason: "no version is retained yet".into(),
            });
        };
        let t = Instant::now();
        self.resident = None;
        for (m, buf) in self.memory.iter_mut().zip(&r.ranks) {
            m.write_all(buf)?;
        }
        self.resident = Some(id.clone());
        Ok(self.report(id, ApplyKind::Restored, 0.0, t.elapsed().as_secs_f64()))
    }

    /// Writes host copies of every held rank (laid out as their layouts, in rank order) into
    /// the destination memory as version `id` (e.g. a checkpoint read from disk). The resident
    /// version is retained first.
    ///
    /// # Errors
    /// [`Error::BadDestination`] when the copies do not match the ranks' sizes;
    /// [`Error::Unregistered`]; [`Error::Memory`].
    pub fn install(
        &mut self,
        id: ResidentVersion,
        ranks: &[Vec<u8>],
    ) -> Result<ApplyReport, Error> {
        self.check_registered()?;
        if ranks.len() != self.dest.len() {
            return Err(Error::BadDestination {
                rank: self.dest.first().map_or(0, |d| d.rank),
                param: "(whole rank)".into(),
                reason: format!(
                    "{} rank copies given for {} ranks",
                    ranks.len(),
                    self.dest.len()
                ),
            });
        }
        for (b, d) in ranks.iter().zip(&self.dest) {
            if b.len() as u64 != d.total_bytes {
                return Err(Error::BadDestination {
                    rank: d.rank,
                    param: "(whole rank)".into(),
                    reason: format!(
                        "copy of {} bytes; the layout has {}",
                        b.len(),
                        d.total_bytes
                    ),
                });
            }
        }
        // An exchanged-out version in staging would come back under the wrong name.
        self.swapped = None;
        let retain_s = self.retain_resident()?;
        let t = Instant::now();
        self.resident = None;
        for (m, buf) in self.memory.iter_mut().zip(ranks) {
            m.write_all(buf)?;
        }
        self.resident = Some(id.clone());
        Ok(self.report(
            id,
            ApplyKind::Installed,
            retain_s,
            t.elapsed().as_secs_f64(),
        ))
    }

    /// What an apply that left `version` resident did.
    fn report(
        &self,
        version: ResidentVersion,
        kind: ApplyKind,
        retain_s: f64,
        copy_s: f64,
    ) -> ApplyReport {
        ApplyReport {
            version,
            kind,
            retained: self.versions().retained,
            retain_s,
            copy_s,
        }
    }

    /// Copies bytes `offset..offset + buf.len()` of rank `rank` of the staged `version` into
    /// `buf`, laid out as that rank's [`RankLayout`] (bytes of no piece, such as vocab padding,
    /// zeroed): what [`Puller::apply`] would write into that window of the registered memory,
    /// written into memory the caller owns instead, so an engine can build its processed form of
    /// a version while it still serves the resident one, one window (e.g. one decoder layer's
    /// parameters) at a time. Registered memory, the resident and retained versions are not
    /// touched. `offset == 0` with `buf` the layout's `total_bytes` copies the whole rank.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] when `version` is not the staged one (naming what is);
    /// [`Error::UnknownRank`]; [`Error::BadDestination`] when the window does not lie inside the
    /// rank's layout.
    pub fn copy_staged_rank(
        &self,
        version: VersionId,
        rank: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Error> {
        let i = self.rank_index(rank)?;
        let (Some(s), Some(exec)) = (
            self.staged.as_ref().filter(|s| s.version == version),
            self.exec.as_ref(),
        ) else {
            return Err(self.versions().unknown(version));
        };
        let total = self.dest[i].total_bytes;
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > total) {
            return Err(Error::BadDestination {
                rank,
                param: "(window of the rank)".into(),
                reason: format!(
                    "bytes {offset}..+{} do not lie inside the layout's {total}",
                    buf.len()
                ),
            });
        }
        buf.fill(0);
        exec.apply_rank(&s.plan, i, &mut Window { lo: offset, buf })
    }

    /// Hands the staged version to `f` piece by piece, for engines that install weights through
    /// their own loaders instead of registering memory: every piece of every parameter of every
    /// held rank, as row-major bytes of its box. Holds one parameter's bytes at a time.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] when nothing is staged; `f`'s errors.
    pub fn staged_tensors(
        &self,
        mut f: impl FnMut(StagedPiece<'_>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let (Some(s), Some(exec)) = (self.staged.as_ref(), self.exec.as_ref()) else {
            return Err(self.versions().unknown("(the staged version)"));
        };
        for (i, rl) in self.dest.iter().enumerate() {
            for p in &rl.params {
                let mut buf = vec![0u8; p.len as usize];
                exec.apply_rank(
                    &s.plan,
                    i,
                    &mut Window {
                        lo: p.offset,
                        buf: &mut buf,
                    },
                )?;
                for piece in &p.pieces {
                    let len = piece.region.numel().unwrap_or(0) * piece.dtype.size_bytes();
                    let at = piece.offset.saturating_sub(p.offset) as usize;
                    let bytes = buf.get(at..at + len as usize).ok_or_else(|| {
                        Error::Task(format!("piece of {} lies outside {}", piece.tensor, p.name))
                    })?;
                    f(StagedPiece {
                        rank: rl.rank,
                        param: &p.name,
                        tensor: &piece.tensor,
                        dtype: piece.dtype,
                        global_shape: &piece.global_shape,
                        region: &piece.region,
                        bytes,
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// Retained buffers sized for `dest` (reused when they fit).
fn ensure_buffers(bufs: &mut Vec<Vec<u8>>, dest: &[RankLayout]) {
    let fits = bufs.len() == dest.len()
        && bufs
            .iter()
            .zip(dest)
            .all(|(b, d)| b.len() as u64 == d.total_bytes);
    if !fits {
        *bufs = dest
            .iter()
            .map(|d| vec![0u8; d.total_bytes as usize])
            .collect();
    }
}

/// Per rank, blake3 of every parameter's bytes; `rank_bytes(i)` gives rank `i`'s bytes.
fn param_digests(
    dest: &[RankLayout],
    rank_bytes: impl Fn(usize) -> Result<Vec<u8>, Error>,
) -> Result<Vec<RankDigests>, Error> {
    dest.iter()
        .enumerate()
        .map(|(i, rl)| {
            let buf = rank_bytes(i)?;
            Ok(digests_of(rl, &buf))
        })
        .collect()
}

/// blake3 of every parameter of `rl` in `buf` (the rank's bytes laid out as `rl`).
pub fn digests_of(rl: &RankLayout, buf: &[u8]) -> RankDigests {
    RankDigests {
        rank: rl.rank,
        tensors: rl
            .params
            .par_iter()
            .map(|p| {
                let bytes = buf
                    .get(p.offset as usize..(p.offset + p.len) as usize)
                    .unwrap_or_default();
                (p.name.clone(), Digest::of(bytes))
            })
            .collect(),
    }
}

/// Per rank, per checkpoint tensor: blake3 over the digests of the regions pulled and verified
/// for it, in (tensor, region) order. `manifests` are those `p` was made from.
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
