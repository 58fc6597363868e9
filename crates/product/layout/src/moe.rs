//! Mixture-of-experts models: how a checkpoint names its experts and where vLLM puts them.
//!
//! Families (from `config.json`'s `model_type`): `qwen3_moe` and `qwen2_moe` (experts under
//! `mlp.experts.{e}.{gate,up,down}_proj`, router `mlp.gate`, Qwen2-MoE's shared expert under
//! `mlp.shared_expert.{gate,up,down}_proj` with its gate `mlp.shared_expert_gate`) and `mixtral`
//! (experts under `block_sparse_moe.experts.{e}.{w1,w3,w2}`: gate, up, down; router
//! `block_sparse_moe.gate`). A checkpoint may also hold a layer's experts stacked in two 3-D
//! tensors, `experts.gate_up_proj` `[E, 2I, H]` (gate first along dim 1) and `experts.down_proj`
//! `[E, H, I]` (Mixtral: `experts.w13`, `experts.w2`): the forms vLLM 0.32.0's loaders accept
//! (`RoutedExperts.load_weights`, `build_expert_params_mapping(include_fused=True)`). Any other
//! tensor under `experts.` is refused naming it (vLLM would drop it silently).
//!
//! The destination is vLLM's fused expert parameters (`vllm/model_executor/layers/fused_moe/`,
//! `UnquantizedFusedMoEMethod.create_weights`, `RoutedExperts._load_w13` / `_load_w2`):
//! `{block}.experts.routed_experts.w13_weight` `[L, 2 I_p, H]`, per local expert `[gate_r; up_r]`
//! with `gate_r = gate[r I_p .. (r + 1) I_p, :]`, and `{block}.experts.routed_experts.w2_weight`
//! `[L, H, I_p]`, per local expert `down[:, r I_p .. (r + 1) I_p]`; no transposes. Under `tp:N`
//! every rank holds all `L = E` experts split along the intermediate dimension (`I_p = I / N`,
//! `r` the rank); under `tp-ep:N` (`--enable-expert-parallel`, data parallel 1) experts are whole
//! (`I_p = I`, `r = 0`) and rank `s` holds the global experts `[s b + min(s, E mod N), ..)`,
//! `b + 1` of them on the first `E mod N` ranks and `b = E div N` on the others, local expert `k`
//! being global expert `start + k` (vLLM's `determine_expert_map`, strategy "linear", the only one
//! it applies to these families). The router weight `[E, H]` is replicated on every rank
//! (`GateLinear` is a `ReplicatedLinear`); the shared expert is a dense MLP under the attention's
//! tensor parallelism in both layouts.

use serde::{Deserialize, Serialize};

use crate::{Error, TensorBox, TensorSpec};

/// How a family names its MoE block and the three projections of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertNaming {
    /// Qwen3-MoE, Qwen2-MoE: `mlp.experts.{e}.{gate_proj,up_proj,down_proj}`.
    Qwen,
    /// Mixtral: `block_sparse_moe.experts.{e}.{w1,w3,w2}` (gate, up, down).
    Mixtral,
}

impl ExpertNaming {
    /// The MoE block's attribute in a decoder layer (`mlp`, `block_sparse_moe`).
    pub fn block(self) -> &'static str {
        match self {
            ExpertNaming::Qwen => "mlp",
            ExpertNaming::Mixtral => "block_sparse_moe",
        }
    }

    /// The checkpoint names of one expert's gate, up and down projections.
    fn parts(self) -> [&'static str; 3] {
        match self {
            ExpertNaming::Qwen => ["gate_proj", "up_proj", "down_proj"],
            ExpertNaming::Mixtral => ["w1", "w3", "w2"],
        }
    }

    /// The checkpoint names of a layer's stacked gate/up and down tensors.
    fn stacked(self) -> [&'static str; 2] {
        match self {
            ExpertNaming::Qwen => ["gate_up_proj", "down_proj"],
            ExpertNaming::Mixtral => ["w13", "w2"],
        }
    }
}

