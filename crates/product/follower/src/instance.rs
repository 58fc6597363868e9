//! The inference instance: the live weights (one buffer per rank, registered with an
//! [`mx_puller::Puller`] that stages versions, applies them in place and retains the previous
//! one), the engine built from the live weights, generation behind the pause gate, and the
//! failpoints.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use mx_checkpoint::Checkpoint;
use mx_layout::merkle::VersionProof;
use mx_layout::{
    Digest, LayoutSpec, ModelInfo, RankDigests, RankLayout, ResidentVersion, SourceManifest,
    VersionId, Want,
};
use mx_nixl::Agent;
use mx_puller::{ApplyKind as PullKind, ExecOptions, Puller, PullerConfig, StageReport};

use crate::engine::{Engine, EngineBuilder};
use crate::failpoints::{FailpointValues, Failpoints};
use crate::gate::{Gate, PauseMode, PauseOutcome, Step};
use crate::store::load_disk;
use crate::Error;
use mx_control::observe;

/// The cache tiers an apply clears: the engine's decode KV cache and its prefix cache.
pub const CACHE_TIERS: [&str; 2] = ["kv_cache", "prefix_cache"];

/// What an inference instance serves.
#[derive(Debug, Clone)]
pub struct InstanceConfig {
    /// Model directory: its config.json and safetensors headers give the tensor list and the
    /// engine's architecture (weights are read only by a disk apply).
    pub model_dir: PathBuf,
    /// Inference layout.
    pub layout: LayoutSpec,
    /// Ranks of `layout` this instance holds (generation needs all of them).
    pub ranks: Vec<u32>,
    /// Serve `/mx/failpoints` (fault injection for tests); otherwise that route is 404. Only a
    /// fault-injection harness sets it (`mx-lab worker --failpoints`).
    pub failpoints: bool,
    /// Worker id, for discovery (`instance_id` is derived from it) and logs.
    pub worker_id: String,
}

/// Where an apply takes the new live weights from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApplySource {
    /// A policy version by digest: the staged one (copied out of staging), the pinned one
    /// (rollback: live and pinned swap) or the live one (no-op).
    Version(Digest),
    /// A safetensors checkpoint directory, sliced into this instance's ranks and resident as
    /// `version`.
    Disk {
        /// Checkpoint directory.
        path: PathBuf,
        /// Version id it becomes resident as.
        version: String,
    },
}

impl ApplySource {
    /// From an engine contract's `update_weights_from_disk` fields: `mx://<64 hex>` names a
    /// policy version; anything else is a checkpoint directory, resident as `weight_version`
    /// when non-empty and `disk:<model_path>` otherwise.
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming `model_path` when it is empty or `mx://` is not followed by a
    /// 64-hex digest.
    pub fn from_model_path(model_path: &str, weight_version: &str) -> Result<ApplySource, Error> {
        if model_path.is_empty() {
            return Err(Error::BadRequest {
                field: "model_path".into(),
                reason: "is empty".into(),
            });
        }
        let mx = VersionId::from_model_path(model_path).map_err(|e| Error::BadRequest {
            field: "model_path".into(),
            reason: e.to_string(),
        })?;
        if let Some(v) = mx {
            return Ok(ApplySource::Version(v.digest()));
        }
        let version = if weight_version.is_empty() {
            format!("disk:{model_path}")
        } else {
            weight_version.to_string()
        };
        Ok(ApplySource::Disk {
            path: PathBuf::from(model_path),
            version,
        })
    }
}

impl ApplySource {
    /// From an `mx_install` call's `version_id`: `mx:<64 hex>` names a version mx staged (or
    /// the resident or retained one), `disk:<dir>` a checkpoint directory, resident as
    /// `weight_version` when non-empty and as `version_id` otherwise.
    ///
    /// # Errors
    /// [`Error::BadRequest`] naming `version_id` when it is empty, a malformed mx id, or
    /// neither kind.
    pub fn from_version_id(version_id: &str, weight_version: &str) -> Result<ApplySource, Error> {
        let bad = |reason: String| Error::BadRequest {
            field: "version_id".into(),
            reason,
        };
        if let Some(dir) = version_id.strip_prefix("disk:") {
            if dir.is_empty() {
                return Err(bad("disk: names no directory".into()));
            }
            let version = if weight_version.is_empty() {
                version_id
            } else {
                weight_version
            };
            return Ok(ApplySource::Disk {
                path: PathBuf::from(dir),
                version: version.to_string(),
            });
        }
        match ResidentVersion::parse(version_id).mx() {
            Some(v) => Ok(ApplySource::Version(v.digest())),
            None => Err(bad(format!(
                "{version_id:?} is neither an mx version id (mx:<64 hex>) nor disk:<dir>"
            ))),
        }
    }
}

/// How an apply installed its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyKind {
    /// Copied out of staging into the live weights in place; the old live version is retained.
    Staged,
    /// Copied from the retained host copy of the previous version (a rollback).
    Restored,
    /// The version was live already: nothing installed (caches still cleared).
    AlreadyLive,
    /// Loaded from a checkpoint directory; the old live version is retained.
    Disk,
}

