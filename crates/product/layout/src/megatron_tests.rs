//! Megatron-Core source layouts against an oracle written here from Megatron-Core's rules (not
//! from mx-layout's code): every element of every rank's parameters is the checkpoint element
//! Megatron-Core's rank holds there. Each regression test is named after a failure users hit.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use std::collections::{BTreeMap, BTreeSet};

use crate::test_util::{assembled, Tag};
use crate::{rank_layout, DType, Error, LayoutSpec, ModelInfo, RankLayout, TensorSpec};

/// Sizes of the test model: hidden 16, 4 heads of 4 in 2 query groups, vocab 300 (padded to
/// 384 at tp=1..3: rows past 300 are zero), dense intermediate 8, experts of intermediate 4.
const H: u64 = 16;
const HEADS: u64 = 4;
const GROUPS: u64 = 2;
const D: u64 = 4;
const VOCAB: u64 = 300;
const I_DENSE: u64 = 8;
const I_EXPERT: u64 = 4;

#[derive(Clone, Copy)]
struct Spec {
    kind: &'static str,
    layers: u64,
    experts: u64,
    stacked: bool,
    /// Layer 0 dense (Qwen2-MoE's `mlp_only_layers`), the rest MoE.
    dense_first: bool,
}

fn qwen3(layers: u64, experts: u64) -> Spec {
    Spec {
        kind: "qwen3_moe",
        layers,
        experts,
        stacked: false,
        dense_first: false,
    }
}

fn model(s: Spec) -> ModelInfo {
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<u64>| {
        t.push(TensorSpec {
            name,
            dtype: DType::BF16,
            shape,
        })
    };
    add("model.embed_tokens.weight".into(), vec![VOCAB, H]);
    add("lm_head.weight".into(), vec![VOCAB, H]);
    add("model.norm.weight".into(), vec![H]);
    let (block, parts) = match s.kind {
        "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    for n in 0..s.layers {
        let l = format!("model.layers.{n}");
        add(format!("{l}.input_layernorm.weight"), vec![H]);
        add(format!("{l}.post_attention_layernorm.weight"), vec![H]);
        for (p, rows) in [("q", HEADS * D), ("k", GROUPS * D), ("v", GROUPS * D)] {
            add(format!("{l}.self_attn.{p}_proj.weight"), vec![rows, H]);
            if s.kind == "qwen2_moe" {
                add(format!("{l}.self_attn.{p}_proj.bias"), vec![rows]);
            }
        }
        if s.kind == "qwen3_moe" {
            add(format!("{l}.self_attn.q_norm.weight"), vec![D]);
            add(format!("{l}.self_attn.k_norm.weight"), vec![D]);
        }
        add(format!("{l}.self_attn.o_proj.weight"), vec![H, HEADS * D]);
        if s.experts == 0 || (s.dense_first && n == 0) {
            add(format!("{l}.mlp.gate_proj.weight"), vec![I_DENSE, H]);
            add(format!("{l}.mlp.up_proj.weight"), vec![I_DENSE, H]);
            add(format!("{l}.mlp.down_proj.weight"), vec![H, I_DENSE]);
            continue;
        }
        add(format!("{l}.{block}.gate.weight"), vec![s.experts, H]);
        if s.stacked {
            let stack = if s.kind == "mixtral" {
                ["w13", "w2"]
            } else {
                ["gate_up_proj", "down_proj"]
            };
            add(
                format!("{l}.{block}.experts.{}", stack[0]),
                vec![s.experts, 2 * I_EXPERT, H],
            );
            add(
                format!("{l}.{block}.experts.{}", stack[1]),
                vec![s.experts, H, I_EXPERT],
            );
        } else {
            for e in 0..s.experts {
                let x = format!("{l}.{block}.experts.{e}");
                add(format!("{x}.{}.weight", parts[0]), vec![I_EXPERT, H]);
                add(format!("{x}.{}.weight", parts[1]), vec![I_EXPERT, H]);
                add(format!("{x}.{}.weight", parts[2]), vec![H, I_EXPERT]);
            }
        }
        if s.kind == "qwen2_moe" {
            add(
                format!("{l}.mlp.shared_expert.gate_proj.weight"),
                vec![8, H],
            );
            add(format!("{l}.mlp.shared_expert.up_proj.weight"), vec![8, H]);
            add(
                format!("{l}.mlp.shared_expert.down_proj.weight"),
                vec![H, 8],
            );
            add(format!("{l}.mlp.shared_expert_gate.weight"), vec![1, H]);
        }
    }
    t.sort_by(|a, b| a.name.cmp(&b.name));
    let mut cfg = serde_json::json!({
        "model_type": if s.experts == 0 { "llama" } else { s.kind },
        "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS,
        "head_dim": D, "vocab_size": VOCAB, "num_hidden_layers": s.layers,
        "intermediate_size": if s.kind == "mixtral" { I_EXPERT } else { I_DENSE },
        "tie_word_embeddings": false,
    });
    if s.experts > 0 {
        cfg["num_local_experts"] = s.experts.into();
        cfg["moe_intermediate_size"] = I_EXPERT.into();
        if s.kind == "qwen2_moe" {
            cfg["shared_expert_intermediate_size"] = 8.into();
        }
    }
    ModelInfo::from_hf_config(&cfg, t).unwrap()
}

