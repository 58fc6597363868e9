//! `mx._mx.Publisher`: a trainer rank publishing the shards it holds from memory it owns
//! (torch tensors, numpy arrays; `mx.Publisher` in `python/mx/_publisher.py` turns those into
//! addresses and keeps them alive), and exporting a published version to object storage from
//! whole tensors (host memory, read in place).
#![allow(
    clippy::result_large_err,
    reason = "mx_publisher::Error (with mx_artifact::Error inside) crosses once per call, into a \
              Python exception"
)]

use std::time::Duration;

use mx_layout::{DType, LayoutSpec, TensorBox, TensorSpec};
use mx_publisher::{
    ArtifactUrl, ExportBase, ExportOptions, ExportSpec, ForeignMemory, MemoryId, Patience,
    PublishOptions, ShardSpec, StoreOptions, WholeTensor,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::json;

use crate::control::{client_auth, runtime};
use crate::errors::{chain, control_error, layout_error, mx_error};
use crate::model::Model;
use crate::owned::Owned;
use crate::seconds;

/// One shard as the Python layer gives it: `(tensor, dtype, global_shape, box_offset,
/// box_shape, memory_id, byte_offset)`.
type ShardTuple = (String, String, Vec<u64>, Vec<u64>, Vec<u64>, usize, u64);

/// One whole tensor as the Python layer gives it to `export`: `(name, dtype, shape, address,
/// nbytes, owner)`: the tensor's row-major bytes lie at `address` (host memory), inside the
/// storage of `owner`, which this crate keeps referenced for the call. (The buffer protocol is
/// not in the limited API of Python 3.10 this abi3 module is built for, so, as for
/// `register_host`, `python/mx/_memory.py` finds and checks the address.)
type WholeTuple<'py> = (String, String, Vec<u64>, u64, u64, Bound<'py, PyAny>);

/// The `MxError` for a publisher error, with the gRPC-style code Python callers branch on.
pub(crate) fn publisher_error(py: Python<'_>, e: &mx_publisher::Error) -> PyErr {
    use mx_publisher::Error as E;
    let code = match e {
        E::Control(c) => return control_error(py, c),
        E::Timeout { .. } => Some("DeadlineExceeded"),
        E::BadShard { .. } | E::BadSlot { .. } | E::Layout(_) | E::ForeignAgent { .. } => {
            Some("InvalidArgument")
        }
        E::NoShards { .. } | E::Export { .. } => Some("FailedPrecondition"),
        E::Artifact(a) => artifact_code(a),
        _ => None,
    };
    mx_error(py, chain(e), code)
}

/// The gRPC-style code of an artifact error.
fn artifact_code(e: &mx_artifact::Error) -> Option<&'static str> {
    use mx_artifact::Error as A;
    match e {
        A::NotTheVersion { .. } | A::BadUrl { .. } | A::Layout(_) => Some("InvalidArgument"),
        A::Store { .. } => Some("Unavailable"),
        A::Missing { .. } => Some("NotFound"),
        A::ManifestDigest { .. } | A::BadManifest { .. } | A::BadChunk { .. } => Some("DataLoss"),
        A::WrongBase { .. } | A::ChainTooLong { .. } => Some("FailedPrecondition"),
        _ => None,
    }
}

/// Whole tensors read in place from host memory Python objects own: their specs, their
/// `(address, bytes)`, and the owners, kept referenced (so the memory stays allocated) until
/// this is dropped.
struct Whole<'py> {
    specs: Vec<TensorSpec>,
    ranges: Vec<(u64, u64)>,
    _owners: Vec<Bound<'py, PyAny>>,
}

