//! MoE layouts against an oracle written from vLLM 0.32.0's loader code, not from mx-layout:
//! every element of every rank's fused expert parameters is the checkpoint element vLLM's
//! `RoutedExperts._load_w13` / `_load_w2` and `determine_expert_map` put there. Elements are
//! tagged with (tensor, linear index) so a misplaced one names where it came from.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use std::collections::BTreeMap;

use crate::moe::MoeInfo;
use crate::{rank_layout, DType, Error, LayoutSpec, ModelInfo, TensorSpec};

use crate::test_util::{assembled, Tag};

/// A family's MoE block, per-expert projection names (gate, up, down) and stacked names
/// (gate/up, down), as vLLM 0.32.0's loaders accept them.
fn names(kind: &str) -> (&'static str, [&'static str; 3], [&'static str; 2]) {
    match kind {
        "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"], ["w13", "w2"]),
        _ => (
            "mlp",
            ["gate_proj", "up_proj", "down_proj"],
            ["gate_up_proj", "down_proj"],
        ),
    }
}

/// A Qwen3-MoE (or Mixtral) with `experts` experts of intermediate `inter`, hidden `hidden`,
/// one layer; experts per-expert or stacked.
fn model(kind: &str, experts: u64, inter: u64, hidden: u64, stacked: bool) -> ModelInfo {
    let (block, names, stack) = names(kind);
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<u64>| {
        t.push(TensorSpec {
            name,
            dtype: DType::BF16,
            shape,
        })
    };
    // Attention, embeddings and lm_head divisible by every rank count the tests use (1..=10).
    let (heads, head_dim, vocab) = (2520u64, 1u64, 64 * 2520u64);
    add("model.embed_tokens.weight".into(), vec![vocab, hidden]);
    add("lm_head.weight".into(), vec![vocab, hidden]);
    add("model.norm.weight".into(), vec![hidden]);
    let l = "model.layers.0";
    for (p, rows) in [
        ("q", heads * head_dim),
        ("k", heads * head_dim),
        ("v", heads * head_dim),
    ] {
        add(format!("{l}.self_attn.{p}_proj.weight"), vec![rows, hidden]);
    }
    add(
        format!("{l}.self_attn.o_proj.weight"),
        vec![hidden, heads * head_dim],
    );
    add(format!("{l}.input_layernorm.weight"), vec![hidden]);
    add(format!("{l}.post_attention_layernorm.weight"), vec![hidden]);
    add(format!("{l}.{block}.gate.weight"), vec![experts, hidden]);
    if stacked {
        add(
            format!("{l}.{block}.experts.{}", stack[0]),
            vec![experts, 2 * inter, hidden],
        );
        add(
            format!("{l}.{block}.experts.{}", stack[1]),
            vec![experts, hidden, inter],
        );
    } else {
        for e in 0..experts {
            add(
                format!("{l}.{block}.experts.{e}.{}.weight", names[0]),
                vec![inter, hidden],
            );
            add(
                format!("{l}.{block}.experts.{e}.{}.weight", names[1]),
                vec![inter, hidden],
            );
            add(
                format!("{l}.{block}.experts.{e}.{}.weight", names[2]),
                vec![hidden, inter],
            );
        }
    }
    let mut cfg = serde_json::json!({
        "model_type": kind, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": head_dim, "vocab_size": vocab,
        "num_hidden_layers": 1, "intermediate_size": inter, "tie_word_embeddings": false,
    });
    if kind == "mixtral" {
        cfg["num_local_experts"] = experts.into();
    } else {
        cfg["num_experts"] = experts.into();
        cfg["moe_intermediate_size"] = inter.into();
        cfg["intermediate_size"] = (inter * 3).into();
    }
    ModelInfo::from_hf_config(&cfg, t).unwrap()
}

/// The oracle: vLLM's w13 and w2 of (MoE-)tp rank `r` of `tp` for the global experts `ids`,
/// from `RoutedExperts._load_w13` (gate rows `r*I_p..`, then up rows) and `_load_w2` (down
/// columns `r*I_p..`), with the stacked form split as `fused.chunk(2, dim=1)[0 | 1]`.
fn oracle(
    kind: &str,
    inter: u64,
    hidden: u64,
    stacked: bool,
    ids: &[u64],
    r: u64,
    tp: u64,
) -> (Vec<Tag>, Vec<Tag>) {
    let (block, names, stack) = names(kind);
    let l = "model.layers.0";
    let ip = inter / tp;
    // Element (row, col) of expert e's gate (half 0) or up (half 1), shape [I, H].
    let gate_up = |e: u64, half: u64, row: u64, col: u64| -> Tag {
        if stacked {
            let name = format!("{l}.{block}.experts.{}", stack[0]);
            let row = half * inter + row;
            (name, (e * 2 * inter + row) * hidden + col)
        } else {
            let name = format!("{l}.{block}.experts.{e}.{}.weight", names[half as usize]);
            (name, row * hidden + col)
        }
    };
    let down = |e: u64, row: u64, col: u64| -> Tag {
        if stacked {
            let name = format!("{l}.{block}.experts.{}", stack[1]);
            (name, (e * hidden + row) * inter + col)
        } else {
            let name = format!("{l}.{block}.experts.{e}.{}.weight", names[2]);
            (name, row * inter + col)
        }
    };
    let (mut w13, mut w2) = (Vec::new(), Vec::new());
    for &e in ids {
        for half in 0..2 {
            for row in 0..ip {
                for col in 0..hidden {
                    w13.push(gate_up(e, half, r * ip + row, col));
                }
            }
        }
        for row in 0..hidden {
            for col in 0..ip {
                w2.push(down(e, row, r * ip + col));
            }
        }
    }
    (w13, w2)
}

