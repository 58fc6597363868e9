//! Newtypes shared by every crate: ranks, digests, layout specs, boxes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// A 32-byte blake3 digest, shown and parsed as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// blake3 of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a digest from a byte slice of length 32.
    ///
    /// # Errors
    /// [`Error::BadDigest`] when `b` is not 32 bytes long.
    pub fn from_slice(b: &[u8]) -> Result<Digest, Error> {
        let arr: [u8; 32] = b.try_into().map_err(|_| Error::BadDigest {
            value: format!("{} bytes", b.len()),
        })?;
        Ok(Digest(arr))
    }
}

impl From<blake3::Hash> for Digest {
    fn from(h: blake3::Hash) -> Digest {
        Digest(*h.as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

impl FromStr for Digest {
    type Err = Error;

    /// Parses 64 hex characters.
    ///
    /// # Errors
    /// [`Error::BadDigest`] naming the input.
    fn from_str(s: &str) -> Result<Digest, Error> {
        let bad = || Error::BadDigest {
            value: s.to_string(),
        };
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The id of an mx policy version: the Merkle root ([`crate::version_digest`]) of the trainer's
/// publication, written `mx:<64 lowercase hex>` wherever an engine reports its resident version,
/// and `mx://<64 hex>` as the `model_path` that asks an mx-driven engine to install it. This type
/// is the one place either form is parsed or printed.
///
/// Weights that did not come through mx (a checkpoint read from disk) carry some other id
/// (`disk:<path>`, a trainer's label): they are a [`ResidentVersion::Label`] and never equal an mx
/// version.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VersionId(pub Digest);

impl VersionId {
    /// The prefix of the engine-reported form.
    pub const PREFIX: &'static str = "mx:";
    /// The prefix of the `model_path` form.
    pub const PATH_PREFIX: &'static str = "mx://";

    /// The version digest (the Merkle root of the publication).
    pub fn digest(&self) -> Digest {
        self.0
    }

    /// True when `id` claims to be an mx version (starts with `mx:`), well-formed or not.
    /// Engines refuse such ids on anything but an install from mx staging.
    pub fn claims_mx(id: &str) -> bool {
        id.starts_with(VersionId::PREFIX)
    }

    /// The `model_path` form, `mx://<64 hex>`.
    pub fn model_path(&self) -> String {
        format!("{}{}", VersionId::PATH_PREFIX, self.0)
    }

    /// Parses the `model_path` form: `Ok(None)` when `path` does not start with `mx://` (a
    /// checkpoint directory).
    ///
    /// # Errors
    /// [`Error::BadVersionId`] when `mx://` is not followed by exactly 64 hex digits.
    pub fn from_model_path(path: &str) -> Result<Option<VersionId>, Error> {
        match path.strip_prefix(VersionId::PATH_PREFIX) {
            None => Ok(None),
            Some(hex) => hex
                .parse()
                .map(|d| Some(VersionId(d)))
                .map_err(|_| Error::BadVersionId {
                    value: path.to_string(),
                }),
        }
    }
}

impl From<Digest> for VersionId {
    fn from(d: Digest) -> VersionId {
        VersionId(d)
    }
}

impl fmt::Display for VersionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", VersionId::PREFIX, self.0)
    }
}

impl fmt::Debug for VersionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VersionId({self})")
    }
}

impl FromStr for VersionId {
    type Err = Error;