/// Rows `rows` of 2-D (or 1-D) tensor `name` with `cols` columns, whole rows.
fn rows(name: &str, rows: std::ops::Range<u64>, cols: u64) -> Vec<Tag> {
    rows.flat_map(|r| (0..cols).map(move |c| (name.to_string(), r * cols + c)))
        .collect()
}

/// Columns `c0..c0 + n` of every row of `[nrows, ncols]` tensor `name`.
fn cols(name: &str, nrows: u64, ncols: u64, c0: u64, n: u64) -> Vec<Tag> {
    (0..nrows)
        .flat_map(|r| (c0..c0 + n).map(move |c| (name.to_string(), r * ncols + c)))
        .collect()
}

/// Megatron-Core's rank `rank` of `megatron:tp=T,pp=P,ep=E`, parameter by parameter, written
/// from Megatron-Core's rules: rank order tp-cp-ep-dp-pp, stage-local layer numbers,
/// `linear_qkv` interleaved per query group, `linear_fc1` = [gate_r; up_r], row-parallel
/// `linear_proj`/`linear_fc2`, vocab padded to a multiple of 128 T, local expert k of EP rank
/// s = global expert s E/ep + k (the `_get_local_to_global_expert_map` rule). `None` for padding.
fn oracle(s: Spec, tp: u64, pp: u64, ep: u64, rank: u64) -> BTreeMap<String, Vec<Option<Tag>>> {
    let (r, e_rank, stage) = (rank % tp, (rank / tp) % ep, rank / (tp * ep));
    let mut out: BTreeMap<String, Vec<Option<Tag>>> = BTreeMap::new();
    let mut put = |name: String, tags: Vec<Tag>| {
        out.insert(name, tags.into_iter().map(Some).collect());
    };
    let per_stage = s.layers / pp;
    let padded = VOCAB.div_ceil(128 * tp) * 128 * tp;
    let vocab_rows = |name: &str| -> Vec<Option<Tag>> {
        let per = padded / tp;
        (r * per..(r + 1) * per)
            .flat_map(|row| {
                (0..H).map(move |c| (row < VOCAB).then(|| (name.to_string(), row * H + c)))
            })
            .collect()
    };
    let mut pad: Vec<(String, Vec<Option<Tag>>)> = Vec::new();
    if stage == 0 {
        pad.push((
            "embedding.word_embeddings.weight".into(),
            vocab_rows("model.embed_tokens.weight"),
        ));
    }
    if stage == pp - 1 {
        pad.push(("output_layer.weight".into(), vocab_rows("lm_head.weight")));
        put(
            "decoder.final_layernorm.weight".into(),
            rows("model.norm.weight", 0..1, H),
        );
    }
    let (block, parts) = match s.kind {
        "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    for i in 0..per_stage {
        let g = stage * per_stage + i;
        let hf = format!("model.layers.{g}.");
        let mg = format!("decoder.layers.{i}.");
        put(
            format!("{mg}self_attention.linear_qkv.layer_norm_weight"),
            rows(&format!("{hf}input_layernorm.weight"), 0..1, H),
        );
        let groups_here = GROUPS / tp;
        let qpg = HEADS / GROUPS;
        for (kind, width) in [("weight", H), ("bias", 1)] {
            if kind == "bias" && s.kind != "qwen2_moe" {
                continue;
            }
            let mut qkv = Vec::new();
            for grp in r * groups_here..(r + 1) * groups_here {
                let q = format!("{hf}self_attn.q_proj.{kind}");
                qkv.extend(rows(&q, grp * qpg * D..(grp + 1) * qpg * D, width));
                let k = format!("{hf}self_attn.k_proj.{kind}");
                qkv.extend(rows(&k, grp * D..(grp + 1) * D, width));
                let v = format!("{hf}self_attn.v_proj.{kind}");
                qkv.extend(rows(&v, grp * D..(grp + 1) * D, width));
            }
            put(format!("{mg}self_attention.linear_qkv.{kind}"), qkv);
        }
        if s.kind == "qwen3_moe" {
            for (m, h) in [("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")] {
                put(
                    format!("{mg}self_attention.{m}.weight"),
                    rows(&format!("{hf}self_attn.{h}.weight"), 0..1, D),
                );
            }
        }
        let cw = HEADS * D / tp;
        put(
            format!("{mg}self_attention.linear_proj.weight"),
            cols(
                &format!("{hf}self_attn.o_proj.weight"),
                H,
                HEADS * D,
                r * cw,
                cw,
            ),
        );
        let post = rows(&format!("{hf}post_attention_layernorm.weight"), 0..1, H);
        let fc = |gate: &str, up: &str, down: &str, inter: u64| {
            let n = inter / tp;
            let mut fc1 = rows(gate, r * n..(r + 1) * n, H);
            fc1.extend(rows(up, r * n..(r + 1) * n, H));
            (fc1, cols(down, H, inter, r * n, n))
        };
        if s.experts == 0 || (s.dense_first && g == 0) {
            put(format!("{mg}mlp.linear_fc1.layer_norm_weight"), post);
            let (fc1, fc2) = fc(
                &format!("{hf}mlp.gate_proj.weight"),
                &format!("{hf}mlp.up_proj.weight"),
                &format!("{hf}mlp.down_proj.weight"),
                I_DENSE,
            );
            put(format!("{mg}mlp.linear_fc1.weight"), fc1);
            put(format!("{mg}mlp.linear_fc2.weight"), fc2);
            continue;
        }
        put(format!("{mg}pre_mlp_layernorm.weight"), post);
        put(
            format!("{mg}mlp.router.weight"),
            rows(&format!("{hf}{block}.gate.weight"), 0..s.experts, H),
        );
        let n_local = s.experts / ep;
        for k in 0..n_local {
            let e = e_rank * n_local + k;
            let (fc1, fc2) = if s.stacked {
                // [E, 2I, H] gate first along dim 1; [E, H, I].
                let stack = if s.kind == "mixtral" {
                    ["w13", "w2"]
                } else {
                    ["gate_up_proj", "down_proj"]
                };
                let gu = format!("{hf}{block}.experts.{}", stack[0]);
                let dn = format!("{hf}{block}.experts.{}", stack[1]);
                let n = I_EXPERT / tp;
                let base = e * 2 * I_EXPERT;
                let mut fc1 = rows(&gu, base + r * n..base + (r + 1) * n, H);
                fc1.extend(rows(
                    &gu,
                    base + I_EXPERT + r * n..base + I_EXPERT + (r + 1) * n,
                    H,
                ));
                let fc2 = cols(&dn, H * s.experts, I_EXPERT, r * n, n)
                    .into_iter()
                    .skip((e * H * n) as usize)
                    .take((H * n) as usize)
                    .collect();
                (fc1, fc2)
            } else {
                let x = format!("{hf}{block}.experts.{e}.");
                fc(
                    &format!("{x}{}.weight", parts[0]),
                    &format!("{x}{}.weight", parts[1]),
                    &format!("{x}{}.weight", parts[2]),
                    I_EXPERT,
                )
            };
            let local = format!("{mg}mlp.experts.local_experts.{k}.");
            put(format!("{local}linear_fc1.weight"), fc1);
            put(format!("{local}linear_fc2.weight"), fc2);
        }
        if s.kind == "qwen2_moe" {
            let x = format!("{hf}mlp.shared_expert.");
            let (fc1, fc2) = fc(
                &format!("{x}gate_proj.weight"),
                &format!("{x}up_proj.weight"),
                &format!("{x}down_proj.weight"),
                8,
            );
            put(format!("{mg}mlp.shared_experts.linear_fc1.weight"), fc1);
            put(format!("{mg}mlp.shared_experts.linear_fc2.weight"), fc2);
            put(
                format!("{mg}mlp.shared_experts.gate_weight"),
                rows(&format!("{hf}mlp.shared_expert_gate.weight"), 0..1, H),
            );
        }
    }
    out.extend(pad);
    out
}

