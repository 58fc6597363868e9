//! Writing a version to object storage: as canonical Hugging Face safetensors files with an index,
//! or as an exact-base XOR delta, each with an mx manifest written last (a reader never finds a
//! manifest whose objects are not all there).
//!
//! The exporter is given the version's tensors whole (assembling them from FSDP shards is the
//! trainer's job, e.g. `DTensor.full_tensor()`) and the trainer's shard entries from the
//! version's record; it first proves the bytes are that version (every shard's blake3 over the
//! whole tensors, then the Merkle root), so an artifact can only ever hold the version it names.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use mx_layout::plan::{cut_for_layout, decompose};
use mx_layout::{
    digest_segments, version_digest, DestPiece, Digest, MemDevice, RankLayout, ShardEntry,
    TensorBox, TensorSpec, VersionId,
};
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};
use rayon::prelude::*;

use crate::format::{
    ArtifactKind, ArtifactManifest, Chunk, Location, ObjectEntry, TensorEntry, FORMAT, INDEX_NAME,
    MANIFEST_NAME,
};
use crate::read::Artifact;
use crate::store::{ArtifactUrl, Store};
use crate::Error;

/// One tensor of the version, whole: `bytes` are its row-major (C order) little-endian elements.
#[derive(Debug, Clone, Copy)]
pub struct WholeTensor<'a> {
    /// Name, dtype and shape.
    pub spec: &'a TensorSpec,
    /// `numel x dtype size` bytes.
    pub bytes: &'a [u8],
}

/// What to export.
#[derive(Debug, Clone, Copy)]
pub struct ExportRequest<'a> {
    /// The version (the trainer publication's Merkle root).
    pub version: VersionId,
    /// Its label, when known.
    pub label: Option<&'a str>,
    /// The trainer's shard entries of the version, from its record: the bytes are checked
    /// against every one of them.
    pub shards: &'a [ShardEntry],
    /// The version's tensors, whole, in the order they are written.
    pub tensors: &'a [WholeTensor<'a>],
    /// Destination layouts (all ranks of each) whose regions get digests in the manifest.
    pub layouts: &'a [Vec<RankLayout>],
}

/// The exact base a delta is taken against.
#[derive(Debug, Clone, Copy)]
pub struct DeltaBase<'a> {
    /// The base version.
    pub version: VersionId,
    /// Its artifact, when exported: recorded in the delta (so readers can resolve a chain) and
    /// checked (its version and every tensor's digest must match `tensors`).
    pub url: Option<&'a ArtifactUrl>,
    /// The base version's tensors, whole (same names, dtypes and shapes as the target's).
    pub tensors: &'a [WholeTensor<'a>],
}

/// Knobs of an export.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions {
    /// Canonical: most tensor bytes per safetensors file (default 4 GiB).
    pub max_file_bytes: u64,
    /// Delta: bytes of a tensor per independently fetchable range (default 4 MiB).
    pub chunk_bytes: u64,
    /// Delta: zstd level (default 3).
    pub zstd_level: i32,
    /// Delta: compressed bytes gathered into one object before it is uploaded (default 64 MiB).
    pub object_bytes: u64,
    /// Multipart upload part size (S3's minimum is 5 MiB; default 16 MiB).
    pub part_bytes: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            max_file_bytes: 4 << 30,
            chunk_bytes: 4 << 20,
            zstd_level: 3,
            object_bytes: 64 << 20,
            part_bytes: 16 << 20,
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// Where.
    pub url: ArtifactUrl,
    /// blake3 of the manifest object (what the control plane records).
    pub manifest_digest: Digest,
    /// The manifest.
    pub manifest: ArtifactManifest,
    /// Bytes of every data object written (manifest excluded).
    pub data_bytes: u64,
    /// Seconds in all.
    pub seconds: f64,
}

