//! Checkpoint reading: round trips, sharded indexes, every malformed-file case, real checkpoints.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: test code; a failed unwrap is a failed test

use std::fs;
use std::path::{Path, PathBuf};

use mx_checkpoint::{write_safetensors, Checkpoint, Error};
use mx_layout::{DType, TensorSpec};

type T = (String, DType, Vec<u64>, Vec<u8>);

/// Deterministic bytes: element i of tensor `seed` is a mix of both.
fn bytes(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(7))
        })
        .collect()
}

fn t(name: &str, dtype: DType, shape: &[u64], seed: u8) -> T {
    let n = shape.iter().product::<u64>() * dtype.size_bytes();
    (
        name.to_string(),
        dtype,
        shape.to_vec(),
        bytes(seed, n as usize),
    )
}

fn sample() -> Vec<T> {
    vec![
        t(
            "model.layers.0.self_attn.q_proj.weight",
            DType::BF16,
            &[6, 4],
            1,
        ),
        t("model.embed_tokens.weight", DType::F32, &[5, 4], 2),
        t("model.norm.weight", DType::F16, &[4], 3),
        t("position_ids", DType::I64, &[1, 3], 4),
        t("flags", DType::Bool, &[3], 5),
        t("fp8", DType::F8E4M3, &[2, 2], 6),
        t("scalar", DType::F64, &[], 7),
        t("empty", DType::I32, &[0, 3], 8),
    ]
}

fn write_dir(tensors: &[T]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, tensors).unwrap();
    (dir, path)
}

/// A raw safetensors file from a header string and data bytes.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

fn open_raw(content: &[u8]) -> (tempfile::TempDir, Result<Checkpoint, Error>) {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("model.safetensors"), content).unwrap();
    let r = Checkpoint::open(dir.path());
    (dir, r)
}

#[test]
fn round_trip_every_dtype_byte_exact() {
    let tensors = sample();
    let (dir, path) = write_dir(&tensors);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut names: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
    names.sort();
    assert_eq!(ck.tensor_names(), names);
    assert_eq!(ck.len(), 8);
    assert_eq!(ck.dir(), dir.path());
    assert_eq!(ck.files(), vec![path.as_path()]);
    assert!(ck.config().is_none());
    let total: u64 = tensors.iter().map(|t| t.3.len() as u64).sum();
    assert_eq!(ck.total_bytes(), total);
    let file = fs::read(&path).unwrap();
    for (name, dtype, shape, data) in &tensors {
        let v = ck.tensor(name).unwrap();
        assert_eq!(v.name, name);
        assert_eq!(v.dtype, *dtype);
        assert_eq!(&v.shape, shape);
        assert_eq!(v.data, &data[..], "{name}");
        assert_eq!(blake3::hash(v.data), blake3::hash(data));
        assert_eq!(v.num_elements(), shape.iter().product::<u64>());
        let off = v.file_offset as usize;
        assert_eq!(
            &file[off..off + data.len()],
            &data[..],
            "{name} file_offset"
        );
    }
    assert_eq!(ck.tensor("scalar").unwrap().num_elements(), 1);
    assert!(ck.tensor("empty").unwrap().data.is_empty());
    let specs = ck.specs();
    assert_eq!(specs.len(), 8);
    assert!(specs.windows(2).all(|w| w[0].name < w[1].name));
    assert_eq!(
        specs
            .iter()
            .find(|s| s.name == "model.embed_tokens.weight")
            .unwrap(),
        &TensorSpec {
            name: "model.embed_tokens.weight".into(),
            dtype: DType::F32,
            shape: vec![5, 4]
        }
    );
    // The iterator visits the same views in name order.
    let it: Vec<String> = ck.tensors().map(|v| v.name.to_string()).collect();
    assert_eq!(it, names);

    // The safetensors crate reads our file as written, and the header is 8-byte padded.
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    assert_eq!(st.len(), 8);
    let q = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.shape(), &[6, 4]);
    assert_eq!(q.dtype(), safetensors::Dtype::BF16);
    assert_eq!(q.data(), &tensors[0].3[..]);
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap());
    assert_eq!(header_len % 8, 0);
    assert_eq!(file.len() as u64, 8 + header_len + total);

    // open_file on the file itself gives the same tensors.
    let ck2 = Checkpoint::open_file(&path).unwrap();
    assert_eq!(ck2.specs(), specs);
}

