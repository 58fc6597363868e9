//! `mx_puller`: an inference rank staging versions into host memory the engine owns, applying
//! them in place, and (optionally) served as a control-plane-driven worker.

use std::ffi::{c_char, c_void, CString};
use std::sync::Mutex;

use mx_follower::embedded::{EmbeddedConfig, EmbeddedPuller};
use mx_layout::{DType, SourceManifest, VersionId};
use mx_puller::{DestTensor, ExecOptions, HostRegion};

use crate::model::{free_handle, write_handle, Model};
use crate::util::{
    self, call, call_void, cstr, dims, dtype_cstr, lock, opt_cstr, parse_dtype, parse_layout,
    runtime, slice, write_opt_string, write_out, write_string, FfiError, FfiResult,
};
use crate::{Status, MX_ERR_INVALID_ARGUMENT};

/// An inference process's puller (mx-puller) over host memory the engine owns: its ranks of
/// one inference layout, their registered parameters, staging and the retained copy of the
/// previous version. Calls on one handle serialize (stage and apply block while they hold it);
/// once served (`mx_puller_serve`), the control plane's commands take the same lock.
pub struct Puller {
    inner: Mutex<EmbeddedPuller>,
    /// Parameter and piece descriptions per held rank (immutable; pointers into it are handed
    /// to C).
    ranks: Vec<RankInfo>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller").finish_non_exhaustive()
    }
}

struct PieceC {
    tensor: CString,
    dtype: DType,
    global_shape: Vec<u64>,
    offset: Vec<u64>,
    extent: Vec<u64>,
    at: u64,
}

struct ParamC {
    name: CString,
    dtype: DType,
    shape: Vec<u64>,
    len: u64,
    pieces: Vec<PieceC>,
}

struct RankInfo {
    rank: u32,
    bytes: u64,
    params: Vec<ParamC>,
}

