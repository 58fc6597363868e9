//! Frontier-scale MoE models (the DeepSeek-V3 architecture: MLA attention, one shared expert and
//! many routed experts per MoE layer) described by shape only, with the layouts a large RL fleet
//! uses for them, for planner benchmarks: no bytes exist, manifests are synthetic
//! ([`crate::plan::synthetic_manifest`]).
//!
//! - Trainer ([`FrontierModel::trainer_layouts`], label `fsdp:WORLD`): torchtitan FSDP2 + expert
//!   parallelism. Every non-expert tensor is an FSDP2 dim-0 shard over all ranks (torch.chunk
//!   semantics, [`crate::model::fsdp_rows`]); routed experts are split over `ep` groups, group
//!   `g = rank % ep` holding experts `[g*E/ep, (g+1)*E/ep)`, each of those FSDP dim-0 sharded over
//!   the `world/ep` ranks of the group (`g, g+ep, g+2ep, ...`: torchtitan's `dp_shard_in_ep`).
//! - Inference ([`FrontierModel::inference_layouts`], label `tp:TP`): vLLM's DeepSeek-V2/V3
//!   model (`DeepseekV2MLAAttention`, `DeepseekV2MoE` with `FusedMoE`): `q_a_proj`,
//!   `kv_a_proj_with_mqa`, every layernorm, the router `gate` and its `e_score_correction_bias`
//!   replicated (`ReplicatedLinear`); `q_b_proj`, `kv_b_proj`, dense-MLP and shared-expert
//!   `gate_proj`/`up_proj` column parallel (dim 0 split by tp); `o_proj` and the `down_proj`s
//!   row parallel (dim 1); routed experts expert parallel (rank `r` holds experts
//!   `[r*E/ep, (r+1)*E/ep)` whole) or, with `ep = 1`, tensor parallel like the shared expert;
//!   `embed_tokens` and `lm_head` vocab parallel (dim 0 split evenly). Each checkpoint tensor is
//!   its own parameter here ([`RankLayout::from_boxes`]); vLLM fuses `gate_proj`/`up_proj` into
//!   `gate_up_proj`, the experts into `w13`/`w2` and (in recent versions) `q_a_proj` with
//!   `kv_a_proj_with_mqa`, which changes where bytes land in the live buffer but not which bytes
//!   are planned, pulled and verified.

use std::collections::HashMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::model::fsdp_rows;
use crate::plan::{synthetic_manifest, CostModel, SourceIndex};
use crate::{DType, Error, LayoutSpec, RankLayout, Scheme, SourceManifest, TensorBox, TensorSpec};

/// The shape of a DeepSeek-V3-architecture model (fields named after its HF `config.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrontierModel {
    /// Model name for reports.
    pub name: String,
    /// `hidden_size`.
    pub hidden: u64,
    /// `num_hidden_layers` (transformer layers; multi-token-prediction layers are not included).
    pub layers: u64,
    /// `first_k_dense_replace`: layers `0..first_k_dense` have a dense MLP, the rest are MoE.
    pub first_k_dense: u64,
    /// `intermediate_size` of the dense MLP.
    pub intermediate: u64,
    /// `moe_intermediate_size`, per expert.
    pub moe_intermediate: u64,
    /// `n_routed_experts` per MoE layer.
    pub n_routed_experts: u64,
    /// `n_shared_experts` per MoE layer (fused into one shared MLP of `moe_intermediate * n`).
    pub n_shared_experts: u64,
    /// `num_attention_heads`.
    pub heads: u64,
    /// `q_lora_rank`.
    pub q_lora_rank: u64,
    /// `kv_lora_rank`.
    pub kv_lora_rank: u64,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: u64,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: u64,
    /// `v_head_dim`.
    pub v_head_dim: u64,
    /// `vocab_size`.
    pub vocab: u64,
}

/// The trainer a frontier fleet refits from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontierTrainer {
    /// torchtitan FSDP2 over `world` ranks with `ep`-way expert parallelism
    /// ([`FrontierModel::trainer_layouts`]).
    Fsdp {
        /// Ranks.
        world: u32,
        /// Expert-parallel groups.
        ep: u32,
    },
    /// Megatron-Core ([`FrontierModel::megatron_layouts`]).
    Megatron {
        /// Tensor-parallel size.
        tp: u32,
        /// Pipeline stages.
        pp: u32,
        /// Expert-parallel size.
        ep: u32,
    },
}

impl FrontierTrainer {
    /// Every rank's layout for `model`.
    ///
    /// # Errors
    /// As [`FrontierModel::trainer_layouts`] or [`FrontierModel::megatron_layouts`].
    pub fn layouts(self, model: &FrontierModel) -> Result<Vec<RankLayout>, Error> {
        match self {
            FrontierTrainer::Fsdp { world, ep } => model.trainer_layouts(world, ep),
            FrontierTrainer::Megatron { tp, pp, ep } => model.megatron_layouts(tp, pp, ep),
        }
    }
}

impl std::fmt::Display for FrontierTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrontierTrainer::Fsdp { world, ep } => write!(f, "fsdp:{world} ep={ep}"),
            FrontierTrainer::Megatron { tp, pp, ep } => {
                write!(f, "megatron:tp={tp},pp={pp},ep={ep}")
            }
        }
    }
}

/// How a tensor is placed under vLLM tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Replicated,
    Column,
    Row,
    Vocab,
    /// Routed expert `expert`; `down` for `down_proj` (row-like), else gate/up (column-like).
    Expert {
        expert: u64,
        down: bool,
    },
}

/// One checkpoint tensor with its placement and whether an FP8 checkpoint quantizes it.
struct Entry {
    spec: TensorSpec,
    kind: Kind,
    fp8: bool,
}

fn impossible(layout: LayoutSpec, tensor: &str, reason: String) -> Error {
    Error::ImpossibleLayout {
        layout: layout.to_string(),
        tensor: tensor.to_string(),
        reason,
    }
}

fn rows_box(shape: &[u64], start: u64, end: u64) -> TensorBox {
    let mut b = TensorBox::full(shape);
    if let (Some(o), Some(s)) = (b.global_offset.first_mut(), b.local_shape.first_mut()) {
        *o = start;
        *s = end.saturating_sub(start);
    }
    b
}

/// The box of `t` that rank `rank` of `n` holds when dim `dim` is split evenly.
fn split_even(
    layout: LayoutSpec,
    t: &TensorSpec,
    dim: usize,
    rank: u32,
    n: u32,
) -> Result<TensorBox, Error> {
    let n = u64::from(n);
    let Some(&extent) = t.shape.get(dim) else {
        return Err(impossible(
            layout,
            &t.name,
            format!("needs a dim {dim} to split, shape is {:?}", t.shape),
        ));
    };
    if n == 0 || extent % n != 0 {
        return Err(impossible(
            layout,
            &t.name,
            format!("dim {dim} of size {extent} is not divisible by tp={n}"),
        ));
    }
    let per = extent / n;
    let mut b = TensorBox::full(&t.shape);
    b.global_offset[dim] = per * u64::from(rank);
    b.local_shape[dim] = per;
    Ok(b)
}

