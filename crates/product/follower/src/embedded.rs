//! An engine's puller embedded in another process (the C ABI's `mx_puller`, the Python
//! package's `mx.Puller`): driven by the engine itself (stage, apply, rollback), and optionally
//! served to the control plane as a worker over the same memory.
//!
//! The bindings differ only in how arguments cross their boundary; everything with state lives
//! here: the optional control-plane connection, resolving a version label or id to the
//! version's manifests, and the switch from a puller the engine drives alone to an
//! [`Instance`] a [`Worker`] serves (after which both the engine and the control plane drive it,
//! serialized by the instance's lock).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mx_control::client::ControlClient;
use mx_control::{EngineApi, EngineEndpoint, ModelLimits};
use mx_layout::{LayoutSpec, ModelInfo, RankLayout, SourceManifest, VersionId};
use mx_puller::{ApplyReport, ExecOptions, Puller, PullerConfig, StageReport};

use crate::{Error, Instance, Worker, WorkerConfig};

/// An engine serving the contract's routes itself: where, its model's limits, and its hook
/// for staged versions.
type External = (
    EngineEndpoint,
    Option<ModelLimits>,
    Option<Arc<dyn crate::StagedHook>>,
);

static AGENTS: AtomicU64 = AtomicU64::new(0);

/// A version as the control plane answered [`EmbeddedPuller::resolve`]: its label and id, the
/// manifests this puller's plan reads, and their proof (`None` from a control plane that
/// answers whole records: the manifests' root is checked instead).
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The version's label.
    pub label: String,
    /// Its id.
    pub id: VersionId,
    /// The trainer manifests, only the shards and pieces the plan reads.
    pub manifests: Vec<SourceManifest>,
    /// The Merkle proof of their shards against `id`.
    pub proof: Option<mx_layout::merkle::VersionProof>,
}

/// How long [`EmbeddedPuller::serve`] waits for the command stream to connect.
pub const CONNECT_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// What an embedded puller needs.
#[derive(Debug, Clone)]
pub struct EmbeddedConfig {
    /// Control plane address (`http://host:port`); `None`: stage only from given manifests.
    pub control: Option<String>,
    /// With `control`: register the layout under this worker id at once, so publishers cut
    /// for it before the engine serves.
    pub worker_id: Option<String>,
    /// Inference layout of the engine.
    pub layout: LayoutSpec,
    /// Ranks of `layout` this process holds.
    pub ranks: Vec<u32>,
    /// The model.
    pub model: ModelInfo,
    /// Keep a host copy of the previously applied version (1x the ranks' bytes) for rollback.
    pub retain: bool,
    /// With `retain`: keep it in staging instead of a buffer of its own
    /// ([`mx_puller::Puller::retain_in_staging`]).
    pub retain_in_staging: bool,
    /// Prefix of the NIXL agent's name (the process id and a counter are appended).
    pub agent_prefix: String,
}

enum State {
    /// Driven by the engine alone.
    Bare(Box<Puller>),
    /// Wrapped in an instance served to the control plane (the worker, once it started).
    Served {
        inst: Instance,
        worker: Option<(Arc<Worker>, tokio::task::JoinHandle<()>)>,
        /// Followed ([`EmbeddedPuller::follow`]): the engine's own routes apply and roll back.
        engine_driven: bool,
    },
    /// Only while switching from `Bare` to `Served` (a panic there leaves it).
    Switching,
}

/// An engine's puller with its optional control-plane connection. See the module docs.
pub struct EmbeddedPuller {
    state: State,
    control: Option<(String, ControlClient)>,
    model: ModelInfo,
    layout: LayoutSpec,
    ranks: Vec<u32>,
    rank_layouts: Vec<RankLayout>,
}

impl std::fmt::Debug for EmbeddedPuller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedPuller")
            .field("layout", &self.layout)
            .field("ranks", &self.ranks)
            .field("served", &matches!(self.state, State::Served { .. }))
            .finish_non_exhaustive()
    }
}

