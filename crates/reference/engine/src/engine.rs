//! candle llama on the CPU, f32, with a KV cache and a one-entry prefix cache.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaConfig};
use mx_layout::DType;

use crate::error::candle;
use crate::Error;

/// The KV state right after a prompt was prefilled: reused when a later prompt starts with it.
struct Prefix {
    /// The prompt whose keys and values `cache` holds.
    tokens: Vec<u32>,
    /// KV cache after the prompt (candle tensors are immutable, so this clone is a snapshot).
    cache: Cache,
    /// Logits `[1, vocab]` (f32) after the prompt's last token.
    logits: Tensor,
}

/// A llama-family model (candle's `models::llama`) in f32 on the CPU with a KV cache.
///
/// The cache works like vLLM's prefix cache: after a prompt is prefilled its KV entries are kept,
/// and a later [`generate_greedy`](Self::generate_greedy) whose prompt starts with that prompt
/// reuses them instead of recomputing. Cached entries were computed with the weights that were
/// live at the time, so after [`install_weights`](Self::install_weights) the caller must call
/// [`clear_cache`](Self::clear_cache), exactly as vLLM needs `reset_prefix_cache` after a weight
/// update.
pub struct LlamaEngine {
    config: Config,
    model: Llama,
    device: Device,
    /// KV cache of the current decode (prompt plus generated tokens fed so far); `None` when
    /// cleared.
    cache: Option<Cache>,
    /// Positions `cache` holds.
    positions: usize,
    prefix: Option<Prefix>,
}

impl std::fmt::Debug for LlamaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaEngine")
            .field("layers", &self.config.num_hidden_layers)
            .field("hidden_size", &self.config.hidden_size)
            .field("vocab_size", &self.config.vocab_size)
            .field("cached_positions", &self.positions)
            .finish_non_exhaustive()
    }
}

/// Largest `max_position_embeddings` accepted (the RoPE tables are precomputed for all of them).
const MAX_POSITIONS: usize = 1 << 20;

fn bad_config(field: &str, reason: impl Into<String>) -> Error {
    Error::BadConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Parses and checks an HF llama `config.json` value for what candle's llama supports.
fn parse_config(config: &serde_json::Value) -> Result<Config, Error> {
    let raw: LlamaConfig = serde_json::from_value(config.clone())
        .map_err(|e| bad_config("config.json", e.to_string()))?;
    let cfg = raw.into_config(false);
    for (field, v) in [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("max_position_embeddings", cfg.max_position_embeddings),
    ] {
        if v == 0 {
            return Err(bad_config(field, "must be > 0"));
        }
    }
    if cfg.max_position_embeddings > MAX_POSITIONS {
        return Err(bad_config(
            "max_position_embeddings",
            format!("above {MAX_POSITIONS}, the most this engine's RoPE tables are built for"),
        ));
    }
    if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
        return Err(bad_config(
            "num_attention_heads",
            format!(
                "{} does not divide hidden_size {}",
                cfg.num_attention_heads, cfg.hidden_size
            ),
        ));
    }
    let head_dim = cfg.hidden_size / cfg.num_attention_heads;
    if !head_dim.is_multiple_of(2) {
        return Err(bad_config("hidden_size", "head dim must be even for RoPE"));
    }
    if let Some(h) = config.get("head_dim").and_then(serde_json::Value::as_u64) {
        if h != head_dim as u64 {
            return Err(bad_config(
                "head_dim",
                format!("{h} differs from hidden_size / num_attention_heads = {head_dim}, which candle's llama assumes"),
            ));
        }
    }
    if !cfg
        .num_attention_heads
        .is_multiple_of(cfg.num_key_value_heads)
    {
        return Err(bad_config(
            "num_key_value_heads",
            format!(
                "{} does not divide num_attention_heads {}",
                cfg.num_key_value_heads, cfg.num_attention_heads
            ),
        ));
    }
    if !matches!(
        config.get("hidden_act").and_then(serde_json::Value::as_str),
        None | Some("silu")
    ) {
        return Err(bad_config("hidden_act", "only silu is supported"));
    }
    for field in ["attention_bias", "mlp_bias"] {
        if config.get(field).and_then(serde_json::Value::as_bool) == Some(true) {
            return Err(bad_config(field, "biases are not supported"));
        }
    }
    Ok(cfg)
}