#[test]
fn write_is_deterministic_and_order_independent() {
    let mut a = sample();
    let (d1, p1) = write_dir(&a);
    a.reverse();
    let (_d2, p2) = write_dir(&a);
    assert_eq!(fs::read(&p1).unwrap(), fs::read(&p2).unwrap());
    drop(d1);
}

#[test]
fn sharded_index_two_files_with_config() {
    let dir = tempfile::tempdir().unwrap();
    let all = sample();
    let (first, second) = all.split_at(3);
    let f1 = "model-00001-of-00002.safetensors";
    let f2 = "model-00002-of-00002.safetensors";
    write_safetensors(&dir.path().join(f1), first).unwrap();
    write_safetensors(&dir.path().join(f2), second).unwrap();
    let mut map = serde_json::Map::new();
    for t in first {
        map.insert(t.0.clone(), f1.into());
    }
    for t in second {
        map.insert(t.0.clone(), f2.into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 123}, "weight_map": map});
    fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","hidden_size":4,"num_hidden_layers":1}"#,
    )
    .unwrap();

    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.len(), all.len());
    assert_eq!(ck.files().len(), 2);
    for (name, dtype, shape, data) in &all {
        let v = ck.tensor(name).unwrap();
        assert_eq!(
            (v.dtype, &v.shape, v.data),
            (*dtype, shape, &data[..]),
            "{name}"
        );
        let want = if first.iter().any(|t| &t.0 == name) {
            f1
        } else {
            f2
        };
        assert_eq!(v.file, dir.path().join(want), "{name}");
    }
    let cfg = ck.config().unwrap();
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["hidden_size"], 4);
}

fn assert_err(r: Result<Checkpoint, Error>, check: impl Fn(&Error) -> bool, what: &str) -> Error {
    match r {
        Ok(_) => panic!("{what}: opened a malformed checkpoint"),
        Err(e) => {
            assert!(check(&e), "{what}: wrong error: {e:?}");
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

#[test]
fn file_shorter_than_length_prefix() {
    let (_d, r) = open_raw(&[1, 0, 0, 0, 0]);
    let e = assert_err(
        r,
        |e| matches!(e, Error::HeaderTruncated { file_len: 5, .. }),
        "5-byte file",
    );
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let (_d, r) = open_raw(&[]);
    assert_err(
        r,
        |e| matches!(e, Error::HeaderTruncated { file_len: 0, .. }),
        "empty file",
    );
}

#[test]
fn truncated_inside_the_header() {
    let (dir, path) = write_dir(&sample());
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..40]).unwrap();
    let header_len = u64::from_le_bytes(full[..8].try_into().unwrap());
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::HeaderPastEof { header_len: h, file_len: 40, .. } if *h == header_len),
        "file cut inside the header",
    );
}

#[test]
fn header_length_past_eof_and_too_large() {
    let mut v = 1000u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}          ");
    let (_d, r) = open_raw(&v);
    assert_err(
        r,
        |e| {
            matches!(
                e,
                Error::HeaderPastEof {
                    header_len: 1000,
                    file_len: 20,
                    ..
                }
            )
        },
        "length 1000 in a 20-byte file",
    );
    let mut v = u64::MAX.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    let (_d, r) = open_raw(&v);
    assert_err(
        r,
        |e| {
            matches!(
                e,
                Error::HeaderTooLarge {
                    header_len: u64::MAX,
                    ..
                }
            )
        },
        "u64::MAX header length",
    );
}

#[test]
fn garbled_header_json() {
    let (dir, path) = write_dir(&sample());
    let mut full = fs::read(&path).unwrap();
    full[8] = b'['; // the opening brace of the JSON object
    full[20] = b'}';
    fs::write(&path, &full).unwrap();
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::BadHeader { reason, .. } if reason.starts_with("not JSON")),
        "garbled JSON",
    );
    let mut bad_utf8 = 2u64.to_le_bytes().to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe]);
    let (_d, r) = open_raw(&bad_utf8);
    assert_err(
        r,
        |e| matches!(e, Error::BadHeader { reason, .. } if reason.starts_with("not UTF-8")),
        "non-UTF-8 header",
    );
    let (_d, r) = open_raw(&raw_file("[1,2]", &[]));
    assert_err(
        r,
        |e| matches!(e, Error::BadHeader { .. }),
        "JSON array header",
    );
}