fn rank_info(rl: &mx_layout::RankLayout) -> RankInfo {
    let c = |s: &str| CString::new(s.replace('\0', " ")).unwrap_or_default();
    RankInfo {
        rank: rl.rank,
        bytes: rl.total_bytes,
        params: rl
            .params
            .iter()
            .map(|p| ParamC {
                name: c(&p.name),
                dtype: p.dtype,
                shape: p.shape.clone(),
                len: p.len,
                pieces: p
                    .pieces
                    .iter()
                    .map(|pc| PieceC {
                        tensor: c(&pc.tensor),
                        dtype: pc.dtype,
                        global_shape: pc.global_shape.clone(),
                        offset: pc.region.global_offset.clone(),
                        extent: pc.region.local_shape.clone(),
                        at: pc.offset.saturating_sub(p.offset),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// One parameter of a held rank, as the layout gives it (`mx_puller_param_info`). Pointers
/// stay valid until the puller is freed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ParamInfo {
    /// The engine's parameter name (vLLM names for `tp` layouts, e.g.
    /// `"model.layers.0.self_attn.qkv_proj.weight"`; checkpoint names otherwise).
    pub name: *const c_char,
    /// Element type (`"BF16"`, ...).
    pub dtype: *const c_char,
    /// Local shape on this rank, `ndim` elements.
    pub shape: *const u64,
    /// Number of dims.
    pub ndim: usize,
    /// Bytes of the parameter (the memory to register for it).
    pub len: u64,
    /// The checkpoint boxes it is made of (`mx_puller_piece_info`).
    pub piece_count: usize,
}

/// One checkpoint box inside a parameter (`mx_puller_piece_info`): the parameter's bytes at
/// `offset .. offset + prod(box_shape) * dtype size` are the row-major box (`box_offset`,
/// `box_shape`) of checkpoint tensor `tensor`. Bytes of the parameter in no piece (vocab
/// padding rows) are zero. Pointers stay valid until the puller is freed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PieceInfo {
    /// Checkpoint (HF) tensor name.
    pub tensor: *const c_char,
    /// Element type.
    pub dtype: *const c_char,
    /// The tensor's global shape, `ndim` elements.
    pub global_shape: *const u64,
    /// The box's first element in every dim, `ndim` elements.
    pub box_offset: *const u64,
    /// The box's extent in every dim, `ndim` elements.
    pub box_shape: *const u64,
    /// Number of dims of the three arrays.
    pub ndim: usize,
    /// Byte offset of the box's first byte within the parameter.
    pub offset: u64,
}

/// Memory a puller holds beside the engine's own (`mx_puller_memory_report`), in bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryReportC {
    /// Bytes of the held ranks' layouts (the engine's own parameter bytes).
    pub rank_bytes: u64,
    /// Staging buffers held now.
    pub staging_bytes: u64,
    /// The most staging held at once (at most `rank_bytes` where any plan fits).
    pub staging_bytes_peak: u64,
    /// The retained host copy of the previous version (0 without retention).
    pub retained_bytes: u64,
    /// The process's resident set size now (`VmRSS`; 0 where the platform does not say).
    pub process_rss_bytes: u64,
    /// The process's peak resident set size so far (`VmHWM`; 0 likewise).
    pub process_rss_bytes_peak: u64,
}

/// The engine's host range `addr .. addr + len` for a puller, the error naming `field`.
///
/// # Safety
/// As `mx_puller_register_param`'s contract for `addr`/`len` (which is `HostRegion::new`'s).
unsafe fn host_region(addr: *mut c_void, len: u64, field: &str) -> FfiResult<HostRegion> {
    // SAFETY: the caller's contract.
    unsafe { HostRegion::new(addr as u64, len) }.map_err(|e| FfiError::arg(field, e))
}

/// Creates a puller for ranks `ranks[0..n_ranks]` of inference layout `layout` (`"tp:3"`,
/// `"fsdp:2"`, `"replicated:1"`) of `model` (copied), with a NIXL agent to pull through.
/// `control` (`"http://host:port"`) may be NULL: such a puller stages only from manifests given
/// to `mx_puller_stage_manifests`. With `control` and `worker_id` both given, the layout is
/// registered with the control plane under `worker_id` at once, so publishers cut for it.
/// `retain` 1 keeps a host copy of the previously applied version (1x the ranks' bytes) for
/// `mx_puller_rollback`; 2 keeps it in staging instead (an apply exchanges staging and the
/// registered memory; one buffer of the ranks' bytes less); 0 keeps none. No memory is
/// registered yet. Blocks until connected. Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, a bad layout, repeated or no ranks, `retain` not 0,
/// 1 or 2),
/// `MX_ERR_LAYOUT` (the layout cannot place the model, a rank outside it), `MX_ERR_NIXL`,
/// `MX_ERR_CONTROL`.
///
/// # Safety
/// String arguments are NULL or NUL-terminated; `ranks` points to `n_ranks` values; `model` is
/// NULL or live; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_create(
    control: *const c_char,
    worker_id: *const c_char,
    layout: *const c_char,
    ranks: *const u32,
    n_ranks: usize,
    model: *const Model,
    retain: i32,
    out: *mut *mut Puller,
) -> Status {
    call("mx_puller_create", || {
        // SAFETY: the caller's contract (this and the calls below).
        let control = unsafe { opt_cstr(control, "control") }?;
        // SAFETY: as above.
        let worker_id = unsafe { opt_cstr(worker_id, "worker_id") }?;
        // SAFETY: as above.
        let layout = parse_layout(unsafe { cstr(layout, "layout") }?, "layout")?;
        // SAFETY: as above.
        let ranks = unsafe { slice(ranks, n_ranks, "ranks") }?.to_vec();
        // SAFETY: as above.
        let model = unsafe { util::handle(model, "model") }?;
        if out.is_null() {
            return Err(FfiError::arg("out", "NULL output pointer"));
        }
        if !(0..=2).contains(&retain) {
            return Err(FfiError::arg(
                "retain",
                format!("{retain}: 0 (none), 1 (a copy) or 2 (in staging)"),
            ));
        }
        let puller = runtime()?
            .block_on(EmbeddedPuller::connect(EmbeddedConfig {
                control: control.map(str::to_string),
                worker_id: worker_id.map(str::to_string),
                layout,
                ranks,
                model: model.info.clone(),
                retain: retain != 0,
                retain_in_staging: retain == 2,
                agent_prefix: "mx-ffi-puller".into(),
            }))
            .map_err(|e| match e {
                mx_follower::Error::Puller(e @ mx_puller::Error::BadRanks { .. }) => {
                    FfiError::new(MX_ERR_INVALID_ARGUMENT, format!("ranks: {e}"))
                }
                e => e.into(),
            })?;
        let p = Puller {
            ranks: puller.rank_layouts().iter().map(rank_info).collect(),
            inner: Mutex::new(puller),
        };
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, p) }
    })
}

