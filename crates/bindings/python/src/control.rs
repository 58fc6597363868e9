//! The control plane embedded in a Python process, and the orchestrator's client.
//!
//! Every call that waits releases the GIL (`Python::detach`) and runs under a deadline; long
//! waits are cut into slices of at most [`WAIT_SLICE`] so that Ctrl-C (a pending Python signal)
//! ends them between slices.

use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mx_control::client::{ClientAuth, ControlClient as RustClient};
use mx_control::{
    ControlPlaneConfig, FleetStatus, GenerationCheck, PauseMode, RefitSpec, ServerHandle,
    VersionInfo, VersionState,
};
use mx_layout::LayoutSpec;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use crate::errors::{control_error, layout_error, mx_error};
use crate::{seconds, ForkSafe};

/// Longest single long poll of a wait; between slices pending Python signals are handled.
const WAIT_SLICE: Duration = Duration::from_secs(1);

/// Extra time a long-poll RPC gets beyond its server-side wait before the client gives up.
const POLL_SLACK: Duration = Duration::from_secs(10);

/// A multi-thread runtime with `workers` worker threads named `name`.
pub(crate) fn runtime(py: Python<'_>, name: &str, workers: usize) -> PyResult<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| mx_error(py, format!("starting the tokio runtime {name}: {e}"), None))
}

/// Refuses use of an object in a process other than the one that made it: after `fork` the
/// child has none of the parent's threads, so its runtime would never answer.
pub(crate) fn same_process(py: Python<'_>, pid: u32, what: &str) -> PyResult<()> {
    if std::process::id() == pid {
        return Ok(());
    }
    Err(mx_error(
        py,
        format!(
            "this {what} was created in process {pid} and cannot be used in process {} \
             (a fork child has none of its threads): create a new one here, or start child \
             processes with the 'spawn' method",
            std::process::id()
        ),
        Some("FailedPrecondition"),
    ))
}

/// A control plane that runs inside this Python process, on its own tokio runtime (two worker
/// threads named `mx-control`), until [`ControlPlane::stop`] or until the object is collected.
#[pyclass(module = "mx._mx", frozen)]
pub(crate) struct ControlPlane {
    running: Mutex<Option<Running>>,
    pid: u32,
    addr: SocketAddr,
    journal: PathBuf,
    tls: bool,
    metrics: Option<SocketAddr>,
}

struct Running {
    rt: Runtime,
    handle: ServerHandle,
    /// The `/metrics`, `/health`, `/ready` server, when asked for (stops when dropped).
    probes: Option<mx_control::observe::ProbeServer>,
}

impl Running {
    /// Stops the server: gracefully (connections are told to go away and finish their calls)
    /// for up to `grace`, then by cancelling its tasks. Either way the runtime is gone after.
    ///
    /// # Errors
    /// The error the server itself ended with (a journal or transport failure).
    fn stop(self, grace: Duration) -> Result<(), String> {
        let Running { rt, handle, probes } = self;
        drop(probes);
        // The timer must be created inside the runtime, hence the async block.
        let r = rt.block_on(async { tokio::time::timeout(grace, handle.shutdown()).await });
        rt.shutdown_timeout(Duration::from_secs(1));
        match r {
            // Not stopped within the grace period (a client in another process kept its
            // connection open): its tasks were cancelled with the runtime. The journal is
            // synced record by record, so nothing is lost.
            Ok(Ok(())) | Err(_) => Ok(()),
            Ok(Err(e)) => Err(crate::errors::chain(&e)),
        }
    }
}

fn listen_addr(listen: &str) -> PyResult<SocketAddr> {
    let bad = |why: String| {
        PyValueError::new_err(format!(
            "listen must be HOST:PORT (e.g. \"127.0.0.1:0\"; port 0 picks a free one), got {listen:?}: {why}"
        ))
    };
    listen
        .to_socket_addrs()
        .map_err(|e| bad(e.to_string()))?
        .next()
        .ok_or_else(|| bad("it resolves to no address".into()))
}

