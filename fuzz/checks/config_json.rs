//! config.json text -> mx_checkpoint::parse_config -> ModelInfo::from_hf_config over the llama
//! tensors the config describes (first 2 layers), then every rank of replicated, FSDP and
//! tensor-parallel layouts. Asserts: the config round-trips through JSON; a replicated rank holds
//! every tensor's bytes, FSDP ranks hold them once in all; params are laid out back to back.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/config_json.rs` and the corpus replay in
//! `tests/fuzz_corpus.rs`.

use std::path::Path;

use mx_layout::{rank_layouts, DType, LayoutSpec, ModelInfo, Scheme, TensorSpec};
use serde_json::Value;

fn field(cfg: &Value, name: &str, default: u64) -> u64 {
    cfg.get(name).and_then(Value::as_u64).unwrap_or(default)
}

/// The llama tensors `cfg` describes, for at most 2 layers (shapes are numbers only).
fn llama_tensors(cfg: &Value, with_lm_head: bool) -> Vec<TensorSpec> {
    let h = field(cfg, "hidden_size", 8);
    let heads = field(cfg, "num_attention_heads", 2).max(1);
    let kv = field(cfg, "num_key_value_heads", heads);
    let hd = field(cfg, "head_dim", h / heads);
    let inter = field(cfg, "intermediate_size", 16);
    let vocab = field(cfg, "vocab_size", 32);
    let layers = field(cfg, "num_hidden_layers", 1).min(2);
    let t = |name: String, shape: Vec<u64>| TensorSpec {
        name,
        dtype: DType::BF16,
        shape,
    };
    let mut out = vec![
        t("model.embed_tokens.weight".into(), vec![vocab, h]),
        t("model.norm.weight".into(), vec![h]),
    ];
    if with_lm_head {
        out.push(t("lm_head.weight".into(), vec![vocab, h]));
    }
    for i in 0..layers {
        let l = format!("model.layers.{i}");
        out.push(t(
            format!("{l}.self_attn.q_proj.weight"),
            vec![heads.wrapping_mul(hd), h],
        ));
        out.push(t(
            format!("{l}.self_attn.k_proj.weight"),
            vec![kv.wrapping_mul(hd), h],
        ));
        out.push(t(
            format!("{l}.self_attn.v_proj.weight"),
            vec![kv.wrapping_mul(hd), h],
        ));
        out.push(t(
            format!("{l}.self_attn.o_proj.weight"),
            vec![h, heads.wrapping_mul(hd)],
        ));
        out.push(t(format!("{l}.mlp.gate_proj.weight"), vec![inter, h]));
        out.push(t(format!("{l}.mlp.up_proj.weight"), vec![inter, h]));
        out.push(t(format!("{l}.mlp.down_proj.weight"), vec![h, inter]));
        out.push(t(format!("{l}.input_layernorm.weight"), vec![h]));
        out.push(t(format!("{l}.post_attention_layernorm.weight"), vec![h]));
    }
    out
}

fn bytes(t: &TensorSpec) -> Option<u64> {
    t.shape
        .iter()
        .try_fold(t.dtype.size_bytes(), |a, &d| a.checked_mul(d))
}

/// One input: returns when it is refused, panics when a promise above breaks.
pub(crate) fn check(data: &[u8]) {
    let path = Path::new("config.json");
    let Ok(cfg) = mx_checkpoint::parse_config(path, data) else {
        return;
    };
    let again = serde_json::to_vec(&cfg).expect("a Value serializes");
    assert_eq!(
        mx_checkpoint::parse_config(path, &again).expect("round trip"),
        cfg
    );
    let with_lm_head = data.len().is_multiple_of(2);
    let Ok(model) = ModelInfo::from_hf_config(&cfg, llama_tensors(&cfg, with_lm_head)) else {
        return;
    };
    let Some(total) = model
        .tensors
        .iter()
        .try_fold(0u64, |a, t| a.checked_add(bytes(t)?))
    else {
        return;
    };
    for (scheme, ws) in [
        (Scheme::Replicated, 1),
        (Scheme::Fsdp, 3),
        (Scheme::VllmTp, 1),
        (Scheme::VllmTp, 2),
        (Scheme::VllmTp, 4),
    ] {
        let layout = LayoutSpec {
            scheme,
            world_size: ws,
        };
        let Ok(ranks) = rank_layouts(&model, layout) else {
            continue;
        };
        for r in &ranks {
            let mut at = 0u64;
            for p in &r.params {
                assert_eq!(
                    p.offset, at,
                    "{layout} rank {}: {} not back to back",
                    r.rank, p.name
                );
                at = p.offset + p.len;
            }
            assert_eq!(at, r.total_bytes);
        }
        let sum: u64 = ranks.iter().map(|r| r.total_bytes).sum();
        match scheme {
            Scheme::Replicated | Scheme::Fsdp => assert_eq!(sum, total, "{layout}"),
            _ => {}
        }
    }
}
