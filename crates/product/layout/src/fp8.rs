//! FP8 on the way to an engine: where an engine serving 128x128 block-quantized FP8 (the format
//! vLLM loads for DeepSeek-V3-style checkpoints: `quant_method: fp8`, `weight_block_size:
//! [128, 128]`) gets its rank's e4m3 weights and f32 block scales, from a bf16 version. Geometry
//! only (pure); the quantizer runs where the engine's bytes are (`mx.fp8` in Python).
//!
//! Quantization happens on the inference side, from the rank's pulled bf16 bytes: the trainer
//! publishes what it holds and stays unaware (one bf16 version serves bf16 and FP8 engines
//! alike), and no trainer rank has to hold a whole 128x128 block (FSDP's row chunks and
//! Megatron's shards do not fall on block boundaries, so a trainer-side quantizer would need a
//! collective per step). The price is the wire: bf16 bytes, 2x the e4m3 ones.
//!
//! Which parameters: the linear weights of a vLLM `tp:N` / `tp-ep:N` rank (`qkv_proj`, `o_proj`,
//! `gate_up_proj`, `down_proj`, the shared expert's, and the fused experts' `w13_weight` /
//! `w2_weight`); embeddings, `lm_head`, norms, routers, the shared-expert gate and biases stay in
//! their dtype (the DeepSeek-V3 FP8 checkpoints' convention). Each quantized parameter `P` of
//! shape `[.., R, C]` becomes `P` in e4m3 (same shape) plus `P_scale_inv` (vLLM's name: a
//! multiplier, `w ~= q * s`), f32, one scale per 128x128 block of each checkpoint tensor the
//! parameter is made of, in the parameter's piece order: `[sum of the pieces' block rows, C/128]`
//! for a fused 2-D parameter (`qkv_proj.weight_scale_inv` = q's block rows, then k's, then v's),
//! `[L, 2 ceil(I_p/128), ceil(H/128)]` for `w13_weight_scale_inv` (vLLM's `Fp8MoEMethod`).
//!
//! Blocks are those of each checkpoint tensor (its rows and columns from 0 in steps of 128, the
//! last ones short), so a rank's piece must start on a block boundary and end on one or at the
//! tensor's edge in both of its last two dims: then quantizing the piece alone gives exactly the
//! bytes and scales of quantizing the whole tensor and slicing it. A piece that cuts a block is
//! refused naming the tensor and the block (vLLM refuses those tensor-parallel sizes too:
//! `validate_fp8_block_shape`).

use crate::{DType, Error, RankLayout, TensorBox};

/// The block edge of vLLM's FP8 block format (`weight_block_size: [128, 128]`).
pub const BLOCK: u64 = 128;

/// Whether a vLLM parameter is quantized to FP8 blocks (see the module docs).
pub fn quantized(name: &str) -> bool {
    const LINEAR: [&str; 6] = [
        ".qkv_proj.weight",
        ".o_proj.weight",
        ".gate_up_proj.weight",
        ".down_proj.weight",
        ".w13_weight",
        ".w2_weight",
    ];
    LINEAR.iter().any(|s| name.ends_with(s))
}

/// One piece's scales: the box of its checkpoint tensor's global scale grid
/// (`[.., ceil(R/128), ceil(C/128)]`) and where it lies in the scale parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScalePiece {
    /// The checkpoint tensor.
    pub tensor: String,
    /// Its global scale grid's shape.
    pub grid_shape: Vec<u64>,
    /// The piece's box of that grid.
    pub grid: TensorBox,
    /// Byte offset of the box (row-major, f32) within the scale parameter.
    pub offset: u64,
}

/// A parameter an FP8 engine holds as e4m3 weights plus f32 block scales.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Param {
    /// The weight parameter (e4m3, the bf16 parameter's shape).
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The scale parameter (`{name}_scale_inv`, f32).
    pub scale_name: String,
    /// The scale parameter's shape.
    pub scale_shape: Vec<u64>,
    /// Per piece of the weight parameter (same order), its scales.
    pub pieces: Vec<ScalePiece>,
}

fn ceil_blocks(n: u64) -> u64 {
    n.div_ceil(BLOCK)
}

