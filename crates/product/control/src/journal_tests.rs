//! Tests of the journal file: checksums, torn tails, strict parsing, replay.
use super::*;
use mx_layout::{LayoutSpec, ResidentVersion, Scheme, SourceManifest, TensorSpec};

#[test]
fn batches_are_cut_into_whole_lines() {
    let lines = b"aaaa\nbb\ncccccccc\nd\n";
    let cut = whole_lines(lines, 8);
    assert_eq!(cut, vec![&b"aaaa\nbb\n"[..], b"cccccccc\n", b"d\n"]);
    assert_eq!(cut.concat(), lines);
    assert_eq!(whole_lines(lines, 100), vec![&lines[..]]);
    assert!(whole_lines(b"", 8).is_empty());
}

#[test]
fn a_second_control_plane_cannot_open_a_journal_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (first, _) = Journal::open(&path).unwrap();
    let err = Journal::open(&path).map(|_| ()).unwrap_err();
    assert!(
        matches!(err, Error::JournalIo { what, .. } if what.starts_with("lock")),
        "{err}"
    );
    drop(first);
    assert!(
        Journal::open(&path).is_ok(),
        "the lock is released with the journal"
    );
}

fn reg(id: &str) -> Record {
    Record::Register {
        worker_id: id.into(),
        instance: "i".into(),
        ranks: vec![0],
        layout: LayoutSpec {
            scheme: Scheme::VllmTp,
            world_size: 1,
        },
        engine: None,
        resident_version: None,
        addresses: vec![],
    }
}

#[test]
fn torn_tail_is_cut_and_corrupt_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (mut j, e) = Journal::open(&path).unwrap();
    assert!(e.is_empty());
    j.append(&reg("a")).unwrap();
    j.append(&reg("b")).unwrap();
    drop(j);
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"{\"seq\":3,\"unix_ms\":1,\"rec").unwrap();
    drop(f);
    assert_eq!(read_records(&path).unwrap().len(), 2);
    let (mut j, e) = Journal::open(&path).unwrap();
    assert_eq!(e.len(), 2);
    assert_eq!(e[1].record, reg("b"));
    j.append(&reg("c")).unwrap();
    drop(j);
    let all = read_records(&path).unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[2].seq, 3);
    assert_eq!(all[2].record, reg("c"));

    // A garbled line in the middle is an error naming line 2.
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[1] = "{not json";
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let err = read_records(&path).unwrap_err();
    assert!(
        matches!(err, Error::JournalCorrupt { line: 2, .. }),
        "{err}"
    );
    assert!(Journal::open(&path).is_err());
}

#[test]
fn records_of_the_retired_commit_path_are_refused_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (mut j, _) = Journal::open(&path).unwrap();
    j.append(&reg("a")).unwrap();
    drop(j);
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(
        b"{\"seq\":2,\"unix_ms\":1,\"record\":{\"op\":\"commit\",\"label\":\"v\",\"worker_ids\":[\"a\"]}}\n",
    )
    .unwrap();
    drop(f);
    let err = read_records(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::JournalCorrupt { line: 2, .. })
            && msg.contains("`commit`")
            && msg.contains("retired Commit RPC")
            && msg.contains("new journal"),
        "{msg}"
    );
    assert!(Journal::open(&path).is_err());
}

fn corrupt_line(err: &Error) -> (usize, &str) {
    match err {
        Error::JournalCorrupt { line, reason, .. } => (*line, reason.as_str()),
        other => panic!("expected JournalCorrupt, got {other}"),
    }
}

/// A journal of 3 records: a declaration (shape [8, 4]), a publish (a shard digest) and a
/// registration (a resident version).
fn three_records(path: &Path) -> Vec<u8> {
    let (specs, mut m) = smollm2_manifest(4, 16);
    m.shards.truncate(1);
    m.pieces.clear();
    m.shards[0].digest = mx_layout::Digest([0x11; 32]);
    let (mut j, _) = Journal::open(path).unwrap();
    j.append(&Record::Declare {
        label: "v".into(),
        trainer_layout: m.layout,
        tensors: vec![TensorSpec {
            shape: vec![8, 4],
            ..specs[1].clone()
        }],
    })
    .unwrap();
    j.append(&Record::Publish {
        label: "v".into(),
        manifest: m,
    })
    .unwrap();
    let Record::Register {
        worker_id,
        instance,
        ranks,
        layout,
        engine,
        ..
    } = reg("w")
    else {
        unreachable!()
    };
    j.append(&Record::Register {
        worker_id,
        instance,
        ranks,
        layout,
        engine,
        resident_version: Some(ResidentVersion::parse(&format!("mx:{}", "7".repeat(64)))),
        addresses: vec![],
    })
    .unwrap();
    drop(j);
    std::fs::read(path).unwrap()
}