#[test]
fn offsets_past_the_end_of_the_data() {
    let tensors = vec![t("a", DType::F32, &[4], 1), t("b", DType::BF16, &[8], 2)];
    let (dir, path) = write_dir(&tensors);
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..full.len() - 3]).unwrap(); // a truncated download
    assert_err(
        Checkpoint::open(dir.path()),
        |e| {
            matches!(e, Error::OffsetsPastEnd { tensor, begin: 16, end: 32, data_len: 29, .. }
                if tensor == "b")
        },
        "data cut short",
    );
    // Offsets consistent with the shape but far beyond the file.
    let h = r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[1000000,1000004]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 4]));
    assert_err(
        r,
        |e| matches!(e, Error::OffsetsPastEnd { tensor, data_len: 4, .. } if tensor == "w"),
        "offsets far beyond EOF",
    );
}

#[test]
fn unknown_dtype_names_tensor_and_dtype() {
    let h = r#"{"blk.0.attn_q.weight":{"dtype":"Q4_1","shape":[2],"data_offsets":[0,2]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 2]));
    assert_err(
        r,
        |e| {
            matches!(e, Error::UnknownDType { tensor, dtype, .. }
                if tensor == "blk.0.attn_q.weight" && dtype == "Q4_1")
        },
        "dtype Q4_1",
    );
}

#[test]
fn data_length_not_matching_shape_and_dtype() {
    let h = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 12]));
    assert_err(
        r,
        |e| {
            matches!(e, Error::LengthMismatch { tensor, dtype: DType::F32, shape, expected: 16,
                actual: 12, .. } if tensor == "w" && shape == &[2, 2])
        },
        "12 bytes for F32 [2,2]",
    );
    // Element count overflow is a named entry error, not a wrap-around.
    let h = r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 8]));
    assert_err(
        r,
        |e| matches!(e, Error::BadTensorEntry { tensor, reason, .. } if tensor == "w" && reason.contains("overflow")),
        "overflowing shape",
    );
}

#[test]
fn bad_tensor_entries() {
    for (h, what) in [
        (
            r#"{"w":{"dtype":"F32","data_offsets":[0,4]}}"#,
            "missing shape",
        ),
        (
            r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#,
            "missing dtype",
        ),
        (r#"{"w":{"dtype":"F32","shape":[1]}}"#, "missing offsets"),
        (
            r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            "negative dim",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            "end before begin",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
            "one offset",
        ),
        (r#"{"w":3}"#, "entry not an object"),
    ] {
        let (_d, r) = open_raw(&raw_file(h, &[0; 4]));
        assert_err(
            r,
            |e| matches!(e, Error::BadTensorEntry { tensor, .. } if tensor == "w"),
            what,
        );
    }
}

#[test]
fn gaps_and_overlaps_rejected_by_safetensors() {
    let h = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 12]));
    assert_err(
        r,
        |e| matches!(e, Error::Safetensors { .. }),
        "gap between tensors",
    );
    let h = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 6]));
    assert_err(
        r,
        |e| matches!(e, Error::Safetensors { .. }),
        "overlapping tensors",
    );
    let h = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    let (_d, r) = open_raw(&raw_file(h, &[0; 9]));
    assert_err(
        r,
        |e| matches!(e, Error::Safetensors { .. }),
        "trailing bytes",
    );
}

#[test]
fn every_truncation_and_header_byte_flip_is_an_error_not_a_panic() {
    let (dir, path) = write_dir(&sample());
    let full = fs::read(&path).unwrap();
    for cut in 0..full.len() {
        fs::write(&path, &full[..cut]).unwrap();
        assert!(Checkpoint::open(dir.path()).is_err(), "cut at {cut} opened");
    }
    let header_end = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    for i in 0..header_end {
        for flip in [0x01u8, 0x80] {
            let mut v = full.clone();
            v[i] ^= flip;
            fs::write(&path, &v).unwrap();
            // Some flips leave a valid file (e.g. in a name); none may panic.
            let _ = Checkpoint::open(dir.path());
        }
    }
}

