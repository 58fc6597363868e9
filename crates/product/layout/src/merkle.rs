//! Proofs that some shards belong to a policy version, checked without the version's other
//! shards: what lets a worker fetch only the manifests its plan reads (bounded fan-out) and still
//! check the version's identity.
//!
//! A version id ([`crate::version_digest`]) is blake3 over the version's shard leaves (32 bytes
//! each) in digest order. blake3 is itself a Merkle tree: the input is cut into 1 KiB chunks (32
//! leaves each), and each parent node hashes its two children's chaining values, the left child
//! being the largest power of two of chunks short of the whole. So the id can be recomputed from
//! the chunks holding the leaves a worker received plus one chaining value for every subtree
//! holding none of them, as Bao does for byte ranges. No new hash: the id stays what it was, and
//! a proof is checked against it.
//!
//! Main types: [`LeafTree`] (the prover's side: the sorted leaves and every subtree's chaining
//! value, built once per version) and [`VersionProof`] (what travels: the leaf count, the
//! position of each shard sent, and the hashes of the proof).
//!
//! A proof for `k` shards in `r` runs of neighbouring leaves holds at most `r` chunks of 32
//! leaves plus `r * log2(chunks)` chaining values: 32 bytes each.
//!
//! Left out: which shards a worker wants (see [`crate::want`]) and the wire form (mx-control).

use blake3::hazmat::{
    merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};

use crate::{Digest, Error, ShardEntry, VersionId};

/// Leaves per blake3 chunk (a chunk is 1 KiB, a leaf 32 bytes).
const LEAVES_PER_CHUNK: u64 = (blake3::CHUNK_LEN / LEAF_BYTES) as u64;

/// Bytes of one leaf.
const LEAF_BYTES: usize = 32;

/// Most leaves a version may have for a proof: 2^40 (its leaf bytes stay far below `u64::MAX`).
pub const MAX_LEAVES: u64 = 1 << 40;

/// The leaf of one shard in a version's Merkle tree: blake3 of the tensor name, a 0 byte, the
/// box's offsets then shape (u64 little-endian each) and the shard's digest.
pub fn shard_leaf(s: &ShardEntry) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(s.tensor.as_bytes());
    h.update(&[0]);
    for v in s.shard.global_offset.iter().chain(&s.shard.local_shape) {
        h.update(&v.to_le_bytes());
    }
    h.update(s.digest.as_bytes());
    *h.finalize().as_bytes()
}

/// The leaves of `shards` in digest order ((tensor name, box, leaf), as the version id takes
/// them) and, for each shard in input order, the index of its leaf in that order. Equal shards
/// (same tensor, box and digest) get distinct, neighbouring indices.
pub fn sorted_leaves(shards: &[&ShardEntry]) -> (Vec<[u8; 32]>, Vec<u64>) {
    let leaves: Vec<[u8; 32]> = shards.iter().map(|s| shard_leaf(s)).collect();
    let mut order: Vec<usize> = (0..shards.len()).collect();
    order.sort_by(|&a, &b| {
        (&shards[a].tensor, &shards[a].shard, &leaves[a]).cmp(&(
            &shards[b].tensor,
            &shards[b].shard,
            &leaves[b],
        ))
    });
    let mut positions = vec![0u64; shards.len()];
    for (pos, &i) in order.iter().enumerate() {
        positions[i] = pos as u64;
    }
    let sorted = order.iter().map(|&i| leaves[i]).collect();
    (sorted, positions)
}

/// Chunks of `n` leaves (one for none: blake3 of nothing is one empty chunk).
fn chunks_of(n: u64) -> u64 {
    n.div_ceil(LEAVES_PER_CHUNK).max(1)
}

/// Chunks in the left subtree of a subtree of `n >= 2` chunks: the largest power of two below
/// `n` (blake3's `left_subtree_len`, counted in chunks).
fn left_chunks(n: u64) -> u64 {
    debug_assert!(n >= 2);
    1u64 << (63 - (n - 1).leading_zeros())
}

/// The range of leaf indices in chunk `c` of `leaf_count` leaves.
fn chunk_leaves(c: u64, leaf_count: u64) -> std::ops::Range<u64> {
    let start = c.saturating_mul(LEAVES_PER_CHUNK).min(leaf_count);
    start..start.saturating_add(LEAVES_PER_CHUNK).min(leaf_count)
}