impl Puller {
    fn rank(&self, rank: u32) -> FfiResult<&RankInfo> {
        self.ranks.iter().find(|r| r.rank == rank).ok_or_else(|| {
            FfiError::arg(
                "rank",
                format!(
                    "{rank} is not one of this puller's ranks {:?}",
                    self.ranks.iter().map(|r| r.rank).collect::<Vec<_>>()
                ),
            )
        })
    }

    fn param(&self, rank: u32, index: usize) -> FfiResult<&ParamC> {
        let r = self.rank(rank)?;
        r.params.get(index).ok_or_else(|| {
            FfiError::arg(
                "index",
                format!(
                    "rank {rank} has {} parameters, not {index}+1",
                    r.params.len()
                ),
            )
        })
    }
}

/// The number of parameters of held rank `rank` (in layout order). Thread-safe; does not take
/// the handle's lock.
///
/// # Safety
/// `puller` is NULL or live; `count` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_param_count(
    puller: *const Puller,
    rank: u32,
    count: *mut usize,
) -> Status {
    call("mx_puller_param_count", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let n = h.rank(rank)?.params.len();
        // SAFETY: the caller's contract.
        unsafe { write_out(count, n, "count") }
    })
}

/// Parameter `index` of held rank `rank`: the name, dtype, shape and byte length to register
/// memory for. Thread-safe; does not take the handle's lock.
///
/// # Safety
/// `puller` is NULL or live; `info` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_param_info(
    puller: *const Puller,
    rank: u32,
    index: usize,
    info: *mut ParamInfo,
) -> Status {
    call("mx_puller_param_info", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let p = h.param(rank, index)?;
        let v = ParamInfo {
            name: p.name.as_ptr(),
            dtype: dtype_cstr(p.dtype).as_ptr(),
            shape: p.shape.as_ptr(),
            ndim: p.shape.len(),
            len: p.len,
            piece_count: p.pieces.len(),
        };
        // SAFETY: the caller's contract.
        unsafe { write_out(info, v, "info") }
    })
}

/// Piece `piece` of parameter `index` of held rank `rank`: which box of which checkpoint tensor
/// sits where in the parameter's bytes. Thread-safe; does not take the handle's lock.
///
/// # Safety
/// `puller` is NULL or live; `info` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_piece_info(
    puller: *const Puller,
    rank: u32,
    index: usize,
    piece: usize,
    info: *mut PieceInfo,
) -> Status {
    call("mx_puller_piece_info", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let p = h.param(rank, index)?;
        let pc = p.pieces.get(piece).ok_or_else(|| {
            FfiError::arg(
                "piece",
                format!(
                    "parameter {} has {} pieces, not {piece}+1",
                    p.name.to_string_lossy(),
                    p.pieces.len()
                ),
            )
        })?;
        let v = PieceInfo {
            tensor: pc.tensor.as_ptr(),
            dtype: dtype_cstr(pc.dtype).as_ptr(),
            global_shape: pc.global_shape.as_ptr(),
            box_offset: pc.offset.as_ptr(),
            box_shape: pc.extent.as_ptr(),
            ndim: pc.global_shape.len(),
            offset: pc.at,
        };
        // SAFETY: the caller's contract.
        unsafe { write_out(info, v, "info") }
    })
}

