//! Observability: Prometheus metrics and the HTTP probes of the control plane and the workers.
//!
//! mx records through the [`metrics`] facade (counters, gauges and histograms with low-cardinality
//! labels only: phase, outcome, action, method, code, never a worker id or a version label, so
//! that a 10,000-worker fleet exports the same number of series as a 3-worker one).
//! [`install`] sets metrics-exporter-prometheus as the process-wide recorder; [`router`] serves
//! it in the Prometheus text format (version 0.0.4) at `GET /metrics`, with `GET /health`
//! (liveness: 200 while the process serves) and `GET /ready` (readiness: 200 once it can do its
//! work, 503 with the reason otherwise), the probe convention of Kubernetes.
//!
//! A process that installed another `metrics` recorder first (an application embedding mx with
//! its own exporter) keeps it: mx's metrics then go to that recorder, and `/metrics` answers 503.
//!
//! Every metric name is a constant here; units are in the names (`_seconds`, `_bytes`), as the
//! Prometheus naming convention asks.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::sync::oneshot;

use crate::Error;

/// Refit phase durations (histogram, seconds; label `phase`: stage, prepare, apply, verify,
/// resume, check, commit, abort, rollback). A phase ends when the next begins or the refit ends.
pub const REFIT_PHASE_SECONDS: &str = "mx_refit_phase_seconds";
/// Whole refits, BEGIN to END (histogram, seconds; label `outcome`).
pub const REFIT_SECONDS: &str = "mx_refit_seconds";
/// Refits ended (counter; label `outcome`: committed, aborted, rolled_back, fenced).
pub const REFITS_TOTAL: &str = "mx_refits_total";
/// Engine calls made by refits (counter; labels `action`: pause, apply, read_version, resume,
/// generate; `result`: ok, failed).
pub const ENGINE_CALLS_TOTAL: &str = "mx_engine_calls_total";
/// Engines asked whose they are before a refit's first call to them (counter; label `result`:
/// proven, not_offered (no identity route: called on the strength of the address), refused
/// (the engine named another worker: nothing was sent to it)).
pub const ENGINE_PROOFS_TOTAL: &str = "mx_engine_proofs_total";
/// Engines read back after a refit reached an address they share with an engine it called
/// (counter; label `result`: read (journaled; the worker is admitted if it is the fleet's
/// version), failed (unreachable, or no read-back in its contract: the worker stays gated)).
pub const ENGINE_READ_BACKS_TOTAL: &str = "mx_engine_read_backs_total";
/// Engine call latency (histogram, seconds; label `action`).
pub const ENGINE_CALL_SECONDS: &str = "mx_engine_call_seconds";
/// Verification failures (counter; label `check`: `version` when a worker's resident version
/// read back at VERIFY is not the target, `generation` when the post-update generation does not
/// give the expected tokens, `stage` when a worker's staged bytes failed their digests).
pub const VERIFICATION_FAILURES_TOTAL: &str = "mx_verification_failures_total";
/// RPCs received (counter; label `method`, `unknown` for a path not in the service).
pub const RPC_REQUESTS_TOTAL: &str = "mx_rpc_requests_total";
/// RPCs answered with an error (counter; labels `method` and `code`, the gRPC code name, e.g.
/// `unauthenticated`, `permission_denied`, `failed_precondition`).
pub const RPC_ERRORS_TOTAL: &str = "mx_rpc_errors_total";
/// Journal bytes written (counter, bytes).
pub const JOURNAL_BYTES_TOTAL: &str = "mx_journal_bytes_total";
/// Journal group commits (counter; one write and one fdatasync each).
pub const JOURNAL_SYNCS_TOTAL: &str = "mx_journal_syncs_total";
/// Journal compactions into a snapshot (counter).
pub const JOURNAL_COMPACTIONS_TOTAL: &str = "mx_journal_compactions_total";
/// Journal group-commit latency, write + fdatasync (histogram, seconds).
pub const JOURNAL_SYNC_SECONDS: &str = "mx_journal_sync_seconds";
/// Registered workers (gauge; label `state`: the stage state, e.g. idle, staged, failed).
pub const WORKERS: &str = "mx_workers";
/// Registered workers with a command stream open now (gauge).
pub const WORKERS_CONNECTED: &str = "mx_workers_connected";
/// Connected workers admitted to rollouts (gauge).
pub const WORKERS_ADMITTED: &str = "mx_workers_admitted";
/// Registered workers not admitted, by why (gauge; label `reason`: a [`crate::Gate`] name:
/// in_refit, departed, engine_unread, fenced, no_weights, stale, disconnected). Each worker is
/// counted once, under the first gate [`crate::state::State::gate`] finds (disconnected only
/// when nothing else holds it).
pub const WORKERS_GATED: &str = "mx_workers_gated";
/// Publishers of the versions not yet released, by liveness (gauge; label `liveness`: live,
/// silent, unknown; see [`crate::Liveness`]).
pub const PUBLISHERS: &str = "mx_publishers";
/// Versions (gauge; label `state`: declared, ready, committed, ...).
pub const VERSIONS: &str = "mx_versions";
/// 1 while a refit is open, else 0 (gauge).
pub const REFIT_OPEN: &str = "mx_refit_open";