/// `bytes` with the first `from` after `at` replaced by `to` (same length).
fn flipped(bytes: &[u8], at: &str, from: u8, to: u8) -> Vec<u8> {
    let start = bytes
        .windows(at.len())
        .position(|w| w == at.as_bytes())
        .unwrap_or_else(|| panic!("{at} not in the journal"));
    let i = start + bytes[start..].iter().position(|&b| b == from).unwrap();
    let mut out = bytes.to_vec();
    out[i] = to;
    out
}

#[test]
fn a_flipped_byte_inside_a_value_is_refused_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let good = three_records(&path);
    assert_eq!(read_records(&path).unwrap().len(), 3);
    // Each flip keeps the line valid JSON of a valid record: only the checksum sees it.
    for (at, from, to, line) in [
        ("\"shape\":[", b'8', b'9', 1),
        ("\"digest\":\"", b'1', b'3', 2),
        ("\"resident_version\":\"mx:", b'7', b'6', 3),
        ("\"seq\":2,", b'2', b'4', 2),
    ] {
        let bad = flipped(&good, at, from, to);
        std::fs::write(&path, &bad).unwrap();
        let err = read_records(&path).unwrap_err();
        let (l, reason) = corrupt_line(&err);
        assert_eq!(l, line, "{err}");
        assert!(
            reason.starts_with(&format!("checksum mismatch in record seq {line}: ")),
            "{reason}"
        );
        let err = Journal::open(&path).map(|_| ()).unwrap_err();
        assert_eq!(corrupt_line(&err).0, line);
        // Refused, not repaired: the file is as it was.
        assert_eq!(std::fs::read(&path).unwrap(), bad);
    }
    // A flip inside the checksum itself, and one that renames its key.
    let bad = flipped(&good, "\"crc32\":\"", b'"', b'\'');
    std::fs::write(&path, &bad).unwrap();
    let err = read_records(&path).unwrap_err();
    assert_eq!(corrupt_line(&err).0, 1, "{err}");
    let bad = flipped(&good, "\"crc32\":\"", b'3', b'4');
    std::fs::write(&path, &bad).unwrap();
    let err = read_records(&path).unwrap_err();
    assert_eq!(corrupt_line(&err).0, 1, "{err}");
}

#[test]
fn a_torn_last_record_is_cut_and_kept_beside_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let good = three_records(&path);
    let lines: Vec<usize> = good
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i + 1)
        .collect();
    // The crash cut the last record (seq 3) 40 bytes in.
    let cut = lines[1] + 40;
    std::fs::write(&path, &good[..cut]).unwrap();
    assert_eq!(read_records(&path).unwrap().len(), 2);
    assert_eq!(std::fs::read(&path).unwrap().len(), cut, "read-only");
    let (mut j, entries) = Journal::open(&path).unwrap();
    assert_eq!(entries.len(), 2);
    let torn = j.torn().unwrap().clone();
    assert_eq!((torn.seq, torn.bytes), (3, 40));
    let name = torn.saved_to.file_name().unwrap().to_string_lossy();
    assert!(name.starts_with("j.jsonl.torn-"), "{name}");
    assert_eq!(std::fs::read(&torn.saved_to).unwrap(), &good[lines[1]..cut]);
    assert_eq!(j.size_bytes(), lines[1] as u64);
    assert_eq!(std::fs::read(&path).unwrap(), &good[..lines[1]]);
    // The next record takes seq 3 on a fresh line.
    assert_eq!(j.append(&reg("x")).unwrap(), 3);
    drop(j);
    assert_eq!(read_records(&path).unwrap()[2].record, reg("x"));

    // A torn write whose end the file system filled with NULs is a torn write too.
    let mut tail = good[..lines[1] + 5].to_vec();
    tail.extend([0u8; 300]);
    std::fs::write(&path, &tail).unwrap();
    let (j, entries) = Journal::open(&path).unwrap();
    assert_eq!((entries.len(), j.torn().unwrap().bytes), (2, 305));
}

