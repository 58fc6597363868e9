//! Writing safetensors files (for tests and tools).

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use mx_layout::DType;
use serde_json::{json, Map, Value};

use crate::file::byte_len;
use crate::Error;

/// Writes `tensors` (name, dtype, shape, raw little-endian bytes) to `path` as a safetensors file.
///
/// Data is laid out in name order; the JSON header is padded with spaces to a multiple of 8 bytes
/// so every tensor's data starts 8-byte aligned relative to the data section. The file is written
/// to `path` directly (not atomically) and synced.
///
/// # Errors
/// [`Error::LengthMismatch`] when a buffer's length is not element count x dtype size (naming the
/// tensor; nothing is written); [`Error::DuplicateTensor`] for a repeated name; [`Error::Io`].
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, DType, Vec<u64>, Vec<u8>)],
) -> Result<(), Error> {
    write_safetensors_with_sync(path, tensors, true)
}

/// As [`write_safetensors`]; with `sync: false` the file is left in the page cache without
/// `fsync`, as `safetensors.torch.save_file` and HF `save_pretrained` leave it (for measuring
/// the disk path frameworks use).
///
/// # Errors
/// As [`write_safetensors`].
pub fn write_safetensors_with_sync(
    path: &Path,
    tensors: &[(String, DType, Vec<u64>, Vec<u8>)],
    sync: bool,
) -> Result<(), Error> {
    let mut order: Vec<&(String, DType, Vec<u64>, Vec<u8>)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut seen = BTreeSet::new();
    let mut header = Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape, data) in order.iter().map(|t| (&t.0, t.1, &t.2, &t.3)) {
        if !seen.insert(name.as_str()) {
            return Err(Error::DuplicateTensor {
                file: path.to_path_buf(),
                tensor: name.clone(),
            });
        }
        let actual = data.len() as u64;
        if byte_len(dtype, shape) != Some(actual) {
            return Err(Error::LengthMismatch {
                file: path.to_path_buf(),
                tensor: name.clone(),
                dtype,
                shape: shape.clone(),
                expected: byte_len(dtype, shape).unwrap_or(u64::MAX),
                actual,
            });
        }
        let end = offset + actual; // cannot overflow: the sum of in-memory buffer lengths
        header.insert(
            name.clone(),
            json!({ "dtype": dtype.as_str(), "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut head = serde_json::to_vec(&Value::Object(header)).map_err(|e| Error::Io {
        op: "encoding the header of",
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    head.resize(head.len().next_multiple_of(8), b' ');
    let io = |source| Error::Io {
        op: "writing",
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    let mut out = BufWriter::new(file);
    out.write_all(&(head.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&head).map_err(io)?;
    for t in &order {
        out.write_all(&t.3).map_err(io)?;
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    if sync {
        file.sync_all().map_err(io)?;
    }
    Ok(())
}
