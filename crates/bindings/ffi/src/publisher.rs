//! `mx_publisher`: a trainer rank publishing the shards it holds, from host memory it owns.

use std::ffi::{c_char, c_void};
use std::sync::Mutex;
use std::time::Duration;

use mx_layout::TensorBox;
use mx_publisher::{ForeignMemory, MemoryId, Patience, PublishOptions, ShardSpec};

use crate::model::{free_handle, write_handle, Model};
use crate::util::{
    self, call, call_void, cstr, dims, lock, millis_or, parse_dtype, parse_layout, runtime, slice,
    write_opt_string, write_out, write_string, FfiError,
};
use crate::Status;

/// A trainer rank's publisher (mx-publisher): its NIXL agent, registered memory, shards and
/// control-plane connection. Calls on one handle serialize (publish, wait and release block
/// while they hold it). Freeing it stops serving every version published from it.
pub struct Publisher {
    inner: Mutex<PublisherInner>,
}

struct PublisherInner {
    publisher: mx_publisher::Publisher,
    memories: Vec<MemoryId>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}

/// One shard a trainer rank holds, as given to `mx_publisher_set_shards`: the box
/// (`box_offset`, `box_shape`) of global tensor `tensor`, stored row-major (C order, dense) at
/// byte `offset` of registered memory `memory`, `prod(box_shape) * dtype size` bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ShardC {
    /// Global (checkpoint) tensor name, as in the model.
    pub tensor: *const c_char,
    /// Element type (as in `mx_tensor_spec`); must be the model's.
    pub dtype: *const c_char,
    /// Global shape, `ndim` elements; must be the model's.
    pub global_shape: *const u64,
    /// First element of the box in every dim, `ndim` elements.
    pub box_offset: *const u64,
    /// Extent of the box in every dim, `ndim` elements.
    pub box_shape: *const u64,
    /// Number of dims of all three arrays (at most `MX_MAX_DIMS`).
    pub ndim: usize,
    /// A memory id from `mx_publisher_register_host`.
    pub memory: u64,
    /// Byte offset of the shard's first byte in that memory.
    pub offset: u64,
}

const _: () = assert!(std::mem::size_of::<ShardC>() == 8 * 8);

/// Connects a publisher for slot `slot` (its rank) of trainer layout `layout` (`"fsdp:2"`,
/// `"replicated:1"`, ...) to the control plane at `control` (`"http://host:port"`), with
/// `model` (copied). Creates a NIXL agent with a progress thread. Blocks until connected.
/// Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, a bad layout, a slot outside it), `MX_ERR_NIXL`
/// (NIXL missing: the message says how to install it), `MX_ERR_CONTROL` (unreachable).
///
/// # Safety
/// String arguments are NULL or NUL-terminated; `model` is NULL or a live model; `out` is NULL
/// or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_create(
    control: *const c_char,
    layout: *const c_char,
    slot: u32,
    model: *const Model,
    out: *mut *mut Publisher,
) -> Status {
    call("mx_publisher_create", || {
        // SAFETY: the caller's contract (this and the calls below).
        let control = unsafe { cstr(control, "control") }?;
        // SAFETY: as above.
        let layout = parse_layout(unsafe { cstr(layout, "layout") }?, "layout")?;
        // SAFETY: as above.
        let model = unsafe { util::handle(model, "model") }?;
        if out.is_null() {
            return Err(FfiError::arg("out", "NULL output pointer"));
        }
        let rt = runtime()?;
        let publisher = rt.block_on(mx_publisher::Publisher::connect(
            mx_publisher::PublisherConfig {
                control: control.to_string(),
                slot,
                layout,
                model: model.info.clone(),
                pack: true,
            },
        ))?;
        let p = Publisher {
            inner: Mutex::new(PublisherInner {
                publisher,
                memories: Vec::new(),
            }),
        };
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, p) }
    })
}

/// Registers `len` bytes of host memory at `addr` with the publisher's NIXL agent, so peers
/// can read it, and returns its id for `mx_shard.memory`. Register one large region where you
/// can (registration cost grows with the count). The region stays registered until the
/// publisher is freed. Thread-safe (serializes on the handle).
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL `addr`, `len` 0, a range that overflows),
/// `MX_ERR_NIXL` (registration refused).
///
/// # Safety
/// Until the publisher is freed, `addr .. addr + len` stays allocated and readable (it is
/// not freed or unmapped), and the caller does not write it while mx reads it: during
/// `mx_publisher_publish`, and after an in-place publish until the version is handed back
/// (`mx_publisher_wait_staged`, `mx_publisher_wait_committed` or `mx_publisher_release`
/// returned `MX_OK`). `publisher` is NULL or live; `memory_id` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_register_host(
    publisher: *const Publisher,
    addr: *const c_void,
    len: u64,
    memory_id: *mut u64,
) -> Status {
    call("mx_publisher_register_host", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        if addr.is_null() {
            return Err(FfiError::arg("addr", "NULL pointer"));
        }
        if memory_id.is_null() {
            return Err(FfiError::arg("memory_id", "NULL output pointer"));
        }
        let mut g = lock(&h.inner, "publisher")?;
        // SAFETY: the range stays allocated, readable and unwritten while mx reads it, for as
        // long as the publisher (which owns the registration) lives: this function's contract,
        // which is register_host's.
        let mem = unsafe { ForeignMemory::register_host(g.publisher.agent(), addr as u64, len) }
            .map_err(|e| {
                let status = match e {
                    mx_nixl::Error::BadLength { .. } => crate::MX_ERR_INVALID_ARGUMENT,
                    _ => crate::MX_ERR_NIXL,
                };
                FfiError::new(status, format!("addr/len: {}", util::chain(&e)))
            })?;
        let id = g.publisher.register(mem)?;
        g.memories.push(id);
        let index = (g.memories.len() - 1) as u64;
        // SAFETY: the caller's contract.
        unsafe { write_out(memory_id, index, "memory_id") }
    })
}