#[test]
fn an_incomplete_line_that_is_not_a_torn_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let good = three_records(&path);
    let nl: Vec<usize> = good
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i)
        .collect();
    let refused = |bytes: &[u8], line: usize, says: &str| {
        std::fs::write(&path, bytes).unwrap();
        let err = Journal::open(&path).map(|_| ()).unwrap_err();
        let (l, reason) = corrupt_line(&err);
        assert_eq!(l, line, "{err}");
        assert!(reason.contains(says), "{reason}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing is cut");
    };
    // A last line without its newline that is not record 3.
    let mut b = good[..nl[2]].to_vec();
    b[nl[1] + 8] = b'4';
    refused(&b, 3, "does not start record seq 3");
    // A line in the middle lost its newline: two lines run together, the checksum of the
    // second covers both.
    let mut b = good.clone();
    b[nl[0]] = b' ';
    refused(&b, 1, "checksum mismatch in record seq 1");
    // A line in the middle garbled.
    let mut b = good.clone();
    b[nl[0] + 1..nl[0] + 8].copy_from_slice(b"garbage");
    refused(&b, 2, "checksum mismatch in record seq 2");
    // A line in the middle cut short (its checksum gone).
    let mut b = good[..nl[0] + 30].to_vec();
    b.push(b'\n');
    b.extend_from_slice(&good[nl[1] + 1..]);
    refused(&b, 2, "no checksum, but line 1 had one");
    // Junk after the last good line.
    let mut b = good.clone();
    b.extend_from_slice(b"\x7fELF\x02\x01");
    refused(&b, 4, "does not start record seq 4");
}

#[test]
fn a_journal_from_before_checksums_replays_only_when_asked_and_what_follows_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let old = concat!(
        r#"{"seq":1,"unix_ms":5,"record":{"op":"register","worker_id":"a","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#,
        "\n",
        r#"{"seq":2,"unix_ms":6,"record":{"op":"register","worker_id":"b","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#,
        "\n"
    );
    std::fs::write(&path, old).unwrap();
    // A control plane refuses it unless told the journal predates checksums (issue 29: a
    // stripped checksum reads the same), naming the line and the flag; nothing is changed.
    let err = Journal::open(&path).map(|_| ()).unwrap_err();
    let (line, reason) = corrupt_line(&err);
    assert_eq!(line, 1);
    assert!(
        reason.starts_with("record seq 1 has no checksum")
            && reason.contains("--accept-unchecked-journal-lines"),
        "{reason}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), old);
    let (mut j, loaded) = Journal::recover_with(&path, Unchecked::Accept).unwrap();
    assert_eq!(loaded.entries.len(), 2);
    assert_eq!(j.unverified_lines(), 2);
    j.append(&reg("c")).unwrap();
    drop(j);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.lines().nth(2).unwrap().contains(",\"crc32\":\""));
    let (j, loaded) = Journal::recover_with(&path, Unchecked::Accept).unwrap();
    assert_eq!((loaded.entries.len(), j.unverified_lines()), (3, 2));
    drop(j);
    // Read-only readers replay it (with a warning): they act on nothing.
    assert_eq!(read_records(&path).unwrap().len(), 3);
    // An unchecked line after a checked one is a damaged line.
    let mut text = text;
    text.push_str(
        &old.lines()
            .next()
            .unwrap()
            .replace("\"seq\":1", "\"seq\":4"),
    );
    text.push('\n');
    std::fs::write(&path, &text).unwrap();
    let err = read_records(&path).unwrap_err();
    assert_eq!(
        corrupt_line(&err),
        (
            4,
            "record seq 4 has no checksum, but line 3 had one: its checksum field was damaged"
        )
    );
    // A legacy line with a field it never had (a checksum key mangled) is refused too.
    let mangled = old.replacen("\"unix_ms\":5,", "\"unix_ms\":5,\"crc33\":\"00000000\",", 1);
    std::fs::write(&path, mangled).unwrap();
    let err = read_records(&path).unwrap_err();
    let (line, reason) = corrupt_line(&err);
    assert_eq!(line, 1);
    assert!(reason.contains("unknown field `crc33`"), "{reason}");
}