/// Bytes a worker staged (counter, bytes; label `source`: trainer, peer, artifact).
pub const STAGE_BYTES_TOTAL: &str = "mx_stage_bytes_total";
/// Stage durations, command to staged and verified (histogram, seconds; label `result`: ok,
/// failed).
pub const STAGE_SECONDS: &str = "mx_stage_seconds";
/// Throughput of the last stage (gauge, gigabytes per second, 10^9 bytes).
pub const STAGE_GBPS: &str = "mx_stage_gigabytes_per_second";
/// Stage failures (counter; label `kind`: the error kind).
pub const STAGE_FAILURES_TOTAL: &str = "mx_stage_failures_total";
/// Applies of a staged version into the live weights (histogram, seconds; label `result`).
pub const APPLY_SECONDS: &str = "mx_apply_seconds";

/// Histogram buckets (seconds) for every `_seconds` metric: 1 ms to 10 min.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process-wide `metrics` recorder (once; later calls
/// return the same handle) and starts its upkeep thread (drains histogram samples every 5 s
/// so memory stays bounded without scrapes). `None` when another recorder was installed first.
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .ok()?;
            match builder.install_recorder() {
                Ok(h) => {
                    let upkeep = h.clone();
                    let spawned = std::thread::Builder::new()
                        .name("mx-metrics-upkeep".into())
                        .spawn(move || loop {
                            std::thread::sleep(Duration::from_secs(5));
                            upkeep.run_upkeep();
                        });
                    if let Err(e) = spawned {
                        tracing::warn!("metrics upkeep thread: {e}");
                    }
                    describe();
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!("Prometheus recorder not installed ({e}): /metrics answers 503");
                    None
                }
            }
        })
        .as_ref()
}

/// The `# HELP` text of every metric (the doc comments above, in brief).
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        REFIT_PHASE_SECONDS,
        Unit::Seconds,
        "Refit phase durations by phase"
    );
    describe_histogram!(
        REFIT_SECONDS,
        Unit::Seconds,
        "Refits, BEGIN to END, by outcome"
    );
    describe_counter!(REFITS_TOTAL, "Refits ended, by outcome");
    describe_counter!(
        ENGINE_CALLS_TOTAL,
        "Engine calls of refits, by action and result"
    );
    describe_counter!(
        ENGINE_PROOFS_TOTAL,
        "Engines asked whose they are before a refit called them, by result"
    );
    describe_counter!(
        ENGINE_READ_BACKS_TOTAL,
        "Engines read back after a refit reached an address they share, by result"
    );
    describe_histogram!(
        ENGINE_CALL_SECONDS,
        Unit::Seconds,
        "Engine call latency by action"
    );
    describe_counter!(
        VERIFICATION_FAILURES_TOTAL,
        "Verification failures: version read back, post-update generation, staged digests"
    );
    describe_counter!(RPC_REQUESTS_TOTAL, "Control-plane RPCs received, by method");
    describe_counter!(
        RPC_ERRORS_TOTAL,
        "Control-plane RPCs answered with an error, by method and gRPC code"
    );
    describe_counter!(JOURNAL_BYTES_TOTAL, Unit::Bytes, "Journal bytes written");
    describe_counter!(
        JOURNAL_SYNCS_TOTAL,
        "Journal group commits (one fdatasync each)"
    );
    describe_counter!(
        JOURNAL_COMPACTIONS_TOTAL,
        "Journal compactions into a snapshot"
    );
    describe_histogram!(
        JOURNAL_SYNC_SECONDS,
        Unit::Seconds,
        "Journal group commit latency"
    );
    describe_gauge!(WORKERS, "Registered workers by stage state");
    describe_gauge!(
        WORKERS_CONNECTED,
        "Registered workers with a command stream open"
    );
    describe_gauge!(WORKERS_ADMITTED, "Connected workers admitted to rollouts");
    describe_gauge!(WORKERS_GATED, "Workers not admitted, by the first reason");
    describe_gauge!(PUBLISHERS, "Publishers of unreleased versions, by liveness");
    describe_gauge!(VERSIONS, "Versions by state");
    describe_gauge!(REFIT_OPEN, "1 while a refit is open");
    describe_counter!(
        STAGE_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes staged by this worker, by source"
    );
    describe_histogram!(
        STAGE_SECONDS,
        Unit::Seconds,
        "Stages, command to staged and verified"
    );
    describe_gauge!(
        STAGE_GBPS,
        "Throughput of the last stage, GB/s (10^9 bytes)"
    );
    describe_counter!(STAGE_FAILURES_TOTAL, "Stage failures by error kind");
    describe_histogram!(
        APPLY_SECONDS,
        Unit::Seconds,
        "Applies into the live weights, by result"
    );
}

