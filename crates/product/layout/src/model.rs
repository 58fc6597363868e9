//! Model layouts: for each rank of a [`LayoutSpec`], the parameters it holds and which boxes of which
//! checkpoint tensors they are made of.
//!
//! A model is described by [`ModelInfo`], derived from an HF `config.json` (llama family and BERT)
//! plus the checkpoint's tensor list. [`rank_layouts`] then places every tensor according to the
//! scheme. vLLM conventions (source: vLLM `QKVParallelLinear`, `MergedColumnParallelLinear`,
//! `RowParallelLinear`, `VocabParallelEmbedding`, `pad_vocab_size` with padding 64):
//! - `q_proj`/`k_proj`/`v_proj` fuse into `qkv_proj` as `[q_r; k_r; v_r]` per rank; when
//!   tp > kv heads each rank holds kv head `r / (tp / kv_heads)` (replicated kv heads);
//! - `gate_proj`/`up_proj` fuse into `gate_up_proj` as `[gate_r; up_r]`;
//! - `o_proj`, `down_proj` (and BERT `attention.output.dense`, `output.dense`) split dim 1;
//! - other linear weights and their biases split dim 0 (column parallel);
//! - word embeddings and `lm_head` pad the vocab to a multiple of 64 and split it evenly; padding
//!   rows exist only at the destination and are zero-filled there;
//! - norms, row-parallel biases, position and token-type embeddings are replicated.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{DType, Error, LayoutSpec, Scheme, TensorBox, TensorSpec};

/// Model family, from `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// Llama-family decoder (llama, mistral, qwen2: same parameter names).
    Llama,
    /// BERT encoder.
    Bert,
    /// Known only by its tensors (a checkpoint without `config.json`): replicated and FSDP
    /// layouts place it, tensor parallelism refuses it ([`Error::NoModelConfig`]).
    Generic,
}

/// What the layout needs to know about a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Family.
    pub family: Family,
    /// `num_attention_heads`.
    pub num_heads: u64,
    /// `num_key_value_heads` (= heads for BERT).
    pub num_kv_heads: u64,
    /// `head_dim` (or hidden / heads).
    pub head_dim: u64,
    /// `vocab_size`.
    pub vocab_size: u64,
    /// Every checkpoint tensor, sorted by name.
    pub tensors: Vec<TensorSpec>,
    /// Its routed experts, for a mixture-of-experts family ([`crate::moe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<crate::moe::MoeInfo>,
}

fn cfg_u64(cfg: &serde_json::Value, field: &str) -> Result<u64, Error> {
    cfg.get(field)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| Error::BadConfig {
            field: field.to_string(),
            reason: "missing or not a non-negative integer".into(),
        })
}