#[pymethods]
impl ControlPlane {
    /// Replays (or creates) the journal, binds `listen` and serves until stopped. Security as
    /// `mx control`'s flags (`Security::from_files`); without `tokens` it serves loopback only,
    /// unauthenticated (logged as a warning). `metrics`: `HOST:PORT` of the `/metrics`,
    /// `/health`, `/ready` server.
    #[new]
    #[pyo3(signature = (journal, listen = "127.0.0.1:0", *, tokens = None, tls_cert = None, tls_key = None, engine_token_file = None, metrics = None))]
    #[allow(clippy::too_many_arguments)] // reason: Python keyword arguments
    fn new(
        py: Python<'_>,
        journal: PathBuf,
        listen: &str,
        tokens: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        engine_token_file: Option<PathBuf>,
        metrics: Option<&str>,
    ) -> PyResult<ControlPlane> {
        let addr = listen_addr(listen)?;
        let metrics = metrics.map(listen_addr).transpose()?;
        let security = mx_control::Security::from_files(
            tokens.as_deref(),
            tls_cert.as_deref(),
            tls_key.as_deref(),
            tokens.is_none(),
            engine_token_file.as_deref(),
        )
        .map_err(|e| control_error(py, &e))?;
        let tls = security.tls.is_some();
        if journal.as_os_str().is_empty() {
            return Err(PyValueError::new_err(
                "journal must be a file path, got \"\"",
            ));
        }
        if let Some(dir) = journal.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                mx_error(
                    py,
                    format!("creating the journal directory {}: {e}", dir.display()),
                    None,
                )
            })?;
        }
        let rt = runtime(py, "mx-control", 2)?;
        let cfg = ControlPlaneConfig {
            compaction: Default::default(),
            listen: addr,
            journal_path: journal.clone(),
            security,
        };
        let started = py.detach(|| {
            rt.block_on(async {
                let (bound, handle) = mx_control::spawn(cfg).await?;
                let probes = match metrics {
                    Some(m) => Some(
                        mx_control::observe::serve(m, mx_control::observe::router(handle.probe()))
                            .await?,
                    ),
                    None => None,
                };
                Ok::<_, mx_control::Error>((bound, handle, probes))
            })
        });
        let (bound, handle, probes) = started.map_err(|e| control_error(py, &e))?;
        let metrics = probes.as_ref().map(mx_control::observe::ProbeServer::addr);
        Ok(ControlPlane {
            running: Mutex::new(Some(Running { rt, handle, probes })),
            pid: std::process::id(),
            addr: bound,
            journal,
            tls,
            metrics,
        })
    }

    /// `http://HOST:PORT` (`https://` with TLS), the URL clients connect to.
    #[getter]
    fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// `http://HOST:PORT/metrics` when started with `metrics`, else `None`.
    #[getter]
    fn metrics_url(&self) -> Option<String> {
        self.metrics.map(|m| format!("http://{m}/metrics"))
    }

    /// `HOST:PORT` actually bound.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// The journal file.
    #[getter]
    fn journal(&self) -> PathBuf {
        self.journal.clone()
    }

    /// True until `stop()`.
    #[getter]
    fn running(&self) -> bool {
        self.running.lock().map(|r| r.is_some()).unwrap_or(false)
    }

    /// Stops serving (open command streams and waits end), closes the journal and the runtime;
    /// connections still open after `timeout` seconds are cut. Idempotent.
    #[pyo3(signature = (timeout = 5.0))]
    fn stop(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        same_process(py, self.pid, "ControlPlane")?;
        let r = py.detach(|| {
            let running = match self.running.lock() {
                Ok(mut g) => g.take(),
                Err(poisoned) => poisoned.into_inner().take(),
            };
            running.map(|r| r.stop(timeout))
        });
        match r {
            None | Some(Ok(())) => Ok(()),
            Some(Err(msg)) => Err(mx_error(py, msg, Some("Internal"))),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.stop(py, 5.0)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "ControlPlane(url={:?}, journal={:?}, running={})",
            self.url(),
            self.journal.display().to_string(),
            if self.running() { "True" } else { "False" }
        )
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let running = match self.running.get_mut() {
            Ok(r) => r.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if std::process::id() != self.pid {
            // A fork child: the runtime's threads live only in the parent; stopping would hang.
            std::mem::forget(running);
        } else if let Some(r) = running {
            // Nobody can be told about a failure here; the journal is fsynced record by record.
            let _ = r.stop(Duration::from_secs(2));
        }
    }
}

