//! Reading artifacts: the manifest (checked against the digest the control plane recorded), the
//! chain from the version a reader holds to the target, and ranged reads of exactly the bytes a
//! plan asks for ([`ArtifactSource`], a source the puller stages from like any other).
//!
//! Addresses: the planner sees each tensor of the target whole, as one shard at the virtual
//! address `(i + 1) << 40` (tensor `i` of the target manifest), so a plan's reads name a tensor
//! and a byte range of its row-major bytes, whatever the artifact's kind.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::stream::{self, StreamExt, TryStreamExt};
use mx_layout::{Digest, LayoutSpec, MemDevice, ShardEntry, SourceManifest, TensorBox, VersionId};
use object_store::ObjectStoreExt;
use tokio::runtime::Handle;

use crate::format::{ArtifactKind, ArtifactManifest, MANIFEST_NAME};
use crate::store::{ArtifactUrl, Store};
use crate::Error;

/// Bits of a virtual address that address bytes within one tensor (1 TiB per tensor).
pub const TENSOR_ADDR_BITS: u32 = 40;
/// Longest ranged GET a read issues (bytes); longer runs are split and fetched concurrently.
const MAX_GET_BYTES: u64 = 16 << 20;
/// Spans of one object closer than this share a GET (the gap is read and dropped).
const GAP_BYTES: u64 = 256 << 10;
/// Decompressed delta bytes held at once by one read.
const DELTA_BATCH_BYTES: u64 = 512 << 20;
/// Deltas a chain may have by default.
pub const DEFAULT_CHAIN_LIMIT: usize = 8;

/// One artifact's manifest, read and checked.
#[derive(Debug, Clone)]
pub struct Artifact {
    url: ArtifactUrl,
    manifest: ArtifactManifest,
    digest: Digest,
}

impl Artifact {
    /// Reads `url`'s manifest; `expected` is the digest the control plane recorded for it.
    ///
    /// # Errors
    /// [`Error::Missing`] when there is no manifest; [`Error::Store`]; the errors of
    /// [`ArtifactManifest::parse`].
    pub async fn open(
        store: &Store,
        url: &ArtifactUrl,
        expected: Option<Digest>,
    ) -> Result<Artifact, Error> {
        let at = format!("{url}/{MANIFEST_NAME}");
        let bytes = match store.object_store().get(&url.key(MANIFEST_NAME)).await {
            Ok(r) => r.bytes().await.map_err(|e| Error::Store {
                url: at.clone(),
                op: "reading the manifest",
                source: Box::new(e),
            })?,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::Missing {
                    url: at,
                    what: "the artifact's manifest: nothing was exported there".into(),
                })
            }
            Err(e) => {
                return Err(Error::Store {
                    url: at,
                    op: "reading the manifest",
                    source: Box::new(e),
                })
            }
        };
        let manifest = ArtifactManifest::parse(&at, &bytes, expected)?;
        Ok(Artifact {
            url: url.clone(),
            digest: Digest::of(&bytes),
            manifest,
        })
    }

    /// Where it is.
    pub fn url(&self) -> &ArtifactUrl {
        &self.url
    }

    /// Its manifest.
    pub fn manifest(&self) -> &ArtifactManifest {
        &self.manifest
    }

    /// blake3 of its manifest object.
    pub fn manifest_digest(&self) -> Digest {
        self.digest
    }
}

/// How a reader gets from what it holds to a target version: a canonical artifact, or the deltas
/// from the version held (in apply order), or a canonical artifact and deltas after it.
#[derive(Debug, Clone)]
pub struct Chain {
    /// Whole tensors to start from (`None`: start from the bytes held, the first delta's base).
    canonical: Option<Artifact>,
    /// Deltas to XOR on, in order.
    deltas: Vec<Artifact>,
    /// The last of them (the version read).
    target: Artifact,
}

