//! The artifact manifest (`<prefix>/mx-artifact.json`): what an artifact holds and how each byte
//! of each tensor is found and verified. Parsed strictly (unknown fields and repeated keys are
//! errors) and validated with checked arithmetic before any read is planned from it.

use std::collections::HashSet;

use mx_layout::{DType, DestPiece, Digest, VersionId};
use serde::{Deserialize, Serialize};

use crate::Error;

/// The `format` value this crate writes and reads.
pub const FORMAT: &str = "mx-artifact/1";
/// The manifest's object name under the artifact's prefix.
pub const MANIFEST_NAME: &str = "mx-artifact.json";
/// The Hugging Face index written beside canonical safetensors files.
pub const INDEX_NAME: &str = "model.safetensors.index.json";
/// Largest delta chunk (bytes of a tensor's row-major range) a reader accepts.
pub const MAX_CHUNK_BYTES: u64 = 256 << 20;

/// What an artifact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// Whole tensors in Hugging Face safetensors files with an index.
    Canonical,
    /// Exact-base XOR delta: `target = base ^ delta`, byte for byte, in fixed ranges of each
    /// tensor's row-major bytes, each range zstd-compressed on its own.
    Delta,
}

/// One tensor of the version the artifact holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// Checkpoint tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (elements, row-major).
    pub shape: Vec<u64>,
    /// blake3 of the whole tensor's row-major bytes in the target version.
    pub digest: Digest,
}

/// One object of the artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectEntry {
    /// Object name under the artifact's prefix.
    pub name: String,
    /// Length in bytes.
    pub bytes: u64,
}

/// Where a tensor's bytes lie in a canonical artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Location {
    /// Index into [`ArtifactManifest::objects`].
    pub object: u32,
    /// Byte offset of the tensor's first byte in that object (safetensors header included).
    pub offset: u64,
}

/// One compressed range of a delta: the XOR of target and base over bytes
/// `i * chunk_bytes .. min((i + 1) * chunk_bytes, tensor bytes)` of one tensor, zstd-compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunk {
    /// Index into [`ArtifactManifest::objects`].
    pub object: u32,
    /// Byte offset of the compressed bytes in that object.
    pub at: u64,
    /// Compressed length in bytes.
    pub len: u64,
    /// blake3 of the compressed bytes as stored.
    pub digest: Digest,
}

/// The manifest of one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactManifest {
    /// [`FORMAT`].
    pub format: String,
    /// The version held (the trainer publication's Merkle root: [`VersionId`]).
    pub version: VersionId,
    /// The trainer's label of the version, when known.
    pub label: Option<String>,
    /// Canonical or delta.
    pub kind: ArtifactKind,
    /// For a delta: the exact version the XOR is against.
    pub base: Option<VersionId>,
    /// For a delta: where the base version's artifact was written, when the exporter knew it
    /// (`s3://...`), so a reader can resolve a chain.
    pub base_url: Option<String>,
    /// The tensors of the target version, in artifact order.
    pub tensors: Vec<TensorEntry>,
    /// The objects (canonical: safetensors files, then the index; delta: chunk objects).
    pub objects: Vec<ObjectEntry>,
    /// Canonical: per tensor (same order), where its bytes are. Empty for a delta.
    pub locations: Vec<Location>,
    /// Delta: bytes per range (the last range of a tensor may be shorter). 0 for canonical.
    pub chunk_bytes: u64,
    /// Delta: per tensor (same order), per range, the compressed XOR, or `None` where target and
    /// base are equal over the whole range (nothing stored, nothing fetched).
    pub chunks: Vec<Vec<Option<Chunk>>>,
    /// Digests of the regions workers verify, cut for the destination layouts known at export
    /// (the bytes of each region of the target version, row-major; `packed_addr` unused).
    pub pieces: Vec<DestPiece>,
}