/// Every parameter of `rank` as the layout builds it, padding as `None`.
fn built(r: &RankLayout) -> BTreeMap<String, Vec<Option<Tag>>> {
    r.params
        .iter()
        .map(|p| {
            let mut tags: Vec<Option<Tag>> =
                assembled_padded(r, &p.name).into_iter().collect::<Vec<_>>();
            let numel: u64 = p.shape.iter().product();
            tags.resize(numel as usize, None);
            (p.name.clone(), tags)
        })
        .collect()
}

/// The pieces' elements in order (`assembled` requires full coverage; vocab params end with
/// zero rows, which stay `None`).
fn assembled_padded(r: &RankLayout, name: &str) -> Vec<Option<Tag>> {
    let p = r.param(name).unwrap();
    if p.zero_fill.is_none() {
        return assembled(r, name).into_iter().map(Some).collect();
    }
    let mut trimmed = r.clone();
    let q = trimmed.params.iter_mut().find(|q| q.name == name).unwrap();
    let covered: u64 = q.pieces.iter().map(|pc| pc.region.numel().unwrap()).sum();
    let cols = q.shape[1];
    q.shape[0] = covered / cols;
    assembled(&trimmed, name).into_iter().map(Some).collect()
}

fn check(s: Spec, tp: u64, pp: u64, ep: u64) {
    let m = model(s);
    let l = LayoutSpec::megatron(tp as u32, pp as u32, ep as u32).unwrap();
    assert_eq!(u64::from(l.world_size), tp * pp * ep);
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for rank in 0..l.world_size {
        let r = rank_layout(&m, l, rank).unwrap();
        let got = built(&r);
        let want = oracle(s, tp, pp, ep, u64::from(rank));
        let (gk, wk): (BTreeSet<_>, BTreeSet<_>) = (got.keys().collect(), want.keys().collect());
        assert_eq!(gk, wk, "{} {l} rank {rank}: parameter names", s.kind);
        for (name, tags) in &want {
            let g = &got[name];
            if let Some(k) = (0..tags.len().max(g.len())).find(|&k| g.get(k) != tags.get(k)) {
                panic!(
                    "{} {l} rank {rank} {name}: element {k} is {:?}, Megatron-Core holds {:?}",
                    s.kind,
                    g.get(k),
                    tags.get(k)
                );
            }
            seen.extend(tags.iter().flatten().map(|(t, _)| t.clone()));
        }
        // Offsets: the params lie back to back, each `len` bytes.
        let mut off = 0;
        for p in &r.params {
            assert_eq!(p.offset, off, "{name} offset", name = p.name);
            off += p.len;
        }
        assert_eq!(r.total_bytes, off);
    }
    // Every checkpoint tensor is held by some rank.
    let all: BTreeSet<String> = m.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(seen, all, "{} {l}: tensors no rank holds", s.kind);
}