/// Every tensor candle's llama loads, with its HF shape.
fn expected_tensors(cfg: &Config) -> Vec<(String, Vec<u64>)> {
    let h = cfg.hidden_size as u64;
    let head_dim = (cfg.hidden_size / cfg.num_attention_heads) as u64;
    let q = head_dim * cfg.num_attention_heads as u64;
    let kv = head_dim * cfg.num_key_value_heads as u64;
    let inter = cfg.intermediate_size as u64;
    let vocab = cfg.vocab_size as u64;
    let mut want = vec![
        ("model.embed_tokens.weight".to_string(), vec![vocab, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        want.push(("lm_head.weight".to_string(), vec![vocab, h]));
    }
    for i in 0..cfg.num_hidden_layers {
        let l = format!("model.layers.{i}");
        want.extend([
            (format!("{l}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{l}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{l}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{l}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{l}.mlp.gate_proj.weight"), vec![inter, h]),
            (format!("{l}.mlp.up_proj.weight"), vec![inter, h]),
            (format!("{l}.mlp.down_proj.weight"), vec![h, inter]),
            (format!("{l}.input_layernorm.weight"), vec![h]),
            (format!("{l}.post_attention_layernorm.weight"), vec![h]),
        ]);
    }
    want
}

/// Checks every needed tensor and converts it to an f32 candle tensor.
fn load_tensors(
    cfg: &Config,
    tensors: &BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    device: &Device,
) -> Result<HashMap<String, Tensor>, Error> {
    let want = expected_tensors(cfg);
    // Check everything before converting anything, so bad input fails fast.
    for (name, shape) in &want {
        let Some((dtype, got, bytes)) = tensors.get(name) else {
            return Err(Error::MissingTensor {
                tensor: name.clone(),
                reason: format!(
                    "config.json describes {} llama layers{}",
                    cfg.num_hidden_layers,
                    if cfg.tie_word_embeddings {
                        " with tied embeddings"
                    } else {
                        ""
                    }
                ),
            });
        };
        if got != shape {
            return Err(Error::BadShape {
                tensor: name.clone(),
                expected: shape.clone(),
                got: got.clone(),
            });
        }
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::BadDType {
                tensor: name.clone(),
                dtype: *dtype,
                reason: "the engine loads BF16, F16 or F32".into(),
            });
        }
        // Shapes equal the config's, whose sizes are usize: the product is checked anyway.
        let expected = shape
            .iter()
            .try_fold(dtype.size_bytes(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::Overflow {
                what: "byte length",
                tensor: name.clone(),
            })?;
        if expected != bytes.len() as u64 {
            return Err(Error::BadLength {
                tensor: name.clone(),
                expected,
                got: bytes.len() as u64,
            });
        }
    }
    let mut out = HashMap::with_capacity(want.len());
    for (name, shape) in want {
        let Some((dtype, _, bytes)) = tensors.get(&name) else {
            continue; // Checked above.
        };
        let cdtype = match dtype {
            DType::BF16 => candle_core::DType::BF16,
            DType::F16 => candle_core::DType::F16,
            _ => candle_core::DType::F32,
        };
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let t = Tensor::from_raw_buffer(bytes, cdtype, &dims, device)
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .map_err(candle(format!("loading tensor {name}")))?;
        out.insert(name, t);
    }
    Ok(out)
}

impl LlamaEngine {
    /// From an HF llama config.json value and HF-named tensors (dtype from mx_layout::DType:
    /// BF16/F16/F32), e.g. from reassemble() or a Checkpoint.
    ///
    /// Each tensor is `(dtype, shape in elements, row-major little-endian bytes)`; weights are
    /// converted to f32. Tensors the architecture does not use (e.g. `lm_head.weight` when
    /// `tie_word_embeddings` is true) are ignored. The config must have `head_dim` equal to
    /// `hidden_size / num_attention_heads` (candle's llama assumes it), silu and no biases.
    ///
    /// # Errors
    /// [`Error::BadConfig`] naming the field; [`Error::MissingTensor`], [`Error::BadShape`],
    /// [`Error::BadDType`] or [`Error::BadLength`] naming the tensor; [`Error::Candle`] if candle
    /// fails to build the model.
    pub fn new(
        config: &serde_json::Value,
        tensors: &BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    ) -> Result<Self, Error> {
        let config = parse_config(config)?;
        let device = Device::Cpu;
        let model = build_model(&config, tensors, &device)?;
        Ok(LlamaEngine {
            config,
            model,
            device,
            cache: None,
            positions: 0,
            prefix: None,
        })
    }

    /// Replaces the weights with `tensors` (same config, same checks as [`new`](Self::new)).
    /// Cached KV entries are KEPT, as in vLLM: call [`clear_cache`](Self::clear_cache) afterwards
    /// unless stale entries are wanted (they were computed with the old weights). On error the
    /// old weights stay.
    ///
    /// # Errors
    /// As [`new`](Self::new), without [`Error::BadConfig`].
    pub fn install_weights(
        &mut self,
        tensors: &BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    ) -> Result<(), Error> {
        self.model = build_model(&self.config, tensors, &self.device)?;
        Ok(())
    }

    /// Greedy decoding of `max_new` tokens after `prompt` (token ids), using and filling the KV
    /// cache.
    ///
    /// Returns the `max_new` new token ids (ties go to the lowest id). If the cached prefix is a
    /// prefix of `prompt` its KV entries are reused; otherwise the cache is restarted. Afterwards
    /// the cache holds `prompt` (kept for reuse) and the decode's positions.
    ///
    /// # Errors
    /// [`Error::BadRequest`] for an empty prompt, a token id outside the vocabulary (naming its
    /// position) or `prompt.len() + max_new` past `max_position_embeddings`; [`Error::Candle`]
    /// if the forward pass fails.
    pub fn generate_greedy(&mut self, prompt: &[u32], max_new: usize) -> Result<Vec<u32>, Error> {
        self.generate_greedy_while(prompt, max_new, &mut |_| true)
    }

    /// As [`generate_greedy`](Self::generate_greedy), but asks `keep_going(n)` before computing
    /// each new token, `n` being the number of tokens generated so far (`0` before the prompt is
    /// prefilled), and stops early, returning those `n` tokens, when it returns `false`. It is
    /// not asked once `max_new` tokens exist. Lets a caller interrupt a decode, e.g. to install
    /// new weights between tokens.
    ///
    /// The request is checked before `keep_going` is first asked. Stopping at `n = 0` leaves the
    /// cache untouched; stopping later leaves it as a decode of `n` tokens would (the prompt kept
    /// as the reusable prefix, plus the positions of the first `n - 1` generated tokens).
    ///
    /// # Errors
    /// As [`generate_greedy`](Self::generate_greedy).
    pub fn generate_greedy_while(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Vec<u32>, Error> {
        self.check_prompt(prompt)?;
        let max_pos = self.config.max_position_embeddings;
        if prompt
            .len()
            .checked_add(max_new)
            .is_none_or(|n| n > max_pos)
        {
            return Err(Error::BadRequest {
                field: "max_new".into(),
                reason: format!(
                    "{} prompt tokens + {max_new} new exceed max_position_embeddings {max_pos}",
                    prompt.len()
                ),
            });
        }
        let mut out = Vec::with_capacity(max_new);
        while out.len() < max_new && keep_going(out.len()) {
            // The last generated token is fed only when another token is wanted.
            let logits = match out.last() {
                None => self.prefill(prompt)?,
                Some(&last) => self.forward(&[last])?,
            };
            out.push(argmax(&logits)?);
        }
        Ok(out)
    }

    /// Whether a request for `prompt` would reuse the cached prefix (the KV entries of an earlier
    /// prompt that `prompt` starts with) instead of prefilling from scratch. After
    /// [`install_weights`](Self::install_weights) without [`clear_cache`](Self::clear_cache) a
    /// hit means stale entries would be used.
    pub fn prefix_hit(&self, prompt: &[u32]) -> bool {
        self.prefix
            .as_ref()
            .is_some_and(|p| prompt.starts_with(&p.tokens))
    }

    /// Logits (f32, one per vocabulary entry) for the token after `prompt`, using and filling
    /// the KV cache like [`generate_greedy`](Self::generate_greedy). Finer than tokens for
    /// checking that new weights changed the model.
    ///
    /// # Errors
    /// As [`generate_greedy`](Self::generate_greedy).
    pub fn next_token_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, Error> {
        self.check_prompt(prompt)?;
        let max_pos = self.config.max_position_embeddings;
        if prompt.len() > max_pos {
            return Err(Error::BadRequest {
                field: "prompt".into(),
                reason: format!(
                    "{} tokens exceed max_position_embeddings {max_pos}",
                    prompt.len()
                ),
            });
        }
        let logits = self.prefill(prompt)?;
        logits
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .map_err(candle("reading logits"))
    }

    /// Checks a prompt: non-empty, every id inside the vocabulary.
    fn check_prompt(&self, prompt: &[u32]) -> Result<(), Error> {
        if prompt.is_empty() {
            return Err(Error::BadRequest {
                field: "prompt".into(),
                reason: "is empty".into(),
            });
        }
        let vocab = self.config.vocab_size;
        if let Some((i, t)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(Error::BadRequest {
                field: format!("prompt[{i}]"),
                reason: format!("token id {t} is outside the vocabulary of {vocab}"),
            });
        }
        Ok(())
    }

    /// Feeds `prompt`, reusing the cached prefix when the prompt starts with it, keeps its KV
    /// entries as the new prefix and returns the logits after its last token.
    fn prefill(&mut self, prompt: &[u32]) -> Result<Tensor, Error> {
        // Prefill, reusing the cached prefix when the prompt starts with it.
        let reuse = self
            .prefix
            .as_ref()
            .filter(|p| prompt.starts_with(&p.tokens))
            .map(|p| (p.tokens.len(), p.cache.clone(), p.logits.clone()));
        let logits = match reuse {
            Some((n, cache, logits)) => {
                self.cache = Some(cache);
                self.positions = n;
                if n == prompt.len() {
                    logits
                } else {
                    self.forward(&prompt[n..])?
                }
            }
            None => {
                self.cache = None;
                self.positions = 0;
                self.forward(prompt)?
            }
        };
        if let Some(cache) = &self.cache {
            self.prefix = Some(Prefix {
                tokens: prompt.to_vec(),
                cache: cache.clone(),
                logits: logits.clone(),
            });
        }
        Ok(logits)
    }

    /// Drops every cached KV entry (what apply must do after new weights are installed).
    pub fn clear_cache(&mut self) {
        self.prefix = None;
        self.cache = None;
        self.positions = 0;
    }

    /// Number of cached positions (to prove a cache exists and was cleared): positions whose
    /// keys and values the decode cache holds (the kept prompt prefix included).
    pub fn cached_positions(&self) -> usize {
        self.positions
    }

    /// Feeds `tokens` at the next positions, returning logits `[1, vocab]` (f32) after the last.
    fn forward(&mut self, tokens: &[u32]) -> Result<Tensor, Error> {
        let at = self.positions;
        let cache = match self.cache.take() {
            Some(c) => c,
            None => new_cache(&self.config, &self.device)?,
        };
        let cache = self.cache.insert(cache);
        let input = Tensor::new(tokens, &self.device)
            .and_then(|t| t.unsqueeze(0))
            .map_err(candle("building the input"))?;
        let logits = match self.model.forward(&input, at, cache) {
            Ok(l) => l,
            Err(e) => {
                // Some layers may have appended entries: drop the half-updated cache.
                self.cache = None;
                self.positions = 0;
                return Err(candle(format!("running the forward pass at position {at}"))(e));
            }
        };
        self.positions = at + tokens.len();
        Ok(logits)
    }
}

fn build_model(
    cfg: &Config,
    tensors: &BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    device: &Device,
) -> Result<Llama, Error> {
    let loaded = load_tensors(cfg, tensors, device)?;
    let vb = VarBuilder::from_tensors(loaded, candle_core::DType::F32, device);
    // Every tensor Llama::load reads was checked above, so its internal unwrap cannot fire.
    Llama::load(vb, cfg).map_err(candle("building the model"))
}

fn new_cache(cfg: &Config, device: &Device) -> Result<Cache, Error> {
    Cache::new(true, candle_core::DType::F32, cfg, device).map_err(candle("creating the KV cache"))
}

/// Index of the largest logit (the first one on ties; NaN never wins).
fn argmax(logits: &Tensor) -> Result<u32, Error> {
    let v: Vec<f32> = logits
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .map_err(candle("reading logits"))?;
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in v.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) && !x.is_nan() {
            best = Some((i, x));
        }
    }
    let (i, _) = best.ok_or_else(|| Error::BadRequest {
        field: "logits".into(),
        reason: "every logit is NaN (the weights are broken)".into(),
    })?;
    u32::try_from(i).map_err(|_| Error::BadRequest {
        field: "logits".into(),
        reason: "vocabulary larger than u32".into(),
    })
}