/// Checks `req`: tensors unique and of their declared size, every trainer shard's digest equal
/// to its box of the whole tensors, every tensor covered, and the Merkle root of the shards equal
/// to the version. Returns the whole-tensor digests in `req.tensors` order.
///
/// # Errors
/// [`Error::NotTheVersion`] naming the tensor (and shard box) that differs.
pub fn prove_version(req: &ExportRequest<'_>) -> Result<Vec<Digest>, Error> {
    let v = req.version.to_string();
    let bad = |tensor: &str, reason: String| Error::NotTheVersion {
        version: v.clone(),
        tensor: tensor.to_string(),
        reason,
    };
    let mut by_name: HashMap<&str, &WholeTensor<'_>> = HashMap::new();
    for t in req.tensors {
        let want = t
            .spec
            .shape
            .iter()
            .try_fold(t.spec.dtype.size_bytes(), |a, &d| a.checked_mul(d));
        if want != Some(t.bytes.len() as u64) {
            return Err(bad(
                &t.spec.name,
                format!(
                    "{} bytes given for shape {:?} of {}",
                    t.bytes.len(),
                    t.spec.shape,
                    t.spec.dtype.as_str()
                ),
            ));
        }
        if by_name.insert(t.spec.name.as_str(), t).is_some() {
            return Err(bad(&t.spec.name, "given twice".into()));
        }
    }
    let mut covered: HashMap<&str, Vec<&TensorBox>> = HashMap::new();
    for s in req.shards {
        let t = by_name
            .get(s.tensor.as_str())
            .ok_or_else(|| bad(&s.tensor, "in the version's shards but not given".into()))?;
        if t.spec.dtype != s.dtype || t.spec.shape != s.global_shape {
            return Err(bad(
                &s.tensor,
                format!(
                    "given as {} {:?}, the version has {} {:?}",
                    t.spec.dtype.as_str(),
                    t.spec.shape,
                    s.dtype.as_str(),
                    s.global_shape
                ),
            ));
        }
        if !s.shard.fits_in(&t.spec.shape) {
            return Err(bad(
                &s.tensor,
                format!("shard {} is outside the tensor", s.shard),
            ));
        }
        covered.entry(s.tensor.as_str()).or_default().push(&s.shard);
    }
    req.shards.par_iter().try_for_each(|s| {
        let t = by_name[s.tensor.as_str()];
        let d = region_digest(t, &s.shard);
        if d == s.digest {
            Ok(())
        } else {
            Err(bad(
                &s.tensor,
                format!(
                    "shard {}: blake3 {d} of the bytes given, {} in the version",
                    s.shard, s.digest
                ),
            ))
        }
    })?;
    for t in req.tensors {
        let mut boxes = covered.remove(t.spec.name.as_str()).unwrap_or_default();
        boxes.sort();
        boxes.dedup();
        let n: u64 = boxes.iter().filter_map(|b| b.numel()).sum();
        let want: u64 = t.spec.shape.iter().product();
        if n != want {
            return Err(bad(
                &t.spec.name,
                format!("the version's shards cover {n} of its {want} elements"),
            ));
        }
    }
    let root = VersionId(version_digest(req.shards));
    if root != req.version {
        return Err(bad(
            "(all)",
            format!("the shards' Merkle root is {root}, not the version"),
        ));
    }
    Ok(req
        .tensors
        .par_iter()
        .map(|t| Digest::of(t.bytes))
        .collect())
}

/// blake3 of `region`'s bytes of a whole tensor, row-major.
fn region_digest(t: &WholeTensor<'_>, region: &TensorBox) -> Digest {
    let elem = t.spec.dtype.size_bytes() as usize;
    let (run, starts) = decompose(region, &TensorBox::full(&t.spec.shape));
    let run = run as usize * elem;
    digest_segments(starts.iter().map(|&s| {
        let lo = s as usize * elem;
        &t.bytes[lo..lo + run]
    }))
}