impl ArtifactManifest {
    /// Parses and validates manifest bytes; `expected`, when given, is the blake3 the control
    /// plane recorded for them.
    ///
    /// # Errors
    /// [`Error::ManifestDigest`] when the bytes are not the recorded ones; [`Error::BadManifest`]
    /// naming the field or tensor at fault.
    pub fn parse(
        url: &str,
        bytes: &[u8],
        expected: Option<Digest>,
    ) -> Result<ArtifactManifest, Error> {
        if let Some(want) = expected {
            let got = Digest::of(bytes);
            if got != want {
                return Err(Error::ManifestDigest {
                    url: url.to_string(),
                    expected: want,
                    found: got,
                });
            }
        }
        // Strict: a key repeated in any object (also after unescaping) is refused, naming it.
        let m: ArtifactManifest =
            mx_layout::strict_json::from_slice(bytes).map_err(|e| Error::BadManifest {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
        m.validate(url)?;
        Ok(m)
    }

    /// The tensor's bytes (numel x dtype size), checked.
    ///
    /// # Errors
    /// [`Error::BadManifest`] on overflow.
    pub fn tensor_bytes(&self, url: &str, i: usize) -> Result<u64, Error> {
        let t = &self.tensors[i];
        t.shape
            .iter()
            .try_fold(t.dtype.size_bytes(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::BadManifest {
                url: url.to_string(),
                reason: format!("tensor {}: shape {:?} overflows u64 bytes", t.name, t.shape),
            })
    }

    /// Checks every cross-reference and range.
    fn validate(&self, url: &str) -> Result<(), Error> {
        let bad = |reason: String| Error::BadManifest {
            url: url.to_string(),
            reason,
        };
        if self.format != FORMAT {
            return Err(bad(format!(
                "format {:?}, expected {FORMAT:?}",
                self.format
            )));
        }
        let mut names = HashSet::new();
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                return Err(bad(format!("tensor {} is listed twice", t.name)));
            }
        }
        let mut objects = HashSet::new();
        for o in &self.objects {
            let ok = !o.name.is_empty()
                && o.name
                    .split('/')
                    .all(|s| !s.is_empty() && s != "." && s != "..");
            if !ok || !objects.insert(o.name.as_str()) {
                return Err(bad(format!(
                    "object name {:?} is malformed or repeated",
                    o.name
                )));
            }
        }
        let object = |k: u32, what: &str| {
            self.objects
                .get(k as usize)
                .ok_or_else(|| bad(format!("{what}: object {k} of {}", self.objects.len())))
        };
        let in_object = |k: u32, at: u64, len: u64, what: &str| -> Result<(), Error> {
            let o = object(k, what)?;
            match at.checked_add(len) {
                Some(end) if end <= o.bytes => Ok(()),
                _ => Err(bad(format!(
                    "{what}: bytes {at}+{len} lie outside object {} ({} bytes)",
                    o.name, o.bytes
                ))),
            }
        };
        match self.kind {
            ArtifactKind::Canonical => {
                if self.base.is_some() || !self.chunks.is_empty() || self.chunk_bytes != 0 {
                    return Err(bad(
                        "a canonical artifact has no base, chunks or chunk_bytes".into(),
                    ));
                }
                if self.locations.len() != self.tensors.len() {
                    return Err(bad(format!(
                        "{} locations for {} tensors",
                        self.locations.len(),
                        self.tensors.len()
                    )));
                }
                for (i, (t, l)) in self.tensors.iter().zip(&self.locations).enumerate() {
                    let n = self.tensor_bytes(url, i)?;
                    in_object(l.object, l.offset, n, &format!("tensor {}", t.name))?;
                }
            }
            ArtifactKind::Delta => {
                if self.base.is_none() || !self.locations.is_empty() {
                    return Err(bad("a delta names its base and has no locations".into()));
                }
                if self.chunk_bytes == 0 || self.chunk_bytes > MAX_CHUNK_BYTES {
                    return Err(bad(format!(
                        "chunk_bytes {} is outside 1..={MAX_CHUNK_BYTES}",
                        self.chunk_bytes
                    )));
                }
                if self.chunks.len() != self.tensors.len() {
                    return Err(bad(format!(
                        "chunk lists for {} tensors, {} tensors",
                        self.chunks.len(),
                        self.tensors.len()
                    )));
                }
                for (i, (t, cs)) in self.tensors.iter().zip(&self.chunks).enumerate() {
                    let n = self.tensor_bytes(url, i)?;
                    let want = n.div_ceil(self.chunk_bytes);
                    if cs.len() as u64 != want {
                        return Err(bad(format!(
                            "tensor {}: {} chunks for {n} bytes in ranges of {}",
                            t.name,
                            cs.len(),
                            self.chunk_bytes
                        )));
                    }
                    for (k, c) in cs.iter().enumerate() {
                        if let Some(c) = c {
                            in_object(
                                c.object,
                                c.at,
                                c.len,
                                &format!("tensor {} chunk {k}", t.name),
                            )?;
                        }
                    }
                }
            }
        }
        for p in &self.pieces {
            let Some(t) = self.tensors.iter().find(|t| t.name == p.tensor) else {
                return Err(bad(format!(
                    "a piece names tensor {}, not in the artifact",
                    p.tensor
                )));
            };
            if !p.region.fits_in(&t.shape) {
                return Err(bad(format!(
                    "tensor {}: piece region {} is outside shape {:?}",
                    p.tensor, p.region, t.shape
                )));
            }
        }
        Ok(())
    }

    /// The range of tensor `i`'s row-major bytes chunk `k` covers.
    pub(crate) fn chunk_range(&self, url: &str, i: usize, k: usize) -> Result<(u64, u64), Error> {
        let n = self.tensor_bytes(url, i)?;
        let lo = (k as u64).saturating_mul(self.chunk_bytes).min(n);
        let hi = lo.saturating_add(self.chunk_bytes).min(n);
        Ok((lo, hi))
    }
}
