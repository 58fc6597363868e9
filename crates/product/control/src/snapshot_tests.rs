//! Tests of snapshots and compaction, on real files: replay from snapshot + tail equals the full
//! replay, sequence numbers go on across a snapshot, and a crash at each point of a compaction
//! loses nothing.
use super::*;
use crate::journal::{CompactFailure, Journal};
use crate::refit::{
    Action, CallResult, EngineApi, EngineEndpoint, Outcome, PauseMode, Phase, Refit, RefitSpec,
    RefitWorker,
};
use crate::state::Record;
use mx_layout::{
    DType, Digest, LayoutSpec, MemDevice, ResidentVersion, Scheme, ShardEntry, SourceManifest,
    TensorBox, TensorSpec, VersionId,
};

const LAYOUT: LayoutSpec = LayoutSpec {
    scheme: Scheme::Fsdp,
    world_size: 2,
};

/// Applies `rec` to `st` and keeps it, as the control plane journals then applies.
fn push(recs: &mut Vec<Record>, st: &mut State, rec: Record) {
    st.apply(rec.clone()).unwrap();
    recs.push(rec);
}

/// Declares and publishes `label` (one tensor, two FSDP slots); returns its digest.
fn publish(recs: &mut Vec<Record>, st: &mut State, label: &str) -> Digest {
    let shape = vec![4u64, 2];
    push(
        recs,
        st,
        Record::Declare {
            label: label.into(),
            trainer_layout: LAYOUT,
            tensors: vec![TensorSpec {
                name: "w".into(),
                dtype: DType::BF16,
                shape: shape.clone(),
            }],
        },
    );
    for slot in 0..2u32 {
        let b = TensorBox {
            global_offset: vec![u64::from(slot) * 2, 0],
            local_shape: vec![2, 2],
        };
        let manifest = SourceManifest {
            slot,
            layout: LAYOUT,
            agent_name: format!("src{slot}"),
            agent_metadata: vec![1, 2, 3, 250],
            shards: vec![ShardEntry {
                tensor: "w".into(),
                dtype: DType::BF16,
                global_shape: shape.clone(),
                len: 8,
                shard: b,
                addr: 4096 + (u64::from(slot) << 20),
                device: MemDevice::Dram,
                digest: Digest::of(format!("{label}{slot}").as_bytes()),
            }],
            pieces: vec![],
            pack_seconds: 0.25,
        };
        push(
            recs,
            st,
            Record::Publish {
                label: label.into(),
                manifest,
            },
        );
    }
    st.version_info(label).unwrap().version_digest.unwrap()
}

