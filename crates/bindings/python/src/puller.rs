//! `mx._mx.Puller`: an inference rank staging versions into memory the engine owns (torch
//! tensors; `mx.Puller` in `python/mx/_puller.py` turns them into addresses, checks them
//! against the layout and keeps them alive), applying in place, and optionally served to the
//! control plane as a worker (`mx_follower::embedded`).
#![allow(
    clippy::result_large_err,
    reason = "mx_follower::Error crosses once per call, into a Python exception"
)]

use std::net::SocketAddr;
use std::sync::Arc;

use mx_control::{EngineApi, EngineEndpoint, EngineFrontend, ModelLimits};
use mx_follower::embedded::{EmbeddedConfig, EmbeddedPuller};
use mx_follower::StagedHook;
use mx_layout::{DType, LayoutSpec, SourceManifest, VersionId};
use mx_puller::{
    ApplyKind, ApplyReport, DestMemory, DestTensor, ExecOptions, HostRegion, StageReport,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use crate::control::runtime;
use crate::errors::{chain, control_error, layout_error, mx_error};
use crate::model::Model;
use crate::owned::Owned;

/// The `MxError` for an error of the embedded puller, with a gRPC-style code.
fn worker_error(py: Python<'_>, e: &mx_follower::Error) -> PyErr {
    use mx_follower::Error as E;
    let code = match e {
        E::Control(c) => return control_error(py, c),
        E::Puller(p) => puller_code(p),
        E::Layout(_) | E::Bind { .. } => Some("InvalidArgument"),
        E::UnknownVersionId { .. } => Some("NotFound"),
        E::NoControlPlane
        | E::VersionNotReady { .. }
        | E::NothingStaged
        | E::AlreadyServed
        | E::ServedPuller { .. } => Some("FailedPrecondition"),
        E::Displaced { .. } => Some("AlreadyExists"),
        _ => None,
    };
    mx_error(py, chain(e), code)
}

fn puller_code(e: &mx_puller::Error) -> Option<&'static str> {
    use mx_puller::Error as E;
    match e {
        E::UnknownVersion { .. } => Some("NotFound"),
        E::Unregistered { .. }
        | E::NoRollback { .. }
        | E::NoDataPlane
        | E::DestinationChanged { .. } => Some("FailedPrecondition"),
        E::BadDestination { .. } | E::UnknownRank { .. } | E::BadRanks { .. } | E::Layout(_) => {
            Some("InvalidArgument")
        }
        E::Verify { .. } | E::WrongManifests { .. } | E::Unproven { .. } | E::Incomplete { .. } => {
            Some("DataLoss")
        }
        E::SourceUnreachable { .. } | E::Pull { .. } => Some("Unavailable"),
        _ => None,
    }
}

fn stage_json(label: Option<&str>, id: VersionId, r: &StageReport) -> Value {
    json!({
        "label": label,
        "version_id": id.to_string(),
        "plan_s": r.plan_s,
        "plan_reused": r.plan_reused,
        "pull_s": r.pull_s,
        "verify_s": r.verify_s,
        "descriptors": r.descriptors,
        "wire_bytes": r.wire_bytes,
        "useful_bytes": r.useful_bytes,
        "staging_bytes": r.staging_bytes,
        "lanes": r.lanes,
        "strategies": r.strategies,
        "resident": r.resident,
        "digests": r.digests,
    })
}

fn apply_json(r: &ApplyReport) -> Value {
    let kind = match r.kind {
        ApplyKind::Staged => "staged",
        ApplyKind::Restored => "restored",
        ApplyKind::AlreadyResident => "already_resident",
        ApplyKind::Installed => "installed",
    };
    json!({
        "version_id": r.version,
        "kind": kind,
        "retained": r.retained,
        "retain_s": r.retain_s,
        "copy_s": r.copy_s,
    })
}

/// A registered tensor's host memory with the Python check that it is still there
/// (`mx._memory.check_unchanged`), run before every apply, rollback and digest read, including
/// those the control plane drives once the puller is served.
struct CheckedRegion {
    region: HostRegion,
    check: Py<PyAny>,
}

impl DestMemory for CheckedRegion {
    fn len(&self) -> u64 {
        self.region.len()
    }

    fn data_ptr(&self) -> u64 {
        self.region.data_ptr()
    }