/// Registers the engine's host memory for parameter `name` of held rank `rank`: `len` bytes at
/// `addr`, holding `dtype` elements of shape `shape[0..ndim]` row-major; dtype, shape and
/// length must be the layout's (`mx_puller_param_info`). Applies write into it in place; its
/// address never changes. Thread-safe (serializes on the handle).
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` naming the parameter (unknown rank or parameter, dtype,
/// shape or length differing from the layout's, registered twice, NULL `addr` with `len` > 0).
///
/// # Safety
/// Until the puller is freed, `addr .. addr + len` stays allocated, readable and writable, and
/// the caller neither reads nor writes it while a stage, apply or rollback of this puller runs
/// (including those a control plane drives once it is served). String arguments are NULL or
/// NUL-terminated; `shape` points to `ndim` values; `puller` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_register_param(
    puller: *const Puller,
    rank: u32,
    name: *const c_char,
    addr: *mut c_void,
    len: u64,
    dtype: *const c_char,
    shape: *const u64,
    ndim: usize,
) -> Status {
    call("mx_puller_register_param", || {
        // SAFETY: the caller's contract (this and the calls below).
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: as above.
        let name = unsafe { cstr(name, "name") }?;
        let field = |f: &str| format!("{f} (rank {rank} parameter {name})");
        // SAFETY: as above.
        let dtype = parse_dtype(unsafe { cstr(dtype, &field("dtype")) }?, &field("dtype"))?;
        // SAFETY: as above.
        let shape = unsafe { dims(shape, ndim, &field("shape")) }?;
        // SAFETY: as above: the range's validity for the puller's life is the contract.
        let memory = unsafe { host_region(addr, len, &field("addr/len")) }?;
        let mut g = lock(&h.inner, "puller")?;
        g.with(|p| {
            p.register_param(
                rank,
                name,
                DestTensor {
                    dtype,
                    shape,
                    memory: Box::new(memory),
                },
            )
        })??;
        Ok(())
    })
}

/// Registers one host buffer laid out as the whole of held rank `rank` (every parameter at its
/// layout offset, `len` = the rank's bytes), instead of one registration per parameter.
/// Thread-safe (serializes on the handle).
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (unknown rank, wrong length, parameters of the rank
/// registered already).
///
/// # Safety
/// As `mx_puller_register_param`, for `addr .. addr + len`.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_register_rank(
    puller: *const Puller,
    rank: u32,
    addr: *mut c_void,
    len: u64,
) -> Status {
    call("mx_puller_register_rank", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: the caller's contract for the range.
        let memory = unsafe { host_region(addr, len, &format!("addr/len (rank {rank})")) }?;
        let mut g = lock(&h.inner, "puller")?;
        g.with(|p| p.register_rank(rank, Box::new(memory)))??;
        Ok(())
    })
}

/// Stages `version` (a label, or a version id `"mx:<hex>"`) from the control plane's manifests:
/// plans the exact byte ranges the held ranks need, pulls them over NIXL into staging and
/// verifies every region against its source's digest. The registered memory is not touched.
/// Writes the version id to `*version_id` when not NULL (free it with `mx_string_free`). The
/// control plane is not told (a refit stages through `mx_puller_serve`'s worker itself).
/// Thread-safe (serializes on the handle; blocks for the pull).
///
/// Errors: `MX_ERR_STATE` (no control plane, or the version is not READY),
/// `MX_ERR_UNKNOWN_VERSION`, `MX_ERR_LAYOUT` (the sources do not cover a parameter),
/// `MX_ERR_NIXL` (a source is unreachable or a READ failed), `MX_ERR_VERIFY` (bytes that do not
/// match, or an answer whose shards are not proven to be the version's or leave one out).
///
/// # Safety
/// `puller` is NULL or live; `version` is NULL or NUL-terminated; `version_id` is NULL or valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_stage(
    puller: *const Puller,
    version: *const c_char,
    version_id: *mut *mut c_char,
) -> Status {
    call("mx_puller_stage", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: the caller's contract.
        let version = unsafe { cstr(version, "version") }?;
        let mut g = lock(&h.inner, "puller")?;
        let v = runtime()?.block_on(g.resolve(version))?;
        g.stage_resolved(&v, &ExecOptions::default())
            .map_err(|e| FfiError::from(e).context(format!("version {:?}", v.label)))?;
        // SAFETY: the caller's contract.
        unsafe { write_opt_string(version_id, Some(&v.id.to_string())) }
    })
}

/// Stages version `version_id` (`"mx:<hex>"`) from `manifests_json`, a JSON array of source
/// manifests (as the control plane serves them), without a control plane. The manifests must be
/// the version's (their shards' Merkle root is the id). Thread-safe (serializes on the handle;
/// blocks for the pull).
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (bad id or JSON), `MX_ERR_VERIFY` (manifests of another
/// version, or bytes that do not match), and those of `mx_puller_stage`.
///
/// # Safety
/// `puller` is NULL or live; strings are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_stage_manifests(
    puller: *const Puller,
    version_id: *const c_char,
    manifests_json: *const c_char,
) -> Status {
    call("mx_puller_stage_manifests", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: the caller's contract.
        let id = unsafe { cstr(version_id, "version_id") }?;
        let id: VersionId = id.parse().map_err(|e| FfiError::arg("version_id", e))?;
        // SAFETY: the caller's contract.
        let text = unsafe { cstr(manifests_json, "manifests_json") }?;
        let manifests: Vec<SourceManifest> =
            serde_json::from_str(text).map_err(|e| FfiError::arg("manifests_json", e))?;
        let mut g = lock(&h.inner, "puller")?;
        g.stage(id, &manifests, &ExecOptions::default())?;
        Ok(())
    })
}

/// Installs version `version_id` (`"mx:<hex>"`; NULL: the staged version) into the registered
/// memory in place: from staging, from the retained copy (a rollback), or nothing when it is
/// resident already. Addresses never change. The version resident before is retained first
/// (with retention). Call it at a safe point: the engine must not read the memory meanwhile.
/// Thread-safe (serializes on the handle; blocks for the copy).
///
/// Errors: `MX_ERR_UNKNOWN_VERSION` (neither staged, retained nor resident: the message names
/// all three), `MX_ERR_STATE` (a parameter without memory), `MX_ERR_INVALID_ARGUMENT` (bad id).
///
/// # Safety
/// `puller` is NULL or live; `version_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_apply(
    puller: *const Puller,
    version_id: *const c_char,
) -> Status {
    call("mx_puller_apply", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: the caller's contract.
        let given = unsafe { opt_cstr(version_id, "version_id") }?;
        let mut g = lock(&h.inner, "puller")?;
        let id = given
            .map(|s| s.parse::<VersionId>())
            .transpose()
            .map_err(|e| FfiError::arg("version_id", e))?;
        g.apply(id)?;
        Ok(())
    })
}