/// One committed refit of every worker in `ids` to `label` (digest `d`), with its calls
/// journaled per worker or in batches.
fn refit_with(
    recs: &mut Vec<Record>,
    st: &mut State,
    (label, d): (&str, Digest),
    ids: &[String],
    batched: bool,
) {
    let id = st.next_refit_id();
    let target = VersionId(d);
    let workers = ids
        .iter()
        .map(|w| {
            let prev = st.fleet_version().map(|f| ResidentVersion::from(f.1));
            let rw = RefitWorker {
                previous: prev.clone(),
                resident: prev,
                stage_seconds: 0.5,
                stage_bytes: 16,
                calls: vec![],
                reregistered: None,
            };
            (w.clone(), rw)
        })
        .collect();
    let spec = RefitSpec {
        no_check: false,
        label: label.into(),
        worker_ids: ids.to_vec(),
        pause_mode: PauseMode::Wait,
        allow_partial: false,
        check: None,
        framework_step: id,
        stage_timeout_ms: 1000,
        call_timeout_ms: 1000,
        apply_parallelism: 0,
        orchestrator_gated: true,
        verify_from_apply_answer: true,
    };
    let refit = Refit {
        id,
        spec,
        digest: d,
        target,
        dropped: vec![],
        phase: Phase::Stage,
        phases: vec![(Phase::Stage, 10 * id)],
        workers,
        outcome: None,
        reason: String::new(),
        started_ms: 10 * id,
        ended_ms: None,
        recovered: false,
        trimmed: None,
        request_id: 0,
    };
    let phase = |phase, at_ms| Record::RefitPhase {
        id,
        phase,
        at_ms,
        reason: String::new(),
        recovered: false,
    };
    push(
        recs,
        st,
        Record::RefitBegin {
            refit: Box::new(refit),
        },
    );
    push(recs, st, phase(Phase::Prepare, 10 * id + 1));
    push(recs, st, phase(Phase::Apply, 10 * id + 2));
    let result = CallResult {
        ok: true,
        seconds: 0.125,
        version: Some(target.into()),
        cache_tiers_cleared: vec!["prefix".into()],
        message: "ok".into(),
        ..CallResult::default()
    };
    if batched {
        let action = Action::Apply {
            version: target.into(),
        };
        let worker_ids = ids.to_vec();
        push(
            recs,
            st,
            Record::WorkerCalls {
                id,
                action,
                worker_ids,
            },
        );
        let results = ids
            .iter()
            .map(|w| crate::record::WorkerResult {
                worker_id: w.clone(),
                result: result.clone(),
            })
            .collect();
        push(recs, st, Record::WorkerResults { id, results });
    }
    for w in ids.iter().filter(|_| !batched) {
        let call = Record::WorkerCall {
            id,
            worker_id: w.clone(),
            action: Action::Apply {
                version: target.into(),
            },
        };
        push(recs, st, call);
        let done = Record::WorkerDone {
            id,
            worker_id: w.clone(),
            result: result.clone(),
        };
        push(recs, st, done);
    }
    for (i, p) in [Phase::Verify, Phase::Resume, Phase::Commit]
        .into_iter()
        .enumerate()
    {
        push(recs, st, phase(p, 10 * id + 3 + i as u64));
    }
    let end = Record::RefitEnd {
        id,
        outcome: Outcome::Committed,
        reason: String::new(),
        at_ms: 10 * id + 9,
        recovered: false,
        fenced: vec![],
        departed: vec![],
    };
    push(recs, st, end);
}

/// A history of `rounds` versions, each published and committed on `workers` workers; returns
/// the records and the state they replay to.
fn history(rounds: usize, workers: usize) -> (Vec<Record>, State) {
    history_with(rounds, workers, false)
}

/// [`history`], with the refits' calls journaled per worker or in batches.
fn history_with(rounds: usize, workers: usize, batched: bool) -> (Vec<Record>, State) {
    let mut st = State::new();
    let mut recs = Vec::new();
    let ids: Vec<String> = (0..workers).map(|i| format!("w{i:03}")).collect();
    for (i, w) in ids.iter().enumerate() {
        let engine = EngineEndpoint {
            api: EngineApi::Dynamo,
            system_url: format!("http://127.0.0.1:{}", 9000 + i),
            no_model: false,
            frontend: None,
        };
        let reg = Record::Register {
            worker_id: w.clone(),
            instance: w.clone(),
            ranks: vec![0],
            layout: LAYOUT,
            engine: Some(engine),
            resident_version: None,
            addresses: vec![],
        };
        push(&mut recs, &mut st, reg);
    }
    for r in 0..rounds {
        let label = format!("step-{r}");
        let d = publish(&mut recs, &mut st, &label);
        refit_with(&mut recs, &mut st, (&label, d), &ids, batched);
    }
    (recs, st)
}

fn append_all(j: &mut Journal, recs: &[Record]) {
    for r in recs {
        j.append(r).unwrap();
    }
}

/// The state the journal at `path` (and its snapshot) replays to, opened as the server does.
fn recovered(path: &Path) -> (Journal, State) {
    let (j, loaded) = Journal::recover(path).unwrap();
    let st = loaded.replay(path).unwrap();
    (j, st)
}

fn first_seq(path: &Path) -> Option<u64> {
    crate::journal::read_records(path)
        .unwrap()
        .first()
        .map(|e| e.seq)
}

