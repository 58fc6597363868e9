//! One memory-mapped safetensors file: header checks with named errors, then the safetensors
//! crate's own validation.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mx_layout::{strict_json, DType, JsonError};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::Error;

/// Largest header accepted, in bytes (the safetensors crate's own limit).
pub(crate) const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes of the little-endian u64 header-length prefix.
const PREFIX_LEN: u64 = 8;

/// A tensor's place in one file.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// Element type.
    pub(crate) dtype: DType,
    /// Shape, outermost dimension first.
    pub(crate) shape: Vec<u64>,
    /// Absolute byte offset of the first data byte within the file.
    pub(crate) start: u64,
    /// Byte length of the data.
    pub(crate) len: u64,
}

/// A mapped, validated safetensors file.
#[derive(Debug)]
pub(crate) struct MappedFile {
    /// The file's path as opened.
    pub(crate) path: PathBuf,
    /// The whole file, read-only.
    pub(crate) map: Mmap,
    /// Tensors by name (sorted), with absolute file offsets.
    pub(crate) tensors: Vec<(String, Entry)>,
}

impl MappedFile {
    /// Maps `path` and validates its header and every tensor's extent.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or mapped; the header and tensor variants of
    /// [`Error`] (truncated, too large, past EOF, bad JSON, bad entry, unknown dtype, offsets past
    /// end, length mismatch) naming the file and tensor; [`Error::Safetensors`] for anything else
    /// the safetensors crate refuses.
    pub(crate) fn open(path: &Path) -> Result<MappedFile, Error> {
        let io = |op: &'static str| {
            let path = path.to_path_buf();
            move |source| Error::Io { op, path, source }
        };
        let file = File::open(path).map_err(io("opening"))?;
        let file_len = file.metadata().map_err(io("reading metadata of"))?.len();
        if file_len < PREFIX_LEN {
            return Err(Error::HeaderTruncated {
                file: path.to_path_buf(),
                file_len,
            });
        }
        // SAFETY: the mapping is read-only and private to this process; mx treats checkpoint files
        // as immutable while a `Checkpoint` is open (a file truncated by another process while
        // mapped would fault on access, which is the documented limit of this crate). The map's
        // lifetime is tied to `MappedFile`, and every slice handed out borrows from it.
        let map = unsafe { Mmap::map(&file) }.map_err(io("mapping"))?;
        let header = Header::parse(path, &map)?;
        let tensors = header
            .tensors
            .into_iter()
            .map(|t| {
                let entry = Entry {
                    dtype: t.dtype,
                    shape: t.shape,
                    start: header.data_start + t.begin,
                    len: t.end - t.begin,
                };
                (t.name, entry)
            })
            .collect();
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            tensors,
        })
    }

    /// The data bytes of `entry`, which came from this file's header.
    pub(crate) fn bytes(&self, entry: &Entry) -> &[u8] {
        // Both bounds were checked against the mapped length in `check_header`; `get` keeps this
        // total anyway.
        let start = usize::try_from(entry.start).unwrap_or(usize::MAX);
        let end = start.saturating_add(usize::try_from(entry.len).unwrap_or(usize::MAX));
        self.map.get(start..end).unwrap_or(&[])
    }
}

/// One tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost dimension first.
    pub shape: Vec<u64>,
    /// Start of its bytes in the data section (after the header).
    pub begin: u64,
    /// End (exclusive) of its bytes in the data section.
    pub end: u64,
}

/// A checked safetensors header: what [`Header::parse`] accepts from a file's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors, sorted by name; every extent lies in the data section and matches dtype x shape.
    pub tensors: Vec<HeaderTensor>,
    /// `__metadata__`: string keys to string values.
    pub metadata: BTreeMap<String, String>,
    /// Byte offset of the data section in the file (8 + header length).
    pub data_start: u64,
    /// Length of the data section in bytes.
    pub data_len: u64,
}

impl Header {
    /// Parses and checks the header of the safetensors file `bytes` (the whole file; `path` only
    /// names it in errors), then lets the safetensors crate validate it again (gaps, overlaps,
    /// trailing bytes).
    ///
    /// # Errors
    /// The header variants of [`Error`] (truncated, too large, past EOF, bad JSON, duplicate key,
    /// bad metadata, bad entry, unknown dtype, offsets past end, length mismatch) naming the file
    /// and tensor; [`Error::Safetensors`] for anything else the safetensors crate refuses.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Header, Error> {
        let header = check_header(path, bytes)?;
        if let Err(source) = SafeTensors::read_metadata(bytes) {
            return Err(Error::Safetensors {
                file: path.to_path_buf(),
                source,
            });
        }
        Ok(header)
    }

    /// The header's JSON text (canonical: keys sorted, no padding), which [`Header::parse`]
    /// reads back as `self` when prefixed by its length and followed by the data section.
    pub fn to_json(&self) -> String {
        let mut map = serde_json::Map::new();
        if !self.metadata.is_empty() {
            let meta: serde_json::Map<String, Value> = self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            map.insert("__metadata__".into(), Value::Object(meta));
        }
        for t in &self.tensors {
            map.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": t.dtype.to_string(),
                    "shape": t.shape,
                    "data_offsets": [t.begin, t.end],
                }),
            );
        }
        Value::Object(map).to_string()
    }
}

