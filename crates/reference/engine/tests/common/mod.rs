//! Test helpers shared by the integration tests: slicing rank buffers out of full tensors (an
//! implementation independent of the crate's reassembly) and a tiny synthetic llama.
#![allow(dead_code, reason = "each test binary uses a subset")]

use std::collections::BTreeMap;

use mx_layout::{DType, RankLayout, TensorBox};

/// HF-named tensors as the engine takes them.
pub(crate) type Tensors = BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>;

/// Byte range of element run starting at multi-index (`region.global_offset` + `local`) in a
/// row-major tensor of `shape`.
fn flat_index(shape: &[u64], at: &[u64]) -> u64 {
    shape.iter().zip(at).fold(0u64, |acc, (&d, &i)| acc * d + i)
}

/// Copies the row-major box `region` of a full tensor (`full`, of `shape`, element size `es`).
pub(crate) fn slice_box(full: &[u8], shape: &[u64], es: usize, region: &TensorBox) -> Vec<u8> {
    let n = shape.len();
    if n == 0 {
        return full[..es].to_vec();
    }
    let run = region.local_shape[n - 1] as usize;
    let rows: u64 = region.local_shape[..n - 1].iter().product();
    let mut out = Vec::with_capacity(rows as usize * run * es);
    for r in 0..rows {
        // Decompose r over the leading local dims.
        let mut at = vec![0u64; n];
        let mut rem = r;
        for d in (0..n - 1).rev() {
            at[d] = region.global_offset[d] + rem % region.local_shape[d];
            rem /= region.local_shape[d];
        }
        at[n - 1] = region.global_offset[n - 1];
        let start = flat_index(shape, &at) as usize * es;
        out.extend_from_slice(&full[start..start + run * es]);
    }
    out
}

/// A rank's live buffer: garbage-filled, then every piece sliced in at its offset and every
/// zero-fill range zeroed.
pub(crate) fn build_rank_buffer(layout: &RankLayout, tensors: &Tensors) -> Vec<u8> {
    let mut buf = vec![0xEEu8; layout.total_bytes as usize];
    for p in &layout.params {
        for piece in &p.pieces {
            let (dtype, shape, bytes) = &tensors[&piece.tensor];
            let part = slice_box(bytes, shape, dtype.size_bytes() as usize, &piece.region);
            let o = piece.offset as usize;
            buf[o..o + part.len()].copy_from_slice(&part);
        }
        if let Some((o, l)) = p.zero_fill {
            buf[o as usize..(o + l) as usize].fill(0);
        }
    }
    buf
}

/// Config of a tiny llama: hidden 8, 2 heads (head dim 4), 1 kv head, 2 layers, vocab 40, tied.
pub(crate) fn tiny_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 40,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": true,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2
    })
}

/// Deterministic pseudo-random F32 weights for [`tiny_config`] (norms are 1).
pub(crate) fn tiny_tensors() -> Tensors {
    tiny_tensors_seeded(0x1234_5678_9abc_def0)
}

/// As [`tiny_tensors`] from another seed.
pub(crate) fn tiny_tensors_seeded(seed: u64) -> Tensors {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.8
    };
    let mut t = Tensors::new();
    let mut add = |name: String, shape: Vec<u64>, norm: bool| {
        let n: u64 = shape.iter().product();
        let bytes = (0..n)
            .flat_map(|_| if norm { 1.0f32 } else { next() }.to_le_bytes())
            .collect();
        t.insert(name, (DType::F32, shape, bytes));
    };
    add("model.embed_tokens.weight".into(), vec![40, 8], false);
    add("model.norm.weight".into(), vec![8], true);
    for i in 0..2 {
        let l = format!("model.layers.{i}");
        add(format!("{l}.self_attn.q_proj.weight"), vec![8, 8], false);
        add(format!("{l}.self_attn.k_proj.weight"), vec![4, 8], false);
        add(format!("{l}.self_attn.v_proj.weight"), vec![4, 8], false);
        add(format!("{l}.self_attn.o_proj.weight"), vec![8, 8], false);
        add(format!("{l}.mlp.gate_proj.weight"), vec![12, 8], false);
        add(format!("{l}.mlp.up_proj.weight"), vec![12, 8], false);
        add(format!("{l}.mlp.down_proj.weight"), vec![8, 12], false);
        add(format!("{l}.input_layernorm.weight"), vec![8], true);
        add(
            format!("{l}.post_attention_layernorm.weight"),
            vec![8],
            true,
        );
    }
    t
}

/// The model's tensor list for mx-layout.
pub(crate) fn specs(tensors: &Tensors) -> Vec<mx_layout::TensorSpec> {
    tensors
        .iter()
        .map(|(name, (dtype, shape, _))| mx_layout::TensorSpec {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
        })
        .collect()
}