/// The chaining value of chunk `c` made of `leaves` (not the root).
fn chunk_cv<'a>(c: u64, leaves: impl Iterator<Item = &'a [u8; 32]>) -> ChainingValue {
    let mut h = blake3::Hasher::new();
    // Chunk offsets are multiples of the chunk length and a chunk fits any subtree, as
    // `set_input_offset` and `update` require.
    h.set_input_offset(c * blake3::CHUNK_LEN as u64);
    for l in leaves {
        h.update(l);
    }
    h.finalize_non_root()
}

/// A version's leaves in digest order with the chaining value of every subtree of blake3's tree
/// over them: what a control plane keeps per version to answer [`LeafTree::prove`] in time
/// proportional to the proof. Memory: 32 bytes per leaf plus 64 bytes per 32 leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafTree {
    /// Leaves in digest order.
    leaves: Vec<[u8; 32]>,
    /// Chaining values of the subtrees, pre-order (a subtree of `n` chunks at `i`: its left
    /// child at `i + 1`, its right child at `i + 2 * left_chunks(n)`); `2 * chunks - 1` entries
    /// (one unused entry for a single chunk: its hash is the root).
    cvs: Vec<ChainingValue>,
}

impl LeafTree {
    /// The tree of `shards` and, for each shard in input order, the index of its leaf.
    ///
    /// # Errors
    /// [`Error::ProofMalformed`] past [`MAX_LEAVES`] shards.
    pub fn new(shards: &[&ShardEntry]) -> Result<(LeafTree, Vec<u64>), Error> {
        let (leaves, positions) = sorted_leaves(shards);
        Ok((LeafTree::from_sorted(leaves)?, positions))
    }

    /// The tree of leaves already in digest order.
    ///
    /// # Errors
    /// [`Error::ProofMalformed`] past [`MAX_LEAVES`] leaves.
    pub fn from_sorted(leaves: Vec<[u8; 32]>) -> Result<LeafTree, Error> {
        let n = leaves.len() as u64;
        if n > MAX_LEAVES {
            return Err(malformed(format!("{n} leaves: more than {MAX_LEAVES}")));
        }
        let chunks = chunks_of(n);
        let mut t = LeafTree {
            leaves,
            cvs: vec![[0; 32]; (2 * chunks - 1) as usize],
        };
        if chunks > 1 {
            // One chunk is hashed as the root, never as a chaining value (and blake3 gives an
            // empty chunk none).
            t.build(0, 0, chunks);
        }
        Ok(t)
    }

    /// Fills the chaining values of the subtree of `n` chunks from chunk `a`, at pre-order `i`.
    fn build(&mut self, i: usize, a: u64, n: u64) -> ChainingValue {
        let cv = if n == 1 {
            let r = chunk_leaves(a, self.len());
            chunk_cv(a, self.leaves[r.start as usize..r.end as usize].iter())
        } else {
            let l = left_chunks(n);
            let left = self.build(i + 1, a, l);
            let right = self.build(i + 2 * l as usize, a + l, n - l);
            merge_subtrees_non_root(&left, &right, Mode::Hash)
        };
        self.cvs[i] = cv;
        cv
    }

    /// Number of leaves (shards of the version).
    pub fn len(&self) -> u64 {
        self.leaves.len() as u64
    }

    /// True when the version has no shards.
    pub fn is_empty(&self) -> bool {
        self.leaves.is_empty()
    }

    /// The leaf at `position` in digest order.
    pub fn leaf(&self, position: u64) -> Option<&[u8; 32]> {
        usize::try_from(position)
            .ok()
            .and_then(|p| self.leaves.get(p))
    }

    /// The Merkle root: the version id ([`crate::version_digest`] of the same shards).
    pub fn root(&self) -> Digest {
        let chunks = chunks_of(self.len());
        if chunks == 1 {
            return Digest(*blake3::hash(self.leaves.concat().as_slice()).as_bytes());
        }
        let l = left_chunks(chunks) as usize;
        Digest(*merge_subtrees_root(&self.cvs[1], &self.cvs[2 * l], Mode::Hash).as_bytes())
    }