/// Maps a strict-JSON error of `file` onto [`Error`]; `invalid` builds the error for bad JSON.
pub(crate) fn json_error(
    file: &Path,
    e: JsonError,
    invalid: impl FnOnce(String) -> Error,
) -> Error {
    match e {
        JsonError::DuplicateKey { key, path } => Error::DuplicateKey {
            file: file.to_path_buf(),
            key,
            path,
        },
        other => invalid(other.to_string()),
    }
}

/// Parses and checks the header of the safetensors bytes `buf` read from `path`.
fn check_header(path: &Path, buf: &[u8]) -> Result<Header, Error> {
    let file = || path.to_path_buf();
    let file_len = buf.len() as u64;
    let mut prefix = [0u8; 8];
    prefix.copy_from_slice(buf.get(..8).ok_or(Error::HeaderTruncated {
        file: file(),
        file_len,
    })?);
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge {
            file: file(),
            header_len,
            limit: MAX_HEADER_LEN,
        });
    }
    let data_start = PREFIX_LEN + header_len; // cannot overflow: header_len <= 1e8
    if data_start > file_len {
        return Err(Error::HeaderPastEof {
            file: file(),
            header_len,
            file_len,
        });
    }
    let header = buf.get(8..data_start as usize).unwrap_or(&[]);
    let text = std::str::from_utf8(header).map_err(|e| Error::BadHeader {
        file: file(),
        reason: format!("not UTF-8: {e}"),
    })?;
    let json: Value = strict_json::from_str(text).map_err(|e| {
        json_error(path, e, |reason| Error::BadHeader {
            file: file(),
            reason: format!("not JSON: {reason}"),
        })
    })?;
    let Value::Object(map) = json else {
        return Err(Error::BadHeader {
            file: file(),
            reason: "not a JSON object".to_string(),
        });
    };
    let data_len = file_len - data_start;
    let mut out = Vec::with_capacity(map.len());
    let mut metadata = BTreeMap::new();
    for (name, info) in &map {
        if name == "__metadata__" {
            metadata = check_metadata(path, info)?;
            continue;
        }
        let bad = |reason: &str| Error::BadTensorEntry {
            file: file(),
            tensor: name.clone(),
            reason: reason.to_string(),
        };
        let dtype_str = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing or non-string \"dtype\""))?;
        let dtype: DType = dtype_str.parse().map_err(|_| Error::UnknownDType {
            file: file(),
            tensor: name.clone(),
            dtype: dtype_str.to_string(),
        })?;
        let shape = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing or non-array \"shape\""))?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| bad("\"shape\" holds a value that is not a non-negative integer"))?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing or non-array \"data_offsets\""))?;
        let (begin, end) = match offsets.as_slice() {
            [b, e] => match (b.as_u64(), e.as_u64()) {
                (Some(b), Some(e)) => (b, e),
                _ => return Err(bad("\"data_offsets\" are not non-negative integers")),
            },
            _ => return Err(bad("\"data_offsets\" is not a [begin, end] pair")),
        };
        if end < begin {
            return Err(bad("\"data_offsets\" end is before begin"));
        }
        let expected = byte_len(dtype, &shape)
            .ok_or_else(|| bad("element count times dtype size overflows u64"))?;
        let actual = end - begin;
        if actual != expected {
            return Err(Error::LengthMismatch {
                file: file(),
                tensor: name.clone(),
                dtype,
                shape,
                expected,
                actual,
            });
        }
        if end > data_len {
            return Err(Error::OffsetsPastEnd {
                file: file(),
                tensor: name.clone(),
                begin,
                end,
                data_len,
            });
        }
        out.push(HeaderTensor {
            name: name.clone(),
            dtype,
            shape,
            begin,
            end,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Header {
        tensors: out,
        metadata,
        data_start,
        data_len,
    })
}

/// `__metadata__` as string pairs; any other value is an error naming its key.
fn check_metadata(path: &Path, info: &Value) -> Result<BTreeMap<String, String>, Error> {
    let bad = |key: &str, reason: String| Error::BadMetadata {
        file: path.to_path_buf(),
        key: key.to_string(),
        reason,
    };
    let Value::Object(meta) = info else {
        return Err(bad(
            "",
            format!(
                "__metadata__ is {}, not an object",
                mx_layout::strict_json::kind(info)
            ),
        ));
    };
    meta.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(bad(
                k,
                format!(
                    "value is {}, not a string",
                    mx_layout::strict_json::kind(other)
                ),
            )),
        })
        .collect()
}

/// Bytes of a `dtype` tensor of `shape`, or None on u64 overflow.
pub(crate) fn byte_len(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
}
