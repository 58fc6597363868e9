//! Property tests: executing a plan with the puller's executor (the code every puller runs, here
//! over sources in this process's memory) equals slicing the full tensors independently.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::too_many_arguments,
    missing_docs
)] // tests: panics are failures; model builders take every dim

use std::collections::HashMap;

use mx_layout::plan::{cut_for_layout, plan, plan_within, CostModel, Plan, Strategy as Pull};
use mx_layout::{
    rank_layout, rank_layouts, DType, DestPiece, Digest, Error, LayoutSpec, MemDevice, ModelInfo,
    RankLayout, Scheme, ShardEntry, SourceManifest, TensorBox, TensorSpec,
};
use mx_puller::exec::{ExecOptions, Executor, MemorySources};
use proptest::prelude::*;

/// Stages `p` from in-process sources and applies it to fresh buffers (0xAA everywhere first,
/// so a byte the plan misses shows), one per rank of `dest`.
fn execute<'a>(
    p: &Plan,
    manifests: &[SourceManifest],
    dest: &[RankLayout],
    read: impl Fn(usize, u64, u64) -> Option<&'a [u8]> + Sync + 'a,
) -> Result<Vec<Vec<u8>>, mx_puller::Error> {
    let mut exec = Executor::new(MemorySources::new(read));
    exec.stage(p, manifests, &ExecOptions::default())?;
    let mut live: Vec<Vec<u8>> = dest
        .iter()
        .map(|d| vec![0xAA; d.total_bytes as usize])
        .collect();
    for (i, buf) in live.iter_mut().enumerate() {
        exec.apply_rank(p, i, buf.as_mut_slice())?;
    }
    Ok(live)
}

/// Deterministic bytes of a global tensor.
fn full_bytes(t: &TensorSpec) -> Vec<u8> {
    let n: u64 = t.shape.iter().product::<u64>() * t.dtype.size_bytes();
    let seed = blake3::hash(t.name.as_bytes());
    let mut out = vec![0u8; n as usize];
    let mut xof = blake3::Hasher::new().update(seed.as_bytes()).finalize_xof();
    xof.fill(&mut out);
    out
}

/// Independent slicing: element by element, multi-index arithmetic.
fn slice(full: &[u8], shape: &[u64], region: &TensorBox, es: u64) -> Vec<u8> {
    let n = region.numel().unwrap();
    let mut out = Vec::with_capacity((n * es) as usize);
    let nd = shape.len();
    for i in 0..n {
        let mut rem = i;
        let mut flat = 0u64;
        let mut mul = 1u64;
        let mut coords = vec![0u64; nd];
        for d in (0..nd).rev() {
            coords[d] = rem % region.local_shape[d] + region.global_offset[d];
            rem /= region.local_shape[d];
        }
        for d in (0..nd).rev() {
            flat += coords[d] * mul;
            mul *= shape[d];
        }
        out.extend_from_slice(&full[(flat * es) as usize..((flat + 1) * es) as usize]);
    }
    out
}

/// Reference live buffer of one destination rank, built without the planner.
fn reference(rl: &RankLayout, fulls: &HashMap<String, (TensorSpec, Vec<u8>)>) -> Vec<u8> {
    let mut buf = vec![0u8; rl.total_bytes as usize];
    for p in &rl.params {
        for piece in &p.pieces {
            let (spec, full) = &fulls[&piece.tensor];
            let s = slice(full, &spec.shape, &piece.region, spec.dtype.size_bytes());
            buf[piece.offset as usize..piece.offset as usize + s.len()].copy_from_slice(&s);
        }
    }
    buf
}

struct Source {
    manifest: SourceManifest,
    base: u64,
    mem: Vec<u8>,
}

