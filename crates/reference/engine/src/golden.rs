//! The independent "golden" path: what a worker SHOULD generate with version `k` of the demo
//! weights, computed from the checkpoint file alone (never from pulled bytes).
//!
//! Version 1 is the checkpoint; version `k` is the checkpoint with
//! [`mx_layout::update::training_step`]`(dtype, bytes, j)` applied to every tensor for
//! `j = 2..=k` in order, exactly as the demo's publishers do between versions. The training step is
//! strong enough that the first greedy token of [`CHECK_PROMPT`] differs between versions 1, 2
//! and 3 on SmolLM2-135M, so a worker that serves stale weights, or a stale prefix cache, is caught
//! by its first token.

use std::collections::BTreeMap;
use std::path::Path;

use mx_checkpoint::Checkpoint;
use mx_layout::DType;

use crate::{Error, LlamaEngine};

/// SmolLM2 tokenizer ids of "The capital of France is" (no BOS). SmolLM2-135M's checkpoint
/// decodes `[7042, 30]` (" Paris.") greedily after it.
pub const CHECK_PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];

/// HF-named tensors as [`LlamaEngine::new`] takes them: `(dtype, shape, row-major bytes)`.
pub type Weights = BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>;

/// Opens the checkpoint in `model_dir`, naming the directory on failure.
fn open(model_dir: &Path) -> Result<Checkpoint, Error> {
    Checkpoint::open(model_dir).map_err(|source| Error::Checkpoint {
        dir: model_dir.to_path_buf(),
        source: Box::new(source),
    })
}

/// Every tensor of `ck` with training steps `2..=version` applied.
fn weights_of(ck: &Checkpoint, version: u32) -> Result<Weights, Error> {
    if version == 0 {
        return Err(Error::BadRequest {
            field: "version".into(),
            reason: "versions start at 1 (the checkpoint itself)".into(),
        });
    }
    Ok(ck
        .tensors()
        .map(|v| {
            let mut bytes = v.data.to_vec();
            for step in 2..=version {
                mx_layout::update::training_step(v.dtype, &mut bytes, step);
            }
            (v.name.to_string(), (v.dtype, v.shape.clone(), bytes))
        })
        .collect())
}

/// Every tensor of version `version` (1 = the checkpoint in `model_dir`), HF-named, as
/// [`LlamaEngine::new`] takes them: the checkpoint's bytes with training steps `2..=version`
/// applied in order.
///
/// # Errors
/// [`Error::Checkpoint`] naming `model_dir` when the checkpoint cannot be opened;
/// [`Error::BadRequest`] for version 0.
pub fn version_weights(model_dir: &Path, version: u32) -> Result<Weights, Error> {
    weights_of(&open(model_dir)?, version)
}

/// The `max_new` greedy tokens after `prompt` of a fresh engine over version `version` of the
/// checkpoint in `model_dir` (its `config.json`, weights from [`version_weights`]).
///
/// # Errors
/// [`Error::Checkpoint`] or [`Error::NoConfig`] naming `model_dir`; [`Error::BadRequest`] for
/// version 0 or a bad request; any error of [`LlamaEngine::new`] or
/// [`LlamaEngine::generate_greedy`].
pub fn golden_tokens(
    model_dir: &Path,
    version: u32,
    prompt: &[u32],
    max_new: usize,
) -> Result<Vec<u32>, Error> {
    let ck = open(model_dir)?;
    let config = ck.config().ok_or_else(|| Error::NoConfig {
        dir: model_dir.to_path_buf(),
    })?;
    let weights = weights_of(&ck, version)?;
    let mut engine = LlamaEngine::new(config, &weights)?;
    engine.generate_greedy(prompt, max_new)
}
