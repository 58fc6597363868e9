//! The control-plane side of a worker: registration, the command stream and reconnection.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use mx_adapters::EngineIdentity;
use mx_control::client::{Backoff, CommandStream, ControlClient};
use mx_control::{Command, EngineApi, EngineEndpoint, Registration, StagedReport};
use mx_layout::{Digest, LayoutSpec, VersionId};
use mx_nixl::Agent;

use crate::http::{self, HttpServer};
use crate::instance::{ApplySource, Instance, InstanceConfig};
use crate::Error;
use mx_puller::StageReport;

/// First wait before a reconnect attempt; doubles (with jitter) up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between reconnect attempts to a lost control plane.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Longest one reconnect attempt (connect, register, watch) may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a worker that keeps failing to reconnect says so at warn level (debug otherwise).
const REPORT_EVERY: Duration = Duration::from_secs(30);

/// What a worker needs to start.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Control plane address, `http://host:port`.
    pub control: String,
    /// Bearer token the engine routes (`--http`) require of every caller
    /// (`authorization: Bearer <token>`), e.g. the control plane's engine calls; `None`: open
    /// routes (refused on a non-loopback address).
    pub http_token: Option<String>,
    /// Model directory: its config.json and safetensors header give the tensor list (no weights
    /// are read unless `load` names it).
    pub model_dir: PathBuf,
    /// Inference layout.
    pub layout: LayoutSpec,
    /// Ranks of `layout` this instance holds.
    pub ranks: Vec<u32>,
    /// Worker id (unique in the fleet).
    pub worker_id: String,
    /// Instance name.
    pub instance: String,
    /// HTTP listen address of the engine routes (port 0 picks a free port).
    pub http: SocketAddr,
    /// The contract the control plane should speak to this worker (both are served).
    pub engine_api: EngineApi,
    /// Serve `/mx/failpoints`.
    pub failpoints: bool,
    /// Give up ([`Error::ReconnectTimeout`]) after the control plane stayed unreachable this
    /// long; `None` (the default) retries forever while the engine keeps serving.
    pub reconnect_timeout: Option<Duration>,
    /// Checkpoint directory to load as the initial live weights, before registering.
    pub load: Option<PathBuf>,
    /// Version id of the initial weights (default `disk:<load>`).
    pub load_version: Option<String>,
    /// Serve the resident mx version to other workers from the live memory (a peer source,
    /// [`mx_puller::Puller::peer_manifest`]), re-offered whenever the resident version changes.
    pub serve_peers: bool,
    /// Builds the generation engine once weights are live ([`Worker::start`]); `None`: the
    /// worker generates nothing (refits need no post-update generation of it only when it
    /// declares no model).
    pub engine: Option<std::sync::Arc<dyn crate::EngineBuilder>>,
    /// Called with each version this worker pulled into staging, before it reports it staged
    /// (see [`crate::StagedHook`]); `None`: reported at once.
    pub on_staged: Option<std::sync::Arc<dyn crate::StagedHook>>,
}

/// How often a worker serving peers looks whether its resident version changed.
const PEER_POLL: Duration = Duration::from_millis(500);

/// Where the engine routes the control plane calls live.
enum Routes {
    /// Served by this process over the instance ([`Worker::serve`]).
    Served(HttpServer),
    /// Served by the engine itself, e.g. a vLLM server whose weight-transfer backend embeds this
    /// worker ([`Worker::attach`]): the base URL, and whether the engine runs a model the
    /// control plane can generate with.
    External {
        url: String,
        no_model: bool,
        frontend: Option<mx_adapters::dynamo::Frontend>,
        model_limits: Option<mx_control::ModelLimits>,
    },
}

impl Routes {
    fn url(&self) -> String {
        match self {
            Routes::Served(h) => h.url(),
            Routes::External { url, .. } => url.clone(),
        }
    }
}

/// What the engine of worker `cfg.worker_id`, registered with `incarnation`, answers when asked
/// whose it is ([`mx_adapters::identity`]).
fn engine_identity(cfg: &WorkerConfig, incarnation: u64) -> EngineIdentity {
    EngineIdentity {
        worker_id: cfg.worker_id.clone(),
        instance: cfg.instance.clone(),
        incarnation_digest: mx_adapters::incarnation_digest(incarnation),
    }
}