    /// Parses `mx:<64 hex>`.
    ///
    /// # Errors
    /// [`Error::BadVersionId`] naming the input.
    fn from_str(s: &str) -> Result<VersionId, Error> {
        s.strip_prefix(VersionId::PREFIX)
            .and_then(|h| h.parse().ok())
            .map(VersionId)
            .ok_or_else(|| Error::BadVersionId {
                value: s.to_string(),
            })
    }
}

impl Serialize for VersionId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for VersionId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<VersionId, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The weights an engine holds, as it reports them: an mx policy version, or another label.
///
/// An mx version becomes resident only by an apply of a staged, verified version (or a
/// rollback to the retained one); weights that did not come through mx (a checkpoint read from
/// disk, named `disk:<path>` or by the `weight_version` the engine was given) are a
/// [`ResidentVersion::Label`] and never equal an mx version. This type is the one place an
/// engine's version string is parsed ([`ResidentVersion::parse`]); it prints and serializes as
/// that string.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResidentVersion {
    /// An mx policy version (`mx:<64 hex>`).
    Mx(VersionId),
    /// Any other label; a malformed `mx:` string is one too (it names no mx version).
    Label(String),
}

impl ResidentVersion {
    /// What an engine reports: `mx:<64 hex>` is an mx version, anything else a label.
    pub fn parse(reported: &str) -> ResidentVersion {
        match reported.parse() {
            Ok(v) => ResidentVersion::Mx(v),
            Err(_) => ResidentVersion::Label(reported.to_string()),
        }
    }

    /// The mx version, when it is one.
    pub fn mx(&self) -> Option<VersionId> {
        match self {
            ResidentVersion::Mx(v) => Some(*v),
            ResidentVersion::Label(_) => None,
        }
    }

    /// True when it is mx version `v`.
    pub fn is(&self, v: VersionId) -> bool {
        self.mx() == Some(v)
    }
}

impl From<VersionId> for ResidentVersion {
    fn from(v: VersionId) -> ResidentVersion {
        ResidentVersion::Mx(v)
    }
}

impl fmt::Display for ResidentVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResidentVersion::Mx(v) => v.fmt(f),
            ResidentVersion::Label(l) => f.write_str(l),
        }
    }
}

impl fmt::Debug for ResidentVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

impl Serialize for ResidentVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ResidentVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ResidentVersion, D::Error> {
        Ok(ResidentVersion::parse(&String::deserialize(d)?))
    }
}

/// How a model's tensors are split over the ranks of one process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Scheme {
    /// Every rank holds every tensor whole, under its checkpoint (HF) name.
    Replicated,
    /// FSDP2 dim-0 shards under checkpoint names: torch.chunk semantics, ceil(rows / N) rows per
    /// rank, trailing ranks short or empty. 0-d tensors live on rank 0.
    Fsdp,
    /// vLLM tensor parallelism with vLLM parameter names: fused `qkv_proj` (QKVParallelLinear, GQA kv
    /// heads replicated when tp > kv heads), fused `gate_up_proj` (MergedColumnParallelLinear),
    /// row-parallel `o_proj`/`down_proj` (RowParallelLinear, dim 1), vocab-parallel embedding and
    /// lm_head (VocabParallelEmbedding: vocab padded to a multiple of 64, split evenly), norms
    /// replicated.
    VllmTp,
    /// vLLM tensor parallelism with `--enable-expert-parallel` (data parallel 1): as
    /// [`Scheme::VllmTp`], except that a mixture-of-experts model's routed experts are whole
    /// and spread over the ranks by vLLM's linear placement ([`crate::moe`]). Written `tp-ep:N`.
    VllmTpEp,
    /// A Megatron-Core trainer's ranks, under Megatron-Core's own parameter names: tensor,
    /// pipeline and expert parallel ([`crate::megatron`]). Written `megatron:tp=T,pp=P,ep=E`.
    Megatron(MegatronDims),
}

/// The parallel sizes of a Megatron-Core layout; its world is `tp * pp * ep` ranks, rank
/// `(pp_rank * ep + ep_rank) * tp + tp_rank` (Megatron-Core's order `tp-cp-ep-dp-pp`, context
/// parallel 1, data parallel = `ep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MegatronDims {
    /// Tensor-parallel size (also the expert tensor-parallel size, Megatron-Core's default).
    pub tp: u32,
    /// Pipeline-parallel size (stages).
    pub pp: u32,
    /// Expert-parallel size.
    pub ep: u32,
}