    /// The proof for the shards at `positions` (in the order the answer lists them): every
    /// chunk holding one of them whole, and the chaining value of every largest subtree holding
    /// none, left to right.
    ///
    /// # Errors
    /// [`Error::ProofMalformed`] when a position is past the leaves or given twice.
    pub fn prove(&self, positions: Vec<u64>) -> Result<VersionProof, Error> {
        let wanted = sorted_unique(&positions, self.len())?;
        let mut nodes = Vec::new();
        let chunks = chunks_of(self.len());
        if chunks == 1 {
            nodes.extend_from_slice(&self.leaves);
        } else {
            let l = left_chunks(chunks);
            self.prove_subtree(1, 0, l, &wanted, &mut nodes);
            self.prove_subtree(2 * l as usize, l, chunks - l, &wanted, &mut nodes);
        }
        Ok(VersionProof {
            leaf_count: self.len(),
            positions,
            nodes,
        })
    }

    fn prove_subtree(&self, i: usize, a: u64, n: u64, wanted: &[u64], out: &mut Vec<[u8; 32]>) {
        let leaves = LEAVES_PER_CHUNK * a..LEAVES_PER_CHUNK * (a + n);
        if !touches(wanted, &leaves) {
            out.push(self.cvs[i]);
        } else if n == 1 {
            let r = chunk_leaves(a, self.len());
            out.extend_from_slice(&self.leaves[r.start as usize..r.end as usize]);
        } else {
            let l = left_chunks(n);
            self.prove_subtree(i + 1, a, l, wanted, out);
            self.prove_subtree(i + 2 * l as usize, a + l, n - l, wanted, out);
        }
    }
}

/// True when a sorted `wanted` has an index in `range`.
fn touches(wanted: &[u64], range: &std::ops::Range<u64>) -> bool {
    let i = wanted.partition_point(|&w| w < range.start);
    wanted.get(i).is_some_and(|&w| w < range.end)
}

fn malformed(reason: String) -> Error {
    Error::ProofMalformed { reason }
}

/// `positions` sorted, each checked below `leaf_count` and given once.
fn sorted_unique(positions: &[u64], leaf_count: u64) -> Result<Vec<u64>, Error> {
    let mut w = positions.to_vec();
    w.sort_unstable();
    for pair in w.windows(2) {
        if pair[0] == pair[1] {
            return Err(malformed(format!("leaf {} is given twice", pair[0])));
        }
    }
    if let Some(&last) = w.last() {
        if last >= leaf_count {
            return Err(malformed(format!(
                "leaf {last} is past the version's {leaf_count} leaves"
            )));
        }
    }
    Ok(w)
}

/// The proof that the shards of an answer belong to a version: their leaf positions and the
/// hashes that, with those leaves, give the version id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VersionProof {
    /// Leaves (shards) of the whole version.
    pub leaf_count: u64,
    /// For each shard of the answer, in its order (manifest by manifest, shard by shard): the
    /// index of its leaf in digest order.
    pub positions: Vec<u64>,
    /// Left to right over blake3's tree: the leaves (32 bytes each) of every chunk holding a
    /// position, whole; the chaining value of every largest subtree holding none. With fewer
    /// than 33 leaves in all, every leaf.
    pub nodes: Vec<[u8; 32]>,
}

/// A cursor over a proof's nodes, keeping the leaves at the wanted positions.
struct Walk<'a> {
    nodes: std::slice::Iter<'a, [u8; 32]>,
    leaf_count: u64,
    wanted: &'a [u64],
    /// The proven leaf of each wanted position, in `wanted` order.
    found: Vec<[u8; 32]>,
}

impl Walk<'_> {
    fn next(&mut self) -> Result<&[u8; 32], Error> {
        self.nodes
            .next()
            .ok_or_else(|| malformed("the proof ends early".into()))
    }

    /// The chunk `c`'s leaves from the proof, keeping the wanted ones.
    fn chunk(&mut self, c: u64) -> Result<Vec<[u8; 32]>, Error> {
        let r = chunk_leaves(c, self.leaf_count);
        let mut leaves = Vec::with_capacity((r.end - r.start) as usize);
        for pos in r {
            let l = *self.next()?;
            if self.wanted.binary_search(&pos).is_ok() {
                self.found.push(l);
            }
            leaves.push(l);
        }
        Ok(leaves)
    }

    fn subtree(&mut self, a: u64, n: u64) -> Result<ChainingValue, Error> {
        let range = LEAVES_PER_CHUNK * a..LEAVES_PER_CHUNK * (a + n);
        if !touches(self.wanted, &range) {
            return self.next().copied();
        }
        if n == 1 {
            let leaves = self.chunk(a)?;
            return Ok(chunk_cv(a, leaves.iter()));
        }
        let l = left_chunks(n);
        let left = self.subtree(a, l)?;
        let right = self.subtree(a + l, n - l)?;
        Ok(merge_subtrees_non_root(&left, &right, Mode::Hash))
    }
}