impl Chain {
    /// Resolves the chain to the artifact at `url` (whose manifest must have the recorded
    /// digest `expected`, when given) for a reader holding `held`: a canonical artifact is read
    /// as is; a delta whose base is `held` is applied to it; otherwise the delta's `base_url` is
    /// followed, at most `limit` deltas, until the held version or a canonical artifact.
    ///
    /// # Errors
    /// [`Error::WrongBase`] naming the delta, both versions and what is held when no chain leads
    /// from `held` (a delta without a base URL, a missing base artifact);
    /// [`Error::ChainTooLong`]; [`Error::BadManifest`] when the artifacts disagree on the tensors
    /// or a base's version is not the one named; the errors of [`Artifact::open`].
    pub async fn resolve(
        store: &Store,
        url: &ArtifactUrl,
        expected: Option<Digest>,
        held: Option<VersionId>,
        limit: usize,
    ) -> Result<Chain, Error> {
        let target = Artifact::open(store, url, expected).await?;
        let target_version = target.manifest.version;
        let held_s = held.map_or_else(|| "nothing".to_string(), |h| h.to_string());
        let mut deltas: Vec<Artifact> = Vec::new();
        let mut at = target;
        loop {
            match at.manifest.kind {
                ArtifactKind::Canonical => {
                    deltas.reverse();
                    let target = deltas.last().unwrap_or(&at).clone();
                    let chain = Chain {
                        canonical: Some(at),
                        deltas,
                        target,
                    };
                    chain.check()?;
                    return Ok(chain);
                }
                ArtifactKind::Delta => {
                    let base = at.manifest.base.ok_or_else(|| Error::BadManifest {
                        url: at.url.to_string(),
                        reason: "a delta without a base".into(),
                    })?;
                    let wrong_base = |a: &Artifact| Error::WrongBase {
                        url: a.url.to_string(),
                        version: a.manifest.version,
                        base,
                        held: held_s.clone(),
                    };
                    if Some(base) == held {
                        deltas.push(at.clone());
                        deltas.reverse();
                        let target = deltas.last().unwrap_or(&at).clone();
                        let chain = Chain {
                            canonical: None,
                            deltas,
                            target,
                        };
                        chain.check()?;
                        return Ok(chain);
                    }
                    if deltas.len() + 1 > limit {
                        return Err(Error::ChainTooLong {
                            url: url.to_string(),
                            limit,
                            held: held_s,
                            target: target_version,
                        });
                    }
                    let Some(next) = at.manifest.base_url.clone() else {
                        return Err(wrong_base(&at));
                    };
                    let next: ArtifactUrl = next.parse()?;
                    let prev = match Artifact::open(store, &next, None).await {
                        Ok(a) => a,
                        Err(Error::Missing { .. }) => return Err(wrong_base(&at)),
                        Err(e) => return Err(e),
                    };
                    if prev.manifest.version != base {
                        return Err(Error::BadManifest {
                            url: next.to_string(),
                            reason: format!(
                                "holds {}, but the delta {} names it as its base {base}",
                                prev.manifest.version, at.url
                            ),
                        });
                    }
                    deltas.push(at);
                    at = prev;
                }
            }
        }
    }

    /// The target artifact (the last delta, or the canonical artifact when there is none).
    pub fn target(&self) -> &Artifact {
        &self.target
    }

    /// The canonical artifact the chain starts from, if any.
    pub fn canonical(&self) -> Option<&Artifact> {
        self.canonical.as_ref()
    }

    /// The deltas, in apply order.
    pub fn deltas(&self) -> &[Artifact] {
        &self.deltas
    }

    /// Every artifact of the chain agrees with the target on the tensors (names, dtypes, shapes).
    fn check(&self) -> Result<(), Error> {
        let t = self.target();
        for a in self.canonical.iter().chain(&self.deltas) {
            let same = a.manifest.tensors.len() == t.manifest.tensors.len()
                && a.manifest
                    .tensors
                    .iter()
                    .zip(&t.manifest.tensors)
                    .all(|(x, y)| x.name == y.name && x.dtype == y.dtype && x.shape == y.shape);
            if !same {
                return Err(Error::BadManifest {
                    url: a.url.to_string(),
                    reason: format!(
                        "its tensors (names, dtypes, shapes, order) differ from the target {}'s",
                        t.url
                    ),
                });
            }
        }
        Ok(())
    }
}

/// (tensor index, chunk index) of a delta.
type ChunkKey = (usize, usize);

/// One read of a plan: `len` bytes of tensor `tensor` from byte `offset`, into `local`.
#[derive(Debug, Clone, Copy)]
pub struct ByteRead {
    /// Tensor index in the target manifest.
    pub tensor: usize,
    /// Byte offset in the tensor's row-major bytes.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the destination buffer.
    pub local: u64,
}