    fn host(&self) -> Option<&[u8]> {
        self.region.host()
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        self.region.host_mut()
    }

    fn check(&self) -> Result<(), String> {
        Python::attach(|py| {
            self.check
                .call0(py)
                .map(|_| ())
                .map_err(|e| e.value(py).to_string())
        })
    }
}

/// A Python callable as the engine's [`StagedHook`]: called with the version id (`mx:<hex>`)
/// under the GIL; what it raises is the hook's error.
struct PyStagedHook(Py<PyAny>);

impl std::fmt::Debug for PyStagedHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PyStagedHook")
    }
}

impl StagedHook for PyStagedHook {
    fn staged(&self, version: VersionId) -> Result<(), String> {
        Python::attach(|py| {
            self.0
                .call1(py, (version.to_string(),))
                .map(|_| ())
                .map_err(|e| e.value(py).to_string())
        })
    }
}

/// An engine's puller on a tokio runtime of its own (two worker threads, `mx-puller`, which
/// also run the worker once served). Calls serialize; stage, apply and rollback block with
/// the GIL released.
#[pyclass(module = "mx._mx", frozen)]
pub(crate) struct Puller {
    owned: Owned<EmbeddedPuller>,
}

type One<'a> =
    Box<dyn FnOnce(&mut EmbeddedPuller, &Runtime) -> Result<Value, mx_follower::Error> + Send + 'a>;

impl Puller {
    /// Runs `f` on the puller with the GIL released; its JSON answer as text.
    fn call(&self, py: Python<'_>, f: One<'_>) -> PyResult<String> {
        let v = self.with(py, f)?;
        serde_json::to_string(&v).map_err(|e| mx_error(py, e.to_string(), Some("Internal")))
    }

    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut EmbeddedPuller, &Runtime) -> Result<T, mx_follower::Error> + Send,
    ) -> PyResult<T> {
        self.owned.with(py, f)?.map_err(|e| worker_error(py, &e))
    }
}

fn parse_id(py: Python<'_>, field: &str, s: &str) -> PyResult<VersionId> {
    s.parse().map_err(|e| layout_error(py, field, &e))
}

#[pymethods]
impl Puller {
    /// Creates the puller (a NIXL agent; with `control`, a connection, and with `worker_id`
    /// too, the layout registered under that id at once).
    #[new]
    #[pyo3(signature = (control, worker_id, layout, ranks, model, retain = true, retain_in_staging = false))]
    #[allow(clippy::too_many_arguments)] // the Python constructor's keyword arguments
    fn new(
        py: Python<'_>,
        control: Option<String>,
        worker_id: Option<String>,
        layout: &str,
        ranks: Vec<u32>,
        model: &Model,
        retain: bool,
        retain_in_staging: bool,
    ) -> PyResult<Puller> {
        let layout: LayoutSpec = layout.parse().map_err(|e| layout_error(py, "layout", &e))?;
        let rt = runtime(py, "mx-puller", 2)?;
        let cfg = EmbeddedConfig {
            control,
            worker_id,
            layout,
            ranks,
            model: model.info.clone(),
            retain,
            retain_in_staging,
            agent_prefix: "mx-python-puller".into(),
        };
        let p = py
            .detach(|| rt.block_on(EmbeddedPuller::connect(cfg)))
            .map_err(|e| worker_error(py, &e))?;
        Ok(Puller {
            owned: Owned::new(p, rt, "Puller"),
        })
    }

    /// The held ranks' layouts as JSON text: `[{"rank", "bytes", "params": [{"name", "dtype",
    /// "shape", "offset", "nbytes", "pieces": [{"tensor", "dtype", "global_shape",
    /// "box_offset", "box_shape", "offset"}]}]}]` (piece offsets are within the parameter).
    fn rank_layouts(&self, py: Python<'_>) -> PyResult<String> {
        self.call(
            py,
            Box::new(|p, _| {
                Ok(Value::Array(
                    p.rank_layouts()
                        .iter()
                        .map(crate::model::rank_layout_json)
                        .collect(),
                ))
            }),
        )
    }