impl ModelInfo {
    /// Derives model info from an HF `config.json` value and the checkpoint's tensors.
    ///
    /// # Errors
    /// [`Error::BadConfig`] naming a missing or inconsistent field (unsupported `model_type`,
    /// heads not dividing hidden size, kv heads not dividing heads).
    pub fn from_hf_config(
        config: &serde_json::Value,
        mut tensors: Vec<TensorSpec>,
    ) -> Result<ModelInfo, Error> {
        let model_type = config
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| Error::BadConfig {
                field: "model_type".into(),
                reason: "missing".into(),
            })?;
        let family = match model_type {
            "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "mixtral" => {
                Family::Llama
            }
            "bert" => Family::Bert,
            other => {
                return Err(Error::BadConfig {
                    field: "model_type".into(),
                    reason: format!(
                        "{other:?} is not supported (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral or bert)"
                    ),
                })
            }
        };
        let hidden = cfg_u64(config, "hidden_size")?;
        let num_heads = cfg_u64(config, "num_attention_heads")?;
        if num_heads == 0 {
            return Err(Error::BadConfig {
                field: "num_attention_heads".into(),
                reason: "must be > 0".into(),
            });
        }
        let num_kv_heads = match family {
            Family::Llama => cfg_u64(config, "num_key_value_heads").unwrap_or(num_heads),
            Family::Bert | Family::Generic => num_heads,
        };
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::BadConfig {
                field: "num_key_value_heads".into(),
                reason: format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            });
        }
        let head_dim = match cfg_u64(config, "head_dim") {
            Ok(h) => h,
            Err(_) => {
                if hidden % num_heads != 0 {
                    return Err(Error::BadConfig {
                        field: "hidden_size".into(),
                        reason: format!(
                            "{hidden} not divisible by num_attention_heads {num_heads}"
                        ),
                    });
                }
                hidden / num_heads
            }
        };
        let vocab_size = cfg_u64(config, "vocab_size")?;
        let tied = config
            .get("tie_word_embeddings")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        if family == Family::Llama && tied {
            drop_tied_lm_head(&mut tensors)?;
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let info = ModelInfo {
            family,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            tensors,
            moe: crate::moe::MoeInfo::from_hf_config(model_type, config)?,
        };
        if let Ok(layers) = cfg_u64(config, "num_hidden_layers") {
            info.check_architecture(config, hidden, layers)?;
        }
        Ok(info)
    }

    /// A model known only by its tensors, for a checkpoint without `config.json`: replicated and
    /// FSDP layouts need nothing else; a tensor-parallel layout is refused by [`rank_layout`]
    /// with [`Error::NoModelConfig`].
    pub fn generic(mut tensors: Vec<TensorSpec>) -> ModelInfo {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        ModelInfo {
            family: Family::Generic,
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            vocab_size: 0,
            tensors,
            moe: None,
        }
    }

    /// Checks that every tensor the architecture needs is present with the shape `config.json`
    /// implies, so a checkpoint missing a layer or an embedding is refused instead of leaving an
    /// engine parameter stale.
    fn check_architecture(
        &self,
        config: &serde_json::Value,
        hidden: u64,
        layers: u64,
    ) -> Result<(), Error> {
        let mut want: Vec<(String, Vec<u64>)> = Vec::new();
        let too_big = |field: &str| Error::BadConfig {
            field: field.to_string(),
            reason: "heads x head_dim overflows u64".into(),
        };
        let q = self
            .num_heads
            .checked_mul(self.head_dim)
            .ok_or_else(|| too_big("num_attention_heads"))?;
        let kv = self
            .num_kv_heads
            .checked_mul(self.head_dim)
            .ok_or_else(|| too_big("num_key_value_heads"))?;
        match self.family {
            Family::Llama => {
                let inter = cfg_u64(config, "intermediate_size")?;
                let tied = config
                    .get("tie_word_embeddings")
                    .and_then(serde_json::Value::as_bool)
                    .unwrap_or(false);
                want.push((
                    "model.embed_tokens.weight".into(),
                    vec![self.vocab_size, hidden],
                ));
                want.push(("model.norm.weight".into(), vec![hidden]));
                if !tied {
                    want.push(("lm_head.weight".into(), vec![self.vocab_size, hidden]));
                }
                for i in 0..layers.min(self.tensors.len() as u64 + 1) {
                    let l = format!("model.layers.{i}");
                    want.push((format!("{l}.self_attn.q_proj.weight"), vec![q, hidden]));
                    want.push((format!("{l}.self_attn.k_proj.weight"), vec![kv, hidden]));
                    want.push((format!("{l}.self_attn.v_proj.weight"), vec![kv, hidden]));
                    want.push((format!("{l}.self_attn.o_proj.weight"), vec![hidden, q]));
                    // An MoE layer has a router (its experts are checked where they are placed,
                    // crate::moe); any other layer a dense MLP.
                    let router = self
                        .moe
                        .as_ref()
                        .map(|m| (format!("{l}.{}.gate.weight", m.naming.block()), m));
                    match router {
                        Some((name, m)) if self.tensor(&name).is_some() => {
                            want.push((name, vec![m.num_experts, hidden]));
                            if m.shared_intermediate > 0 {
                                let (s, si) =
                                    (format!("{l}.mlp.shared_expert"), m.shared_intermediate);
                                want.push((format!("{s}.gate_proj.weight"), vec![si, hidden]));
                                want.push((format!("{s}.up_proj.weight"), vec![si, hidden]));
                                want.push((format!("{s}.down_proj.weight"), vec![hidden, si]));
                                want.push((format!("{s}_gate.weight"), vec![1, hidden]));
                            }
                        }
                        Some((name, m)) if m.naming == crate::moe::ExpertNaming::Mixtral => {
                            want.push((name, vec![m.num_experts, hidden]));
                        }
                        _ => {
                            want.push((format!("{l}.mlp.gate_proj.weight"), vec![inter, hidden]));
                            want.push((format!("{l}.mlp.up_proj.weight"), vec![inter, hidden]));
                            want.push((format!("{l}.mlp.down_proj.weight"), vec![hidden, inter]));
                        }
                    }
                    want.push((format!("{l}.input_layernorm.weight"), vec![hidden]));
                    want.push((format!("{l}.post_attention_layernorm.weight"), vec![hidden]));
                }
            }
            Family::Generic => {}
            Family::Bert => {
                let inter = cfg_u64(config, "intermediate_size")?;
                let suffix = "embeddings.word_embeddings.weight";
                let prefix = self
                    .tensors
                    .iter()
                    .find_map(|t| t.name.strip_suffix(suffix))
                    .unwrap_or("")
                    .to_string();
                want.push((format!("{prefix}{suffix}"), vec![self.vocab_size, hidden]));
                for i in 0..layers.min(self.tensors.len() as u64 + 1) {
                    let l = format!("{prefix}encoder.layer.{i}");
                    for part in ["query", "key", "value"] {
                        want.push((
                            format!("{l}.attention.self.{part}.weight"),
                            vec![hidden, hidden],
                        ));
                        want.push((format!("{l}.attention.self.{part}.bias"), vec![hidden]));
                    }
                    want.push((
                        format!("{l}.attention.output.dense.weight"),
                        vec![hidden, hidden],
                    ));
                    want.push((
                        format!("{l}.intermediate.dense.weight"),
                        vec![inter, hidden],
                    ));
                    want.push((format!("{l}.output.dense.weight"), vec![hidden, inter]));
                }
            }
        }
        for (name, shape) in want {
            match self.tensor(&name) {
                None => {
                    return Err(Error::MissingTensor {
                        tensor: name,
                        reason: format!(
                            "config.json describes {layers} layers of this architecture"
                        ),
                    })
                }
                Some(t) if t.shape != shape => {
                    return Err(Error::Mismatch {
                        tensor: name,
                        what: "shape",
                        source_value: format!("{:?} in the checkpoint", t.shape),
                        dest_value: format!("{shape:?} from config.json"),
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Looks up a tensor by checkpoint name.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }
}

/// One box of a checkpoint tensor placed row-major at `offset` (bytes) in a rank's buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Checkpoint tensor name.
    pub tensor: String,
    /// The tensor's dtype.
    pub dtype: DType,
    /// The tensor's global shape.
    pub global_shape: Vec<u64>,
    /// The box of the tensor this piece holds.
    pub region: TensorBox,
    /// Byte offset of the piece in the rank's buffer.
    pub offset: u64,
}

/// One parameter on one rank: its engine name, local shape, where it lives in the rank's buffer
/// and what it is made of. Pieces stack along dim 0 in order; `zero_rows` trailing rows (vocab
/// padding) are zero-filled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Param {
    /// Engine parameter name (vLLM names for `tp`, checkpoint names otherwise).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Local shape on this rank (elements).
    pub shape: Vec<u64>,
    /// Byte offset in the rank's buffer.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The boxes it is made of, in order.
    pub pieces: Vec<Piece>,
    /// Zero-filled byte range (offset in rank buffer, length), for vocab padding rows.
    pub zero_fill: Option<(u64, u64)>,
}

/// Everything one rank of a layout holds, packed back to back in one buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLayout {
    /// The layout.
    pub layout: LayoutSpec,
    /// The rank.
    pub rank: u32,
    /// Parameters, in buffer order.
    pub params: Vec<Param>,
    /// Total bytes of the rank's buffer.
    pub total_bytes: u64,
}

impl RankLayout {
    /// The shard entries of this rank's pieces as a source publishes them: one per piece, at
    /// `base + piece.offset` in DRAM, digests left zero for the publisher to fill in.
    pub fn shard_entries(&self, base: u64) -> Vec<crate::ShardEntry> {
        self.params
            .iter()
            .flat_map(|p| p.pieces.iter())
            .map(|piece| crate::ShardEntry {
                tensor: piece.tensor.clone(),
                dtype: piece.dtype,
                global_shape: piece.global_shape.clone(),
                shard: piece.region.clone(),
                addr: base + piece.offset,
                len: piece.region.numel().unwrap_or(0) * piece.dtype.size_bytes(),
                device: crate::MemDevice::Dram,
                digest: crate::Digest::default(),
            })
            .collect()
    }

    /// A rank layout from explicit boxes, each its own parameter named after its tensor, in order
    /// (for N-d layouts the schemes do not cover, e.g. expert or 2-D grid splits).
    ///
    /// # Errors
    /// [`Error::Overflow`] on sizes past u64; [`Error::ImpossibleLayout`] when a box is outside
    /// its tensor.
    pub fn from_boxes(
        layout: LayoutSpec,
        rank: u32,
        boxes: &[(TensorSpec, TensorBox)],
    ) -> Result<RankLayout, Error> {
        let mut b = Builder {
            layout,
            params: Vec::new(),
            offset: 0,
        };
        for (t, bx) in boxes {
            if !bx.fits_in(&t.shape) {
                return Err(Error::ImpossibleLayout {
                    layout: layout.to_string(),
                    tensor: t.name.clone(),
                    reason: format!("box {bx} is outside shape {:?}", t.shape),
                });
            }
            b.single(t.name.clone(), t, bx.clone())?;
        }
        Ok(RankLayout {
            layout,
            rank,
            total_bytes: b.offset,
            params: b.params,
        })
    }

    /// Finds a parameter by name.
    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }
}

