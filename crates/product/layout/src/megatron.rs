//! Megatron-Core trainer layouts as sources: what each rank of a Megatron-Core GPT model holds,
//! under Megatron-Core's own parameter names, in its own order.
//!
//! Written `megatron:tp=T,pp=P,ep=E` ([`crate::MegatronDims`]): `T * P * E` ranks, rank
//! `(pp_rank * E + ep_rank) * T + tp_rank` (Megatron-Core's default order `tp-cp-ep-dp-pp` with
//! context parallel 1 and data parallel `E`: the dense weights of a stage's tensor-parallel rank
//! are held by each of its `E` data-parallel replicas, the experts are not). The checkpoint is an
//! HF one (llama family, Qwen3-MoE, Qwen2-MoE, Mixtral); each rank's parameters are named as
//! Megatron-Core's GPT model with the transformer-engine layer spec and `SequentialMLP` experts
//! names them, and made of these boxes of the HF tensors (`r` the tensor-parallel rank):
//!
//! | Megatron-Core parameter | HF tensors, box |
//! |---|---|
//! | `embedding.word_embeddings.weight` (stage 0) | `model.embed_tokens.weight` rows `[r V_p/T, (r+1) V_p/T)`, rows past the vocabulary zero; `V_p` the vocabulary padded to a multiple of `128 T` (`make_vocab_size_divisible_by` 128) |
//! | `output_layer.weight` (last stage) | `lm_head.weight`, as the embedding (untied models) |
//! | `decoder.final_layernorm.weight` (last stage) | `model.norm.weight` |
//! | `decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight` | `input_layernorm.weight` |
//! | `...self_attention.linear_qkv.weight` / `.bias` | per query group `g` of the rank (`[r G/T, (r+1) G/T)` of `G` = kv heads), in order: the group's q rows, its k rows, its v rows |
//! | `...self_attention.q_layernorm.weight`, `k_layernorm.weight` | `self_attn.q_norm`, `k_norm` (Qwen3) |
//! | `...self_attention.linear_proj.weight` | `o_proj` columns `[r C/T, (r+1) C/T)` |
//! | `...mlp.linear_fc1.layer_norm_weight` (dense layer) | `post_attention_layernorm.weight` |
//! | `...mlp.linear_fc1.weight` (dense layer) | `[gate_r; up_r]`: `gate_proj` rows `[r I/T, (r+1) I/T)`, then `up_proj`'s |
//! | `...mlp.linear_fc2.weight` (dense layer) | `down_proj` columns `[r I/T, (r+1) I/T)` |
//! | `...pre_mlp_layernorm.weight` (MoE layer) | `post_attention_layernorm.weight` |
//! | `...mlp.router.weight` (MoE layer) | the router (`mlp.gate`, Mixtral `block_sparse_moe.gate`), whole |
//! | `...mlp.experts.local_experts.{k}.linear_fc1.weight` | global expert `e = ep_rank * E_n / E + k`: `[gate_r; up_r]` of expert `e` |
//! | `...mlp.experts.local_experts.{k}.linear_fc2.weight` | expert `e`'s down columns `[r I/T, ..)` |
//! | `...mlp.shared_experts.linear_fc1.weight`, `linear_fc2.weight` | Qwen2-MoE's `shared_expert`, as a dense MLP |
//! | `...mlp.shared_experts.gate_weight` | `mlp.shared_expert_gate.weight`, whole |
//!
//! Layer `i` of stage `s` is global layer `s L / P + i` (each stage numbers its layers from 0).
//! Experts are split by tensor parallelism as dense MLPs are (expert tensor parallel = `T`,
//! Megatron-Core's default). Refused, naming the tensor: a layer count, kv-head count, expert
//! count or intermediate size the sizes do not divide, a tied embedding with `P > 1`, and any
//! checkpoint tensor no Megatron-Core parameter holds.

use std::collections::BTreeMap;

use crate::model::{rows_box, Builder, Family};
use crate::moe::{Block, Part, Slice};
use crate::{Error, LayoutSpec, MegatronDims, ModelInfo, TensorBox, TensorSpec};

/// Megatron-Core's padded vocabulary: `vocab` rounded up to a multiple of `128 * tp`
/// (`make_vocab_size_divisible_by` = 128, times the tensor-parallel size).
pub fn padded_vocab(vocab: u64, tp: u32) -> Option<u64> {
    let m = 128u64.checked_mul(u64::from(tp.max(1)))?;
    vocab.div_ceil(m).checked_mul(m)
}

