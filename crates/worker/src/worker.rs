//! The control-plane side of a worker: registration, the command stream and reconnection.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use mx_control::client::{CommandStream, ControlClient};
use mx_control::{Command, EngineApi, EngineEndpoint, Registration, StagedReport};
use mx_layout::{Digest, LayoutSpec};
use mx_nixl::Agent;

use crate::http::{self, HttpServer};
use crate::instance::{ApplySource, Instance, InstanceConfig};
use crate::staging::{StageOutcome, StageStats};
use crate::Error;

/// How long a worker keeps trying to reach a lost control plane, by default.
pub const DEFAULT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// First wait before a reconnect attempt; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between reconnect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How long the worker waits for the control plane's status after its stream ended, before it
/// decides the control plane went away (rather than another process took its id over).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What a worker needs to start.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Control plane address, `http://host:port`.
    pub control: String,
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
    /// How long to keep reconnecting to a lost control plane before giving up.
    pub reconnect_timeout: Duration,
    /// Checkpoint directory to load as the initial live weights, before registering.
    pub load: Option<PathBuf>,
    /// Version id of the initial weights (default `disk:<load>`).
    pub load_version: Option<String>,
}

/// One inference instance connected to the control plane.
pub struct Worker {
    cfg: WorkerConfig,
    inst: Instance,
    http: HttpServer,
    client: Mutex<ControlClient>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("worker_id", &self.cfg.worker_id)
            .field("http", &self.http.url())
            .finish_non_exhaustive()
    }
}

/// How a command stream ended.
enum StreamEnd {
    /// The server ended it (a newer stream of the same worker replaced it, or the server shut
    /// down gracefully).
    Closed,
    /// It failed (the connection broke: the control plane died).
    Failed(mx_control::Error),
}