/// What the layout needs to know about a model's experts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeInfo {
    /// Routed experts per MoE layer (`num_experts`, Mixtral `num_local_experts`).
    pub num_experts: u64,
    /// One expert's intermediate size (`moe_intermediate_size`, Mixtral `intermediate_size`).
    pub intermediate: u64,
    /// The shared expert's intermediate size (`shared_expert_intermediate_size`; 0: none).
    pub shared_intermediate: u64,
    /// `hidden_size`.
    pub hidden: u64,
    /// The family's names.
    pub naming: ExpertNaming,
}

/// Which projection an expert tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Part {
    Gate,
    Up,
    Down,
    /// A stacked `[E, 2I, H]` gate/up tensor.
    GateUp,
}

/// A checkpoint tensor of a layer's routed experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExpertTensor {
    /// `model.layers.3.mlp`: the MoE block the tensor belongs to.
    pub(crate) block: String,
    /// The expert (`None`: all of them, stacked along dim 0).
    pub(crate) expert: Option<u64>,
    pub(crate) part: Part,
}

impl MoeInfo {
    /// Reads the MoE fields of an HF `config.json` for `model_type` (`None` for a dense family).
    ///
    /// # Errors
    /// [`Error::BadConfig`] naming a missing or zero field.
    pub fn from_hf_config(
        model_type: &str,
        config: &serde_json::Value,
    ) -> Result<Option<MoeInfo>, Error> {
        let (naming, inter_field) = match model_type {
            "qwen3_moe" | "qwen2_moe" => (ExpertNaming::Qwen, "moe_intermediate_size"),
            "mixtral" => (ExpertNaming::Mixtral, "intermediate_size"),
            _ => return Ok(None),
        };
        let field = |name: &str| -> Result<u64, Error> {
            match config.get(name).and_then(serde_json::Value::as_u64) {
                Some(v) if v > 0 => Ok(v),
                _ => Err(Error::BadConfig {
                    field: name.to_string(),
                    reason: format!("missing or not a positive integer ({model_type} has experts)"),
                }),
            }
        };
        let shared_intermediate = config
            .get("shared_expert_intermediate_size")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        // The expert count under either name transformers maps onto the other
        // (`attribute_map = {"num_experts": "num_local_experts"}` in Qwen3-MoE's and Mixtral's
        // configs; released Qwen checkpoints write `num_experts`, transformers 5 writes
        // `num_local_experts`); both present must agree.
        let num_experts = match (config.get("num_experts"), config.get("num_local_experts")) {
            (Some(_), None) => field("num_experts")?,
            (None, Some(_)) | (None, None) => field("num_local_experts")?,
            (Some(_), Some(_)) => {
                let (a, b) = (field("num_experts")?, field("num_local_experts")?);
                if a != b {
                    return Err(Error::BadConfig {
                        field: "num_experts".into(),
                        reason: format!("{a} disagrees with num_local_experts {b}"),
                    });
                }
                a
            }
        };
        Ok(Some(MoeInfo {
            num_experts,
            intermediate: field(inter_field)?,
            shared_intermediate,
            hidden: field("hidden_size")?,
            naming,
        }))
    }

    /// Parses `name` as a routed-expert tensor of this family (`None` for any other tensor).
    ///
    /// # Errors
    /// [`Error::ImpossibleLayout`] for a tensor under `experts.` in neither form vLLM loads
    /// (for example a stacked `experts.gate_proj`), naming it.
    pub(crate) fn expert_tensor(&self, name: &str) -> Result<Option<ExpertTensor>, Error> {
        let marker = format!(".{}.experts.", self.naming.block());
        let Some(at) = name.find(&marker) else {
            return Ok(None);
        };
        let block = &name[..at + marker.len() - ".experts.".len()];
        let rest = &name[at + marker.len()..];
        let [gate, up, down] = self.naming.parts();
        let [gate_up, stacked_down] = self.naming.stacked();
        let refuse = |why: &str| {
            Error::ImpossibleLayout {
            layout: "any".into(),
            tensor: name.to_string(),
            reason: format!(
                "{why}: a layer's experts are `experts.{{e}}.{gate}|{up}|{down}.weight` or stacked `experts.{gate_up}` [E, 2I, H] and `experts.{stacked_down}` [E, H, I]"
            ),
        }
        };
        if let Some((e, proj)) = rest.split_once('.') {
            if let Ok(expert) = e.parse::<u64>() {
                let part = match proj.strip_suffix(".weight") {
                    Some(p) if p == gate => Part::Gate,
                    Some(p) if p == up => Part::Up,
                    Some(p) if p == down => Part::Down,
                    _ => return Err(refuse("not an expert projection's weight")),
                };
                if expert >= self.num_experts {
                    return Err(refuse(&format!(
                        "expert {expert} is past the config's {} experts",
                        self.num_experts
                    )));
                }
                return Ok(Some(ExpertTensor {
                    block: block.to_string(),
                    expert: Some(expert),
                    part,
                }));
            }
        }
        let part = match rest {
            r if r == gate_up => Part::GateUp,
            r if r == stacked_down => Part::Down,
            _ => return Err(refuse("not a form vLLM loads")),
        };
        Ok(Some(ExpertTensor {
            block: block.to_string(),
            expert: None,
            part,
        }))
    }