/// Restores the retained copy (the version applied before the current one) into the
/// registered memory in place, with no source involved. Thread-safe (serializes on the handle;
/// blocks for the copy).
///
/// Errors: `MX_ERR_STATE` (retention off, nothing retained yet, a parameter without memory).
///
/// # Safety
/// `puller` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_rollback(puller: *const Puller) -> Status {
    call("mx_puller_rollback", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let mut g = lock(&h.inner, "puller")?;
        g.rollback()?;
        Ok(())
    })
}

/// The versions the puller holds: resident (in the registered memory), retained (the host
/// copy) and staged. Each output that is not NULL receives an owned string (free it with
/// `mx_string_free`), or NULL when nothing is held there. Thread-safe (serializes on the
/// handle).
///
/// # Safety
/// `puller` is NULL or live; each output is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_versions(
    puller: *const Puller,
    resident: *mut *mut c_char,
    retained: *mut *mut c_char,
    staged: *mut *mut c_char,
) -> Status {
    call("mx_puller_versions", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let mut g = lock(&h.inner, "puller")?;
        let v = g.with(|p| p.versions())?;
        // SAFETY: the caller's contract (each output).
        unsafe {
            let resident_s = v.resident.as_ref().map(ToString::to_string);
            let retained_s = v.retained.as_ref().map(ToString::to_string);
            let staged_s = v.staged.as_ref().map(ToString::to_string);
            write_opt_string(resident, resident_s.as_deref())?;
            write_opt_string(retained, retained_s.as_deref())?;
            write_opt_string(staged, staged_s.as_deref())
        }
    })
}

/// The memory the puller holds beside the engine's own. Thread-safe (serializes on the
/// handle).
///
/// # Safety
/// `puller` is NULL or live; `report` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_memory_report(
    puller: *const Puller,
    report: *mut MemoryReportC,
) -> Status {
    call("mx_puller_memory_report", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let mut g = lock(&h.inner, "puller")?;
        let m = g.with(|p| p.memory_report())?;
        let v = MemoryReportC {
            rank_bytes: h.ranks.iter().map(|r| r.bytes).sum(),
            staging_bytes: m.staging_bytes,
            staging_bytes_peak: m.staging_bytes_peak,
            retained_bytes: m.retained_bytes,
            process_rss_bytes: m.process_rss_bytes,
            process_rss_bytes_peak: m.process_rss_bytes_peak,
        };
        // SAFETY: the caller's contract.
        unsafe { write_out(report, v, "report") }
    })
}