fn sharded(dir: &Path, index: &serde_json::Value, shards: &[(&str, Vec<T>)]) {
    for (f, ts) in shards {
        write_safetensors(&dir.join(f), ts).unwrap();
    }
    fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn index_referencing_a_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}});
    sharded(
        dir.path(),
        &index,
        &[("s1.safetensors", vec![t("a", DType::U8, &[2], 1)])],
    );
    assert_err(
        Checkpoint::open(dir.path()),
        |e| {
            matches!(e, Error::IndexFileMissing { tensor, file, .. }
                if tensor == "b" && file.ends_with("s2.safetensors"))
        },
        "missing shard",
    );
}

#[test]
fn index_referencing_a_missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}});
    sharded(
        dir.path(),
        &index,
        &[("s1.safetensors", vec![t("a", DType::U8, &[2], 1)])],
    );
    assert_err(
        Checkpoint::open(dir.path()),
        |e| {
            matches!(e, Error::IndexTensorMissing { tensor, file, .. }
                if tensor == "b" && file.ends_with("s1.safetensors"))
        },
        "tensor absent from its shard",
    );
    // Mapped to the wrong shard: held by s2, the index says s1.
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
        "c": "s2.safetensors"}});
    sharded(
        dir.path(),
        &index,
        &[
            ("s1.safetensors", vec![t("a", DType::U8, &[2], 1)]),
            (
                "s2.safetensors",
                vec![t("b", DType::U8, &[2], 2), t("c", DType::U8, &[1], 3)],
            ),
        ],
    );
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::IndexTensorMissing { tensor, .. } if tensor == "b"),
        "tensor in the wrong shard",
    );
}

#[test]
fn tensor_held_by_two_shards() {
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}});
    sharded(
        dir.path(),
        &index,
        &[
            ("s1.safetensors", vec![t("a", DType::U8, &[2], 1)]),
            (
                "s2.safetensors",
                vec![t("a", DType::U8, &[2], 1), t("b", DType::U8, &[1], 2)],
            ),
        ],
    );
    assert_err(
        Checkpoint::open(dir.path()),
        |e| {
            matches!(e, Error::DuplicateTensor { tensor, file }
                if tensor == "a" && file.ends_with("s2.safetensors"))
        },
        "tensor in two shards",
    );
}

#[test]
fn shard_tensor_missing_from_index_and_bad_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({"weight_map": {"a": "s1.safetensors"}});
    sharded(
        dir.path(),
        &index,
        &[(
            "s1.safetensors",
            vec![t("a", DType::U8, &[2], 1), t("extra", DType::U8, &[1], 2)],
        )],
    );
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::UnlistedTensor { tensor, .. } if tensor == "extra"),
        "unlisted shard tensor",
    );
    let idx = dir.path().join("model.safetensors.index.json");
    for (text, what) in [
        (
            r#"{"weight_map": {"a": "../s1.safetensors"}}"#,
            "path escaping the dir",
        ),
        (r#"{"weight_map": {"a": 7}}"#, "non-string file"),
        (r#"{"metadata": {}}"#, "no weight_map"),
        (r#"{"weight_map": {"a": "s1.safe"#, "garbled JSON"),
    ] {
        fs::write(&idx, text).unwrap();
        assert_err(
            Checkpoint::open(dir.path()),
            |e| matches!(e, Error::BadIndex { .. }),
            what,
        );
    }
}

#[test]
fn missing_checkpoint_missing_tensor_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::NoCheckpoint { .. }),
        "empty dir",
    );
    write_safetensors(&dir.path().join("model.safetensors"), &sample()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    match ck.tensor("lm_head.weight") {
        Err(Error::MissingTensor { name, .. }) => assert_eq!(name, "lm_head.weight"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    fs::write(dir.path().join("config.json"), "{\"hidden_size\": ").unwrap();
    assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::BadConfig { .. }),
        "truncated config.json",
    );
}