/// What a process reports at its probes: readiness (`Err(reason)` answers 503 at `/ready`) and
/// gauges to set just before each `/metrics` render (values that are cheaper to read on demand
/// than to keep current, e.g. counts over the fleet).
pub trait Probe: Send + Sync + 'static {
    /// `Ok` when the process can do its work now; otherwise why not.
    ///
    /// # Errors
    /// The reason it is not ready, answered as the 503 body.
    fn ready(&self) -> Result<(), String>;
    /// Sets scrape-time gauges (called before each render).
    fn refresh(&self) {}
}

/// `GET /metrics`, `GET /health` and `GET /ready` over `probe` (the routes are unauthenticated,
/// as probes and scrapers expect; they expose counts and durations only, no ids, labels,
/// manifests or metadata).
pub fn router(probe: Arc<dyn Probe>) -> Router {
    install();
    let ready = Arc::clone(&probe);
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route(
            "/ready",
            get(move || async move {
                match ready.ready() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()).into_response(),
                    Err(why) => {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || async move { metrics_page(&*probe) }),
        )
}

fn metrics_page(probe: &dyn Probe) -> Response {
    let Some(h) = HANDLE.get().and_then(Option::as_ref) else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "another metrics recorder is installed in this process\n",
        )
            .into_response();
    };
    probe.refresh();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        h.render(),
    )
        .into_response()
}

/// An HTTP server of [`router`] routes running in a background task.
#[derive(Debug)]
pub struct ProbeServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl ProbeServer {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ProbeServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Binds `addr` (port 0 picks one) and serves `router` until the returned server is dropped.
///
/// # Errors
/// [`Error::Bind`] when the address cannot be bound.
pub async fn serve(addr: SocketAddr, router: Router) -> Result<ProbeServer, Error> {
    let (listener, bound) = crate::server::bind(addr).await?;
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let res = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = res {
            tracing::error!("probe server on {bound} failed: {e}");
        }
    });
    Ok(ProbeServer {
        addr: bound,
        stop: Some(stop),
    })
}

/// The gRPC code's name in snake case (`PermissionDenied` -> `permission_denied`), as a label.
pub(crate) fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// Fleet counts for metrics ([`crate::state::State::tallies`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tallies {
    /// Registered workers by stage state.
    pub workers: std::collections::BTreeMap<crate::types::WorkerState, usize>,
    /// Registered workers with a command stream open.
    pub connected: usize,
    /// Connected workers admitted to rollouts.
    pub admitted: usize,
    /// Every other registered worker, by its first gate.
    pub gated: std::collections::BTreeMap<crate::types::Gate, usize>,
    /// Versions by state.
    pub versions: std::collections::BTreeMap<crate::types::VersionState, usize>,
    /// A refit is open.
    pub refit_open: bool,
}
