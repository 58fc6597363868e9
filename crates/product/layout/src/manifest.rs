//! What a source publishes (its manifest) and what a worker reports back.
//!
//! These are the typed, storage- and planning-side forms; the control plane converts its proto
//! messages into them at the RPC edge.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{DType, Digest, LayoutSpec, Scheme, TensorBox};

/// Where a registered buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemDevice {
    /// Host memory (NIXL `DRAM_SEG`).
    Dram,
    /// GPU memory of the given CUDA device ordinal (NIXL `VRAM_SEG`).
    Vram(u32),
}

/// One shard a source holds: the box it owns of a global tensor, stored row-major (C order) at
/// `addr .. addr + len` of the source's registered arena.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// Global (checkpoint) tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub tensor: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape of the whole tensor (elements).
    pub global_shape: Vec<u64>,
    /// The box of the global tensor this shard holds.
    pub shard: TensorBox,
    /// Virtual address of the first byte in the source's process (NIXL descriptor address).
    pub addr: u64,
    /// Length in bytes; equals `numel(shard) * dtype.size_bytes()`.
    pub len: u64,
    /// Memory kind of the arena.
    pub device: MemDevice,
    /// blake3 of the shard's `len` bytes.
    pub digest: Digest,
}

/// One piece of a destination rank's needs that this source can serve: the intersection of the
/// source's shard with one box the destination rank needs, for one registered destination layout.
///
/// The digest covers the intersection's bytes in row-major order of the intersection box, so a
/// worker can verify exactly the bytes it pulled, whichever way it pulled them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestPiece {
    /// The destination layout this piece was cut for.
    pub layout: LayoutSpec,
    /// Destination rank within that layout.
    pub dest_rank: u32,
    /// Global tensor name.
    pub tensor: String,
    /// The intersection box (global coordinates).
    pub region: TensorBox,
    /// blake3 of the region's bytes in row-major order.
    pub digest: Digest,
    /// Where the publisher packed this region contiguously (row-major), if it did.
    pub packed_addr: Option<u64>,
}

/// A source's full manifest for one policy version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceManifest {
    /// Source slot (trainer rank) within the version's expected slots.
    pub slot: u32,
    /// The trainer layout this source belongs to.
    pub layout: LayoutSpec,
    /// NIXL agent name of the source.
    pub agent_name: String,
    /// NIXL agent metadata blob (from `getLocalMD`), loaded by pullers. A base64 string in JSON
    /// (an array of numbers is read too, as older journals wrote it).
    #[serde(with = "bytes_b64")]
    pub agent_metadata: Vec<u8>,
    /// Shards held.
    pub shards: Vec<ShardEntry>,
    /// Per-destination pieces with digests (and packed addresses where packed).
    pub pieces: Vec<DestPiece>,
    /// Seconds the publisher spent packing destination regions for this version.
    pub pack_seconds: f64,
}

/// A byte blob as a base64 string (RFC 4648, padded) in human-readable formats (JSON: 1.33 bytes
/// per byte, against 3.6 for an array of numbers); deserializing also takes the array of numbers
/// that older JSON holds. Other formats keep serde's default (a sequence of bytes).
mod bytes_b64 {
    use std::fmt;

    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;
    use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
    use serde::{Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&STANDARD.encode(b))
        } else {
            b.serialize(s)
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        if d.is_human_readable() {
            d.deserialize_any(Blob)
        } else {
            Vec::<u8>::deserialize(d)
        }
    }

    struct Blob;

    impl<'de> Visitor<'de> for Blob {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a base64 string or an array of bytes")
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
            STANDARD
                .decode(v)
                .map_err(|e| E::custom(format!("bad base64: {e}")))
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // The hint comes from the input: trust it only so far.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// A global tensor declared for a version (taken from the checkpoint's header/index).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
}

/// Per-rank digests of live or staged bytes: `tensors[name]` is the blake3 of that parameter's
/// bytes on that rank (vLLM parameter names for a `tp` layout).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankDigests {
    /// Rank within the worker's layout.
    pub rank: u32,
    /// Parameter name -> digest.
    pub tensors: BTreeMap<String, Digest>,
}

/// The policy version identity: a blake3 Merkle root over the digests of every published shard,
/// taken in (tensor name, box) order so it does not depend on publish order.
///
/// Leaf = blake3(name || 0 || box offsets and shape as u64 LE || shard digest); root = blake3 over
/// the sorted leaves.
pub fn version_digest<'a>(shards: impl IntoIterator<Item = &'a ShardEntry>) -> Digest {
    let shards: Vec<&ShardEntry> = shards.into_iter().collect();
    let (leaves, _) = crate::merkle::sorted_leaves(&shards);
    let mut root = blake3::Hasher::new();
    for leaf in &leaves {
        root.update(leaf);
    }
    root.finalize().into()
}

/// blake3 over the concatenation of `segments`, gathering small segments into a 64 KiB buffer
/// first so blake3 hashes many 1 KiB chunks at once with SIMD (feeding it 384-byte rows one at a
/// time is several times slower). Equals `Digest::of(&segments.concat())`.
pub fn digest_segments<'a>(segments: impl IntoIterator<Item = &'a [u8]>) -> Digest {
    const BUF: usize = 64 * 1024;
    let mut h = blake3::Hasher::new();
    let mut buf: Vec<u8> = Vec::with_capacity(BUF);
    for s in segments {
        if s.len() >= BUF {
            if !buf.is_empty() {
                h.update(&buf);
                buf.clear();
            }
            h.update(s);
            continue;
        }
        if buf.len() + s.len() > BUF {
            h.update(&buf);
            buf.clear();
        }
        buf.extend_from_slice(s);
    }
    h.update(&buf);
    h.finalize().into()
}