/// vLLM's `determine_expert_map` (strategy "linear"), written from its code: the global ids
/// EP rank `r` of `ep` holds, in local order.
fn vllm_expert_ids(experts: u64, ep: u64, r: u64) -> Vec<u64> {
    let base = experts / ep;
    let rem = experts % ep;
    let local = if r < rem { base + 1 } else { base };
    let start = r * base + r.min(rem);
    (start..start + local).collect()
}

fn layout(s: &str) -> LayoutSpec {
    s.parse().unwrap()
}

fn check(kind: &str, experts: u64, inter: u64, hidden: u64, stacked: bool, l: &str) {
    let m = model(kind, experts, inter, hidden, stacked);
    let ly = layout(l);
    let ep = l.starts_with("tp-ep");
    let block = if kind == "mixtral" {
        "block_sparse_moe"
    } else {
        "mlp"
    };
    let n = u64::from(ly.world_size);
    let mut seen = BTreeMap::new();
    for rank in 0..ly.world_size {
        let r = rank_layout(&m, ly, rank).unwrap();
        let p = format!("model.layers.0.{block}.experts.routed_experts");
        let (ids, tr, tp) = if ep {
            (vllm_expert_ids(experts, n, u64::from(rank)), 0, 1)
        } else {
            ((0..experts).collect(), u64::from(rank), n)
        };
        let (w13, w2) = oracle(kind, inter, hidden, stacked, &ids, tr, tp);
        let got13 = assembled(&r, &format!("{p}.w13_weight"));
        let got2 = assembled(&r, &format!("{p}.w2_weight"));
        for (i, (g, w)) in got13.iter().zip(&w13).enumerate() {
            assert_eq!(g, w, "{kind} {l} rank {rank}: w13 element {i}");
        }
        for (i, (g, w)) in got2.iter().zip(&w2).enumerate() {
            assert_eq!(g, w, "{kind} {l} rank {rank}: w2 element {i}");
        }
        assert_eq!((got13.len(), got2.len()), (w13.len(), w2.len()));
        let w13p = r.param(&format!("{p}.w13_weight")).unwrap();
        assert_eq!(
            w13p.shape,
            vec![ids.len() as u64, 2 * inter / tp, hidden],
            "{l} rank {rank}"
        );
        // The router is whole on every rank, under its checkpoint name.
        let router = r
            .param(&format!("model.layers.0.{block}.gate.weight"))
            .unwrap();
        assert_eq!(router.shape, vec![experts, hidden]);
        assert_eq!(assembled(&r, &router.name).len() as u64, experts * hidden);
        for t in got13.iter().chain(&got2) {
            *seen.entry(t.clone()).or_insert(0u32) += 1;
        }
    }
    // Every expert element lands exactly once across the ranks.
    let expert_elems: u64 = m
        .tensors
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .map(|t| t.shape.iter().product::<u64>())
        .sum();
    assert_eq!(seen.len() as u64, expert_elems, "{kind} {l}");
    assert!(
        seen.values().all(|&c| c == 1),
        "{kind} {l}: an element placed twice"
    );
}

#[test]
fn each_expert_lands_under_tensor_parallelism_split_along_the_intermediate_dim() {
    for kind in ["qwen3_moe", "mixtral"] {
        for l in ["tp:1", "tp:2", "tp:4"] {
            check(kind, 8, 16, 8, false, l);
        }
    }
}

