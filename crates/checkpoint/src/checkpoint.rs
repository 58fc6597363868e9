//! A checkpoint directory: one file or an index over shards, plus its config.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use mx_layout::{DType, TensorSpec};
use serde_json::Value;

use crate::file::{Entry, MappedFile};
use crate::Error;

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of a sharded checkpoint's index (`{"weight_map": {tensor: file}}`).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// An open HF safetensors checkpoint: every file memory-mapped and validated, every tensor known.
///
/// Opened from a directory holding `model.safetensors`, or `model.safetensors.index.json` and the
/// shard files its `weight_map` names (the index wins when both exist). Tensor data is borrowed
/// straight from the read-only mappings; nothing is copied.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<MappedFile>,
    /// Tensor name -> (index into `files`, entry).
    tensors: BTreeMap<String, (usize, Entry)>,
    config: Option<Value>,
}

/// A borrowed view of one tensor's bytes in a [`Checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// Tensor name as in the checkpoint header.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost dimension first (row-major, C order).
    pub shape: Vec<u64>,
    /// Raw little-endian element bytes; `data.len()` = element count x `dtype.size_bytes()`.
    /// No alignment is promised.
    pub data: &'a [u8],
    /// The safetensors file holding the tensor.
    pub file: &'a Path,
    /// Byte offset of `data` within `file` (header included).
    pub file_offset: u64,
}

impl TensorView<'_> {
    /// Number of elements (product of `shape`; 1 for a scalar).
    pub fn num_elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: maps every safetensors file, parses and validates every
    /// header, checks the index against the shards, and reads `config.json` if present.
    ///
    /// # Errors
    /// [`Error::NoCheckpoint`] when `dir` has neither file; [`Error::Io`]; any header error of
    /// [`Error`] naming the file and tensor; for a sharded checkpoint [`Error::BadIndex`],
    /// [`Error::IndexFileMissing`], [`Error::IndexTensorMissing`], [`Error::UnlistedTensor`];
    /// [`Error::BadConfig`] when `config.json` is not JSON.
    pub fn open(dir: &Path) -> Result<Checkpoint, Error> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let (files, tensors) = if index.is_file() {
            open_sharded(dir, &index)?
        } else if single.is_file() {
            open_files(&[single])?
        } else {
            return Err(Error::NoCheckpoint {
                dir: dir.to_path_buf(),
            });
        };
        let config = read_config(&dir.join(CONFIG_FILE))?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            tensors,
            config,
        })
    }

    /// Opens one safetensors file as a checkpoint; `dir()` is its parent, and `config.json` there
    /// is read if present.
    ///
    /// # Errors
    /// As [`Checkpoint::open`], less the index errors.
    pub fn open_file(path: &Path) -> Result<Checkpoint, Error> {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let (files, tensors) = open_files(&[path.to_path_buf()])?;
        let config = read_config(&dir.join(CONFIG_FILE))?;
        Ok(Checkpoint {
            dir,
            files,
            tensors,
            config,
        })
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when the checkpoint holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// A view of tensor `name`'s bytes.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] naming it when the checkpoint does not hold it.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, Error> {
        let (key, (file_idx, entry)) =
            self.tensors
                .get_key_value(name)
                .ok_or_else(|| Error::MissingTensor {
                    dir: self.dir.clone(),
                    name: name.to_string(),
                })?;
        // `file_idx` always indexes `files`: both are built together in `open_files`.
        let file = &self.files[*file_idx];
        Ok(TensorView {
            name: key,
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            data: file.bytes(entry),
            file: &file.path,
            file_offset: entry.start,
        })
    }

    /// Iterates over every tensor in name order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        self.tensors.iter().map(|(name, (file_idx, entry))| {
            let file = &self.files[*file_idx];
            TensorView {
                name,
                dtype: entry.dtype,
                shape: entry.shape.clone(),
                data: file.bytes(entry),
                file: &file.path,
                file_offset: entry.start,
            }
        })
    }

    /// Name, dtype and global shape of every tensor, sorted by name.
    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors
            .iter()
            .map(|(name, (_, e))| TensorSpec {
                name: name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
            })
            .collect()
    }

    /// Sum of all tensors' byte lengths.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|(_, e)| e.len).sum()
    }

    /// The parsed `config.json`, if the directory has one.
    pub fn config(&self) -> Option<&Value> {
        self.config.as_ref()
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The safetensors files, in the order opened (sorted by name for a sharded checkpoint).
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }
}

type Tensors = BTreeMap<String, (usize, Entry)>;

/// Maps and validates `paths`; fails on a tensor name held by two files.
fn open_files(paths: &[PathBuf]) -> Result<(Vec<MappedFile>, Tensors), Error> {
    let mut files = Vec::with_capacity(paths.len());
    let mut tensors = Tensors::new();
    for (i, path) in paths.iter().enumerate() {
        let f = MappedFile::open(path)?;
        for (name, entry) in &f.tensors {
            if tensors.insert(name.clone(), (i, entry.clone())).is_some() {
                return Err(Error::DuplicateTensor {
                    file: path.clone(),
                    tensor: name.clone(),
                });
            }
        }
        files.push(f);
    }
    Ok((files, tensors))
}

/// Opens a sharded checkpoint and checks that the index and the shards agree exactly.
fn open_sharded(dir: &Path, index: &Path) -> Result<(Vec<MappedFile>, Tensors), Error> {
    let bad = |reason: String| Error::BadIndex {
        index: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io {
        op: "reading",
        path: index.to_path_buf(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("missing or non-object \"weight_map\"".to_string()))?;
    // tensor -> shard file name, and the first tensor naming each file.
    let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
    let mut shard_names: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("tensor {tensor}: file name is not a string")))?;
        if !is_plain_file_name(file) {
            return Err(bad(format!(
                "tensor {tensor}: file {file:?} is not a plain file name"
            )));
        }
        wanted.insert(tensor, file);
        shard_names.entry(file).or_insert(tensor);
    }
    let mut paths = Vec::with_capacity(shard_names.len());
    for (file, first_tensor) in &shard_names {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(Error::IndexFileMissing {
                index: index.to_path_buf(),
                tensor: (*first_tensor).to_string(),
                file: path,
            });
        }
        paths.push(path);
    }
    let (files, tensors) = open_files(&paths)?;
    let names: Vec<&str> = shard_names.keys().copied().collect();
    for (tensor, file) in &wanted {
        let held_by = tensors.get(*tensor).and_then(|(i, _)| names.get(*i));
        if held_by != Some(file) {
            return Err(Error::IndexTensorMissing {
                index: index.to_path_buf(),
                tensor: (*tensor).to_string(),
                file: dir.join(file),
            });
        }
    }
    let listed: BTreeSet<&str> = wanted.keys().copied().collect();
    for (tensor, (i, _)) in &tensors {
        if !listed.contains(tensor.as_str()) {
            return Err(Error::UnlistedTensor {
                index: index.to_path_buf(),
                tensor: tensor.clone(),
                file: paths.get(*i).cloned().unwrap_or_default(),
            });
        }
    }
    Ok((files, tensors))
}

/// True for a single normal path component (no separators, no `..`, not absolute).
fn is_plain_file_name(name: &str) -> bool {
    let mut comps = Path::new(name).components();
    matches!(
        (comps.next(), comps.next()),
        (Some(Component::Normal(_)), None)
    )
}

/// Reads `path` as JSON if it exists.
fn read_config(path: &Path) -> Result<Option<Value>, Error> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        op: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::BadConfig {
            file: path.to_path_buf(),
            reason: e.to_string(),
        })
}
