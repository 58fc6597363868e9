//! Bounded fan-out: a worker's `GetVersion` names what its plan reads ([`Want`]) and is answered
//! with only the shards and pieces that overlap it, plus a Merkle proof
//! ([`mx_layout::merkle::VersionProof`]) that those shards are the version's, so that no worker
//! receives every manifest of a version (Kimi-K2's are hundreds of MiB) and every worker still
//! checks the version id.
//!
//! Per READY version the control plane keeps an [`Index`], built on the first such request and
//! kept while the version's manifests do not change (its revision): the version's Merkle tree
//! over the sorted shard leaves, where each shard sits in it, each tensor's shards and each
//! destination's pieces. An answer then costs time in the shards and pieces it holds, not in
//! the version's. At most [`MAX_CACHED`] versions are kept (the newest requested).
//!
//! Left out: peers' manifests are filtered by a scan (peers are vouched for by the control
//! plane, not proven); a version not READY yet is answered filtered and without a proof.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use mx_layout::merkle::LeafTree;
use mx_layout::{Digest, LayoutSpec, SourceManifest, Want};

use crate::types::{PeerSource, VersionInfo};
use crate::Error;

/// Most versions whose [`Index`] is kept.
pub(crate) const MAX_CACHED: usize = 4;

/// A version's sources by reference, as the state holds them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sources<'a> {
    /// Bumped by every publish into the version.
    pub(crate) revision: u64,
    /// Trainer manifests by slot.
    pub(crate) slots: &'a BTreeMap<u32, SourceManifest>,
    /// Peer manifests by worker id.
    pub(crate) peers: &'a BTreeMap<String, SourceManifest>,
}

/// Where one shard is: its source slot, its index in that manifest's shards, its leaf's index.
#[derive(Debug, Clone, Copy)]
struct Loc {
    slot: u32,
    shard: u32,
    position: u64,
}

/// A READY version's Merkle tree and lookups over its manifests (see the module docs).
#[derive(Debug)]
pub(crate) struct Index {
    digest: Digest,
    revision: u64,
    tree: LeafTree,
    /// Tensor name -> its shards.
    by_tensor: HashMap<String, Vec<Loc>>,
    /// (destination layout, rank) -> (slot, index in that manifest's pieces).
    by_dest: HashMap<(LayoutSpec, u32), Vec<(u32, u32)>>,
}

impl Index {
    /// Indexes `slots` of a version whose id is `digest`.
    ///
    /// # Errors
    /// [`Error::Fanout`] when the shards' Merkle root is not `digest` (the state is
    /// inconsistent), or past the tree's leaf limit.
    fn build(
        digest: Digest,
        revision: u64,
        slots: &BTreeMap<u32, SourceManifest>,
    ) -> Result<Index, Error> {
        let mut refs = Vec::new();
        let mut at: Vec<(u32, u32)> = Vec::new();
        for (&slot, m) in slots {
            for (i, s) in m.shards.iter().enumerate() {
                refs.push(s);
                at.push((
                    slot,
                    u32::try_from(i).map_err(|_| internal("shard index over u32"))?,
                ));
            }
        }
        let (tree, positions) =
            LeafTree::new(&refs).map_err(|e| internal(&format!("version tree: {e}")))?;
        if tree.root() != digest {
            return Err(internal("the shards' Merkle root is not the version id"));
        }
        let mut by_tensor: HashMap<String, Vec<Loc>> = HashMap::new();
        for ((s, &(slot, shard)), &position) in refs.iter().zip(&at).zip(&positions) {
            by_tensor.entry(s.tensor.clone()).or_default().push(Loc {
                slot,
                shard,
                position,
            });
        }
        let mut by_dest: HashMap<(LayoutSpec, u32), Vec<(u32, u32)>> = HashMap::new();
        for (&slot, m) in slots {
            for (i, p) in m.pieces.iter().enumerate() {
                let i = u32::try_from(i).map_err(|_| internal("piece index over u32"))?;
                by_dest
                    .entry((p.layout, p.dest_rank))
                    .or_default()
                    .push((slot, i));
            }
        }
        Ok(Index {
            digest,
            revision,
            tree,
            by_tensor,
            by_dest,
        })
    }
}

fn internal(what: &str) -> Error {
    Error::Fanout {
        reason: what.to_string(),
    }
}

/// The [`Index`]es of the last versions asked for with a want.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    entries: Mutex<Vec<(String, Arc<Index>)>>,
}

impl Cache {
    /// The index of `label` at (`digest`, `sources.revision`), built when missing or stale.
    fn get(&self, label: &str, digest: Digest, sources: Sources<'_>) -> Result<Arc<Index>, Error> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = entries.iter().position(|(l, _)| l == label) {
            let (_, idx) = entries.remove(i);
            if idx.digest == digest && idx.revision == sources.revision {
                entries.push((label.to_string(), Arc::clone(&idx)));
                return Ok(idx);
            }
        }
        let idx = Arc::new(Index::build(digest, sources.revision, sources.slots)?);
        if entries.len() >= MAX_CACHED {
            entries.remove(0);
        }
        entries.push((label.to_string(), Arc::clone(&idx)));
        Ok(idx)
    }
}

