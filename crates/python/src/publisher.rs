//! `mx._mx.Publisher`: a trainer rank publishing the shards it holds from memory it owns
//! (torch tensors, numpy arrays; `mx.Publisher` in `python/mx/_publisher.py` turns those into
//! addresses and keeps them alive).

use std::time::Duration;

use mx_layout::{DType, LayoutSpec, TensorBox};
use mx_publisher::{ForeignMemory, MemoryId, Patience, PublishOptions, ShardSpec};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::control::runtime;
use crate::errors::{chain, control_error, layout_error, mx_error};
use crate::model::Model;
use crate::owned::Owned;
use crate::seconds;

/// One shard as the Python layer gives it: `(tensor, dtype, global_shape, box_offset,
/// box_shape, memory_id, byte_offset)`.
type ShardTuple = (String, String, Vec<u64>, Vec<u64>, Vec<u64>, usize, u64);

/// The `MxError` for a publisher error, with the gRPC-style code Python callers branch on.
pub(crate) fn publisher_error(py: Python<'_>, e: &mx_publisher::Error) -> PyErr {
    use mx_publisher::Error as E;
    let code = match e {
        E::Control(c) => return control_error(py, c),
        E::Timeout { .. } => Some("DeadlineExceeded"),
        E::BadShard { .. } | E::BadSlot { .. } | E::Layout(_) | E::ForeignAgent { .. } => {
            Some("InvalidArgument")
        }
        E::NoShards { .. } => Some("FailedPrecondition"),
        _ => None,
    };
    mx_error(py, chain(e), code)
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
    /// `control`, checking shards against `model`.
    #[new]
    #[pyo3(signature = (control, layout, slot, model, pack = true))]
    fn new(
        py: Python<'_>,
        control: String,
        layout: &str,
        slot: u32,
        model: &Model,
        pack: bool,
    ) -> PyResult<Publisher> {
        let layout: LayoutSpec = layout.parse().map_err(|e| layout_error(py, "layout", &e))?;
        let rt = runtime(py, "mx-publisher", 1)?;
        let cfg = mx_publisher::PublisherConfig {
            control,
            slot,
            layout,
            model: model.info.clone(),
            pack,
        };
        let publisher = py
            .detach(|| rt.block_on(mx_publisher::Publisher::connect(cfg)))
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
