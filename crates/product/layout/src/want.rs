//! What a worker's plan reads of a version: the boxes of checkpoint tensors its ranks hold, and
//! the destination (layout, ranks) whose published pieces it looks up. A control plane answers
//! a worker with only the shards and pieces a [`Want`] selects (bounded fan-out), and the worker
//! checks them against the version id with a [`crate::merkle::VersionProof`].
//!
//! A shard is wanted when its box overlaps a wanted box of its tensor; a piece when it was cut
//! for the wanted destination (or, with none named, when its region overlaps a wanted box). Any
//! shard a plan for the ranks could read overlaps one of their boxes, so planning from the
//! selection gives the plan the whole manifests give.

use std::collections::BTreeMap;

use crate::{DestPiece, LayoutSpec, RankLayout, ShardEntry, SourceManifest, TensorBox};

/// The regions of a version a worker reads, and the destination it plans for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Want {
    /// Tensor name -> the boxes of it the worker holds (global coordinates), sorted, each once.
    pub regions: BTreeMap<String, Vec<TensorBox>>,
    /// The destination layout and its ranks whose pieces are wanted; `None`: every piece whose
    /// region overlaps a wanted box (a peer describing its memory for every layout).
    pub dest: Option<(LayoutSpec, Vec<u32>)>,
}

impl Want {
    /// What a worker holding the ranks `dest` (one layout) reads: every box of every piece of
    /// every parameter, and the pieces cut for those ranks.
    pub fn for_ranks(dest: &[RankLayout]) -> Want {
        let mut regions: BTreeMap<String, Vec<TensorBox>> = BTreeMap::new();
        for p in dest
            .iter()
            .flat_map(|r| r.params.iter())
            .flat_map(|p| p.pieces.iter())
        {
            regions
                .entry(p.tensor.clone())
                .or_default()
                .push(p.region.clone());
        }
        for boxes in regions.values_mut() {
            boxes.sort();
            boxes.dedup();
        }
        let dest = dest.first().map(|d| {
            let mut ranks: Vec<u32> = dest.iter().map(|r| r.rank).collect();
            ranks.sort_unstable();
            ranks.dedup();
            (d.layout, ranks)
        });
        Want { regions, dest }
    }

    /// The same regions, with no destination: pieces of every layout that overlap them.
    pub fn any_dest(mut self) -> Want {
        self.dest = None;
        self
    }

    /// Number of wanted boxes over all tensors.
    pub fn region_count(&self) -> usize {
        self.regions.values().map(Vec::len).sum()
    }

    /// True when `region` of `tensor` overlaps a wanted box.
    pub fn overlaps(&self, tensor: &str, region: &TensorBox) -> bool {
        self.regions
            .get(tensor)
            .is_some_and(|boxes| boxes.iter().any(|b| b.intersect(region).is_some()))
    }

    /// True when the shard's box overlaps a wanted box of its tensor.
    pub fn wants_shard(&self, s: &ShardEntry) -> bool {
        self.overlaps(&s.tensor, &s.shard)
    }

    /// True when the piece was cut for the wanted destination (and overlaps a wanted box), or,
    /// with no destination named, when it overlaps a wanted box.
    pub fn wants_piece(&self, p: &DestPiece) -> bool {
        let for_dest = match &self.dest {
            Some((layout, ranks)) => {
                p.layout == *layout && ranks.binary_search(&p.dest_rank).is_ok()
            }
            None => true,
        };
        for_dest && self.overlaps(&p.tensor, &p.region)
    }

    /// The part of `m` this want selects: its wanted shards and pieces, in their order, with
    /// the source's other fields; `None` when it holds no wanted shard.
    pub fn select(&self, m: &SourceManifest) -> Option<SourceManifest> {
        let shards: Vec<ShardEntry> = m
            .shards
            .iter()
            .filter(|s| self.wants_shard(s))
            .cloned()
            .collect();
        if shards.is_empty() {
            return None;
        }
        Some(SourceManifest {
            slot: m.slot,
            layout: m.layout,
            agent_name: m.agent_name.clone(),
            agent_metadata: m.agent_metadata.clone(),
            shards,
            pieces: m
                .pieces
                .iter()
                .filter(|p| self.wants_piece(p))
                .cloned()
                .collect(),
            pack_seconds: m.pack_seconds,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::{rank_layouts, DType, ModelInfo, Scheme, TensorSpec};

    fn model() -> ModelInfo {
        let (hidden, inter) = (64u64, 128u64);
        let mut t = Vec::new();
        let mut add = |name: &str, shape: Vec<u64>| {
            t.push(TensorSpec {
                name: name.into(),
                dtype: DType::BF16,
                shape,
            })
        };
        add("model.embed_tokens.weight", vec![96, hidden]);
        add("lm_head.weight", vec![96, hidden]);
        add("model.norm.weight", vec![hidden]);
        let l = "model.layers.0";
        add(
            &format!("{l}.self_attn.q_proj.weight"),
            vec![hidden, hidden],
        );
        add(&format!("{l}.self_attn.k_proj.weight"), vec![32, hidden]);
        add(&format!("{l}.self_attn.v_proj.weight"), vec![32, hidden]);
        add(
            &format!("{l}.self_attn.o_proj.weight"),
            vec![hidden, hidden],
        );
        add(&format!("{l}.mlp.gate_proj.weight"), vec![inter, hidden]);
        add(&format!("{l}.mlp.up_proj.weight"), vec![inter, hidden]);
        add(&format!("{l}.mlp.down_proj.weight"), vec![hidden, inter]);
        add(&format!("{l}.input_layernorm.weight"), vec![hidden]);
        add(
            &format!("{l}.post_attention_layernorm.weight"),
            vec![hidden],
        );
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": hidden, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96,
            "num_hidden_layers": 1, "intermediate_size": inter, "tie_word_embeddings": false,
        });
        ModelInfo::from_hf_config(&cfg, t).unwrap()
    }

    #[test]
    fn a_tp_rank_wants_its_rows_and_a_fsdp_shard_outside_them_is_dropped() {
        let m = model();
        let tp2 = LayoutSpec {
            scheme: Scheme::VllmTp,
            world_size: 2,
        };
        let r0 = rank_layouts(&m, tp2).unwrap();
        let want = Want::for_ranks(&r0[..1]);
        assert_eq!(want.dest, Some((tp2, vec![0])));
        let q = "model.layers.0.self_attn.q_proj.weight";
        // Column-parallel: rank 0 of 2 holds rows 0..32 of 64.
        let top = TensorBox {
            global_offset: vec![0, 0],
            local_shape: vec![32, 64],
        };
        let bottom = TensorBox {
            global_offset: vec![32, 0],
            local_shape: vec![32, 64],
        };
        assert_eq!(want.regions[q], vec![top.clone()]);
        assert!(want.overlaps(q, &top));
        assert!(!want.overlaps(q, &bottom));
        assert!(!want.overlaps("no.such.tensor", &top));
    }
}