/// `info` (with its manifests and peers empty, as [`crate::state::State::version_sources`]
/// gives it) filled with what `want` selects of `sources`: the wanted shards and pieces of each
/// manifest (sources with none left out), the peers likewise, only the declared tensors `want`
/// names, and for a version with an id the proof of the manifests' shards.
///
/// # Errors
/// [`Error::Fanout`] when the version's index cannot be built.
pub(crate) fn answer(
    cache: &Cache,
    mut info: VersionInfo,
    sources: Sources<'_>,
    want: &Want,
) -> Result<VersionInfo, Error> {
    info.tensors.retain(|t| want.regions.contains_key(&t.name));
    info.peers = sources
        .peers
        .iter()
        .filter_map(|(w, m)| {
            want.select(m).map(|manifest| PeerSource {
                worker_id: w.clone(),
                manifest,
            })
        })
        .collect();
    let Some(digest) = info.version_digest else {
        info.manifests = sources
            .slots
            .values()
            .filter_map(|m| want.select(m))
            .collect();
        return Ok(info);
    };
    let idx = cache.get(&info.label, digest, sources)?;
    // slot -> (shard index, leaf position) wanted, and piece indices wanted.
    let mut shards: BTreeMap<u32, Vec<(u32, u64)>> = BTreeMap::new();
    for (tensor, boxes) in &want.regions {
        for loc in idx.by_tensor.get(tensor).into_iter().flatten() {
            let Some(s) = shard_at(sources.slots, loc.slot, loc.shard) else {
                return Err(internal("a shard moved without a new revision"));
            };
            if boxes.iter().any(|b| b.intersect(&s.shard).is_some()) {
                shards
                    .entry(loc.slot)
                    .or_default()
                    .push((loc.shard, loc.position));
            }
        }
    }
    let mut pieces: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut add_piece = |slot: u32, i: u32, p: &mx_layout::DestPiece| {
        if shards.contains_key(&slot) && want.wants_piece(p) {
            pieces.entry(slot).or_default().push(i);
        }
    };
    match &want.dest {
        Some((layout, ranks)) => {
            for r in ranks {
                for &(slot, i) in idx.by_dest.get(&(*layout, *r)).into_iter().flatten() {
                    if let Some(p) = sources
                        .slots
                        .get(&slot)
                        .and_then(|m| m.pieces.get(i as usize))
                    {
                        add_piece(slot, i, p);
                    }
                }
            }
        }
        None => {
            for (&slot, m) in sources.slots {
                for (i, p) in m.pieces.iter().enumerate() {
                    add_piece(slot, i as u32, p);
                }
            }
        }
    }
    let mut positions = Vec::new();
    let mut manifests = Vec::with_capacity(shards.len());
    for (slot, mut list) in shards {
        let Some(m) = sources.slots.get(&slot) else {
            continue;
        };
        list.sort_unstable();
        let mut kept = pieces.remove(&slot).unwrap_or_default();
        kept.sort_unstable();
        positions.extend(list.iter().map(|&(_, p)| p));
        manifests.push(SourceManifest {
            slot: m.slot,
            layout: m.layout,
            agent_name: m.agent_name.clone(),
            agent_metadata: m.agent_metadata.clone(),
            shards: list
                .iter()
                .filter_map(|&(i, _)| m.shards.get(i as usize).cloned())
                .collect(),
            pieces: kept
                .iter()
                .filter_map(|&i| m.pieces.get(i as usize).cloned())
                .collect(),
            pack_seconds: m.pack_seconds,
        });
    }
    info.manifests = manifests;
    info.proof = Some(
        idx.tree
            .prove(positions)
            .map_err(|e| internal(&format!("proof: {e}")))?,
    );
    Ok(info)
}

