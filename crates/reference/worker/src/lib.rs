//! mx-worker: the reference inference worker, mx's stand-in for vLLM/SGLang on CPU machines: the
//! fleet's follower ([`mx_follower`]: registration, the command stream, the version store, the
//! engine routes) running the reference engine ([`mx_engine::LlamaEngine`], candle's llama in
//! f32 on the CPU) over its live weights.
//!
//! Everything but the engine is [`mx_follower`]'s and re-exported here, so `mx worker` and the
//! tests read `mx_worker::Worker`; [`ReferenceEngine`] is what this crate adds, and
//! [`WorkerConfig::engine`] takes it ([`reference_engine`]).
#![forbid(unsafe_code)]

use std::sync::Arc;

use mx_engine::LlamaEngine;
use mx_layout::model::Family;
use mx_layout::{DType, ModelInfo, RankLayout};

pub use mx_follower::*;

/// Builds the reference engine for llama-family models: candle's llama in f32 on the CPU, with
/// a KV cache and a one-entry prefix cache ([`mx_engine::LlamaEngine`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReferenceEngine;

/// The reference engine as a worker's [`WorkerConfig::engine`].
pub fn reference_engine() -> Arc<dyn EngineBuilder> {
    Arc::new(ReferenceEngine)
}

/// [`mx_engine::LlamaEngine`] as an [`Engine`].
struct Llama(LlamaEngine);

/// HF-named tensors as the engine takes them: (dtype, shape, row-major bytes).
type EngineTensors = std::collections::BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>;

fn engine_error(e: mx_engine::Error) -> EngineError {
    match e {
        mx_engine::Error::BadRequest { .. } => EngineError::BadRequest(e.to_string()),
        _ => EngineError::Failed(e.to_string()),
    }
}

/// Full Hugging Face tensors reassembled from the ranks' live buffers ([`mx_engine::reassemble`]).
fn engine_tensors(
    model: &ModelInfo,
    dest: &[RankLayout],
    live: &[&[u8]],
) -> Result<EngineTensors, EngineError> {
    let full = mx_engine::reassemble(model, dest, live).map_err(engine_error)?;
    full.into_iter()
        .map(|(name, bytes)| {
            let spec = model.tensor(&name).ok_or_else(|| {
                EngineError::Failed(format!("reassembly returned tensor {name} the model lacks"))
            })?;
            Ok((name, (spec.dtype, spec.shape.clone(), bytes)))
        })
        .collect()
}

impl EngineBuilder for ReferenceEngine {
    fn supports(&self, model: &ModelInfo) -> Result<(), String> {
        if model.family == Family::Llama {
            Ok(())
        } else {
            Err(format!(
                "model family {:?} cannot generate: the reference engine runs the llama family",
                model.family
            ))
        }
    }

    fn build(
        &self,
        config: &serde_json::Value,
        model: &ModelInfo,
        dest: &[RankLayout],
        live: &[&[u8]],
    ) -> Result<Box<dyn Engine>, EngineError> {
        let tensors = engine_tensors(model, dest, live)?;
        let engine = LlamaEngine::new(config, &tensors).map_err(engine_error)?;
        Ok(Box::new(Llama(engine)))
    }
}

impl Engine for Llama {
    fn install(
        &mut self,
        model: &ModelInfo,
        dest: &[RankLayout],
        live: &[&[u8]],
    ) -> Result<(), EngineError> {
        let tensors = engine_tensors(model, dest, live)?;
        self.0.install_weights(&tensors).map_err(engine_error)
    }

    fn clear_cache(&mut self) {
        self.0.clear_cache();
    }

    fn cached_positions(&self) -> usize {
        self.0.cached_positions()
    }

    fn generate_greedy_while(
        &mut self,
        context: &[u32],
        max_new: usize,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.0
            .generate_greedy_while(context, max_new, keep_going)
            .map_err(engine_error)
    }
}