impl EmbeddedPuller {
    /// Creates the puller with a NIXL agent, connects to the control plane when one is given
    /// and registers the layout there under `worker_id` when that is given too. No memory is
    /// registered yet.
    ///
    /// # Errors
    /// [`Error::Nixl`] (NIXL missing, agent refused), [`Error::Puller`] (a rank outside the
    /// layout, repeated or no ranks, a layout that cannot place the model), [`Error::Control`].
    pub async fn connect(cfg: EmbeddedConfig) -> Result<EmbeddedPuller, Error> {
        mx_nixl::nixl_available()?;
        let agent = mx_nixl::Agent::new(&format!(
            "{}-{}-{}",
            cfg.agent_prefix,
            std::process::id(),
            AGENTS.fetch_add(1, Ordering::Relaxed)
        ))?;
        let mut puller = Puller::new(
            PullerConfig {
                model: cfg.model.clone(),
                layout: cfg.layout,
                ranks: cfg.ranks.clone(),
                retain: cfg.retain,
            },
            Some(agent),
        )?;
        if cfg.retain_in_staging {
            puller.retain_in_staging()?;
        }
        let control = match cfg.control {
            Some(url) => {
                let client = ControlClient::connect(&url).await?;
                if let Some(id) = &cfg.worker_id {
                    client
                        .register_worker(id, id, &cfg.ranks, cfg.layout)
                        .await?;
                }
                Some((url, client))
            }
            None => None,
        };
        Ok(EmbeddedPuller {
            rank_layouts: puller.rank_layouts().to_vec(),
            state: State::Bare(Box::new(puller)),
            control,
            model: cfg.model,
            layout: cfg.layout,
            ranks: cfg.ranks,
        })
    }

    /// The held ranks' layouts (parameters, their pieces, offsets), in `ranks` order.
    pub fn rank_layouts(&self) -> &[RankLayout] {
        &self.rank_layouts
    }

    /// The control-plane address, when there is one.
    pub fn control_url(&self) -> Option<&str> {
        self.control.as_ref().map(|(u, _)| u.as_str())
    }

    /// Runs `f` on the puller (under the served instance's lock once served).
    ///
    /// # Errors
    /// [`Error::Task`] when an earlier switch to serving panicked half-way.
    pub fn with<T>(&mut self, f: impl FnOnce(&mut Puller) -> T) -> Result<T, Error> {
        match &mut self.state {
            State::Bare(p) => Ok(f(p)),
            State::Served { inst, .. } => Ok(inst.with_puller(f)),
            State::Switching => Err(Error::Task(
                "the puller was lost while starting to serve it; drop it".into(),
            )),
        }
    }

    fn client(&self) -> Result<&ControlClient, Error> {
        self.control
            .as_ref()
            .map(|(_, c)| c)
            .ok_or(Error::NoControlPlane)
    }

    /// The version `version` names (a label, or an id `mx:<hex>` of a READY version) with its
    /// label and the manifests this puller's plan reads ([`mx_puller::Puller::want`]) with
    /// their proof, from the control plane.
    ///
    /// # Errors
    /// [`Error::NoControlPlane`], [`Error::UnknownVersionId`] (no READY version has that id),
    /// [`Error::VersionNotReady`], [`Error::Control`] (e.g. an unknown label).
    pub async fn resolve(&mut self, version: &str) -> Result<Resolved, Error> {
        let want = self.with(|p| p.want())?;
        let client = self.client()?;
        let label = match version.parse::<VersionId>() {
            Ok(id) => client
                .get_status()
                .await?
                .versions
                .iter()
                .find(|v| v.version_digest == Some(id.digest()))
                .map(|v| v.label.clone())
                .ok_or_else(|| Error::UnknownVersionId { id: id.to_string() })?,
            Err(_) => version.to_string(),
        };
        let info = client.get_version_for(&label, &want).await?;
        let Some(d) = info.version_digest else {
            return Err(Error::VersionNotReady {
                label,
                state: info.state.to_string(),
            });
        };
        Ok(Resolved {
            label,
            id: VersionId(d),
            manifests: info.manifests,
            proof: info.proof,
        })
    }