fn shard_at(
    slots: &BTreeMap<u32, SourceManifest>,
    slot: u32,
    shard: u32,
) -> Option<&mx_layout::ShardEntry> {
    slots.get(&slot)?.shards.get(shard as usize)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use mx_layout::{
        DType, DestPiece, MemDevice, Scheme, ShardEntry, TensorBox, TensorSpec, VersionId,
    };

    use super::*;
    use crate::state::{Record, State};

    const FSDP2: LayoutSpec = LayoutSpec {
        scheme: Scheme::Fsdp,
        world_size: 2,
    };
    const TP2: LayoutSpec = LayoutSpec {
        scheme: Scheme::VllmTp,
        world_size: 2,
    };

    fn rows(off: u64, n: u64) -> TensorBox {
        TensorBox {
            global_offset: vec![off, 0],
            local_shape: vec![n, 4],
        }
    }

    /// Slot `slot` of fsdp:2 over tensors t0..t5 of 8x4: rows 4*slot..4*slot+4, with pieces
    /// cut for tp:2 (rank r holds rows 4r..4r+4, so each slot serves exactly one rank).
    fn manifest(slot: u32) -> SourceManifest {
        let mut m = SourceManifest {
            slot,
            layout: FSDP2,
            agent_name: format!("src{slot}"),
            agent_metadata: vec![1, 2, 3],
            shards: Vec::new(),
            pieces: Vec::new(),
            pack_seconds: 0.0,
        };
        for t in 0..6 {
            let b = rows(4 * u64::from(slot), 4);
            m.shards.push(ShardEntry {
                tensor: format!("t{t}"),
                dtype: DType::F32,
                global_shape: vec![8, 4],
                digest: Digest::of(format!("t{t}{b}").as_bytes()),
                len: 64,
                shard: b.clone(),
                addr: 4096 * (t + 1),
                device: MemDevice::Dram,
            });
            m.pieces.push(DestPiece {
                layout: TP2,
                dest_rank: slot,
                tensor: format!("t{t}"),
                digest: Digest::of(format!("piece t{t}{b}").as_bytes()),
                region: b,
                packed_addr: None,
            });
        }
        m
    }

    fn publish(st: &mut State, m: SourceManifest) {
        st.apply(Record::Publish {
            label: "v".into(),
            manifest: m,
        })
        .unwrap();
    }

    fn ask(cache: &Cache, st: &State, want: &Want) -> VersionInfo {
        let (info, src) = st.version_sources("v").unwrap();
        answer(cache, info, src, want).unwrap()
    }

    #[test]
    fn answers_only_overlapping_shards_with_a_proof_and_follow_new_pieces() {
        let mut st = State::new();
        st.apply(Record::Declare {
            label: "v".into(),
            trainer_layout: FSDP2,
            tensors: (0..6)
                .map(|t| TensorSpec {
                    name: format!("t{t}"),
                    dtype: DType::F32,
                    shape: vec![8, 4],
                })
                .collect(),
        })
        .unwrap();
        let cache = Cache::default();
        // Rank 1 of tp:2 reads rows 4..8 of t1 and t4.
        let mut want = Want {
            dest: Some((TP2, vec![1])),
            ..Want::default()
        };
        for t in ["t1", "t4"] {
            want.regions.insert(t.into(), vec![rows(4, 4)]);
        }
        publish(&mut st, manifest(1));
        // Not READY: filtered, no proof (there is no id yet).
        let early = ask(&cache, &st, &want);
        assert!(early.proof.is_none());
        assert_eq!(early.manifests[0].shards.len(), 2);
        publish(&mut st, manifest(0));
        let id = VersionId(st.version_info("v").unwrap().version_digest.unwrap());
        let a = ask(&cache, &st, &want);
        assert_eq!(a.manifests.len(), 1, "slot 0 holds nothing rank 1 reads");
        let m = &a.manifests[0];
        assert_eq!(m.slot, 1);
        let names: Vec<&str> = m.shards.iter().map(|s| s.tensor.as_str()).collect();
        assert_eq!(names, ["t1", "t4"]);
        assert_eq!(m.pieces.len(), 2);
        assert_eq!(m.agent_metadata, vec![1, 2, 3]);
        let tensors: Vec<&str> = a.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(tensors, ["t1", "t4"]);
        let proof = a.proof.as_ref().unwrap();
        assert_eq!(proof.leaf_count, 12);
        let shards = || {
            a.manifests
                .iter()
                .flat_map(|m| m.shards.iter().map(move |s| (m.slot, s)))
        };
        proof.verify(id, shards()).unwrap();
        // Asked again: the cached index answers the same.
        assert_eq!(ask(&cache, &st, &want), a);
        // Slot 1 extended with a piece for another layout's rank 1 overlapping the rows: a new
        // revision, so the index is rebuilt and the piece is found (and only with no dest named).
        let mut ext = manifest(1);
        let mut p = ext.pieces[1].clone();
        p.layout = LayoutSpec {
            scheme: Scheme::Replicated,
            world_size: 2,
        };
        ext.pieces.push(p);
        publish(&mut st, ext);
        assert_eq!(ask(&cache, &st, &want).manifests[0].pieces.len(), 2);
        let any = ask(&cache, &st, &want.clone().any_dest());
        assert_eq!(any.manifests[0].pieces.len(), 3);
        any.proof.as_ref().unwrap().verify(id, shards()).unwrap();
        // A want naming nothing of the version gets no manifests and a proof of none.
        let none = ask(&cache, &st, &Want::default());
        assert!(none.manifests.is_empty());
        none.proof.unwrap().verify(id, std::iter::empty()).unwrap();
    }
}