    /// Registers `nbytes` of host memory at `addr` as parameter `name` of held rank `rank`.
    /// The Python layer keeps the owning object referenced for the puller's life and checks
    /// dtype, shape, contiguity and that the range lies in the object's storage first.
    ///
    /// `check` (no arguments) raises when the tensor's memory is no longer what was registered;
    /// the puller calls it before every write or read of the memory.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (rank, name, addr, nbytes, dtype, shape, check = None))]
    fn register_param(
        &self,
        py: Python<'_>,
        rank: u32,
        name: String,
        addr: u64,
        nbytes: u64,
        dtype: &str,
        shape: Vec<u64>,
        check: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let field = format!("rank {rank} parameter {name}");
        let dtype: DType = dtype
            .parse()
            .map_err(|e| layout_error(py, &format!("{field}: dtype"), &e))?;
        // SAFETY: `mx.Puller.register` (python/mx/_puller.py) passes the data pointer and size
        // of a tensor it keeps referenced until the puller is closed, after checking the range
        // lies inside the tensor's storage; not touching it during stage/apply/rollback is the
        // documented contract of `mx.Puller`.
        let region = unsafe { HostRegion::new(addr, nbytes) }
            .map_err(|e| PyValueError::new_err(format!("{field}: {e}")))?;
        let memory: Box<dyn DestMemory> = match check {
            Some(check) => Box::new(CheckedRegion { region, check }),
            None => Box::new(region),
        };
        self.with(py, move |p, _| {
            p.with(|p| {
                p.register_param(
                    rank,
                    &name,
                    DestTensor {
                        dtype,
                        shape,
                        memory,
                    },
                )
            })?
            .map_err(mx_follower::Error::from)
        })
    }

    /// Registers one host buffer laid out as the whole of held rank `rank`.
    fn register_rank(&self, py: Python<'_>, rank: u32, addr: u64, nbytes: u64) -> PyResult<()> {
        // SAFETY: as register_param: the Python layer keeps the owning object alive and
        // checked the range; the contract reserves it to the puller during its calls.
        let memory = unsafe { HostRegion::new(addr, nbytes) }
            .map_err(|e| PyValueError::new_err(format!("rank {rank}: {e}")))?;
        self.with(py, move |p, _| {
            p.with(|p| p.register_rank(rank, Box::new(memory)))?
                .map_err(mx_follower::Error::from)
        })
    }

    /// Stages `version` (a label or an id) from the control plane's manifests; a JSON report.
    fn stage(&self, py: Python<'_>, version: String) -> PyResult<String> {
        self.call(
            py,
            Box::new(move |p, rt| {
                let v = rt.block_on(p.resolve(&version))?;
                let r = p.stage_resolved(&v, &ExecOptions::default())?;
                Ok(stage_json(Some(&v.label), v.id, &r))
            }),
        )
    }

    /// Stages `version_id` from `manifests_json` (the version's source manifests as JSON).
    fn stage_manifests(
        &self,
        py: Python<'_>,
        version_id: &str,
        manifests_json: &str,
    ) -> PyResult<String> {
        let id = parse_id(py, "version_id", version_id)?;
        let manifests: Vec<SourceManifest> = serde_json::from_str(manifests_json)
            .map_err(|e| PyValueError::new_err(format!("manifests_json: {e}")))?;
        self.call(
            py,
            Box::new(move |p, _| {
                let r = p.stage(id, &manifests, &ExecOptions::default())?;
                Ok(stage_json(None, id, &r))
            }),
        )
    }

    /// Installs `version_id` (None: the staged version) in place; a JSON report.
    #[pyo3(signature = (version_id = None))]
    fn apply(&self, py: Python<'_>, version_id: Option<&str>) -> PyResult<String> {
        let id = version_id
            .map(|s| parse_id(py, "version_id", s))
            .transpose()?;
        self.call(py, Box::new(move |p, _| Ok(apply_json(&p.apply(id)?))))
    }

    /// Declares that the registered memory holds version `version` (any id: the engine loaded
    /// it itself, e.g. `disk:<dir>` at start-up); nothing is copied. Only before serving.
    fn set_resident(&self, py: Python<'_>, version: Option<String>) -> PyResult<()> {
        self.with(py, move |p, _| {
            if p.served() {
                return Err(mx_follower::Error::ServedPuller {
                    what: "set_resident",
                });
            }
            p.with(|p| p.set_resident(version.as_deref().map(mx_layout::ResidentVersion::parse)))
        })
    }

    /// Restores the retained copy in place; a JSON report.
    fn rollback(&self, py: Python<'_>) -> PyResult<String> {
        self.call(py, Box::new(|p, _| Ok(apply_json(&p.rollback()?))))
    }