#[test]
fn a_state_round_trips_through_a_snapshot() {
    let (_, st) = history(3, 4);
    let p = Path::new("j.jsonl.snapshot");
    let bytes = encode(p, 77, 5, &st).unwrap();
    assert_eq!(bytes.iter().filter(|&&b| b == b'\n').count(), 1);
    let back = decode(p, &bytes).unwrap();
    assert_eq!(
        (back.seq, back.unix_ms, back.bytes),
        (77, 5, bytes.len() as u64)
    );
    assert_eq!(back.state, st);
    // The maps keyed by (label, slot) are lists, and read back.
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.contains("\"republishes\":[]"), "{}", &text[..200]);
}

#[test]
fn replay_from_snapshot_and_tail_equals_the_full_replay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, full) = history(4, 5);
    let half = recs.len() / 2;
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs[..half]);
    let before = j.size_bytes();
    assert_eq!(before, std::fs::metadata(&path).unwrap().len());
    let (_, at_half) = recovered_copy(&path, dir.path());
    let c = j.compact(&at_half).unwrap();
    assert_eq!(c.seq, half as u64);
    assert_eq!(c.journal_bytes, before);
    assert_eq!(
        c.snapshot_bytes,
        std::fs::metadata(snapshot_path(&path)).unwrap().len()
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    assert_eq!(
        (j.len(), j.snapshot_seq(), j.size_bytes()),
        (half as u64, half as u64, 0)
    );
    // Sequence numbers go on from the snapshot's.
    assert_eq!(j.append(&recs[half]).unwrap(), half as u64 + 1);
    append_all(&mut j, &recs[half + 1..]);
    assert_eq!(j.records_since_snapshot(), (recs.len() - half) as u64);
    drop(j);
    assert_eq!(first_seq(&path), Some(half as u64 + 1));
    let (j, st) = recovered(&path);
    assert_eq!(st, full);
    assert_eq!(j.len(), recs.len() as u64);
    assert_eq!(crate::journal::load_state(&path).unwrap(), full);
    // The snapshot's file holds exactly the state at the half.
    assert_eq!(read(&path).unwrap().unwrap().state, at_half);
}

/// Replays a copy of the journal at `path` (in `dir`), leaving the original alone.
fn recovered_copy(path: &Path, dir: &Path) -> (u64, State) {
    let copy = dir.join("copy.jsonl");
    std::fs::copy(path, &copy).unwrap();
    let (j, st) = recovered(&copy);
    let n = j.len();
    drop(j);
    std::fs::remove_file(&copy).unwrap();
    (n, st)
}