/// The digests of every region a rank of `layouts` needs, over whole tensors.
fn pieces_for(
    tensors: &[WholeTensor<'_>],
    layouts: &[Vec<RankLayout>],
) -> Result<Vec<DestPiece>, Error> {
    let whole: Vec<ShardEntry> = tensors
        .iter()
        .map(|t| ShardEntry {
            tensor: t.spec.name.clone(),
            dtype: t.spec.dtype,
            global_shape: t.spec.shape.clone(),
            shard: TensorBox::full(&t.spec.shape),
            addr: 0,
            len: t.bytes.len() as u64,
            device: MemDevice::Dram,
            digest: Digest::default(),
        })
        .collect();
    let mut out = Vec::new();
    for dest in layouts {
        let Some(layout) = dest.first().map(|d| d.layout) else {
            continue;
        };
        let cuts = cut_for_layout(&whole, dest)?;
        let pieces: Vec<DestPiece> = cuts
            .par_iter()
            .map(|c| {
                let bytes = tensors[c.shard].bytes;
                let run = c.run_bytes as usize;
                let digest = digest_segments(
                    c.run_offsets
                        .iter()
                        .map(|&o| &bytes[o as usize..o as usize + run]),
                );
                DestPiece {
                    layout,
                    dest_rank: c.dest_rank,
                    tensor: c.tensor.clone(),
                    region: c.region.clone(),
                    digest,
                    packed_addr: None,
                }
            })
            .collect();
        out.extend(pieces);
    }
    Ok(out)
}

fn store_err(url: String, op: &'static str) -> impl FnOnce(object_store::Error) -> Error {
    move |e| Error::Store {
        url,
        op,
        source: Box::new(e),
    }
}

/// Uploads `parts` (written in order) as one object with a multipart upload.
async fn upload(
    store: &Store,
    url: &ArtifactUrl,
    name: &str,
    parts: &[&[u8]],
    part_bytes: usize,
) -> Result<u64, Error> {
    let key = url.key(name);
    let at = format!("{url}/{name}");
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    if total < (5 << 20) {
        // One request: S3 refuses no small object, and a multipart upload of one part is slower.
        let payload: PutPayload = parts
            .iter()
            .map(|p| bytes::Bytes::copy_from_slice(p))
            .collect();
        store
            .object_store()
            .put(&key, payload)
            .await
            .map_err(store_err(at, "uploading"))?;
        return Ok(total);
    }
    let up = store
        .object_store()
        .put_multipart(&key)
        .await
        .map_err(store_err(at.clone(), "starting a multipart upload"))?;
    let mut w = WriteMultipart::new_with_chunk_size(up, part_bytes.max(5 << 20));
    for p in parts {
        for piece in p.chunks(part_bytes.max(5 << 20)) {
            w.wait_for_capacity(store.options().concurrency.max(1))
                .await
                .map_err(store_err(at.clone(), "uploading a part"))?;
            w.write(piece);
        }
    }
    w.finish()
        .await
        .map_err(store_err(at, "completing a multipart upload"))?;
    Ok(total)
}

/// A safetensors header (JSON, space-padded to a multiple of 8 bytes, after its u64 LE length)
/// for `tensors` laid out back to back in order; see the format's specification
/// (<https://github.com/huggingface/safetensors>). Returns the header bytes.
fn safetensors_header(tensors: &[WholeTensor<'_>]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut off = 0u64;
    for t in tensors {
        let end = off + t.bytes.len() as u64;
        map.insert(
            t.spec.name.clone(),
            serde_json::json!({
                "dtype": t.spec.dtype.as_str(),
                "shape": t.spec.shape,
                "data_offsets": [off, end],
            }),
        );
        off = end;
    }
    let mut json = serde_json::Value::Object(map).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

/// Writes `req`'s version to `url` as Hugging Face safetensors files (`model-0000K-of-0000N.
/// safetensors`, at most `opts.max_file_bytes` of tensors each, a tensor never split) with
/// `model.safetensors.index.json`, `extra` files beside them (e.g. `config.json`), and the mx
/// manifest last.
///
/// # Errors
/// [`prove_version`]'s errors; [`Error::Store`] from the uploads; [`Error::Layout`] cutting.
pub async fn export_canonical(
    store: &Store,
    url: &ArtifactUrl,
    req: &ExportRequest<'_>,
    extra: &[(String, Vec<u8>)],
    opts: &ExportOptions,
) -> Result<Exported, Error> {
    let t0 = Instant::now();
    let digests = prove_version(req)?;
    let pieces = pieces_for(req.tensors, req.layouts)?;
    // Files: tensors in order, a new file once the next tensor would pass the limit.
    let mut files: Vec<std::ops::Range<usize>> = Vec::new();
    let mut start = 0;
    let mut acc = 0u64;
    for (i, t) in req.tensors.iter().enumerate() {
        let n = t.bytes.len() as u64;
        if i > start && acc + n > opts.max_file_bytes {
            files.push(start..i);
            (start, acc) = (i, 0);
        }
        acc += n;
    }
    if start < req.tensors.len() || files.is_empty() {
        files.push(start..req.tensors.len());
    }
    let nfiles = files.len();
    let mut objects = Vec::new();
    let mut locations = Vec::with_capacity(req.tensors.len());
    let mut weight_map = BTreeMap::new();
    let mut data_bytes = 0;
    for (k, range) in files.into_iter().enumerate() {
        let name = format!("model-{:05}-of-{nfiles:05}.safetensors", k + 1);
        let ts = &req.tensors[range];
        let header = safetensors_header(ts);
        let mut off = header.len() as u64;
        for t in ts {
            locations.push(Location {
                object: k as u32,
                offset: off,
            });
            weight_map.insert(t.spec.name.clone(), name.clone());
            off += t.bytes.len() as u64;
        }
        let mut parts: Vec<&[u8]> = vec![&header];
        parts.extend(ts.iter().map(|t| t.bytes));
        let n = upload(store, url, &name, &parts, opts.part_bytes).await?;
        data_bytes += n;
        objects.push(ObjectEntry { name, bytes: n });
    }
    let total: u64 = req.tensors.iter().map(|t| t.bytes.len() as u64).sum();
    let index = serde_json::to_vec_pretty(&serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    }))
    .unwrap_or_default();
    let n = upload(store, url, INDEX_NAME, &[&index], opts.part_bytes).await?;
    objects.push(ObjectEntry {
        name: INDEX_NAME.into(),
        bytes: n,
    });
    for (name, bytes) in extra {
        let n = upload(store, url, name, &[bytes], opts.part_bytes).await?;
        objects.push(ObjectEntry {
            name: name.clone(),
            bytes: n,
        });
    }
    let manifest = ArtifactManifest {
        format: FORMAT.into(),
        version: req.version,
        label: req.label.map(str::to_string),
        kind: ArtifactKind::Canonical,
        base: None,
        base_url: None,
        tensors: tensor_entries(req.tensors, &digests),
        objects,
        locations,
        chunk_bytes: 0,
        chunks: Vec::new(),
        pieces,
    };
    finish(store, url, manifest, data_bytes, t0).await
}

fn tensor_entries(tensors: &[WholeTensor<'_>], digests: &[Digest]) -> Vec<TensorEntry> {
    tensors
        .iter()
        .zip(digests)
        .map(|(t, d)| TensorEntry {
            name: t.spec.name.clone(),
            dtype: t.spec.dtype,
            shape: t.spec.shape.clone(),
            digest: *d,
        })
        .collect()
}

/// Writes the manifest (last) and reports.
async fn finish(
    store: &Store,
    url: &ArtifactUrl,
    manifest: ArtifactManifest,
    data_bytes: u64,
    t0: Instant,
) -> Result<Exported, Error> {
    let bytes = serde_json::to_vec(&manifest).map_err(|e| Error::BadManifest {
        url: url.to_string(),
        reason: format!("serializing: {e}"),
    })?;
    let manifest_digest = Digest::of(&bytes);
    upload(store, url, MANIFEST_NAME, &[&bytes], 16 << 20).await?;
    tracing::info!(
        url = %url,
        kind = ?manifest.kind,
        version = %manifest.version,
        data_bytes,
        seconds = t0.elapsed().as_secs_f64(),
        "exported"
    );
    Ok(Exported {
        url: url.clone(),
        manifest_digest,
        manifest,
        data_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Writes `req`'s version to `url` as an XOR delta against `base`: per tensor, per range of
/// `opts.chunk_bytes` of its row-major bytes, `zstd(target ^ base)` (ranges where they are equal
/// store nothing), the compressed ranges gathered into objects of about `opts.object_bytes`, each
/// range fetchable on its own by its (object, offset, length) and checked by its blake3. The
/// manifest records the base's id (and its URL when given) and the target's digests.
///
/// # Errors
/// [`prove_version`]'s errors; [`Error::NotTheVersion`] when the base's tensors differ in name,
/// dtype or shape from the target's, or (with `base.url`) from the base artifact's digests;
/// [`Error::Store`] from the uploads.
pub async fn export_delta(
    store: &Store,
    url: &ArtifactUrl,
    req: &ExportRequest<'_>,
    base: &DeltaBase<'_>,
    opts: &ExportOptions,
) -> Result<Exported, Error> {
    let t0 = Instant::now();
    let digests = prove_version(req)?;
    let bases = match_base(req, base)?;
    if let Some(base_url) = base.url {
        let a = Artifact::open(store, base_url, None).await?;
        check_base_artifact(req, base, &bases, &a)?;
    }
    let pieces = pieces_for(req.tensors, req.layouts)?;
    let cb = opts.chunk_bytes.clamp(1, crate::format::MAX_CHUNK_BYTES) as usize;
    let mut chunks = Vec::with_capacity(req.tensors.len());
    let mut objects: Vec<ObjectEntry> = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut data_bytes = 0;
    for (t, b) in req.tensors.iter().zip(&bases) {
        let compressed: Vec<Option<Vec<u8>>> = t
            .bytes
            .par_chunks(cb)
            .zip(b.par_chunks(cb))
            .map(|(x, y)| {
                if x == y {
                    return Ok(None);
                }
                let xor: Vec<u8> = x.iter().zip(y).map(|(a, b)| a ^ b).collect();
                zstd::bulk::compress(&xor, opts.zstd_level).map(Some)
            })
            .collect::<Result<_, _>>()
            .map_err(|e| Error::Io {
                path: format!("zstd compressing tensor {}", t.spec.name),
                source: e,
            })?;
        let mut list = Vec::with_capacity(compressed.len());
        for c in compressed {
            let Some(c) = c else {
                list.push(None);
                continue;
            };
            list.push(Some(Chunk {
                object: objects.len() as u32,
                at: pending.len() as u64,
                len: c.len() as u64,
                digest: Digest::of(&c),
            }));
            pending.extend_from_slice(&c);
            if pending.len() as u64 >= opts.object_bytes {
                data_bytes += flush(store, url, &mut objects, &mut pending, opts).await?;
            }
        }
        chunks.push(list);
    }
    if !pending.is_empty() {
        data_bytes += flush(store, url, &mut objects, &mut pending, opts).await?;
    }
    let manifest = ArtifactManifest {
        format: FORMAT.into(),
        version: req.version,
        label: req.label.map(str::to_string),
        kind: ArtifactKind::Delta,
        base: Some(base.version),
        base_url: base.url.map(ToString::to_string),
        tensors: tensor_entries(req.tensors, &digests),
        objects,
        locations: Vec::new(),
        chunk_bytes: cb as u64,
        chunks,
        pieces,
    };
    finish(store, url, manifest, data_bytes, t0).await
}

/// The base bytes of each target tensor, in target order.
fn match_base<'a>(req: &ExportRequest<'_>, base: &DeltaBase<'a>) -> Result<Vec<&'a [u8]>, Error> {
    let by_name: HashMap<&str, &WholeTensor<'a>> = base
        .tensors
        .iter()
        .map(|t| (t.spec.name.as_str(), t))
        .collect();
    req.tensors
        .iter()
        .map(|t| {
            let bad = |reason: String| Error::NotTheVersion {
                version: req.version.to_string(),
                tensor: t.spec.name.clone(),
                reason,
            };
            let b = by_name
                .get(t.spec.name.as_str())
                .ok_or_else(|| bad(format!("not in the base {}", base.version)))?;
            if b.spec.dtype != t.spec.dtype
                || b.spec.shape != t.spec.shape
                || b.bytes.len() != t.bytes.len()
            {
                return Err(bad(format!(
                    "{} {:?} in the base {}, {} {:?} in the target",
                    b.spec.dtype.as_str(),
                    b.spec.shape,
                    base.version,
                    t.spec.dtype.as_str(),
                    t.spec.shape
                )));
            }
            Ok(b.bytes)
        })
        .collect()
}

/// The base bytes must be the base artifact's version, tensor by tensor.
fn check_base_artifact(
    req: &ExportRequest<'_>,
    base: &DeltaBase<'_>,
    bases: &[&[u8]],
    a: &Artifact,
) -> Result<(), Error> {
    let m = a.manifest();
    let bad = |tensor: &str, reason: String| Error::NotTheVersion {
        version: req.version.to_string(),
        tensor: tensor.to_string(),
        reason,
    };
    if m.version != base.version {
        return Err(bad(
            "(all)",
            format!(
                "the base artifact {} holds {}, not the base {}",
                a.url(),
                m.version,
                base.version
            ),
        ));
    }
    let digests: HashMap<&str, Digest> = m
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.digest))
        .collect();
    let mismatch = req
        .tensors
        .par_iter()
        .zip(bases.par_iter())
        .find_map_any(|(t, b)| {
            let want = digests.get(t.spec.name.as_str());
            (want != Some(&Digest::of(b))).then(|| t.spec.name.clone())
        });
    match mismatch {
        Some(name) => Err(bad(
            &name,
            format!(
                "the base bytes given differ from the base artifact {}",
                a.url()
            ),
        )),
        None => Ok(()),
    }
}

/// Uploads the pending compressed chunks as the next delta object.
async fn flush(
    store: &Store,
    url: &ArtifactUrl,
    objects: &mut Vec<ObjectEntry>,
    pending: &mut Vec<u8>,
    opts: &ExportOptions,
) -> Result<u64, Error> {
    let name = format!("delta-{:05}.bin", objects.len());
    let n = upload(store, url, &name, &[pending.as_slice()], opts.part_bytes).await?;
    objects.push(ObjectEntry { name, bytes: n });
    pending.clear();
    Ok(n)
}
