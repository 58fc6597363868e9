//! mx-engine: the reference inference worker's compute, a CPU stand-in for vLLM that generates
//! with a worker's LIVE weights.
//!
//! - [`reassemble`] rebuilds full Hugging Face-named tensors from the live buffers of the ranks of
//!   any [`mx_layout::RankLayout`] set (vLLM tp, FSDP, replicated), using each piece's region, and
//!   refuses a set of ranks that leaves some tensor byte uncovered.
//! - [`LlamaEngine`] runs candle's llama (`candle_transformers::models::llama`) in f32 on the CPU
//!   with a KV cache and a one-entry prefix cache, and decodes greedily. Weights can be swapped in
//!   place with [`LlamaEngine::install_weights`]; like vLLM, that does not drop cached KV entries:
//!   the caller must call [`LlamaEngine::clear_cache`] after installing new weights.
//!
//! - [`golden`] computes, from the checkpoint file alone, the weights of demo version `k` and the
//!   greedy tokens a worker must produce with them (the independent reference for a refit), with
//!   [`golden::CHECK_PROMPT`], whose first greedy token tells versions 1, 2 and 3 apart.
//!
//! Bad input (missing or misshapen tensors, unsupported dtypes, short buffers, out-of-vocabulary
//! token ids, over-long requests) is an [`Error`] naming the tensor, rank or field at fault, never
//! a panic.
//!
//! Left out: sampling other than greedy, batching, tokenization, GPUs, non-llama architectures.
//!
//! Map: `engine` ([`LlamaEngine`]) · `reassemble` ([`reassemble`]) · [`golden`] · `error`.

mod engine;
mod error;
pub mod golden;
mod reassemble;

pub use engine::LlamaEngine;
pub use error::Error;
pub use reassemble::reassemble;