impl<'py> Whole<'py> {
    /// Checks and takes `tensors` (`what` names the argument in errors).
    ///
    /// # Errors
    /// `ValueError` naming the tensor: a dtype that is not a safetensors name, a shape whose
    /// size overflows, a length that is not exactly the tensor's size, a null address or a
    /// range that wraps.
    fn take(what: &str, tensors: Vec<WholeTuple<'py>>) -> PyResult<Whole<'py>> {
        let mut specs = Vec::with_capacity(tensors.len());
        let mut ranges = Vec::with_capacity(tensors.len());
        let mut owners = Vec::with_capacity(tensors.len());
        for (i, (name, dtype, shape, addr, nbytes, owner)) in tensors.into_iter().enumerate() {
            let at = format!("{what}[{i}] (tensor {name})");
            let dtype: DType = dtype.parse().map_err(|e: mx_layout::Error| {
                PyValueError::new_err(format!("{at}: dtype {dtype:?}: {}", chain(&e)))
            })?;
            let want = shape
                .iter()
                .try_fold(dtype.size_bytes(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "{at}: shape {shape:?} of {dtype} has more bytes than fit in 64 bits"
                    ))
                })?;
            if nbytes != want {
                return Err(PyValueError::new_err(format!(
                    "{at}: {nbytes} bytes given, but {dtype} {shape:?} is {want} bytes"
                )));
            }
            let fits = usize::try_from(nbytes).is_ok_and(|n| n <= isize::MAX as usize)
                && usize::try_from(addr).is_ok()
                && addr.checked_add(nbytes).is_some();
            if nbytes > 0 && (addr == 0 || !fits) {
                return Err(PyValueError::new_err(format!(
                    "{at}: {nbytes} bytes at address {addr:#x} is not a host memory range"
                )));
            }
            specs.push(TensorSpec { name, dtype, shape });
            ranges.push((addr, nbytes));
            owners.push(owner);
        }
        Ok(Whole {
            specs,
            ranges,
            _owners: owners,
        })
    }

    /// The tensors, borrowing their memory.
    fn tensors(&self) -> Vec<WholeTensor<'_>> {
        self.specs
            .iter()
            .zip(&self.ranges)
            .map(|(spec, &(addr, n))| WholeTensor {
                spec,
                bytes: bytes_at(addr, n),
            })
            .collect()
    }
}

/// The `n` bytes at `addr` (checked in [`Whole::take`]: non-null, fitting the address space).
fn bytes_at<'a>(addr: u64, n: u64) -> &'a [u8] {
    if n == 0 {
        return &[];
    }
    // SAFETY: `_mx.Publisher.export` is private to `mx.Publisher.export`
    // (python/mx/_publisher.py), which passes only ranges that `_memory.describe` found inside
    // the storage of a host (CPU), dense, C-contiguous tensor or array, and keeps that object
    // and its storage referenced for the call (so does [`Whole`], which outlives the borrow):
    // the bytes stay allocated and in place while mx reads them. `u8` has no alignment or
    // validity requirements. That nothing writes them during the call is the documented
    // contract of `mx.Publisher.export`, as of `publish`.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, n as usize) }
}

/// Checks the names of the files written beside a canonical artifact: plain relative paths
/// that do not replace the artifact's own objects.
fn check_extra(extra: &[(String, Vec<u8>)]) -> PyResult<()> {
    let mut seen = std::collections::HashSet::new();
    for (i, (name, _)) in extra.iter().enumerate() {
        let own = name == mx_artifact::MANIFEST_NAME
            || name == mx_artifact::INDEX_NAME
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        let bad = if name.is_empty()
            || name
                .split('/')
                .any(|s| s.is_empty() || s == "." || s == "..")
        {
            Some("a relative path of non-empty segments other than '.' and '..'")
        } else if name.chars().any(char::is_control) || name.contains('\\') {
            Some("no control characters or backslashes")
        } else if own {
            Some("not a name the artifact itself writes")
        } else if !seen.insert(name.as_str()) {
            Some("given once")
        } else {
            None
        };
        if let Some(must) = bad {
            return Err(PyValueError::new_err(format!(
                "extra[{i}]: the file name {name:?} must be {must}"
            )));
        }
    }
    Ok(())
}