/// What an apply did.
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyOutcome {
    /// The version now resident.
    pub version: ResidentVersion,
    /// How it got there.
    pub kind: ApplyKind,
    /// The pinned (previous) version now, if any.
    pub pinned: Option<ResidentVersion>,
    /// Cache tiers clear after the apply (empty when the caller asked not to clear them). An
    /// instance that runs no engine (see [`Instance::generation_support`]) caches nothing, so
    /// every tier is clear.
    pub cache_tiers_cleared: Vec<String>,
    /// Wall seconds of the apply, engine rebuild included.
    pub seconds: f64,
}

/// The version ids the store holds right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Versions {
    /// Resident version.
    pub live: Option<ResidentVersion>,
    /// Previous live version, retained in a host copy so a rollback needs no source (`None`
    /// when the retained copy is the live version itself, e.g. right after a rollback).
    pub pinned: Option<ResidentVersion>,
    /// Staged version (pulled and verified).
    pub staged: Option<VersionId>,
}

/// One generation request (greedy).
///
/// Unlike SGLang, the model's end-of-sequence token is not a stop by default: the engine decodes
/// exactly `max_new_tokens` tokens unless one of `stop_token_ids` comes first, so a post-update
/// generation compares token for token with golden tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub input_ids: Vec<u32>,
    /// Most new tokens to generate.
    pub max_new_tokens: usize,
    /// Generation stops after the first of these tokens (it is included in the output).
    pub stop_token_ids: Vec<u32>,
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` tokens were generated.
    Length(usize),
    /// One of the request's `stop_token_ids` was generated.
    Stop(u32),
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerateOutput {
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// The version whose weights generated the last token (`None` when no token was
    /// generated).
    pub weight_version: Option<ResidentVersion>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV entries came from the prefix cache.
    pub cached_tokens: usize,
    /// Why it stopped.
    pub finish_reason: FinishReason,
}

/// What the store holds, behind one lock (stage and apply hold it for their whole run): the
/// puller, which owns the live rank buffers (registered as whole-rank destination memory),
/// staging and the retained copy.
#[derive(Debug)]
struct State {
    puller: Puller,
}

impl State {
    fn versions(&self) -> Versions {
        let v = self.puller.versions();
        Versions {
            pinned: v.retained.filter(|r| v.resident.as_ref() != Some(r)),
            live: v.resident,
            staged: v.staged,
        }
    }

    /// The live rank buffers.
    fn live(&self) -> Vec<&[u8]> {
        (0..self.puller.rank_layouts().len())
            .filter_map(|i| self.puller.host_rank(i))
            .collect()
    }
}

/// The engine and what it last did.
#[derive(Default)]
struct EngineSlot {
    engine: Option<Box<dyn Engine>>,
    /// The version whose weights the engine holds.
    version: Option<ResidentVersion>,
    /// The prompt the engine's prefix cache holds (mirrors the engine's one-entry prefix
    /// cache, to report `cached_tokens`); empty when cleared.
    prefix: Vec<u32>,
}

impl std::fmt::Debug for EngineSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSlot")
            .field("built", &self.engine.is_some())
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl EngineSlot {
    fn clear_caches(&mut self) {
        if let Some(e) = self.engine.as_mut() {
            e.clear_cache();
        }
        self.prefix.clear();
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: InstanceConfig,
    /// The highest control-plane leader epoch seen, on an engine call or a command stream
    /// ([`Instance::admit_epoch`]).
    pub(crate) epoch: std::sync::atomic::AtomicU64,
    /// The highest refit id that called this engine ([`mx_adapters::REFIT_HEADER`]): reported
    /// at registration, so the fleet can contradict a damaged journal.
    pub(crate) last_refit: std::sync::atomic::AtomicU64,
    config: serde_json::Value,
    pub(crate) model: ModelInfo,
    pub(crate) dest: Vec<RankLayout>,
    /// Why generation is impossible here, or `Ok` when this instance can run the engine.
    generation: Result<(), String>,
    /// What builds the engine once weights are live (`None`: this instance runs none).
    builder: Option<std::sync::Arc<dyn EngineBuilder>>,
    max_positions: Option<u64>,
    state: Mutex<State>,
    engine: Mutex<EngineSlot>,
    /// Snapshot of the store's version ids, readable while a stage or apply runs.
    versions: Mutex<Versions>,
    pub(crate) gate: Gate,
    pub(crate) failpoints: Failpoints,
    /// Set once when this process lost its worker id to another process (see
    /// [`Instance::retire`]); every engine route refuses from then on.
    retired: std::sync::OnceLock<String>,
    /// Over another engine's memory: no model, no disk loads ([`Instance::over_puller`]).
    no_model: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Task(e.to_string()))?
}

/// An inference instance (cheap to clone; clones share everything).
#[derive(Debug, Clone)]
pub struct Instance {
    pub(crate) shared: Arc<Shared>,
}

/// Raises `highest` to `epoch`; `Err(highest)` when `epoch` is lower (see
/// [`Instance::admit_epoch`]).
pub(crate) fn admit_epoch(highest: &std::sync::atomic::AtomicU64, epoch: u64) -> Result<(), u64> {
    let seen = highest.fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
    if epoch < seen {
        return Err(seen);
    }
    Ok(())
}

impl Instance {
    /// Admits control-plane leader `epoch` ([`mx_adapters::EPOCH_HEADER`]) and raises the
    /// highest seen to it.
    ///
    /// # Errors
    /// The highest epoch seen, when `epoch` is lower: its sender is a deposed leader.
    pub fn admit_epoch(&self, epoch: u64) -> Result<(), u64> {
        admit_epoch(&self.shared.epoch, epoch)
    }

    /// What this engine has seen of the control plane: the highest refit id that called it
    /// and the highest leader epoch (0: none), as a registration reports them.
    pub fn seen(&self) -> mx_control::Seen {
        use std::sync::atomic::Ordering::SeqCst;
        mx_control::Seen {
            refit: self.shared.last_refit.load(SeqCst),
            epoch: self.shared.epoch.load(SeqCst),
        }
    }

    /// Reads the model's config.json and headers and computes the layout of the held ranks.
    /// No weights are resident until an apply (or [`Instance::apply`] of a disk checkpoint).
    /// `agent` is the NIXL agent staging pulls through; without one, staging fails with
    /// [`mx_puller::Error::NoDataPlane`] (disk loads and generation still work). `engine` builds
    /// the generation engine once weights are live; without one (or when it does not support
    /// the model, or this instance lacks a rank) generation is refused, saying why.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] (also for a missing config.json under a tensor-parallel layout),
    /// [`Error::Layout`] when the layout cannot
    /// place the model or a rank is outside it.
    pub fn open(
        cfg: InstanceConfig,
        agent: Option<Agent>,
        engine: Option<Arc<dyn EngineBuilder>>,
    ) -> Result<Instance, Error> {
        let ckpt = Checkpoint::open(&cfg.model_dir)?;
        // Without config.json: replicated and FSDP layouts only, and no generation.
        let model = ckpt.model_info(&[cfg.layout])?;
        let config = ckpt.config().cloned().unwrap_or(serde_json::Value::Null);
        let mut puller = Puller::new(
            PullerConfig {
                model: model.clone(),
                layout: cfg.layout,
                ranks: cfg.ranks.clone(),
                retain: true,
            },
            agent,
        )?;
        let dest = puller.rank_layouts().to_vec();
        for rl in &dest {
            // The live weights: one buffer per rank, at a fixed address for the puller's life.
            puller.register_rank(rl.rank, Box::new(vec![0u8; rl.total_bytes as usize]))?;
        }
        let mut sorted = cfg.ranks.clone();
        sorted.sort_unstable();
        let all: Vec<u32> = (0..cfg.layout.world_size).collect();
        let generation = match &engine {
            None => Err("this worker runs no generation engine".to_string()),
            Some(_) if sorted != all => Err(format!(
                "this worker holds ranks {:?} of layout {}; generation needs every rank 0..{}",
                cfg.ranks, cfg.layout, cfg.layout.world_size
            )),
            Some(b) => b.supports(&model),
        };
        Ok(Instance {
            shared: Arc::new(Shared {
                epoch: std::sync::atomic::AtomicU64::new(0),
                last_refit: std::sync::atomic::AtomicU64::new(0),
                max_positions: config
                    .get("max_position_embeddings")
                    .and_then(serde_json::Value::as_u64),
                config,
                model,
                dest,
                generation,
                builder: engine,
                state: Mutex::new(State { puller }),
                engine: Mutex::new(EngineSlot::default()),
                versions: Mutex::new(Versions::default()),
                gate: Gate::default(),
                failpoints: Failpoints::default(),
                retired: std::sync::OnceLock::new(),
                no_model: false,
                cfg,
            }),
        })
    }

    /// An instance over memory another engine owns: `puller` has that engine's parameter
    /// memory registered (see [`Puller::register_param`]) and declares what it holds
    /// ([`Puller::set_resident`]). There is no reference engine: the instance serves the same
    /// HTTP contracts (pause, resume, apply of staged or retained versions, version read-back)
    /// but no generation, and it declares no model, so refits skip its post-update generation.
    /// Checkpoint loads from disk are refused (the engine loads its own).
    ///
    /// # Errors
    /// [`Error::Puller`] ([`mx_puller::Error::Unregistered`]) when a parameter has no memory.
    pub fn over_puller(
        puller: Puller,
        model: ModelInfo,
        worker_id: String,
        failpoints: bool,
    ) -> Result<Instance, Error> {
        puller.check_registered()?;
        let dest = puller.rank_layouts().to_vec();
        let layout = dest.first().map(|d| d.layout).unwrap_or(LayoutSpec {
            scheme: mx_layout::Scheme::Replicated,
            world_size: 1,
        });
        let versions = State { puller };
        let snapshot = versions.versions();
        Ok(Instance {
            shared: Arc::new(Shared {
                epoch: std::sync::atomic::AtomicU64::new(0),
                last_refit: std::sync::atomic::AtomicU64::new(0),
                max_positions: None,
                config: serde_json::Value::Null,
                model,
                generation: Err(
                    "this engine declared no model: it holds weights only, and mx runs no generation on it"
                        .into(),
                ),
                builder: None,
                cfg: InstanceConfig {
                    model_dir: PathBuf::new(),
                    layout,
                    ranks: dest.iter().map(|d| d.rank).collect(),
                    failpoints,
                    worker_id,
                },
                dest,
                state: Mutex::new(versions),
                engine: Mutex::new(EngineSlot::default()),
                versions: Mutex::new(snapshot),
                gate: Gate::default(),
                failpoints: Failpoints::default(),
                retired: std::sync::OnceLock::new(),
                no_model: true,
            }),
        })
    }

    /// True for an instance over another engine's memory ([`Instance::over_puller`]): no
    /// model, no generation.
    pub fn no_model(&self) -> bool {
        self.shared.no_model
    }

    /// Runs `f` on the puller (behind the store's lock; blocks while a stage or apply runs).
    /// For engines that drive staging and applying themselves (the bindings).
    pub fn with_puller<T>(&self, f: impl FnOnce(&mut Puller) -> T) -> T {
        let mut st = lock(&self.shared.state);
        let out = f(&mut st.puller);
        *lock(&self.shared.versions) = st.versions();
        out
    }

    /// Stops this instance from serving for good: every engine route (generation, pause,
    /// resume, apply, version read-back, live digests) answers 410 Gone with `reason` from now
    /// on. A worker calls it when another process took its worker id over, so that nothing
    /// reaches weights the control plane no longer tracks. The first reason stays.
    pub fn retire(&self, reason: String) {
        if self.shared.retired.set(reason.clone()).is_ok() {
            tracing::error!(
                worker = self.shared.cfg.worker_id,
                "engine retired: {reason}"
            );
        }
    }

    /// Why this instance stopped serving, once [`Instance::retire`]d.
    pub fn retired(&self) -> Option<&str> {
        self.shared.retired.get().map(String::as_str)
    }

    /// The limits of its model on generation requests, sent when it registers: `None` when it
    /// cannot generate or its config.json lacks `vocab_size` or `max_position_embeddings`.
    pub fn model_limits(&self) -> Option<mx_control::ModelLimits> {
        let sh = &self.shared;
        sh.generation.as_ref().ok()?;
        Some(mx_control::ModelLimits {
            vocab_size: sh
                .config
                .get("vocab_size")
                .and_then(serde_json::Value::as_u64)?,
            max_positions: sh.max_positions?,
        })
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &InstanceConfig {
        &self.shared.cfg
    }

    /// The layout of each held rank, in `ranks` order.
    pub fn rank_layouts(&self) -> &[RankLayout] {
        &self.shared.dest
    }

    /// The version ids held now (live, pinned, staged).
    pub fn versions(&self) -> Versions {
        lock(&self.shared.versions).clone()
    }

    /// The resident version, `None` before the first apply.
    pub fn resident_version(&self) -> Option<ResidentVersion> {
        self.versions().live
    }

    /// `Ok` when this instance can generate (it holds every rank of a llama-family model),
    /// else why not.
    pub fn generation_support(&self) -> Result<(), String> {
        self.shared.generation.clone()
    }

    /// Positions the engine's KV cache holds (0 once cleared); `None` without an engine.
    pub fn cached_positions(&self) -> Option<usize> {
        lock(&self.shared.engine)
            .engine
            .as_ref()
            .map(|e| e.cached_positions())
    }

    /// The failpoints set now.
    pub fn failpoints(&self) -> FailpointValues {
        self.shared.failpoints.get()
    }

    /// The resident version id and blake3 of every live parameter per rank (`None` before the
    /// first apply).
    pub async fn live_digests(&self) -> Result<Option<(ResidentVersion, Vec<RankDigests>)>, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || {
            let st = lock(&sh.state);
            let Some(id) = st.puller.versions().resident else {
                return Ok(None);
            };
            Ok(Some((id, st.puller.live_digests()?)))
        })
        .await
    }

    /// The data pointer of every held rank's live buffer, in rank order: applies write in
    /// place, so these never change.
    pub async fn live_addresses(&self) -> Vec<u64> {
        let sh = Arc::clone(&self.shared);
        blocking(move || {
            let st = lock(&sh.state);
            let mut out = Vec::new();
            for rl in st.puller.rank_layouts() {
                out.extend(st.puller.addresses(rl.rank)?.into_iter().map(|(_, p)| p));
            }
            Ok(out)
        })
        .await
        .unwrap_or_default()
    }

    /// The memory the puller holds beside the live weights (staging, retained copy).
    pub async fn memory_report(&self) -> mx_puller::MemoryReport {
        let sh = Arc::clone(&self.shared);
        blocking(move || Ok(lock(&sh.state).puller.memory_report()))
            .await
            .unwrap_or_default()
    }

    /// Installs new live weights from `source` (see [`ApplySource`]), rebuilds the engine from
    /// them and clears every cache tier. All or nothing: on error live, pinned and the engine
    /// stay as they were.
    ///
    /// # Errors
    /// [`Error::UnknownVersion`] naming the version and what is live, pinned and staged;
    /// [`Error::Checkpoint`] / [`Error::DiskMismatch`] for a disk load; [`Error::Engine`] when
    /// the engine refuses the weights.
    pub async fn apply(&self, source: ApplySource) -> Result<ApplyOutcome, Error> {
        self.apply_with(source, true).await
    }

    /// [`Instance::apply`], clearing the caches only when `clear_cache` (SGLang's
    /// `flush_cache`).
    pub(crate) async fn apply_with(
        &self,
        source: ApplySource,
        clear_cache: bool,
    ) -> Result<ApplyOutcome, Error> {
        if self.shared.gate.paused().is_none() {
            tracing::warn!(
                worker = self.shared.cfg.worker_id,
                ?source,
                "apply while generation is not paused (the orchestrator gates generation)"
            );
        }
        let sh = Arc::clone(&self.shared);
        blocking(move || apply_blocking(&sh, source, clear_cache)).await
    }

    /// [`Instance::apply`] before the engine serves anything (`mx worker --load` at start-up):
    /// there is no generation to gate yet, so no warning about it.
    pub(crate) async fn apply_before_serving(
        &self,
        source: ApplySource,
    ) -> Result<ApplyOutcome, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || apply_blocking(&sh, source, true)).await
    }

    /// Clears every cache tier of the engine (no-op without one); returns the tiers cleared.
    pub async fn clear_caches(&self) -> Result<Vec<String>, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || {
            let mut slot = lock(&sh.engine);
            if slot.engine.is_none() {
                return Ok(Vec::new());
            }
            slot.clear_caches();
            Ok(CACHE_TIERS.iter().map(|s| s.to_string()).collect())
        })
        .await
    }

    /// When `digest` is the live or the retained (pinned) version: digests of those bytes, and
    /// applying it needs no pull. `None` otherwise (a pull is needed).
    pub(crate) async fn stage_resident(
        &self,
        digest: Digest,
    ) -> Result<Option<Vec<RankDigests>>, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || {
            let st = lock(&sh.state);
            Ok(st.puller.resident_digests(VersionId(digest))?)
        })
        .await
    }

    /// Plans, pulls and verifies version `digest` from `manifests` (which must be that
    /// version's) into staging. Live weights are not touched.
    ///
    /// # Errors
    /// [`Error::Puller`]: no NIXL agent, manifests of another version, planning, NIXL and
    /// verification errors (a failed stage leaves nothing staged).
    pub async fn stage(
        &self,
        label: &str,
        digest: Digest,
        manifests: Vec<SourceManifest>,
    ) -> Result<StageReport, Error> {
        self.stage_with(label, move |p, opts| {
            p.stage(VersionId(digest), &manifests, opts)
        })
        .await
    }

    /// Like [`Instance::stage`] from only the manifests the plan reads, as the control plane
    /// answers [`Instance::want`], proven to be the version's by `proof`
    /// ([`mx_puller::Puller::stage_proven`]).
    ///
    /// # Errors
    /// As [`Instance::stage`]; [`mx_puller::Error::Unproven`] (a shard or a proof hash that is
    /// not the version's) and [`mx_puller::Error::Incomplete`] (a shard left out).
    pub async fn stage_proven(
        &self,
        label: &str,
        digest: Digest,
        manifests: Vec<SourceManifest>,
        proof: VersionProof,
    ) -> Result<StageReport, Error> {
        self.stage_with(label, move |p, opts| {
            p.stage_proven(VersionId(digest), &manifests, &proof, opts)
        })
        .await
    }

    /// What the puller's plan reads of a version ([`mx_puller::Puller::want`]), to ask the
    /// control plane for only that.
    ///
    /// # Errors
    /// [`Error::Task`] when the blocking task fails.
    pub async fn want(&self) -> Result<Want, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || Ok(lock(&sh.state).puller.want())).await
    }

    /// Runs one stage on the puller (under the state lock, off the async threads) with the
    /// execution options the failpoints set, and publishes the resulting versions.
    async fn stage_with(
        &self,
        label: &str,
        f: impl FnOnce(&mut mx_puller::Puller, &ExecOptions) -> Result<StageReport, mx_puller::Error>
            + Send
            + 'static,
    ) -> Result<StageReport, Error> {
        let sh = Arc::clone(&self.shared);
        let opts = ExecOptions {
            sleep_between_sources: self.shared.failpoints.get().stage_sleep_between_sources,
            ..ExecOptions::default()
        };
        let label = label.to_string();
        blocking(move || {
            let t0 = Instant::now();
            let mut st = lock(&sh.state);
            let res = f(&mut st.puller, &opts);
            *lock(&sh.versions) = st.versions();
            let seconds = t0.elapsed().as_secs_f64();
            let r = match res {
                Ok(r) => r,
                Err(e) => {
                    metrics::histogram!(observe::STAGE_SECONDS, "result" => "failed")
                        .record(seconds);
                    metrics::counter!(observe::STAGE_FAILURES_TOTAL, "kind" => e.kind())
                        .increment(1);
                    if matches!(e, mx_puller::Error::Verify { .. }) {
                        metrics::counter!(observe::VERIFICATION_FAILURES_TOTAL, "check" => "stage")
                            .increment(1);
                    }
                    return Err(e.into());
                }
            };
            metrics::histogram!(observe::STAGE_SECONDS, "result" => "ok").record(seconds);
            if !r.source.is_empty() {
                metrics::counter!(observe::STAGE_BYTES_TOTAL, "source" => source_label(&r.source))
                    .increment(r.wire_bytes);
                if seconds > 0.0 {
                    metrics::gauge!(observe::STAGE_GBPS).set(r.wire_bytes as f64 / seconds / 1e9);
                }
            }
            tracing::info!(
                label,
                source = r.source,
                staging_bytes = r.staging_bytes,
                wire_bytes = r.wire_bytes,
                "staged"
            );
            Ok(r)
        })
        .await
    }

    /// The model this instance serves.
    pub fn model(&self) -> &ModelInfo {
        &self.shared.model
    }

    /// Its inference layout.
    pub fn layout(&self) -> mx_layout::LayoutSpec {
        self.shared.cfg.layout
    }

    /// The resident version `v` as a peer source ([`mx_puller::Puller::peer_manifest`]):
    /// `record` the version's trainer manifests, `layouts` every registered layout's ranks.
    ///
    /// # Errors
    /// [`Error::Puller`]: not resident, a region not contiguous in the live memory, device
    /// memory, NIXL.
    pub async fn peer_manifest(
        &self,
        v: VersionId,
        record: Vec<SourceManifest>,
        layouts: Vec<Vec<mx_layout::RankLayout>>,
    ) -> Result<SourceManifest, Error> {
        let sh = Arc::clone(&self.shared);
        blocking(move || {
            let mut st = lock(&sh.state);
            Ok(st.puller.peer_manifest(v, &record, &layouts)?)
        })
        .await
    }

    /// Stages version `digest` from peer sources (manifests the control plane checked against
    /// the version's record; [`mx_puller::Puller::stage_vouched`]).
    ///
    /// # Errors
    /// As [`Instance::stage`].
    pub async fn stage_peers(
        &self,
        label: &str,
        digest: Digest,
        manifests: Vec<SourceManifest>,
    ) -> Result<StageReport, Error> {
        self.stage_with(label, move |p, opts| {
            p.stage_vouched(VersionId(digest), &manifests, opts)
        })
        .await
    }

    /// Plans, reads and verifies version `digest` from an artifact chain in object storage
    /// into staging ([`mx_puller::Puller::stage_artifact`]). Live weights are not touched.
    ///
    /// # Errors
    /// [`Error::Puller`]: another version, a delta against a base not resident, object-store
    /// and verification errors (a failed stage leaves nothing staged).
    pub async fn stage_artifact(
        &self,
        label: &str,
        digest: Digest,
        source: Arc<mx_artifact::ArtifactSource>,
    ) -> Result<StageReport, Error> {
        self.stage_with(label, move |p, opts| {
            p.stage_artifact(VersionId(digest), source, opts)
        })
        .await
    }

    /// Pauses generation (see [`PauseMode`]) and returns once no request is running; clears
    /// every cache tier when `clear_cache`.
    ///
    /// # Errors
    /// [`Error::Task`] when clearing the caches failed to run.
    pub async fn pause(&self, mode: PauseMode, clear_cache: bool) -> Result<PauseOutcome, Error> {
        let out = self.shared.gate.pause(mode).await;
        if let Some(d) = self.shared.failpoints.take_pause_sleep() {
            tracing::warn!(
                ms = d.as_millis(),
                "failpoint pause.sleep_ms: sleeping before answering the pause (the failpoint is now cleared)"
            );
            tokio::time::sleep(d).await;
        }
        if clear_cache {
            self.clear_caches().await?;
        }
        tracing::info!(
            worker = self.shared.cfg.worker_id,
            mode = mode.as_str(),
            in_flight = out.in_flight,
            held = out.held,
            "generation paused"
        );
        Ok(out)
    }

    /// Resumes generation: waiting and held requests continue.
    pub fn resume(&self) {
        self.shared.gate.resume();
        tracing::info!(worker = self.shared.cfg.worker_id, "generation resumed");
    }

    /// Generation requests admitted and not yet finished (held ones included).
    pub fn requests_in_flight(&self) -> u64 {
        self.shared.gate.in_flight()
    }

    /// The pause mode now, `None` while generating.
    pub fn paused(&self) -> Option<PauseMode> {
        self.shared.gate.paused()
    }

    /// Greedy generation with the live weights, between tokens following the pause gate.
    ///
    /// # Errors
    /// [`Error::FailpointGenerate`]; [`Error::GenerationUnavailable`] when this instance does not
    /// hold every rank (or the model is not llama-family); [`Error::BadRequest`] naming
    /// `input_ids` or `sampling_params.max_new_tokens`; [`Error::NoWeights`] before the first
    /// apply; [`Error::Paused`] / [`Error::Aborted`] under pause mode abort; [`Error::Engine`].
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateOutput, Error> {
        let sh = &self.shared;
        if sh.failpoints.get().generate_fail {
            return Err(Error::FailpointGenerate);
        }
        sh.generation
            .clone()
            .map_err(|reason| Error::GenerationUnavailable { reason })?;
        if req.input_ids.is_empty() {
            return Err(Error::BadRequest {
                field: "input_ids".into(),
                reason: "is empty".into(),
            });
        }
        if let Some(max) = sh.max_positions {
            let need = req.input_ids.len() as u64 + req.max_new_tokens as u64;
            if need > max {
                return Err(Error::BadRequest {
                    field: "sampling_params.max_new_tokens".into(),
                    reason: format!(
                        "{} prompt tokens + {} new exceed max_position_embeddings {max}",
                        req.input_ids.len(),
                        req.max_new_tokens
                    ),
                });
            }
        }
        if lock(&sh.versions).live.is_none() {
            return Err(Error::NoWeights);
        }
        let admission = sh.gate.admit().await?;
        let prompt = Arc::new(req.input_ids);
        let stop = Arc::new(req.stop_token_ids);
        let mut progress = Progress::default();
        loop {
            let (sh2, p, st, cancel) = (
                Arc::clone(sh),
                Arc::clone(&prompt),
                Arc::clone(&stop),
                Arc::clone(&admission.cancelled),
            );
            let max = req.max_new_tokens;
            let (done, end) = blocking(move || {
                let mut progress = progress;
                let end = decode(&sh2, &p, max, &st, &cancel, &mut progress)?;
                Ok((progress, end))
            })
            .await?;
            progress = done;
            match end {
                ChunkEnd::Done(finish_reason) => {
                    return Ok(GenerateOutput {
                        prompt_tokens: prompt.len(),
                        completion_tokens: progress.out.len(),
                        output_ids: progress.out,
                        weight_version: progress.version,
                        cached_tokens: progress.cached.unwrap_or(0),
                        finish_reason,
                    })
                }
                ChunkEnd::Abort => return Err(Error::Aborted),
                ChunkEnd::Hold => sh.gate.hold(&admission).await?,
            }
        }
    }
}

/// A request's progress across decode calls (a held request resumes from here).
#[derive(Debug, Default)]
struct Progress {
    /// Tokens generated so far.
    out: Vec<u32>,
    /// Prompt tokens the first decode call found in the prefix cache.
    cached: Option<usize>,
    /// The version whose weights generated the last token.
    version: Option<ResidentVersion>,
}

/// How a decode call ended.
enum ChunkEnd {
    Done(FinishReason),
    Hold,
    Abort,
}

/// Decodes until done or the gate says stop. The engine lock is held for one decode call, which
/// asks the gate before every token (pause abort/keep stop it there). The engine decodes to the
/// end of a call; tokens after a stop token are dropped.
fn decode(
    sh: &Shared,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    cancelled: &AtomicBool,
    c: &mut Progress,
) -> Result<ChunkEnd, Error> {
    loop {
        if c.out.len() >= max_new {
            return Ok(ChunkEnd::Done(FinishReason::Length(c.out.len())));
        }
        if cancelled.load(Ordering::SeqCst) {
            // The client went away; nobody reads the result.
            return Ok(ChunkEnd::Abort);
        }
        match sh.gate.step() {
            Step::Go => {}
            Step::Hold => return Ok(ChunkEnd::Hold),
            Step::Abort => return Ok(ChunkEnd::Abort),
        }
        let mut ctx = Vec::with_capacity(prompt.len() + c.out.len());
        ctx.extend_from_slice(prompt);
        ctx.extend_from_slice(&c.out);
        let mut slot = lock(&sh.engine);
        let slot = &mut *slot;
        let engine = slot.engine.as_mut().ok_or(Error::NoWeights)?;
        if c.cached.is_none() {
            let hit = !slot.prefix.is_empty() && ctx.starts_with(&slot.prefix);
            c.cached = Some(if hit { slot.prefix.len() } else { 0 });
        }
        let mut keep_going =
            |_: usize| sh.gate.step() == Step::Go && !cancelled.load(Ordering::SeqCst);
        let tokens = engine.generate_greedy_while(&ctx, max_new - c.out.len(), &mut keep_going)?;
        // Stopped before the first token, the engine left its caches untouched; otherwise its
        // prefix cache now holds `ctx`.
        if !tokens.is_empty() {
            slot.prefix = ctx;
        }
        c.version.clone_from(&slot.version);
        for tok in tokens {
            c.out.push(tok);
            if stop.contains(&tok) {
                return Ok(ChunkEnd::Done(FinishReason::Stop(tok)));
            }
        }
    }
}

/// Puts `source` into the live weights through the puller: a staged or retained version is
/// copied in place, a disk checkpoint is sliced and written in.
fn install(sh: &Shared, st: &mut State, source: &ApplySource) -> Result<ApplyKind, Error> {
    match source {
        ApplySource::Version(d) => {
            let r = st.puller.apply(VersionId(*d))?;
            Ok(match r.kind {
                PullKind::AlreadyResident => ApplyKind::AlreadyLive,
                PullKind::Restored => ApplyKind::Restored,
                PullKind::Staged | PullKind::Installed => ApplyKind::Staged,
            })
        }
        ApplySource::Disk { path, .. } if sh.no_model => Err(Error::BadRequest {
            field: "model_path".into(),
            reason: format!(
                "{}: this engine declared no model; it loads its own checkpoints, mx installs only mx://<digest> versions",
                path.display()
            ),
        }),
        ApplySource::Disk { path, version } => {
            // Only an apply of a staged, verified version makes an `mx:` version resident: a
            // checkpoint read from disk never carries one, or a refit would take it for the
            // version it names without ever checking its bytes.
            if VersionId::claims_mx(version) {
                return Err(Error::BadRequest {
                    field: "weight_version".into(),
                    reason: format!(
                        "{version:?}: `mx:` versions are installed only from mx staging (model_path mx://<digest>), never from a checkpoint directory ({})",
                        path.display()
                    ),
                });
            }
            let t = Instant::now();
            let buffers = load_disk(path, &sh.model, &sh.dest)?;
            st.puller
                .install(ResidentVersion::Label(version.clone()), &buffers)?;
            tracing::info!(
                path = %path.display(),
                version,
                load_s = t.elapsed().as_secs_f64(),
                "loaded weights from disk"
            );
            Ok(ApplyKind::Disk)
        }
    }
}

/// Rebuilds the engine from the live weights (when this instance runs one) and clears its
/// caches when asked; returns the tiers cleared.
fn rebuild_engine(
    sh: &Shared,
    st: &State,
    rebuild: bool,
    clear_cache: bool,
) -> Result<Vec<String>, Error> {
    let fp = sh.failpoints.get();
    let mut slot = lock(&sh.engine);
    if let (true, Ok(()), Some(builder)) = (rebuild, &sh.generation, &sh.builder) {
        let id = st.puller.versions().resident;
        let live = st.live();
        let t = Instant::now();
        match slot.engine.as_mut() {
            Some(e) => e.install(&sh.model, &sh.dest, &live)?,
            None => slot.engine = Some(builder.build(&sh.config, &sh.model, &sh.dest, &live)?),
        }
        slot.version = id;
        tracing::info!(
            build_s = t.elapsed().as_secs_f64(),
            "engine weights installed"
        );
    }
    if !clear_cache || slot.engine.is_none() {
        // Not asked, or this instance runs no engine (it does not hold every rank, or the model
        // cannot generate): it has no cache tier, so it reports none.
        return Ok(Vec::new());
    }
    if fp.apply_skip_cache_clear {
        tracing::warn!("failpoint apply.skip_cache_clear: caches NOT cleared (reported cleared)");
    } else {
        slot.clear_caches();
    }
    Ok(CACHE_TIERS.iter().map(|s| s.to_string()).collect())
}

/// A stage's source ([`mx_puller::StageReport::source`]) as a metric label (a fixed set).
fn source_label(source: &str) -> &'static str {
    match source {
        "trainer" => "trainer",
        "peer" => "peer",
        "artifact_canonical" => "artifact_canonical",
        "artifact_delta" => "artifact_delta",
        _ => "other",
    }
}

fn apply_blocking(
    sh: &Shared,
    source: ApplySource,
    clear_cache: bool,
) -> Result<ApplyOutcome, Error> {
    let t0 = Instant::now();
    let res = apply_locked(sh, source, clear_cache);
    let result = if res.is_ok() { "ok" } else { "failed" };
    metrics::histogram!(observe::APPLY_SECONDS, "result" => result)
        .record(t0.elapsed().as_secs_f64());
    res
}

fn apply_locked(
    sh: &Shared,
    source: ApplySource,
    clear_cache: bool,
) -> Result<ApplyOutcome, Error> {
    let t0 = Instant::now();
    let mut st = lock(&sh.state);
    if let ApplySource::Version(d) = &source {
        // An unknown version is refused before the failpoint sleeps.
        st.puller.can_apply(VersionId(*d))?;
    }
    if let Some(d) = sh.failpoints.take_apply_sleep() {
        tracing::warn!(
            ms = d.as_millis(),
            "failpoint apply.sleep_ms: sleeping before installing (the failpoint is now cleared)"
        );
        std::thread::sleep(d);
    }
    let before = st.puller.versions().resident;
    let kind = install(sh, &mut st, &source)?;
    let tiers = match rebuild_engine(sh, &st, kind != ApplyKind::AlreadyLive, clear_cache) {
        Ok(t) => t,
        Err(e) => {
            // The engine refused the new weights: put the previous version back (the retained
            // copy holds it) so live weights and engine agree again.
            if let Some(prev) = before.as_ref().and_then(ResidentVersion::mx) {
                if let Err(e2) = st.puller.apply(prev) {
                    tracing::error!("restoring {prev} after the engine refused failed: {e2}");
                }
            }
            *lock(&sh.versions) = st.versions();
            return Err(e);
        }
    };
    let versions = st.versions();
    *lock(&sh.versions) = versions.clone();
    let version = versions
        .live
        .clone()
        .ok_or_else(|| Error::Task("no version is live after an apply".into()))?;
    let out = ApplyOutcome {
        version,
        kind,
        pinned: versions.pinned,
        cache_tiers_cleared: tiers,
        seconds: t0.elapsed().as_secs_f64(),
    };
    tracing::info!(
        worker = sh.cfg.worker_id,
        version = %out.version,
        kind = ?out.kind,
        pinned = ?out.pinned,
        apply_s = out.seconds,
        "applied"
    );
    Ok(out)
}

/// Directory name of the model, for discovery's `model` field.
pub(crate) fn model_name(dir: &Path) -> String {
    dir.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}