fn layer_of(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (n, suffix) = rest.split_once('.')?;
    Some((n.parse().ok()?, suffix))
}

/// The tensors of one decoder layer by their suffix after `model.layers.{n}.`, and its experts.
#[derive(Default)]
struct Layer<'a> {
    by_suffix: BTreeMap<&'a str, &'a TensorSpec>,
    experts: Block<'a>,
    block: Option<String>,
}

/// Fills `b` with rank `rank`'s parameters of `megatron:tp=T,pp=P,ep=E` (see the module docs).
///
/// # Errors
/// [`Error::ImpossibleLayout`] naming the tensor the layout cannot cut or place;
/// [`Error::MissingTensor`] when a fused parameter lacks one of its parts;
/// [`Error::NoModelConfig`] for a checkpoint without `config.json`.
pub(crate) fn rank(
    model: &ModelInfo,
    dims: MegatronDims,
    rank: u32,
    b: &mut Builder,
) -> Result<(), Error> {
    let layout = b.layout;
    let bad = |tensor: &str, reason: String| Error::ImpossibleLayout {
        layout: layout.to_string(),
        tensor: tensor.to_string(),
        reason,
    };
    match model.family {
        Family::Llama => {}
        Family::Generic => {
            return Err(Error::NoModelConfig {
                layout: layout.to_string(),
            })
        }
        Family::Bert => {
            return Err(bad(
                "*",
                "Megatron layouts cover decoder (GPT) models, not BERT".into(),
            ))
        }
    }
    // Every tensor placed somewhere, or refused, whichever rank is asked.
    let mut layers: BTreeMap<u64, Layer<'_>> = BTreeMap::new();
    let mut top: BTreeMap<&str, &TensorSpec> = BTreeMap::new();
    for t in &model.tensors {
        match layer_of(&t.name) {
            Some((n, suffix)) => {
                let layer = layers.entry(n).or_default();
                if let Some(x) = match &model.moe {
                    Some(moe) => moe.expert_tensor(&t.name)?,
                    None => None,
                } {
                    layer.block = Some(x.block.clone());
                    match (x.expert, x.part) {
                        (Some(e), part) => {
                            layer.experts.per_expert.insert((e, part), t);
                        }
                        (None, Part::Down) => layer.experts.down = Some(t),
                        (None, _) => layer.experts.gate_up = Some(t),
                    }
                } else if known_layer_suffix(suffix) {
                    layer.by_suffix.insert(suffix, t);
                } else {
                    return Err(bad(
                        &t.name,
                        "no Megatron-Core parameter holds it (see mx_layout::megatron)".into(),
                    ));
                }
            }
            None => match t.name.as_str() {
                "model.embed_tokens.weight" | "model.norm.weight" | "lm_head.weight" => {
                    top.insert(&t.name, t);
                }
                _ => {
                    return Err(bad(
                        &t.name,
                        "no Megatron-Core parameter holds it (see mx_layout::megatron)".into(),
                    ))
                }
            },
        }
    }
    let count = layers.keys().next_back().map_or(0, |n| n + 1);
    if let Some(gap) = (0..count).find(|n| !layers.contains_key(n)) {
        return Err(bad(
            &format!("model.layers.{gap}"),
            format!(
                "the checkpoint has layers up to {} but not this one",
                count - 1
            ),
        ));
    }
    let pp = u64::from(dims.pp);
    if !count.is_multiple_of(pp) {
        return Err(bad(
            "model.layers",
            format!("{count} decoder layers are not divisible by pp={pp}"),
        ));
    }
    let (tp_rank, pp_rank, ep_rank) = dims.coords(rank);
    let per_stage = count / pp;
    let first = u64::from(pp_rank) * per_stage;
    let last_stage = pp_rank + 1 == dims.pp;
    let tied = !top.contains_key("lm_head.weight");
    if pp_rank == 0 {
        if let Some(t) = top.get("model.embed_tokens.weight") {
            vocab_parallel(b, "embedding.word_embeddings.weight", t, dims.tp, tp_rank)?;
        }
    }
    let cut = Cut {
        model,
        layout,
        tp: dims.tp,
        tp_rank,
    };
    for g in first..first + per_stage {
        let layer = &layers[&g];
        let prefix = format!("decoder.layers.{}.", g - first);
        cut.layer(b, &prefix, g, layer, dims.ep, ep_rank)?;
    }
    if last_stage {
        if let Some(t) = top.get("model.norm.weight") {
            b.single(
                "decoder.final_layernorm.weight".into(),
                t,
                TensorBox::full(&t.shape),
            )?;
        }
        if let Some(t) = top.get("lm_head.weight") {
            vocab_parallel(b, "output_layer.weight", t, dims.tp, tp_rank)?;
        } else if tied && dims.pp > 1 {
            return Err(bad(
                "model.embed_tokens.weight",
                "a tied embedding under pp > 1 (the last stage's copy of it) is not supported yet"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// The suffixes (after `model.layers.{n}.`) of the layer tensors a Megatron-Core rank holds,
/// routed experts aside.
fn known_layer_suffix(suffix: &str) -> bool {
    const KNOWN: [&str; 20] = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "mlp.gate.weight",
        "block_sparse_moe.gate.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight",
    ];
    KNOWN.contains(&suffix)
}

/// A vocab-parallel embedding or output layer: rows `[r V_p/T, (r+1) V_p/T)`, zero past `V`.
fn vocab_parallel(
    b: &mut Builder,
    name: &str,
    t: &TensorSpec,
    tp: u32,
    tp_rank: u32,
) -> Result<(), Error> {
    let vocab = t.shape.first().copied().unwrap_or(0);
    let overflow = || Error::Overflow {
        what: "padded vocabulary",
        tensor: t.name.clone(),
    };
    let padded = padded_vocab(vocab, tp).ok_or_else(overflow)?;
    let per = padded / u64::from(tp.max(1));
    let start = per.checked_mul(u64::from(tp_rank)).ok_or_else(overflow)?;
    let end = start.checked_add(per).ok_or_else(overflow)?;
    let (real_start, real_end) = (start.min(vocab), end.min(vocab));
    let pieces = if real_end > real_start {
        vec![(t, rows_box(t, real_start, real_end))]
    } else {
        Vec::new()
    };
    let zero = end - real_end.max(start);
    b.push(name.to_string(), t.dtype, &t.shape, pieces, zero)
}

/// One tensor-parallel rank's cut of a stage's layers.
struct Cut<'m> {
    model: &'m ModelInfo,
    layout: LayoutSpec,
    tp: u32,
    tp_rank: u32,
}

impl Cut<'_> {
    fn bad(&self, tensor: &str, reason: String) -> Error {
        Error::ImpossibleLayout {
            layout: self.layout.to_string(),
            tensor: tensor.to_string(),
            reason,
        }
    }

    /// `[start, start + len)` of an extent split evenly over the tensor-parallel ranks.
    fn even(&self, tensor: &str, extent: u64, what: &str) -> Result<(u64, u64), Error> {
        let tp = u64::from(self.tp.max(1));
        if !extent.is_multiple_of(tp) {
            return Err(self.bad(
                tensor,
                format!("{what} {extent} is not divisible by tp={tp}"),
            ));
        }
        let per = extent / tp;
        Ok((per * u64::from(self.tp_rank), per))
    }

    /// Columns `[r C/T, (r+1) C/T)` of a 2-D tensor (row parallel).
    fn columns(&self, t: &TensorSpec) -> Result<TensorBox, Error> {
        let (rows, cols) = match t.shape[..] {
            [rows, cols] => (rows, cols),
            _ => return Err(self.bad(&t.name, format!("expected 2-D, shape is {:?}", t.shape))),
        };
        let (c0, n) = self.even(&t.name, cols, "dim 1 of size")?;
        Ok(TensorBox {
            global_offset: vec![0, c0],
            local_shape: vec![rows, n],
        })
    }

    /// Rows `[r R/T, (r+1) R/T)` (column parallel).
    fn rows(&self, t: &TensorSpec) -> Result<TensorBox, Error> {
        let rows = t.shape.first().copied().unwrap_or(0);
        let (r0, n) = self.even(&t.name, rows, "dim 0 of size")?;
        Ok(rows_box(t, r0, r0 + n))
    }

    fn layer(
        &self,
        b: &mut Builder,
        prefix: &str,
        g: u64,
        layer: &Layer<'_>,
        ep: u32,
        ep_rank: u32,
    ) -> Result<(), Error> {
        let get = |suffix: &str| layer.by_suffix.get(suffix).copied();
        let need = |suffix: &str, for_param: &str| {
            get(suffix).ok_or_else(|| Error::MissingTensor {
                tensor: format!("model.layers.{g}.{suffix}"),
                reason: format!("Megatron-Core's {prefix}{for_param} needs it"),
            })
        };
        let whole = |b: &mut Builder, name: &str, t: &TensorSpec| {
            b.single(format!("{prefix}{name}"), t, TensorBox::full(&t.shape))
        };
        let norm = need(
            "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_weight",
        )?;
        whole(b, "self_attention.linear_qkv.layer_norm_weight", norm)?;
        for kind in ["weight", "bias"] {
            let q = format!("self_attn.q_proj.{kind}");
            if kind == "bias" && get(&q).is_none() {
                continue;
            }
            let param = format!("self_attention.linear_qkv.{kind}");
            let parts = [
                need(&q, &param)?,
                need(&format!("self_attn.k_proj.{kind}"), &param)?,
                need(&format!("self_attn.v_proj.{kind}"), &param)?,
            ];
            self.qkv(b, &format!("{prefix}{param}"), parts)?;
        }
        if let Some(t) = get("self_attn.q_norm.weight") {
            whole(b, "self_attention.q_layernorm.weight", t)?;
        }
        if let Some(t) = get("self_attn.k_norm.weight") {
            whole(b, "self_attention.k_layernorm.weight", t)?;
        }
        let o = need(
            "self_attn.o_proj.weight",
            "self_attention.linear_proj.weight",
        )?;
        b.single(
            format!("{prefix}self_attention.linear_proj.weight"),
            o,
            self.columns(o)?,
        )?;
        let post = need(
            "post_attention_layernorm.weight",
            "pre_mlp_layernorm.weight",
        )?;
        let Some(block) = &layer.block else {
            whole(b, "mlp.linear_fc1.layer_norm_weight", post)?;
            let fc1 = "mlp.linear_fc1.weight";
            let gate = need("mlp.gate_proj.weight", fc1)?;
            let up = need("mlp.up_proj.weight", fc1)?;
            let down = need("mlp.down_proj.weight", "mlp.linear_fc2.weight")?;
            return self.mlp(b, &format!("{prefix}mlp."), gate, up, down);
        };
        whole(b, "pre_mlp_layernorm.weight", post)?;
        let router = get("mlp.gate.weight")
            .or_else(|| get("block_sparse_moe.gate.weight"))
            .ok_or_else(|| Error::MissingTensor {
                tensor: format!("{block}.gate.weight"),
                reason: format!("Megatron-Core's {prefix}mlp.router.weight needs it"),
            })?;
        whole(b, "mlp.router.weight", router)?;
        self.experts(b, prefix, block, &layer.experts, ep, ep_rank)?;
        if let Some(gate) = get("mlp.shared_expert.gate_proj.weight") {
            let fc1 = "mlp.shared_experts.linear_fc1.weight";
            let up = need("mlp.shared_expert.up_proj.weight", fc1)?;
            let down = need(
                "mlp.shared_expert.down_proj.weight",
                "mlp.shared_experts.linear_fc2.weight",
            )?;
            self.mlp(b, &format!("{prefix}mlp.shared_experts."), gate, up, down)?;
            if let Some(t) = get("mlp.shared_expert_gate.weight") {
                whole(b, "mlp.shared_experts.gate_weight", t)?;
            }
        }
        Ok(())
    }

    /// `linear_qkv`: per query group of this rank, its q rows, then its k and v rows.
    fn qkv(&self, b: &mut Builder, name: &str, [q, k, v]: [&TensorSpec; 3]) -> Result<(), Error> {
        let m = self.model;
        let (heads, groups, d) = (m.num_heads, m.num_kv_heads, m.head_dim);
        if groups == 0 || !heads.is_multiple_of(groups) {
            return Err(self.bad(
                &q.name,
                format!("{heads} attention heads do not divide into {groups} query groups"),
            ));
        }
        let per_group = heads / groups;
        for (t, want) in [(q, heads), (k, groups), (v, groups)] {
            let rows = t.shape.first().copied().unwrap_or(0);
            if want.checked_mul(d) != Some(rows) || (t.dtype != q.dtype) {
                return Err(Error::Mismatch {
                    tensor: t.name.clone(),
                    what: "shape",
                    source_value: format!("{:?} {}", t.shape, t.dtype),
                    dest_value: format!("{want} heads x head_dim {d}, {} (config.json)", q.dtype),
                });
            }
        }
        let (g0, n) = self.even(&k.name, groups, "the query-group (kv head) count")?;
        let mut pieces = Vec::new();
        for grp in g0..g0 + n {
            let q0 = grp * per_group * d;
            pieces.push((q, rows_box(q, q0, q0 + per_group * d)));
            pieces.push((k, rows_box(k, grp * d, (grp + 1) * d)));
            pieces.push((v, rows_box(v, grp * d, (grp + 1) * d)));
        }
        b.push(name.to_string(), q.dtype, &q.shape, pieces, 0)
    }

    /// A dense (or shared-expert) MLP: `linear_fc1` = `[gate_r; up_r]`, `linear_fc2` = down's
    /// columns.
    fn mlp(
        &self,
        b: &mut Builder,
        prefix: &str,
        gate: &TensorSpec,
        up: &TensorSpec,
        down: &TensorSpec,
    ) -> Result<(), Error> {
        if gate.shape != up.shape || gate.dtype != up.dtype {
            return Err(Error::Mismatch {
                tensor: up.name.clone(),
                what: "shape",
                source_value: format!("{:?} {}", up.shape, up.dtype),
                dest_value: format!("{:?} {} (its gate, one fused fc1)", gate.shape, gate.dtype),
            });
        }
        let pieces = vec![(gate, self.rows(gate)?), (up, self.rows(up)?)];
        b.push(
            format!("{prefix}linear_fc1.weight"),
            gate.dtype,
            &gate.shape,
            pieces,
            0,
        )?;
        b.single(
            format!("{prefix}linear_fc2.weight"),
            down,
            self.columns(down)?,
        )
    }

    /// The EP rank's experts, each split by tensor parallelism as a dense MLP.
    fn experts(
        &self,
        b: &mut Builder,
        prefix: &str,
        block_name: &str,
        block: &Block<'_>,
        ep: u32,
        ep_rank: u32,
    ) -> Result<(), Error> {
        let moe = self.model.moe.as_ref().ok_or_else(|| {
            self.bad(
                block_name,
                "expert tensors in a model without MoE config".into(),
            )
        })?;
        let tensor = format!("{block_name}.experts");
        let ep = u64::from(ep.max(1));
        if !moe.num_experts.is_multiple_of(ep) {
            return Err(self.bad(
                &tensor,
                format!(
                    "{} experts are not divisible by ep={ep} (Megatron-Core needs an equal count per rank)",
                    moe.num_experts
                ),
            ));
        }
        let per_rank = moe.num_experts / ep;
        let (row0, rows) = self.even(&tensor, moe.intermediate, "the expert intermediate size")?;
        let slice = Slice {
            first: u64::from(ep_rank) * per_rank,
            count: per_rank,
            rows,
            row0,
        };
        let [w13, w2] = crate::moe::block_pieces(moe, block_name, block, slice)?;
        let dtype = w13
            .first()
            .map(|(t, _)| t.dtype)
            .ok_or_else(|| self.bad(&tensor, "no experts on this rank".into()))?;
        let rows2 = rows
            .checked_mul(2)
            .ok_or_else(|| self.bad(&tensor, "intermediate size overflows".into()))?;
        let mut fc1 = w13.into_iter();
        for (k, down) in w2.into_iter().enumerate() {
            let (Some(gate), Some(up)) = (fc1.next(), fc1.next()) else {
                return Err(self.bad(&tensor, "gate and up pieces out of step".into()));
            };
            let local = format!("{prefix}mlp.experts.local_experts.{k}.");
            b.stacked(
                format!("{local}linear_fc1.weight"),
                dtype,
                vec![rows2, moe.hidden],
                vec![gate, up],
            )?;
            b.stacked(
                format!("{local}linear_fc2.weight"),
                dtype,
                vec![moe.hidden, rows],
                vec![down],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "megatron_tests.rs"]
mod tests;