#[test]
fn regression_gate_up_is_never_reassembled_half_and_half() {
    // Rank 1 of tp:2 holds gate rows 8..16 then up rows 8..16 of each expert: never rows 16..32
    // of the stacked [E, 2I, H] gate/up (which would be up rows read as gate).
    check("qwen3_moe", 8, 16, 8, true, "tp:2");
    let m = model("qwen3_moe", 8, 16, 8, true);
    let r = rank_layout(&m, layout("tp:2"), 1).unwrap();
    let w13 = r
        .param("model.layers.0.mlp.experts.routed_experts.w13_weight")
        .unwrap();
    let first_two: Vec<Vec<u64>> = w13.pieces[..2]
        .iter()
        .map(|p| p.region.global_offset.clone())
        .collect();
    assert_eq!(first_two, vec![vec![0, 8, 0], vec![0, 24, 0]]);
}

#[test]
fn regression_a_wrong_global_expert_id_is_caught_under_expert_parallelism() {
    // 8 experts over 3 EP ranks: vLLM places 3, 3, 2 (extras on the first ranks).
    check("qwen3_moe", 8, 16, 8, false, "tp-ep:3");
    check("mixtral", 8, 16, 8, true, "tp-ep:2");
    let m = model("qwen3_moe", 8, 16, 8, false);
    let r = rank_layout(&m, layout("tp-ep:3"), 2).unwrap();
    let w2 = r
        .param("model.layers.0.mlp.experts.routed_experts.w2_weight")
        .unwrap();
    assert_eq!(w2.shape, vec![2, 8, 16]);
    assert_eq!(
        w2.pieces[0].tensor,
        "model.layers.0.mlp.experts.6.down_proj.weight"
    );
}

#[test]
fn an_expert_count_not_divisible_by_the_ep_size_puts_the_extras_first() {
    for ep in 1..=10u32 {
        let m = model("qwen3_moe", 10, 8, 8, ep % 2 == 0);
        let moe = m.moe.as_ref().unwrap();
        for r in 0..ep {
            let (first, count) = moe.ep_experts(ep, r);
            let want = vllm_expert_ids(10, u64::from(ep), u64::from(r));
            assert_eq!(
                (first..first + count).collect::<Vec<_>>(),
                want,
                "ep {ep} rank {r}"
            );
        }
        check("qwen3_moe", 10, 8, 8, ep % 2 == 0, &format!("tp-ep:{ep}"));
    }
}

#[test]
fn stacked_3d_expert_tensors_place_the_same_elements_as_per_expert_ones() {
    for l in ["tp:2", "tp-ep:4"] {
        check("qwen3_moe", 8, 16, 8, true, l);
        check("mixtral", 8, 16, 8, true, l);
    }
}

#[test]
fn bad_moe_checkpoints_and_layouts_are_refused_naming_the_tensor() {
    let m = model("qwen3_moe", 8, 12, 8, false);
    let e = rank_layout(&m, layout("tp:8"), 0).unwrap_err();
    assert!(
        matches!(&e, Error::ImpossibleLayout { tensor, reason, .. }
            if tensor == "model.layers.0.mlp.experts" && reason.contains("not divisible by tp=8")),
        "{e}"
    );
    let e = rank_layout(&model("qwen3_moe", 4, 16, 8, false), layout("tp:8"), 0).unwrap_err();
    assert!(e.to_string().contains("above the expert count"), "{e}");
    // A missing expert projection is named.
    let mut m = model("qwen3_moe", 8, 16, 8, false);
    m.tensors
        .retain(|t| t.name != "model.layers.0.mlp.experts.5.up_proj.weight");
    let e = rank_layout(&m, layout("tp:2"), 0).unwrap_err();
    assert!(
        matches!(&e, Error::MissingTensor { tensor, .. } if tensor == "model.layers.0.mlp.experts.5.up_proj.weight"),
        "{e}"
    );
    // A stacked form vLLM does not load, an expert past the config's count, a wrong shape.
    for (name, shape, needle) in [
        (
            "model.layers.0.mlp.experts.gate_proj",
            vec![8, 16, 8],
            "not a form vLLM loads",
        ),
        (
            "model.layers.0.mlp.experts.8.gate_proj.weight",
            vec![16, 8],
            "past the config's 8",
        ),
        (
            "model.layers.0.mlp.experts.3.gate_proj.bias",
            vec![16],
            "not an expert projection",
        ),
    ] {
        let mut m = model("qwen3_moe", 8, 16, 8, false);
        m.tensors.push(TensorSpec {
            name: name.into(),
            dtype: DType::BF16,
            shape,
        });
        m.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let e = rank_layout(&m, layout("tp:2"), 0).unwrap_err();
        assert!(
            matches!(&e, Error::ImpossibleLayout { tensor, reason, .. } if tensor == name && reason.contains(needle)),
            "{name}: {e}"
        );
    }
    let mut m = model("qwen3_moe", 8, 16, 8, false);
    for t in &mut m.tensors {
        if t.name == "model.layers.0.mlp.experts.2.down_proj.weight" {
            t.shape = vec![16, 8];
        }
    }
    let e = rank_layout(&m, layout("tp:2"), 0).unwrap_err();
    assert!(
        matches!(&e, Error::Mismatch { tensor, what: "shape", .. } if tensor == "model.layers.0.mlp.experts.2.down_proj.weight"),
        "{e}"
    );
    // A dtype differing inside one fused parameter.
    let mut m = model("qwen3_moe", 8, 16, 8, false);
    for t in &mut m.tensors {
        if t.name == "model.layers.0.mlp.experts.7.gate_proj.weight" {
            t.dtype = DType::F32;
        }
    }
    let e = rank_layout(&m, layout("tp:2"), 0).unwrap_err();
    assert!(
        matches!(&e, Error::Mismatch { tensor, what: "dtype", .. } if tensor == "model.layers.0.mlp.experts.7.gate_proj.weight"),
        "{e}"
    );
}