    /// The global experts `[start, start + count)` rank `rank` of an expert-parallel group of
    /// `ep` ranks holds: vLLM's linear placement (`determine_expert_map`), the first
    /// `num_experts mod ep` ranks holding one expert more.
    pub fn ep_experts(&self, ep: u32, rank: u32) -> (u64, u64) {
        let (ep, rank) = (u64::from(ep.max(1)), u64::from(rank));
        let base = self.num_experts / ep;
        let rem = self.num_experts % ep;
        let count = base + u64::from(rank < rem);
        (rank * base + rank.min(rem), count)
    }
}

/// The tensors of one MoE block, by expert and part.
#[derive(Debug, Default)]
pub(crate) struct Block<'a> {
    /// (expert, part) -> per-expert tensor.
    pub(crate) per_expert: std::collections::BTreeMap<(u64, Part), &'a TensorSpec>,
    /// Stacked gate/up and down tensors.
    pub(crate) gate_up: Option<&'a TensorSpec>,
    pub(crate) down: Option<&'a TensorSpec>,
}

/// One rank's view of a block's experts: which global experts, and which slice of each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slice {
    /// First global expert and how many.
    pub(crate) first: u64,
    pub(crate) count: u64,
    /// Intermediate rows per expert on this rank (`I_p`) and the first of them (`r I_p`).
    pub(crate) rows: u64,
    pub(crate) row0: u64,
}

/// The `[I, H]`-form box of expert `e`'s gate (`up` = false) or up rows `[row0, row0 + rows)`:
/// from its own tensor, or from the stacked `[E, 2I, H]` one (a `[1, rows, H]` box).
fn gate_up_box<'a>(
    block: &Block<'a>,
    moe: &MoeInfo,
    e: u64,
    up: bool,
    s: Slice,
    want_name: impl Fn(Part) -> String,
) -> Result<(&'a TensorSpec, TensorBox), Error> {
    let part = if up { Part::Up } else { Part::Gate };
    if let Some(t) = block.per_expert.get(&(e, part)) {
        let b = TensorBox {
            global_offset: vec![s.row0, 0],
            local_shape: vec![s.rows, t.shape.get(1).copied().unwrap_or(0)],
        };
        return Ok((*t, b));
    }
    if let Some(t) = block.gate_up {
        let off = if up { moe.intermediate } else { 0 };
        let b = TensorBox {
            global_offset: vec![e, off + s.row0, 0],
            local_shape: vec![1, s.rows, t.shape.get(2).copied().unwrap_or(0)],
        };
        return Ok((t, b));
    }
    Err(Error::MissingTensor {
        tensor: want_name(part),
        reason: format!("expert {e}'s rows of the fused vLLM parameter w13_weight need it"),
    })
}