/// A chain as a staging source: the planner's view of it ([`ArtifactSource::manifest`]) and
/// ranged reads of exactly the bytes a plan asks for. Reads run on the tokio runtime whose
/// handle it was given, and must be called from outside that runtime's threads (the puller's
/// staging threads are).
#[derive(Debug)]
pub struct ArtifactSource {
    store: Store,
    chain: Chain,
    manifest: SourceManifest,
    rt: Handle,
    fetched: AtomicU64,
    requests: AtomicU64,
}

impl ArtifactSource {
    /// A source over `chain`.
    ///
    /// # Errors
    /// [`Error::BadManifest`] when a tensor's size overflows or there are more than 2^23
    /// tensors (the virtual address space).
    pub fn new(store: Store, chain: Chain, rt: Handle) -> Result<ArtifactSource, Error> {
        let target = chain.target();
        let m = &target.manifest;
        let url = target.url.to_string();
        let mut shards = Vec::with_capacity(m.tensors.len());
        for (i, t) in m.tensors.iter().enumerate() {
            let addr = (i as u64 + 1)
                .checked_shl(TENSOR_ADDR_BITS)
                .filter(|a| a >> TENSOR_ADDR_BITS == i as u64 + 1)
                .ok_or_else(|| Error::BadManifest {
                    url: url.clone(),
                    reason: "too many tensors for the virtual address space".into(),
                })?;
            let len = m.tensor_bytes(&url, i)?;
            if len >= 1 << TENSOR_ADDR_BITS {
                return Err(Error::BadManifest {
                    url: url.clone(),
                    reason: format!("tensor {} is larger than 1 TiB", t.name),
                });
            }
            shards.push(ShardEntry {
                tensor: t.name.clone(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                shard: TensorBox::full(&t.shape),
                addr,
                len,
                device: MemDevice::Dram,
                digest: t.digest,
            });
        }
        let manifest = SourceManifest {
            slot: 0,
            layout: LayoutSpec {
                scheme: mx_layout::Scheme::Replicated,
                world_size: 1,
            },
            agent_name: url,
            agent_metadata: Vec::new(),
            shards,
            pieces: m.pieces.clone(),
            pack_seconds: 0.0,
        };
        Ok(ArtifactSource {
            store,
            chain,
            manifest,
            rt,
            fetched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }

    /// The chain read.
    pub fn chain(&self) -> &Chain {
        &self.chain
    }

    /// The planner's view: one whole-tensor shard per tensor at its virtual address, and the
    /// region digests of the target's manifest.
    pub fn manifest(&self) -> &SourceManifest {
        &self.manifest
    }

    /// The version its reads give.
    pub fn version(&self) -> VersionId {
        self.chain.target().manifest.version
    }

    /// `Some(b)` when reads XOR onto the bytes of version `b` already in the buffer (a chain
    /// without a canonical start); `None` when reads give whole bytes.
    pub fn base(&self) -> Option<VersionId> {
        match &self.chain.canonical {
            Some(_) => None,
            None => self.chain.deltas.first().and_then(|d| d.manifest.base),
        }
    }

    /// `artifact_canonical` or `artifact_delta` (what the stage reports as its source).
    pub fn kind(&self) -> &'static str {
        if self.chain.deltas.is_empty() {
            "artifact_canonical"
        } else {
            "artifact_delta"
        }
    }

    /// Bytes fetched from the object store so far.
    pub fn fetched_bytes(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// GET requests issued so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Splits a virtual address range into (tensor, offset), checked against the tensor's size.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn locate(&self, addr: u64, len: u64) -> Result<(usize, u64), Error> {
        let oor = || Error::OutOfRange {
            url: self.manifest.agent_name.clone(),
            addr,
            len,
        };
        let i = usize::try_from(addr >> TENSOR_ADDR_BITS)
            .ok()
            .and_then(|k| k.checked_sub(1))
            .ok_or_else(oor)?;
        let off = addr & ((1 << TENSOR_ADDR_BITS) - 1);
        let s = self.manifest.shards.get(i).ok_or_else(oor)?;
        match off.checked_add(len) {
            Some(end) if end <= s.len => Ok((i, off)),
            _ => Err(oor()),
        }
    }

    /// Carries out `reads` into `into`: for a chain with a canonical start, writes the bytes;
    /// then XORs every delta's bytes in (so without a canonical start, `into` must hold the
    /// base's bytes at those places first).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a read outside `into` or the tensors; [`Error::Store`],
    /// [`Error::Missing`]; [`Error::BadChunk`] for a chunk whose bytes are not the manifest's.
    pub fn read(&self, reads: &[ByteRead], into: &mut [u8]) -> Result<(), Error> {
        self.rt.block_on(self.read_async(reads, into))
    }

    /// [`ArtifactSource::read`] for async callers (on any runtime).
    ///
    /// # Errors
    /// As [`ArtifactSource::read`].
    pub async fn read_async(&self, reads: &[ByteRead], into: &mut [u8]) -> Result<(), Error> {
        for r in reads {
            let ok = usize::try_from(r.local)
                .ok()
                .zip(usize::try_from(r.len).ok())
                .and_then(|(lo, n)| lo.checked_add(n))
                .is_some_and(|hi| hi <= into.len());
            let bytes = self.manifest.shards.get(r.tensor).map_or(0, |s| s.len);
            if !ok || r.offset.checked_add(r.len).is_none_or(|e| e > bytes) {
                return Err(Error::OutOfRange {
                    url: self.manifest.agent_name.clone(),
                    addr: r.offset,
                    len: r.len,
                });
            }
        }
        if let Some(c) = &self.chain.canonical {
            self.read_canonical(c, reads, into).await?;
        }
        for d in &self.chain.deltas {
            self.xor_delta(d, reads, into).await?;
        }
        Ok(())
    }

    /// Ranged GETs of the canonical files, adjacent reads merged, at most [`MAX_GET_BYTES`]
    /// each, many in flight.
    async fn read_canonical(
        &self,
        a: &Artifact,
        reads: &[ByteRead],
        into: &mut [u8],
    ) -> Result<(), Error> {
        let m = &a.manifest;
        let mut spans: Vec<(u32, u64, u64, u64)> = reads
            .iter()
            .map(|r| {
                let loc = m.locations[r.tensor];
                (loc.object, loc.offset + r.offset, r.len, r.local)
            })
            .collect();
        spans.sort_unstable();
        let gets = merge_spans(&spans);
        let results: Vec<(Vec<Segment>, u64, bytes::Bytes)> =
            stream::iter(gets.into_iter().map(|g| {
                let name = &m.objects[g.object as usize].name;
                async move {
                    let b = self.get_range(&a.url, name, g.range.clone()).await?;
                    Ok::<_, Error>((g.segments, g.range.start, b))
                }
            }))
            .buffer_unordered(self.store.options().concurrency.max(1))
            .try_collect()
            .await?;
        for (segments, start, bytes) in results {
            for sg in segments {
                let from = (sg.at - start) as usize;
                let lo = sg.local as usize;
                into[lo..lo + sg.len as usize]
                    .copy_from_slice(&bytes[from..from + sg.len as usize]);
            }
        }
        Ok(())
    }

    /// One ranged GET of an object of the artifact at `url`, counted.
    async fn get_range(
        &self,
        url: &ArtifactUrl,
        name: &str,
        range: Range<u64>,
    ) -> Result<bytes::Bytes, Error> {
        let want = range.end - range.start;
        self.requests.fetch_add(1, Ordering::Relaxed);
        let at = format!("{url}/{name}");
        let b = match self
            .store
            .object_store()
            .get_range(&url.key(name), range.clone())
            .await
        {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::Missing {
                    url: at,
                    what: format!(
                        "bytes {}..{} listed in the artifact's manifest",
                        range.start, range.end
                    ),
                })
            }
            Err(e) => {
                return Err(Error::Store {
                    url: at,
                    op: "a ranged read",
                    source: Box::new(e),
                })
            }
        };
        self.fetched.fetch_add(b.len() as u64, Ordering::Relaxed);
        if b.len() as u64 != want {
            return Err(Error::Missing {
                url: at,
                what: format!(
                    "{} of bytes {}..{}: the object is shorter than its manifest says",
                    b.len(),
                    range.start,
                    range.end
                ),
            });
        }
        Ok(b)
    }