#[test]
fn a_router_weight_under_tensor_parallelism_is_whole_on_every_rank_and_fsdp_sources_cut_it() {
    let m = model("mixtral", 8, 16, 8, false);
    for l in ["tp:2", "tp-ep:2"] {
        for rank in 0..2 {
            let r = rank_layout(&m, layout(l), rank).unwrap();
            let g = r
                .param("model.layers.0.block_sparse_moe.gate.weight")
                .unwrap();
            assert_eq!(g.pieces.len(), 1);
            assert_eq!(g.pieces[0].region.local_shape, vec![8, 8]);
        }
    }
    // An FSDP source cuts expert tensors by rows like any other tensor.
    let r = rank_layout(&m, layout("fsdp:2"), 1).unwrap();
    let w = r
        .param("model.layers.0.block_sparse_moe.experts.3.w2.weight")
        .unwrap();
    assert_eq!(w.pieces[0].region.global_offset, vec![4, 0]);
}

#[test]
fn qwen2_moe_shared_experts_are_a_tensor_parallel_mlp_in_both_layouts() {
    let mut m = model("qwen3_moe", 8, 16, 8, false);
    let l = "model.layers.0.mlp";
    let si = 24u64;
    for (n, shape) in [
        (format!("{l}.shared_expert.gate_proj.weight"), vec![si, 8]),
        (format!("{l}.shared_expert.up_proj.weight"), vec![si, 8]),
        (format!("{l}.shared_expert.down_proj.weight"), vec![8, si]),
        (format!("{l}.shared_expert_gate.weight"), vec![1, 8]),
    ] {
        m.tensors.push(TensorSpec {
            name: n,
            dtype: DType::BF16,
            shape,
        });
    }
    m.tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for lay in ["tp:2", "tp-ep:2"] {
        let r = rank_layout(&m, layout(lay), 1).unwrap();
        let gu = r
            .param(&format!("{l}.shared_expert.gate_up_proj.weight"))
            .unwrap();
        assert_eq!(gu.shape, vec![24, 8], "{lay}");
        let offs: Vec<Vec<u64>> = gu
            .pieces
            .iter()
            .map(|p| p.region.global_offset.clone())
            .collect();
        assert_eq!(
            offs,
            vec![vec![12, 0], vec![12, 0]],
            "{lay}: gate rows 12.., then up rows 12.."
        );
        let d = r
            .param(&format!("{l}.shared_expert.down_proj.weight"))
            .unwrap();
        assert_eq!(
            (d.shape.clone(), d.pieces[0].region.global_offset.clone()),
            (vec![8, 12], vec![0, 12])
        );
        let g = r.param(&format!("{l}.shared_expert_gate.weight")).unwrap();
        assert_eq!(g.shape, vec![1, 8]);
    }
}

#[test]
fn the_expert_count_is_read_under_either_name_transformers_writes() {
    let cfg = |extra: serde_json::Value| {
        let mut c = serde_json::json!({"hidden_size": 64, "moe_intermediate_size": 32});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        MoeInfo::from_hf_config("qwen3_moe", &c)
    };
    let n = |r: Result<Option<MoeInfo>, Error>| r.unwrap().unwrap().num_experts;
    assert_eq!(n(cfg(serde_json::json!({"num_experts": 8}))), 8);
    // transformers 5 saves Qwen3-MoE with num_local_experts (its attribute_map's target).
    assert_eq!(n(cfg(serde_json::json!({"num_local_experts": 6}))), 6);
    assert_eq!(
        n(cfg(
            serde_json::json!({"num_experts": 4, "num_local_experts": 4})
        )),
        4
    );
    let err = cfg(serde_json::json!({"num_experts": 4, "num_local_experts": 8})).unwrap_err();
    assert!(err.to_string().contains("num_experts"), "{err}");
    assert!(err.to_string().contains("disagrees"), "{err}");
    let err = cfg(serde_json::json!({})).unwrap_err();
    assert!(err.to_string().contains("num_local_experts"), "{err}");
}