/// How a checkpoint tensor is placed under vLLM tensor parallelism.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Role {
    Replicated,
    Column,
    Row,
    Vocab,
    /// Part of a fused parameter: (vLLM param name, part index: q/k/v = 0/1/2, gate/up = 0/1).
    Fused(String, usize),
}

fn role(family: Family, name: &str) -> Role {
    let fused = |suffix_from: &str, to: &str, part: usize| -> Option<Role> {
        let idx = name.find(suffix_from)?;
        let rest = &name[idx + suffix_from.len()..];
        if rest == "weight" || rest == "bias" {
            Some(Role::Fused(format!("{}{to}{rest}", &name[..idx]), part))
        } else {
            None
        }
    };
    let is_weight = name.ends_with(".weight");
    match family {
        Family::Llama => {
            if let Some(r) = fused("self_attn.q_proj.", "self_attn.qkv_proj.", 0)
                .or_else(|| fused("self_attn.k_proj.", "self_attn.qkv_proj.", 1))
                .or_else(|| fused("self_attn.v_proj.", "self_attn.qkv_proj.", 2))
                .or_else(|| fused("mlp.gate_proj.", "mlp.gate_up_proj.", 0))
                .or_else(|| fused("mlp.up_proj.", "mlp.gate_up_proj.", 1))
                .or_else(|| fused("shared_expert.gate_proj.", "shared_expert.gate_up_proj.", 0))
                .or_else(|| fused("shared_expert.up_proj.", "shared_expert.gate_up_proj.", 1))
            {
                return r;
            }
            if is_weight
                && (name.ends_with("self_attn.o_proj.weight")
                    || name.ends_with("mlp.down_proj.weight")
                    || name.ends_with("mlp.shared_expert.down_proj.weight"))
            {
                return Role::Row;
            }
            if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
                return Role::Vocab;
            }
            Role::Replicated
        }
        Family::Generic => Role::Replicated,
        Family::Bert => {
            if let Some(r) = fused("attention.self.query.", "attention.self.qkv_proj.", 0)
                .or_else(|| fused("attention.self.key.", "attention.self.qkv_proj.", 1))
                .or_else(|| fused("attention.self.value.", "attention.self.qkv_proj.", 2))
            {
                return r;
            }
            if is_weight
                && (name.ends_with("attention.output.dense.weight")
                    || (name.ends_with(".output.dense.weight") && !name.contains("attention")))
            {
                return Role::Row;
            }
            if name.ends_with("intermediate.dense.weight")
                || name.ends_with("intermediate.dense.bias")
            {
                return Role::Column;
            }
            if name.ends_with("embeddings.word_embeddings.weight") {
                return Role::Vocab;
            }
            Role::Replicated
        }
    }
}