    /// XORs delta `d`'s bytes over `reads` into `into`, in batches of at most
    /// [`DELTA_BATCH_BYTES`] decompressed.
    async fn xor_delta(
        &self,
        d: &Artifact,
        reads: &[ByteRead],
        into: &mut [u8],
    ) -> Result<(), Error> {
        let m = &d.manifest;
        let url = d.url.to_string();
        let cb = m.chunk_bytes;
        // Distinct chunks needed, in order of first need, batched.
        let mut start = 0;
        while start < reads.len() {
            let mut want: Vec<ChunkKey> = Vec::new();
            let mut seen: std::collections::HashSet<ChunkKey> = std::collections::HashSet::new();
            let mut held = 0u64;
            let mut end = start;
            while end < reads.len() && (held < DELTA_BATCH_BYTES || end == start) {
                let r = reads[end];
                if r.len > 0 {
                    let (k0, k1) = (r.offset / cb, (r.offset + r.len - 1) / cb);
                    for k in k0..=k1 {
                        let key = (r.tensor, k as usize);
                        if m.chunks[r.tensor][k as usize].is_some() && seen.insert(key) {
                            want.push(key);
                            held += cb;
                        }
                    }
                }
                end += 1;
            }
            let plain = self.fetch_chunks(d, &want).await?;
            for r in &reads[start..end] {
                if r.len == 0 {
                    continue;
                }
                let (k0, k1) = (r.offset / cb, (r.offset + r.len - 1) / cb);
                for k in k0..=k1 {
                    let Some(bytes) = plain.get(&(r.tensor, k as usize)) else {
                        continue; // an unchanged range: XOR with zeros
                    };
                    let (lo, _) = m.chunk_range(&url, r.tensor, k as usize)?;
                    let a = r.offset.max(lo);
                    let b = (r.offset + r.len).min(lo + bytes.len() as u64);
                    let src = &bytes[(a - lo) as usize..(b - lo) as usize];
                    let dst_lo = (r.local + (a - r.offset)) as usize;
                    for (x, y) in into[dst_lo..dst_lo + src.len()].iter_mut().zip(src) {
                        *x ^= y;
                    }
                }
            }
            start = end;
        }
        Ok(())
    }

