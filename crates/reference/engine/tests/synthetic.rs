//! Tests on a tiny synthetic llama: they run everywhere (no model files needed).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use common::{build_rank_buffer, specs, tiny_config, tiny_tensors};
use mx_engine::{reassemble, Error, LlamaEngine};
use mx_layout::{rank_layouts, DType, ModelInfo};

#[test]
fn tiny_model_generates_and_caches() {
    let mut e = LlamaEngine::new(&tiny_config(), &tiny_tensors()).unwrap();
    assert_eq!(e.cached_positions(), 0);
    let a = e.generate_greedy(&[3, 7, 11], 5).unwrap();
    assert_eq!(a.len(), 5);
    assert!(a.iter().all(|&t| t < 40), "{a:?}");
    // 3 prompt positions + 4 fed generated tokens (the last one is never fed).
    assert_eq!(e.cached_positions(), 7);
    // Same prompt again: prefix reuse gives the same tokens.
    assert_eq!(e.generate_greedy(&[3, 7, 11], 5).unwrap(), a);
    // An extension of the prompt reuses the prefix and equals a fresh computation.
    let ext = e.generate_greedy(&[3, 7, 11, 5], 3).unwrap();
    e.clear_cache();
    assert_eq!(e.cached_positions(), 0);
    assert_eq!(e.generate_greedy(&[3, 7, 11, 5], 3).unwrap(), ext);
    e.clear_cache();
    assert_eq!(e.generate_greedy(&[3, 7, 11], 5).unwrap(), a);
    assert_eq!(e.generate_greedy(&[3], 0).unwrap(), Vec::<u32>::new());
}

#[test]
fn stale_cache_after_install_changes_tokens() {
    let prompt = [3u32, 7, 11, 5, 9];
    let mut e = LlamaEngine::new(&tiny_config(), &tiny_tensors()).unwrap();
    e.generate_greedy(&prompt[..3], 2).unwrap();
    e.install_weights(&common::tiny_tensors_seeded(42)).unwrap();
    // Prompt extends the cached prefix: positions 0..3 come from the old weights' KV.
    let stale = e.generate_greedy(&prompt, 6).unwrap();
    let stale_logits = e.next_token_logits(&prompt).unwrap();
    e.clear_cache();
    let fresh = e.generate_greedy(&prompt, 6).unwrap();
    let fresh_logits = e.next_token_logits(&prompt).unwrap();
    let mut other = LlamaEngine::new(&tiny_config(), &common::tiny_tensors_seeded(42)).unwrap();
    assert_eq!(other.generate_greedy(&prompt, 6).unwrap(), fresh);
    assert_eq!(other.next_token_logits(&prompt).unwrap(), fresh_logits);
    assert_ne!(stale_logits, fresh_logits);
    assert_ne!(stale, fresh, "stale {stale:?} fresh {fresh:?}");
}

#[test]
fn missing_tensor_is_named() {
    let mut t = tiny_tensors();
    t.remove("model.layers.1.mlp.up_proj.weight");
    let err = LlamaEngine::new(&tiny_config(), &t).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("model.layers.1.mlp.up_proj.weight"));
}

#[test]
fn wrong_shape_is_named() {
    let mut t = tiny_tensors();
    let (_, shape, bytes) = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
    *shape = vec![8, 4]; // same byte length, transposed
    assert_eq!(bytes.len(), 4 * 8 * 4);
    let err = LlamaEngine::new(&tiny_config(), &t).unwrap_err();
    match &err {
        Error::BadShape {
            tensor,
            expected,
            got,
        } => {
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!(expected, &vec![4, 8]);
            assert_eq!(got, &vec![8, 4]);
        }
        other => panic!("wrong error {other}"),
    }
}

