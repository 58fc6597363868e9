//! `mx_model`: the model publishers, pullers and declarations are checked against.

use std::ffi::c_char;
use std::path::Path;

use mx_layout::{ModelInfo, TensorSpec};

use crate::util::{self, call, call_void, cstr, dims, parse_dtype, slice, write_out, FfiError};
use crate::{Status, MX_ERR_INVALID_ARGUMENT};

/// A model description: tensor names, dtypes and global shapes, and the architecture fields
/// layouts need (heads, kv heads, head dim, vocab). Immutable once made; thread-safe; may be
/// freed as soon as the handles made from it exist (they keep their own copy).
#[derive(Debug)]
pub struct Model {
    pub(crate) info: ModelInfo,
}

/// One checkpoint tensor, as given to `mx_model_from_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TensorSpecC {
    /// HF (checkpoint) tensor name, e.g. `"model.layers.0.self_attn.q_proj.weight"`.
    pub name: *const c_char,
    /// Element type: a safetensors name (`"BF16"`, `"F32"`, `"F8_E4M3"`, ...) or a torch name
    /// (`"bfloat16"`, `"float32"`, ...), case-insensitive.
    pub dtype: *const c_char,
    /// Global shape, `ndim` elements.
    pub shape: *const u64,
    /// Number of dims (at most `MX_MAX_DIMS`; 0 for a scalar).
    pub ndim: usize,
}

const _: () = assert!(std::mem::size_of::<TensorSpecC>() == 4 * std::mem::size_of::<usize>());

/// Reads a model from an HF checkpoint directory: its `config.json` and the headers of its
/// safetensors files (no weights are read). Blocks on file I/O. Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL), `MX_ERR_IO` (unreadable directory or headers),
/// `MX_ERR_LAYOUT` (config.json missing a field, or tensors that contradict it).
///
/// # Safety
/// `dir` is NULL or a NUL-terminated string; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_model_from_dir(dir: *const c_char, out: *mut *mut Model) -> Status {
    call("mx_model_from_dir", || {
        // SAFETY: the caller's contract.
        let dir = unsafe { cstr(dir, "dir") }?;
        let ckpt = mx_checkpoint::Checkpoint::open(Path::new(dir))?;
        let config = ckpt.config().ok_or_else(|| {
            FfiError::new(
                crate::MX_ERR_IO,
                format!("{dir}: no config.json (a model directory needs one)"),
            )
        })?;
        let info = ModelInfo::from_hf_config(config, ckpt.specs())?;
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, Model { info }) }
    })
}

/// Makes a model from the text of an HF `config.json` (llama family: llama, mistral, qwen2,
/// qwen3; or bert) and its checkpoint tensors (`n` specs; every tensor the architecture needs
/// must be there, with the shape the config implies). Thread-safe.
///
/// Errors: `MX_ERR_INVALID_ARGUMENT` (NULL, bad JSON, a bad dtype or too many dims: the message
/// names the spec's index and tensor), `MX_ERR_LAYOUT` (a missing or inconsistent config field
/// or tensor).
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string; `tensors` points to `n` specs (each with
/// valid strings and `ndim` shape elements) or is NULL with `n == 0`; `out` is NULL or valid for
/// a write.
#[no_mangle]
pub unsafe extern "C" fn mx_model_from_config(
    config_json: *const c_char,
    tensors: *const TensorSpecC,
    n: usize,
    out: *mut *mut Model,
) -> Status {
    call("mx_model_from_config", || {
        // SAFETY: the caller's contract.
        let text = unsafe { cstr(config_json, "config_json") }?;
        let config: serde_json::Value =
            serde_json::from_str(text).map_err(|e| FfiError::arg("config_json", e))?;
        // SAFETY: the caller's contract.
        let specs = unsafe { slice(tensors, n, "tensors") }?;
        let mut list = Vec::with_capacity(specs.len());
        for (i, t) in specs.iter().enumerate() {
            // SAFETY: each spec's strings and shape follow the caller's contract.
            let name = unsafe { cstr(t.name, &format!("tensors[{i}].name")) }?;
            let field = |f: &str| format!("tensors[{i}] ({name}).{f}");
            // SAFETY: as above.
            let dtype = unsafe { cstr(t.dtype, &field("dtype")) }?;
            list.push(TensorSpec {
                name: name.to_string(),
                dtype: parse_dtype(dtype, &field("dtype"))?,
                // SAFETY: as above.
                shape: unsafe { dims(t.shape, t.ndim, &field("shape")) }?,
            });
        }
        let mut names: Vec<&str> = list.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(FfiError::new(
                MX_ERR_INVALID_ARGUMENT,
                format!("tensors: {} is given twice", w[0]),
            ));
        }
        let info = ModelInfo::from_hf_config(&config, list)?;
        // SAFETY: the caller's contract.
        unsafe { write_handle(out, Model { info }) }
    })
}

/// The number of checkpoint tensors of `model`. Thread-safe.
///
/// # Safety
/// `model` is NULL or a live model; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn mx_model_tensor_count(model: *const Model, out: *mut usize) -> Status {
    call("mx_model_tensor_count", || {
        // SAFETY: the caller's contract.
        let m = unsafe { util::handle(model, "model") }?;
        // SAFETY: the caller's contract.
        unsafe { write_out(out, m.info.tensors.len(), "out") }
    })
}

/// Frees a model. NULL is ignored. Handles made from it are not affected.
///
/// # Safety
/// `model` is NULL or a model from `mx_model_from_*` not freed yet, with no call on it in
/// flight.
#[no_mangle]
pub unsafe extern "C" fn mx_model_free(model: *mut Model) {
    call_void("mx_model_free", || {
        // SAFETY: the caller's contract.
        unsafe { free_handle(model) }
    });
}

/// Boxes `v` and writes the pointer to `*out`; on a failed write the box is dropped.
///
/// # Safety
/// `out` is NULL or valid for a write of a pointer.
pub(crate) unsafe fn write_handle<T>(out: *mut *mut T, v: T) -> util::FfiResult {
    let p = Box::into_raw(Box::new(v));
    // SAFETY: the caller's contract.
    if let Err(e) = unsafe { write_out(out, p, "out") } {
        // SAFETY: `p` came from Box::into_raw just above and was not handed out.
        drop(unsafe { Box::from_raw(p) });
        return Err(e);
    }
    Ok(())
}

/// Drops the box behind a handle pointer (NULL is ignored).
///
/// # Safety
/// `p` is NULL or came from [`write_handle`] and is freed once, with no call on it in flight.
pub(crate) unsafe fn free_handle<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(p) });
    }
}