/// The geometry of a set of source manifests: a blake3 digest of everything a plan made from
/// them depends on, and of nothing that changes from one policy version to the next while the
/// trainer keeps its layout and its registered arenas. Two lists with equal geometry digests
/// give the same plan for the same destination ranks and cost model, so a worker can keep its
/// plan across versions and only look up the new digests ([`crate::plan::VerifyItem::published`]).
///
/// Covered, in list order: each source's slot, layout and NIXL agent name; each shard's tensor
/// name, dtype, global shape, box, address, length and memory kind; each published piece's
/// destination layout and rank, tensor name, region and packed address. Not covered: the shard
/// and piece digests, `pack_seconds` and the agent metadata blob (reloaded at every pull).
/// Every field is written with its length, so different lists cannot run together into equal
/// bytes. Cost: one pass over the manifests (`mx-lab bench plan` times it for Kimi-K2).
pub fn geometry_digest(sources: &[SourceManifest]) -> Digest {
    const BUF: usize = 64 * 1024;
    struct Sink {
        h: blake3::Hasher,
        buf: Vec<u8>,
    }
    impl Sink {
        fn u64(&mut self, v: u64) {
            self.buf.extend_from_slice(&v.to_le_bytes());
            if self.buf.len() >= BUF {
                self.h.update(&self.buf);
                self.buf.clear();
            }
        }
        fn str(&mut self, s: &str) {
            self.u64(s.len() as u64);
            self.buf.extend_from_slice(s.as_bytes());
        }
        fn dims(&mut self, d: &[u64]) {
            self.u64(d.len() as u64);
            for &x in d {
                self.u64(x);
            }
        }
        fn layout(&mut self, l: LayoutSpec) {
            // The declaration-order codes the scheme had as a field-less enum (digests of
            // existing layouts unchanged); a Megatron layout adds its sizes.
            match l.scheme {
                Scheme::Replicated => self.u64(0),
                Scheme::Fsdp => self.u64(1),
                Scheme::VllmTp => self.u64(2),
                Scheme::VllmTpEp => self.u64(3),
                Scheme::Megatron(d) => {
                    self.u64(4);
                    for x in [d.tp, d.pp, d.ep] {
                        self.u64(u64::from(x));
                    }
                }
            }
            self.u64(u64::from(l.world_size));
        }
    }
    let mut k = Sink {
        h: blake3::Hasher::new(),
        buf: Vec::with_capacity(BUF + 4096),
    };
    k.u64(sources.len() as u64);
    for m in sources {
        k.u64(u64::from(m.slot));
        k.layout(m.layout);
        k.str(&m.agent_name);
        k.u64(m.shards.len() as u64);
        for s in &m.shards {
            k.str(&s.tensor);
            k.str(s.dtype.as_str());
            k.dims(&s.global_shape);
            k.dims(&s.shard.global_offset);
            k.dims(&s.shard.local_shape);
            k.u64(s.addr);
            k.u64(s.len);
            match s.device {
                MemDevice::Dram => k.u64(0),
                MemDevice::Vram(d) => k.u64((1 << 32) | u64::from(d)),
            }
        }
        k.u64(m.pieces.len() as u64);
        for p in &m.pieces {
            k.layout(p.layout);
            k.u64(u64::from(p.dest_rank));
            k.str(&p.tensor);
            k.dims(&p.region.global_offset);
            k.dims(&p.region.local_shape);
            match p.packed_addr {
                None => k.u64(0),
                Some(a) => {
                    k.u64(1);
                    k.u64(a);
                }
            }
        }
    }
    k.h.update(&k.buf);
    k.h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_segments_equals_digest_of_concatenation() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let cuts = [0usize, 384, 768, 1000, 70_000, 70_001, 200_000, 300_000];
        let segs: Vec<&[u8]> = cuts.windows(2).map(|w| &data[w[0]..w[1]]).collect();
        assert_eq!(digest_segments(segs), Digest::of(&data));
        assert_eq!(digest_segments(std::iter::empty()), Digest::of(&[]));
    }

    #[test]
    #[allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
    fn agent_metadata_is_base64_in_json_and_the_old_array_form_still_reads() {
        let m = SourceManifest {
            slot: 1,
            layout: LayoutSpec {
                scheme: crate::Scheme::Fsdp,
                world_size: 2,
            },
            agent_name: "a".into(),
            agent_metadata: vec![0, 1, 2, 250, 255],
            shards: Vec::new(),
            pieces: Vec::new(),
            pack_seconds: 0.5,
        };
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains(r#""agent_metadata":"AAEC+v8=""#), "{json}");
        assert_eq!(serde_json::from_str::<SourceManifest>(&json).unwrap(), m);
        let old = json.replace(r#""AAEC+v8=""#, "[0,1,2,250,255]");
        assert_eq!(serde_json::from_str::<SourceManifest>(&old).unwrap(), m);
        let bad = json.replace(r#""AAEC+v8=""#, r#""AA!C""#);
        let err = serde_json::from_str::<SourceManifest>(&bad).unwrap_err();
        assert!(err.to_string().contains("bad base64"), "{err}");
        let over = json.replace(r#""AAEC+v8=""#, "[0,256]");
        assert!(serde_json::from_str::<SourceManifest>(&over).is_err());
    }
}