#[test]
fn megatron_ranks_hold_what_megatron_core_holds_in_every_family_and_split() {
    let sizes = [
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
        (1, 1, 2),
        (2, 2, 2),
        (2, 1, 4),
        (1, 4, 4),
    ];
    let families = [
        qwen3(4, 8),
        Spec {
            kind: "mixtral",
            ..qwen3(4, 8)
        },
        Spec {
            kind: "qwen2_moe",
            dense_first: true,
            ..qwen3(4, 8)
        },
        Spec {
            kind: "llama",
            ..qwen3(4, 0)
        },
    ];
    for s in families {
        for (tp, pp, ep) in sizes {
            if s.experts == 0 && ep > 1 {
                continue;
            }
            check(s, tp, pp, ep);
        }
    }
}

#[test]
fn regression_gate_up_is_each_shards_gate_then_up_never_halves_of_the_gathered_tensor() {
    let m = model(qwen3(2, 4));
    let l = LayoutSpec::megatron(2, 1, 1).unwrap();
    let r1 = rank_layout(&m, l, 1).unwrap();
    let fc1 = assembled(
        &r1,
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
    );
    let (rows_per, e) = (I_EXPERT / 2, "model.layers.0.mlp.experts.3.");
    // First half: gate rows 2..4 of expert 3; second half: up rows 2..4. The wrong reading
    // (rows 2..4 of the gathered [gate; up], i.e. half of gate) never appears.
    let half = (rows_per * H) as usize;
    assert!(fc1[..half]
        .iter()
        .all(|(t, i)| t == &format!("{e}gate_proj.weight") && *i >= 2 * H));
    assert!(fc1[half..]
        .iter()
        .all(|(t, i)| t == &format!("{e}up_proj.weight") && *i >= 2 * H));
}