/// Rows `[start, end)` of dim 0 that FSDP rank `rank` of `n` holds (torch.chunk: ceil(rows/n) per
/// rank, trailing ranks short or empty).
pub fn fsdp_rows(rows: u64, rank: u32, n: u32) -> (u64, u64) {
    let n = u64::from(n.max(1));
    let chunk = rows.div_ceil(n);
    let start = chunk.saturating_mul(u64::from(rank)).min(rows);
    let end = start.saturating_add(chunk).min(rows);
    (start, end)
}

/// vLLM's padded vocab size: rounded up to a multiple of 64 (`pad_vocab_size`).
pub fn padded_vocab(vocab: u64) -> u64 {
    vocab.div_ceil(64).saturating_mul(64)
}

/// For a tied-embedding llama-family model: drops a redundant `lm_head.weight` (same dtype and
/// shape as the embedding; its bytes are compared where they are, in mx-checkpoint) so it is not
/// placed, published or pulled twice.
fn drop_tied_lm_head(tensors: &mut Vec<TensorSpec>) -> Result<(), Error> {
    const EMBED: &str = "model.embed_tokens.weight";
    const LM_HEAD: &str = "lm_head.weight";
    let Some(at) = tensors.iter().position(|t| t.name == LM_HEAD) else {
        return Ok(());
    };
    let mismatch = |reason: String| Error::TiedEmbeddingMismatch {
        embedding: EMBED.into(),
        lm_head: LM_HEAD.into(),
        reason,
    };
    let head = &tensors[at];
    let Some(embed) = tensors.iter().find(|t| t.name == EMBED) else {
        return Err(mismatch(format!(
            "the checkpoint has {LM_HEAD} but no {EMBED}"
        )));
    };
    if embed.dtype != head.dtype || embed.shape != head.shape {
        return Err(mismatch(format!(
            "{} {:?} against {} {:?}",
            head.dtype, head.shape, embed.dtype, embed.shape
        )));
    }
    tensors.remove(at);
    Ok(())
}