fn check_world(layout: LayoutSpec, what: &str) -> Result<(), Error> {
    if layout.world_size == 0 || layout.world_size > LayoutSpec::MAX_WORLD_SIZE {
        return Err(impossible(
            layout,
            "*",
            format!(
                "field `{what}`: must be between 1 and {}",
                LayoutSpec::MAX_WORLD_SIZE
            ),
        ));
    }
    Ok(())
}

impl FrontierModel {
    /// DeepSeek-V3 (671B) from its published `config.json`: 61 layers, the first 3 dense, 256
    /// routed experts and 1 shared expert per MoE layer, 128 heads, vocab 129280. The
    /// multi-token-prediction layer (`model.layers.61`, ~11.5B parameters in the checkpoint) is
    /// left out: it is not part of the policy served for generation.
    pub fn deepseek_v3() -> FrontierModel {
        FrontierModel {
            name: "DeepSeek-V3".into(),
            hidden: 7168,
            layers: 61,
            first_k_dense: 3,
            intermediate: 18432,
            moe_intermediate: 2048,
            n_routed_experts: 256,
            n_shared_experts: 1,
            heads: 128,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            vocab: 129280,
        }
    }

    /// Kimi-K2 (1.04T) from its published `config.json`: 61 layers, the first dense, 384 routed
    /// experts and 1 shared expert per MoE layer, 64 heads, vocab 163840.
    pub fn kimi_k2() -> FrontierModel {
        FrontierModel {
            name: "Kimi-K2".into(),
            hidden: 7168,
            layers: 61,
            first_k_dense: 1,
            intermediate: 18432,
            moe_intermediate: 2048,
            n_routed_experts: 384,
            n_shared_experts: 1,
            heads: 64,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            vocab: 163840,
        }
    }

    /// The first routed-expert tensor's name (`*` without experts): where an expert-parallel
    /// error points.
    fn first_expert(entries: &[Entry]) -> &str {
        entries
            .iter()
            .find(|e| matches!(e.kind, Kind::Expert { .. }))
            .map_or("*", |e| e.spec.name.as_str())
    }

    /// `ep` divides the routed experts, or an error naming the first expert tensor.
    fn check_experts_divide(
        &self,
        layout: LayoutSpec,
        entries: &[Entry],
        ep: u32,
    ) -> Result<(), Error> {
        if self.n_routed_experts.is_multiple_of(u64::from(ep)) {
            return Ok(());
        }
        Err(impossible(
            layout,
            Self::first_expert(entries),
            format!(
                "field `n_routed_experts`: {} experts are not divisible by ep={ep}",
                self.n_routed_experts
            ),
        ))
    }

    fn entries(&self) -> Vec<Entry> {
        let bf16 = DType::BF16;
        let h = self.hidden;
        let mut out = Vec::new();
        let mut add = |name: String, shape: Vec<u64>, dtype: DType, kind: Kind| {
            let fp8 = shape.len() == 2 && kind != Kind::Vocab && !name.ends_with("mlp.gate.weight");
            out.push(Entry {
                spec: TensorSpec { name, dtype, shape },
                kind,
                fp8,
            });
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
            bf16,
            Kind::Vocab,
        );
        let qk = self.qk_nope_head_dim + self.qk_rope_head_dim;
        for i in 0..self.layers {
            let l = format!("model.layers.{i}");
            let a = format!("{l}.self_attn");
            add(
                format!("{l}.input_layernorm.weight"),
                vec![h],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{a}.q_a_proj.weight"),
                vec![self.q_lora_rank, h],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{a}.q_a_layernorm.weight"),
                vec![self.q_lora_rank],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{a}.q_b_proj.weight"),
                vec![self.heads * qk, self.q_lora_rank],
                bf16,
                Kind::Column,
            );
            add(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![self.kv_lora_rank + self.qk_rope_head_dim, h],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{a}.kv_a_layernorm.weight"),
                vec![self.kv_lora_rank],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{a}.kv_b_proj.weight"),
                vec![
                    self.heads * (self.qk_nope_head_dim + self.v_head_dim),
                    self.kv_lora_rank,
                ],
                bf16,
                Kind::Column,
            );
            add(
                format!("{a}.o_proj.weight"),
                vec![h, self.heads * self.v_head_dim],
                bf16,
                Kind::Row,
            );
            add(
                format!("{l}.post_attention_layernorm.weight"),
                vec![h],
                bf16,
                Kind::Replicated,
            );
            let m = format!("{l}.mlp");
            if i < self.first_k_dense {
                let inter = self.intermediate;
                add(
                    format!("{m}.gate_proj.weight"),
                    vec![inter, h],
                    bf16,
                    Kind::Column,
                );
                add(
                    format!("{m}.up_proj.weight"),
                    vec![inter, h],
                    bf16,
                    Kind::Column,
                );
                add(
                    format!("{m}.down_proj.weight"),
                    vec![h, inter],
                    bf16,
                    Kind::Row,
                );
                continue;
            }
            let e = self.n_routed_experts;
            add(
                format!("{m}.gate.weight"),
                vec![e, h],
                bf16,
                Kind::Replicated,
            );
            add(
                format!("{m}.gate.e_score_correction_bias"),
                vec![e],
                DType::F32,
                Kind::Replicated,
            );
            let shared = self.moe_intermediate * self.n_shared_experts;
            if shared > 0 {
                add(
                    format!("{m}.shared_experts.gate_proj.weight"),
                    vec![shared, h],
                    bf16,
                    Kind::Column,
                );
                add(
                    format!("{m}.shared_experts.up_proj.weight"),
                    vec![shared, h],
                    bf16,
                    Kind::Column,
                );
                add(
                    format!("{m}.shared_experts.down_proj.weight"),
                    vec![h, shared],
                    bf16,
                    Kind::Row,
                );
            }
            let mi = self.moe_intermediate;
            for x in 0..e {
                let gu = Kind::Expert {
                    expert: x,
                    down: false,
                };
                add(
                    format!("{m}.experts.{x}.gate_proj.weight"),
                    vec![mi, h],
                    bf16,
                    gu,
                );
                add(
                    format!("{m}.experts.{x}.up_proj.weight"),
                    vec![mi, h],
                    bf16,
                    gu,
                );
                add(
                    format!("{m}.experts.{x}.down_proj.weight"),
                    vec![h, mi],
                    bf16,
                    Kind::Expert {
                        expert: x,
                        down: true,
                    },
                );
            }
        }
        add("model.norm.weight".into(), vec![h], bf16, Kind::Replicated);
        add(
            "lm_head.weight".into(),
            vec![self.vocab, h],
            bf16,
            Kind::Vocab,
        );
        out
    }