struct Inner {
    publisher: mx_publisher::Publisher,
    memories: Vec<MemoryId>,
}

/// A trainer rank's publisher: its NIXL agent (with a progress thread), the memory registered
/// with it, its shards and its control-plane connection, on a tokio runtime of its own (one
/// worker thread, `mx-publisher`). Calls serialize; publish and the waits block with the GIL
/// released.
#[pyclass(module = "mx._mx", frozen)]
pub(crate) struct Publisher {
    owned: Owned<Inner>,
    agent: String,
}

impl Publisher {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Inner) -> Result<T, mx_publisher::Error> + Send,
    ) -> PyResult<T> {
        self.owned
            .with(py, |inner, _| f(inner))?
            .map_err(|e| publisher_error(py, &e))
    }

    /// Runs the publisher's async call `f` with the GIL released; Ctrl-C interrupts it
    /// ([`crate::interruptible`]).
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl for<'a> FnOnce(
                &'a mut mx_publisher::Publisher,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<T, mx_publisher::Error>> + Send + 'a>,
            > + Send,
    ) -> PyResult<T> {
        self.owned
            .with(py, |inner, rt| {
                rt.block_on(crate::interruptible(f(&mut inner.publisher)))
            })??
            .map_err(|e| publisher_error(py, &e))
    }
}

fn patience(timeout: f64) -> PyResult<Patience> {
    Ok(Patience::GiveUpAfter(seconds("timeout", timeout)?))
}