pub(crate) struct Builder {
    pub(crate) layout: LayoutSpec,
    pub(crate) params: Vec<Param>,
    pub(crate) offset: u64,
}

impl Builder {
    /// A parameter of explicit `shape` whose pieces lie back to back in row-major order (a
    /// fused expert parameter: `[experts, rows, cols]` from 2-D or 3-D boxes).
    pub(crate) fn stacked(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        pieces: Vec<(&TensorSpec, TensorBox)>,
    ) -> Result<(), Error> {
        let overflow = |what| Error::Overflow {
            what,
            tensor: name.clone(),
        };
        let mut elements = 0u64;
        for (_, region) in &pieces {
            let n = region.numel().ok_or_else(|| overflow("piece elements"))?;
            elements = elements
                .checked_add(n)
                .ok_or_else(|| overflow("elements"))?;
        }
        let want = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| overflow("shape"))?;
        if want != elements {
            return Err(Error::ImpossibleLayout {
                layout: self.layout.to_string(),
                tensor: name,
                reason: format!("its pieces hold {elements} elements, its shape {shape:?} {want}"),
            });
        }
        let (placed, off) = self.place(&name, dtype, pieces)?;
        self.params.push(Param {
            name,
            dtype,
            shape,
            offset: self.offset,
            len: off - self.offset,
            pieces: placed,
            zero_fill: None,
        });
        self.offset = off;
        Ok(())
    }

    /// Lays `pieces` back to back from the current offset: the pieces and the offset after them.
    fn place(
        &self,
        name: &str,
        dtype: DType,
        pieces: Vec<(&TensorSpec, TensorBox)>,
    ) -> Result<(Vec<Piece>, u64), Error> {
        let overflow = |what| Error::Overflow {
            what,
            tensor: name.to_string(),
        };
        let mut placed = Vec::with_capacity(pieces.len());
        let mut off = self.offset;
        for (spec, region) in pieces {
            let bytes = region
                .numel()
                .and_then(|n| n.checked_mul(dtype.size_bytes()))
                .ok_or_else(|| overflow("piece bytes"))?;
            placed.push(Piece {
                tensor: spec.name.clone(),
                dtype: spec.dtype,
                global_shape: spec.shape.clone(),
                region,
                offset: off,
            });
            off = off.checked_add(bytes).ok_or_else(|| overflow("offset"))?;
        }
        Ok((placed, off))
    }

    pub(crate) fn single(
        &mut self,
        name: String,
        t: &TensorSpec,
        region: TensorBox,
    ) -> Result<(), Error> {
        let shape = region.local_shape.clone();
        self.push(name, t.dtype, &shape, vec![(t, region)], 0)
    }

    pub(crate) fn push(
        &mut self,
        name: String,
        dtype: DType,
        template: &[u64],
        pieces: Vec<(&TensorSpec, TensorBox)>,
        zero_rows: u64,
    ) -> Result<(), Error> {
        let overflow = |what| Error::Overflow {
            what,
            tensor: name.clone(),
        };
        let mut shape = template.to_vec();
        let mut rows = 0u64;
        for (spec, region) in &pieces {
            if region.local_shape.get(1..) != shape.get(1..) {
                return Err(Error::ImpossibleLayout {
                    layout: self.layout.to_string(),
                    tensor: spec.name.clone(),
                    reason: format!("cannot fuse into {name}: trailing dims differ"),
                });
            }
            rows = rows.saturating_add(region.local_shape.first().copied().unwrap_or(1));
        }
        let (placed, mut off) = self.place(&name, dtype, pieces)?;
        let mut zero_fill = None;
        if zero_rows > 0 {
            let row_bytes = shape
                .iter()
                .skip(1)
                .try_fold(dtype.size_bytes(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| overflow("row bytes"))?;
            let z = row_bytes
                .checked_mul(zero_rows)
                .ok_or_else(|| overflow("padding bytes"))?;
            zero_fill = Some((off, z));
            off = off.checked_add(z).ok_or_else(|| overflow("offset"))?;
            rows = rows.saturating_add(zero_rows);
        }
        if let Some(d0) = shape.first_mut() {
            *d0 = rows;
        }
        let len = off - self.offset;
        self.params.push(Param {
            name,
            dtype,
            shape,
            offset: self.offset,
            len,
            pieces: placed,
            zero_fill,
        });
        self.offset = off;
        Ok(())
    }
}