/// The credentials of one client: `token`, the token in `token_file`, else the process's
/// (`MX_CONTROL_TOKEN` / `MX_CONTROL_TOKEN_FILE`); the CA from `MX_CONTROL_CA`.
pub(crate) fn client_auth(
    py: Python<'_>,
    token: Option<&str>,
    token_file: Option<&std::path::Path>,
) -> PyResult<ClientAuth> {
    ClientAuth::resolve(token, token_file).map_err(|e| control_error(py, &e))
}

/// The orchestrator's connection to a control plane (`mx.Control` wraps it).
///
/// It owns a tokio runtime with one worker thread (`mx-client`) that keeps its connection alive
/// between calls (HTTP/2 pings, and closing it when the control plane stops). Calls from several
/// Python threads at once are allowed. Not usable in a child created by `fork` (its thread
/// does not survive the fork): make a new client there.
#[pyclass(module = "mx._mx", frozen)]
pub(crate) struct ControlClient {
    // Dropped in this order: the channel, then the runtime it ran on.
    client: ForkSafe<RustClient>,
    rt: ForkSafe<Runtime>,
    url: String,
    timeout: Duration,
    pid: u32,
}

impl ControlClient {
    /// Runs `fut` with the GIL released, under `timeout`.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        timeout: Duration,
        fut: impl Future<Output = Result<T, mx_control::Error>> + Send,
    ) -> PyResult<T> {
        same_process(py, self.pid, "Control client")?;
        match py.detach(|| {
            self.rt
                .block_on(async { tokio::time::timeout(timeout, fut).await })
        }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(control_error(py, &e)),
            Err(_) => Err(mx_error(
                py,
                format!(
                    "{what}: no answer from the control plane at {} within {:.3} s",
                    self.url,
                    timeout.as_secs_f64()
                ),
                Some("DeadlineExceeded"),
            )),
        }
    }

    fn deadline(&self, timeout: Option<f64>) -> PyResult<Duration> {
        timeout.map_or(Ok(self.timeout), |t| seconds("timeout", t))
    }
}

fn check_label(label: &str) -> PyResult<()> {
    if label.is_empty() {
        return Err(PyValueError::new_err("label must be a non-empty string"));
    }
    Ok(())
}

fn version_state(s: &str) -> PyResult<VersionState> {
    Ok(match s.to_ascii_uppercase().as_str() {
        "DECLARED" => VersionState::Declared,
        "PUBLISHING" => VersionState::Publishing,
        "READY" => VersionState::Ready,
        "COMMITTING" => VersionState::Committing,
        "COMMITTED" => VersionState::Committed,
        _ => {
            return Err(PyValueError::new_err(format!(
                "state must be one of DECLARED, PUBLISHING, READY, COMMITTING, COMMITTED, got {s:?}"
            )))
        }
    })
}

fn digest_json(d: Option<mx_layout::Digest>) -> Value {
    d.map_or(Value::Null, |d| Value::String(d.to_string()))
}

fn fleet_json(s: &FleetStatus) -> Value {
    json!({
        "versions": s.versions.iter().map(|v| json!({
            "label": v.label,
            "state": v.state.to_string(),
            "version_digest": digest_json(v.version_digest),
            "slots": v.slots,
            "publishers": v.publishers,
            "peers": v.peers,
            "artifacts": v.artifacts,
            "release": v.release.as_ref().map(ToString::to_string),
        })).collect::<Vec<_>>(),
        "workers": s.workers.iter().map(|w| json!({
            "worker_id": w.worker_id,
            "instance": w.instance,
            "ranks": w.ranks,
            "layout": w.layout.to_string(),
            "state": w.state.to_string(),
            "label": w.label,
            "version_digest": digest_json(w.version_digest),
            "resident_id": w.resident_id,
            "last_error": w.last_error,
            "last_staged": w.last_staged,
            "engine": w.engine,
            "admitted": w.admitted,
            "admission": w.admission,
            "connected": w.connected,
            "gate": w.gate,
            "resident_label": w.resident_label,
        })).collect::<Vec<_>>(),
        "fleet_version": s.fleet_version,
        "open_refit": s.open_refit,
        "halted": s.halted,
    })
}