impl MegatronDims {
    /// `(tp_rank, pp_rank, ep_rank)` of layout rank `rank`.
    pub fn coords(self, rank: u32) -> (u32, u32, u32) {
        let tp = self.tp.max(1);
        let ep = self.ep.max(1);
        (rank % tp, rank / tp / ep, rank / tp % ep)
    }
}

/// A layout: a scheme over `world_size` ranks. Written `fsdp:4`, `tp:3`, `tp-ep:2`,
/// `replicated:1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayoutSpec {
    /// The split scheme.
    pub scheme: Scheme,
    /// Number of ranks (>= 1).
    pub world_size: u32,
}

impl LayoutSpec {
    /// The largest world size accepted (65536 ranks).
    pub const MAX_WORLD_SIZE: u32 = 1 << 16;

    /// A Megatron-Core layout of `tp * pp * ep` ranks.
    ///
    /// # Errors
    /// [`Error::BadLayoutSpec`] for a size of 0 or a world above [`Self::MAX_WORLD_SIZE`].
    pub fn megatron(tp: u32, pp: u32, ep: u32) -> Result<LayoutSpec, Error> {
        let dims = MegatronDims { tp, pp, ep };
        let bad = |reason: &str| Error::BadLayoutSpec {
            spec: Scheme::Megatron(dims).name_with(0),
            reason: reason.to_string(),
        };
        if tp == 0 || pp == 0 || ep == 0 {
            return Err(bad("tp, pp and ep must be at least 1"));
        }
        let world = u64::from(tp) * u64::from(pp) * u64::from(ep);
        if world > u64::from(Self::MAX_WORLD_SIZE) {
            return Err(bad("tp x pp x ep must be at most 65536 ranks"));
        }
        Ok(LayoutSpec {
            scheme: Scheme::Megatron(dims),
            world_size: world as u32,
        })
    }

    /// Whether `scheme` and `world_size` agree (a Megatron layout's world is `tp * pp * ep`).
    pub fn is_consistent(&self) -> bool {
        match self.scheme {
            Scheme::Megatron(d) => {
                u64::from(d.tp) * u64::from(d.pp) * u64::from(d.ep) == u64::from(self.world_size)
            }
            _ => true,
        }
    }
}

impl Scheme {
    fn name_with(self, world_size: u32) -> String {
        match self {
            Scheme::Replicated => format!("replicated:{world_size}"),
            Scheme::Fsdp => format!("fsdp:{world_size}"),
            Scheme::VllmTp => format!("tp:{world_size}"),
            Scheme::VllmTpEp => format!("tp-ep:{world_size}"),
            Scheme::Megatron(d) => format!("megatron:tp={},pp={},ep={}", d.tp, d.pp, d.ep),
        }
    }
}

impl fmt::Display for LayoutSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.scheme.name_with(self.world_size))
    }
}

impl FromStr for LayoutSpec {
    type Err = Error;

    /// Parses `fsdp:N`, `tp:N` (vLLM tensor parallel), `tp-ep:N` (with expert parallelism) or
    /// `replicated:N`.
    ///
    /// # Errors
    /// [`Error::BadLayoutSpec`] naming the input.
    fn from_str(s: &str) -> Result<LayoutSpec, Error> {
        let bad = |why: &str| Error::BadLayoutSpec {
            spec: s.to_string(),
            reason: why.to_string(),
        };
        let (name, n) = s.split_once(':').ok_or_else(|| bad("expected SCHEME:N"))?;
        if name == "megatron" {
            return parse_megatron(s, n);
        }
        let scheme = match name {
            "fsdp" => Scheme::Fsdp,
            "tp" | "vllm-tp" => Scheme::VllmTp,
            "tp-ep" => Scheme::VllmTpEp,
            "replicated" | "identity" => Scheme::Replicated,
            _ => {
                return Err(bad(
                    "scheme must be fsdp, tp, tp-ep, replicated or megatron",
                ))
            }
        };
        let world_size: u32 = match n.parse::<u64>() {
            Ok(v) => u32::try_from(v).unwrap_or(u32::MAX),
            Err(_) => return Err(bad("N must be an integer")),
        };
        if world_size == 0 || world_size > LayoutSpec::MAX_WORLD_SIZE {
            return Err(bad("N must be between 1 and 65536"));
        }
        Ok(LayoutSpec { scheme, world_size })
    }
}