    /// Stages version `id` from `manifests` (which must be that version's): plans the exact
    /// byte ranges of the held ranks, pulls them into staging, verifies them. The registered
    /// memory is not touched. Blocks for the pull.
    ///
    /// # Errors
    /// [`Error::ServedPuller`]; [`Error::Puller`]: manifests of another version, a source
    /// unreachable, a failed READ or verification, sources that do not cover a parameter.
    pub fn stage(
        &mut self,
        id: VersionId,
        manifests: &[SourceManifest],
        opts: &ExecOptions,
    ) -> Result<StageReport, Error> {
        self.not_served("stage")?;
        Ok(self.with(|p| p.stage(id, manifests, opts))??)
    }

    /// Stages what [`EmbeddedPuller::resolve`] answered: checked by its proof when it has one
    /// ([`mx_puller::Puller::stage_proven`]), by the root of its manifests otherwise.
    ///
    /// # Errors
    /// As [`EmbeddedPuller::stage`]; [`mx_puller::Error::Unproven`] and
    /// [`mx_puller::Error::Incomplete`] for an answer that is not the version's or leaves a
    /// shard out.
    pub fn stage_resolved(
        &mut self,
        r: &Resolved,
        opts: &ExecOptions,
    ) -> Result<StageReport, Error> {
        self.not_served("stage")?;
        Ok(self.with(|p| match &r.proof {
            Some(proof) => p.stage_proven(r.id, &r.manifests, proof, opts),
            None => p.stage(r.id, &r.manifests, opts),
        })??)
    }

    /// Once served, staging, applying and rolling back are the control plane's (a refit):
    /// done behind its back they would replace what it staged or leave its record of this
    /// worker's resident version wrong. A followed puller's engine applies and rolls back
    /// itself: that is how the refit's APPLY, sent to the engine's routes, reaches it.
    fn not_served(&self, what: &'static str) -> Result<(), Error> {
        match &self.state {
            State::Served {
                engine_driven: true,
                ..
            } if what != "stage" => Ok(()),
            _ if self.served() => Err(Error::ServedPuller { what }),
            _ => Ok(()),
        }
    }

    /// Restores the retained copy in place (a rollback to the version applied before).
    ///
    /// # Errors
    /// [`Error::ServedPuller`]; [`Error::Puller`] (retention off, nothing retained, memory
    /// unregistered or changed).
    pub fn rollback(&mut self) -> Result<ApplyReport, Error> {
        self.not_served("rollback")?;
        Ok(self.with(|p| p.rollback())??)
    }

    /// Installs `id` (`None`: the staged version) into the registered memory in place.
    ///
    /// # Errors
    /// [`Error::ServedPuller`], [`Error::NothingStaged`] (`None` with nothing staged),
    /// [`Error::Puller`] (a version
    /// neither staged, retained nor resident; a parameter without memory).
    pub fn apply(&mut self, id: Option<VersionId>) -> Result<ApplyReport, Error> {
        self.not_served("apply")?;
        let id = match id {
            Some(id) => id,
            None => {
                let staged = self.with(|p| p.versions().staged)?;
                staged.ok_or(Error::NothingStaged)?
            }
        };
        Ok(self.with(|p| p.apply(id))??)
    }