#[test]
fn write_rejects_bad_input_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let mut bad = t("w", DType::BF16, &[3, 2], 1);
    bad.3.pop();
    match write_safetensors(&path, &[bad]) {
        Err(Error::LengthMismatch {
            tensor,
            expected: 12,
            actual: 11,
            ..
        }) => {
            assert_eq!(tensor, "w")
        }
        other => panic!("expected LengthMismatch, got {other:?}"),
    }
    let dup = vec![t("w", DType::U8, &[1], 1), t("w", DType::U8, &[1], 2)];
    match write_safetensors(&path, &dup) {
        Err(Error::DuplicateTensor { tensor, .. }) => assert_eq!(tensor, "w"),
        other => panic!("expected DuplicateTensor, got {other:?}"),
    }
    assert!(!path.exists());
}

fn repo_model(name: &str) -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../.mx/models")
        .join(name);
    if dir.join("model.safetensors").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "skipping: {} not found (run scripts/setup-models.sh to fetch it)",
            dir.join("model.safetensors").display()
        );
        None
    }
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn real_minilm_l6_bert_checkpoint() {
    let Some(dir) = repo_model("minilm-l6") else {
        return;
    };
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.len(), 104);
    let specs = ck.specs();
    // Every weight is F32; the one I64 tensor is BERT's position_ids buffer.
    let non_f32: Vec<&TensorSpec> = specs.iter().filter(|s| s.dtype != DType::F32).collect();
    assert_eq!(non_f32.len(), 1);
    assert_eq!(non_f32[0].name, "embeddings.position_ids");
    assert_eq!(
        (non_f32[0].dtype, &non_f32[0].shape[..]),
        (DType::I64, &[1u64, 512][..])
    );
    let pos = ck.tensor("embeddings.position_ids").unwrap();
    let ids: Vec<i64> = pos
        .data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(ids, (0..512).collect::<Vec<i64>>());

    let emb = ck.tensor("embeddings.word_embeddings.weight").unwrap();
    assert_eq!(
        (emb.dtype, &emb.shape[..]),
        (DType::F32, &[30522u64, 384][..])
    );
    assert_eq!(emb.data.len(), 30522 * 384 * 4);
    assert_eq!(emb.file_offset, 808_088);
    // Values read independently with numpy from the same file.
    let v = f32s(emb.data);
    // -0.019989014, -0.00340271, -0.014678955, 0.011703491 as f32 bit patterns.
    let bits: Vec<u32> = v[..4].iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits, [0xbca3_c000, 0xbb5f_0000, 0xbc70_8000, 0x3c3f_c000]);
    let sum: f64 = v.iter().map(|&x| f64::from(x)).sum();
    assert!((sum - 138.050_722_149_236).abs() < 1e-6, "sum {sum}");
    assert_eq!(ck.total_bytes(), 90_856_960);
    let cfg = ck.config().unwrap();
    assert_eq!(cfg["model_type"], "bert");
    assert_eq!(cfg["hidden_size"], 384);
}

#[test]
fn real_smollm2_135m_converted_checkpoint() {
    let Some(dir) = repo_model("smollm2-135m") else {
        return;
    };
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.len(), 272);
    assert!(ck.specs().iter().all(|s| s.dtype == DType::BF16));
    let shape = |n: &str| ck.tensor(n).unwrap().shape;
    assert_eq!(shape("model.embed_tokens.weight"), vec![49152, 576]);
    assert_eq!(
        shape("model.layers.0.self_attn.q_proj.weight"),
        vec![576, 576]
    );
    assert_eq!(
        shape("model.layers.29.self_attn.k_proj.weight"),
        vec![192, 576]
    );
    assert_eq!(
        shape("model.layers.29.mlp.down_proj.weight"),
        vec![576, 1536]
    );
    assert!(
        ck.tensor("lm_head.weight").is_err(),
        "tied embeddings: no lm_head"
    );
    assert_eq!(ck.total_bytes(), 269_030_016);
    let norm = ck.tensor("model.norm.weight").unwrap();
    assert_eq!(
        &norm.data[..8],
        &[0xe1, 0x3f, 0xe9, 0x3f, 0xe4, 0x3f, 0xcd, 0x3f]
    );
    let cfg = ck.config().unwrap();
    assert_eq!(cfg["num_key_value_heads"], 3);
    assert_eq!(cfg["tie_word_embeddings"], true);
}

#[test]
fn checkpoint_is_shareable_across_threads() {
    fn assert_send_sync<X: Send + Sync>() {}
    assert_send_sync::<Checkpoint>();
    assert_send_sync::<mx_checkpoint::TensorView<'static>>();
    assert_send_sync::<Error>();
}

