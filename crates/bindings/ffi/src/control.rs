//! `mx_control`: the orchestrator's client of the control plane (declare, refit, status), and
//! `mx_control_plane`: a control plane running in this process.

use std::ffi::c_char;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mx_control::client::ControlClient;
use mx_control::{ControlPlaneConfig, GenerationCheck, Outcome, RefitSpec, ServerHandle};

use crate::model::{free_handle, write_handle, Model};
use crate::util::{
    self, call, call_void, cstr, millis_or, parse_layout, runtime, slice, write_opt_string,
    write_out, write_string, FfiError,
};
use crate::{Status, MX_ERR_INTERNAL, MX_ERR_TIMEOUT};

/// How a refit ended (`mx_control_refit`): one of the `MX_REFIT_*` values.
pub type RefitOutcome = i32;

/// Every worker of the set runs the version; rollouts admitted.
pub const MX_REFIT_COMMITTED: RefitOutcome = 0;
/// Failed before any apply: every worker kept its version.
pub const MX_REFIT_ABORTED: RefitOutcome = 1;
/// Failed after some applies: every worker is back on its previous version.
pub const MX_REFIT_ROLLED_BACK: RefitOutcome = 2;
/// A worker could not be brought back in time and stays gated until refitted again; the
/// others are consistent.
pub const MX_REFIT_FENCED: RefitOutcome = 3;

/// A client of one control plane (the orchestrator's side). Thread-safe: calls may come from
/// several threads at once (they do not serialize; a refit blocks only its caller).
#[derive(Debug)]
pub struct Control {
    client: ControlClient,
}

/// A control plane running in this process (gRPC server, journal, refit driver) on the
/// library's runtime. Freeing it stops it.
pub struct ControlPlane {
    handle: Mutex<Option<ServerHandle>>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane").finish_non_exhaustive()
    }
}