pub(crate) fn rows_box(spec: &TensorSpec, start: u64, end: u64) -> TensorBox {
    let mut b = TensorBox::full(&spec.shape);
    if let (Some(o), Some(s)) = (b.global_offset.first_mut(), b.local_shape.first_mut()) {
        *o = start;
        *s = end - start;
    }
    b
}

fn split_even(
    layout: LayoutSpec,
    spec: &TensorSpec,
    dim: usize,
    rank: u32,
) -> Result<TensorBox, Error> {
    let tp = u64::from(layout.world_size);
    let extent = *spec.shape.get(dim).ok_or_else(|| Error::ImpossibleLayout {
        layout: layout.to_string(),
        tensor: spec.name.clone(),
        reason: format!("needs a dim {dim} to split, shape is {:?}", spec.shape),
    })?;
    if extent % tp != 0 {
        return Err(Error::ImpossibleLayout {
            layout: layout.to_string(),
            tensor: spec.name.clone(),
            reason: format!("dim {dim} of size {extent} is not divisible by tp={tp}"),
        });
    }
    let per = extent / tp;
    let mut b = TensorBox::full(&spec.shape);
    b.global_offset[dim] = per * u64::from(rank);
    b.local_shape[dim] = per;
    Ok(b)
}

/// The box of q, k or v (`part` 0/1/2) that tp rank `rank` holds in vLLM's QKVParallelLinear.
fn qkv_box(
    model: &ModelInfo,
    layout: LayoutSpec,
    spec: &TensorSpec,
    part: usize,
    rank: u32,
) -> Result<TensorBox, Error> {
    let tp = u64::from(layout.world_size);
    let r = u64::from(rank);
    let bad = |reason: String| Error::ImpossibleLayout {
        layout: layout.to_string(),
        tensor: spec.name.clone(),
        reason,
    };
    let heads = if part == 0 {
        model.num_heads
    } else {
        model.num_kv_heads
    };
    let rows = spec.shape.first().copied().unwrap_or(0);
    if heads.checked_mul(model.head_dim) != Some(rows) {
        return Err(bad(format!(
            "dim 0 is {rows}, expected {heads} heads x head_dim {}",
            model.head_dim
        )));
    }
    let (first_head, n_heads) = if part == 0 {
        if heads % tp != 0 {
            return Err(bad(format!(
                "{heads} attention heads are not divisible by tp={tp}"
            )));
        }
        (r * (heads / tp), heads / tp)
    } else if tp >= heads {
        if tp % heads != 0 {
            return Err(bad(format!(
                "tp={tp} is not a multiple of {heads} kv heads"
            )));
        }
        (r / (tp / heads), 1)
    } else {
        if heads % tp != 0 {
            return Err(bad(format!(
                "{heads} kv heads are not divisible by tp={tp}"
            )));
        }
        (r * (heads / tp), heads / tp)
    };
    Ok(rows_box(
        spec,
        first_head * model.head_dim,
        (first_head + n_heads) * model.head_dim,
    ))
}

/// The layout of every rank of `layout` for `model`.
///
/// # Errors
/// [`Error::ImpossibleLayout`] naming the tensor when the layout cannot split it (e.g. tp=2 over 9
/// attention heads); [`Error::MissingTensor`] when a fused parameter lacks one of its parts.
pub fn rank_layouts(model: &ModelInfo, layout: LayoutSpec) -> Result<Vec<RankLayout>, Error> {
    (0..layout.world_size)
        .map(|rank| rank_layout(model, layout, rank))
        .collect()
}