/// One inference instance connected to the control plane.
pub struct Worker {
    cfg: WorkerConfig,
    inst: Instance,
    routes: Routes,
    client: Mutex<ControlClient>,
    /// Drawn once per process: the control plane tells this process's registrations from
    /// another process's under the same worker id by it.
    incarnation: u64,
    /// Whether the control plane accepted a registration from this process since its last
    /// (re)start: until it did, the worker registers before it watches.
    registered: AtomicBool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("worker_id", &self.cfg.worker_id)
            .field("engine", &self.routes.url())
            .field("incarnation", &format_args!("{:#x}", self.incarnation))
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Computes the layout of its ranks, creates the NIXL agent, loads `load` if given, starts
    /// the HTTP server and registers with the control plane (engine endpoint and resident
    /// version included). A control plane that is unreachable is not an error: the worker
    /// serves its engine and [`Worker::run`] registers once it is back.
    ///
    /// # Errors
    /// [`Error::Layout`] when the layout cannot place the model (e.g. tp=2 over 9 heads),
    /// [`Error::Nixl`] when NIXL is missing, errors of a disk apply for `load`,
    /// [`Error::Bind`], [`Error::Displaced`] when another live process holds the worker id (or
    /// the engine URL), [`Error::Control`] when the control plane refuses the registration
    /// (e.g. a malformed worker id).
    pub async fn start(cfg: WorkerConfig) -> Result<Worker, Error> {
        mx_nixl::nixl_available()?;
        let agent = Agent::new(&format!(
            "mx-worker-{}-{}",
            cfg.worker_id,
            std::process::id()
        ))?;
        let inst = Instance::open(
            InstanceConfig {
                model_dir: cfg.model_dir.clone(),
                layout: cfg.layout,
                ranks: cfg.ranks.clone(),
                failpoints: cfg.failpoints,
                worker_id: cfg.worker_id.clone(),
            },
            Some(agent),
            cfg.engine.clone(),
        )?;
        if let Some(dir) = &cfg.load {
            let version = cfg
                .load_version
                .clone()
                .unwrap_or_else(|| format!("disk:{}", dir.display()));
            inst.apply_before_serving(ApplySource::Disk {
                path: dir.clone(),
                version,
            })
            .await?;
        }
        Worker::serve(cfg, inst).await
    }

    /// Serves `inst` (e.g. [`Instance::over_puller`], an engine's own memory) as worker
    /// `cfg.worker_id`: starts the HTTP server for the engine contracts and registers with the
    /// control plane; `cfg.model_dir`, `load` and `load_version` are not used (the instance
    /// holds what it holds). [`Worker::run`] then follows the command stream.
    ///
    /// # Errors
    /// As [`Worker::start`], after the instance exists.
    pub async fn serve(cfg: WorkerConfig, inst: Instance) -> Result<Worker, Error> {
        let incarnation = mx_control::client::random_u64();
        let identity = engine_identity(&cfg, incarnation);
        let reporter = http::Reporter {
            client: ControlClient::connect_lazy(&cfg.control)?.with_incarnation(incarnation),
            worker_id: cfg.worker_id.clone(),
            incarnation,
        };
        let http = http::serve(
            inst.clone(),
            cfg.http,
            cfg.http_token.clone(),
            Some(identity),
            Some(reporter),
        )
        .await?;
        tracing::info!(
            worker = cfg.worker_id,
            url = http.url(),
            "engine HTTP routes served"
        );
        Worker::with_routes(cfg, inst, Routes::Served(http), incarnation).await
    }

    /// Follows the control plane for `inst`, whose engine serves its own routes at
    /// `engine.system_url` (e.g. a vLLM server with mx as its weight-transfer backend): no HTTP
    /// server is started; the worker registers `engine` as its endpoint (`cfg.http` and
    /// `cfg.engine_api` are not used) and [`Worker::run`] follows the command stream, staging
    /// what the control plane asks. Applies come through the engine's own routes, which call
    /// back into the instance's puller.
    ///
    /// # Errors
    /// As [`Worker::serve`], without [`Error::Bind`].
    pub async fn attach(
        cfg: WorkerConfig,
        inst: Instance,
        engine: EngineEndpoint,
        model_limits: Option<mx_control::ModelLimits>,
    ) -> Result<Worker, Error> {
        let cfg = WorkerConfig {
            engine_api: engine.api,
            ..cfg
        };
        let routes = Routes::External {
            url: engine.system_url,
            no_model: engine.no_model,
            frontend: engine.frontend,
            model_limits,
        };
        let incarnation = mx_control::client::random_u64();
        Worker::with_routes(cfg, inst, routes, incarnation).await
    }

