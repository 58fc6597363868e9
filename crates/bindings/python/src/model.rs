//! `mx._mx.Model`: the model publishers and pullers check shards and parameters against.

use std::path::PathBuf;

use mx_layout::{DType, LayoutSpec, ModelInfo, RankLayout, TensorSpec};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{json, Value};

use crate::errors::{chain, layout_error, mx_error};

/// A model description: checkpoint tensor names, dtypes and global shapes, and the architecture
/// fields layouts need (heads, kv heads, head dim, vocab). Immutable.
#[pyclass(module = "mx._mx", frozen)]
pub(crate) struct Model {
    pub(crate) info: ModelInfo,
}

/// A rank's layout as JSON: `{"rank", "bytes", "params": [{"name", "dtype", "shape", "offset",
/// "nbytes", "pieces": [{"tensor", "dtype", "global_shape", "box_offset", "box_shape",
/// "offset"}]}]}` (piece offsets are within the parameter, bytes).
pub(crate) fn rank_layout_json(rl: &RankLayout) -> Value {
    json!({
        "rank": rl.rank,
        "bytes": rl.total_bytes,
        "params": rl.params.iter().map(|pa| json!({
            "name": pa.name,
            "dtype": pa.dtype.to_string(),
            "shape": pa.shape,
            "offset": pa.offset,
            "nbytes": pa.len,
            "pieces": pa.pieces.iter().map(|pc| json!({
                "tensor": pc.tensor,
                "dtype": pc.dtype.to_string(),
                "global_shape": pc.global_shape,
                "box_offset": pc.region.global_offset,
                "box_shape": pc.region.local_shape,
                "offset": pc.offset.saturating_sub(pa.offset),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Parses `(name, dtype, shape)` triples strictly: a bad dtype names the tensor, a name given
/// twice is an error.
pub(crate) fn tensor_specs(
    py: Python<'_>,
    tensors: Vec<(String, String, Vec<u64>)>,
) -> PyResult<Vec<TensorSpec>> {
    let mut specs = Vec::with_capacity(tensors.len());
    for (name, dtype, shape) in tensors {
        let dtype: DType = dtype
            .parse()
            .map_err(|e| layout_error(py, &format!("tensor {name}: dtype"), &e))?;
        specs.push(TensorSpec { name, dtype, shape });
    }
    let mut names: Vec<&str> = specs.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(PyValueError::new_err(format!(
            "tensors: {} is given twice",
            w[0]
        )));
    }
    Ok(specs)
}

#[pymethods]
impl Model {
    /// Reads a model from an HF checkpoint directory: its `config.json` and the headers of its
    /// safetensors files (no weights are read).
    #[staticmethod]
    fn from_dir(py: Python<'_>, dir: PathBuf) -> PyResult<Model> {
        let ckpt = mx_checkpoint::Checkpoint::open(&dir)
            .map_err(|e| mx_error(py, format!("{}: {}", dir.display(), chain(&e)), None))?;
        let config = ckpt.config().ok_or_else(|| {
            mx_error(
                py,
                format!(
                    "{}: no config.json (a model directory needs one)",
                    dir.display()
                ),
                Some("InvalidArgument"),
            )
        })?;
        let info = ModelInfo::from_hf_config(config, ckpt.specs())
            .map_err(|e| layout_error(py, &dir.display().to_string(), &e))?;
        Ok(Model { info })
    }

    /// Makes a model from the text of an HF `config.json` (llama family or bert) and its
    /// checkpoint tensors as `(name, dtype, shape)`.
    #[staticmethod]
    fn from_config(
        py: Python<'_>,
        config_json: &str,
        tensors: Vec<(String, String, Vec<u64>)>,
    ) -> PyResult<Model> {
        let config: serde_json::Value = serde_json::from_str(config_json)
            .map_err(|e| PyValueError::new_err(format!("config_json: {e}")))?;
        let specs = tensor_specs(py, tensors)?;
        let info = ModelInfo::from_hf_config(&config, specs)
            .map_err(|e| layout_error(py, "config", &e))?;
        Ok(Model { info })
    }

    /// Every checkpoint tensor as `(name, dtype, shape)`, sorted by name; dtypes are
    /// safetensors names (`"BF16"`, `"F32"`, ...).
    fn tensors(&self) -> Vec<(String, String, Vec<u64>)> {
        self.info
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype.to_string(), t.shape.clone()))
            .collect()
    }

    /// `(num_heads, num_kv_heads, head_dim, vocab_size)`.
    fn dims(&self) -> (u64, u64, u64, u64) {
        let m = &self.info;
        (m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size)
    }

    /// Rank `rank` of `layout` for this model as JSON text ([`rank_layout_json`]): its
    /// parameters under the layout's names and the checkpoint boxes each is made of. Pure: no
    /// control plane.
    fn rank_layout(&self, py: Python<'_>, layout: &str, rank: u32) -> PyResult<String> {
        let spec: LayoutSpec = layout.parse().map_err(|e| layout_error(py, "layout", &e))?;
        let rl = mx_layout::rank_layout(&self.info, spec, rank)
            .map_err(|e| layout_error(py, &format!("layout {spec} rank {rank}"), &e))?;
        Ok(rank_layout_json(&rl).to_string())
    }

    /// The FP8 block-quantized parameters of rank `rank` of `layout` as JSON text
    /// ([`mx_layout::fp8::fp8_params`]): `[{"name", "shape", "scale_name", "scale_shape",
    /// "pieces": [{"tensor", "grid_shape", "grid_offset", "grid_box", "offset"}]}]`.
    fn fp8_layout(&self, py: Python<'_>, layout: &str, rank: u32) -> PyResult<String> {
        let spec: LayoutSpec = layout.parse().map_err(|e| layout_error(py, "layout", &e))?;
        let what = format!("layout {spec} rank {rank}");
        let rl = mx_layout::rank_layout(&self.info, spec, rank)
            .map_err(|e| layout_error(py, &what, &e))?;
        let params = mx_layout::fp8::fp8_params(&rl).map_err(|e| layout_error(py, &what, &e))?;
        let out: Vec<Value> = params
            .iter()
            .map(|p| {
                json!({
                    "name": p.name,
                    "shape": p.shape,
                    "scale_name": p.scale_name,
                    "scale_shape": p.scale_shape,
                    "pieces": p.pieces.iter().map(|pc| json!({
                        "tensor": pc.tensor,
                        "grid_shape": pc.grid_shape,
                        "grid_offset": pc.grid.global_offset,
                        "grid_box": pc.grid.local_shape,
                        "offset": pc.offset,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        Ok(Value::Array(out).to_string())
    }

    fn __repr__(&self) -> String {
        format!(
            "Model(family={:?}, tensors={}, heads={}, kv_heads={}, head_dim={}, vocab={})",
            self.info.family,
            self.info.tensors.len(),
            self.info.num_heads,
            self.info.num_kv_heads,
            self.info.head_dim,
            self.info.vocab_size
        )
    }
}