/// Builds source `rank` of `src_layout`: its memory holds its rank buffer, then packed regions.
fn build_source(
    layouts: &[RankLayout],
    rank: u32,
    fulls: &HashMap<String, (TensorSpec, Vec<u8>)>,
    dest: &[RankLayout],
    pack: bool,
) -> Source {
    let rl = &layouts[rank as usize];
    let base = 0x10_0000 * (u64::from(rank) + 1);
    let mut mem = reference(rl, fulls);
    let mut shards = Vec::new();
    for p in &rl.params {
        for piece in &p.pieces {
            let es = piece.dtype.size_bytes();
            let len = piece.region.numel().unwrap() * es;
            shards.push(ShardEntry {
                tensor: piece.tensor.clone(),
                dtype: piece.dtype,
                global_shape: piece.global_shape.clone(),
                shard: piece.region.clone(),
                addr: base + piece.offset,
                len,
                device: MemDevice::Dram,
                digest: Digest::of(&mem[piece.offset as usize..(piece.offset + len) as usize]),
            });
        }
    }
    let mut pieces = Vec::new();
    for cut in cut_for_layout(&shards, dest).unwrap() {
        let sh = &shards[cut.shard];
        let off = (sh.addr - base) as usize;
        let mut bytes = Vec::new();
        for &o in &cut.run_offsets {
            bytes.extend_from_slice(&mem[off + o as usize..off + (o + cut.run_bytes) as usize]);
        }
        let digest = Digest::of(&bytes);
        let packed_addr = if pack && cut.run_offsets.len() > 1 {
            let a = base + mem.len() as u64;
            mem.extend_from_slice(&bytes);
            Some(a)
        } else {
            None
        };
        pieces.push(DestPiece {
            layout: dest[0].layout,
            dest_rank: cut.dest_rank,
            tensor: cut.tensor,
            region: cut.region,
            digest,
            packed_addr,
        });
    }
    Source {
        manifest: SourceManifest {
            slot: rank,
            layout: rl.layout,
            agent_name: format!("src{rank}"),
            agent_metadata: Vec::new(),
            shards,
            pieces,
            pack_seconds: 0.0,
        },
        base,
        mem,
    }
}

fn run_case(
    model: &ModelInfo,
    src: LayoutSpec,
    dst: LayoutSpec,
    worker_ranks: &[u32],
    pack: bool,
    cost: CostModel,
) -> Result<mx_layout::plan::Plan, Error> {
    let fulls: HashMap<String, (TensorSpec, Vec<u8>)> = model
        .tensors
        .iter()
        .map(|t| (t.name.clone(), (t.clone(), full_bytes(t))))
        .collect();
    let src_layouts = rank_layouts(model, src)?;
    let dst_layouts = rank_layouts(model, dst)?;
    let sources: Vec<Source> = (0..src.world_size)
        .map(|r| build_source(&src_layouts, r, &fulls, &dst_layouts, pack))
        .collect();
    let manifests: Vec<SourceManifest> = sources.iter().map(|s| s.manifest.clone()).collect();
    let mine: Vec<RankLayout> = worker_ranks
        .iter()
        .map(|&r| dst_layouts[r as usize].clone())
        .collect();
    let p = plan(&mine, &manifests, &cost)?;
    let live = execute(&p, &manifests, &mine, |si, addr, len| {
        let s = &sources[si];
        let o = addr.checked_sub(s.base)? as usize;
        s.mem.get(o..o + len as usize)
    })
    .expect("verification failed");
    // The bounded plan stages at most the ranks' own bytes and writes the same bytes.
    let bound: u64 = mine.iter().map(|d| d.total_bytes).sum();
    let pb = plan_within(&mine, &manifests, &cost, bound)?;
    assert!(
        pb.staging_bytes <= bound,
        "bounded plan stages {} > {bound}",
        pb.staging_bytes
    );
    let live_b = execute(&pb, &manifests, &mine, |si, addr, len| {
        let s = &sources[si];
        let o = addr.checked_sub(s.base)? as usize;
        s.mem.get(o..o + len as usize)
    })
    .expect("verification failed (bounded plan)");
    assert_eq!(live, live_b, "the bounded plan writes other bytes");
    for (rl, buf) in mine.iter().zip(&live) {
        assert_eq!(
            buf,
            &reference(rl, &fulls),
            "rank {} of {dst} differs",
            rl.rank
        );
    }
    Ok(p)
}