    /// Fetches (adjacent chunks in one GET), checks and decompresses `want`'s chunks.
    async fn fetch_chunks(
        &self,
        d: &Artifact,
        want: &[(usize, usize)],
    ) -> Result<HashMap<(usize, usize), Vec<u8>>, Error> {
        let m = &d.manifest;
        let url = d.url.to_string();
        let mut list: Vec<(u32, u64, u64, (usize, usize))> = want
            .iter()
            .filter_map(|&(t, k)| m.chunks[t][k].map(|c| (c.object, c.at, c.len, (t, k))))
            .collect();
        list.sort_unstable();
        // GETs over runs of adjacent chunks: (object, range, members).
        let mut gets: Vec<(u32, Range<u64>, Vec<ChunkKey>)> = Vec::new();
        for (obj, at, len, key) in list {
            match gets.last_mut() {
                Some((o, r, keys))
                    if *o == obj && r.end == at && r.end - r.start + len <= MAX_GET_BYTES =>
                {
                    r.end += len;
                    keys.push(key);
                }
                _ => gets.push((obj, at..at + len, vec![key])),
            }
        }
        let fetched: Vec<(Range<u64>, Vec<ChunkKey>, bytes::Bytes)> =
            stream::iter(gets.into_iter().map(|(obj, range, keys)| {
                let name = m.objects[obj as usize].name.clone();
                let url = &d.url;
                async move {
                    let b = self.get_range(url, &name, range.clone()).await?;
                    Ok::<_, Error>((range, keys, b))
                }
            }))
            .buffer_unordered(self.store.options().concurrency.max(1))
            .try_collect()
            .await?;
        let mut out = HashMap::with_capacity(want.len());
        for (range, keys, b) in fetched {
            for (t, k) in keys {
                let Some(c) = m.chunks[t][k] else { continue };
                let bad = |reason: String| Error::BadChunk {
                    url: url.clone(),
                    tensor: m.tensors[t].name.clone(),
                    chunk: k,
                    object: m.objects[c.object as usize].name.clone(),
                    at: c.at,
                    len: c.len,
                    reason,
                };
                let lo = (c.at - range.start) as usize;
                let raw = &b[lo..lo + c.len as usize];
                let got = Digest::of(raw);
                if got != c.digest {
                    return Err(bad(format!("blake3 {got}, the manifest says {}", c.digest)));
                }
                let (a, e) = m.chunk_range(&url, t, k)?;
                let n = (e - a) as usize;
                let plain =
                    zstd::bulk::decompress(raw, n).map_err(|e| bad(format!("zstd: {e}")))?;
                if plain.len() != n {
                    return Err(bad(format!(
                        "{} bytes decompressed, the range has {n}",
                        plain.len()
                    )));
                }
                out.insert((t, k), plain);
            }
        }
        Ok(out)
    }
}