#[pymethods]
impl Publisher {
    /// Connects a publisher for `slot` of trainer layout `layout` to the control plane at
    /// `control`, checking shards against `model`. `token` or `token_file` (one at most)
    /// override the process's `MX_CONTROL_TOKEN` / `MX_CONTROL_TOKEN_FILE` for this publisher.
    #[new]
    #[pyo3(signature = (control, layout, slot, model, pack = true, *, token = None, token_file = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control: String,
        layout: &str,
        slot: u32,
        model: &Model,
        pack: bool,
        token: Option<String>,
        token_file: Option<std::path::PathBuf>,
    ) -> PyResult<Publisher> {
        let layout: LayoutSpec = layout.parse().map_err(|e| layout_error(py, "layout", &e))?;
        let auth = client_auth(py, token.as_deref(), token_file.as_deref())?;
        let rt = runtime(py, "mx-publisher", 1)?;
        let cfg = mx_publisher::PublisherConfig {
            control,
            slot,
            layout,
            model: model.info.clone(),
            pack,
        };
        let publisher = py
            .detach(|| rt.block_on(mx_publisher::Publisher::connect_with(cfg, &auth)))
            .map_err(|e| publisher_error(py, &e))?;
        let agent = publisher.agent().name().to_string();
        let inner = Inner {
            publisher,
            memories: Vec::new(),
        };
        Ok(Publisher {
            owned: Owned::new(inner, rt, "Publisher"),
            agent,
        })
    }

    /// The NIXL agent's name.
    #[getter]
    fn agent_name(&self) -> String {
        self.agent.clone()
    }

    /// Registers `nbytes` of host memory at `addr` with the NIXL agent and returns its memory
    /// id. The Python layer guarantees the contract of `ForeignMemory::register_host`: it holds
    /// a reference to the object owning the memory for the publisher's life, and documents
    /// that the caller must not write it while mx reads it.
    fn register_host(&self, py: Python<'_>, addr: u64, nbytes: u64) -> PyResult<usize> {
        if addr == 0 || nbytes == 0 {
            return Err(PyValueError::new_err(format!(
                "register_host: address {addr:#x} and length {nbytes} must both be non-zero"
            )));
        }
        self.owned
            .with(py, |inner, _| {
                // SAFETY: `mx.Publisher` (python/mx/_publisher.py) calls this only for memory of a
                // Python object it keeps referenced until this publisher is closed (so the range
                // stays allocated and readable), after checking the range lies inside that object's
                // storage; not writing it while mx reads it is the documented contract of
                // `mx.Publisher.publish` (in place: until the version is handed back).
                let mem =
                    unsafe { ForeignMemory::register_host(inner.publisher.agent(), addr, nbytes) }
                        .map_err(|e| {
                            format!("registering {nbytes} bytes at {addr:#x}: {}", chain(&e))
                        })?;
                let id = inner.publisher.register(mem).map_err(|e| chain(&e))?;
                inner.memories.push(id);
                Ok(inner.memories.len() - 1)
            })?
            .map_err(|msg: String| mx_error(py, msg, None))
    }

    /// Sets the shards this rank holds (replacing any set before); nothing changes on error.
    fn set_shards(&self, py: Python<'_>, shards: Vec<ShardTuple>) -> PyResult<()> {
        let mut specs = Vec::with_capacity(shards.len());
        {
            let memories = self.owned.with(py, |inner, _| inner.memories.clone())?;
            for (i, (tensor, dtype, global_shape, offset, extent, memory, at)) in
                shards.into_iter().enumerate()
            {
                let dtype: DType = dtype.parse().map_err(|e| {
                    layout_error(py, &format!("shards[{i}] (tensor {tensor}).dtype"), &e)
                })?;
                let memory = memories.get(memory).copied().ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "shards[{i}] (tensor {tensor}): unknown memory id {memory} ({} registered)",
                        memories.len()
                    ))
                })?;
                specs.push(ShardSpec {
                    tensor,
                    dtype,
                    global_shape,
                    shard: TensorBox {
                        global_offset: offset,
                        local_shape: extent,
                    },
                    memory,
                    offset: at,
                });
            }
        }
        self.with(py, |inner| inner.publisher.set_shards(specs))
    }

    /// Publishes the shards' current bytes as version `label`; returns the version id once
    /// READY.
    #[pyo3(signature = (label, copy = false, timeout = 600.0))]
    fn publish(&self, py: Python<'_>, label: String, copy: bool, timeout: f64) -> PyResult<String> {
        let opts = PublishOptions {
            copy,
            patience: patience(timeout)?,
        };
        let published = self.run(py, move |p| {
            Box::pin(async move { p.publish(&label, opts).await })
        })?;
        Ok(published.version.to_string())
    }

    /// Blocks until version `label` is handed back; returns why, as JSON text.
    #[pyo3(signature = (label, timeout = 600.0))]
    fn wait_staged(&self, py: Python<'_>, label: String, timeout: f64) -> PyResult<String> {
        let timeout: Duration = seconds("timeout", timeout)?;
        let r = self.run(py, move |p| {
            Box::pin(async move { p.wait_staged(&label, timeout).await })
        })?;
        serde_json::to_string(&r).map_err(|e| mx_error(py, e.to_string(), Some("Internal")))
    }

    /// Blocks until version `label` is COMMITTED (then it is handed back).
    #[pyo3(signature = (label, timeout = 600.0))]
    fn wait_committed(&self, py: Python<'_>, label: String, timeout: f64) -> PyResult<()> {
        let p = patience(timeout)?;
        self.run(py, move |pb| {
            Box::pin(async move { pb.wait_committed(&label, p).await })
        })
    }

    /// Stops serving version `label` from this slot and tells the control plane.
    #[pyo3(signature = (label, timeout = 600.0))]
    fn release(&self, py: Python<'_>, label: String, timeout: f64) -> PyResult<()> {
        let p = patience(timeout)?;
        self.run(py, move |pb| {
            Box::pin(async move { pb.release(&label, p).await })
        })
    }

    /// Exports READY version `label` to `to` (`s3://bucket/prefix`) from its whole tensors
    /// (`(name, dtype, shape, address, nbytes, owner)`, read in place), as canonical
    /// safetensors (with `extra` files beside them) or, with `base_label`, as an XOR delta
    /// against that READY version (whose whole tensors are `base_tensors`), and records the
    /// artifact at the control plane. The bytes are proven to be the version first. Returns
    /// what was written, as JSON text.
    #[pyo3(signature = (
        label, tensors, to, base_label = None, base_tensors = None, extra = None,
        chunk_bytes = 4 << 20, timeout = 600.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn export<'py>(
        &self,
        py: Python<'py>,
        label: String,
        tensors: Vec<WholeTuple<'py>>,
        to: &str,
        base_label: Option<String>,
        base_tensors: Option<Vec<WholeTuple<'py>>>,
        extra: Option<Vec<(String, Vec<u8>)>>,
        chunk_bytes: u64,
        timeout: f64,
    ) -> PyResult<String> {
        let deadline = seconds("timeout", timeout)?;
        let url: ArtifactUrl = to
            .parse()
            .map_err(|e: mx_artifact::Error| PyValueError::new_err(format!("to: {}", chain(&e))))?;
        if !(1..=mx_artifact::MAX_CHUNK_BYTES).contains(&chunk_bytes) {
            return Err(PyValueError::new_err(format!(
                "chunk_bytes must be in 1..={}, got {chunk_bytes}",
                mx_artifact::MAX_CHUNK_BYTES
            )));
        }
        let extra = extra.unwrap_or_default();
        check_extra(&extra)?;
        let target = Whole::take("tensors", tensors)?;
        let base = match (base_label, base_tensors) {
            (None, None) => None,
            (Some(l), Some(t)) => {
                if !extra.is_empty() {
                    return Err(PyValueError::new_err(
                        "extra files are written only beside a canonical artifact, not a delta",
                    ));
                }
                Some((l, Whole::take("base_tensors", t)?))
            }
            _ => {
                return Err(PyValueError::new_err(
                    "base_label and base_tensors go together: give both (a delta) or neither",
                ))
            }
        };
        let target_whole = target.tensors();
        let base_whole = base.as_ref().map(|(_, b)| b.tensors());
        let spec = ExportSpec {
            label: &label,
            url: &url,
            tensors: &target_whole,
            base: base
                .as_ref()
                .zip(base_whole.as_deref())
                .map(|((l, _), tensors)| ExportBase { label: l, tensors }),
            extra: &extra,
            options: ExportOptions {
                chunk_bytes,
                ..ExportOptions::default()
            },
            store: StoreOptions::default(),
        };
        // The owners stay referenced until this returns.
        let r = self.owned.with(py, |inner, rt| {
            rt.block_on(crate::interruptible(async {
                tokio::time::timeout(deadline, inner.publisher.export(&spec)).await
            }))
        })??;
        let exported = match r {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => return Err(publisher_error(py, &e)),
            Err(_) => {
                return Err(mx_error(
                    py,
                    format!(
                        "exporting {label} to {url}: not done within {:.3} s (the artifact is not \
                         recorded; objects already written under it stay)",
                        deadline.as_secs_f64()
                    ),
                    Some("DeadlineExceeded"),
                ))
            }
        };
        let m = &exported.manifest;
        let out = json!({
            "url": exported.url.to_string(),
            "manifest_digest": exported.manifest_digest.to_string(),
            "kind": m.kind,
            "label": m.label,
            "version": m.version.to_string(),
            "base": m.base.map(|b| b.to_string()),
            "base_url": m.base_url,
            "tensors": m.tensors.len(),
            "data_bytes": exported.data_bytes,
            "seconds": exported.seconds,
        });
        serde_json::to_string(&out).map_err(|e| mx_error(py, e.to_string(), Some("Internal")))
    }

    /// Stops serving and deregisters the memory (which stays the caller's). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.owned.close(py, |inner, _| drop(inner))
    }

    /// True until `close()`.
    #[getter]
    fn open(&self) -> bool {
        self.owned.is_open()
    }
}
