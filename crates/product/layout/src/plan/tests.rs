#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use proptest::prelude::*;

use super::coverage::{prove_coverage_sorted, sort_by_start};
use super::geometry::runs_in;
use super::index::name_hash;
use super::order::{by_value, group_by_first_seen, order_by_key, order_wires, permute_in_place};
use super::sinks::{CopySink, SegmentSink};
use super::*;
use crate::plan_reference;
use crate::{
    rank_layouts, DType, Digest, LayoutSpec, MemDevice, ModelInfo, Scheme, ShardEntry, TensorBox,
    TensorSpec,
};

fn llama(heads: u64, kv: u64, head_dim: u64, hidden: u64, inter: u64, vocab: u64) -> ModelInfo {
    let dtype = DType::BF16;
    let mut t = vec![];
    let mut add = |name: String, shape: Vec<u64>| t.push(TensorSpec { name, dtype, shape });
    add("model.embed_tokens.weight".into(), vec![vocab, hidden]);
    add("lm_head.weight".into(), vec![vocab, hidden]);
    add("model.norm.weight".into(), vec![hidden]);
    for l in 0..2 {
        let l = format!("model.layers.{l}");
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
        add(
            format!("{l}.self_attn.o_proj.weight"),
            vec![hidden, heads * head_dim],
        );
        add(format!("{l}.mlp.gate_proj.weight"), vec![inter, hidden]);
        add(format!("{l}.mlp.up_proj.weight"), vec![inter, hidden]);
        add(format!("{l}.mlp.down_proj.weight"), vec![hidden, inter]);
        add(format!("{l}.input_layernorm.weight"), vec![hidden]);
        add(format!("{l}.post_attention_layernorm.weight"), vec![hidden]);
    }
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "num_hidden_layers": 2, "intermediate_size": inter, "tie_word_embeddings": false,
    });
    ModelInfo::from_hf_config(&cfg, t).unwrap()
}

/// `p` with its copies and segments expanded row by row and compressed again.
fn recompress(p: &Plan) -> Plan {
    let mut q = p.clone();
    let mut sink = CopySink::new(0);
    for c in &p.copies {
        for (s, l) in c.rows() {
            sink.push(c.rank_index, s, l, c.len);
        }
    }
    q.copies = sink.finish();
    let mut seg = SegmentSink::default();
    for v in &mut q.verify {
        let runs: Vec<(u64, u64)> = v.byte_ranges().collect();
        for (o, l) in runs {
            seg.push(o, l);
        }
        v.segments = seg.take();
    }
    q
}

/// Distinct digests per piece, so verification dedup depends on real content identity.
fn with_digests(mut ms: Vec<SourceManifest>) -> Vec<SourceManifest> {
    for m in &mut ms {
        for p in &mut m.pieces {
            let mut h = blake3::Hasher::new();
            h.update(p.tensor.as_bytes());
            for v in p.region.global_offset.iter().chain(&p.region.local_shape) {
                h.update(&v.to_le_bytes());
            }
            p.digest = h.finalize().into();
        }
    }
    ms
}