/// blake3 of every registered parameter's bytes, per held rank, as JSON
/// (`[{"rank":0,"tensors":{"name":"<hex>",...}},...]`), written to `*json` (free it with
/// `mx_string_free`). Thread-safe (serializes on the handle; reads every byte).
///
/// Errors: `MX_ERR_STATE` (a parameter without memory).
///
/// # Safety
/// `puller` is NULL or live; `json` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_live_digests(
    puller: *const Puller,
    json: *mut *mut c_char,
) -> Status {
    call("mx_puller_live_digests", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        let mut g = lock(&h.inner, "puller")?;
        let d = g.with(|p| p.live_digests())??;
        let text = serde_json::to_string(&d)
            .map_err(|e| FfiError::new(crate::MX_ERR_INTERNAL, e.to_string()))?;
        // SAFETY: the caller's contract.
        unsafe { write_string(json, &text, "json") }
    })
}

/// Serves the puller as worker `worker_id` of the control plane it was created with: the
/// engine HTTP routes (Dynamo's contract: pause, resume, apply of staged or retained versions,
/// version read-back; no generation: the engine declares no model, so refits skip their
/// post-update generation) on `listen` (`"127.0.0.1:0"` picks a free port), registration with
/// the control plane, and its command stream (Stage) on the library's runtime in the
/// background. Every parameter must have memory. The routes' URL is written to `*url` when not
/// NULL (free it with `mx_string_free`). The other puller calls keep working and serialize with
/// what the control plane drives. Thread-safe (serializes on the handle; blocks until
/// registered).
///
/// Errors: `MX_ERR_STATE` (no control plane, served already, a parameter without memory),
/// `MX_ERR_INVALID_ARGUMENT` (bad address), `MX_ERR_CONTROL` (the worker id is held by another
/// process, or the registration was refused).
///
/// # Safety
/// `puller` is NULL or live; strings are NULL or NUL-terminated; `url` is NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_serve(
    puller: *const Puller,
    worker_id: *const c_char,
    listen: *const c_char,
    url: *mut *mut c_char,
) -> Status {
    call("mx_puller_serve", || {
        // SAFETY: the caller's contract.
        let h = unsafe { util::handle(puller, "puller") }?;
        // SAFETY: the caller's contract.
        let worker_id = unsafe { cstr(worker_id, "worker_id") }?;
        // SAFETY: the caller's contract.
        let listen = unsafe { cstr(listen, "listen") }?;
        let http: std::net::SocketAddr = listen
            .parse()
            .map_err(|e| FfiError::arg("listen", format!("{listen:?}: {e}")))?;
        let mut g = lock(&h.inner, "puller")?;
        let served_url =
            runtime()?.block_on(g.serve(worker_id, http, mx_control::EngineApi::Dynamo))?;
        // SAFETY: the caller's contract.
        unsafe { write_opt_string(url, Some(&served_url)) }
    })
}

/// Frees a puller. A served puller stops serving first (its routes answer 410 Gone, its
/// command stream ends). The registered memory stays the caller's and is not touched after
/// this returns. NULL is ignored.
///
/// # Safety
/// `puller` is NULL or a puller from `mx_puller_create` not freed yet, with no call on it in
/// flight.
#[no_mangle]
pub unsafe extern "C" fn mx_puller_free(puller: *mut Puller) {
    call_void("mx_puller_free", || {
        if puller.is_null() {
            return;
        }
        // SAFETY: the caller's contract: a live handle with no call in flight.
        let h = unsafe { &*puller };
        let rt = runtime().ok();
        if let Some(rt) = rt {
            let mut g = h
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            rt.block_on(g.stop_serving("the engine freed its puller"));
        }
        let _guard = rt.map(|rt| rt.enter());
        // SAFETY: the caller's contract.
        unsafe { free_handle(puller) }
    });
}