#[test]
fn regression_a_qkv_shard_holds_whole_query_groups_and_only_its_own_k_and_v() {
    // tp=2 over 2 groups: rank 1 holds group 1 whole: its 2 q heads, then k and v head 1.
    let m = model(qwen3(2, 4));
    let r1 = rank_layout(&m, LayoutSpec::megatron(2, 1, 1).unwrap(), 1).unwrap();
    let qkv = assembled(&r1, "decoder.layers.0.self_attention.linear_qkv.weight");
    let l0 = "model.layers.0.self_attn.";
    let names: Vec<&str> = qkv
        .chunks((D * H) as usize)
        .map(|c| c[0].0.as_str())
        .collect();
    let (q, k, v) = (
        format!("{l0}q_proj.weight"),
        format!("{l0}k_proj.weight"),
        format!("{l0}v_proj.weight"),
    );
    assert_eq!(names, [q.as_str(), q.as_str(), k.as_str(), v.as_str()]);
    // No k or v row of group 0 (rows 0..D) on rank 1; q rows are heads 2 and 3.
    assert!(qkv
        .iter()
        .filter(|(t, _)| t != &q)
        .all(|(_, i)| *i >= D * H));
    assert!(qkv
        .iter()
        .filter(|(t, _)| t == &q)
        .all(|(_, i)| *i >= 2 * D * H));
    // A tp that would split a group across shards is refused, naming the tensor.
    let err = rank_layout(&m, LayoutSpec::megatron(4, 1, 1).unwrap(), 0).unwrap_err();
    assert!(
        matches!(&err, Error::ImpossibleLayout { tensor, .. } if tensor.ends_with("k_proj.weight")),
        "{err}"
    );
    assert!(err.to_string().contains("query-group"), "{err}");
}

#[test]
fn regression_local_expert_k_of_ep_rank_s_is_global_expert_s_times_n_plus_k() {
    let m = model(qwen3(2, 8));
    let l = LayoutSpec::megatron(1, 1, 4).unwrap();
    for s in 0..4u32 {
        let r = rank_layout(&m, l, s).unwrap();
        for k in 0..2u64 {
            let fc2 = assembled(
                &r,
                &format!("decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc2.weight"),
            );
            let want = format!(
                "model.layers.1.mlp.experts.{}.down_proj.weight",
                u64::from(s) * 2 + k
            );
            assert!(fc2.iter().all(|(t, _)| t == &want), "rank {s} local {k}");
        }
        assert!(r
            .param("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight")
            .is_none());
    }
}

#[test]
fn stacked_3d_expert_checkpoints_cut_into_the_same_ranks() {
    for kind in ["qwen3_moe", "mixtral"] {
        let s = Spec {
            kind,
            stacked: true,
            ..qwen3(2, 8)
        };
        check(s, 2, 1, 2);
        check(s, 1, 2, 4);
    }
}