    /// Copies bytes `offset..offset + buf.len()` of rank `rank` of the staged `version` into
    /// `buf` (laid out as the rank's layout), leaving staging, the registered memory and the
    /// resident version as they are ([`mx_puller::Puller::copy_staged_rank`]). Allowed while
    /// served: it changes nothing the control plane tracks.
    ///
    /// # Errors
    /// [`Error::Puller`]: `version` is not the staged one, `rank` is not held, the window does
    /// not lie inside the rank's layout.
    pub fn copy_staged_rank(
        &mut self,
        version: VersionId,
        rank: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Error> {
        Ok(self.with(|p| p.copy_staged_rank(version, rank, offset, buf))??)
    }

    /// Serves the puller as worker `worker_id` of its control plane: the engine routes of
    /// `engine_api` on `listen` (the instance declares no model: refits skip the post-update
    /// generation), registration, and the command stream on the current tokio runtime in the
    /// background. Every parameter must have memory. Returns the routes' URL once the control
    /// plane reports the worker connected (a refit may start at once).
    ///
    /// # Errors
    /// [`Error::NoControlPlane`], [`Error::AlreadyServed`], [`Error::Puller`] (a parameter
    /// without memory), [`Error::Bind`], [`Error::Control`] / [`Error::Displaced`] (the id is
    /// held by another process, or the registration was refused).
    pub async fn serve(
        &mut self,
        worker_id: &str,
        listen: SocketAddr,
        engine_api: EngineApi,
    ) -> Result<String, Error> {
        self.start_worker(worker_id, worker_id, listen, engine_api, None)
            .await
    }

    /// Follows the control plane as worker `worker_id` of inference instance `instance`, whose
    /// engine serves the contract's routes itself at `engine.system_url` (a vLLM server with mx
    /// as its weight-transfer backend): registration with that endpoint and `model_limits`, and
    /// the command stream (the control plane stages versions into this puller) on the current
    /// tokio runtime in the background. Unlike [`EmbeddedPuller::serve`], the engine keeps
    /// applying and rolling back itself ([`EmbeddedPuller::apply`], [`EmbeddedPuller::rollback`]):
    /// its routes are how a refit's APPLY reaches this puller. `on_staged` is handed each
    /// version pulled into staging before the worker reports it staged (the engine prepares
    /// it outside the pause). Returns once the control plane reports the worker connected.
    ///
    /// # Errors
    /// As [`EmbeddedPuller::serve`], without [`Error::Bind`].
    pub async fn follow(
        &mut self,
        worker_id: &str,
        instance: &str,
        engine: EngineEndpoint,
        model_limits: Option<ModelLimits>,
        on_staged: Option<Arc<dyn crate::StagedHook>>,
    ) -> Result<String, Error> {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        self.start_worker(
            worker_id,
            instance,
            any,
            engine.api,
            Some((engine, model_limits, on_staged)),
        )
        .await
    }

    async fn start_worker(
        &mut self,
        worker_id: &str,
        instance: &str,
        listen: SocketAddr,
        engine_api: EngineApi,
        external: Option<External>,
    ) -> Result<String, Error> {
        self.client()?;
        let control = self.control_url().unwrap_or_default().to_string();
        match &self.state {
            State::Bare(p) => p.check_registered()?,
            State::Served {
                worker: Some(_), ..
            } => return Err(Error::AlreadyServed),
            State::Served { worker: None, .. } => {}
            State::Switching => return Err(Error::Task("the puller was lost".into())),
        }
        let inst = match std::mem::replace(&mut self.state, State::Switching) {
            // check_registered passed above, so this does not fail (and leaves `Switching` if it
            // ever did, which `with` reports).
            State::Bare(p) => {
                Instance::over_puller(*p, self.model.clone(), worker_id.into(), false)?
            }
            State::Served { inst, .. } => inst,
            State::Switching => return Err(Error::Task("the puller was lost".into())),
        };
        let engine_driven = external.is_some();
        self.state = State::Served {
            inst: inst.clone(),
            worker: None,
            engine_driven,
        };
        let cfg = WorkerConfig {
            control,
            http_token: None,
            model_dir: std::path::PathBuf::new(),
            layout: self.layout,
            ranks: self.ranks.clone(),
            worker_id: worker_id.to_string(),
            instance: instance.to_string(),
            http: listen,
            engine_api,
            failpoints: false,
            reconnect_timeout: None,
            load: None,
            load_version: None,
            serve_peers: false,
            engine: None,
            on_staged: None,
        };
        let w = match external {
            None => Worker::serve(cfg, inst.clone()).await?,
            Some((engine, limits, on_staged)) => {
                let cfg = WorkerConfig { on_staged, ..cfg };
                Worker::attach(cfg, inst.clone(), engine, limits).await?
            }
        };
        let w = Arc::new(w);
        let url = w.http_url();
        let runner = tokio::spawn({
            let w = Arc::clone(&w);
            async move {
                if let Err(e) = w.run().await {
                    tracing::error!(error = %e, "the served puller's worker stopped");
                }
            }
        });
        self.state = State::Served {
            inst,
            worker: Some((w, runner)),
            engine_driven,
        };
        self.wait_connected(worker_id).await?;
        Ok(url)
    }

    /// Waits until the control plane reports `worker_id` connected (its command stream open),
    /// so a refit started right after `serve` returns finds it: up to [`CONNECT_WAIT`].
    async fn wait_connected(&self, worker_id: &str) -> Result<(), Error> {
        let client = self.client()?;
        let deadline = tokio::time::Instant::now() + CONNECT_WAIT;
        loop {
            let status = client.get_status().await?;
            if status
                .workers
                .iter()
                .any(|w| w.worker_id == worker_id && w.connected)
            {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Task(format!(
                    "worker {worker_id:?} registered but its command stream did not connect \
                     within {} s",
                    CONNECT_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Whose engine this is once [`EmbeddedPuller::serve`] or [`EmbeddedPuller::follow`] started
    /// a worker (`None` before): what an engine serving its own routes answers when the control
    /// plane asks ([`mx_adapters::identity`]; mx's vLLM plugin through `collective_rpc`).
    pub fn identity(&self) -> Option<mx_adapters::EngineIdentity> {
        match &self.state {
            State::Served {
                worker: Some((w, _)),
                ..
            } => Some(w.identity()),
            _ => None,
        }
    }

    /// Reports to the control plane what this rank holds now, after an install the engine ran
    /// through mx ([`Worker::report_resident`]; `error`: why it failed and what was restored).
    ///
    /// # Errors
    /// [`Error::Task`] before [`EmbeddedPuller::follow`] or [`EmbeddedPuller::serve`] started a
    /// worker or when the control plane did not answer; [`Error::Control`] when it refused.
    pub async fn report_resident(&self, error: &str) -> Result<(), Error> {
        match &self.state {
            State::Served {
                worker: Some((w, _)),
                ..
            } => w.report_resident(error).await,
            _ => Err(Error::Task(
                "report_resident: the puller follows no control plane yet (call follow first)"
                    .into(),
            )),
        }
    }

    /// True once [`EmbeddedPuller::serve`] started a worker.
    pub fn served(&self) -> bool {
        matches!(
            self.state,
            State::Served {
                worker: Some(_),
                ..
            }
        )
    }

    /// True once [`EmbeddedPuller::follow`] started a worker (the engine applies itself).
    pub fn followed(&self) -> bool {
        matches!(
            self.state,
            State::Served {
                worker: Some(_),
                engine_driven: true,
                ..
            }
        )
    }

    /// Stops serving, if served: the routes answer 410 Gone with `reason`, the command stream
    /// ends and the worker id is retired at the control plane (best effort, see
    /// [`Worker::retire`]). Idempotent. Call it inside the runtime that served the worker.
    pub async fn stop_serving(&mut self, reason: &str) {
        if let State::Served { inst, worker, .. } = &mut self.state {
            inst.retire(reason.to_string());
            if let Some((w, runner)) = worker.take() {
                runner.abort();
                let _ = runner.await;
                w.retire(reason).await;
                drop(w);
            }
        }
    }
}
