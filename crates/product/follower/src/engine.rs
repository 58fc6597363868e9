//! The generation engine an [`crate::Instance`] may run over its live weights, as a trait: the
//! follower stages, applies, gates and serves the engine contracts without knowing the engine.
//! mx-worker's reference engine (candle's llama on the CPU) is one; an instance over another
//! engine's memory ([`crate::Instance::over_puller`]) runs none.

use mx_layout::{ModelInfo, RankLayout};

/// An engine's refusal, kept apart so the HTTP routes can tell the caller's fault from the
/// engine's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request does not fit the model (a token id past the vocabulary, a context past the
    /// model's positions): the routes answer 400.
    #[error("{0}")]
    BadRequest(String),
    /// The engine refused the weights or failed: the routes answer 500.
    #[error("{0}")]
    Failed(String),
}

/// A generation engine built from an instance's live weights. It decodes greedily and keeps a
/// KV cache and a one-entry prefix cache, which installing weights does not drop (like vLLM):
/// the instance clears them after every apply.
pub trait Engine: Send {
    /// Installs new weights: `live[i]` is the live buffer of rank `dest[i]` of `model`
    /// (row-major, each piece at its region; see [`mx_layout::RankLayout`]).
    ///
    /// # Errors
    /// [`EngineError::Failed`] naming the tensor the engine refuses; the old weights stay.
    fn install(
        &mut self,
        model: &ModelInfo,
        dest: &[RankLayout],
        live: &[&[u8]],
    ) -> Result<(), EngineError>;

    /// Drops every cached KV entry and the prefix cache.
    fn clear_cache(&mut self);

    /// Positions the KV cache holds (0 once cleared).
    fn cached_positions(&self) -> usize;

    /// Greedy decoding of at most `max_new` tokens after `context` (token ids), asking
    /// `keep_going(tokens so far)` before every token after the first; stops early when it
    /// answers false. Returns the new tokens.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] for a context the model cannot take,
    /// [`EngineError::Failed`] otherwise.
    fn generate_greedy_while(
        &mut self,
        context: &[u32],
        max_new: usize,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Vec<u32>, EngineError>;
}

/// Builds an [`Engine`] for an instance's model the first time weights are live.
pub trait EngineBuilder: Send + Sync + std::fmt::Debug {
    /// `Ok` when this engine can run `model` (an instance that cannot generates nothing and
    /// says why), else the reason.
    ///
    /// # Errors
    /// Why not, naming the model family.
    fn supports(&self, model: &ModelInfo) -> Result<(), String>;

    /// The engine over the first live weights (see [`Engine::install`]); `config` is the
    /// model's config.json (`Null` without one).
    ///
    /// # Errors
    /// As [`Engine::install`], and a config.json the engine cannot read.
    fn build(
        &self,
        config: &serde_json::Value,
        model: &ModelInfo,
        dest: &[RankLayout],
        live: &[&[u8]],
    ) -> Result<Box<dyn Engine>, EngineError>;
}

/// What an engine does with a version once it is staged and verified, before the worker reports
/// it staged (so before the control plane pauses anything): e.g. mx's vLLM backend builds vLLM's
/// processed form of the version beside the live weights, leaving the safe point an exchange.
/// Runs on a blocking thread while the engine keeps generating; a version already resident is
/// not handed over.
pub trait StagedHook: Send + Sync + std::fmt::Debug {
    /// Prepares `version` (the staged one; the puller's copy stays staged). An error is logged
    /// and the stage still succeeds: the engine installs without what it could not prepare.
    ///
    /// # Errors
    /// Why the engine could not prepare it.
    fn staged(&self, version: mx_layout::VersionId) -> Result<(), String>;
}