/// Reads a whole version from its artifact at `url` (whose manifest must have the recorded
/// digest `expected`, when given): the chain is resolved from nothing held (it must start from a
/// canonical artifact), every tensor is read whole and checked against the target manifest's
/// whole-tensor blake3. Returns (name, dtype, shape) and bytes per tensor, in artifact order.
/// For exporters that need a base's bytes; holds the whole model in memory.
///
/// # Errors
/// The errors of [`Chain::resolve`] and [`ArtifactSource::read_async`]; [`Error::BadManifest`]
/// naming a tensor whose bytes do not match its digest.
pub async fn read_version(
    store: &Store,
    url: &ArtifactUrl,
    expected: Option<Digest>,
) -> Result<Vec<(mx_layout::TensorSpec, Vec<u8>)>, Error> {
    let chain = Chain::resolve(store, url, expected, None, DEFAULT_CHAIN_LIMIT).await?;
    let src = ArtifactSource::new(store.clone(), chain, Handle::current())?;
    let mut out = Vec::with_capacity(src.manifest.shards.len());
    for (i, s) in src.manifest.shards.iter().enumerate() {
        let n = usize::try_from(s.len).map_err(|_| Error::OutOfRange {
            url: url.to_string(),
            addr: s.addr,
            len: s.len,
        })?;
        let mut buf = vec![0u8; n];
        let read = ByteRead {
            tensor: i,
            offset: 0,
            len: s.len,
            local: 0,
        };
        src.read_async(&[read], &mut buf).await?;
        if Digest::of(&buf) != s.digest {
            return Err(Error::BadManifest {
                url: url.to_string(),
                reason: format!(
                    "tensor {}: the bytes read do not have the manifest's blake3",
                    s.tensor
                ),
            });
        }
        let spec = mx_layout::TensorSpec {
            name: s.tensor.clone(),
            dtype: s.dtype,
            shape: s.global_shape.clone(),
        };
        out.push((spec, buf));
    }
    Ok(out)
}

/// Bytes of one read inside a GET: `len` bytes from object offset `at` to buffer offset `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    at: u64,
    len: u64,
    local: u64,
}

/// One ranged GET and the reads it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Get {
    object: u32,
    range: Range<u64>,
    segments: Vec<Segment>,
}

/// Ranged GETs for `spans` (object, offset, len, local), sorted: a span is split at
/// [`MAX_GET_BYTES`], and spans of one object less than [`GAP_BYTES`] apart share a GET (the gap
/// is fetched and dropped: the column slices of a row-parallel weight are many short runs with
/// short gaps), as long as the GET stays within [`MAX_GET_BYTES`].
fn merge_spans(spans: &[(u32, u64, u64, u64)]) -> Vec<Get> {
    let mut gets: Vec<Get> = Vec::new();
    for &(object, at, len, local) in spans {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(MAX_GET_BYTES);
            let sg = Segment {
                at: at + off,
                len: n,
                local: local + off,
            };
            match gets.last_mut() {
                Some(g)
                    if g.object == object
                        && sg.at >= g.range.start
                        && sg.at <= g.range.end.saturating_add(GAP_BYTES)
                        && (sg.at + n).max(g.range.end) - g.range.start <= MAX_GET_BYTES =>
                {
                    g.range.end = g.range.end.max(sg.at + n);
                    g.segments.push(sg);
                }
                _ => gets.push(Get {
                    object,
                    range: sg.at..sg.at + n,
                    segments: vec![sg],
                }),
            }
            off += n;
        }
    }
    gets
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: panics are failures
mod tests {
    use super::*;

    #[test]
    fn near_spans_share_a_get_and_long_ones_split() {
        let spans = [
            (0, 100, 10, 0),
            (0, 120, 10, 10),                // 10 bytes after: merged
            (0, 130 + GAP_BYTES + 1, 5, 20), // past the gap: new GET
            (1, 0, MAX_GET_BYTES + 3, 25),   // another object, split
        ];
        let gets = merge_spans(&spans);
        assert_eq!(gets.len(), 4, "{gets:?}");
        assert_eq!(gets[0].range, 100..130);
        assert_eq!(gets[0].segments.len(), 2);
        assert_eq!(gets[1].range.start, 131 + GAP_BYTES);
        assert_eq!(gets[2].range, 0..MAX_GET_BYTES);
        assert_eq!(gets[3].range, MAX_GET_BYTES..MAX_GET_BYTES + 3);
        assert_eq!(gets[3].segments[0].local, 25 + MAX_GET_BYTES);
    }
}