    /// Every checkpoint tensor (HF names, BF16 except the router's `e_score_correction_bias`,
    /// which is F32 as in the released checkpoint), in checkpoint order: `model.embed_tokens`,
    /// then per layer the attention, norms and MLP (dense for `i < first_k_dense`, else router,
    /// shared experts and routed experts `0..n_routed_experts`), then `model.norm` and `lm_head`.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        self.entries().into_iter().map(|e| e.spec).collect()
    }

    /// Total parameter count (elements) of [`FrontierModel::tensors`].
    pub fn param_count(&self) -> u64 {
        self.entries()
            .iter()
            .map(|e| e.spec.shape.iter().product::<u64>())
            .sum()
    }

    /// Total bytes of [`FrontierModel::tensors`] in their dtypes.
    pub fn bytes(&self) -> u64 {
        self.entries()
            .iter()
            .map(|e| e.spec.shape.iter().product::<u64>() * e.spec.dtype.size_bytes())
            .sum()
    }

    /// The trainer's layout over `world` ranks (label `fsdp:world`) with `ep`-way expert
    /// parallelism (see the module doc): non-expert tensors FSDP dim-0 over all ranks, routed
    /// experts of group `rank % ep` FSDP dim-0 over the `world / ep` ranks of the group. Empty
    /// shards are omitted.
    ///
    /// # Errors
    /// [`Error::ImpossibleLayout`] naming the field when `world` is 0 or over 65536, `ep` is 0,
    /// `ep` does not divide `world` or `n_routed_experts`; [`Error::Overflow`] on sizes.
    pub fn trainer_layouts(&self, world: u32, ep: u32) -> Result<Vec<RankLayout>, Error> {
        let layout = LayoutSpec {
            scheme: Scheme::Fsdp,
            world_size: world,
        };
        check_world(layout, "world")?;
        let entries = self.entries();
        let first_expert = Self::first_expert(&entries);
        if ep == 0 || !world.is_multiple_of(ep) {
            return Err(impossible(
                layout,
                first_expert,
                format!("field `ep`: ep={ep} does not divide the world size {world}"),
            ));
        }
        self.check_experts_divide(layout, &entries, ep)?;
        let per_group = self.n_routed_experts / u64::from(ep);
        let dp_in_ep = world / ep;
        (0..world)
            .map(|r| {
                let group = u64::from(r % ep);
                let j = r / ep;
                let mut boxes = Vec::new();
                for e in &entries {
                    let rows = e.spec.shape.first().copied().unwrap_or(1);
                    let (s, end) = match e.kind {
                        Kind::Expert { expert, .. } => {
                            if expert / per_group != group {
                                continue;
                            }
                            fsdp_rows(rows, j, dp_in_ep)
                        }
                        _ => fsdp_rows(rows, r, world),
                    };
                    if end > s {
                        boxes.push((e.spec.clone(), rows_box(&e.spec.shape, s, end)));
                    }
                }
                RankLayout::from_boxes(layout, r, &boxes)
            })
            .collect()
    }

    /// A Megatron-Core trainer's layout, `megatron:tp=T,pp=P,ep=E` ([`crate::megatron`]'s rank
    /// order and rules, each checkpoint tensor its own parameter as everywhere in this module):
    /// stage `s` holds layers `[s L / P, (s+1) L / P)` (integer division: DeepSeek-V3's 61 layers
    /// do not divide, so stages differ by one layer, as Megatron-Core's uneven first and last
    /// stages allow), the embedding on stage 0 and the final norm and `lm_head` on the last;
    /// MLA's `q_a_proj`/`kv_a_proj_with_mqa` and their norms replicated (Megatron-Core builds
    /// them duplicated), `q_b_proj`/`kv_b_proj`, dense and shared-expert `gate_proj`/`up_proj`
    /// split along dim 0 and `o_proj`/`down_proj`s along dim 1 over the tensor-parallel ranks;
    /// embedding and `lm_head` vocab parallel (padded to 128 x tp); EP rank `s` holding
    /// routed experts `[s E/ep, (s+1) E/ep)`, each split over the tensor-parallel ranks (expert
    /// tensor parallel = tp); the router and its bias replicated.
    ///
    /// # Errors
    /// [`Error::BadLayoutSpec`] for sizes of 0 or a world over 65536; [`Error::ImpossibleLayout`]
    /// naming the tensor when `pp` exceeds the layers, `ep` does not divide the experts or `tp` a
    /// split dim.
    pub fn megatron_layouts(&self, tp: u32, pp: u32, ep: u32) -> Result<Vec<RankLayout>, Error> {
        let layout = LayoutSpec::megatron(tp, pp, ep)?;
        let entries = self.entries();
        self.check_experts_divide(layout, &entries, ep)?;
        if u64::from(pp) > self.layers {
            return Err(impossible(
                layout,
                "model.layers",
                format!("pp={pp} stages over {} layers", self.layers),
            ));
        }
        let per_rank = self.n_routed_experts / u64::from(ep);
        let dims = match layout.scheme {
            Scheme::Megatron(d) => d,
            _ => unreachable!("LayoutSpec::megatron builds a Megatron layout"),
        };
        // Each entry's stage, once: layer l is on the last stage s with s L / P <= l.
        let (layers, stages) = (self.layers, u64::from(pp));
        let stage_of: Vec<u32> = entries
            .iter()
            .map(|e| {
                let layer = e
                    .spec
                    .name
                    .strip_prefix("model.layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|n| n.parse::<u64>().ok());
                match layer {
                    Some(l) => (0..stages)
                        .rev()
                        .find(|&s| s * layers / stages <= l)
                        .unwrap_or(0),
                    None if e.spec.name == "model.embed_tokens.weight" => 0,
                    None => stages - 1,
                }
            })
            .map(|s| u32::try_from(s).unwrap_or(0))
            .collect();
        (0..layout.world_size)
            .map(|rank| {
                let (r, stage, e_rank) = dims.coords(rank);
                let mut boxes = Vec::new();
                for (e, &s) in entries.iter().zip(&stage_of) {
                    let t = &e.spec;
                    if s != stage {
                        continue;
                    }
                    let bx = match e.kind {
                        Kind::Replicated => TensorBox::full(&t.shape),
                        Kind::Column => split_even(layout, t, 0, r, tp)?,
                        Kind::Row => split_even(layout, t, 1, r, tp)?,
                        Kind::Vocab => {
                            let vocab = t.shape.first().copied().unwrap_or(0);
                            let padded =
                                crate::megatron::padded_vocab(vocab, tp).ok_or_else(|| {
                                    impossible(layout, &t.name, "vocab overflows".into())
                                })?;
                            let per = padded / u64::from(tp);
                            let start = (per * u64::from(r)).min(vocab);
                            let end = (per * (u64::from(r) + 1)).min(vocab);
                            if end == start {
                                continue;
                            }
                            rows_box(&t.shape, start, end)
                        }
                        Kind::Expert { expert, down } => {
                            if expert / per_rank != u64::from(e_rank) {
                                continue;
                            }
                            split_even(layout, t, usize::from(down), r, tp)?
                        }
                    };
                    boxes.push((t.clone(), bx));
                }
                RankLayout::from_boxes(layout, rank, &boxes)
            })
            .collect()
    }

    /// One inference instance's layout over `tp` ranks (label `tp:tp`), vLLM conventions (see the
    /// module doc), routed experts expert parallel when `ep == tp` (rank `r` holds experts
    /// `[r*E/ep, (r+1)*E/ep)` whole) or tensor parallel when `ep == 1`. The vocab must be a
    /// multiple of 64 (no vLLM padding rows) and divisible by `tp`.
    ///
    /// # Errors
    /// [`Error::ImpossibleLayout`] naming the tensor or field when `tp` is 0 or over 65536, `ep`
    /// is neither 1 nor `tp` (vLLM's expert parallel size is tp x dp, and dp = 1 here), `ep`
    /// does not divide `n_routed_experts`, or tp does not divide a split dim or the vocab.
    pub fn inference_layouts(&self, tp: u32, ep: u32) -> Result<Vec<RankLayout>, Error> {
        let layout = LayoutSpec {
            scheme: Scheme::VllmTp,
            world_size: tp,
        };
        check_world(layout, "tp")?;
        let entries = self.entries();
        let first_expert = Self::first_expert(&entries);
        if ep != 1 && ep != tp {
            return Err(impossible(
                layout,
                first_expert,
                format!("field `ep`: ep={ep} must be 1 (tensor-parallel experts) or tp={tp}"),
            ));
        }
        self.check_experts_divide(layout, &entries, ep)?;
        let per_rank = self.n_routed_experts / u64::from(ep);
        (0..tp)
            .map(|r| {
                let mut boxes = Vec::with_capacity(entries.len());
                for e in &entries {
                    let t = &e.spec;
                    let bx = match e.kind {
                        Kind::Replicated => TensorBox::full(&t.shape),
                        Kind::Column => split_even(layout, t, 0, r, tp)?,
                        Kind::Row => split_even(layout, t, 1, r, tp)?,
                        Kind::Vocab => {
                            let vocab = t.shape.first().copied().unwrap_or(0);
                            if vocab % 64 != 0 {
                                return Err(impossible(
                                    layout,
                                    &t.name,
                                    format!(
                                        "field `vocab`: {vocab} is not a multiple of 64 (vLLM would pad it)"
                                    ),
                                ));
                            }
                            split_even(layout, t, 0, r, tp)?
                        }
                        Kind::Expert { expert, down } => {
                            if ep > 1 {
                                if expert / per_rank != u64::from(r) {
                                    continue;
                                }
                                TensorBox::full(&t.shape)
                            } else {
                                split_even(layout, t, usize::from(down), r, tp)?
                            }
                        }
                    };
                    boxes.push((t.clone(), bx));
                }
                RankLayout::from_boxes(layout, r, &boxes)
            })
            .collect()
    }

    /// The manifest every trainer rank of `trainer` would publish for the destination layout
    /// `dest` (all ranks of one inference instance): [`synthetic_manifest`] per rank, addresses
    /// synthetic (`(rank + 1) << 40`), digests zero, nothing packed.
    ///
    /// # Errors
    /// [`Error::Overflow`] when a synthetic address or size overflows.
    pub fn manifests(
        &self,
        trainer: &[RankLayout],
        dest: &[RankLayout],
    ) -> Result<Vec<SourceManifest>, Error> {
        trainer
            .iter()
            .map(|rl| synthetic_manifest(rl, dest, &[]))
            .collect()
    }

    /// Whether an FP8 checkpoint stores each tensor as FP8 with 128x128 block scales (every 2-D
    /// linear weight except `embed_tokens`, `lm_head` and the router `gate`), and its dtype size.
    fn fp8_table(&self) -> HashMap<String, (bool, u64)> {
        self.entries()
            .into_iter()
            .map(|e| (e.spec.name, (e.fp8, e.spec.dtype.size_bytes())))
            .collect()
    }
}

