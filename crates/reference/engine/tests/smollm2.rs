//! Tests on the real SmolLM2-135M checkpoint (bf16, tied embeddings, 30 layers). Each test prints
//! a message and passes when the repository's .mx/models/smollm2-135m is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use common::{build_rank_buffer, Tensors};
use mx_checkpoint::Checkpoint;
use mx_engine::golden::{golden_tokens, version_weights, CHECK_PROMPT};
use mx_engine::{reassemble, LlamaEngine};
use mx_layout::{rank_layouts, ModelInfo};

const MODEL_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../.mx/models/smollm2-135m"
);
/// "The capital of France is" in the model's vocabulary.
const PROMPT: [u32; 5] = CHECK_PROMPT;
/// " Paris."
const PARIS: [u32; 2] = [7042, 30];

struct Model {
    config: serde_json::Value,
    v1: Tensors,
}

fn model() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| {
        if !Path::new(MODEL_DIR).join("model.safetensors").exists() {
            return None;
        }
        let ck = Checkpoint::open(Path::new(MODEL_DIR)).unwrap();
        let config = ck.config().cloned().unwrap();
        let v1 = ck
            .tensors()
            .map(|v| {
                (
                    v.name.to_string(),
                    (v.dtype, v.shape.clone(), v.data.to_vec()),
                )
            })
            .collect();
        Some(Model { config, v1 })
    })
    .as_ref()
    .or_else(|| {
        println!("skipping: {MODEL_DIR} is missing");
        None
    })
}

/// Version 2 by the golden path: `training_step(dtype, bytes, 2)` on every tensor.
fn v2() -> Tensors {
    version_weights(Path::new(MODEL_DIR), 2).unwrap()
}

#[test]
fn checkpoint_says_paris() {
    let Some(m) = model() else { return };
    let t0 = Instant::now();
    let mut e = LlamaEngine::new(&m.config, &m.v1).unwrap();
    let build = t0.elapsed();
    let t1 = Instant::now();
    let out = e.generate_greedy(&PROMPT, 2).unwrap();
    let gen = t1.elapsed();
    println!("TIMING build engine {build:?}, generate 2 tokens {gen:?}");
    assert_eq!(out, PARIS);
    let t2 = Instant::now();
    let longer = e.generate_greedy(&PROMPT, 8).unwrap();
    println!(
        "v1 8 tokens {longer:?} in {:?} (prefix reused)",
        t2.elapsed()
    );
    assert_eq!(longer[..2], PARIS);
}