impl Worker {
    /// Computes the layout of its ranks, creates the NIXL agent, loads `load` if given, starts
    /// the HTTP server and registers with the control plane (engine endpoint and resident
    /// version included).
    ///
    /// # Errors
    /// [`Error::Layout`] when the layout cannot place the model (e.g. tp=2 over 9 heads),
    /// [`Error::Nixl`] when NIXL is missing, errors of a disk apply for `load`,
    /// [`Error::Bind`], [`Error::Control`].
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
        let http = http::serve(inst.clone(), cfg.http).await?;
        tracing::info!(
            worker = cfg.worker_id,
            url = http.url(),
            "engine HTTP routes served"
        );
        let client = ControlClient::connect(&cfg.control).await?;
        register(&client, &cfg, &inst, &http).await?;
        tracing::info!(
            worker = cfg.worker_id,
            layout = %cfg.layout,
            ranks = ?cfg.ranks,
            resident = ?inst.resident_version(),
            "registered"
        );
        Ok(Worker {
            cfg,
            inst,
            http,
            client: Mutex::new(client),
        })
    }

    /// The base URL of the engine routes, `http://host:port`.
    pub fn http_url(&self) -> String {
        self.http.url()
    }

    /// The inference instance (version store, engine, gate).
    pub fn instance(&self) -> &Instance {
        &self.inst
    }

    fn client(&self) -> ControlClient {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Follows the command stream. When the stream breaks or ends (the control plane died,
    /// stopped or restarted), reconnects with backoff (100 ms
    /// doubling to 1 s): connect, re-register with the current resident version, watch again.
    ///
    /// # Errors
    /// [`Error::StreamClosed`] when the stream ended because another process registered with the
    /// same worker id (the control plane lists this id with another engine endpoint);
    /// [`Error::ReconnectTimeout`] when the control plane stayed unreachable for
    /// [`WorkerConfig::reconnect_timeout`]. Stage failures are reported to the control plane,
    /// not returned. (Applies do not come over the stream: a refit calls the engine routes.)
    pub async fn run(&self) -> Result<(), Error> {
        let first = self.client().watch_commands(&self.cfg.worker_id).await;
        let mut stream = match first {
            Ok(s) => s,
            Err(e) => self.reconnect(e.to_string()).await?,
        };
        loop {
            let why = match self.follow(&mut stream).await {
                StreamEnd::Closed => "the control plane ended the command stream".to_string(),
                StreamEnd::Failed(e) => e.to_string(),
            };
            if self.replaced().await {
                return Err(Error::StreamClosed {
                    worker_id: self.cfg.worker_id.clone(),
                });
            }
            tracing::warn!(
                worker = self.cfg.worker_id,
                "lost the control plane: {why}; reconnecting"
            );
            stream = self.reconnect(why).await?;
        }
    }

    /// Handles commands until the stream ends.
    async fn follow(&self, stream: &mut CommandStream) -> StreamEnd {
        loop {
            match stream.next().await {
                Ok(Some(cmd)) => self.handle(cmd).await,
                Ok(None) => return StreamEnd::Closed,
                Err(e) => return StreamEnd::Failed(e),
            }
        }
    }

    /// True when the control plane answers (within [`PROBE_TIMEOUT`]) that this worker id is
    /// now registered with another engine endpoint: a newer process took the id over, so this
    /// one must not re-register (the two would replace each other forever). No answer, or this
    /// worker's own registration, means the control plane went away or is restarting.
    async fn replaced(&self) -> bool {
        let probe = async {
            let c = ControlClient::connect(&self.cfg.control).await?;
            c.get_status().await
        };
        let Ok(Ok(status)) = tokio::time::timeout(PROBE_TIMEOUT, probe).await else {
            return false;
        };
        let mine = self.http.url();
        status
            .workers
            .iter()
            .find(|w| w.worker_id == self.cfg.worker_id)
            .is_some_and(|w| {
                w.engine.as_ref().map(|e| e.system_url.as_str()) != Some(mine.as_str())
            })
    }

    /// Connects, registers and opens the command stream, retrying with backoff until the
    /// reconnect timeout.
    async fn reconnect(&self, why: String) -> Result<CommandStream, Error> {
        let t0 = Instant::now();
        let limit = self.cfg.reconnect_timeout;
        let mut backoff = FIRST_BACKOFF;
        let mut last = why;
        loop {
            let left = limit.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return Err(Error::ReconnectTimeout {
                    worker_id: self.cfg.worker_id.clone(),
                    control: self.cfg.control.clone(),
                    seconds: limit.as_secs_f64(),
                    last_error: last,
                });
            }
            tokio::time::sleep(backoff.min(left)).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let attempt = async {
                let client = ControlClient::connect(&self.cfg.control).await?;
                register(&client, &self.cfg, &self.inst, &self.http).await?;
                let stream = client.watch_commands(&self.cfg.worker_id).await?;
                Ok::<_, Error>((client, stream))
            };
            let left = limit.saturating_sub(t0.elapsed()).max(FIRST_BACKOFF);
            match tokio::time::timeout(left, attempt).await {
                Ok(Ok((client, stream))) => {
                    *self.client.lock().unwrap_or_else(PoisonError::into_inner) = client;
                    tracing::warn!(
                        worker = self.cfg.worker_id,
                        after_s = t0.elapsed().as_secs_f64(),
                        resident = ?self.inst.resident_version(),
                        "reconnected and re-registered"
                    );
                    return Ok(stream);
                }
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "connecting timed out".into(),
            }
            tracing::debug!(
                worker = self.cfg.worker_id,
                "reconnect attempt failed: {last}"
            );
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
                    Ok((stats, strategies, ranks)) => {
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
                            ranks,
                            bytes: stats.useful_bytes,
                            descriptors: stats.descriptors,
                            seconds: t0.elapsed().as_secs_f64(),
                            strategies,
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

    /// Stages version `label` (`digest`): reported at once when it is already live or pinned
    /// (that copy becomes the staged one; the digests are of its live bytes), otherwise planned,
    /// pulled and verified into staging. Live weights are not touched.
    ///
    /// # Errors
    /// [`Error::Control`] fetching the manifests; planning, NIXL and verification errors.
    pub async fn stage(&self, label: &str, digest: Digest) -> Result<StageOutcome, Error> {
        if let Some(ranks) = self.inst.stage_resident(digest).await? {
            tracing::info!(
                worker = self.cfg.worker_id,
                label,
                "version already resident (live or pinned): staged without pulling"
            );
            return Ok((StageStats::default(), BTreeMap::new(), ranks));
        }
        let t = Instant::now();
        let info = self.client().get_version(label).await?;
        tracing::info!(
            label,
            fetch_s = t.elapsed().as_secs_f64(),
            "fetched manifests"
        );
        self.inst.stage(label, digest, info.manifests).await
    }
}

async fn register(
    client: &ControlClient,
    cfg: &WorkerConfig,
    inst: &Instance,
    http: &HttpServer,
) -> Result<(), Error> {
    client
        .register(&Registration {
            worker_id: cfg.worker_id.clone(),
            instance: cfg.instance.clone(),
            ranks: cfg.ranks.clone(),
            layout: cfg.layout,
            engine: Some(EngineEndpoint {
                api: cfg.engine_api,
                system_url: http.url(),
            }),
            resident_version: inst.resident_version(),
            model_limits: inst.model_limits(),
        })
        .await?;
    Ok(())
}