/// Bytes of `region` of a tensor as an FP8 block-quantized checkpoint would hold it: 1 byte per
/// element plus one F32 scale per 128x128 block of the region's own shape, when `fp8`; else
/// `elem` bytes per element.
fn fp8_bytes(region: &TensorBox, fp8: bool, elem: u64) -> u64 {
    let n = region.numel().unwrap_or(0);
    if !fp8 || region.ndim() != 2 {
        return n.saturating_mul(elem);
    }
    let blocks = region.local_shape[0].div_ceil(128) * region.local_shape[1].div_ceil(128);
    n.saturating_add(blocks.saturating_mul(4))
}

/// Bytes a source sends in FP8 for the region at `offset` with extent `shape` (elements): 1 byte
/// per element plus the F32 scale of every 128x128 block of the global tensor the region touches
/// (a block split between sources is sent by each of them); `elem` bytes per element when not
/// `fp8`.
fn fp8_source_bytes(offset: &[u64], shape: &[u64], fp8: bool, elem: u64) -> u64 {
    let n = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .unwrap_or(0);
    if !fp8 || shape.len() != 2 || offset.len() != 2 {
        return n.saturating_mul(elem);
    }
    let touched = |d: usize| (offset[d] + shape[d]).div_ceil(128) - offset[d] / 128;
    n.saturating_add((touched(0) * touched(1)).saturating_mul(4))
}

/// One destination rank's plan in a [`FleetPlanReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPlanReport {
    /// Rank within the inference instance.
    pub rank: u32,
    /// Wall time of [`SourceIndex::plan`] for this rank alone, on the calling thread (ms).
    pub plan_ms: f64,
    /// Coalesced READ descriptors.
    pub reads: u64,
    /// Apply copies.
    pub copies: u64,
    /// Digest checks.
    pub verify_items: u64,
    /// (tensor, source shard) strategy choices.
    pub choices: u64,
    /// Bytes on the wire in BF16 (the plan's `wire_bytes`; superset spans included).
    pub wire_bytes_bf16: u64,
    /// Live bytes of the rank in BF16 (the plan's `useful_bytes`).
    pub bytes_bf16: u64,
    /// The rank's bytes if the weights were FP8 with 128x128 block scales (see
    /// [`fleet_plan_report`]).
    pub bytes_fp8: u64,
    /// The cost model's prediction for the reads (seconds).
    pub predicted_seconds: f64,
    /// Bytes of the plan's items in memory ([`crate::plan::Plan::approx_bytes`]).
    #[serde(default)]
    pub plan_bytes: u64,
}