#[test]
fn tp3_reassembly_is_byte_exact_and_generates_the_same() {
    let Some(m) = model() else { return };
    let specs = common::specs(&m.v1);
    let info = ModelInfo::from_hf_config(&m.config, specs).unwrap();
    let ranks = rank_layouts(&info, "tp:3".parse().unwrap()).unwrap();
    assert_eq!(ranks.len(), 3);
    let bufs: Vec<Vec<u8>> = ranks.iter().map(|r| build_rank_buffer(r, &m.v1)).collect();
    let live: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    let t0 = Instant::now();
    let out = reassemble(&info, &ranks, &live).unwrap();
    println!("TIMING reassemble tp:3 {:?}", t0.elapsed());
    assert_eq!(out.len(), m.v1.len());
    assert_eq!(out.len(), 272);
    for (name, (_, _, bytes)) in &m.v1 {
        assert!(&out[name] == bytes, "{name} differs");
    }
    let tensors: Tensors = out
        .into_iter()
        .map(|(name, bytes)| {
            let (dtype, shape, _) = &m.v1[&name];
            (name, (*dtype, shape.clone(), bytes))
        })
        .collect();
    let mut e = LlamaEngine::new(&m.config, &tensors).unwrap();
    assert_eq!(e.generate_greedy(&PROMPT, 2).unwrap(), PARIS);

    // Two of the three ranks do not cover the model: the error names a tensor.
    let err = reassemble(&info, &ranks[..2], &live[..2]).unwrap_err();
    assert!(
        matches!(&err, mx_engine::Error::NotCovered { tensor, .. } if tensor == "model.embed_tokens.weight"),
        "{err}"
    );
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn versions_differ_in_their_first_token() {
    let Some(m) = model() else { return };
    let dir = Path::new(MODEL_DIR);
    // The golden path's version 1 is the checkpoint, version 2 one training step on it.
    let w1 = version_weights(dir, 1).unwrap();
    assert!(w1 == m.v1, "version 1 is not the checkpoint");
    let w2 = version_weights(dir, 2).unwrap();
    let mut by_hand = m.v1.clone();
    for (dtype, _, bytes) in by_hand.values_mut() {
        mx_layout::update::training_step(*dtype, bytes, 2);
    }
    assert!(
        w2 == by_hand,
        "version 2 is not training step 2 on the checkpoint"
    );
    drop((w1, w2, by_hand));

    let t0 = Instant::now();
    let g: Vec<Vec<u32>> = (1..=3)
        .map(|v| golden_tokens(dir, v, &CHECK_PROMPT, 8).unwrap())
        .collect();
    println!(
        "TOKENS v1 {:?}\nTOKENS v2 {:?}\nTOKENS v3 {:?}\nTIMING golden v1..v3 {:?}",
        g[0],
        g[1],
        g[2],
        t0.elapsed()
    );
    // Greedy: the first 2 of 8 tokens are what a 2-token request gives.
    assert_eq!(g[0][..2], PARIS);
    assert_ne!(
        g[1][0], g[0][0],
        "version 2's first token equals version 1's"
    );
    assert_ne!(
        g[2][0], g[1][0],
        "version 3's first token equals version 2's"
    );

    let err = version_weights(dir, 0).unwrap_err();
    assert!(
        matches!(&err, mx_engine::Error::BadRequest { field, .. } if field == "version"),
        "{err}"
    );
    let missing = Path::new(MODEL_DIR).join("no-such-dir");
    let err = golden_tokens(&missing, 1, &CHECK_PROMPT, 1).unwrap_err();
    assert!(
        matches!(&err, mx_engine::Error::Checkpoint { dir, .. } if *dir == missing),
        "{err}"
    );
    assert!(err.to_string().contains("no-such-dir"), "{err}");
}

#[test]
fn skipped_cache_clear_shows_in_the_first_token() {
    let Some(m) = model() else { return };
    let dir = Path::new(MODEL_DIR);
    let golden_v2 = golden_tokens(dir, 2, &CHECK_PROMPT, 8).unwrap();
    assert_ne!(golden_v2[0], PARIS[0]);
    let mut e = LlamaEngine::new(&m.config, &m.v1).unwrap();
    assert!(!e.prefix_hit(&CHECK_PROMPT));
    assert_eq!(e.generate_greedy(&CHECK_PROMPT, 2).unwrap(), PARIS);
    assert!(e.prefix_hit(&CHECK_PROMPT));
    e.install_weights(&version_weights(dir, 2).unwrap())
        .unwrap();
    // Cache not cleared: the prompt's KV entries and last logits are version 1's.
    assert!(e.prefix_hit(&CHECK_PROMPT));
    let stale = e.generate_greedy(&CHECK_PROMPT, 8).unwrap();
    println!("TOKENS stale {stale:?}\nTOKENS v2    {golden_v2:?}");
    assert_eq!(
        stale[0], PARIS[0],
        "a stale prefix cache gives version 1's first token"
    );
    assert_ne!(stale[0], golden_v2[0]);
    e.clear_cache();
    assert!(!e.prefix_hit(&CHECK_PROMPT));
    assert_eq!(e.generate_greedy(&CHECK_PROMPT, 8).unwrap(), golden_v2);
}

#[test]
fn generate_greedy_while_stops_early() {
    let Some(m) = model() else { return };
    let mut e = LlamaEngine::new(&m.config, &m.v1).unwrap();
    let full = e.generate_greedy(&CHECK_PROMPT, 8).unwrap();
    e.clear_cache();

    // Refused before the prompt is prefilled: nothing computed, the cache untouched.
    let mut asked = Vec::new();
    let none = e
        .generate_greedy_while(&CHECK_PROMPT, 8, &mut |n| {
            asked.push(n);
            false
        })
        .unwrap();
    assert!(none.is_empty());
    assert_eq!(asked, [0]);
    assert_eq!(e.cached_positions(), 0);
    assert!(!e.prefix_hit(&CHECK_PROMPT));

    // Stops after 3 tokens: asked before each, the 4th refused.
    let mut asked = Vec::new();
    let three = e
        .generate_greedy_while(&CHECK_PROMPT, 8, &mut |n| {
            asked.push(n);
            n < 3
        })
        .unwrap();
    assert_eq!(three, full[..3]);
    assert_eq!(asked, [0, 1, 2, 3]);
    // 5 prompt positions + the 2 generated tokens fed so far.
    assert_eq!(e.cached_positions(), 7);

    // Never refused: asked for tokens 0..8 only, and equal to generate_greedy (prefix reused).
    let mut asked = Vec::new();
    let all = e
        .generate_greedy_while(&CHECK_PROMPT, 8, &mut |n| {
            asked.push(n);
            true
        })
        .unwrap();
    assert_eq!(all, full);
    assert_eq!(asked, (0..8).collect::<Vec<_>>());
    // Bad requests fail before the callback is asked.
    let mut asked = false;
    let err = e
        .generate_greedy_while(&[], 1, &mut |_| {
            asked = true;
            true
        })
        .unwrap_err();
    assert!(!asked, "{err}");
}

#[test]
fn kv_cache_fills_clears_and_goes_stale() {
    let Some(m) = model() else { return };
    let mut e = LlamaEngine::new(&m.config, &m.v1).unwrap();
    assert_eq!(e.cached_positions(), 0);
    let v1 = e.generate_greedy(&PROMPT, 8).unwrap();
    // 5 prompt positions + 7 fed generated tokens.
    assert_eq!(e.cached_positions(), 12);
    e.clear_cache();
    assert_eq!(e.cached_positions(), 0);
    assert_eq!(e.generate_greedy(&PROMPT, 8).unwrap(), v1);

    // The prompt plus " Paris": its first 5 positions can come from a cached prefix.
    let ext: Vec<u32> = PROMPT.iter().copied().chain([PARIS[0]]).collect();
    e.clear_cache();
    let v1_logits = e.next_token_logits(&ext).unwrap();
    e.clear_cache();
    e.generate_greedy(&PROMPT, 2).unwrap(); // caches PROMPT's KV under v1 weights
    e.install_weights(&v2()).unwrap();
    let stale_logits = e.next_token_logits(&ext).unwrap(); // v1 KV for 5 positions, v2 for the 6th
    e.clear_cache();
    assert_eq!(e.cached_positions(), 0);
    let fresh_logits = e.next_token_logits(&ext).unwrap();
    let mut e2 = LlamaEngine::new(&m.config, &v2()).unwrap();
    assert_eq!(e2.next_token_logits(&ext).unwrap(), fresh_logits);
    let (ds, d1) = (
        max_abs_diff(&stale_logits, &fresh_logits),
        max_abs_diff(&v1_logits, &fresh_logits),
    );
    println!("max |logit| diff: stale vs fresh v2 {ds}, v1 vs fresh v2 {d1}");
    assert!(ds > 1e-4, "stale cache gave the fresh logits");
    assert_ne!(stale_logits, v1_logits);
}

#[test]
fn bad_real_input_is_named() {
    let Some(m) = model() else { return };
    let mut t = m.v1.clone();
    t.remove("model.layers.29.self_attn.v_proj.weight");
    let err = LlamaEngine::new(&m.config, &t).unwrap_err();
    assert!(
        matches!(&err, mx_engine::Error::MissingTensor { tensor, .. } if tensor == "model.layers.29.self_attn.v_proj.weight"),
        "{err}"
    );
    let mut t = m.v1.clone();
    t.get_mut("model.layers.3.mlp.down_proj.weight").unwrap().1 = vec![1536, 576];
    let err = LlamaEngine::new(&m.config, &t).unwrap_err();
    assert!(
        matches!(&err, mx_engine::Error::BadShape { tensor, .. } if tensor == "model.layers.3.mlp.down_proj.weight"),
        "{err}"
    );
}
