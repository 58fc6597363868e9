//! A checkpoint directory: one file or an index over shards, plus its config.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use mx_layout::{strict_json, DType, LayoutSpec, ModelInfo, Scheme, TensorSpec};
use serde_json::Value;

use crate::file::{json_error, Entry, MappedFile};
use crate::Error;

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of a sharded checkpoint's index (`{"weight_map": {tensor: file}}`).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// The word embedding a tied-embedding (`tie_word_embeddings`) llama-family model reuses as its
/// output projection.
const EMBEDDING: &str = "model.embed_tokens.weight";
/// The output projection, redundant in a tied-embedding model.
const LM_HEAD: &str = "lm_head.weight";

/// An open HF safetensors checkpoint: every file memory-mapped and validated, every tensor known.
///
/// Opened from a directory holding `model.safetensors`, or `model.safetensors.index.json` and the
/// shard files its `weight_map` names (the index wins when both exist). Tensor data is borrowed
/// straight from the read-only mappings; nothing is copied.
///
/// When `config.json` ties the word embeddings (`tie_word_embeddings: true`) and the checkpoint
/// also holds an `lm_head.weight`, that tensor must equal `model.embed_tokens.weight` byte for
/// byte ([`Error::TiedEmbeddingMismatch`] otherwise), and is then left out of the checkpoint's
/// tensors, so it is neither declared, published nor pulled a second time.
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
        Checkpoint {
            dir: dir.to_path_buf(),
            files,
            tensors,
            config,
        }
        .untie()
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
        Checkpoint {
            dir,
            files,
            tensors,
            config,
        }
        .untie()
    }

    /// Checks a tied-embedding checkpoint's `lm_head.weight` against its embedding and drops it
    /// when identical (see [`Checkpoint`]).
    fn untie(mut self) -> Result<Checkpoint, Error> {
        let tied = self
            .config
            .as_ref()
            .and_then(|c| c.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if !tied || !self.tensors.contains_key(LM_HEAD) {
            return Ok(self);
        }
        let mismatch = |reason: String| Error::TiedEmbeddingMismatch {
            dir: self.dir.clone(),
            embedding: EMBEDDING.into(),
            lm_head: LM_HEAD.into(),
            reason,
        };
        let head = self.tensor(LM_HEAD)?;
        let Ok(embed) = self.tensor(EMBEDDING) else {
            return Err(mismatch(format!("there is no {EMBEDDING}")));
        };
        if (head.dtype, &head.shape) != (embed.dtype, &embed.shape) {
            return Err(mismatch(format!(
                "{} {:?} against {} {:?}",
                head.dtype, head.shape, embed.dtype, embed.shape
            )));
        }
        if let Some(at) = head.data.iter().zip(embed.data).position(|(a, b)| a != b) {
            return Err(mismatch(format!(
                "their bytes differ (first at byte {at} of {})",
                head.data.len()
            )));
        }
        self.tensors.remove(LM_HEAD);
        Ok(self)
    }

    /// The model as mx lays it out, for `layouts`: from `config.json` and the tensors
    /// ([`ModelInfo::from_hf_config`]), or without `config.json` a generic model
    /// ([`ModelInfo::generic`]) when every layout is replicated or FSDP, which need no model
    /// shape.
    ///
    /// # Errors
    /// [`Error::NoConfig`] naming `config.json` and the first layout that needs it (tensor
    /// parallelism); [`Error::Model`] when `config.json` does not describe the tensors.
    pub fn model_info(&self, layouts: &[LayoutSpec]) -> Result<ModelInfo, Error> {
        match &self.config {
            Some(config) => {
                ModelInfo::from_hf_config(config, self.specs()).map_err(|source| Error::Model {
                    dir: self.dir.clone(),
                    source,
                })
            }
            None => match layouts
                .iter()
                .find(|l| !matches!(l.scheme, Scheme::Replicated | Scheme::Fsdp))
            {
                Some(l) => Err(Error::NoConfig {
                    file: self.dir.join(CONFIG_FILE),
                    layout: l.to_string(),
                }),
                None => Ok(ModelInfo::generic(self.specs())),
            },
        }
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
    let text = std::fs::read(index).map_err(|source| Error::Io {
        op: "reading",
        path: index.to_path_buf(),
        source,
    })?;
    let weight_map = parse_index(index, &text)?;
    // tensor -> shard file name, and the first tensor naming each file.
    let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
    let mut shard_names: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, file) in &weight_map {
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

/// Parses the text of `model.safetensors.index.json` (`index` names it in errors) into its
/// `weight_map`: tensor name -> shard file name, every file name a plain name in the same
/// directory. Other top-level keys (`metadata`) are allowed; no key may repeat anywhere.
///
/// # Errors
/// [`Error::DuplicateKey`] naming a repeated key; [`Error::BadIndex`] for text that is not JSON,
/// a missing or non-object `weight_map`, or a file name that is not a string or not plain.
pub fn parse_index(index: &Path, text: &[u8]) -> Result<BTreeMap<String, String>, Error> {
    let bad = |reason: String| Error::BadIndex {
        index: index.to_path_buf(),
        reason,
    };
    let json: Value = strict_json::from_slice(text)
        .map_err(|e| json_error(index, e, |r| bad(format!("not JSON: {r}"))))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("missing or non-object \"weight_map\"".to_string()))?;
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("tensor {tensor}: file name is not a string")))?;
        if !is_plain_file_name(file) {
            return Err(bad(format!(
                "tensor {tensor}: file {file:?} is not a plain file name"
            )));
        }
        out.insert(tensor.clone(), file.to_string());
    }
    Ok(out)
}

/// Parses the text of a `config.json` (`file` names it in errors) as strict JSON.
///
/// # Errors
/// [`Error::DuplicateKey`] naming a repeated key; [`Error::BadConfig`] for text that is not
/// JSON or not an object.
pub fn parse_config(file: &Path, text: &[u8]) -> Result<Value, Error> {
    let bad = |reason: String| Error::BadConfig {
        file: file.to_path_buf(),
        reason,
    };
    let v: Value = strict_json::from_slice(text).map_err(|e| json_error(file, e, bad))?;
    if !v.is_object() {
        return Err(bad("not a JSON object".to_string()));
    }
    Ok(v)
}

/// True for a single normal path component (no separators, no `..`, not absolute). The text
/// must be that component exactly: `Path::components` drops a trailing `/` or `/.`, so
/// `"shard/"` would otherwise pass (found by the `safetensors_index` fuzz target).
fn is_plain_file_name(name: &str) -> bool {
    let mut comps = Path::new(name).components();
    match (comps.next(), comps.next()) {
        (Some(Component::Normal(c)), None) => c == std::ffi::OsStr::new(name),
        _ => false,
    }
}

/// Reads `path` as JSON if it exists.
fn read_config(path: &Path) -> Result<Option<Value>, Error> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read(path).map_err(|source| Error::Io {
        op: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    parse_config(path, &text).map(Some)
}