#[test]
fn pipeline_stages_number_their_layers_from_zero_and_hold_only_their_own() {
    let m = model(qwen3(4, 4));
    let l = LayoutSpec::megatron(1, 2, 1).unwrap();
    let last = rank_layout(&m, l, 1).unwrap();
    let qkv = assembled(&last, "decoder.layers.0.self_attention.linear_qkv.weight");
    assert!(qkv.iter().all(|(t, _)| t.starts_with("model.layers.2.")));
    assert!(last
        .param("decoder.layers.2.pre_mlp_layernorm.weight")
        .is_none());
    assert!(last.param("embedding.word_embeddings.weight").is_none());
    assert!(last.param("output_layer.weight").is_some());
    let first = rank_layout(&m, l, 0).unwrap();
    assert!(first.param("output_layer.weight").is_none());
    assert!(first.param("decoder.final_layernorm.weight").is_none());
}

#[test]
fn bad_megatron_layouts_and_checkpoints_are_refused_naming_the_tensor() {
    let refused = |m: &ModelInfo, tp: u32, pp: u32, ep: u32, tensor: &str, why: &str| {
        let err = rank_layout(m, LayoutSpec::megatron(tp, pp, ep).unwrap(), 0).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(tensor) && text.contains(why),
            "tp={tp} pp={pp} ep={ep}: {text}"
        );
    };
    let m = model(qwen3(3, 6));
    refused(&m, 1, 2, 1, "model.layers", "not divisible by pp=2");
    refused(
        &m,
        1,
        1,
        4,
        "mlp.experts",
        "6 experts are not divisible by ep=4",
    );
    refused(&m, 8, 1, 1, "k_proj", "query-group");
    let m = model(qwen3(2, 4));
    let mut extra = m.clone();
    extra.tensors.push(TensorSpec {
        name: "model.layers.0.mlp.experts.0.gate_up_proj.weight".into(),
        dtype: DType::BF16,
        shape: vec![8, H],
    });
    refused(
        &extra,
        1,
        1,
        1,
        "experts.0.gate_up_proj.weight",
        "not an expert projection",
    );
    let mut unknown = m.clone();
    unknown.tensors.push(TensorSpec {
        name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        dtype: DType::F32,
        shape: vec![2],
    });
    refused(
        &unknown,
        1,
        1,
        1,
        "rotary_emb.inv_freq",
        "no Megatron-Core parameter",
    );
    let mut missing = m.clone();
    missing
        .tensors
        .retain(|t| t.name != "model.layers.1.self_attn.v_proj.weight");
    let err = rank_layout(&missing, LayoutSpec::megatron(1, 1, 1).unwrap(), 0).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "model.layers.1.self_attn.v_proj.weight"),
        "{err}"
    );
}

#[test]
fn megatron_layout_specs_parse_strictly_and_print_back() {
    let l: LayoutSpec = "megatron:tp=2,pp=2,ep=2".parse().unwrap();
    assert_eq!(l, LayoutSpec::megatron(2, 2, 2).unwrap());
    assert_eq!(l.world_size, 8);
    assert_eq!(l.to_string(), "megatron:tp=2,pp=2,ep=2");
    let short: LayoutSpec = "megatron:ep=4,tp=2".parse().unwrap();
    assert_eq!(short.to_string(), "megatron:tp=2,pp=1,ep=4");
    for bad in [
        "megatron:tp=2,tp=2",
        "megatron:tp=0",
        "megatron:dp=2",
        "megatron:tp2",
        "megatron:tp=65536,pp=2",
    ] {
        let err = bad.parse::<LayoutSpec>().unwrap_err();
        assert!(
            matches!(&err, Error::BadLayoutSpec { spec, .. } if spec == bad),
            "{bad}: {err}"
        );
    }
    // Rank order tp-cp-ep-dp-pp: tp fastest, then ep, then the stage.
    let d = match l.scheme {
        crate::Scheme::Megatron(d) => d,
        _ => unreachable!(),
    };
    assert_eq!(d.coords(0), (0, 0, 0));
    assert_eq!(d.coords(1), (1, 0, 0));
    assert_eq!(d.coords(2), (0, 0, 1));
    assert_eq!(d.coords(5), (1, 1, 0));
}