/// `tp=T,pp=P,ep=E` (each at most once, any order, a missing one 1) of `megatron:...`.
fn parse_megatron(spec: &str, fields: &str) -> Result<LayoutSpec, Error> {
    let bad = |reason: String| Error::BadLayoutSpec {
        spec: spec.to_string(),
        reason,
    };
    let mut sizes: [Option<u32>; 3] = [None; 3];
    for field in fields.split(',') {
        let (key, value) = field
            .split_once('=')
            .ok_or_else(|| bad(format!("{field:?} is not KEY=N (tp, pp, ep)")))?;
        let slot = match key {
            "tp" => 0,
            "pp" => 1,
            "ep" => 2,
            _ => {
                return Err(bad(format!(
                    "unknown key {key:?}: megatron takes tp, pp and ep"
                )))
            }
        };
        if sizes[slot].is_some() {
            return Err(bad(format!("{key} given twice")));
        }
        let v = value
            .parse::<u32>()
            .ok()
            .filter(|v| (1..=LayoutSpec::MAX_WORLD_SIZE).contains(v))
            .ok_or_else(|| bad(format!("{key}={value:?} is not an integer in 1..=65536")))?;
        sizes[slot] = Some(v);
    }
    let [tp, pp, ep] = sizes.map(|v| v.unwrap_or(1));
    LayoutSpec::megatron(tp, pp, ep).map_err(|e| match e {
        Error::BadLayoutSpec { reason, .. } => bad(reason),
        other => other,
    })
}

/// An N-dimensional box inside a tensor's global shape: `global_offset[d] .. global_offset[d] +
/// local_shape[d]` in every dim `d`. Elements are counted, not bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorBox {
    /// Start of the box in each dim (elements).
    pub global_offset: Vec<u64>,
    /// Extent of the box in each dim (elements).
    pub local_shape: Vec<u64>,
}

impl TensorBox {
    /// The box covering a whole tensor of `shape`.
    pub fn full(shape: &[u64]) -> TensorBox {
        TensorBox {
            global_offset: vec![0; shape.len()],
            local_shape: shape.to_vec(),
        }
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.local_shape.len()
    }

    /// Element count; `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.local_shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// True when the box has no elements.
    pub fn is_empty(&self) -> bool {
        self.local_shape.contains(&0)
    }

    /// The intersection of two boxes of the same rank; `None` when empty or ranks differ.
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut off = Vec::with_capacity(self.ndim());
        let mut shape = Vec::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.global_offset[d].max(other.global_offset[d]);
            let hi = (self.global_offset[d].saturating_add(self.local_shape[d]))
                .min(other.global_offset[d].saturating_add(other.local_shape[d]));
            if hi <= lo {
                return None;
            }
            off.push(lo);
            shape.push(hi - lo);
        }
        Some(TensorBox {
            global_offset: off,
            local_shape: shape,
        })
    }

    /// True when `self` lies inside `shape`, with checked arithmetic.
    pub fn fits_in(&self, shape: &[u64]) -> bool {
        self.ndim() == shape.len()
            && (0..shape.len()).all(|d| {
                self.global_offset[d]
                    .checked_add(self.local_shape[d])
                    .is_some_and(|end| end <= shape[d])
            })
    }

    /// True when `inner` lies inside `self`.
    pub fn contains(&self, inner: &TensorBox) -> bool {
        inner.ndim() == self.ndim()
            && (0..self.ndim()).all(|d| {
                inner.global_offset[d] >= self.global_offset[d]
                    && inner.global_offset[d] + inner.local_shape[d]
                        <= self.global_offset[d] + self.local_shape[d]
            })
    }
}