/// Issue 29: lines of a checksummed journal with their checksums stripped, and a resident
/// version edited on one, were replayed as a legacy journal and the edit believed.
#[test]
fn stripped_checksums_and_an_edit_under_them_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (mut j, _) = Journal::open(&path).unwrap();
    for w in ["a", "b", "c"] {
        j.append(&reg(w)).unwrap();
    }
    drop(j);
    let good = std::fs::read_to_string(&path).unwrap();
    let stripped: String = good
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let l = if i < 2 {
                let cut = l.find(",\"crc32\":\"").unwrap();
                format!("{}}}", &l[..cut])
            } else {
                l.to_string()
            };
            format!("{l}\n")
        })
        .collect();
    let edited = stripped.replacen("\"worker_id\":\"a\"", "\"worker_id\":\"z\"", 1);
    assert_ne!(edited, stripped);
    for text in [&stripped, &edited] {
        std::fs::write(&path, text).unwrap();
        let err = Journal::open(&path).map(|_| ()).unwrap_err();
        let (line, reason) = corrupt_line(&err);
        assert_eq!(line, 1, "{reason}");
        assert!(reason.contains("stripped"), "{reason}");
        assert_eq!(
            &std::fs::read_to_string(&path).unwrap(),
            text,
            "nothing cut"
        );
    }
}

#[test]
fn a_repeated_key_in_a_record_is_refused_naming_it() {
    let p = Path::new("j.jsonl");
    let good = r#"{"seq":1,"unix_ms":5,"record":{"op":"register","worker_id":"a","instance":"i","ranks":[0],"layout":{"scheme":"VllmTp","world_size":1}}}"#;
    assert_eq!(
        parse_records(p, format!("{good}\n").as_bytes())
            .unwrap()
            .len(),
        1
    );
    // Repeated as spelled, and repeated after unescaping (serde would keep one silently).
    for (from, to, key, at) in [
        (
            "\"instance\":\"i\",",
            "\"instance\":\"i\",\"instance\":\"j\",",
            "instance",
            "$.record",
        ),
        (
            "\"world_size\":1",
            "\"world_size\":1,\"world_siz\\u0065\":2",
            "world_size",
            "$.record.layout",
        ),
        (
            "\"unix_ms\":5,",
            "\"unix_ms\":5,\"unix_ms\":6,",
            "unix_ms",
            "$",
        ),
    ] {
        let line = good.replacen(from, to, 1);
        assert_ne!(line, good);
        let err = parse_records(p, format!("{line}\n").as_bytes()).unwrap_err();
        let (n, reason) = corrupt_line(&err);
        assert_eq!(n, 1);
        assert_eq!(
            reason,
            format!("duplicate key {key:?} in the JSON object at {at}")
        );
    }
    // With a valid checksum too.
    let mut buf = Vec::new();
    let body =
        good.strip_suffix('}')
            .unwrap()
            .replacen("\"ranks\":[0]", "\"ranks\":[0],\"ranks\":[1]", 1);
    buf.extend_from_slice(body.as_bytes());
    let crc = crc32fast::hash(&buf);
    buf.extend_from_slice(format!(",\"crc32\":\"{crc:08x}\"}}\n").as_bytes());
    let err = parse_records(p, &buf).unwrap_err();
    assert_eq!(
        corrupt_line(&err).1,
        "duplicate key \"ranks\" in the JSON object at $.record"
    );
}

#[test]
fn replay_names_the_refused_line() {
    let p = Path::new("j.jsonl");
    let text = concat!(
        r#"{"seq":1,"unix_ms":1,"record":{"op":"stage","label":"nope","worker_ids":["w"]}}"#,
        "\n"
    );
    let entries = parse_records(p, text.as_bytes()).unwrap();
    match replay(p, entries) {
        Err(Error::Replay { line, .. }) => assert_eq!(line, 1),
        other => panic!("expected a replay error, got {:?}", other.map(|_| ())),
    }
}