fn version_json(v: &VersionInfo) -> Value {
    json!({
        "label": v.label,
        "state": v.state.to_string(),
        "trainer_layout": v.trainer_layout.to_string(),
        "tensors": v.tensors.iter().map(|t| json!({
            "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape,
        })).collect::<Vec<_>>(),
        "version_digest": digest_json(v.version_digest),
        "published_slots": v.published_slots,
        "missing_slots": v.missing_slots,
        "missing_tensors": v.missing_tensors,
        "coverage_gaps": v.coverage_gaps,
        "manifests": v.manifests.len(),
        "commit_workers": v.commit_workers,
        "expected_outputs": v.expected_outputs,
        "artifacts": v.artifacts.iter().map(|a| json!({
            "url": a.url,
            "manifest_digest": a.manifest_digest.to_string(),
            "kind": a.kind,
            "base": a.base.map(|b| mx_layout::VersionId(b).to_string()),
        })).collect::<Vec<_>>(),
    })
}

fn json_text(py: Python<'_>, v: &Value) -> PyResult<String> {
    serde_json::to_string(v)
        .map_err(|e| mx_error(py, format!("encoding an answer as JSON: {e}"), None))
}

#[pymethods]
impl ControlClient {
    /// Connects to `url` (`http://HOST:PORT` or `HOST:PORT`) within `timeout` seconds; `timeout`
    /// is also the default deadline of every later call. `token` or `token_file` (one at most)
    /// override the process's `MX_CONTROL_TOKEN` / `MX_CONTROL_TOKEN_FILE` for this client.
    #[new]
    #[pyo3(signature = (url, timeout = 30.0, *, token = None, token_file = None))]
    fn new(
        py: Python<'_>,
        url: String,
        timeout: f64,
        token: Option<String>,
        token_file: Option<PathBuf>,
    ) -> PyResult<ControlClient> {
        let timeout = seconds("timeout", timeout)?;
        if url.is_empty() {
            return Err(PyValueError::new_err("url must be a non-empty string"));
        }
        let auth = client_auth(py, token.as_deref(), token_file.as_deref())?;
        let rt = runtime(py, "mx-client", 1)?;
        let connected = py.detach(|| {
            rt.block_on(async {
                tokio::time::timeout(timeout, RustClient::connect_with(&url, &auth)).await
            })
        });
        let client = match connected {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(control_error(py, &e)),
            Err(_) => {
                return Err(mx_error(
                    py,
                    format!(
                        "connecting to the control plane at {url}: no connection within {:.3} s",
                        timeout.as_secs_f64()
                    ),
                    Some("DeadlineExceeded"),
                ))
            }
        };
        Ok(ControlClient {
            client: ForkSafe::new(client),
            rt: ForkSafe::new(rt),
            url,
            timeout,
            pid: std::process::id(),
        })
    }

    /// The URL this client was made for.
    #[getter]
    fn url(&self) -> String {
        self.url.clone()
    }

    /// The default deadline of each call, seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// Declares version `label`: `tensors` as `(name, dtype, shape)` and the trainer layout
    /// (`"fsdp:N"`, `"tp:N"`, `"replicated:N"`; source slots `0..N`).
    #[pyo3(signature = (label, tensors, trainer_layout, timeout = None))]
    fn declare(
        &self,
        py: Python<'_>,
        label: String,
        tensors: Vec<(String, String, Vec<u64>)>,
        trainer_layout: &str,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        check_label(&label)?;
        let timeout = self.deadline(timeout)?;
        let layout: LayoutSpec = trainer_layout
            .parse()
            .map_err(|e| layout_error(py, "trainer_layout", &e))?;
        let specs = crate::model::tensor_specs(py, tensors)?;
        self.call(
            py,
            "DeclareVersion",
            timeout,
            self.client.declare_version(&label, layout, &specs),
        )
    }