/// The quantized parameters of rank `rl` (see the module docs), in layout order.
///
/// # Errors
/// [`Error::ImpossibleLayout`] naming the tensor and block when a piece cuts a 128x128 block,
/// or a parameter whose pieces have different block-column counts; [`Error::Mismatch`] for a
/// quantized parameter that is not 2-D or 3-D or not a float type.
pub fn fp8_params(rl: &RankLayout) -> Result<Vec<Fp8Param>, Error> {
    let mut out = Vec::new();
    for p in rl.params.iter().filter(|p| quantized(&p.name)) {
        let bad = |tensor: &str, reason: String| Error::ImpossibleLayout {
            layout: format!("{} rank {} (fp8 128x128 blocks)", rl.layout, rl.rank),
            tensor: tensor.to_string(),
            reason,
        };
        if !matches!(p.dtype, DType::BF16 | DType::F16 | DType::F32)
            || !(2..=3).contains(&p.shape.len())
        {
            return Err(Error::Mismatch {
                tensor: p.name.clone(),
                what: "dtype",
                source_value: format!("{} {:?}", p.dtype, p.shape),
                dest_value: "a 2-D or 3-D float weight to quantize".into(),
            });
        }
        let mut pieces = Vec::with_capacity(p.pieces.len());
        let mut grid_rows = 0u64;
        let mut grid_cols = None;
        let mut offset = 0u64;
        for pc in &p.pieces {
            let n = pc.global_shape.len();
            if n < 2 {
                return Err(bad(
                    &pc.tensor,
                    "a 1-D tensor in a quantized parameter".into(),
                ));
            }
            let mut grid_shape = pc.global_shape.clone();
            let mut grid = pc.region.clone();
            for d in [n - 2, n - 1] {
                let (extent, off, len) = (
                    pc.global_shape[d],
                    pc.region.global_offset[d],
                    pc.region.local_shape[d],
                );
                let end = off + len;
                if off % BLOCK != 0 || (end % BLOCK != 0 && end != extent) {
                    let which = if d == n - 1 { "column" } else { "row" };
                    let block = off / BLOCK;
                    return Err(bad(
                        &pc.tensor,
                        format!(
                            "this rank's {which}s [{off}, {end}) cut 128x128 block {which} {block} \
                             (blocks start at multiples of 128): the layout splits the tensor \
                             inside a block"
                        ),
                    ));
                }
                grid_shape[d] = ceil_blocks(extent);
                grid.global_offset[d] = off / BLOCK;
                grid.local_shape[d] = ceil_blocks(end) - off / BLOCK;
            }
            let cols = grid.local_shape[n - 1];
            if *grid_cols.get_or_insert(cols) != cols {
                return Err(bad(
                    &pc.tensor,
                    format!(
                        "its {cols} block columns differ from the other pieces' of {}",
                        p.name
                    ),
                ));
            }
            let elems = grid.numel().ok_or_else(|| Error::Overflow {
                what: "scale grid",
                tensor: pc.tensor.clone(),
            })?;
            grid_rows += elems / cols.max(1);
            pieces.push(ScalePiece {
                tensor: pc.tensor.clone(),
                grid_shape,
                grid,
                offset,
            });
            offset += elems * 4;
        }
        let cols = grid_cols.unwrap_or(0);
        let lead: u64 = p.shape[..p.shape.len() - 2].iter().product();
        if lead == 0 || !grid_rows.is_multiple_of(lead) {
            return Err(bad(
                &p.name,
                format!("{grid_rows} block rows do not stack over {lead} experts"),
            ));
        }
        let mut scale_shape = p.shape[..p.shape.len() - 2].to_vec();
        scale_shape.extend([grid_rows / lead, cols]);
        out.push(Fp8Param {
            name: p.name.clone(),
            shape: p.shape.clone(),
            scale_name: format!("{}_scale_inv", p.name),
            scale_shape,
            pieces,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests: panics are failures")]

    use super::*;
    use crate::{rank_layout, LayoutSpec, ModelInfo, TensorSpec};

    /// A Qwen3-MoE with FP8-sized dimensions: hidden 256, 4 heads of 128 in 2 groups, 4 experts
    /// of intermediate 256 (no dense MLP), and a vocabulary of 300.
    fn model() -> ModelInfo {
        let mut t = Vec::new();
        let mut add = |name: &str, shape: Vec<u64>| {
            t.push(TensorSpec {
                name: name.into(),
                dtype: DType::BF16,
                shape,
            })
        };
        add("model.embed_tokens.weight", vec![300, 256]);
        add("lm_head.weight", vec![300, 256]);
        add("model.norm.weight", vec![256]);
        let l = "model.layers.0.";
        add(&format!("{l}input_layernorm.weight"), vec![256]);
        add(&format!("{l}post_attention_layernorm.weight"), vec![256]);
        add(&format!("{l}self_attn.q_proj.weight"), vec![512, 256]);
        add(&format!("{l}self_attn.k_proj.weight"), vec![256, 256]);
        add(&format!("{l}self_attn.v_proj.weight"), vec![256, 256]);
        add(&format!("{l}self_attn.o_proj.weight"), vec![256, 512]);
        add(&format!("{l}mlp.gate.weight"), vec![4, 256]);
        for e in 0..4 {
            add(
                &format!("{l}mlp.experts.{e}.gate_proj.weight"),
                vec![256, 256],
            );
            add(
                &format!("{l}mlp.experts.{e}.up_proj.weight"),
                vec![256, 256],
            );
            add(
                &format!("{l}mlp.experts.{e}.down_proj.weight"),
                vec![256, 256],
            );
        }
        let cfg = serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 300,
            "num_hidden_layers": 1, "intermediate_size": 384, "moe_intermediate_size": 256,
            "num_experts": 4, "tie_word_embeddings": false,
        });
        ModelInfo::from_hf_config(&cfg, t).unwrap()
    }

    #[test]
    fn scale_parameters_have_vllms_shapes_and_piece_order() {
        let m = model();
        let rl = rank_layout(&m, LayoutSpec::from_str_ok("tp:2"), 1).unwrap();
        let ps = fp8_params(&rl).unwrap();
        let names: Vec<&str> = ps.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.mlp.experts.routed_experts.w13_weight",
                "model.layers.0.mlp.experts.routed_experts.w2_weight",
                "model.layers.0.self_attn.qkv_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
            ]
        );
        let by = |n: &str| ps.iter().find(|p| p.name.ends_with(n)).unwrap();
        // w13 [4, 2*128, 256]: per expert gate's block row 1, then up's.
        let w13 = by("w13_weight");
        assert_eq!(w13.scale_name, format!("{}_scale_inv", w13.name));
        assert_eq!(w13.scale_shape, vec![4, 2, 2]);
        assert_eq!(w13.pieces.len(), 8);
        assert_eq!(w13.pieces[0].grid.global_offset, vec![1, 0]);
        assert_eq!(
            w13.pieces[1].tensor,
            "model.layers.0.mlp.experts.0.up_proj.weight"
        );
        assert_eq!(w13.pieces[1].offset, 2 * 4);
        // w2 [4, 256, 128]: down's block column 1 of each expert.
        assert_eq!(by("w2_weight").scale_shape, vec![4, 2, 1]);
        assert_eq!(by("w2_weight").pieces[3].grid.global_offset, vec![0, 1]);
        // qkv: q rows 256..512 (block rows 2, 3), k and v rows 128..256 (block row 1 each).
        let qkv = by("qkv_proj.weight");
        assert_eq!(qkv.scale_shape, vec![4, 2]);
        assert_eq!(qkv.pieces[0].grid.global_offset, vec![2, 0]);
        assert_eq!(qkv.pieces[2].offset, 3 * 2 * 4);
        assert_eq!(by("o_proj.weight").scale_shape, vec![2, 2]);
    }

    #[test]
    fn a_slice_that_cuts_a_block_is_refused_naming_the_tensor_and_block() {
        let m = model();
        // tp=4: 64 of each expert's 256 intermediate rows per rank cut block row 0.
        let rl = rank_layout(&m, LayoutSpec::from_str_ok("tp:4"), 1).unwrap();
        let err = fp8_params(&rl).unwrap_err().to_string();
        assert!(
            err.contains("model.layers.0.mlp.experts.0.gate_proj.weight"),
            "{err}"
        );
        assert!(
            err.contains("rows [64, 128) cut 128x128 block row 0"),
            "{err}"
        );
        // The same for attention: 4 kv heads of 64 (k_proj's 256 rows) over 4 ranks.
        let mut dense = m.clone();
        dense.tensors.retain(|t| !t.name.contains("mlp."));
        dense.moe = None;
        (dense.num_heads, dense.num_kv_heads, dense.head_dim) = (8, 4, 64);
        let rl = rank_layout(&dense, LayoutSpec::from_str_ok("tp:4"), 1).unwrap();
        let err = fp8_params(&rl).unwrap_err().to_string();
        assert!(err.contains("self_attn.k_proj.weight"), "{err}");
        // Whole tensors at tp=1 are always whole blocks, a short last one included.
        let rl = rank_layout(&m, LayoutSpec::from_str_ok("tp:1"), 0).unwrap();
        assert_eq!(fp8_params(&rl).unwrap().len(), 4);
    }

    impl LayoutSpec {
        fn from_str_ok(s: &str) -> LayoutSpec {
            s.parse().unwrap()
        }
    }
}