#[test]
fn bad_dtype_length_config_and_requests_are_errors() {
    let mut t = tiny_tensors();
    t.get_mut("model.norm.weight").unwrap().0 = DType::I32;
    let err = LlamaEngine::new(&tiny_config(), &t).unwrap_err();
    assert!(
        matches!(&err, Error::BadDType { tensor, dtype: DType::I32, .. } if tensor == "model.norm.weight"),
        "{err}"
    );

    let mut t = tiny_tensors();
    t.get_mut("model.embed_tokens.weight").unwrap().2.pop();
    let err = LlamaEngine::new(&tiny_config(), &t).unwrap_err();
    assert!(
        matches!(&err, Error::BadLength { tensor, expected: 1280, got: 1279 } if tensor == "model.embed_tokens.weight"),
        "{err}"
    );

    let mut cfg = tiny_config();
    cfg["num_attention_heads"] = 3.into();
    let err = LlamaEngine::new(&cfg, &tiny_tensors()).unwrap_err();
    assert!(
        matches!(&err, Error::BadConfig { field, .. } if field == "num_attention_heads"),
        "{err}"
    );
    let mut cfg = tiny_config();
    cfg.as_object_mut().unwrap().remove("vocab_size");
    let err = LlamaEngine::new(&cfg, &tiny_tensors()).unwrap_err();
    assert!(
        matches!(&err, Error::BadConfig { reason, .. } if reason.contains("vocab_size")),
        "{err}"
    );
    let mut cfg = tiny_config();
    cfg["head_dim"] = 8.into();
    let err = LlamaEngine::new(&cfg, &tiny_tensors()).unwrap_err();
    assert!(
        matches!(&err, Error::BadConfig { field, .. } if field == "head_dim"),
        "{err}"
    );

    let mut e = LlamaEngine::new(&tiny_config(), &tiny_tensors()).unwrap();
    let err = e.generate_greedy(&[], 2).unwrap_err();
    assert!(
        matches!(&err, Error::BadRequest { field, .. } if field == "prompt"),
        "{err}"
    );
    let err = e.generate_greedy(&[1, 40], 2).unwrap_err();
    assert!(
        matches!(&err, Error::BadRequest { field, .. } if field == "prompt[1]"),
        "{err}"
    );
    let err = e.generate_greedy(&[1, 2], 63).unwrap_err();
    assert!(
        matches!(&err, Error::BadRequest { field, .. } if field == "max_new"),
        "{err}"
    );
    let err = e.generate_greedy(&[1, 2], usize::MAX).unwrap_err();
    assert!(
        matches!(&err, Error::BadRequest { field, .. } if field == "max_new"),
        "{err}"
    );
    assert_eq!(e.generate_greedy(&[1, 2], 62).unwrap().len(), 62);

    // install_weights checks like new and keeps the old weights on error.
    let before = e.generate_greedy(&[4, 5], 3).unwrap();
    let mut bad = tiny_tensors();
    bad.remove("model.norm.weight");
    assert!(matches!(
        e.install_weights(&bad),
        Err(Error::MissingTensor { .. })
    ));
    e.clear_cache();
    assert_eq!(e.generate_greedy(&[4, 5], 3).unwrap(), before);
}

#[test]
fn reassemble_tiny_tp2_and_fsdp3_is_byte_exact() {
    let t = tiny_tensors();
    let info = ModelInfo::from_hf_config(&tiny_config(), specs(&t)).unwrap();
    for layout in ["tp:2", "fsdp:3", "replicated:1"] {
        let ranks = rank_layouts(&info, layout.parse().unwrap()).unwrap();
        let bufs: Vec<Vec<u8>> = ranks.iter().map(|r| build_rank_buffer(r, &t)).collect();
        let live: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        let out = reassemble(&info, &ranks, &live).unwrap();
        assert_eq!(out.len(), t.len(), "{layout}");
        for (name, (_, _, bytes)) in &t {
            assert_eq!(&out[name], bytes, "{layout} {name}");
        }
    }
}

#[test]
fn reassemble_refuses_gaps_and_bad_buffers() {
    let t = tiny_tensors();
    let info = ModelInfo::from_hf_config(&tiny_config(), specs(&t)).unwrap();
    let ranks = rank_layouts(&info, "tp:2".parse().unwrap()).unwrap();
    let bufs: Vec<Vec<u8>> = ranks.iter().map(|r| build_rank_buffer(r, &t)).collect();

    // Rank 0 alone leaves the second half of column-split tensors uncovered.
    let err = reassemble(&info, &ranks[..1], &[&bufs[0]]).unwrap_err();
    assert!(
        matches!(&err, Error::NotCovered { tensor, missing: 64, total: 320 } if tensor == "model.embed_tokens.weight"),
        "{err}"
    );
    let err = reassemble(&info, &ranks, &[&bufs[0]]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RankCount {
                ranks: 2,
                buffers: 1
            }
        ),
        "{err}"
    );

    // A short live buffer names the rank.
    let err = reassemble(&info, &ranks, &[&bufs[0], &bufs[1][..10]]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadRank {
                index: 1,
                rank: 1,
                ..
            }
        ),
        "{err}"
    );

    // Replicas that disagree (the kv head is replicated on both ranks) name the tensor.
    let k = ranks[1]
        .params
        .iter()
        .flat_map(|p| &p.pieces)
        .find(|p| p.tensor == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    let mut b1 = bufs[1].clone();
    b1[k.offset as usize] ^= 1;
    let err = reassemble(&info, &ranks, &[&bufs[0], &b1]).unwrap_err();
    assert!(
        matches!(&err, Error::BadRank { index: 1, tensor, .. } if tensor == "model.layers.0.self_attn.k_proj.weight"),
        "{err}"
    );

    // A piece past its buffer.
    let mut bad = ranks.clone();
    bad[0].params[0].pieces[0].offset = u64::MAX - 3;
    let err = reassemble(&info, &bad, &[&bufs[0], &bufs[1]]).unwrap_err();
    assert!(matches!(err, Error::BadRank { index: 0, .. }), "{err}");
    // A region outside its tensor.
    let mut bad = ranks.clone();
    bad[0].params[0].pieces[0].region.global_offset[0] = 1000;
    let err = reassemble(&info, &bad, &[&bufs[0], &bufs[1]]).unwrap_err();
    assert!(matches!(err, Error::BadRank { index: 0, .. }), "{err}");
    // A region with mismatched dims.
    let mut bad = ranks.clone();
    bad[0].params[0].pieces[0].region.global_offset.clear();
    let err = reassemble(&info, &bad, &[&bufs[0], &bufs[1]]).unwrap_err();
    assert!(matches!(err, Error::BadRank { index: 0, .. }), "{err}");
}