fn llama(
    heads: u64,
    kv: u64,
    head_dim: u64,
    hidden: u64,
    inter: u64,
    vocab: u64,
    dtype: DType,
    tied: bool,
) -> ModelInfo {
    let mut t = vec![];
    let mut add = |name: String, shape: Vec<u64>| t.push(TensorSpec { name, dtype, shape });
    add("model.embed_tokens.weight".into(), vec![vocab, hidden]);
    if !tied {
        add("lm_head.weight".into(), vec![vocab, hidden]);
    }
    add("model.norm.weight".into(), vec![hidden]);
    let l = "model.layers.0";
    add(
        format!("{l}.self_attn.q_proj.weight"),
        vec![heads * head_dim, hidden],
    );
    add(
        format!("{l}.self_attn.k_proj.weight"),
        vec![kv * head_dim, hidden],
    );
    add(
        format!("{l}.self_attn.v_proj.weight"),
        vec![kv * head_dim, hidden],
    );
    add(format!("{l}.self_attn.q_proj.bias"), vec![heads * head_dim]);
    add(format!("{l}.self_attn.k_proj.bias"), vec![kv * head_dim]);
    add(format!("{l}.self_attn.v_proj.bias"), vec![kv * head_dim]);
    add(
        format!("{l}.self_attn.o_proj.weight"),
        vec![hidden, heads * head_dim],
    );
    add(format!("{l}.mlp.gate_proj.weight"), vec![inter, hidden]);
    add(format!("{l}.mlp.up_proj.weight"), vec![inter, hidden]);
    add(format!("{l}.mlp.down_proj.weight"), vec![hidden, inter]);
    add(format!("{l}.input_layernorm.weight"), vec![hidden]);
    add(format!("{l}.post_attention_layernorm.weight"), vec![hidden]);
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "num_hidden_layers": 1, "intermediate_size": inter, "tie_word_embeddings": tied,
    });
    ModelInfo::from_hf_config(&cfg, t).unwrap()
}