/// The layout of one rank; see [`rank_layouts`].
///
/// # Errors
/// As [`rank_layouts`].
pub fn rank_layout(model: &ModelInfo, layout: LayoutSpec, rank: u32) -> Result<RankLayout, Error> {
    if rank >= layout.world_size {
        return Err(Error::RankOutsideLayout {
            rank,
            layout: layout.to_string(),
            world_size: layout.world_size,
        });
    }
    let mut b = Builder {
        layout,
        params: Vec::new(),
        offset: 0,
    };
    match layout.scheme {
        Scheme::Replicated => {
            for t in &model.tensors {
                b.single(t.name.clone(), t, TensorBox::full(&t.shape))?;
            }
        }
        Scheme::Fsdp => {
            for t in &model.tensors {
                if t.shape.is_empty() {
                    if rank == 0 {
                        b.single(t.name.clone(), t, TensorBox::full(&t.shape))?;
                    }
                    continue;
                }
                let (s, e) = fsdp_rows(t.shape[0], rank, layout.world_size);
                if e > s {
                    b.single(t.name.clone(), t, rows_box(t, s, e))?;
                }
            }
        }
        Scheme::VllmTp | Scheme::VllmTpEp if model.family == Family::Generic => {
            return Err(Error::NoModelConfig {
                layout: layout.to_string(),
            })
        }
        Scheme::VllmTp | Scheme::VllmTpEp => vllm_tp(model, layout, rank, &mut b)?,
        Scheme::Megatron(dims) => crate::megatron::rank(model, dims, rank, &mut b)?,
    }
    Ok(RankLayout {
        layout,
        rank,
        total_bytes: b.offset,
        params: b.params,
    })
}

fn vllm_tp(model: &ModelInfo, layout: LayoutSpec, rank: u32, b: &mut Builder) -> Result<(), Error> {
    // Fused params collect their parts; emitted at the position of their first part.
    let mut fused: BTreeMap<String, Vec<Option<&TensorSpec>>> = BTreeMap::new();
    let mut order: Vec<(String, Option<&TensorSpec>)> = Vec::new();
    // MoE blocks collect their experts; emitted at the position of their first expert tensor.
    let mut blocks: BTreeMap<String, crate::moe::Block<'_>> = BTreeMap::new();
    for t in &model.tensors {
        if let Some(moe) = &model.moe {
            if let Some(x) = moe.expert_tensor(&t.name)? {
                let block = blocks.entry(x.block.clone()).or_insert_with(|| {
                    order.push((x.block.clone(), None));
                    crate::moe::Block::default()
                });
                match (x.expert, x.part) {
                    (Some(e), part) => {
                        block.per_expert.insert((e, part), t);
                    }
                    (None, crate::moe::Part::Down) => block.down = Some(t),
                    (None, _) => block.gate_up = Some(t),
                }
                continue;
            }
        }
        match role(model.family, &t.name) {
            Role::Fused(param, part) => {
                let parts = fused.entry(param.clone()).or_insert_with(|| {
                    order.push((param.clone(), None));
                    Vec::new()
                });
                if parts.len() <= part {
                    parts.resize(part + 1, None);
                }
                parts[part] = Some(t);
            }
            _ => order.push((t.name.clone(), Some(t))),
        }
    }
    for (name, single) in order {
        if let Some(t) = single {
            match role(model.family, &t.name) {
                Role::Replicated => b.single(name, t, TensorBox::full(&t.shape))?,
                Role::Column => {
                    let bx = split_even(layout, t, 0, rank)?;
                    b.single(name, t, bx)?
                }
                Role::Row => {
                    let bx = split_even(layout, t, 1, rank)?;
                    b.single(name, t, bx)?
                }
                Role::Vocab => {
                    let vocab = t.shape.first().copied().unwrap_or(0);
                    let padded = padded_vocab(vocab);
                    let tp = u64::from(layout.world_size);
                    if padded < vocab || !padded.is_multiple_of(tp) {
                        return Err(Error::ImpossibleLayout {
                            layout: layout.to_string(),
                            tensor: t.name.clone(),
                            reason: format!("padded vocab {padded} is not divisible by tp={tp}"),
                        });
                    }
                    let per = padded / tp;
                    let start = per * u64::from(rank);
                    let end = start + per;
                    let real_end = end.min(vocab);
                    let real_start = start.min(vocab);
                    let pieces = if real_end > real_start {
                        vec![(t, rows_box(t, real_start, real_end))]
                    } else {
                        Vec::new()
                    };
                    let zero = end - real_end.max(start);
                    b.push(name, t.dtype, &t.shape, pieces, zero)?;
                }
                Role::Fused(..) => {}
            }
            continue;
        }
        if let (Some(moe), Some(block)) = (&model.moe, blocks.get(&name)) {
            experts(moe, layout, rank, &name, block, b)?;
            continue;
        }
        let parts = fused.get(&name).cloned().unwrap_or_default();
        let expected = if name.contains("qkv_proj") { 3 } else { 2 };
        let mut pieces = Vec::with_capacity(expected);
        for part in 0..expected {
            let Some(t) = parts.get(part).copied().flatten() else {
                return Err(Error::MissingTensor {
                    tensor: match (expected, part) {
                        (3, p) => {
                            let parts = match model.family {
                                Family::Llama | Family::Generic => ["q_proj", "k_proj", "v_proj"],
                                Family::Bert => ["query", "key", "value"],
                            };
                            name.replace("qkv_proj", parts[p.min(2)])
                        }
                        (_, 0) => name.replace("gate_up_proj", "gate_proj"),
                        _ => name.replace("gate_up_proj", "up_proj"),
                    },
                    reason: format!("the fused vLLM parameter {name} needs it"),
                });
            };
            let bx = if expected == 3 {
                qkv_box(model, layout, t, part, rank)?
            } else {
                split_even(layout, t, 0, rank)?
            };
            pieces.push((t, bx));
        }
        let dtype = pieces[0].0.dtype;
        let template = pieces[0].0.shape.clone();
        if let Some((t, _)) = pieces.iter().find(|(t, _)| t.dtype != dtype) {
            return Err(Error::Mismatch {
                tensor: t.name.clone(),
                what: "dtype",
                source_value: t.dtype.to_string(),
                dest_value: dtype.to_string(),
            });
        }
        b.push(name, dtype, &template, pieces, 0)?;
    }
    Ok(())
}

