//! One memory-mapped safetensors file: header checks with named errors, then the safetensors
//! crate's own validation.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mx_layout::DType;
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
        let tensors = check_header(path, &map)?;
        if let Err(source) = SafeTensors::read_metadata(&map) {
            return Err(Error::Safetensors {
                file: path.to_path_buf(),
                source,
            });
        }
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

/// Parses and checks the header of the safetensors bytes `buf` read from `path`.
fn check_header(path: &Path, buf: &[u8]) -> Result<Vec<(String, Entry)>, Error> {
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
    let json: Value = serde_json::from_str(text).map_err(|e| Error::BadHeader {
        file: file(),
        reason: format!("not JSON: {e}"),
    })?;
    let Value::Object(map) = json else {
        return Err(Error::BadHeader {
            file: file(),
            reason: "not a JSON object".to_string(),
        });
    };
    let data_len = file_len - data_start;
    let mut out = Vec::with_capacity(map.len());
    for (name, info) in &map {
        if name == "__metadata__" {
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
        out.push((
            name.clone(),
            Entry {
                dtype,
                shape,
                start: data_start + begin,
                len: actual,
            },
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Bytes of a `dtype` tensor of `shape`, or None on u64 overflow.
pub(crate) fn byte_len(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
}