    /// Everything known about version `label`, as JSON text.
    #[pyo3(signature = (label, timeout = None))]
    fn get_version(&self, py: Python<'_>, label: String, timeout: Option<f64>) -> PyResult<String> {
        check_label(&label)?;
        let timeout = self.deadline(timeout)?;
        let v = self.call(py, "GetVersion", timeout, self.client.get_version(&label))?;
        json_text(py, &version_json(&v))
    }

    /// Waits until version `label` reached `state` (or a later one), as JSON text.
    #[pyo3(signature = (label, state, timeout))]
    fn wait_version(
        &self,
        py: Python<'_>,
        label: String,
        state: &str,
        timeout: f64,
    ) -> PyResult<String> {
        check_label(&label)?;
        let wanted = version_state(state)?;
        let total = seconds("timeout", timeout)?;
        let deadline = Instant::now() + total;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE).max(Duration::from_millis(1));
            let r = self.call(
                py,
                "WaitVersion",
                slice + POLL_SLACK,
                self.client.wait_version(&label, wanted, slice),
            );
            match r {
                Ok(v) => return json_text(py, &version_json(&v)),
                Err(e) => {
                    let not_yet = e
                        .value(py)
                        .getattr("code")
                        .and_then(|c| c.extract::<String>())
                        .is_ok_and(|c| c == "DeadlineExceeded");
                    if !not_yet || Instant::now() >= deadline {
                        return Err(e);
                    }
                }
            }
            py.check_signals()?;
        }
    }

    /// All versions and workers, as JSON text (per-tensor digests of the last stage only
    /// with `digests`).
    #[pyo3(signature = (timeout = None, digests = false))]
    fn status(&self, py: Python<'_>, timeout: Option<f64>, digests: bool) -> PyResult<String> {
        let timeout = self.deadline(timeout)?;
        let s = self.call(
            py,
            "GetStatus",
            timeout,
            self.client.get_status_with(digests),
        )?;
        json_text(py, &fleet_json(&s))
    }

    /// Retires a departed worker id (see `ControlClient::retire_worker`).
    #[pyo3(signature = (worker_id, reason = "", timeout = None))]
    fn retire_worker(
        &self,
        py: Python<'_>,
        worker_id: String,
        reason: &str,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = self.deadline(timeout)?;
        self.call(
            py,
            "RetireWorker",
            timeout,
            self.client.retire_worker(&worker_id, reason),
        )
    }

    /// Accepts the journal as it stands after the fleet contradicted it (status's `halted`;
    /// see `ControlClient::accept_journal`): returns `{"accepted": [str], "resumed_refit": int
    /// | None}`.
    #[pyo3(signature = (reason, timeout = None))]
    fn accept_journal(
        &self,
        py: Python<'_>,
        reason: &str,
        timeout: Option<f64>,
    ) -> PyResult<String> {
        let timeout = self.deadline(timeout)?;
        let (accepted, resumed) = self.call(
            py,
            "AcceptJournal",
            timeout,
            self.client.accept_journal(reason),
        )?;
        json_text(py, &json!({"accepted": accepted, "resumed_refit": resumed}))
    }

    /// Publishes the outputs version `label`'s trainer expects of it (`check`: a check tuple,
    /// see `generation_check`); every refit of it then checks against them by default.
    #[pyo3(signature = (label, check, timeout = None))]
    fn publish_expected_outputs(
        &self,
        py: Python<'_>,
        label: String,
        check: CheckTuple,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        check_label(&label)?;
        let timeout = self.deadline(timeout)?;
        let outputs = generation_check(check)?;
        self.call(
            py,
            "PublishExpectedOutputs",
            timeout,
            self.client.publish_expected_outputs(&label, &outputs),
        )
    }

    /// Starts a refit and returns its id at once.
    #[pyo3(signature = (
        label, workers, *, pause_mode = "wait", allow_partial = false, check = None,
        no_check = false, framework_step = 0, stage_timeout = 300.0, call_timeout = 60.0,
        apply_parallelism = 0, orchestrator_gated = false, verify_from_apply_answer = false,
        timeout = None
    ))]
    #[allow(clippy::too_many_arguments)] // reason: mirrors RefitSpec's fields as keyword arguments
    fn start_refit(
        &self,
        py: Python<'_>,
        label: String,
        workers: Vec<String>,
        pause_mode: &str,
        allow_partial: bool,
        check: Option<CheckTuple>,
        no_check: bool,
        framework_step: u64,
        stage_timeout: f64,
        call_timeout: f64,
        apply_parallelism: u32,
        orchestrator_gated: bool,
        verify_from_apply_answer: bool,
        timeout: Option<f64>,
    ) -> PyResult<u64> {
        check_label(&label)?;
        let timeout = self.deadline(timeout)?;
        let pause_mode: PauseMode = pause_mode
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("pause_mode: {e}")))?;
        let ms = |name: &str, v: f64| -> PyResult<u64> {
            let d = seconds(name, v)?;
            Ok(u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1))
        };
        let check = check.map(generation_check).transpose()?;
        let spec = RefitSpec {
            no_check,
            label,
            worker_ids: workers,
            pause_mode,
            allow_partial,
            check,
            framework_step,
            stage_timeout_ms: ms("stage_timeout", stage_timeout)?,
            call_timeout_ms: ms("call_timeout", call_timeout)?,
            apply_parallelism,
            orchestrator_gated,
            verify_from_apply_answer,
        };
        self.call(py, "Refit", timeout, self.client.refit(&spec))
    }

    /// Waits up to `timeout` seconds for refit `refit_id` (0 = the latest) to end; returns its
    /// record as JSON text (with `"ended"`), or None when there is no such refit.
    #[pyo3(signature = (refit_id, timeout))]
    fn wait_refit(&self, py: Python<'_>, refit_id: u64, timeout: f64) -> PyResult<Option<String>> {
        let total = seconds("timeout", timeout)?;
        let deadline = Instant::now() + total;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE).max(Duration::from_millis(1));
            let (ended, refit) = self.call(
                py,
                "WaitRefit",
                slice + POLL_SLACK,
                self.client.wait_refit(refit_id, slice),
            )?;
            let Some(refit) = refit else {
                return Ok(None);
            };
            if ended || Instant::now() >= deadline {
                let mut v = serde_json::to_value(&refit)
                    .map_err(|e| mx_error(py, format!("encoding refit {refit_id}: {e}"), None))?;
                if let Value::Object(m) = &mut v {
                    m.insert("ended".into(), Value::Bool(ended));
                }
                return json_text(py, &v).map(Some);
            }
            py.check_signals()?;
        }
    }

    fn __repr__(&self) -> String {
        format!("Control(url={:?})", self.url)
    }
}

/// A post-update check as Python passes it: `(probes, max_new_tokens, tie_margin, source)`,
/// each probe `(prompt_tokens, tokens, margins, logprobs)`.
type CheckTuple = (Vec<ProbeTuple>, u32, f32, String);
type ProbeTuple = (Vec<u32>, Vec<u32>, Vec<f32>, Vec<f32>);

/// Builds and checks a post-update check from its Python form ([`CheckTuple`]).
///
/// # Errors
/// `ValueError` naming the field at fault (`check.probes[0].margins: ...`).
fn generation_check(c: CheckTuple) -> PyResult<GenerationCheck> {
    let (probes, max_new_tokens, tie_margin, source) = c;
    let check = GenerationCheck {
        probes: probes
            .into_iter()
            .map(
                |(prompt_tokens, tokens, margins, logprobs)| mx_control::Probe {
                    prompt_tokens,
                    tokens,
                    margins,
                    logprobs,
                },
            )
            .collect(),
        max_new_tokens,
        tie_margin,
        source,
    };
    check
        .validate()
        .map_err(|(field, reason)| PyValueError::new_err(format!("check.{field}: {reason}")))?;
    Ok(check)
}