impl fmt::Display for TensorBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Offsets and extents of different lengths (a malformed box from outside) print as far
        // as they go, never panic; an end past u64 prints as `o..`.
        f.write_str("[")?;
        let dims = self.global_offset.len().max(self.local_shape.len());
        for d in 0..dims {
            if d > 0 {
                f.write_str(", ")?;
            }
            match (self.global_offset.get(d), self.local_shape.get(d)) {
                (Some(o), Some(e)) => match o.checked_add(*e) {
                    Some(end) => write!(f, "{o}..{end}")?,
                    None => write!(f, "{o}..")?,
                },
                (Some(o), None) => write!(f, "{o}..?")?,
                (None, Some(e)) => write!(f, "?+{e}")?,
                (None, None) => {}
            }
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_box_prints_without_panicking() {
        let b = TensorBox {
            global_offset: vec![0],
            local_shape: vec![4, 8],
        };
        assert_eq!(b.to_string(), "[0..4, ?+8]");
        let b = TensorBox {
            global_offset: vec![u64::MAX, 1],
            local_shape: vec![2],
        };
        assert_eq!(b.to_string(), "[18446744073709551615.., 1..?]");
    }

    #[test]
    fn version_id_round_trips_both_forms_and_refuses_others() {
        let d = Digest::of(b"weights");
        let v = VersionId(d);
        let engine = v.to_string();
        assert_eq!(engine, format!("mx:{d}"));
        assert_eq!(engine.parse::<VersionId>().ok(), Some(v));
        assert_eq!(ResidentVersion::parse(&engine).mx(), Some(v));
        assert_eq!(v.model_path(), format!("mx://{d}"));
        assert_eq!(
            VersionId::from_model_path(&v.model_path()).ok(),
            Some(Some(v))
        );
        assert_eq!(VersionId::from_model_path("/ckpt/step-3").ok(), Some(None));
        for bad in [
            "mx:abc",
            "disk:/x",
            &format!("mx:{}", "g".repeat(64)),
            &d.to_string(),
        ] {
            assert_eq!(ResidentVersion::parse(bad).mx(), None, "{bad}");
            assert!(matches!(
                bad.parse::<VersionId>(),
                Err(Error::BadVersionId { .. })
            ));
        }
        assert!(VersionId::claims_mx("mx:abc") && !VersionId::claims_mx("disk:/x"));
        assert!(matches!(
            VersionId::from_model_path("mx://abc"),
            Err(Error::BadVersionId { value }) if value == "mx://abc"
        ));
        let json = serde_json::to_string(&v).unwrap_or_default();
        assert_eq!(json, format!("\"mx:{d}\""));
        let back: Result<VersionId, _> = serde_json::from_str(&json);
        assert_eq!(back.ok(), Some(v));
    }

    #[test]
    #[allow(clippy::unwrap_used)] // reason: a test fails loudly on purpose
    fn a_resident_version_is_an_mx_version_or_a_label_and_prints_as_reported() {
        let v = VersionId(Digest([7; 32]));
        for (reported, want) in [
            (v.to_string(), ResidentVersion::Mx(v)),
            (
                "disk:/ckpt".to_string(),
                ResidentVersion::Label("disk:/ckpt".into()),
            ),
            (
                "mx:abc".to_string(),
                ResidentVersion::Label("mx:abc".into()),
            ),
            (String::new(), ResidentVersion::Label(String::new())),
        ] {
            let r = ResidentVersion::parse(&reported);
            assert_eq!(r, want, "{reported}");
            assert_eq!(r.to_string(), reported);
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, serde_json::to_string(&reported).unwrap());
            assert_eq!(serde_json::from_str::<ResidentVersion>(&json).unwrap(), r);
        }
        assert!(ResidentVersion::from(v).is(v));
        assert_eq!(ResidentVersion::parse("mx:abc").mx(), None);
    }
}
