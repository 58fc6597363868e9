//! Strict model parsing (issue 17): tied embeddings, models without config.json, oversized
//! config values.
#![allow(clippy::unwrap_used)] // reason: test code; a failed unwrap is a failed test

use mx_layout::model::Family;
use mx_layout::{rank_layouts, DType, Error, LayoutSpec, ModelInfo, TensorSpec};

fn t(name: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype: DType::BF16,
        shape: shape.to_vec(),
    }
}

fn tiny(tied: bool) -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 8, "vocab_size": 6,
        "num_hidden_layers": 1, "tie_word_embeddings": tied,
    })
}

fn tensors(lm_head: Option<TensorSpec>) -> Vec<TensorSpec> {
    let l = "model.layers.0";
    let mut v = vec![
        t("model.embed_tokens.weight", &[6, 4]),
        t("model.norm.weight", &[4]),
        t(&format!("{l}.self_attn.q_proj.weight"), &[4, 4]),
        t(&format!("{l}.self_attn.k_proj.weight"), &[2, 4]),
        t(&format!("{l}.self_attn.v_proj.weight"), &[2, 4]),
        t(&format!("{l}.self_attn.o_proj.weight"), &[4, 4]),
        t(&format!("{l}.mlp.gate_proj.weight"), &[8, 4]),
        t(&format!("{l}.mlp.up_proj.weight"), &[8, 4]),
        t(&format!("{l}.mlp.down_proj.weight"), &[4, 8]),
        t(&format!("{l}.input_layernorm.weight"), &[4]),
        t(&format!("{l}.post_attention_layernorm.weight"), &[4]),
    ];
    v.extend(lm_head);
    v
}

#[test]
fn tied_model_drops_a_redundant_lm_head() {
    let with = ModelInfo::from_hf_config(&tiny(true), tensors(Some(t("lm_head.weight", &[6, 4]))))
        .unwrap();
    let without = ModelInfo::from_hf_config(&tiny(true), tensors(None)).unwrap();
    assert_eq!(with, without);
    assert!(with.tensor("lm_head.weight").is_none());
    // Untied: lm_head is a tensor of its own.
    let untied =
        ModelInfo::from_hf_config(&tiny(false), tensors(Some(t("lm_head.weight", &[6, 4]))))
            .unwrap();
    assert!(untied.tensor("lm_head.weight").is_some());
}

#[test]
fn tied_model_with_a_different_lm_head_names_both() {
    let err = ModelInfo::from_hf_config(&tiny(true), tensors(Some(t("lm_head.weight", &[7, 4]))))
        .unwrap_err();
    match &err {
        Error::TiedEmbeddingMismatch {
            embedding, lm_head, ..
        } => {
            assert_eq!(embedding, "model.embed_tokens.weight");
            assert_eq!(lm_head, "lm_head.weight");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn generic_model_lays_out_replicated_and_fsdp_and_refuses_tp() {
    let m = ModelInfo::generic(vec![t("b", &[5, 2]), t("a", &[3])]);
    assert_eq!(m.family, Family::Generic);
    assert_eq!(m.tensors[0].name, "a");
    let fsdp: LayoutSpec = "fsdp:2".parse().unwrap();
    let sum: u64 = rank_layouts(&m, fsdp)
        .unwrap()
        .iter()
        .map(|r| r.total_bytes)
        .sum();
    assert_eq!(sum, (3 + 10) * 2);
    let err = rank_layouts(&m, "tp:1".parse().unwrap()).unwrap_err();
    assert!(
        matches!(&err, Error::NoModelConfig { layout } if layout == "tp:1"),
        "{err:?}"
    );
    assert!(err.to_string().contains("config.json"));
}

#[test]
fn regression_config_heads_times_head_dim_overflow_is_an_error() {
    // Seen while writing the config_json fuzz target: q = heads x head_dim overflowed u64 (a
    // panic with overflow checks), and num_hidden_layers = u64::MAX built an unbounded list.
    let mut cfg = tiny(false);
    cfg["num_attention_heads"] = 4.into();
    cfg["num_key_value_heads"] = 4.into();
    cfg["head_dim"] = (u64::MAX / 2).into();
    let err = ModelInfo::from_hf_config(&cfg, tensors(None)).unwrap_err();
    assert!(
        matches!(&err, Error::BadConfig { field, .. } if field == "num_attention_heads"),
        "{err:?}"
    );
    let mut cfg = tiny(false);
    cfg["num_hidden_layers"] = u64::MAX.into();
    let err =
        ModelInfo::from_hf_config(&cfg, tensors(Some(t("lm_head.weight", &[6, 4])))).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor.starts_with("model.layers.1.")),
        "{err:?}"
    );
}