#[test]
fn generate_greedy_while_and_prefix_hit() {
    let prompt = [3u32, 7, 11];
    let mut e = LlamaEngine::new(&tiny_config(), &tiny_tensors()).unwrap();
    assert!(!e.prefix_hit(&prompt));
    let full = e.generate_greedy(&prompt, 6).unwrap();
    assert!(e.prefix_hit(&prompt));
    assert!(e.prefix_hit(&[3, 7, 11, 5]));
    assert!(!e.prefix_hit(&[3, 7]));
    assert!(!e.prefix_hit(&[4, 7, 11]));
    e.clear_cache();
    assert!(!e.prefix_hit(&prompt));

    let mut asked = Vec::new();
    let part = e
        .generate_greedy_while(&prompt, 6, &mut |n| {
            asked.push(n);
            n < 2
        })
        .unwrap();
    assert_eq!(part, full[..2]);
    assert_eq!(asked, [0, 1, 2]);
    // 3 prompt positions + the first generated token.
    assert_eq!(e.cached_positions(), 4);
    e.clear_cache();
    assert!(e
        .generate_greedy_while(&prompt, 6, &mut |_| false)
        .unwrap()
        .is_empty());
    assert_eq!(e.cached_positions(), 0);
    assert!(!e.prefix_hit(&prompt));
    assert_eq!(
        e.generate_greedy_while(&prompt, 6, &mut |_| true).unwrap(),
        full
    );
    // max_new 0: nothing to ask.
    let mut asked = false;
    let none = e
        .generate_greedy_while(&prompt, 0, &mut |_| {
            asked = true;
            true
        })
        .unwrap();
    assert!(none.is_empty() && !asked);
}

#[test]
fn golden_path_on_a_tiny_checkpoint() {
    use mx_engine::golden::{golden_tokens, version_weights};

    let dir = std::env::temp_dir().join(format!("mx-engine-golden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let v1 = tiny_tensors();
    let flat: Vec<_> = v1
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), *d, s.clone(), b.clone()))
        .collect();
    mx_checkpoint::write_safetensors(&dir.join("model.safetensors"), &flat).unwrap();
    std::fs::write(dir.join("config.json"), tiny_config().to_string()).unwrap();

    assert_eq!(version_weights(&dir, 1).unwrap(), v1);
    let mut v3 = v1.clone();
    for (dtype, _, bytes) in v3.values_mut() {
        mx_layout::update::training_step(*dtype, bytes, 2);
        mx_layout::update::training_step(*dtype, bytes, 3);
    }
    assert_eq!(version_weights(&dir, 3).unwrap(), v3);
    let prompt = [3u32, 7, 11];
    let mut e = LlamaEngine::new(&tiny_config(), &v3).unwrap();
    assert_eq!(
        golden_tokens(&dir, 3, &prompt, 5).unwrap(),
        e.generate_greedy(&prompt, 5).unwrap()
    );
    let err = golden_tokens(&dir, 0, &prompt, 5).unwrap_err();
    assert!(
        matches!(&err, Error::BadRequest { field, .. } if field == "version"),
        "{err}"
    );

    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = golden_tokens(&dir, 1, &prompt, 5).unwrap_err();
    assert!(
        matches!(&err, Error::NoConfig { dir: d } if *d == dir),
        "{err}"
    );
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let err = version_weights(&dir, 1).unwrap_err();
    assert!(
        matches!(&err, Error::Checkpoint { dir: d, .. } if *d == dir),
        "{err}"
    );
    assert!(err.to_string().contains(&*dir.to_string_lossy()), "{err}");
    std::fs::remove_dir(&dir).unwrap();
}