/// Plan time, plan size and traffic of refitting a fleet of identical inference instances from
/// one trainer; see [`fleet_plan_report`]. Times in seconds unless named `_ms`, sizes in bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetPlanReport {
    /// Model name.
    pub model: String,
    /// Parameters (elements).
    pub params: u64,
    /// Checkpoint tensors.
    pub tensors: u64,
    /// Model bytes (BF16, the router bias F32).
    pub model_bytes: u64,
    /// Trainer layout, e.g. `fsdp:256 ep=64`.
    pub trainer: String,
    /// Inference layout of one instance, e.g. `tp:8 ep=8`.
    pub inference: String,
    /// Number of identical inference instances.
    pub instances: u32,
    /// The cost model the plans were made under.
    pub cost_model: CostModel,
    /// Building the trainer and inference rank layouts (s).
    pub layouts_seconds: f64,
    /// Synthesizing every trainer rank's manifest, cuts included (s).
    pub manifest_seconds: f64,
    /// Building the [`SourceIndex`] (s).
    pub index_seconds: f64,
    /// [`crate::geometry_digest`] over every manifest (s): what a worker spends per version
    /// instead of the index build and its plan when the trainer publishes from the same arenas
    /// and it keeps its plan (`mx worker` does).
    #[serde(default)]
    pub geometry_seconds: f64,
    /// [`SourceIndex::for_ranks`] for the slowest rank alone (s): the index a worker holding
    /// that rank builds at its first stage (`mx_layout::plan::plan` builds it).
    #[serde(default)]
    pub own_rank_index_seconds: f64,
    /// Source shards over all manifests.
    pub shards: u64,
    /// Published pieces over all manifests.
    pub pieces: u64,
    /// Estimated bytes of the manifests in memory (structs plus heap).
    pub manifest_bytes_estimate: u64,
    /// Estimated bytes of the index (see [`SourceIndex::approx_bytes`]).
    pub index_bytes_estimate: u64,
    /// Per destination rank of one instance.
    pub ranks: Vec<RankPlanReport>,
    /// The slowest rank to plan.
    pub slowest_rank: u32,
    /// Its plan time (ms).
    pub slowest_rank_ms: f64,
    /// Bytes of the slowest rank's plan's items in memory.
    #[serde(default)]
    pub slowest_rank_plan_bytes: u64,
    /// Writing that many bytes of freshly allocated memory once, on the same thread in the same
    /// run (ms, median of three): the part of a plan's time that is the kernel backing new
    /// pages (page faults, zeroing), which no planner change short of a smaller plan removes.
    #[serde(default)]
    pub slowest_rank_fresh_memory_ms: f64,
    /// Median plan time over the ranks of one instance (ms).
    pub median_rank_ms: f64,
    /// Index build plus one plan per distinct rank (the instances share layouts) (s).
    pub whole_fleet_seconds: f64,
    /// Index build plus `instances` times the plans of one instance, i.e. every rank of the
    /// fleet planned separately on one core (s).
    pub projected_all_ranks_seconds: f64,
    /// Largest and total (one instance) READ descriptors.
    pub max_reads: u64,
    /// Total READ descriptors of one instance.
    pub total_reads: u64,
    /// Largest apply-copy count of a rank.
    pub max_copies: u64,
    /// Total apply copies of one instance.
    pub total_copies: u64,
    /// Largest digest-check count of a rank.
    pub max_verify_items: u64,
    /// Total digest checks of one instance.
    pub total_verify_items: u64,
    /// Largest per-rank live bytes, BF16.
    pub max_rank_bytes_bf16: u64,
    /// Largest per-rank bytes, FP8 with block scales.
    pub max_rank_bytes_fp8: u64,
    /// Bytes every instance pulls, BF16 (wire).
    pub instance_wire_bytes_bf16: u64,
    /// Bytes every instance pulls, FP8.
    pub instance_bytes_fp8: u64,
    /// The trainer rank sending the most to the whole fleet (BF16 wire bytes).
    pub max_egress_trainer_rank: u32,
    /// Its egress to all instances, BF16 wire bytes (superset spans included).
    pub max_trainer_egress_wire_bf16: u64,
    /// Largest trainer-rank egress to all instances, BF16 bytes of the regions pulled.
    pub max_trainer_egress_bf16: u64,
    /// Largest trainer-rank egress to all instances if the weights were FP8 with block scales.
    pub max_trainer_egress_fp8: u64,
}