/// The compact plan, made from `ms` and expanded row by row, is the reference's plan.
fn same(
    ms: &[SourceManifest],
    new: Result<Plan, Error>,
    old: Result<plan_reference::RefPlan, Error>,
) -> Result<(), TestCaseError> {
    match (new, old) {
        (Ok(a), Ok(b)) => {
            // The compact form is canonical: re-compressing the expansion gives it back.
            prop_assert_eq!(&recompress(&a), &a);
            prop_assert_eq!(plan_reference::expand(&a, ms), b)
        }
        (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
        (a, b) => prop_assert!(false, "indexed {:?} vs reference {:?}", a.err(), b.err()),
    }
    Ok(())
}

fn check_all(
    dest_all: &[RankLayout],
    ms: &[SourceManifest],
    cost: &CostModel,
) -> Result<(), TestCaseError> {
    // One index, many plans: each single rank, then the whole layout, each equal to the
    // per-call planner of before.
    let index = SourceIndex::new(ms).unwrap();
    for r in 0..dest_all.len() {
        let d = &dest_all[r..=r];
        same(ms, index.plan(d, cost), plan_reference::plan(d, ms, cost))?;
        same(ms, plan(d, ms, cost), plan_reference::plan(d, ms, cost))?;
    }
    same(
        ms,
        index.plan(dest_all, cost),
        plan_reference::plan(dest_all, ms, cost),
    )?;
    Ok(())
}

fn layout(s: u8, n: u32) -> LayoutSpec {
    LayoutSpec {
        scheme: [Scheme::Fsdp, Scheme::VllmTp, Scheme::Replicated][s as usize],
        world_size: n,
    }
}

fn grid(shape: &[u64], g: &[u64]) -> Vec<TensorBox> {
    let cuts: Vec<Vec<(u64, u64)>> = (0..shape.len())
        .map(|d| {
            let n = g[d].min(shape[d]).max(1);
            let per = shape[d].div_ceil(n);
            (0..n)
                .map(|i| (i * per, ((i + 1) * per).min(shape[d])))
                .filter(|(a, b)| b > a)
                .collect()
        })
        .collect();
    let mut out = vec![];
    for a in &cuts[0] {
        for b in &cuts[1] {
            for c in &cuts[2] {
                out.push(TensorBox {
                    global_offset: vec![a.0, b.0, c.0],
                    local_shape: vec![a.1 - a.0, b.1 - b.0, c.1 - c.0],
                });
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The indexed planner equals the per-call planner on llama layouts, with and without
    /// packing, replicated (alternative) sources included.
    #[test]
    fn indexed_plan_equals_reference(
        kv in 1..4u64, group in 1..3u64, head_dim in 1..4u64, hidden in 1..10u64,
        inter in 1..10u64, vocab in 1..130u64, s in 0..3u8, sn in 1..6u32, d in 0..3u8,
        dn in 1..5u32, pack: bool, per_desc in 0.0..2e-5f64,
    ) {
        let model = llama(kv * group, kv, head_dim, hidden, inter, vocab);
        let src = layout(s, if s == 2 { sn.min(3) } else { sn });
        let dst = layout(d, dn);
        let (Ok(_), Ok(dest_all)) = (rank_layouts(&model, src), rank_layouts(&model, dst)) else {
            return Ok(());
        };
        let packs: Vec<Vec<u32>> = if pack { vec![(0..dn).collect()] } else { vec![] };
        let ms = with_digests(synthetic_manifests(&model, src, dst, &packs).unwrap());
        let cost = CostModel { per_descriptor_s: per_desc, wire_gbps: 10.0, per_segment_s: per_desc / 20.0 };
        check_all(&dest_all, &ms, &cost)?;
        // Every source shard cut exactly as the straightforward cutter does.
        for r in 0..src.world_size {
            let rl = crate::rank_layout(&model, src, r).unwrap();
            let shards = rl.shard_entries(0);
            prop_assert_eq!(
                cut_for_layout(&shards, &dest_all).unwrap(),
                plan_reference::cut_for_layout(&shards, &dest_all).unwrap()
            );
        }
    }

    /// The chain-based coverage proof agrees with sorting every copy: random tilings of two
    /// ranks' buffers cut into copies, shuffled, then possibly perturbed.
    #[test]
    fn coverage_proof_equals_sorting_every_copy(
        cuts in proptest::collection::vec((0..2usize, 1..6u64), 1..24),
        order in proptest::collection::vec(0..1000u32, 24),
        perturb in proptest::option::of((0..24usize, 0..3u8)),
        zero_rank1 in 0..4u64,
    ) {
        let mut ends = [0u64; 2];
        let mut copies = vec![];
        for (k, &(r, l)) in cuts.iter().enumerate() {
            copies.push(Copy::single(r, k as u64 * 7, ends[r], l));
            ends[r] += l;
        }
        let zero = vec![ZeroFill { rank_index: 1, live_offset: ends[1], len: zero_rank1 }];
        let mk = |rank: u32, total: u64| RankLayout {
            layout: LayoutSpec { scheme: Scheme::VllmTp, world_size: 2 },
            rank,
            params: vec![],
            total_bytes: total,
        };
        let dest = [mk(0, ends[0]), mk(1, ends[1] + zero_rank1)];
        let n = copies.len();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&i| order[i]);
        let mut copies: Vec<Copy> = idx.into_iter().map(|i| copies[i]).collect();
        if let Some((i, how)) = perturb {
            let c = &mut copies[i % n];
            match how {
                0 => c.len += 1,
                1 => c.live_offset += 1,
                _ => c.len = 0,
            }
        }
        let fast = prove_coverage(&dest, &copies, &zero).map_err(|e| e.to_string());
        let slow = prove_coverage_sorted(&dest, &copies, &zero).map_err(|e| e.to_string());
        prop_assert_eq!(&fast, &slow);
        // The same rows as strided copies: the same verdict and error.
        let mut sink = CopySink::new(0);
        for c in &copies {
            sink.push(c.rank_index, c.staging_offset, c.live_offset, c.len);
        }
        let strided = sink.finish();
        let rows: Vec<Copy> = strided
            .iter()
            .flat_map(|c| c.rows().map(move |(s, l)| Copy::single(c.rank_index, s, l, c.len)))
            .collect();
        let merged = {
            // What the sink merged without strides: the rows themselves.
            let mut sink = CopySink::new(0);
            for c in &rows {
                sink.push(c.rank_index, c.staging_offset, c.live_offset, c.len);
            }
            sink.finish()
        };
        prop_assert_eq!(&merged, &strided);
        let fast2 = prove_coverage(&dest, &strided, &zero).map_err(|e| e.to_string());
        let slow2 = prove_coverage_sorted(&dest, &rows, &zero).map_err(|e| e.to_string());
        prop_assert_eq!(&fast2, &slow2);
        // Merging abutting copies changes neither coverage nor (for tilings) the verdict.
        prop_assert_eq!(fast2.is_ok(), fast.is_ok());
    }

    /// The compact run description lists exactly the runs of `decompose`.
    #[test]
    fn runs_in_equals_decompose(
        dims in proptest::collection::vec((1..6u64, 0..6u64, 0..6u64, 0..9u64), 0..5),
    ) {
        // Per dim: outer extent, inner start and length inside it, outer global offset.
        let outer = TensorBox {
            global_offset: dims.iter().map(|d| d.3).collect(),
            local_shape: dims.iter().map(|d| d.0).collect(),
        };
        let start = |d: &(u64, u64, u64, u64)| d.1 % d.0;
        let inner = TensorBox {
            global_offset: dims.iter().map(|d| d.3 + start(d)).collect(),
            local_shape: dims.iter().map(|d| 1 + d.2 % (d.0 - start(d))).collect(),
        };
        prop_assume!(outer.contains(&inner));
        let (run, starts) = decompose(&inner, &outer);
        let (run2, runs) = runs_in(
            &inner.global_offset, &inner.local_shape, &outer.global_offset, &outer.local_shape,
        );
        prop_assert_eq!(run, run2);
        let listed: Vec<u64> = (0..runs.len()).map(|i| runs.get(i)).collect();
        prop_assert_eq!(listed, starts);
    }

    /// Rows pushed at once equal the same rows pushed one by one, after any earlier rows;
    /// likewise segment runs.
    #[test]
    fn closed_form_rows_equal_row_by_row(
        before in proptest::collection::vec((0..2usize, 0..64u64, 0..64u64, 1..5u64), 0..4),
        rank in 0..2usize, s in 0..64u64, ss in 0..9u64, l in 0..64u64, ls in 0..9u64,
        len in 1..5u64, count in 0..9u64, wrap: bool,
    ) {
        // Offsets near u64::MAX make some rows wrap: then the rows are pushed one by one.
        let top = if wrap { u64::MAX - 40 } else { 0 };
        let (s, l) = (s.wrapping_add(top), l.wrapping_add(top));
        let mut a = CopySink::new(0);
        let mut b = CopySink::new(0);
        for &(r, x, y, n) in &before {
            a.push(r, x, y, n);
            b.push(r, x, y, n);
        }
        a.push_rows(rank, (s, ss), (l, ls), len, count);
        for i in 0..count {
            b.push(rank, s.wrapping_add(i * ss), l.wrapping_add(i * ls), len);
        }
        prop_assert_eq!(a.finish(), b.finish());
        let mut a = SegmentSink::default();
        let mut b = SegmentSink::default();
        for &(_, x, _, n) in &before {
            a.push(x, n);
            b.push(x, n);
        }
        a.push_runs(s, ss, len, count);
        for i in 0..count {
            b.push(s.wrapping_add(i * ss), len);
        }
        prop_assert_eq!(a.take(), b.take());
    }

    /// The radix ordering is a stable sort by key; the permutation applies it in place.
    #[test]
    fn order_by_key_is_a_stable_sort(keys in proptest::collection::vec(0..5000usize, 0..300)) {
        let order = order_by_key(&keys, 5000);
        let mut expect: Vec<usize> = (0..keys.len()).collect();
        expect.sort_by_key(|&i| keys[i]);
        prop_assert_eq!(&order, &expect);
        let mut v: Vec<usize> = (0..keys.len()).map(|i| i * 10).collect();
        permute_in_place(&mut v, &order);
        let want: Vec<usize> = order.iter().map(|&i| i * 10).collect();
        prop_assert_eq!(v, want);
    }

    /// Grouping by first occurrence: groups in order of their key's first occurrence, members
    /// in index order; `None` exactly when the keys are grouped already. Small key ranges
    /// make repeats (and so both paths) common.
    #[test]
    fn group_by_first_seen_groups_stably(
        keys in proptest::collection::vec(0..12usize, 0..200),
        runs in proptest::bool::ANY,
    ) {
        // Half the cases grouped already: each key's occurrences in a row.
        let keys = if runs {
            let mut k = keys;
            k.sort_unstable();
            k
        } else {
            keys
        };
        let mut first: Vec<usize> = Vec::new();
        for &k in &keys {
            if !first.contains(&k) {
                first.push(k);
            }
        }
        let mut expect: Vec<usize> = (0..keys.len()).collect();
        expect.sort_by_key(|&i| first.iter().position(|&f| f == keys[i]));
        let grouped = keys
            .iter()
            .enumerate()
            .all(|(i, k)| keys[..i].last() == Some(k) || !keys[..i].contains(k));
        match group_by_first_seen(&keys, 12) {
            None => {
                prop_assert!(grouped);
                prop_assert_eq!(expect, (0..keys.len()).collect::<Vec<_>>());
            }
            Some(order) => {
                prop_assert!(!grouped);
                prop_assert_eq!(order, expect);
            }
        }
    }

    /// Wire runs are ordered exactly as a stable sort by value, whether or not each source's
    /// runs come in order (few distinct values make ties common).
    #[test]
    fn order_wires_is_a_stable_sort(
        wire in proptest::collection::vec((0..4usize, 0..6u64, 1..3u64), 0..120),
        sorted_per_source in proptest::bool::ANY,
    ) {
        let mut wire = wire;
        if sorted_per_source {
            wire.sort_by_key(|w| (w.1, w.2));
        }
        prop_assert_eq!(order_wires(&wire, 4), by_value(&wire));
    }

    /// The radix sort of spans orders by start exactly as a comparison sort (long lists take
    /// the radix path; starts spread over up to 40 bits, so it runs four digit passes).
    #[test]
    fn sort_by_start_orders_by_start(
        seed in proptest::collection::vec((0..(1u64 << 40), 0..1000u64), 0..64),
        len in 4096..6000usize,
    ) {
        let mut v: Vec<(u64, u64)> = (0..len)
            .map(|i| {
                let (a, b) = seed.get(i % seed.len().max(1)).copied().unwrap_or((0, 0));
                (a.wrapping_mul(i as u64 + 1) % (1 << 40), b)
            })
            .collect();
        let mut want = v.clone();
        want.sort_unstable_by_key(|x| x.0);
        sort_by_start(&mut v);
        let starts: Vec<u64> = v.iter().map(|x| x.0).collect();
        let want_starts: Vec<u64> = want.iter().map(|x| x.0).collect();
        prop_assert_eq!(starts, want_starts);
        let (mut a, mut b) = (v, want);
        a.sort_unstable();
        b.sort_unstable();
        prop_assert_eq!(a, b);
    }

    /// 3-D grids, sources from one or two different grids (two grids overlap: an error the
    /// indexed planner must report exactly as before), some replicated.
    #[test]
    fn indexed_plan_equals_reference_on_grids(
        shape in proptest::collection::vec(1..7u64, 3),
        g1 in proptest::collection::vec(1..4u64, 3),
        g2 in proptest::collection::vec(1..4u64, 3),
        dg in proptest::collection::vec(1..4u64, 3),
        two_grids: bool, replicas in 1..3usize, drop_one: bool,
    ) {
        let t = TensorSpec { name: "experts.w".into(), dtype: DType::F32, shape: shape.clone() };
        let sl = layout(0, 1);
        let dl = layout(1, 1);
        let dest_all: Vec<RankLayout> = grid(&shape, &dg).into_iter().enumerate()
            .map(|(i, b)| RankLayout::from_boxes(dl, i as u32, &[(t.clone(), b)]).unwrap())
            .collect();
        let mut boxes = grid(&shape, &g1);
        if two_grids {
            boxes.extend(grid(&shape, &g2));
        }
        let mut ms = vec![];
        for _ in 0..replicas {
            for b in &boxes {
                let rl = RankLayout::from_boxes(sl, ms.len() as u32, &[(t.clone(), b.clone())]).unwrap();
                ms.push(synthetic_manifest(&rl, &dest_all, &[vec![0, 2]]).unwrap());
            }
        }
        if drop_one && ms.len() > 1 {
            ms.remove(ms.len() / 2);
        }
        let ms = with_digests(ms);
        check_all(&dest_all, &ms, &CostModel::default())?;
        let all: Vec<ShardEntry> = ms.iter().flat_map(|m| m.shards.clone()).collect();
        prop_assert_eq!(
            cut_for_layout(&all, &dest_all).unwrap(),
            plan_reference::cut_for_layout(&all, &dest_all).unwrap()
        );
    }
}

fn base_case() -> (Vec<RankLayout>, Vec<SourceManifest>) {
    let model = llama(4, 2, 4, 8, 12, 100);
    let dest = rank_layouts(&model, "tp:2".parse().unwrap()).unwrap();
    let ms = synthetic_manifests(
        &model,
        "fsdp:3".parse().unwrap(),
        "tp:2".parse().unwrap(),
        &[vec![1]],
    )
    .unwrap();
    (dest, with_digests(ms))
}

fn same_error(dest: &[RankLayout], ms: &[SourceManifest]) -> String {
    let cost = CostModel::default();
    let old = plan_reference::plan(dest, ms, &cost)
        .unwrap_err()
        .to_string();
    let new = plan(dest, ms, &cost).unwrap_err().to_string();
    assert_eq!(new, old);
    new
}

#[test]
fn strided_copies_and_segments() {
    // Rows of 4 bytes: staging every 10, live every 4 (contiguous), then a break.
    let mut sink = CopySink::new(0);
    for i in 0..5u64 {
        sink.push(0, 100 + 10 * i, 4 * i, 4);
    }
    sink.push(0, 3, 20, 2);
    sink.push(0, 5, 22, 2); // continues the previous row: one copy of 4
    sink.push(1, 0, 0, 4);
    let c = sink.finish();
    assert_eq!(
        c,
        vec![
            Copy {
                rank_index: 0,
                staging_offset: 100,
                live_offset: 0,
                len: 4,
                count: 5,
                staging_stride: 10,
                live_stride: 4
            },
            Copy::single(0, 3, 20, 4),
            Copy::single(1, 0, 0, 4),
        ]
    );
    assert!(c[0].live_contiguous());
    assert_eq!(c[0].bytes(), Some(20));
    assert_eq!(c[0].rows().last(), Some((140, 16)));
    assert_eq!(c[0].row(5), None);
    // Old JSON (no strides) reads as single copies and segments.
    let old: Copy =
        serde_json::from_str(r#"{"rank_index":1,"staging_offset":2,"live_offset":3,"len":4}"#)
            .unwrap();
    assert_eq!(old, Copy::single(1, 2, 3, 4));
    let seg: Segment = serde_json::from_str(r#"{"offset":5,"len":6}"#).unwrap();
    assert_eq!(seg.runs().collect::<Vec<_>>(), vec![(5, 6)]);
    let mut s = SegmentSink::default();
    for o in [0u64, 8, 16, 20, 40] {
        s.push(o, 4);
    }
    // 16 and 20 join into one run of 8.
    let segs = s.take();
    assert_eq!(
        segs.iter().flat_map(Segment::runs).collect::<Vec<_>>(),
        vec![(0, 4), (8, 4), (16, 8), (40, 4)]
    );
    assert_eq!(segs.len(), 3);
    let c = Candidates::new([
        (super::Strategy::Exact, 1.0),
        (super::Strategy::Superset, 2.0),
    ]);
    let j = serde_json::to_string(&c).unwrap();
    assert_eq!(j, r#"[["Exact",1.0],["Superset",2.0]]"#);
    assert_eq!(serde_json::from_str::<Candidates>(&j).unwrap(), c);
}

#[test]
fn segments_stand_for_a_list() {
    let g = Segment {
        offset: 1,
        len: 2,
        count: 3,
        stride: 4,
    };
    for v in [vec![], vec![g], vec![g, g]] {
        let s = Segments::from(v.clone());
        assert_eq!(&*s, v.as_slice());
        assert_eq!((&s).into_iter().count(), v.len());
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(j, serde_json::to_string(&v).unwrap());
        assert_eq!(serde_json::from_str::<Segments>(&j).unwrap(), s);
        assert_eq!(Vec::from(s), v);
    }
}

#[test]
fn errors_are_those_of_the_reference() {
    let (dest, ms) = base_case();
    // Missing digest for a region.
    let mut m = ms.clone();
    m[1].pieces.retain(|p| !p.tensor.ends_with("o_proj.weight"));
    assert!(same_error(&dest, &m).contains("published no digest"));
    // A tensor nobody published.
    let mut m = ms.clone();
    for x in &mut m {
        x.shards.retain(|s| s.tensor != "model.norm.weight");
    }
    assert!(same_error(&dest, &m).contains("no source published it"));
    // Dtype disagreement on every shard (uniform) and on one source only (not uniform).
    let mut m = ms.clone();
    for x in &mut m {
        for s in &mut x.shards {
            if s.tensor.ends_with("down_proj.weight") {
                s.dtype = DType::F16;
            }
        }
    }
    assert!(same_error(&dest, &m).contains("dtype mismatch"));
    let mut m = ms.clone();
    for s in &mut m[2].shards {
        if s.tensor == "lm_head.weight" {
            s.global_shape = vec![200, 4];
            s.shard.local_shape = vec![s.shard.local_shape[0], 4];
            s.len = s.shard.numel().unwrap() * 2;
        }
    }
    assert!(same_error(&dest, &m).contains("shape mismatch"));
    // A missing source: coverage gap.
    assert!(same_error(&dest, &ms[..2]).contains("coverage gap"));
    // An inconsistent manifest.
    let mut m = ms.clone();
    m[0].shards[0].len += 1;
    assert!(same_error(&dest, &m).contains("manifest of source slot 0"));
    assert!(SourceIndex::new(&m).is_err());
    // A malformed destination region is refused without panicking.
    let mut d = dest.clone();
    d[0].params[0].pieces[0].region.global_offset.pop();
    let e = plan(&d, &ms, &CostModel::default()).unwrap_err();
    assert!(matches!(e, Error::CoverageGap { .. }), "{e}");
}

#[test]
fn one_index_serves_every_worker_like_a_fresh_plan() {
    let model = llama(8, 2, 4, 16, 24, 300);
    let tp4: LayoutSpec = "tp:4".parse().unwrap();
    let dest = rank_layouts(&model, tp4).unwrap();
    // Four FSDP sources plus a replica of each: alternatives spread over ranks.
    let mut ms =
        synthetic_manifests(&model, "fsdp:4".parse().unwrap(), tp4, &[vec![0, 1]]).unwrap();
    let replicas: Vec<SourceManifest> = ms
        .iter()
        .map(|m| {
            let mut r = m.clone();
            r.slot += 4;
            r
        })
        .collect();
    ms.extend(replicas);
    let ms = with_digests(ms);
    let cost = CostModel::default();
    let index = SourceIndex::new(&ms).unwrap();
    assert!(index.approx_bytes() > 0);
    assert_eq!(index.sources().len(), 8);
    for workers in [vec![0usize], vec![1, 2], vec![0, 1, 2, 3], vec![3]] {
        let d: Vec<RankLayout> = workers.iter().map(|&r| dest[r].clone()).collect();
        let a = index.plan(&d, &cost).unwrap();
        let b = plan(&d, &ms, &cost).unwrap();
        // An index of these ranks' pieces only plans them alike, and is smaller.
        let own = SourceIndex::for_ranks(&ms, &d).unwrap();
        assert_eq!(own.plan(&d, &cost).unwrap(), a);
        if workers.len() < 4 {
            assert!(own.approx_bytes() < index.approx_bytes());
        }
        let c = plan_reference::plan(&d, &ms, &cost).unwrap();
        assert_eq!(a, b);
        assert_eq!(plan_reference::expand(&a, &ms), c);
        // Both replicas serve some reads.
        if workers.len() == 4 {
            assert!(a.reads.iter().any(|r| r.source >= 4));
            assert!(a.reads.iter().any(|r| r.source < 4));
        }
    }
}

/// Tensors are found by name through the hash table, and through the collision table when
/// another name holds their hash: here every name's hash is made to point at the first
/// tensor, so all but that one are looked up as collided names. Plans are unchanged.
#[test]
fn tensors_are_found_by_name_even_when_hashes_collide() {
    let model = llama(8, 2, 4, 16, 24, 300);
    let tp2: LayoutSpec = "tp:2".parse().unwrap();
    let dest = rank_layouts(&model, tp2).unwrap();
    let ms = synthetic_manifests(&model, "fsdp:2".parse().unwrap(), tp2, &[]).unwrap();
    let cost = CostModel::default();
    let index = SourceIndex::new(&ms).unwrap();
    let expect = index.plan(&dest, &cost).unwrap();
    let names: Vec<Arc<str>> = index.tensors.iter().map(|t| Arc::clone(&t.name)).collect();
    assert!(names.len() > 2);
    // In order of first appearance over the sources.
    assert_eq!(&*names[0], ms[0].shards[0].tensor.as_str());
    let mut forced = SourceIndex::new(&ms).unwrap();
    forced.by_hash.clear();
    forced.collided.clear();
    for (id, n) in (0u32..).zip(&names) {
        forced.by_hash.insert(name_hash(n), 0);
        if id > 0 {
            forced.collided.insert(ms_name(&ms, n), id);
        }
    }
    for (i, n) in names.iter().enumerate() {
        assert_eq!(index.tensor(n).map(|(k, _)| k), Some(i));
        assert_eq!(forced.tensor(n).map(|(k, _)| k), Some(i), "{n}");
    }
    assert!(index.tensor("no.such.tensor").is_none());
    assert!(forced.tensor("no.such.tensor").is_none());
    assert_eq!(forced.plan(&dest, &cost).unwrap(), expect);
}

/// The manifests' own copy of tensor name `n` (the collision table borrows from them).
fn ms_name<'m>(ms: &'m [SourceManifest], n: &str) -> &'m str {
    ms.iter()
        .flat_map(|m| &m.shards)
        .find(|s| s.tensor == n)
        .map(|s| s.tensor.as_str())
        .unwrap()
}
#[test]
fn synthetic_manifest_matches_synthetic_manifests() {
    let model = llama(4, 2, 4, 8, 12, 100);
    let (src, dst): (LayoutSpec, LayoutSpec) = ("fsdp:3".parse().unwrap(), "tp:2".parse().unwrap());
    let all = synthetic_manifests(&model, src, dst, &[vec![0]]).unwrap();
    let dest = rank_layouts(&model, dst).unwrap();
    for (r, m) in all.iter().enumerate() {
        let rl = crate::rank_layout(&model, src, r as u32).unwrap();
        assert_eq!(&synthetic_manifest(&rl, &dest, &[vec![0]]).unwrap(), m);
        assert_eq!(m.shards[0].addr, (r as u64 + 1) << 40);
        assert!(m.shards.iter().all(|s| s.device == MemDevice::Dram));
    }
}

/// A new policy version changes every digest and nothing else: the geometry digest is
/// unchanged and so is the plan, whose checks then look up the new digests. Any field a
/// plan depends on changes the geometry digest.
#[test]
fn geometry_digest_ignores_digests_and_sees_every_planned_field() {
    type Change = Box<dyn Fn(&mut Vec<SourceManifest>)>;
    let model = llama(8, 2, 4, 16, 24, 300);
    let tp2: LayoutSpec = "tp:2".parse().unwrap();
    let dest = rank_layouts(&model, tp2).unwrap();
    let a = with_digests(
        synthetic_manifests(&model, "fsdp:4".parse().unwrap(), tp2, &[vec![0, 1]]).unwrap(),
    );
    let g = crate::geometry_digest(&a);
    let mut b = a.clone();
    for m in &mut b {
        m.pack_seconds = 1.5;
        m.agent_metadata = vec![9; 8];
        for s in &mut m.shards {
            s.digest = Digest([1; 32]);
        }
        for p in &mut m.pieces {
            p.digest = Digest([2; 32]);
        }
    }
    assert_eq!(crate::geometry_digest(&b), g);
    let cost = CostModel::default();
    let pa = plan(&dest, &a, &cost).unwrap();
    assert_eq!(plan(&dest, &b, &cost).unwrap(), pa);
    assert!(!pa.verify.is_empty());
    for v in &pa.verify {
        assert_ne!(v.published(&a).unwrap().digest, Digest([2; 32]));
        assert_eq!(v.published(&b).unwrap().digest, Digest([2; 32]));
    }

    let (ps, pp) = a
        .iter()
        .enumerate()
        .find_map(|(i, m)| {
            m.pieces
                .iter()
                .position(|p| p.packed_addr.is_some())
                .map(|j| (i, j))
        })
        .expect("a packed piece");
    let changes: Vec<(&str, Change)> = vec![
        ("slot", Box::new(|m| m[1].slot = 9)),
        (
            "source layout",
            Box::new(|m| m[0].layout = "fsdp:8".parse().unwrap()),
        ),
        ("agent name", Box::new(|m| m[0].agent_name.push('x'))),
        ("source order", Box::new(|m| m.swap(0, 1))),
        ("a source fewer", Box::new(|m| drop(m.pop()))),
        (
            "shard tensor",
            Box::new(|m| m[0].shards[0].tensor.push('x')),
        ),
        (
            "shard dtype",
            Box::new(|m| m[0].shards[0].dtype = DType::F32),
        ),
        (
            "global shape",
            Box::new(|m| m[0].shards[0].global_shape[0] += 1),
        ),
        (
            "shard offset",
            Box::new(|m| m[3].shards[2].shard.global_offset[0] += 1),
        ),
        (
            "shard shape",
            Box::new(|m| m[3].shards[2].shard.local_shape[0] -= 1),
        ),
        ("shard address", Box::new(|m| m[2].shards[1].addr += 64)),
        ("shard length", Box::new(|m| m[2].shards[1].len += 2)),
        (
            "memory kind",
            Box::new(|m| m[0].shards[0].device = MemDevice::Vram(0)),
        ),
        ("a shard fewer", Box::new(|m| drop(m[1].shards.pop()))),
        (
            "piece layout",
            Box::new(|m| m[0].pieces[0].layout = "tp:4".parse().unwrap()),
        ),
        ("piece rank", Box::new(|m| m[0].pieces[0].dest_rank += 1)),
        (
            "piece tensor",
            Box::new(|m| m[0].pieces[0].tensor.push('x')),
        ),
        (
            "piece offset",
            Box::new(|m| m[1].pieces[3].region.global_offset[0] += 1),
        ),
        (
            "piece shape",
            Box::new(|m| m[1].pieces[3].region.local_shape[0] += 1),
        ),
        (
            "packed address moved",
            Box::new(move |m| {
                m[ps].pieces[pp].packed_addr = m[ps].pieces[pp].packed_addr.map(|x| x + 2)
            }),
        ),
        (
            "packed address dropped",
            Box::new(move |m| m[ps].pieces[pp].packed_addr = None),
        ),
        (
            "packed address added",
            Box::new(|m| m[0].pieces[0].packed_addr = Some(0)),
        ),
        ("a piece fewer", Box::new(|m| drop(m[0].pieces.pop()))),
    ];
    assert!(a[0].pieces[0].packed_addr.is_none());
    for (what, change) in changes {
        let mut c = a.clone();
        change(&mut c);
        assert_ne!(c, a, "{what}: the change did nothing");
        assert_ne!(crate::geometry_digest(&c), g, "{what}");
    }
}

proptest! {
    /// Whole rows assembled from column slices of several sources (a row-parallel weight
    /// gathered whole, an expert's down projection from tensor-parallel shards): the quick proof
    /// takes each band of strided copies as one span and agrees with sorting every row, tilings
    /// and broken ones alike (a slice missing, shifted, widened, or the bands overlapping).
    #[test]
    fn column_slices_filling_whole_rows_prove_as_bands(
        widths in proptest::collection::vec(1..9u64, 2..6),
        rows in 2..40u64,
        bands in 1..4u64,
        perturb in proptest::option::of((0..6usize, 0..4u8)),
        order in proptest::collection::vec(0..1000u32, 24),
    ) {
        let stride: u64 = widths.iter().sum();
        let mut copies = vec![];
        for b in 0..bands {
            let base = b * rows * stride;
            let mut col = 0;
            for &w in &widths {
                copies.push(Copy {
                    rank_index: 0,
                    staging_offset: 0,
                    live_offset: base + col,
                    len: w,
                    count: rows,
                    staging_stride: w,
                    live_stride: stride,
                });
                col += w;
            }
        }
        if let Some((i, how)) = perturb {
            let n = copies.len();
            match how {
                0 => { copies.remove(i % n); }
                1 => copies[i % n].live_offset += 1,
                2 => copies[i % n].len += 1,
                _ => copies[i % n].count += 1,
            }
        }
        let n = copies.len();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&i| order[i % order.len()]);
        let copies: Vec<Copy> = idx.into_iter().map(|i| copies[i]).collect();
        let dest = [RankLayout {
            layout: LayoutSpec { scheme: Scheme::VllmTp, world_size: 1 },
            rank: 0,
            params: vec![],
            total_bytes: bands * rows * stride,
        }];
        let rows_of: Vec<Copy> = copies
            .iter()
            .flat_map(|c| c.rows().map(move |(s, l)| Copy::single(c.rank_index, s, l, c.len)))
            .collect();
        let fast = prove_coverage(&dest, &copies, &[]).map_err(|e| e.to_string());
        let slow = prove_coverage_sorted(&dest, &rows_of, &[]).map_err(|e| e.to_string());
        prop_assert_eq!(&fast, &slow);
        prop_assert_eq!(fast.is_ok(), perturb.is_none());
    }
}