/// A SmolLM2-135M-shaped FSDP slot-0 manifest of `fsdp` slots: 272 BF16 tensors (dim-0
/// chunks), two TP pieces per shard, and `md` bytes of agent metadata.
pub(crate) fn smollm2_manifest(fsdp: u32, md: usize) -> (Vec<TensorSpec>, SourceManifest) {
    use mx_layout::{DType, DestPiece, Digest, MemDevice, ShardEntry, TensorBox};
    let mut specs = vec![TensorSpec {
        name: "model.embed_tokens.weight".into(),
        dtype: DType::BF16,
        shape: vec![49152, 576],
    }];
    for l in 0..30 {
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![576, 576]),
            ("self_attn.k_proj.weight", vec![192, 576]),
            ("self_attn.v_proj.weight", vec![192, 576]),
            ("self_attn.o_proj.weight", vec![576, 576]),
            ("mlp.gate_proj.weight", vec![1536, 576]),
            ("mlp.up_proj.weight", vec![1536, 576]),
            ("mlp.down_proj.weight", vec![576, 1536]),
            ("input_layernorm.weight", vec![576]),
            ("post_attention_layernorm.weight", vec![576]),
        ] {
            specs.push(TensorSpec {
                name: format!("model.layers.{l}.{n}"),
                dtype: DType::BF16,
                shape: s,
            });
        }
    }
    specs.push(TensorSpec {
        name: "model.norm.weight".into(),
        dtype: DType::BF16,
        shape: vec![576],
    });
    let layout = LayoutSpec {
        scheme: mx_layout::Scheme::Fsdp,
        world_size: fsdp,
    };
    let tp2 = LayoutSpec {
        scheme: mx_layout::Scheme::VllmTp,
        world_size: 2,
    };
    let mut addr = 0x7f00_0000_0000u64;
    let mut shards = Vec::new();
    let mut pieces = Vec::new();
    for t in &specs {
        let rows = t.shape[0].div_ceil(u64::from(fsdp));
        let mut local = t.shape.clone();
        local[0] = rows;
        let mut off = vec![0; t.shape.len()];
        let b = TensorBox {
            global_offset: off.clone(),
            local_shape: local.clone(),
        };
        let len = b.numel().unwrap() * 2;
        shards.push(ShardEntry {
            tensor: t.name.clone(),
            dtype: t.dtype,
            global_shape: t.shape.clone(),
            shard: b,
            addr,
            len,
            device: MemDevice::Vram(0),
            digest: Digest::of(&addr.to_le_bytes()),
        });
        for r in 0..2u64 {
            let half = local[0] / 2;
            off[0] = r * half;
            let mut shape = local.clone();
            shape[0] = half;
            pieces.push(DestPiece {
                layout: tp2,
                dest_rank: r as u32,
                tensor: t.name.clone(),
                region: TensorBox {
                    global_offset: off.clone(),
                    local_shape: shape,
                },
                digest: Digest::of(&(addr + r).to_le_bytes()),
                packed_addr: Some(addr + (1 << 36) + r * half),
            });
        }
        addr += len;
    }
    let m = SourceManifest {
        slot: 0,
        layout,
        agent_name: "mx-publisher-host-0-1234-slot0".into(),
        agent_metadata: (0..md)
            .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
            .collect(),
        shards,
        pieces,
        pack_seconds: 0.0123,
    };
    (specs, m)
}

#[test]
fn journal_bytes_per_publish_of_a_smollm2_manifest() {
    use prost::Message;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (specs, m) = smollm2_manifest(4, 8 << 10);
    let proto = crate::convert::manifest_pb(&m).encoded_len();
    let (mut j, _) = Journal::open(&path).unwrap();
    j.append(&Record::Declare {
        label: "v".into(),
        trainer_layout: m.layout,
        tensors: specs,
    })
    .unwrap();
    let before = j.size_bytes();
    j.append(&Record::Publish {
        label: "v".into(),
        manifest: m.clone(),
    })
    .unwrap();
    let line = j.size_bytes() - before;
    eprintln!(
        "MEASURE shards {} pieces {} agent_metadata {} B: proto {proto} B, journal line {line} B ({:.2}x)",
        m.shards.len(),
        m.pieces.len(),
        m.agent_metadata.len(),
        line as f64 / proto as f64
    );
    // The agent metadata is base64: 4 bytes per 3, not an array of numbers (3.6 per byte).
    let (_, big) = smollm2_manifest(4, 128 << 10);
    let before = j.size_bytes();
    j.append(&Record::Publish {
        label: "v".into(),
        manifest: big,
    })
    .unwrap();
    let grew = j.size_bytes() - before - line;
    assert_eq!(
        grew,
        (128u64 << 10).div_ceil(3) * 4 - (8u64 << 10).div_ceil(3) * 4
    );
}