    /// `(resident, retained, staged)` version ids (None where nothing is held).
    fn versions(
        &self,
        py: Python<'_>,
    ) -> PyResult<(Option<String>, Option<String>, Option<String>)> {
        self.with(py, |p, _| {
            let v = p.with(|p| p.versions())?;
            Ok((
                v.resident.map(|x| x.to_string()),
                v.retained.map(|x| x.to_string()),
                v.staged.map(|x| x.to_string()),
            ))
        })
    }

    /// Memory held beside the engine's own, as JSON text.
    fn memory_report(&self, py: Python<'_>) -> PyResult<String> {
        self.call(
            py,
            Box::new(|p, _| {
                let m = p.with(|p| p.memory_report())?;
                Ok(json!({
                    "rank_bytes": m.rank_bytes.iter().map(|(r, b)| json!({"rank": r, "bytes": b})).collect::<Vec<_>>(),
                    "staging_bytes": m.staging_bytes,
                    "staging_bytes_peak": m.staging_bytes_peak,
                    "retained_bytes": m.retained_bytes,
                    "process_rss_bytes": m.process_rss_bytes,
                    "process_rss_bytes_peak": m.process_rss_bytes_peak,
                }))
            }),
        )
    }

    /// blake3 of every registered parameter, per held rank, as JSON text.
    fn live_digests(&self, py: Python<'_>) -> PyResult<String> {
        self.call(
            py,
            Box::new(|p, _| {
                let d = p.with(|p| p.live_digests())??;
                serde_json::to_value(d).map_err(|e| mx_follower::Error::Task(e.to_string()))
            }),
        )
    }

    /// `(name, data pointer)` of every registered parameter of `rank`.
    fn addresses(&self, py: Python<'_>, rank: u32) -> PyResult<Vec<(String, u64)>> {
        self.with(py, move |p, _| Ok(p.with(|p| p.addresses(rank))??))
    }

    /// The staged version piece by piece (copied out): `(rank, param, tensor, dtype,
    /// global_shape, box_offset, box_shape, bytes)`.
    #[allow(clippy::type_complexity)]
    fn staged_tensors(
        &self,
        py: Python<'_>,
    ) -> PyResult<
        Vec<(
            u32,
            String,
            String,
            String,
            Vec<u64>,
            Vec<u64>,
            Vec<u64>,
            Vec<u8>,
        )>,
    > {
        let pieces = self.with(py, |p, _| {
            let mut out = Vec::new();
            p.with(|p| {
                p.staged_tensors(|s| {
                    out.push((
                        s.rank,
                        s.param.to_string(),
                        s.tensor.to_string(),
                        s.dtype.to_string(),
                        s.global_shape.to_vec(),
                        s.region.global_offset.clone(),
                        s.region.local_shape.clone(),
                        s.bytes.to_vec(),
                    ));
                    Ok(())
                })
            })??;
            Ok(out)
        })?;
        Ok(pieces)
    }

    /// Serves the puller as worker `worker_id` on `listen` with `engine_api` ("dynamo" or
    /// "dynamo_sglang": mx's reference routes in that contract's shape); returns the routes' URL.
    #[pyo3(signature = (worker_id, listen = "127.0.0.1:0", engine_api = "dynamo"))]
    fn serve(
        &self,
        py: Python<'_>,
        worker_id: String,
        listen: &str,
        engine_api: &str,
    ) -> PyResult<String> {
        let http: SocketAddr = listen.parse().map_err(|e| {
            PyValueError::new_err(format!("listen must be IP:PORT, got {listen:?}: {e}"))
        })?;
        let api = match engine_api {
            "dynamo" => EngineApi::Dynamo,
            "dynamo_sglang" => EngineApi::DynamoSglang,
            other => {
                return Err(PyValueError::new_err(format!(
                    "engine_api must be \"dynamo\" or \"dynamo_sglang\", got {other:?}"
                )))
            }
        };
        self.with(py, move |p, rt| rt.block_on(p.serve(&worker_id, http, api)))
    }