// Strict parsing (issue 17): repeated keys, metadata values, tied embeddings, no config.json.

#[test]
fn header_with_a_repeated_key_is_refused_naming_it() {
    let entry = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    // Spelled the same, and spelled differently but the same after unescaping.
    for header in [
        format!(r#"{{"w":{entry},"w":{entry}}}"#),
        format!(r#"{{"w":{entry},"\u0077":{entry}}}"#),
    ] {
        let (_d, r) = open_raw(&raw_file(&header, &[0; 4]));
        let err = assert_err(
            r,
            |e| matches!(e, Error::DuplicateKey { key, .. } if key == "w"),
            "a repeated tensor key",
        );
        assert!(err.to_string().contains("\"w\""), "{err}");
    }
    // Inside a tensor entry and inside __metadata__.
    let header = r#"{"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let (_d, r) = open_raw(&raw_file(header, &[0; 4]));
    assert_err(
        r,
        |e| matches!(e, Error::DuplicateKey { key, path, .. } if key == "dtype" && path == "$.w"),
        "a repeated dtype",
    );
    let header = format!(r#"{{"__metadata__":{{"format":"pt","form\u0061t":"pt"}},"w":{entry}}}"#);
    let (_d, r) = open_raw(&raw_file(&header, &[0; 4]));
    assert_err(
        r,
        |e| matches!(e, Error::DuplicateKey { key, path, .. } if key == "format" && path == "$.__metadata__"),
        "a repeated metadata key",
    );
}

#[test]
fn non_string_metadata_value_is_refused_naming_its_key() {
    let entry = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    for (meta, key) in [
        (r#"{"format":"pt","step":7}"#, "step"),
        (r#"{"nested":{"a":"b"}}"#, "nested"),
        (r#"{"n":null}"#, "n"),
        (r#"["pt"]"#, ""),
    ] {
        let header = format!(r#"{{"__metadata__":{meta},"w":{entry}}}"#);
        let (_d, r) = open_raw(&raw_file(&header, &[0; 4]));
        let err = assert_err(
            r,
            |e| matches!(e, Error::BadMetadata { key: k, .. } if k == key),
            "a non-string metadata value",
        );
        assert!(err.to_string().contains(&format!("{key:?}")), "{err}");
    }
    // Strings only: accepted, and read back from the header.
    let header = format!(r#"{{"__metadata__":{{"format":"pt"}},"w":{entry}}}"#);
    let h = mx_checkpoint::Header::parse(Path::new("f"), &raw_file(&header, &[0; 4])).unwrap();
    assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
    assert_eq!(h.tensors.len(), 1);
}

#[test]
fn index_and_config_with_a_repeated_key_are_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let shard = vec![t("a", DType::F32, &[2], 1), t("b", DType::F32, &[2], 2)];
    write_safetensors(&dir.path().join("s1.safetensors"), &shard).unwrap();
    fs::write(
        dir.path().join(mx_checkpoint::INDEX_FILE),
        r#"{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","\u0061":"s1.safetensors"}}"#,
    )
    .unwrap();
    let err = assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::DuplicateKey { key, path, .. } if key == "a" && path == "$.weight_map"),
        "a repeated weight_map key",
    );
    assert!(err.to_string().contains(mx_checkpoint::INDEX_FILE), "{err}");

    let (dir, _) = write_dir(&shard);
    fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","vocab_size":3,"vocab_size":4}"#,
    )
    .unwrap();
    let err = assert_err(
        Checkpoint::open(dir.path()),
        |e| matches!(e, Error::DuplicateKey { key, .. } if key == "vocab_size"),
        "a repeated config key",
    );
    assert!(err.to_string().contains("config.json"), "{err}");
}

fn tied_dir(lm_head: Option<T>) -> tempfile::TempDir {
    let mut tensors = vec![
        t("model.embed_tokens.weight", DType::BF16, &[4, 2], 1),
        t("model.norm.weight", DType::BF16, &[2], 2),
    ];
    tensors.extend(lm_head);
    let (dir, _) = write_dir(&tensors);
    fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","tie_word_embeddings":true}"#,
    )
    .unwrap();
    dir
}

#[test]
fn tied_lm_head_that_differs_from_the_embedding_is_refused_naming_both() {
    for head in [
        t("lm_head.weight", DType::BF16, &[4, 2], 9),
        t("lm_head.weight", DType::BF16, &[2, 4], 1),
        t("lm_head.weight", DType::F16, &[4, 2], 1),
    ] {
        let dir = tied_dir(Some(head));
        let err = assert_err(
            Checkpoint::open(dir.path()),
            |e| {
                matches!(e, Error::TiedEmbeddingMismatch { embedding, lm_head, .. }
                    if embedding == "model.embed_tokens.weight" && lm_head == "lm_head.weight")
            },
            "a tied lm_head that differs",
        );
        let msg = err.to_string();
        assert!(msg.contains("lm_head.weight") && msg.contains("model.embed_tokens.weight"));
    }
}

#[test]
fn tied_lm_head_identical_to_the_embedding_is_accepted_and_not_pulled_twice() {
    let dir = tied_dir(Some(t("lm_head.weight", DType::BF16, &[4, 2], 1)));
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.tensor_names(),
        vec!["model.embed_tokens.weight", "model.norm.weight"]
    );
    assert!(ck.specs().iter().all(|s| s.name != "lm_head.weight"));
    assert_eq!(ck.total_bytes(), 4 * 2 * 2 + 2 * 2);
    // The same checkpoint without the redundant tensor opens to the same tensors.
    let plain = tied_dir(None);
    assert_eq!(Checkpoint::open(plain.path()).unwrap().specs(), ck.specs());
}

#[test]
fn no_config_is_accepted_for_replicated_and_fsdp_layouts_only() {
    use mx_layout::{rank_layouts, LayoutSpec};
    let (dir, _) = write_dir(&sample());
    assert!(!dir.path().join("config.json").exists());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let fsdp: LayoutSpec = "fsdp:2".parse().unwrap();
    let repl: LayoutSpec = "replicated:1".parse().unwrap();
    let model = ck.model_info(&[fsdp, repl]).unwrap();
    assert_eq!(model.family, mx_layout::model::Family::Generic);
    assert_eq!(model.tensors, ck.specs());
    let total: u64 = rank_layouts(&model, fsdp)
        .unwrap()
        .iter()
        .map(|r| r.total_bytes)
        .sum();
    assert_eq!(total, ck.total_bytes());
    assert_eq!(
        rank_layouts(&model, repl).unwrap()[0].total_bytes,
        ck.total_bytes()
    );

    let tp: LayoutSpec = "tp:2".parse().unwrap();
    let err = ck.model_info(&[fsdp, tp]).unwrap_err();
    match &err {
        Error::NoConfig { file, layout } => {
            assert_eq!(file, &dir.path().join("config.json"));
            assert_eq!(layout, "tp:2");
        }
        other => panic!("expected NoConfig, got {other:?}"),
    }
    assert!(err.to_string().contains("config.json"), "{err}");
    // The layout crate refuses the generic model for tensor parallelism too.
    let err = rank_layouts(&model, tp).unwrap_err();
    assert!(
        matches!(&err, mx_layout::Error::NoModelConfig { layout } if layout == "tp:2"),
        "{err:?}"
    );
    assert!(err.to_string().contains("config.json"), "{err}");
}

#[test]
fn regression_index_file_name_with_a_trailing_slash_is_not_plain() {
    // Found by the safetensors_index fuzz target: Path::components drops a trailing "/" (and
    // "/."), so "shard.safetensors/" passed as a plain file name.
    for name in [
        "s1.safetensors/",
        "s1.safetensors/.",
        "./s1.safetensors",
        "a/b",
        "..",
        "",
    ] {
        let text = serde_json::json!({ "weight_map": { "a": name } }).to_string();
        let err = mx_checkpoint::parse_index(Path::new("i.json"), text.as_bytes()).unwrap_err();
        assert!(matches!(&err, Error::BadIndex { .. }), "{name:?}: {err:?}");
    }
    let text = r#"{"weight_map":{"a":"s1.safetensors"}}"#;
    let map = mx_checkpoint::parse_index(Path::new("i.json"), text.as_bytes()).unwrap();
    assert_eq!(map["a"], "s1.safetensors");
}