fn layout_strategy() -> impl Strategy<Value = LayoutSpec> {
    (0..3u8, 1..6u32).prop_map(|(s, n)| LayoutSpec {
        scheme: [Scheme::Fsdp, Scheme::VllmTp, Scheme::Replicated][s as usize],
        world_size: if s == 2 { n.min(2) } else { n },
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn plan_equals_slicing(
        kv in 1..4u64, group in 1..4u64, head_dim in 1..4u64, hidden in 1..12u64,
        inter in 1..12u64, vocab in 1..150u64, dt in 0..12usize, tied: bool,
        src in layout_strategy(), dst in layout_strategy(), pack: bool,
        one_rank in proptest::option::of(0..6u32), per_desc in 0.0..2e-5f64, bw in 0.5..20.0f64,
    ) {
        let model = llama(kv * group, kv, head_dim, hidden, inter, vocab, DType::ALL[dt], tied);
        // Layouts that cannot split this model are a clear error, not a panic.
        let (Ok(_), Ok(_)) = (rank_layouts(&model, src), rank_layouts(&model, dst)) else {
            return Ok(());
        };
        let ranks: Vec<u32> = match one_rank {
            Some(r) => vec![r % dst.world_size],
            None => (0..dst.world_size).collect(),
        };
        let cost = CostModel { per_descriptor_s: per_desc, wire_gbps: bw, per_segment_s: per_desc / 20.0 };
        run_case(&model, src, dst, &ranks, pack, cost).unwrap();
    }

    /// N-d boxes: a 3-D tensor split on a grid at the source and another grid at the destination.
    #[test]
    fn grid_boxes_3d(
        shape in proptest::collection::vec(1..7u64, 3),
        sgrid in proptest::collection::vec(1..4u64, 3),
        dgrid in proptest::collection::vec(1..4u64, 3),
        dt in 0..12usize, per_desc in 0.0..2e-5f64,
    ) {
        let t = TensorSpec { name: "experts.w".into(), dtype: DType::ALL[dt], shape: shape.clone() };
        let grid = |g: &[u64]| -> Vec<TensorBox> {
            let cuts: Vec<Vec<(u64, u64)>> = (0..3).map(|d| {
                let n = g[d].min(shape[d]);
                let per = shape[d].div_ceil(n);
                (0..n).map(|i| (i * per, ((i + 1) * per).min(shape[d]))).filter(|(a, b)| b > a).collect()
            }).collect();
            let mut out = vec![];
            for a in &cuts[0] { for b in &cuts[1] { for c in &cuts[2] {
                out.push(TensorBox { global_offset: vec![a.0, b.0, c.0], local_shape: vec![a.1 - a.0, b.1 - b.0, c.1 - c.0] });
            }}}
            out
        };
        let sl = LayoutSpec { scheme: Scheme::Fsdp, world_size: 1 };
        let dl = LayoutSpec { scheme: Scheme::VllmTp, world_size: 1 };
        let full = full_bytes(&t);
        let fulls: HashMap<String, (TensorSpec, Vec<u8>)> = [(t.name.clone(), (t.clone(), full.clone()))].into();
        let dst: Vec<RankLayout> = grid(&dgrid).into_iter().enumerate()
            .map(|(i, b)| RankLayout::from_boxes(dl, i as u32, &[(t.clone(), b)]).unwrap()).collect();
        let srcs: Vec<Source> = grid(&sgrid).into_iter().enumerate().map(|(i, b)| {
            let ls = vec![RankLayout::from_boxes(sl, i as u32, &[(t.clone(), b)]).unwrap(); 1];
            let mut s = build_source(&ls, 0, &fulls, &dst, i % 2 == 0);
            s.base += 0x100_0000 * i as u64;
            for sh in &mut s.manifest.shards { sh.addr += 0x100_0000 * i as u64; }
            for p in &mut s.manifest.pieces { if let Some(a) = &mut p.packed_addr { *a += 0x100_0000 * i as u64; } }
            s
        }).collect();
        let manifests: Vec<SourceManifest> = srcs.iter().map(|s| s.manifest.clone()).collect();
        let p = plan(&dst, &manifests, &CostModel { per_descriptor_s: per_desc, wire_gbps: 10.0, per_segment_s: 1e-8 }).unwrap();
        let live = execute(&p, &manifests, &dst, |si, addr, len| {
            let s = &srcs[si];
            let o = addr.checked_sub(s.base)? as usize;
            s.mem.get(o..o + len as usize)
        }).unwrap();
        for (rl, buf) in dst.iter().zip(&live) {
            prop_assert_eq!(buf, &reference(rl, &fulls));
        }
    }
}

fn smollm_like() -> ModelInfo {
    // SmolLM2-135M shapes for one layer: 9 heads, 3 kv heads, head_dim 64, hidden 576.
    llama(9, 3, 64, 576, 1536, 49152, DType::BF16, true)
}

#[test]
fn tp2_over_nine_heads_is_a_clear_error() {
    let m = smollm_like();
    let err = rank_layouts(&m, "tp:2".parse().unwrap()).unwrap_err();
    match err {
        Error::ImpossibleLayout { tensor, reason, .. } => {
            assert!(tensor.contains("q_proj"), "{tensor}");
            assert!(reason.contains("9 attention heads"), "{reason}");
        }
        e => panic!("unexpected {e}"),
    }
}

#[test]
fn vllm_tp3_qkv_and_vocab_padding() {
    let m = llama(9, 3, 64, 576, 1536, 49150, DType::BF16, true);
    let r1 = rank_layout(&m, "tp:3".parse().unwrap(), 1).unwrap();
    let qkv = r1
        .param("model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    assert_eq!(qkv.shape, vec![3 * 64 + 64 + 64, 576]);
    assert_eq!(qkv.pieces[0].region.global_offset, vec![192, 0]);
    assert_eq!(qkv.pieces[1].region.global_offset, vec![64, 0]); // kv head 1
    let emb = rank_layout(&m, "tp:3".parse().unwrap(), 2).unwrap();
    let e = emb.param("model.embed_tokens.weight").unwrap();
    // padded vocab 49152 / 3 = 16384 rows; rank 2 holds rows 32768..49150 and 2 zero rows.
    assert_eq!(e.shape, vec![16384, 576]);
    assert_eq!(e.pieces[0].region.local_shape, vec![16382, 576]);
    assert_eq!(e.zero_fill.unwrap().1, 2 * 576 * 2);
    // tp > kv heads: tp=9 -> ranks 0..2 share kv head 0, ranks 3..5 kv head 1.
    let m9 = llama(9, 3, 64, 576, 1152, 576, DType::BF16, true);
    let r4 = rank_layout(&m9, "tp:9".parse().unwrap(), 4).unwrap();
    let q = r4
        .param("model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    assert_eq!(q.pieces[1].region.global_offset, vec![64, 0]);
    let g = rank_layout(&m, "tp:3".parse().unwrap(), 0).unwrap();
    let gu = g.param("model.layers.0.mlp.gate_up_proj.weight").unwrap();
    assert_eq!(
        gu.pieces
            .iter()
            .map(|p| p.tensor.as_str())
            .collect::<Vec<_>>(),
        vec![
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight"
        ]
    );
    assert_eq!(gu.shape, vec![1024, 576]);
}

#[test]
fn fsdp_chunks_follow_torch_chunk() {
    // torch.chunk(10 rows, 4) -> 3, 3, 3, 1; chunk(2 rows, 4) -> 1, 1, (empty), (empty)
    assert_eq!(mx_layout::model::fsdp_rows(10, 3, 4), (9, 10));
    assert_eq!(mx_layout::model::fsdp_rows(2, 2, 4), (2, 2));
    assert_eq!(mx_layout::model::fsdp_rows(2, 1, 4), (1, 2));
}

#[test]
fn cost_model_picks_each_strategy() {
    let m = smollm_like();
    let fsdp4: LayoutSpec = "fsdp:4".parse().unwrap();
    let tp3: LayoutSpec = "tp:3".parse().unwrap();
    // Expensive descriptors and packing available: row-parallel tensors come packed.
    let p = run_case(&m, fsdp4, tp3, &[1], true, CostModel::default()).unwrap();
    let down = p
        .choices
        .iter()
        .find(|c| p.tensor_name(c.tensor).ends_with("down_proj.weight"))
        .unwrap();
    assert_eq!(down.strategy, Pull::Packed);
    // Free descriptors: exact runs.
    let free = CostModel {
        per_descriptor_s: 0.0,
        wire_gbps: 10.0,
        per_segment_s: 0.0,
    };
    let p = run_case(&m, fsdp4, tp3, &[1], false, free).unwrap();
    assert!(p.choices.iter().all(|c| c.strategy == Pull::Exact));
    // Costly descriptors, no packing: a superset span beats 144 rows of 1 KiB.
    let p = run_case(
        &m,
        fsdp4,
        tp3,
        &[1],
        false,
        CostModel {
            per_descriptor_s: 1e-3,
            wire_gbps: 10.0,
            per_segment_s: 0.0,
        },
    )
    .unwrap();
    let down = p
        .choices
        .iter()
        .find(|c| p.tensor_name(c.tensor).ends_with("down_proj.weight"))
        .unwrap();
    assert_eq!(down.strategy, Pull::Superset);
    // A worker holding all three ranks, with nothing packed and free local segments, pulls whole
    // rows of o_proj exactly: one run per shard.
    let rows = CostModel {
        per_segment_s: 0.0,
        ..CostModel::default()
    };
    let p = run_case(&m, fsdp4, tp3, &[0, 1, 2], false, rows).unwrap();
    let o = p
        .choices
        .iter()
        .find(|c| p.tensor_name(c.tensor).ends_with("o_proj.weight"))
        .unwrap();
    assert_eq!((o.strategy, o.descriptors), (Pull::Exact, 1));
}

#[test]
fn dtype_mismatch_between_source_and_destination_names_the_tensor() {
    let src_model = smollm_like();
    let mut dst_model = src_model.clone();
    for t in &mut dst_model.tensors {
        if t.name.ends_with("o_proj.weight") {
            t.dtype = DType::F16;
        }
    }
    let fulls: HashMap<String, (TensorSpec, Vec<u8>)> = src_model
        .tensors
        .iter()
        .map(|t| (t.name.clone(), (t.clone(), full_bytes(t))))
        .collect();
    let sl = rank_layouts(&src_model, "fsdp:2".parse().unwrap()).unwrap();
    let dl = rank_layouts(&dst_model, "tp:3".parse().unwrap()).unwrap();
    let src = build_source(&sl, 0, &fulls, &dl, false);
    let err = plan(&dl, &[src.manifest], &CostModel::default()).unwrap_err();
    assert!(
        matches!(&err, Error::Mismatch { tensor, what: "dtype", .. } if tensor.ends_with("o_proj.weight")),
        "{err}"
    );
}

#[test]
fn missing_source_coverage_is_a_gap_naming_the_param() {
    let m = smollm_like();
    let fulls: HashMap<String, (TensorSpec, Vec<u8>)> = m
        .tensors
        .iter()
        .map(|t| (t.name.clone(), (t.clone(), full_bytes(t))))
        .collect();
    let sl = rank_layouts(&m, "fsdp:2".parse().unwrap()).unwrap();
    let dl = rank_layouts(&m, "tp:3".parse().unwrap()).unwrap();
    // Only source 0 of 2: half of every tensor is missing.
    let src = build_source(&sl, 0, &fulls, &dl, false);
    let err = plan(&dl[..1], &[src.manifest], &CostModel::default()).unwrap_err();
    assert!(matches!(err, Error::CoverageGap { .. }), "{err}");
    // A tensor no source published at all is named.
    let mut src = build_source(&sl, 0, &fulls, &dl, false);
    src.manifest
        .shards
        .retain(|s| !s.tensor.ends_with("input_layernorm.weight"));
    let err = plan(&dl[..1], &[src.manifest], &CostModel::default()).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor.ends_with("input_layernorm.weight")),
        "{err}"
    );
}

#[test]
fn checkpoint_missing_a_layer_tensor_or_with_a_wrong_shape_is_refused() {
    let m = smollm_like();
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "num_hidden_layers": 1,
        "intermediate_size": 1536, "tie_word_embeddings": true,
    });
    let mut t = m.tensors.clone();
    t.retain(|t| !t.name.ends_with("mlp.down_proj.weight"));
    let err = ModelInfo::from_hf_config(&cfg, t).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "model.layers.0.mlp.down_proj.weight"),
        "{err}"
    );
    let mut t = m.tensors.clone();
    for x in &mut t {
        if x.name == "model.layers.0.input_layernorm.weight" {
            x.shape = vec![288, 2];
        }
    }
    let err = ModelInfo::from_hf_config(&cfg, t).unwrap_err();
    assert!(
        matches!(&err, Error::Mismatch { tensor, what: "shape", .. } if tensor == "model.layers.0.input_layernorm.weight"),
        "{err}"
    );
    // Two layers declared, one present.
    let mut cfg2 = cfg.clone();
    cfg2["num_hidden_layers"] = 2.into();
    let err = ModelInfo::from_hf_config(&cfg2, m.tensors.clone()).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor.starts_with("model.layers.1.")),
        "{err}"
    );
    // Not tied: lm_head is required.
    let mut cfg3 = cfg.clone();
    cfg3["tie_word_embeddings"] = false.into();
    let err = ModelInfo::from_hf_config(&cfg3, m.tensors.clone()).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "lm_head.weight"),
        "{err}"
    );
}