#[test]
fn a_crash_at_any_point_of_a_compaction_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, full) = history(3, 3);
    let (a, b) = (recs.len() / 3, 2 * recs.len() / 3);
    // A first compaction at `a`, then records up to `b`.
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs[..a]);
    let mut st = State::new();
    for r in &recs[..a] {
        st.apply(r.clone()).unwrap();
    }
    j.compact(&st).unwrap();
    append_all(&mut j, &recs[a..b]);
    for r in &recs[a..b] {
        st.apply(r.clone()).unwrap();
    }
    drop(j);
    let journal_at_b = std::fs::read(&path).unwrap();
    let snapshot_at_a = std::fs::read(snapshot_path(&path)).unwrap();
    let finish = |j: Journal| {
        let mut j = j;
        assert_eq!(j.len(), b as u64);
        append_all(&mut j, &recs[b..]);
        drop(j);
        let (_, st) = recovered(&path);
        assert_eq!(st, full);
    };
    let reset = || {
        std::fs::write(&path, &journal_at_b).unwrap();
        std::fs::write(snapshot_path(&path), &snapshot_at_a).unwrap();
    };

    // 1. Crash while writing the temporary snapshot (half of a new one): ignored and removed.
    reset();
    let new = encode(&path, b as u64, 9, &st).unwrap();
    std::fs::write(temp_path(&path), &new[..new.len() / 2]).unwrap();
    let (j, loaded) = Journal::recover(&path).unwrap();
    assert!(!temp_path(&path).exists());
    assert_eq!(loaded.snapshot.as_ref().unwrap().seq, a as u64);
    assert_eq!(loaded.entries.len(), b - a);
    assert_eq!(loaded.replay(&path).unwrap(), st);
    finish(j);

    // 2. Crash after the rename, before the truncation: the journal still holds a..b, which the
    // new snapshot includes; the open verifies and skips them, and truncates.
    reset();
    write_atomic(&path, &new).unwrap();
    let (j, loaded) = Journal::recover(&path).unwrap();
    assert_eq!(loaded.snapshot.as_ref().unwrap().seq, b as u64);
    assert!(loaded.entries.is_empty());
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        0,
        "truncation finished"
    );
    assert_eq!(loaded.replay(&path).unwrap(), st);
    finish(j);
    assert_eq!(first_seq(&path), Some(b as u64 + 1));

    // 2b. The same crash, but records after the snapshot were appended (a journal that spans
    // it): the records up to the snapshot are skipped, the rest replayed.
    reset();
    let mid = (a + b) / 2;
    let mut st_mid = State::new();
    for r in &recs[..mid] {
        st_mid.apply(r.clone()).unwrap();
    }
    write_atomic(&path, &encode(&path, mid as u64, 9, &st_mid).unwrap()).unwrap();
    let (j, loaded) = Journal::recover(&path).unwrap();
    assert_eq!((loaded.skipped, loaded.entries.len()), (mid - a, b - mid));
    assert_eq!(loaded.entries[0].seq, mid as u64 + 1);
    assert_eq!(loaded.replay(&path).unwrap(), st);
    finish(j);

    // 3. Crash after the truncation: snapshot at b and an empty journal.
    reset();
    write_atomic(&path, &new).unwrap();
    std::fs::write(&path, b"").unwrap();
    let (j, loaded) = Journal::recover(&path).unwrap();
    assert_eq!(loaded.replay(&path).unwrap(), st);
    finish(j);

    // 4. No crash: compaction through the journal itself, then the rest.
    reset();
    let (mut j, loaded) = Journal::recover(&path).unwrap();
    let live = loaded.replay(&path).unwrap();
    j.compact(&live).unwrap();
    finish(j);
}

#[test]
fn a_damaged_snapshot_is_refused_naming_the_file_and_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, st) = history(1, 2);
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs);
    j.compact(&st).unwrap();
    drop(j);
    let snap = snapshot_path(&path);
    let good = std::fs::read(&snap).unwrap();
    let refused = |bytes: &[u8], says: &str| {
        std::fs::write(&snap, bytes).unwrap();
        let err = Journal::recover(&path).map(|_| ()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("snapshot {}: ", snap.display())),
            "{text}"
        );
        assert!(text.contains(says), "{text}");
        // Read-only readers refuse it too.
        assert!(crate::journal::load_state(&path).is_err());
    };
    // Cut short (a half-written snapshot in place).
    refused(&good[..good.len() / 2], "without the final newline");
    // A flipped byte.
    let mut b = good.clone();
    let at = b.windows(6).position(|w| w == b"\"w000\"").unwrap() + 2;
    b[at] = b'9';
    refused(&b, "checksum mismatch");
    // A repeated key and an unknown field, each with a valid checksum.
    let body = &good[..good.len() - CRC_LINE_TAIL];
    let with_crc = |body: &[u8]| {
        let mut v = body.to_vec();
        let crc = crc32fast::hash(&v);
        v.extend_from_slice(format!(",\"crc32\":\"{crc:08x}\"}}\n").as_bytes());
        v
    };
    let text = String::from_utf8(body.to_vec()).unwrap();
    let dup = text.replacen("\"seq\":", "\"seq\":1,\"seq\":", 1);
    refused(&with_crc(dup.as_bytes()), "duplicate key \"seq\"");
    let unknown = text.replacen("\"next_order\":", "\"next_ordr\":0,\"next_order\":", 1);
    refused(&with_crc(unknown.as_bytes()), "unknown field `next_ordr`");
    let format = text.replacen("\"format\":1", "\"format\":2", 1);
    refused(&with_crc(format.as_bytes()), "field `format`: 2");
    // Good again: it opens.
    std::fs::write(&snap, &good).unwrap();
    let (_, back) = recovered(&path);
    assert_eq!(back, st);
}