    /// Follows the control plane as worker `worker_id` of `instance`, whose engine serves the
    /// `engine_api` routes itself at `engine_url` (see `EmbeddedPuller::follow`); `limits` is
    /// `(vocab_size, max_positions)` of the engine's model when it generates; `frontend` is
    /// `(url, served model, instance id)` of a Dynamo worker's frontend, where it generates.
    /// Returns the URL.
    #[pyo3(signature = (worker_id, instance, engine_url, engine_api, limits=None, frontend=None, on_staged=None))]
    #[allow(clippy::too_many_arguments)]
    fn follow(
        &self,
        py: Python<'_>,
        worker_id: String,
        instance: String,
        engine_url: String,
        engine_api: &str,
        limits: Option<(u64, u64)>,
        frontend: Option<(String, String, u64)>,
        on_staged: Option<Py<PyAny>>,
    ) -> PyResult<String> {
        let api: EngineApi = engine_api
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("engine_api: {e}")))?;
        let engine = EngineEndpoint {
            api,
            system_url: engine_url,
            no_model: false,
            frontend: frontend.map(|(url, model, instance_id)| EngineFrontend {
                url,
                model,
                instance_id,
            }),
        };
        let limits = limits.map(|(vocab_size, max_positions)| ModelLimits {
            vocab_size,
            max_positions,
        });
        let hook = on_staged.map(|f| Arc::new(PyStagedHook(f)) as Arc<dyn StagedHook>);
        self.with(py, move |p, rt| {
            rt.block_on(p.follow(&worker_id, &instance, engine, limits, hook))
        })
    }

    /// Copies bytes `offset..offset + nbytes` of held rank `rank` of the staged version
    /// `version_id` into the `nbytes` of host memory at `addr` (laid out as the rank's layout;
    /// see `Puller::copy_staged_rank`).
    fn copy_staged_rank(
        &self,
        py: Python<'_>,
        version_id: &str,
        rank: u32,
        offset: u64,
        addr: u64,
        nbytes: u64,
    ) -> PyResult<()> {
        let id = parse_id(py, "version_id", version_id)?;
        // SAFETY: `mx.Puller.copy_staged` (python/mx/_puller.py) passes the data pointer and
        // size of a contiguous, writable host tensor it holds referenced for this call, after
        // checking the range lies inside the tensor's storage.
        let mut region = unsafe { HostRegion::new(addr, nbytes) }
            .map_err(|e| PyValueError::new_err(format!("rank {rank}: {e}")))?;
        self.with(py, move |p, _| {
            let buf = region
                .host_mut()
                .ok_or_else(|| mx_follower::Error::Task("host memory expected".into()))?;
            p.copy_staged_rank(id, rank, offset, buf)
        })
    }

    /// Reports to the control plane what this rank holds in its engine's live weights now (its
    /// resident version), after an install the engine ran through mx: `error` says why the
    /// install failed and what was restored (empty when it succeeded). Blocks until the control
    /// plane recorded it (at most 10 s). mx's SGLang loader calls it before it returns, since
    /// SGLang answers every custom load with success.
    ///
    /// Raises `MxError` (`Control`) when the control plane refused or did not answer, or before
    /// `follow` / `serve`.
    #[pyo3(signature = (error = ""))]
    fn report_resident(&self, py: Python<'_>, error: &str) -> PyResult<()> {
        let error = error.to_string();
        self.with(py, move |p, rt| rt.block_on(p.report_resident(&error)))
    }

    /// Whose engine this is once `serve` or `follow` started a worker, else `None`: a dict
    /// `{"worker_id", "instance", "incarnation_digest"}` (the incarnation itself never leaves
    /// the process). An engine serving its own routes answers it when the control plane asks
    /// before changing the engine (mx's vLLM plugin: vLLM's `collective_rpc`).
    fn engine_identity<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        let id = self.with(py, |p, _rt| Ok::<_, mx_follower::Error>(p.identity()))?;
        id.map(|id| {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("worker_id", id.worker_id)?;
            d.set_item("instance", id.instance)?;
            d.set_item("incarnation_digest", id.incarnation_digest)?;
            Ok(d)
        })
        .transpose()
    }

    /// Stops serving (if served) and drops the puller; the registered memory stays the
    /// caller's and is not touched after this returns. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.owned.close(py, |mut p, rt| {
            rt.block_on(p.stop_serving("the engine closed its puller"));
            drop(p);
        })
    }

    /// True until `close()`.
    #[getter]
    fn open(&self) -> bool {
        self.owned.is_open()
    }
}