/// Starts a control plane in this process, listening on `listen` (`"127.0.0.1:0"` picks a
/// free port) with its durable journal at `journal_path` (created if missing, replayed if
/// present). Writes its URL (`"http://127.0.0.1:PORT"`) to `*url` when not NULL (free it with
/// `mx_string_free`). Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, a bad address), `MX_ERR_CONTROL` (cannot bind, a
/// corrupt journal).
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` and `url` are NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_control_plane_start(
    listen: *const c_char,
    journal_path: *const c_char,
    out: *mut *mut ControlPlane,
    url: *mut *mut c_char,
) -> Status {
    call("mx_control_plane_start", || {
        // SAFETY: the caller's contract.
        let listen = unsafe { cstr(listen, "listen") }?;
        // SAFETY: the caller's contract.
        let journal = unsafe { cstr(journal_path, "journal_path") }?;
        let addr: std::net::SocketAddr = listen
            .parse()
            .map_err(|e| FfiError::arg("listen", format!("{listen:?}: {e}")))?;
        if out.is_null() {
            return Err(FfiError::arg("out", "NULL output pointer"));
        }
        let (bound, handle) = runtime()?.block_on(mx_control::spawn(ControlPlaneConfig {
            compaction: Default::default(),
            listen: addr,
            journal_path: journal.into(),
            security: mx_control::Security::insecure_loopback(),
        }))?;
        let plane = ControlPlane {
            handle: Mutex::new(Some(handle)),
        };
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, plane) }?;
        // SAFETY: the caller's contract.
        unsafe { write_opt_string(url, Some(&format!("http://{bound}"))) }
    })
}

/// Stops a control plane started by `mx_control_plane_start` (waits until its journal is
/// closed) and frees it. NULL is ignored.
///
/// # Safety
/// `plane` is NULL or a live control plane, with no call on it in flight.
#[no_mangle]
pub unsafe extern "C" fn mx_control_plane_free(plane: *mut ControlPlane) {
    call_void("mx_control_plane_free", || {
        if plane.is_null() {
            return;
        }
        // SAFETY: the caller's contract.
        let h = unsafe { &*plane };
        let handle = h
            .handle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let (Some(handle), Ok(rt)) = (handle, runtime()) {
            if let Err(e) = rt.block_on(handle.shutdown()) {
                tracing::warn!(error = %e, "control plane stopped with an error");
            }
        }
        // SAFETY: the caller's contract.
        unsafe { free_handle(plane) }
    });
}

/// Connects to the control plane at `addr` (`"http://host:port"` or `"host:port"`). Blocks
/// until connected. Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, malformed), `MX_ERR_CONTROL` (unreachable).
///
/// # Safety
/// `addr` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_control_connect(addr: *const c_char, out: *mut *mut Control) -> Status {
    call("mx_control_connect", || {
        // SAFETY: the caller's contract.
        let addr = unsafe { cstr(addr, "addr") }?;
        if out.is_null() {
            return Err(FfiError::arg("out", "NULL output pointer"));
        }
        let client = runtime()?.block_on(ControlClient::connect(addr))?;
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, Control { client }) }
    })
}

/// Declares version `label`: source slots `0..N` of trainer layout `trainer_layout` (e.g.
/// `"fsdp:2"`: two publishers) and the model's tensors. Idempotent when identical. Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, a bad layout), `MX_ERR_CONTROL` (declared
/// differently before, or refused).
///
/// # Safety
/// `control` and `model` are NULL or live; strings are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_control_declare(
    control: *const Control,
    label: *const c_char,
    trainer_layout: *const c_char,
    model: *const Model,
) -> Status {
    call("mx_control_declare", || {
        // SAFETY: the caller's contract (this and the calls below).
        let c = unsafe { util::handle(control, "control") }?;
        // SAFETY: as above.
        let label = unsafe { cstr(label, "label") }?;
        // SAFETY: as above.
        let layout = parse_layout(
            unsafe { cstr(trainer_layout, "trainer_layout") }?,
            "trainer_layout",
        )?;
        // SAFETY: as above.
        let model = unsafe { util::handle(model, "model") }?;
        runtime()?.block_on(c.client.declare_version(label, layout, &model.info.tensors))?;
        Ok(())
    })
}

/// The state of version `label` (`"DECLARED"`, `"PUBLISHING"`, `"READY"`, `"COMMITTED"`, ...)
/// and its id (`"mx:<hex>"`, once READY; NULL before). Each output that is not NULL receives
/// an owned string (free it with `mx_string_free`). Thread-safe.
///
/// Errors: `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_CONTROL`.
///
/// # Safety
/// `control` is NULL or live; `label` is NULL or NUL-terminated; outputs are NULL or valid for
/// a write.
#[no_mangle]
pub unsafe extern "C" fn mx_control_version(
    control: *const Control,
    label: *const c_char,
    state: *mut *mut c_char,
    version_id: *mut *mut c_char,
) -> Status {
    call("mx_control_version", || {
        // SAFETY: the caller's contract.
        let c = unsafe { util::handle(control, "control") }?;
        // SAFETY: the caller's contract.
        let label = unsafe { cstr(label, "label") }?;
        let info = runtime()?.block_on(c.client.get_version(label))?;
        let id = info
            .version_digest
            .map(|d| mx_layout::VersionId(d).to_string());
        // SAFETY: the caller's contract (each output).
        unsafe {
            write_opt_string(state, Some(&info.state.to_string()))?;
            write_opt_string(version_id, id.as_deref())
        }
    })
}

fn outcome_code(o: Outcome) -> RefitOutcome {
    match o {
        Outcome::Committed => MX_REFIT_COMMITTED,
        Outcome::Aborted => MX_REFIT_ABORTED,
        Outcome::RolledBack => MX_REFIT_ROLLED_BACK,
        Outcome::Fenced => MX_REFIT_FENCED,
    }
}

/// Refits workers `worker_ids[0..n_workers]` to version `label` (READY) and blocks until the
/// refit ended: STAGE on every worker, then the safe point (pause), APPLY, read-back, RESUME,
/// CHECK and COMMIT, or ABORT / ROLLBACK. `check` != 0 runs a post-update generation on every
/// worker (one token; it only has to succeed; engines that declared no model skip it).
/// `timeout_ms` bounds the wait (0: 600 s); the refit's own deadlines are the control plane's
/// defaults. On `MX_OK` the refit ended: `*outcome` is one of `MX_REFIT_*` (COMMITTED or not),
/// and `*result_json` (when not NULL; free it with `mx_string_free`) is the refit's record
/// (phases, per-worker calls and timings, `reason` when it did not commit). Thread-safe
/// (blocks).
///
/// Errors: `MX_ERR_TIMEOUT` (not ended in time: it goes on), `MX_ERR_UNKNOWN_VERSION`,
/// `MX_ERR_CONTROL` (refused: another refit is open, the version is not READY, ...).
///
/// # Safety
/// `control` is NULL or live; `label` is NULL or NUL-terminated; `worker_ids` points to
/// `n_workers` NUL-terminated strings; outputs are NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_control_refit(
    control: *const Control,
    label: *const c_char,
    worker_ids: *const *const c_char,
    n_workers: usize,
    check: i32,
    timeout_ms: u64,
    outcome: *mut RefitOutcome,
    result_json: *mut *mut c_char,
) -> Status {
    call("mx_control_refit", || {
        // SAFETY: the caller's contract (this and the calls below).
        let c = unsafe { util::handle(control, "control") }?;
        // SAFETY: as above.
        let label = unsafe { cstr(label, "label") }?;
        // SAFETY: as above.
        let ptrs = unsafe { slice(worker_ids, n_workers, "worker_ids") }?;
        let mut workers = Vec::with_capacity(ptrs.len());
        for (i, &p) in ptrs.iter().enumerate() {
            // SAFETY: as above: each entry is a NUL-terminated string.
            workers.push(unsafe { cstr(p, &format!("worker_ids[{i}]")) }?.to_string());
        }
        if outcome.is_null() {
            return Err(FfiError::arg("outcome", "NULL output pointer"));
        }
        let spec = RefitSpec {
            no_check: false,
            label: label.to_string(),
            worker_ids: workers,
            pause_mode: mx_control::PauseMode::Wait,
            allow_partial: false,
            check: (check != 0).then(|| GenerationCheck::tokens(vec![1], 1, Vec::new())),
            framework_step: 0,
            stage_timeout_ms: 0,
            call_timeout_ms: 0,
            apply_parallelism: 0,
            orchestrator_gated: false,
            verify_from_apply_answer: false,
        };
        let rt = runtime()?;
        let wait = millis_or(timeout_ms, Duration::from_secs(600));
        let refit = rt.block_on(async {
            let id = c.client.refit(&spec).await?;
            let deadline = Instant::now() + wait;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let (ended, r) = c
                    .client
                    .wait_refit(id, left.min(Duration::from_secs(30)))
                    .await?;
                if ended {
                    return Ok(r);
                }
                if Instant::now() >= deadline {
                    return Err(FfiError::new(
                        MX_ERR_TIMEOUT,
                        format!("refit {id} to {label:?} did not end within {wait:?}"),
                    ));
                }
            }
        })?;
        let refit = refit.ok_or_else(|| FfiError::new(MX_ERR_INTERNAL, "the refit vanished"))?;
        let code = refit.outcome.map_or(MX_REFIT_ABORTED, outcome_code);
        let json = serde_json::to_string(&refit)
            .map_err(|e| FfiError::new(MX_ERR_INTERNAL, e.to_string()))?;
        // SAFETY: the caller's contract (each output).
        unsafe {
            write_out(outcome, code, "outcome")?;
            write_opt_string(result_json, Some(&json))
        }
    })
}

/// Publishes the outputs version `label`'s trainer expects of it, for the post-update check of
/// every later refit of it: `json` is `{"probes": [{"prompt_tokens": [u32], "tokens": [u32],
/// "margins": [f32], "logprobs": [f32]}], "max_new_tokens": u32, "tie_margin": f32}` (1 to 16
/// probes; `tokens` the trainer's greedy continuation of `prompt_tokens`, at most
/// `max_new_tokens`; `margins` per token `log p(top1) - log p(top2)` in nats, where a first
/// difference below `tie_margin` is accepted (0 with margins: 0.25); `logprobs` per token,
/// reported only; `margins` and `logprobs` may be omitted). Journaled once per version: the same
/// outputs again are a no-op. Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, JSON that does not parse, unknown or duplicate keys,
/// a field out of its bounds, named), `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_CONTROL` (other outputs
/// were published for it already, or refused).
///
/// # Safety
/// `control` is NULL or live; `label` and `json` are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_control_publish_expected_outputs(
    control: *const Control,
    label: *const c_char,
    json: *const c_char,
) -> Status {
    call("mx_control_publish_expected_outputs", || {
        // SAFETY: the caller's contract (this and the calls below).
        let c = unsafe { util::handle(control, "control") }?;
        // SAFETY: as above.
        let label = unsafe { cstr(label, "label") }?;
        // SAFETY: as above.
        let text = unsafe { cstr(json, "json") }?;
        let outputs: GenerationCheck =
            serde_json::from_str(text).map_err(|e| FfiError::arg("json", e))?;
        if let Err((field, reason)) = outputs.validate() {
            return Err(FfiError::arg(&format!("json.{field}"), reason));
        }
        runtime()?.block_on(c.client.publish_expected_outputs(label, &outputs))?;
        Ok(())
    })
}

/// The fleet's status as JSON (versions with state, id, slots and sources: publishers with
/// their liveness `live`/`silent`/`unknown`, peers, artifacts, release; workers with layout,
/// ranks, state, resident version and its label, connection, admission and its `gate`; the
/// committed version as `{label, version_id}`; the open refit), written to `*json` (free it
/// with `mx_string_free`). Thread-safe.
///
/// Errors: `MX_ERR_CONTROL`.
///
/// # Safety
/// `control` is NULL or live; `json` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_control_status(
    control: *const Control,
    json: *mut *mut c_char,
) -> Status {
    call("mx_control_status", || {
        // SAFETY: the caller's contract.
        let c = unsafe { util::handle(control, "control") }?;
        let s = runtime()?.block_on(c.client.get_status())?;
        let v = serde_json::json!({
            "versions": s.versions.iter().map(|v| serde_json::json!({
                "label": v.label,
                "state": v.state.to_string(),
                "version_id": v.version_digest.map(|d| mx_layout::VersionId(d).to_string()),
                "slots": v.slots,
                "publishers": v.publishers,
                "peers": v.peers,
                "artifacts": v.artifacts,
                "release": v.release.as_ref().map(ToString::to_string),
            })).collect::<Vec<_>>(),
            "workers": s.workers.iter().map(|w| serde_json::json!({
                "worker_id": w.worker_id,
                "layout": w.layout.to_string(),
                "ranks": w.ranks,
                "state": format!("{:?}", w.state),
                "resident_id": w.resident_id,
                "resident_label": w.resident_label,
                "last_error": w.last_error,
                "connected": w.connected,
                "admitted": w.admitted,
                "gate": w.gate,
                "admission": w.admission,
            })).collect::<Vec<_>>(),
            "fleet_version": s.fleet_version,
            "open_refit": s.open_refit,
        });
        // SAFETY: the caller's contract.
        unsafe { write_string(json, &v.to_string(), "json") }
    })
}

/// Frees a control-plane client. NULL is ignored.
///
/// # Safety
/// `control` is NULL or a live client, with no call on it in flight.
#[no_mangle]
pub unsafe extern "C" fn mx_control_free(control: *mut Control) {
    call_void("mx_control_free", || {
        let _guard = runtime().ok().map(|rt| rt.enter());
        // SAFETY: the caller's contract.
        unsafe { free_handle(control) }
    });
}