/// Bytes after a line's body: `,"crc32":"` + 8 hex + `"}` + newline.
const CRC_LINE_TAIL: usize = 10 + 8 + 2 + 1;

#[test]
fn a_journal_that_does_not_follow_its_snapshot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, _) = history(1, 2);
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs);
    drop(j);
    let journal = std::fs::read(&path).unwrap();
    // A snapshot at seq 2 with an empty state, then the journal from seq 1: fine (skips 1..2).
    // A journal starting after a gap is not.
    let snap = encode(&path, 2, 0, &State::new()).unwrap();
    write_atomic(&path, &snap).unwrap();
    let nl = journal.iter().position(|&b| b == b'\n').unwrap();
    let nl2 = nl + 1 + journal[nl + 1..].iter().position(|&b| b == b'\n').unwrap();
    let nl3 = nl2 + 1 + journal[nl2 + 1..].iter().position(|&b| b == b'\n').unwrap();
    std::fs::write(&path, &journal[nl3 + 1..]).unwrap(); // starts at seq 4
    let err = Journal::recover(&path).map(|_| ()).unwrap_err();
    assert!(
        err.to_string()
            .contains("sequence number 4 where 1..=3 was expected (the snapshot ends at seq 2)"),
        "{err}"
    );
}

#[test]
fn compaction_is_due_by_bytes_or_records() {
    let c = Compaction {
        max_journal_bytes: 100,
        max_journal_records: 10,
        refit_detail: 2,
        retire_departed_after: None,
        ..Default::default()
    };
    assert!(!c.due(100, 10));
    assert!(c.due(101, 1));
    assert!(c.due(5, 11));
    assert!(
        !c.due(1000, 0),
        "nothing after the snapshot: nothing to compact"
    );
    let never = Compaction {
        max_journal_bytes: 0,
        max_journal_records: 0,
        refit_detail: 2,
        retire_departed_after: None,
        ..Default::default()
    };
    assert!(!never.due(u64::MAX, u64::MAX));
}

#[test]
fn old_refits_keep_their_summary_and_replay_alike() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, full) = history(6, 4);
    // Default: 8 refits keep detail, so all 6 do.
    assert!(full
        .refits()
        .all(|r| r.trimmed.is_none() && r.workers.len() == 4));
    let keep = crate::history::RefitDetail::new(2);
    let mut st = State::new();
    st.set_refit_detail(keep);
    for r in &recs {
        st.apply(r.clone()).unwrap();
    }
    let summary: Vec<_> = st.refits().map(|r| (r.id, r.trimmed)).collect();
    let counts = crate::history::Trimmed {
        workers: 4,
        calls: 4,
        failed_calls: 0,
        dropped: 0,
    };
    assert_eq!(
        summary,
        vec![
            (1, Some(counts)),
            (2, Some(counts)),
            (3, Some(counts)),
            (4, Some(counts)),
            (5, None),
            (6, None)
        ]
    );
    let old = st.refit(1).unwrap();
    assert!(old.workers.is_empty() && old.spec.worker_ids.is_empty());
    assert_eq!(old.outcome, Some(Outcome::Committed));
    assert_eq!(old.phases.len(), 6);
    assert_eq!((old.started_ms, old.ended_ms), (10, Some(19)));
    assert_eq!(old.spec.label, "step-0");
    // The state beyond refit history is the same as with every detail kept.
    assert_eq!(st.fleet_status(), full.fleet_status());
    // Lowering the limit later trims at once; the same through a snapshot and replay.
    let mut full_trimmed = full.clone();
    full_trimmed.set_refit_detail(keep);
    assert_eq!(full_trimmed, st);
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs[..recs.len() / 2]);
    let mut half = State::new();
    half.set_refit_detail(keep);
    for r in &recs[..recs.len() / 2] {
        half.apply(r.clone()).unwrap();
    }
    j.compact(&half).unwrap();
    append_all(&mut j, &recs[recs.len() / 2..]);
    drop(j);
    let (_, loaded) = Journal::recover(&path).unwrap();
    let mut back = loaded.replay(&path).unwrap();
    back.set_refit_detail(keep);
    assert_eq!(back, st);
    // A smaller snapshot than with every detail kept.
    let small = encode(&path, 1, 0, &st).unwrap().len();
    let big = encode(&path, 1, 0, &full).unwrap().len();
    assert!(small < big, "{small} < {big}");
}