/// Expert `e`'s down columns `[row0, row0 + rows)`: `[H, rows]` of its own tensor, or a
/// `[1, H, rows]` box of the stacked `[E, H, I]` one.
fn down_box<'a>(
    block: &Block<'a>,
    e: u64,
    s: Slice,
    want_name: impl Fn(Part) -> String,
) -> Result<(&'a TensorSpec, TensorBox), Error> {
    if let Some(t) = block.per_expert.get(&(e, Part::Down)) {
        let h = t.shape.first().copied().unwrap_or(0);
        return Ok((
            *t,
            TensorBox {
                global_offset: vec![0, s.row0],
                local_shape: vec![h, s.rows],
            },
        ));
    }
    if let Some(t) = block.down {
        let h = t.shape.get(1).copied().unwrap_or(0);
        return Ok((
            t,
            TensorBox {
                global_offset: vec![e, 0, s.row0],
                local_shape: vec![1, h, s.rows],
            },
        ));
    }
    Err(Error::MissingTensor {
        tensor: want_name(Part::Down),
        reason: format!("expert {e}'s slice of the fused vLLM parameter w2_weight needs it"),
    })
}

/// The pieces of a block's `w13_weight` and `w2_weight` on one rank, in local-expert order
/// (see the module docs), each checked to lie inside its tensor.
pub(crate) fn block_pieces<'a>(
    moe: &MoeInfo,
    block_name: &str,
    block: &Block<'a>,
    s: Slice,
) -> Result<[Vec<(&'a TensorSpec, TensorBox)>; 2], Error> {
    let [gate, up, down] = moe.naming.parts();
    let [gate_up, stacked_down] = moe.naming.stacked();
    let (e_, i_, h_) = (moe.num_experts, moe.intermediate, moe.hidden);
    let expect = |t: &TensorSpec, shape: Vec<u64>| -> Result<(), Error> {
        if t.shape == shape {
            return Ok(());
        }
        Err(Error::Mismatch {
            tensor: t.name.clone(),
            what: "shape",
            source_value: format!("{:?} in the checkpoint", t.shape),
            dest_value: format!(
                "{shape:?} from config.json ({e_} experts, intermediate {i_}, hidden {h_})"
            ),
        })
    };
    for ((_, part), t) in &block.per_expert {
        match part {
            Part::Down => expect(t, vec![h_, i_])?,
            _ => expect(t, vec![i_, h_])?,
        }
    }
    if let Some(t) = block.gate_up {
        expect(t, vec![e_, i_.saturating_mul(2), h_])?;
    }
    if let Some(t) = block.down {
        expect(t, vec![e_, h_, i_])?;
    }
    let dtype = block
        .per_expert
        .values()
        .chain(block.gate_up.iter())
        .chain(block.down.iter())
        .map(|t| t.dtype)
        .next();
    if let Some(t) = block
        .per_expert
        .values()
        .chain(block.gate_up.iter())
        .chain(block.down.iter())
        .find(|t| Some(t.dtype) != dtype)
    {
        return Err(Error::Mismatch {
            tensor: t.name.clone(),
            what: "dtype",
            source_value: t.dtype.to_string(),
            dest_value: format!(
                "{} (the block's other experts: one fused vLLM parameter)",
                dtype.map(|d| d.to_string()).unwrap_or_default()
            ),
        });
    }
    let mut w13 = Vec::new();
    let mut w2 = Vec::new();
    for e in s.first..s.first + s.count {
        let name = |p: Part| match (p, block.gate_up.is_some() || block.down.is_some()) {
            (Part::Gate, false) => format!("{block_name}.experts.{e}.{gate}.weight"),
            (Part::Up, false) => format!("{block_name}.experts.{e}.{up}.weight"),
            (Part::Down, false) => format!("{block_name}.experts.{e}.{down}.weight"),
            (Part::Down, true) => format!("{block_name}.experts.{stacked_down}"),
            _ => format!("{block_name}.experts.{gate_up}"),
        };
        w13.push(gate_up_box(block, moe, e, false, s, name)?);
        w13.push(gate_up_box(block, moe, e, true, s, name)?);
        w2.push(down_box(block, e, s, name)?);
    }
    for (t, b) in w13.iter().chain(&w2) {
        if !b.fits_in(&t.shape) {
            return Err(Error::Mismatch {
                tensor: t.name.clone(),
                what: "shape",
                source_value: format!("{:?} in the checkpoint", t.shape),
                dest_value: format!(
                    "a box {b} of {} experts x intermediate {} (config.json)",
                    moe.num_experts, moe.intermediate
                ),
            });
        }
    }
    Ok([w13, w2])
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