impl VersionProof {
    /// The root this proof gives, and the proven leaf at each of its positions (in `positions`
    /// order).
    ///
    /// # Errors
    /// [`Error::ProofMalformed`]: too many leaves, a position past them or given twice, too few
    /// or too many hashes for the tree's shape.
    pub fn root(&self) -> Result<(Digest, Vec<[u8; 32]>), Error> {
        let n = self.leaf_count;
        if n > MAX_LEAVES {
            return Err(malformed(format!("{n} leaves: more than {MAX_LEAVES}")));
        }
        let wanted = sorted_unique(&self.positions, n)?;
        let chunks = chunks_of(n);
        let mut w = Walk {
            nodes: self.nodes.iter(),
            leaf_count: n,
            wanted: &wanted,
            found: Vec::with_capacity(wanted.len()),
        };
        let root = if chunks == 1 {
            // Every leaf, hashed as blake3's root chunk.
            let leaves = w.chunk(0)?;
            *blake3::hash(leaves.concat().as_slice()).as_bytes()
        } else {
            let l = left_chunks(chunks);
            let left = w.subtree(0, l)?;
            let right = w.subtree(l, chunks - l)?;
            *merge_subtrees_root(&left, &right, Mode::Hash).as_bytes()
        };
        let left_over = w.nodes.len();
        if left_over != 0 {
            return Err(malformed(format!(
                "{left_over} hashes left over after the tree"
            )));
        }
        // `found` is in sorted order; give each position its leaf.
        let by_position = self
            .positions
            .iter()
            .map(|p| {
                wanted
                    .binary_search(p)
                    .ok()
                    .and_then(|i| w.found.get(i).copied())
                    .ok_or_else(|| malformed(format!("leaf {p} is not in the proof")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((Digest(root), by_position))
    }

    /// Checks that `shards` (the answer's shards with their source slots, in the order of
    /// `positions`) belong to `version`: the proof's root is the version id, and each shard's
    /// leaf (its tensor, box and digest) is the proven leaf at its position.
    ///
    /// # Errors
    /// [`Error::ProofMalformed`] (a shape that does not fit, or a shard count other than the
    /// positions'); [`Error::ProofRoot`] when the proof's hashes give another root (a leaf or
    /// subtree hash in it is wrong); [`Error::ShardNotInVersion`] naming the first shard whose
    /// leaf is not the version's at its position (a tampered tensor, box or digest).
    pub fn verify<'a>(
        &self,
        version: VersionId,
        shards: impl IntoIterator<Item = (u32, &'a ShardEntry)>,
    ) -> Result<(), Error> {
        let (root, leaves) = self.root()?;
        if root != version.0 {
            return Err(Error::ProofRoot {
                version: version.to_string(),
                found: VersionId(root).to_string(),
            });
        }
        let mut count = 0usize;
        for (slot, s) in shards {
            let (Some(&position), Some(leaf)) = (self.positions.get(count), leaves.get(count))
            else {
                return Err(malformed(format!(
                    "more shards than the proof's {} positions",
                    self.positions.len()
                )));
            };
            if shard_leaf(s) != *leaf {
                return Err(Error::ShardNotInVersion {
                    version: version.to_string(),
                    slot,
                    tensor: s.tensor.clone(),
                    region: s.shard.to_string(),
                    position,
                });
            }
            count += 1;
        }
        if count != self.positions.len() {
            return Err(malformed(format!(
                "{count} shards for the proof's {} positions (a shard was dropped)",
                self.positions.len()
            )));
        }
        Ok(())
    }

    /// Bytes of the proof's hashes and positions on the wire, about (positions as 8 bytes).
    pub fn approx_bytes(&self) -> u64 {
        (self.nodes.len() as u64 * LEAF_BYTES as u64)
            .saturating_add(self.positions.len() as u64 * 8)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{version_digest, DType, MemDevice, TensorBox};

    fn shard(t: usize, row: u64, salt: u8) -> ShardEntry {
        ShardEntry {
            tensor: format!("t{t:03}"),
            dtype: DType::F32,
            global_shape: vec![64, 4],
            shard: TensorBox {
                global_offset: vec![row, 0],
                local_shape: vec![1, 4],
            },
            addr: 0,
            len: 16,
            device: MemDevice::Dram,
            digest: Digest::of(&[salt, t as u8, row as u8]),
        }
    }

    fn shards(n: usize) -> Vec<ShardEntry> {
        // Published out of digest order on purpose.
        (0..n)
            .rev()
            .map(|i| shard(i % 7, (i / 7) as u64, 1))
            .collect()
    }

    #[test]
    fn root_is_the_version_id_at_every_size() {
        for n in [
            0, 1, 2, 31, 32, 33, 63, 64, 65, 96, 97, 129, 300, 1025, 2049,
        ] {
            let s = shards(n);
            let refs: Vec<&ShardEntry> = s.iter().collect();
            let (t, _) = LeafTree::new(&refs).unwrap();
            assert_eq!(t.root(), version_digest(&s), "{n} shards");
        }
    }

    proptest! {
        #[test]
        fn proofs_verify_and_name_a_forged_shard(
            n in 0usize..700,
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..40),
            flip in any::<prop::sample::Index>(),
        ) {
            let s = shards(n);
            let refs: Vec<&ShardEntry> = s.iter().collect();
            let (t, pos) = LeafTree::new(&refs).unwrap();
            let version = VersionId(version_digest(&s));
            let mut chosen: Vec<usize> = if n == 0 {
                Vec::new()
            } else {
                picks.iter().map(|i| i.index(n)).collect()
            };
            chosen.sort_unstable();
            chosen.dedup();
            let proof = t.prove(chosen.iter().map(|&i| pos[i]).collect()).unwrap();
            let sent = || chosen.iter().map(|&i| (0u32, &s[i]));
            proof.verify(version, sent()).unwrap();
            // At most one chunk per chosen shard and log2(chunks) chaining values each.
            let bound = 32 + chosen.len() * (32 + 2 * 64);
            prop_assert!(proof.nodes.len() <= bound.max(n));
            if !chosen.is_empty() {
                // A forged digest on one shard is named.
                let k = flip.index(chosen.len());
                let mut forged: Vec<ShardEntry> = chosen.iter().map(|&i| s[i].clone()).collect();
                forged[k].digest = Digest::of(b"forged");
                let err = proof
                    .verify(version, forged.iter().map(|x| (3u32, x)))
                    .unwrap_err();
                let named = matches!(&err, Error::ShardNotInVersion { tensor, slot: 3, .. }
                    if *tensor == forged[k].tensor);
                prop_assert!(named, "{err}");
                // A shard left out of the answer is refused.
                let fewer = chosen.iter().skip(1).map(|&i| (0u32, &s[i]));
                prop_assert!(proof.verify(version, fewer).is_err());
            }
            if !proof.nodes.is_empty() {
                // Any forged hash in the proof misses the root.
                let mut bad = proof.clone();
                let k = flip.index(bad.nodes.len());
                bad.nodes[k][0] ^= 1;
                let err = bad.verify(version, sent()).unwrap_err();
                let root = matches!(err, Error::ProofRoot { .. });
                prop_assert!(root, "{err}");
            }
        }
    }

    #[test]
    fn malformed_proofs_are_refused() {
        let s = shards(100);
        let refs: Vec<&ShardEntry> = s.iter().collect();
        let (t, pos) = LeafTree::new(&refs).unwrap();
        let version = VersionId(t.root());
        let proof = t.prove(vec![pos[5], pos[50]]).unwrap();
        let sent = [(0u32, &s[5]), (0u32, &s[50])];
        proof.verify(version, sent).unwrap();
        let mut short = proof.clone();
        short.nodes.pop();
        assert!(matches!(
            short.verify(version, sent),
            Err(Error::ProofMalformed { .. })
        ));
        let mut long = proof.clone();
        long.nodes.push([0; 32]);
        assert!(matches!(
            long.verify(version, sent),
            Err(Error::ProofMalformed { .. })
        ));
        let mut twice = proof.clone();
        twice.positions[1] = twice.positions[0];
        assert!(matches!(
            twice.verify(version, sent),
            Err(Error::ProofMalformed { .. })
        ));
        let mut huge = proof.clone();
        huge.leaf_count = u64::MAX;
        assert!(huge.verify(version, sent).is_err());
        let mut past = proof;
        past.positions[1] = 100;
        assert!(past.verify(version, sent).is_err());
        assert!(t.prove(vec![100]).is_err());
    }
}