    async fn with_routes(
        cfg: WorkerConfig,
        inst: Instance,
        routes: Routes,
        incarnation: u64,
    ) -> Result<Worker, Error> {
        let client = ControlClient::connect_lazy(&cfg.control)?.with_incarnation(incarnation);
        let w = Worker {
            cfg,
            inst,
            routes,
            client: Mutex::new(client.clone()),
            incarnation,
            registered: AtomicBool::new(false),
        };
        match w.register(&client).await {
            Ok(()) => {
                w.registered.store(true, Ordering::SeqCst);
                tracing::info!(
                    worker = w.cfg.worker_id,
                    layout = %w.cfg.layout,
                    ranks = ?w.cfg.ranks,
                    resident = ?w.inst.resident_version(),
                    incarnation = format_args!("{incarnation:#x}"),
                    "registered"
                );
            }
            Err(Error::Control(e)) if e.is_transient() => tracing::warn!(
                worker = w.cfg.worker_id,
                control = w.cfg.control,
                "control plane unreachable at start ({e}); serving the engine and registering once it is back"
            ),
            Err(e) => return Err(e),
        }
        Ok(w)
    }

    /// The base URL of the engine routes, `http://host:port` (the engine's own for a
    /// [`Worker::attach`]ed one).
    pub fn http_url(&self) -> String {
        self.routes.url()
    }

    /// The inference instance (version store, engine, gate).
    pub fn instance(&self) -> &Instance {
        &self.inst
    }

    /// This process's incarnation, sent with its registrations and command streams.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Retires this worker's id at the control plane (a clean exit: status, admission and
    /// default refit sets forget it), best effort within 5 s: a control plane that is away or
    /// refuses (a refit holds the id) is logged, and the id stays until it is retired later.
    pub async fn retire(&self, reason: &str) {
        let id = &self.cfg.worker_id;
        let client = self.client();
        match tokio::time::timeout(Duration::from_secs(5), client.retire_worker(id, reason)).await {
            Ok(Ok(())) => tracing::info!(worker = %id, "worker id retired: {reason}"),
            Ok(Err(e)) => tracing::warn!(worker = %id, "retiring the worker id on exit: {e}"),
            Err(_) => {
                tracing::warn!(worker = %id, "retiring the worker id on exit: no answer within 5 s")
            }
        }
    }

    /// Reports to the control plane what this worker's rank holds in its engine's live weights
    /// ([`Instance::resident_version`]) after an install its engine ran through mx (`error`:
    /// why the install failed and what was restored; empty when it succeeded), within 10 s.
    /// Where the engine cannot fail the request that installs (SGLang's custom weight loader),
    /// this is how the control plane learns the outcome, so it is sent before the engine's
    /// route returns.
    ///
    /// # Errors
    /// [`Error::Control`] when the control plane refused the report, [`Error::Task`] when it did
    /// not answer in time.
    pub async fn report_resident(&self, error: &str) -> Result<(), Error> {
        let id = &self.cfg.worker_id;
        let resident = self.inst.resident_version();
        let client = self.client();
        match tokio::time::timeout(
            Duration::from_secs(10),
            client.report_resident(id, self.incarnation, resident.as_ref(), error),
        )
        .await
        {
            Ok(r) => r.map_err(Error::Control),
            Err(_) => Err(Error::Task(
                "ReportResident: the control plane did not answer within 10 s".into(),
            )),
        }
    }

    /// What this worker's engine answers when asked whose it is ([`mx_adapters::identity`]):
    /// an engine serving its own routes (vLLM) returns it from its identity route.
    pub fn identity(&self) -> EngineIdentity {
        engine_identity(&self.cfg, self.incarnation)
    }