/// Median wall time (ms) of three rounds of allocating `bytes` and writing every byte once
/// (each round's memory is new to the process: an allocation that large is mapped on demand and
/// unmapped when freed), on the calling thread. 0 for 0 bytes.
fn fresh_memory_ms(bytes: u64) -> f64 {
    let Ok(n) = usize::try_from(bytes) else {
        return 0.0;
    };
    if n == 0 {
        return 0.0;
    }
    let mut t: Vec<f64> = (0..3)
        .map(|_| {
            let t0 = Instant::now();
            let v = vec![1u8; n];
            std::hint::black_box(&v);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            drop(v);
            ms
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[1]
}

/// Measures planning a refit of `instances` identical inference instances (vLLM `tp:tp` with
/// `ep_inf`-way expert parallelism) from `trainer` (torchtitan FSDP2 + EP, or Megatron-Core
/// tp x pp x ep), for `model`, under [`CostModel::default`], on the calling thread
/// ([`std::time::Instant`] wall time, so run it on an otherwise idle core).
///
/// What is measured: building the layouts; synthesizing every trainer rank's manifest
/// ([`FrontierModel::manifests`]: cuts for the inference layout, no packing); building the
/// [`SourceIndex`] once; then one [`SourceIndex::plan`] per rank of one instance, each rank
/// planned alone (a GPU's process plans and pulls its own rank). The instances have identical
/// layouts, so one instance's plans stand for all: `whole_fleet_seconds` = index + the sum over
/// the `tp` distinct ranks; `projected_all_ranks_seconds` = index + `instances` x that sum.
///
/// Traffic assumptions: BF16 bytes are the plans' (wire bytes include superset over-fetch,
/// useful bytes do not). FP8 bytes: every 2-D linear weight except `embed_tokens`, `lm_head`
/// and the router `gate` is 1 byte per element plus an F32 scale per 128x128 block
/// (`ceil(rows/128) * ceil(cols/128) * 4` bytes of the destination's part); other tensors keep
/// their dtype (BF16; the router bias F32). A trainer rank's egress is what all `instances`
/// pull from it (each rank of each instance planned alone); its FP8 egress counts the scales of
/// every 128x128 block its regions touch. Memory: estimated struct and heap bytes of the
/// manifests and of the index (process peak RSS is not read here; the crate does no I/O).
///
/// # Errors
/// The errors of [`FrontierModel::trainer_layouts`], [`FrontierModel::inference_layouts`],
/// [`FrontierModel::manifests`], [`SourceIndex::new`] and [`SourceIndex::plan`];
/// [`Error::ImpossibleLayout`] when `instances` is 0.
pub fn fleet_plan_report(
    model: &FrontierModel,
    trainer: FrontierTrainer,
    tp: u32,
    ep_inf: u32,
    instances: u32,
) -> Result<FleetPlanReport, Error> {
    if instances == 0 {
        return Err(Error::ImpossibleLayout {
            layout: format!("tp:{tp}"),
            tensor: "*".into(),
            reason: "field `instances`: must be at least 1".into(),
        });
    }
    let cost = CostModel::default();
    let t0 = Instant::now();
    let trainer_label = trainer.to_string();
    let trainer = trainer.layouts(model)?;
    let dest = model.inference_layouts(tp, ep_inf)?;
    let layouts_seconds = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let manifests = model.manifests(&trainer, &dest)?;
    let manifest_seconds = t0.elapsed().as_secs_f64();
    drop(trainer);
    let t0 = Instant::now();
    let index = SourceIndex::new(&manifests)?;
    let index_seconds = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    std::hint::black_box(crate::geometry_digest(&manifests));
    let geometry_seconds = t0.elapsed().as_secs_f64();

    let table = model.fp8_table();
    let lookup = |name: &str| table.get(name).copied().unwrap_or((false, 2));
    let mut ranks = Vec::with_capacity(dest.len());
    // Per trainer rank: (wire bf16, region bf16, region fp8) pulled by one instance.
    let mut egress = vec![[0u64; 3]; manifests.len()];
    // Plans are kept until every rank is planned, so freeing one plan does not land in the
    // next one's time.
    let mut plans = Vec::with_capacity(dest.len());
    for rl in &dest {
        let t0 = Instant::now();
        let p = index.plan(std::slice::from_ref(rl), &cost)?;
        let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
        plans.push(p);
        let Some(p) = plans.last() else {
            continue;
        };
        for r in &p.reads {
            if let Some(e) = egress.get_mut(r.source) {
                e[0] = e[0].saturating_add(r.len);
            }
        }
        for v in &p.verify {
            let (fp8, elem) = lookup(p.tensor_name(v.tensor));
            let region = v.published(&manifests).map(|d| &d.region);
            if let (Some(e), Some(region)) = (egress.get_mut(v.source), region) {
                let n = region.numel().unwrap_or(0).saturating_mul(elem);
                e[1] = e[1].saturating_add(n);
                e[2] = e[2].saturating_add(fp8_source_bytes(
                    &region.global_offset,
                    &region.local_shape,
                    fp8,
                    elem,
                ));
            }
        }
        let bytes_fp8 = rl
            .params
            .iter()
            .flat_map(|p| &p.pieces)
            .map(|piece| {
                let (fp8, elem) = lookup(&piece.tensor);
                fp8_bytes(&piece.region, fp8, elem)
            })
            .sum();
        ranks.push(RankPlanReport {
            rank: rl.rank,
            plan_ms,
            reads: p.reads.len() as u64,
            copies: p.copies.len() as u64,
            verify_items: p.verify.len() as u64,
            choices: p.choices.len() as u64,
            wire_bytes_bf16: p.wire_bytes,
            bytes_bf16: p.useful_bytes,
            bytes_fp8,
            predicted_seconds: p.predicted_seconds,
            plan_bytes: p.approx_bytes(),
        });
    }

    drop(plans);
    let mut times: Vec<f64> = ranks.iter().map(|r| r.plan_ms).collect();
    times.sort_by(f64::total_cmp);
    let median_rank_ms = match times.len() {
        0 => 0.0,
        n if n % 2 == 1 => times[n / 2],
        n => (times[n / 2 - 1] + times[n / 2]) / 2.0,
    };
    let slowest = ranks
        .iter()
        .max_by(|a, b| a.plan_ms.total_cmp(&b.plan_ms))
        .map_or((0, 0.0, 0), |r| (r.rank, r.plan_ms, r.plan_bytes));
    let fresh_ms = fresh_memory_ms(slowest.2);
    let own_rank_index_seconds = match dest.iter().find(|rl| rl.rank == slowest.0) {
        Some(rl) => {
            let t0 = Instant::now();
            let own = SourceIndex::for_ranks(&manifests, std::slice::from_ref(rl))?;
            let s = t0.elapsed().as_secs_f64();
            drop(own);
            s
        }
        None => 0.0,
    };
    let sum_s: f64 = ranks.iter().map(|r| r.plan_ms).sum::<f64>() / 1e3;
    let k = u64::from(instances);
    let (max_src, max_wire) = egress
        .iter()
        .enumerate()
        .max_by_key(|(_, e)| e[0])
        .map_or((0, 0), |(i, e)| (i, e[0]));
    let manifest_bytes_estimate = manifests.iter().map(manifest_bytes).sum();
    Ok(FleetPlanReport {
        model: model.name.clone(),
        params: model.param_count(),
        tensors: table.len() as u64,
        model_bytes: model.bytes(),
        trainer: trainer_label,
        inference: format!("tp:{tp} ep={ep_inf}"),
        instances,
        cost_model: cost,
        layouts_seconds,
        manifest_seconds,
        index_seconds,
        geometry_seconds,
        own_rank_index_seconds,
        shards: manifests.iter().map(|m| m.shards.len() as u64).sum(),
        pieces: manifests.iter().map(|m| m.pieces.len() as u64).sum(),
        manifest_bytes_estimate,
        index_bytes_estimate: index.approx_bytes(),
        slowest_rank: slowest.0,
        slowest_rank_ms: slowest.1,
        slowest_rank_plan_bytes: slowest.2,
        slowest_rank_fresh_memory_ms: fresh_ms,
        median_rank_ms,
        whole_fleet_seconds: index_seconds + sum_s,
        projected_all_ranks_seconds: index_seconds + instances as f64 * sum_s,
        max_reads: ranks.iter().map(|r| r.reads).max().unwrap_or(0),
        total_reads: ranks.iter().map(|r| r.reads).sum(),
        max_copies: ranks.iter().map(|r| r.copies).max().unwrap_or(0),
        total_copies: ranks.iter().map(|r| r.copies).sum(),
        max_verify_items: ranks.iter().map(|r| r.verify_items).max().unwrap_or(0),
        total_verify_items: ranks.iter().map(|r| r.verify_items).sum(),
        max_rank_bytes_bf16: ranks.iter().map(|r| r.bytes_bf16).max().unwrap_or(0),
        max_rank_bytes_fp8: ranks.iter().map(|r| r.bytes_fp8).max().unwrap_or(0),
        instance_wire_bytes_bf16: ranks.iter().map(|r| r.wire_bytes_bf16).sum(),
        instance_bytes_fp8: ranks.iter().map(|r| r.bytes_fp8).sum(),
        max_egress_trainer_rank: manifests.get(max_src).map_or(0, |m| m.slot),
        max_trainer_egress_wire_bf16: max_wire.saturating_mul(k),
        max_trainer_egress_bf16: egress
            .iter()
            .map(|e| e[1])
            .max()
            .unwrap_or(0)
            .saturating_mul(k),
        max_trainer_egress_fp8: egress
            .iter()
            .map(|e| e[2])
            .max()
            .unwrap_or(0)
            .saturating_mul(k),
        ranks,
    })
}

/// Estimated in-memory bytes of a manifest: its structs plus their heap (names, shapes, boxes).
fn manifest_bytes(m: &SourceManifest) -> u64 {
    use std::mem::size_of;
    let boxb = |b: &TensorBox| (b.global_offset.capacity() + b.local_shape.capacity()) * 8;
    let mut n = size_of::<SourceManifest>()
        + m.agent_name.capacity()
        + m.agent_metadata.capacity()
        + m.shards.capacity() * size_of::<crate::ShardEntry>()
        + m.pieces.capacity() * size_of::<crate::DestPiece>();
    for s in &m.shards {
        n += s.tensor.capacity() + s.global_shape.capacity() * 8 + boxb(&s.shard);
    }
    for p in &m.pieces {
        n += p.tensor.capacity() + boxb(&p.region);
    }
    n as u64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// A scaled-down model of the same architecture: 2 layers (1 dense, 1 MoE), 16 experts.
    fn tiny() -> FrontierModel {
        FrontierModel {
            name: "tiny".into(),
            hidden: 64,
            layers: 2,
            first_k_dense: 1,
            intermediate: 96,
            moe_intermediate: 32,
            n_routed_experts: 16,
            n_shared_experts: 1,
            heads: 4,
            q_lora_rank: 48,
            kv_lora_rank: 16,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 8,
            vocab: 512,
        }
    }

    fn numel(t: &TensorSpec) -> u64 {
        t.shape.iter().product()
    }

    #[test]
    fn param_counts_match_the_published_sizes() {
        let ds = FrontierModel::deepseek_v3();
        let n = ds.param_count();
        assert_eq!(n, 671_026_419_200);
        // The brief's bound: 671B minus the ~11.5B MTP layer, within 2%; the count equals the
        // published 671B main-model size (685B with the MTP module) to 0.01%.
        let target = 671e9 - 11.5e9;
        assert!((n as f64 - target).abs() / target < 0.02, "{n}");
        assert!((n as f64 - 671e9).abs() / 671e9 < 1e-4, "{n}");
        let k = FrontierModel::kimi_k2();
        let n = k.param_count();
        assert_eq!(n, 1_026_408_232_448);
        assert!((n as f64 - 1.04e12).abs() / 1.04e12 < 0.02, "{n}");
        // Tensor list shape checks.
        let t = k.tensors();
        assert_eq!(t.len(), 1 + 9 * 61 + 3 + 60 * (5 + 384 * 3) + 2);
        let find = |name: &str| t.iter().find(|x| x.name == name).unwrap();
        assert_eq!(
            find("model.layers.5.self_attn.q_b_proj.weight").shape,
            vec![64 * 192, 1536]
        );
        assert_eq!(
            find("model.layers.5.self_attn.kv_b_proj.weight").shape,
            vec![64 * 256, 512]
        );
        assert_eq!(
            find("model.layers.5.self_attn.kv_a_proj_with_mqa.weight").shape,
            vec![576, 7168]
        );
        assert_eq!(
            find("model.layers.60.mlp.experts.383.down_proj.weight").shape,
            vec![7168, 2048]
        );
        assert_eq!(
            find("model.layers.1.mlp.gate.e_score_correction_bias").dtype,
            DType::F32
        );
        assert_eq!(
            find("model.layers.0.mlp.down_proj.weight").shape,
            vec![7168, 18432]
        );
        assert!(t.iter().all(|x| !x.name.contains("layers.0.mlp.experts")));
    }

    #[test]
    fn trainer_shards_cover_every_byte_once_and_follow_ep_groups() {
        let m = tiny();
        let total = m.bytes();
        let trainer = m.trainer_layouts(16, 4).unwrap();
        assert_eq!(trainer.len(), 16);
        assert_eq!(trainer.iter().map(|r| r.total_bytes).sum::<u64>(), total);
        // Rank 5 is in EP group 1 (experts 4..8), index 1 of the group's 4 ranks.
        let r5 = &trainer[5];
        assert_eq!(r5.layout.to_string(), "fsdp:16");
        let experts: Vec<&str> = r5
            .params
            .iter()
            .filter(|p| p.name.contains(".experts."))
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(experts.len(), 4 * 3);
        assert!(experts.iter().all(|n| ["4", "5", "6", "7"]
            .iter()
            .any(|e| n.contains(&format!("experts.{e}.")))));
        let g = r5
            .param("model.layers.1.mlp.experts.5.gate_proj.weight")
            .unwrap();
        // 32 rows over 4 ranks of the group: rows 8..16.
        assert_eq!(g.pieces[0].region.global_offset, vec![8, 0]);
        assert_eq!(g.shape, vec![8, 64]);
        // Non-expert: 64 rows over 16 ranks.
        let q = r5.param("model.layers.0.self_attn.o_proj.weight").unwrap();
        assert_eq!(q.pieces[0].region.global_offset, vec![20, 0]);
        // Every tensor's rows covered once.
        for t in m.tensors() {
            let rows: u64 = trainer
                .iter()
                .filter_map(|r| r.param(&t.name))
                .map(|p| p.shape[0])
                .sum();
            assert_eq!(rows, t.shape[0], "{}", t.name);
        }
    }

    #[test]
    fn inference_instance_holds_the_model_once_plus_replicas() {
        let m = tiny();
        let entries = m.entries();
        let replicated: u64 = entries
            .iter()
            .filter(|e| e.kind == Kind::Replicated)
            .map(|e| numel(&e.spec) * e.spec.dtype.size_bytes())
            .sum();
        for ep in [4, 1] {
            let dest = m.inference_layouts(4, ep).unwrap();
            assert_eq!(dest[0].layout.to_string(), "tp:4");
            assert_eq!(
                dest.iter().map(|r| r.total_bytes).sum::<u64>(),
                m.bytes() + 3 * replicated
            );
        }
        let dest = m.inference_layouts(4, 4).unwrap();
        let r2 = &dest[2];
        assert!(r2
            .param("model.layers.1.mlp.experts.9.down_proj.weight")
            .is_some());
        assert!(r2
            .param("model.layers.1.mlp.experts.12.down_proj.weight")
            .is_none());
        let o = r2.param("model.layers.0.self_attn.o_proj.weight").unwrap();
        assert_eq!(o.pieces[0].region.global_offset, vec![0, 16]);
        let qb = r2
            .param("model.layers.0.self_attn.q_b_proj.weight")
            .unwrap();
        assert_eq!(qb.pieces[0].region.global_offset, vec![24, 0]);
        let emb = r2.param("model.embed_tokens.weight").unwrap();
        assert_eq!(emb.shape, vec![128, 64]);
        let gate = r2.param("model.layers.1.mlp.gate.weight").unwrap();
        assert_eq!(gate.shape, vec![16, 64]);
    }

    #[test]
    fn every_destination_rank_plans_with_full_coverage() {
        let m = tiny();
        let trainer = m.trainer_layouts(16, 4).unwrap();
        for ep in [4, 1] {
            let dest = m.inference_layouts(4, ep).unwrap();
            let ms = m.manifests(&trainer, &dest).unwrap();
            assert!(ms
                .iter()
                .all(|x| x.pieces.iter().all(|p| p.packed_addr.is_none())));
            let index = SourceIndex::new(&ms).unwrap();
            let cost = CostModel::default();
            for rl in &dest {
                // plan() proves every live byte is written exactly once.
                let p = index.plan(std::slice::from_ref(rl), &cost).unwrap();
                assert_eq!(p.useful_bytes, rl.total_bytes);
                assert_eq!(
                    p,
                    crate::plan::plan(std::slice::from_ref(rl), &ms, &cost).unwrap()
                );
            }
            // The whole instance as one worker, too.
            let p = index.plan(&dest, &cost).unwrap();
            assert_eq!(
                p.useful_bytes,
                dest.iter().map(|r| r.total_bytes).sum::<u64>()
            );
        }
    }

    #[test]
    fn tiny_fleet_report_is_consistent() {
        let m = tiny();
        let r = fleet_plan_report(&m, FrontierTrainer::Fsdp { world: 16, ep: 4 }, 4, 4, 3).unwrap();
        assert_eq!(r.ranks.len(), 4);
        assert_eq!(r.trainer, "fsdp:16 ep=4");
        let dest = m.inference_layouts(4, 4).unwrap();
        let index_of = |rank: u32| dest.iter().position(|d| d.rank == rank).unwrap();
        let ms = m
            .manifests(&m.trainer_layouts(16, 4).unwrap(), &dest)
            .unwrap();
        let slow = &dest[index_of(r.slowest_rank)];
        let p = crate::plan::plan(std::slice::from_ref(slow), &ms, &CostModel::default()).unwrap();
        // The plan's bytes: its items, plus the heap of multi-segment items, as reported for
        // the slowest rank.
        use std::mem::size_of;
        let heap: usize = p
            .verify
            .iter()
            .map(|v| {
                let segs = if v.segments.len() > 1 {
                    v.segments.len()
                } else {
                    0
                };
                segs * size_of::<crate::plan::Segment>() + v.shared_with.len() * 4
            })
            .sum();
        let items = size_of::<crate::plan::Plan>()
            + p.verify.len() * size_of::<crate::plan::VerifyItem>()
            + p.copies.len() * size_of::<crate::plan::Copy>()
            + p.reads.len() * size_of::<crate::plan::Read>()
            + p.zero_fills.len() * size_of::<crate::plan::ZeroFill>()
            + p.choices.len() * size_of::<crate::plan::Choice>()
            + p.tensors.len() * size_of::<std::sync::Arc<str>>();
        assert_eq!(p.approx_bytes(), (items + heap) as u64);
        let rr = &r.ranks[index_of(r.slowest_rank)];
        assert_eq!(r.slowest_rank_plan_bytes, rr.plan_bytes);
        assert_eq!(rr.plan_bytes, p.approx_bytes());
        assert!(r.slowest_rank_fresh_memory_ms > 0.0);
        for (rr, rl) in r.ranks.iter().zip(&dest) {
            assert_eq!(rr.bytes_bf16, rl.total_bytes);
            assert!(rr.bytes_fp8 < rr.bytes_bf16);
            assert!(rr.wire_bytes_bf16 >= rr.bytes_bf16);
        }
        assert!(r.max_trainer_egress_bf16 > 0);
        assert!(r.max_trainer_egress_wire_bf16 >= r.max_trainer_egress_bf16);
        assert!(r.max_trainer_egress_fp8 < r.max_trainer_egress_bf16);
        assert!(r.slowest_rank_ms >= r.median_rank_ms);
        assert!(r.projected_all_ranks_seconds >= r.whole_fleet_seconds);
        assert!(r.manifest_bytes_estimate > 0 && r.index_bytes_estimate > 0);
        assert!(serde_json::to_string(&r).is_ok());
        assert!(
            fleet_plan_report(&m, FrontierTrainer::Fsdp { world: 16, ep: 4 }, 4, 4, 0).is_err()
        );
    }

    #[test]
    fn megatron_trainers_cover_every_byte_and_plan_into_vllm_ep() {
        let m = tiny();
        let trainer = FrontierTrainer::Megatron {
            tp: 2,
            pp: 2,
            ep: 2,
        };
        let ranks = trainer.layouts(&m).unwrap();
        assert_eq!(ranks.len(), 8);
        // Every element of every tensor is held, replicas aside, by exactly the ranks whose
        // (stage, ep rank) own it: count bytes per tensor over one ep rank's replicas.
        let mut held: HashMap<String, u64> = HashMap::new();
        for rl in &ranks {
            for p in &rl.params {
                for pc in &p.pieces {
                    *held.entry(pc.tensor.clone()).or_default() += pc.region.numel().unwrap();
                }
            }
        }
        // Per stage, 2 tp ranks x 2 EP replicas: a replicated tensor is held 4 times, a
        // tensor-parallel one twice (once per EP replica), an expert once (its EP rank's 2 tp
        // halves).
        for e in m.entries() {
            let copies = match e.kind {
                Kind::Replicated => 4,
                Kind::Column | Kind::Row | Kind::Vocab => 2,
                Kind::Expert { .. } => 1,
            };
            let got = held.get(&e.spec.name).copied().unwrap_or(0);
            assert_eq!(got, numel(&e.spec) * copies, "{}", e.spec.name);
        }
        // The stages split the layers: layer 0 on stage 0 only, layer 1 on stage 1 only.
        for rl in &ranks {
            let (_, stage, _) = match rl.layout.scheme {
                Scheme::Megatron(d) => d.coords(rl.rank),
                _ => unreachable!(),
            };
            let other = format!("model.layers.{}.", 1 - stage);
            assert!(rl.params.iter().all(|p| !p.name.starts_with(&other)));
        }
        let r = fleet_plan_report(&m, trainer, 4, 4, 2).unwrap();
        assert_eq!(r.trainer, "megatron:tp=2,pp=2,ep=2");
        assert_eq!(r.ranks.len(), 4);
        let err = FrontierTrainer::Megatron {
            tp: 2,
            pp: 2,
            ep: 3,
        }
        .layouts(&m)
        .unwrap_err();
        assert!(err.to_string().contains("not divisible by ep=3"), "{err}");
    }

    #[test]
    fn fp8_block_scales() {
        let b = TensorBox {
            global_offset: vec![100, 0],
            local_shape: vec![60, 256],
        };
        // Own shape 60x256: 1x2 blocks; touches global row blocks 0 and 1: 2x2 blocks.
        assert_eq!(fp8_bytes(&b, true, 2), 60 * 256 + 2 * 4);
        assert_eq!(
            fp8_source_bytes(&b.global_offset, &b.local_shape, true, 2),
            60 * 256 + 4 * 4
        );
        assert_eq!(fp8_bytes(&b, false, 2), 60 * 256 * 2);
    }

    #[test]
    fn impossible_layouts_name_the_field() {
        let m = tiny();
        let msg = |e: Error| e.to_string();
        assert!(msg(m.trainer_layouts(16, 3).unwrap_err()).contains("field `ep`"));
        assert!(msg(m.trainer_layouts(64, 32).unwrap_err()).contains("n_routed_experts"));
        assert!(msg(m.trainer_layouts(0, 1).unwrap_err()).contains("field `world`"));
        assert!(msg(m.inference_layouts(4, 2).unwrap_err()).contains("field `ep`"));
        assert!(msg(m.inference_layouts(32, 32).unwrap_err()).contains("n_routed_experts"));
        assert!(msg(m.inference_layouts(3, 1).unwrap_err()).contains("not divisible by tp=3"));
        let mut v = tiny();
        v.vocab = 500;
        assert!(msg(v.inference_layouts(4, 4).unwrap_err()).contains("field `vocab`"));
        // Both frontier vocabs split over tp=8 without padding.
        for f in [FrontierModel::deepseek_v3(), FrontierModel::kimi_k2()] {
            assert_eq!(f.vocab % 64, 0);
            assert_eq!(f.vocab % 8, 0);
        }
    }

    /// Prints the frontier reports; run by hand, in release, on an idle machine:
    /// `cargo test -p mx-layout --release -- --ignored frontier_report --nocapture`.
    #[test]
    #[ignore = "minutes and GBs: run by hand in release"]
    fn frontier_report() {
        fn vm_hwm_kib() -> Option<u64> {
            let s = std::fs::read_to_string("/proc/self/status").ok()?;
            let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            l.split_whitespace().nth(1)?.parse().ok()
        }
        let only = std::env::var("MX_FRONTIER_MODEL").unwrap_or_default();
        for m in [FrontierModel::kimi_k2(), FrontierModel::deepseek_v3()] {
            if !only.is_empty() && !m.name.eq_ignore_ascii_case(&only) {
                continue;
            }
            let before = vm_hwm_kib();
            let mut r =
                fleet_plan_report(&m, FrontierTrainer::Fsdp { world: 256, ep: 64 }, 8, 8, 16)
                    .unwrap();
            let after = vm_hwm_kib();
            let ranks = std::mem::take(&mut r.ranks);
            println!("{}", serde_json::to_string_pretty(&r).unwrap());
            for x in &ranks {
                println!("{}", serde_json::to_string(x).unwrap());
            }
            println!(
                "{}: VmHWM before {:?} KiB, after {:?} KiB; slowest rank {} ms, median {} ms",
                m.name, before, after, r.slowest_rank_ms, r.median_rank_ms
            );
        }
    }
}