/// A block's routed experts on one rank of `tp:N` or `tp-ep:N`: its `w13_weight` and
/// `w2_weight` ([`crate::moe`]).
fn experts(
    moe: &crate::moe::MoeInfo,
    layout: LayoutSpec,
    rank: u32,
    block_name: &str,
    block: &crate::moe::Block<'_>,
    b: &mut Builder,
) -> Result<(), Error> {
    let n = u64::from(layout.world_size);
    let bad = |reason: String| Error::ImpossibleLayout {
        layout: layout.to_string(),
        tensor: format!("{block_name}.experts"),
        reason,
    };
    if n > moe.num_experts {
        return Err(bad(format!(
            "{n} ranks over {} experts: vLLM refuses a tensor-parallel size above the expert count",
            moe.num_experts
        )));
    }
    let slice = if layout.scheme == Scheme::VllmTpEp {
        let (first, count) = moe.ep_experts(layout.world_size, rank);
        crate::moe::Slice {
            first,
            count,
            rows: moe.intermediate,
            row0: 0,
        }
    } else {
        if !moe.intermediate.is_multiple_of(n) {
            return Err(bad(format!(
                "the expert intermediate size {} is not divisible by tp={n}",
                moe.intermediate
            )));
        }
        let rows = moe.intermediate / n;
        crate::moe::Slice {
            first: 0,
            count: moe.num_experts,
            rows,
            row0: rows * u64::from(rank),
        }
    };
    let [w13, w2] = crate::moe::block_pieces(moe, block_name, block, slice)?;
    let dtype = w13
        .first()
        .map(|(t, _)| t.dtype)
        .ok_or_else(|| bad("no experts on this rank".into()))?;
    let prefix = format!("{block_name}.experts.routed_experts");
    let rows2 = slice
        .rows
        .checked_mul(2)
        .ok_or_else(|| bad("intermediate size overflows".into()))?;
    b.stacked(
        format!("{prefix}.w13_weight"),
        dtype,
        vec![slice.count, rows2, moe.hidden],
        w13,
    )?;
    b.stacked(
        format!("{prefix}.w2_weight"),
        dtype,
        vec![slice.count, moe.hidden, slice.rows],
        w2,
    )
}