/// Sets the shards this rank holds (`n` of them, replacing any set before). Every shard is
/// checked against the model (tensor, dtype, global shape, box inside the shape), the
/// registered memory (its bytes inside the region) and the others (no two boxes of one tensor
/// overlap); nothing changes on error. Thread-safe (serializes on the handle).
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` naming the shard's index, tensor and what is wrong.
///
/// # Safety
/// `shards` points to `n` shards (each with valid strings and `ndim`-element arrays) or is NULL
/// with `n == 0`; `publisher` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_set_shards(
    publisher: *const Publisher,
    shards: *const ShardC,
    n: usize,
) -> Status {
    call("mx_publisher_set_shards", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        // SAFETY: the caller's contract.
        let shards = unsafe { slice(shards, n, "shards") }?;
        let mut g = lock(&h.inner, "publisher")?;
        let mut specs = Vec::with_capacity(shards.len());
        for (i, s) in shards.iter().enumerate() {
            // SAFETY: each shard's strings and arrays follow the caller's contract.
            let tensor = unsafe { cstr(s.tensor, &format!("shards[{i}].tensor")) }?;
            let field = |f: &str| format!("shards[{i}] (tensor {tensor}).{f}");
            // SAFETY: as above.
            let dtype = parse_dtype(unsafe { cstr(s.dtype, &field("dtype")) }?, &field("dtype"))?;
            // SAFETY: as above (three arrays of ndim elements).
            let (global_shape, offset, extent) = unsafe {
                (
                    dims(s.global_shape, s.ndim, &field("global_shape"))?,
                    dims(s.box_offset, s.ndim, &field("box_offset"))?,
                    dims(s.box_shape, s.ndim, &field("box_shape"))?,
                )
            };
            let memory = usize::try_from(s.memory)
                .ok()
                .and_then(|m| g.memories.get(m))
                .copied()
                .ok_or_else(|| {
                    FfiError::arg(
                        &field("memory"),
                        format!(
                            "unknown memory id {} ({} registered)",
                            s.memory,
                            g.memories.len()
                        ),
                    )
                })?;
            specs.push(ShardSpec {
                tensor: tensor.to_string(),
                dtype,
                global_shape,
                shard: TensorBox {
                    global_offset: offset,
                    local_shape: extent,
                },
                memory,
                offset: s.offset,
            });
        }
        g.publisher.set_shards(specs)?;
        Ok(())
    })
}

/// Publishes the current bytes of the shards as version `label` (which an orchestrator
/// declares: waited for) and blocks until the version is READY (every slot published), then
/// writes its id (`"mx:<64 hex>"`) to `*version_id` (free it with `mx_string_free`; NULL
/// `version_id`: not returned). `copy` != 0 snapshots the shards first, so the caller may
/// write its memory as soon as this returns; `copy` == 0 publishes in place: the memory must
/// not be written until the version is handed back (`mx_publisher_wait_staged`, ...).
/// `timeout_ms` bounds each wait (declaration, a free snapshot, READY); 0 means 600 s.
/// Thread-safe (serializes on the handle; blocks).
///
/// Errors: `MX_ERR_STATE` (no shards set), `MX_ERR_TIMEOUT`, `MX_ERR_CONTROL` (the manifest was
/// refused, e.g. it disagrees with the declaration: the message names the tensor),
/// `MX_ERR_NIXL`.
///
/// # Safety
/// `publisher` is NULL or live; `label` is NULL or NUL-terminated; `version_id` is NULL or
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_publish(
    publisher: *const Publisher,
    label: *const c_char,
    copy: i32,
    timeout_ms: u64,
    version_id: *mut *mut c_char,
) -> Status {
    call("mx_publisher_publish", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        // SAFETY: the caller's contract.
        let label = unsafe { cstr(label, "label") }?;
        let mut g = lock(&h.inner, "publisher")?;
        let opts = PublishOptions {
            copy: copy != 0,
            patience: Patience::GiveUpAfter(millis_or(timeout_ms, Duration::from_secs(600))),
        };
        let published = runtime()?
            .block_on(g.publisher.publish(label, opts))
            .map_err(|e| FfiError::from(e).context(format!("version {label:?}")))?;
        // SAFETY: the caller's contract.
        unsafe { write_opt_string(version_id, Some(&published.version.to_string())) }
    })
}

/// Blocks until version `label` is handed back by the control plane: every worker of its last
/// stage staged it, a refit to it ended before any stage completed, a later version was
/// committed, or a source released it. Then the memory may be written again (in place) and its
/// snapshot is reused (copy mode). Writes why, as JSON (e.g. `{"Staged":{...}}`), to `*why`
/// when `why` is not NULL (free it with `mx_string_free`). `timeout_ms` 0 means 600 s.
/// Thread-safe (serializes on the handle; blocks).
///
/// Errors: `MX_ERR_TIMEOUT` (nothing released it in time; the version stays held),
/// `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_CONTROL`.
///
/// # Safety
/// `publisher` is NULL or live; `label` is NULL or NUL-terminated; `why` is NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_wait_staged(
    publisher: *const Publisher,
    label: *const c_char,
    timeout_ms: u64,
    why: *mut *mut c_char,
) -> Status {
    call("mx_publisher_wait_staged", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        // SAFETY: the caller's contract.
        let label = unsafe { cstr(label, "label") }?;
        let mut g = lock(&h.inner, "publisher")?;
        let r = runtime()?.block_on(
            g.publisher
                .wait_staged(label, millis_or(timeout_ms, Duration::from_secs(600))),
        )?;
        let json = serde_json::to_string(&r).unwrap_or_else(|_| format!("{r:?}"));
        // SAFETY: the caller's contract.
        unsafe { write_opt_string(why, Some(&json)) }
    })
}

/// Blocks until version `label` is COMMITTED, then hands it back as `mx_publisher_wait_staged`
/// does. `timeout_ms` 0 means 600 s. Thread-safe (serializes on the handle; blocks).
///
/// Errors: `MX_ERR_TIMEOUT`, `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_CONTROL`.
///
/// # Safety
/// `publisher` is NULL or live; `label` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_wait_committed(
    publisher: *const Publisher,
    label: *const c_char,
    timeout_ms: u64,
) -> Status {
    call("mx_publisher_wait_committed", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        // SAFETY: the caller's contract.
        let label = unsafe { cstr(label, "label") }?;
        let mut g = lock(&h.inner, "publisher")?;
        let patience = Patience::GiveUpAfter(millis_or(timeout_ms, Duration::from_secs(600)));
        runtime()?.block_on(g.publisher.wait_committed(label, patience))?;
        Ok(())
    })
}

/// Stops serving version `label` from this slot (the memory may be written again at once) and
/// tells the control plane: workers that did not stage it can no longer pull it whole.
/// `timeout_ms` bounds riding out a control plane that is away; 0 means 600 s. Thread-safe
/// (serializes on the handle; blocks).
///
/// Errors: `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_CONTROL`, `MX_ERR_TIMEOUT`.
///
/// # Safety
/// `publisher` is NULL or live; `label` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_release(
    publisher: *const Publisher,
    label: *const c_char,
    timeout_ms: u64,
) -> Status {
    call("mx_publisher_release", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        // SAFETY: the caller's contract.
        let label = unsafe { cstr(label, "label") }?;
        let mut g = lock(&h.inner, "publisher")?;
        let patience = Patience::GiveUpAfter(millis_or(timeout_ms, Duration::from_secs(600)));
        runtime()?.block_on(g.publisher.release(label, patience))?;
        Ok(())
    })
}

/// The publisher's NIXL agent name (for logs), written to `*name` (free it with
/// `mx_string_free`). Thread-safe.
///
/// # Safety
/// `publisher` is NULL or live; `name` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_agent_name(
    publisher: *const Publisher,
    name: *mut *mut c_char,
) -> Status {
    call("mx_publisher_agent_name", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(publisher, "publisher") }?;
        let g = lock(&h.inner, "publisher")?;
        // SAFETY: the caller's contract.
        unsafe { write_string(name, g.publisher.agent().name(), "name") }
    })
}

/// Frees a publisher: stops serving, deregisters its memory (which stays the caller's). NULL is
/// ignored. Workers still pulling from it fail their stage.
///
/// # Safety
/// `publisher` is NULL or a publisher from `mx_publisher_create` not freed yet, with no call on
/// it in flight.
#[no_mangle]
pub unsafe extern "C" fn mx_publisher_free(publisher: *mut Publisher) {
    call_void("mx_publisher_free", || {
        let _guard = runtime().ok().map(|rt| rt.enter());
        // SAFETY: the caller's contract.
        unsafe { free_handle(publisher) }
    });
}