    fn client(&self) -> ControlClient {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Registers with `client`. A refusal because another live process holds the id retires
    /// the engine and answers [`Error::Displaced`].
    async fn register(&self, client: &ControlClient) -> Result<(), Error> {
        let res = client
            .register(&Registration {
                worker_id: self.cfg.worker_id.clone(),
                instance: self.cfg.instance.clone(),
                ranks: self.cfg.ranks.clone(),
                layout: self.cfg.layout,
                engine: Some(EngineEndpoint {
                    api: self.cfg.engine_api,
                    system_url: self.routes.url(),
                    no_model: match &self.routes {
                        Routes::Served(_) => self.inst.no_model(),
                        Routes::External { no_model, .. } => *no_model,
                    },
                    frontend: match &self.routes {
                        Routes::Served(_) => None,
                        Routes::External { frontend, .. } => frontend.clone(),
                    },
                }),
                resident_version: self.inst.resident_version(),
                model_limits: match &self.routes {
                    Routes::Served(_) => self.inst.model_limits(),
                    Routes::External { model_limits, .. } => *model_limits,
                },
                seen: self.inst.seen(),
            })
            .await;
        res.map_err(|e| self.displaced_or(e))
    }

    /// [`Error::Displaced`] (retiring the engine) when the control plane said another process
    /// holds this worker id; `e` as it is otherwise.
    fn displaced_or(&self, e: mx_control::Error) -> Error {
        if !e.is_worker_id_in_use() {
            return Error::Control(e);
        }
        let reason = e.to_string();
        self.inst.retire(format!(
            "another process holds worker id {:?}: {reason}",
            self.cfg.worker_id
        ));
        Error::Displaced {
            worker_id: self.cfg.worker_id.clone(),
            reason,
        }
    }

    /// Follows the command stream. When the stream breaks or ends (the control plane died,
    /// stopped or restarted), the engine keeps serving and the worker reconnects with capped,
    /// jittered exponential backoff ([`MAX_BACKOFF`]): connect, re-register with the current
    /// resident version, watch again; by default without a time limit.
    ///
    /// # Errors
    /// [`Error::Displaced`] when the control plane refuses the registration or stream because
    /// another process holds this worker id (the engine is retired first: every route answers
    /// 410); [`Error::ReconnectTimeout`] only with an explicit
    /// [`WorkerConfig::reconnect_timeout`]. Stage failures are reported to the control plane,
    /// not returned. (Applies do not come over the stream: a refit calls the engine routes.)
    pub async fn run(&self) -> Result<(), Error> {
        if !self.cfg.serve_peers {
            return self.run_commands().await;
        }
        tokio::select! {
            r = self.run_commands() => r,
            () = self.peer_loop() => Ok(()),
        }
    }

    /// Offers the resident mx version as a peer source whenever it changes (and withdraws the
    /// offer of the previous one; the control plane already withdrew it at the APPLY intent),
    /// and again when a layout registers (the offer carries pieces cut for every registered
    /// layout). Failures are retried at a slower pace, logged once per version.
    async fn peer_loop(&self) {
        let mut served: Option<(VersionId, Vec<mx_layout::LayoutSpec>)> = None;
        let mut failed: Option<(VersionId, Instant)> = None;
        loop {
            tokio::time::sleep(PEER_POLL).await;
            let want = self.inst.resident_version().and_then(|r| r.mx());
            let Some(v) = want else {
                if served.take().is_some() {
                    let _ = self.client().withdraw_peer(&self.cfg.worker_id, None).await;
                }
                continue;
            };
            let Ok(mut layouts) = self.client().list_layouts().await else {
                continue;
            };
            layouts.sort_by_key(ToString::to_string);
            if served
                .as_ref()
                .is_some_and(|(sv, sl)| *sv == v && *sl == layouts)
            {
                continue;
            }
            if served.as_ref().is_some_and(|(sv, _)| *sv != v) {
                // Best effort: the control plane withdrew it before the apply already.
                let _ = self.client().withdraw_peer(&self.cfg.worker_id, None).await;
                served = None;
            }
            if let Some((fv, at)) = failed {
                if fv == v && at.elapsed() < Duration::from_secs(5) {
                    continue;
                }
            }
            match self.serve_as_peer(v, &layouts).await {
                Ok(label) => {
                    tracing::info!(worker = self.cfg.worker_id, label, "serving {v} to peers");
                    served = Some((v, layouts));
                    failed = None;
                }
                Err(e) => {
                    if failed.is_none_or(|(fv, _)| fv != v) {
                        tracing::warn!(
                            worker = self.cfg.worker_id,
                            "cannot serve {v} to peers (retrying every 5 s): {e}"
                        );
                    }
                    failed = Some((v, Instant::now()));
                }
            }
        }
    }

    /// Describes the resident version `v` from the live memory, with pieces for every layout of
    /// `layouts`, and offers it to the control plane; returns its label.
    async fn serve_as_peer(
        &self,
        v: VersionId,
        layouts: &[mx_layout::LayoutSpec],
    ) -> Result<String, Error> {
        let c = self.client();
        let label = c
            .get_status()
            .await?
            .versions
            .iter()
            .find(|x| x.version_digest == Some(v.digest()))
            .map(|x| x.label.clone())
            .ok_or_else(|| Error::UnknownVersionId { id: v.to_string() })?;
        // The record's shards and pieces (of every layout) over this worker's boxes: all a
        // description of its own memory reads.
        let want = self.inst.want().await?.any_dest();
        let info = c.get_version_for(&label, &want).await?;
        let model = self.inst.model().clone();
        let layouts: Vec<Vec<mx_layout::RankLayout>> = layouts
            .iter()
            .filter_map(|l| mx_layout::rank_layouts(&model, *l).ok())
            .collect();
        let m = self.inst.peer_manifest(v, info.manifests, layouts).await?;
        c.serve_peer(&label, &self.cfg.worker_id, &m).await?;
        Ok(label)
    }

    /// The command loop of [`Worker::run`].
    async fn run_commands(&self) -> Result<(), Error> {
        let mut stream = if self.registered.load(Ordering::SeqCst) {
            match self.client().watch_commands(&self.cfg.worker_id).await {
                Ok(s) if self.admit_stream(&s).is_ok() => s,
                Ok(_) => {
                    self.reconnect("a deposed leader's command stream".into())
                        .await?
                }
                Err(e) => {
                    let e = self.displaced_or(e);
                    if matches!(e, Error::Displaced { .. }) {
                        return Err(e);
                    }
                    self.reconnect(e.to_string()).await?
                }
            }
        } else {
            self.reconnect("not registered yet".into()).await?
        };
        loop {
            let why = match self.follow(&mut stream).await {
                None => "the control plane ended the command stream".to_string(),
                Some(e) => e.to_string(),
            };
            tracing::warn!(
                worker = self.cfg.worker_id,
                "lost the control plane: {why}; serving on and reconnecting"
            );
            stream = self.reconnect(why).await?;
        }
    }

    /// Handles commands until the stream ends (`None`: the server ended it) or fails.
    async fn follow(&self, stream: &mut CommandStream) -> Option<mx_control::Error> {
        loop {
            match stream.next().await {
                Ok(Some(cmd)) => self.handle(cmd).await,
                Ok(None) => return None,
                Err(e) => return Some(e),
            }
        }
    }

    /// Connects, registers and opens the command stream, retrying with backoff until it
    /// succeeds, another process turns out to hold the id, or the optional reconnect timeout
    /// passes.
    async fn reconnect(&self, why: String) -> Result<CommandStream, Error> {
        let t0 = Instant::now();
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        let mut last = why;
        let mut reported = Instant::now();
        let mut attempts = 0u64;
        loop {
            let wait = backoff.next_wait();
            if let Some(limit) = self.cfg.reconnect_timeout {
                if t0.elapsed() + wait > limit {
                    return Err(Error::ReconnectTimeout {
                        worker_id: self.cfg.worker_id.clone(),
                        control: self.cfg.control.clone(),
                        seconds: limit.as_secs_f64(),
                        last_error: last,
                    });
                }
            }
            tokio::time::sleep(wait).await;
            attempts += 1;
            match tokio::time::timeout(ATTEMPT_TIMEOUT, self.attempt()).await {
                Ok(Ok((client, stream))) => {
                    *self.client.lock().unwrap_or_else(PoisonError::into_inner) = client;
                    self.registered.store(true, Ordering::SeqCst);
                    tracing::warn!(
                        worker = self.cfg.worker_id,
                        after_s = t0.elapsed().as_secs_f64(),
                        attempts,
                        resident = ?self.inst.resident_version(),
                        "reconnected and re-registered"
                    );
                    return Ok(stream);
                }
                Ok(Err(e @ Error::Displaced { .. })) => return Err(e),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "connecting timed out".into(),
            }
            if reported.elapsed() >= REPORT_EVERY {
                reported = Instant::now();
                tracing::warn!(
                    worker = self.cfg.worker_id,
                    control = self.cfg.control,
                    away_s = t0.elapsed().as_secs_f64(),
                    attempts,
                    "control plane still unreachable, engine still serving: {last}"
                );
            } else {
                tracing::debug!(
                    worker = self.cfg.worker_id,
                    "reconnect attempt failed: {last}"
                );
            }
        }
    }

    /// One reconnect attempt: a fresh connection, registration, command stream.
    async fn attempt(&self) -> Result<(ControlClient, CommandStream), Error> {
        let client = ControlClient::connect(&self.cfg.control)
            .await?
            .with_incarnation(self.incarnation);
        self.register(&client).await?;
        let stream = client
            .watch_commands(&self.cfg.worker_id)
            .await
            .map_err(|e| self.displaced_or(e))?;
        self.admit_stream(&stream)?;
        Ok((client, stream))
    }

    /// Refuses a command stream of a deposed leader ([`Error::DeposedLeader`]): one whose epoch
    /// is lower than the highest this worker has seen.
    fn admit_stream(&self, stream: &CommandStream) -> Result<(), Error> {
        match stream.epoch() {
            Some(epoch) => self
                .inst
                .admit_epoch(epoch)
                .map_err(|seen| Error::DeposedLeader {
                    worker_id: self.cfg.worker_id.clone(),
                    epoch,
                    seen,
                }),
            None => Ok(()),
        }
    }

    async fn handle(&self, cmd: Command) {
        match cmd {
            Command::Stage {
                label,
                version_digest,
            } => {
                let t0 = Instant::now();
                let report = match self.stage(&label, version_digest).await {
                    Ok(stats) => {
                        if !stats.resident {
                            self.hand_staged(&label, VersionId(version_digest)).await;
                        }
                        tracing::info!(
                            worker = self.cfg.worker_id,
                            label,
                            pull_s = stats.pull_s,
                            verify_s = stats.verify_s,
                            plan_s = stats.plan_s,
                            plan_reused = stats.plan_reused,
                            descriptors = stats.descriptors,
                            "staged"
                        );
                        StagedReport {
                            worker_id: self.cfg.worker_id.clone(),
                            label: label.clone(),
                            ok: true,
                            error: String::new(),
                            ranks: stats.digests,
                            bytes: stats.useful_bytes,
                            descriptors: stats.descriptors,
                            seconds: t0.elapsed().as_secs_f64(),
                            strategies: stats.strategies,
                            source: stats.source,
                            wire_bytes: stats.wire_bytes,
                        }
                    }
                    Err(e) => {
                        tracing::error!(worker = self.cfg.worker_id, label, "stage failed: {e}");
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
                if let Err(e) = self.client().report_staged(&report).await {
                    // A refused report (e.g. a newer Stage superseded this one) is not fatal:
                    // the control plane sends whatever it wants next on the stream.
                    tracing::warn!(worker = self.cfg.worker_id, "staged report refused: {e}");
                }
            }
        }
    }

    /// Hands the version just staged to the engine's [`crate::StagedHook`] (on a blocking
    /// thread); its failure is logged, not the stage's.
    async fn hand_staged(&self, label: &str, version: VersionId) {
        let Some(hook) = self.cfg.on_staged.clone() else {
            return;
        };
        let t = Instant::now();
        let res = tokio::task::spawn_blocking(move || hook.staged(version))
            .await
            .unwrap_or_else(|e| Err(format!("the engine's staged hook panicked: {e}")));
        let seconds = t.elapsed().as_secs_f64();
        match res {
            Ok(()) => tracing::info!(
                worker = self.cfg.worker_id,
                label,
                seconds,
                "the engine prepared the staged version"
            ),
            Err(e) => tracing::warn!(
                worker = self.cfg.worker_id,
                label,
                seconds,
                "the engine could not prepare the staged version (it installs without): {e}"
            ),
        }
    }

    /// Stages version `label` (`digest`): reported at once when it is already live or retained
    /// (the digests are of those bytes; applying it needs no pull), otherwise planned, pulled
    /// and verified into staging. Live weights are not touched.
    ///
    /// # Errors
    /// [`Error::Control`] fetching the manifests; planning, NIXL and verification errors.
    pub async fn stage(&self, label: &str, digest: Digest) -> Result<StageReport, Error> {
        if let Some(ranks) = self.inst.stage_resident(digest).await? {
            tracing::info!(
                worker = self.cfg.worker_id,
                label,
                "version already resident (live or pinned): staged without pulling"
            );
            return Ok(StageReport {
                digests: ranks,
                resident: true,
                ..StageReport::default()
            });
        }
        let t = Instant::now();
        // Only what this worker's plan reads, with the proof that it is the version's.
        let want = self.inst.want().await?;
        let info = self.client().get_version_for(label, &want).await?;
        tracing::info!(
            label,
            fetch_s = t.elapsed().as_secs_f64(),
            manifests = info.manifests.len(),
            shards = info.manifests.iter().map(|m| m.shards.len()).sum::<usize>(),
            "fetched the manifests this worker's plan reads"
        );
        // A join: the fleet committed this version before (workers hold it and serve it as
        // peers; its record says so, no fleet-wide status needed).
        let joining = info.state == mx_control::VersionState::Committed;
        crate::sources::stage_from_any(&self.inst, label, digest, info, joining).await
    }
}