#[test]
fn a_snapshot_not_at_the_last_record_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.jsonl");
    let (recs, _) = history(1, 1);
    let (mut j, _) = Journal::open(&path).unwrap();
    append_all(&mut j, &recs);
    let bytes = encode(&path, 1, 0, &State::new()).unwrap();
    match j.install_snapshot(1, &bytes) {
        Err(CompactFailure::Snapshot(e)) => {
            assert!(
                e.to_string().contains("but the journal's last record is"),
                "{e}"
            )
        }
        other => panic!("expected a refused snapshot, got {other:?}"),
    }
    assert!(!snapshot_path(&path).exists());
    assert_eq!(j.size_bytes(), std::fs::metadata(&path).unwrap().len());
}

#[test]
fn batched_call_records_replay_to_the_same_state_in_fewer_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let workers = 100;
    let (per_worker, a) = history_with(2, workers, false);
    let (batched, b) = history_with(2, workers, true);
    assert_eq!(a, b);
    assert_eq!(per_worker.len() - batched.len(), 2 * (2 * workers - 2));
    let bytes = |name: &str, recs: &[Record]| {
        let path = dir.path().join(name);
        let (mut j, _) = Journal::open(&path).unwrap();
        append_all(&mut j, recs);
        drop(j);
        assert_eq!(crate::journal::load_state(&path).unwrap(), a);
        std::fs::metadata(&path).unwrap().len()
    };
    let (x, y) = (bytes("a.jsonl", &per_worker), bytes("b.jsonl", &batched));
    eprintln!(
        "MEASURE {workers} workers, 2 refits: per-worker records {x} B, batched {y} B ({:.0} B/worker/refit saved)",
        (x - y) as f64 / (2 * workers) as f64
    );
    // Per worker and refit: an intent line and a result line of ~200 B each become ~180 B in
    // two batch lines.
    assert!(x - y > (2 * workers * 200) as u64, "{x} vs {y}");
}

#[test]
fn a_batch_is_checked_whole_and_refused_whole() {
    let (recs, _) = history_with(1, 3, true);
    // Everything up to the batch of results: the calls are in flight.
    let at = recs
        .iter()
        .position(|r| matches!(r, Record::WorkerResults { .. }))
        .unwrap();
    let mut st = State::new();
    for r in &recs[..at] {
        st.apply(r.clone()).unwrap();
    }
    let Record::WorkerResults { id, results } = recs[at].clone() else {
        unreachable!()
    };
    let refused = |rec: Record, says: &str| {
        let mut s = st.clone();
        let err = s.apply(rec).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
        assert_eq!(s, st, "nothing applied");
    };
    let mut twice = results.clone();
    twice.push(results[0].clone());
    refused(
        Record::WorkerResults { id, results: twice },
        "[3]: worker \"w000\" twice in one batch",
    );
    refused(
        Record::WorkerResults {
            id,
            results: vec![],
        },
        "0 workers in one batch",
    );
    // One worker not in the refit: the others' results are not applied either.
    let mut stranger = results.clone();
    stranger[2].worker_id = "nobody".into();
    refused(
        Record::WorkerResults {
            id,
            results: stranger,
        },
        "nobody",
    );
    // A second intent while the calls are in flight.
    let again = Record::WorkerCalls {
        id,
        action: Action::ReadVersion,
        worker_ids: vec!["w001".into()],
    };
    refused(again, "already has a call in flight");
    let mut ok = st.clone();
    ok.apply(Record::WorkerResults { id, results }).unwrap();
    assert!(ok
        .refit(id)
        .unwrap()
        .journal_gaps()
        .iter()
        .all(|g| g.contains("END")));
}
