//! Tests of the control-plane state machine (records, refits, admission).
use super::*;
use crate::refit::CallResult;
use mx_layout::{DType, MemDevice, Scheme, ShardEntry};

fn bx(off: &[u64], shape: &[u64]) -> TensorBox {
    TensorBox {
        global_offset: off.to_vec(),
        local_shape: shape.to_vec(),
    }
}

#[test]
fn coverage_finds_gaps() {
    // FSDP-like dim-0 split, complete.
    let a = bx(&[0, 0], &[3, 4]);
    let b = bx(&[3, 0], &[2, 4]);
    assert_eq!(first_gap(&[5, 4], &[&a, &b]), None);
    // Missing rows 3..5.
    assert_eq!(first_gap(&[5, 4], &[&a]), Some(bx(&[3, 0], &[2, 4])));
    // Column split with a hole in the second dim of the second row block.
    let c = bx(&[3, 0], &[2, 3]);
    assert_eq!(first_gap(&[5, 4], &[&a, &c]), Some(bx(&[3, 3], &[2, 1])));
    // Replicated (identical overlapping boxes) and partial overlaps.
    let full = bx(&[0, 0], &[5, 4]);
    assert_eq!(first_gap(&[5, 4], &[&full, &full, &a]), None);
    let o1 = bx(&[0, 0], &[4, 4]);
    let o2 = bx(&[2, 0], &[3, 4]);
    assert_eq!(first_gap(&[5, 4], &[&o1, &o2]), None);
    // Scalars: covered iff some box exists; empty trailing FSDP shards are fine.
    assert_eq!(first_gap(&[], &[&bx(&[], &[])]), None);
    assert_eq!(first_gap(&[], &[]), Some(bx(&[], &[])));
    let empty = bx(&[5, 0], &[0, 4]);
    assert_eq!(first_gap(&[5, 4], &[&a, &b, &empty]), None);
}

fn spec(name: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        dtype: DType::BF16,
        shape: shape.to_vec(),
    }
}

fn shard(name: &str, shape: &[u64], b: TensorBox) -> ShardEntry {
    let len = b.numel().unwrap() * 2;
    ShardEntry {
        tensor: name.to_string(),
        dtype: DType::BF16,
        global_shape: shape.to_vec(),
        digest: Digest::of(format!("{name}{b}").as_bytes()),
        shard: b,
        addr: 4096,
        len,
        device: MemDevice::Dram,
    }
}

fn manifest(slot: u32, shards: Vec<ShardEntry>) -> SourceManifest {
    SourceManifest {
        slot,
        layout: LAYOUT,
        agent_name: format!("src{slot}"),
        agent_metadata: vec![1, 2, 3],
        shards,
        pieces: vec![],
        pack_seconds: 0.0,
    }
}

const LAYOUT: LayoutSpec = LayoutSpec {
    scheme: Scheme::Fsdp,
    world_size: 2,
};

#[test]
fn publish_then_ready_then_stage() {
    let mut st = State::new();
    let declare = Record::Declare {
        label: "v1".into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("w", &[4, 2])],
    };
    st.apply(declare.clone()).unwrap();
    assert_eq!(st.check(&declare).unwrap(), Check::Noop);
    let s0 = shard("w", &[4, 2], bx(&[0, 0], &[2, 2]));
    let s1 = shard("w", &[4, 2], bx(&[2, 0], &[2, 2]));
    st.apply(Record::Publish {
        label: "v1".into(),
        manifest: manifest(0, vec![s0.clone()]),
    })
    .unwrap();
    assert_eq!(st.version_state("v1"), Some(VersionState::Publishing));
    st.apply(Record::Publish {
        label: "v1".into(),
        manifest: manifest(1, vec![s1.clone()]),
    })
    .unwrap();
    let info = st.version_info("v1").unwrap();
    assert_eq!(info.state, VersionState::Ready);
    assert_eq!(info.version_digest, Some(version_digest([&s0, &s1])));

    // A republish that changes the bytes after READY is refused; the same bytes are fine.
    let mut changed = s1.clone();
    changed.digest = Digest::of(b"other");
    let err = st
        .apply(Record::Publish {
            label: "v1".into(),
            manifest: manifest(1, vec![changed]),
        })
        .unwrap_err();
    assert!(matches!(err, Error::VersionState { .. }), "{err}");
    st.apply(Record::Publish {
        label: "v1".into(),
        manifest: manifest(1, vec![s1.clone()]),
    })
    .unwrap();

    register(&mut st, "a", None);
    assert_eq!(st.pending_command("a"), None);
    st.apply(Record::Stage {
        label: "v1".into(),
        worker_ids: vec!["a".into()],
    })
    .unwrap();
    let (seq, cmd) = st.pending_command("a").unwrap();
    assert_eq!(seq, 1);
    assert!(matches!(cmd, Command::Stage { .. }));
    st.apply(Record::Staged {
        report: StagedReport {
            worker_id: "a".into(),
            label: "v1".into(),
            ok: true,
            ..Default::default()
        },
    })
    .unwrap();
    // STAGED is as far as a worker goes by itself: no command is outstanding, and the
    // version stays READY (only a refit commits it).
    assert_eq!(st.pending_command("a"), None);
    assert_eq!(st.version_state("v1"), Some(VersionState::Ready));
    let (state, label, _) = st.worker_brief("a").unwrap();
    assert_eq!((state, label.as_deref()), (WorkerState::Staged, Some("v1")));
    // A stage again is a new command.
    st.apply(Record::Stage {
        label: "v1".into(),
        worker_ids: vec!["a".into()],
    })
    .unwrap();
    assert_eq!(st.pending_command("a").unwrap().0, 2);
}

#[test]
fn missing_tensor_keeps_publishing() {
    let mut st = State::new();
    st.apply(Record::Declare {
        label: "v".into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("a", &[2]), spec("b", &[3])],
    })
    .unwrap();
    for slot in 0..2 {
        st.apply(Record::Publish {
            label: "v".into(),
            manifest: manifest(slot, vec![shard("a", &[2], bx(&[slot as u64], &[1]))]),
        })
        .unwrap();
    }
    let info = st.version_info("v").unwrap();
    assert_eq!(info.state, VersionState::Publishing);
    assert_eq!(info.missing_tensors, vec!["b".to_string()]);
    assert_eq!(info.version_digest, None);
}

/// Registers worker `id` (rank 0 of LAYOUT, no engine) reporting `resident`.
fn register(st: &mut State, id: &str, resident: Option<String>) {
    st.apply(Record::Register {
        worker_id: id.into(),
        instance: id.into(),
        ranks: vec![0],
        layout: LAYOUT,
        engine: None,
        resident_version: resident.as_deref().map(ResidentVersion::parse),
        addresses: vec![],
    })
    .unwrap();
}

fn ready_state() -> (State, Digest) {
    let mut st = State::new();
    st.apply(Record::Declare {
        label: "v1".into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("w", &[4, 2])],
    })
    .unwrap();
    for slot in 0..2u32 {
        let b = bx(&[u64::from(slot) * 2, 0], &[2, 2]);
        st.apply(Record::Publish {
            label: "v1".into(),
            manifest: manifest(slot, vec![shard("w", &[4, 2], b)]),
        })
        .unwrap();
    }
    for id in ["a", "b"] {
        st.apply(Record::Register {
            worker_id: id.into(),
            instance: id.into(),
            ranks: vec![0],
            layout: LAYOUT,
            engine: Some(EngineEndpoint {
                api: crate::refit::EngineApi::Dynamo,
                system_url: "http://127.0.0.1:1".into(),
                no_model: false,
                frontend: None,
            }),
            resident_version: Some(ResidentVersion::parse("disk:/ckpt")),
            addresses: vec![],
        })
        .unwrap();
    }
    let d = st.version_info("v1").unwrap().version_digest.unwrap();
    (st, d)
}

fn begin(st: &State, d: Digest) -> Record {
    begin_on(
        st,
        "v1",
        d,
        &[("a", Some("disk:/ckpt")), ("b", Some("disk:/ckpt"))],
    )
}

/// BEGIN of the next refit to `label` (digest `d`) on `set`: (worker, previous version).
fn begin_on(st: &State, label: &str, d: Digest, set: &[(&str, Option<&str>)]) -> Record {
    let workers = set
        .iter()
        .map(|(id, previous)| {
            (
                id.to_string(),
                crate::refit::RefitWorker {
                    previous: previous.map(ResidentVersion::parse),
                    resident: previous.map(ResidentVersion::parse),
                    stage_seconds: 0.0,
                    stage_bytes: 0,
                    calls: vec![],
                    reregistered: None,
                },
            )
        })
        .collect();
    Record::RefitBegin {
        refit: Box::new(Refit {
            id: st.next_refit_id(),
            spec: crate::refit::RefitSpec {
                no_check: false,
                label: label.into(),
                worker_ids: set.iter().map(|(w, _)| w.to_string()).collect(),
                pause_mode: crate::refit::PauseMode::Wait,
                allow_partial: false,
                check: None,
                framework_step: 1,
                stage_timeout_ms: 1000,
                call_timeout_ms: 1000,
                apply_parallelism: 0,
                orchestrator_gated: false,
                verify_from_apply_answer: false,
            },
            digest: d,
            target: VersionId(d),
            dropped: vec![],
            phase: Phase::Stage,
            phases: vec![],
            workers,
            outcome: None,
            reason: String::new(),
            started_ms: 0,
            ended_ms: None,
            recovered: false,
            trimmed: None,
            request_id: 0,
        }),
    }
}

fn phase(id: u64, p: Phase) -> Record {
    Record::RefitPhase {
        id,
        phase: p,
        at_ms: 0,
        reason: String::new(),
        recovered: false,
    }
}

#[test]
fn refit_commits_admits_and_refuses_illegal_steps() {
    let (mut st, d) = ready_state();
    // Registered from disk with no fleet version: gated.
    let ws = st.fleet_status().workers;
    assert!(ws
        .iter()
        .all(|w| !w.admitted && w.admission.contains("stale")));
    // A disk version id holds no mx digest.
    assert!(ws.iter().all(|w| w.resident_version.is_none()));
    st.apply(begin(&st, d)).unwrap();
    assert_eq!(st.open_refit_id(), Some(1));
    assert_eq!(st.version_state("v1"), Some(VersionState::Committing));
    // One refit at a time; phases in order only.
    let err = st.check(&begin(&st, d)).unwrap_err();
    assert!(matches!(err, Error::Refit { .. }), "{err}");
    assert!(st.check(&phase(1, Phase::Commit)).is_err());
    for p in [Phase::Prepare, Phase::Apply] {
        st.apply(phase(1, p)).unwrap();
    }
    let target = VersionId(d).to_string();
    for w in ["a", "b"] {
        st.apply(Record::WorkerCall {
            id: 1,
            worker_id: w.into(),
            action: Action::Apply {
                version: ResidentVersion::parse(&target),
            },
        })
        .unwrap();
        // A second call while one is in flight is refused.
        assert!(st
            .check(&Record::WorkerCall {
                id: 1,
                worker_id: w.into(),
                action: Action::Resume,
            })
            .is_err());
        st.apply(Record::WorkerDone {
            id: 1,
            worker_id: w.into(),
            result: CallResult {
                ok: true,
                cache_tiers_cleared: vec!["kv_cache".into()],
                ..CallResult::default()
            },
        })
        .unwrap();
    }
    // Past the point of no return ABORT is refused; ROLLBACK would be allowed.
    assert!(st.check(&phase(1, Phase::Abort)).is_err());
    assert!(st.check(&phase(1, Phase::Rollback)).is_ok());
    for p in [Phase::Verify, Phase::Resume, Phase::Commit] {
        st.apply(phase(1, p)).unwrap();
    }
    // Still gated until END.
    assert!(st.fleet_status().workers.iter().all(|w| !w.admitted));
    st.apply(Record::RefitEnd {
        id: 1,
        outcome: Outcome::Committed,
        reason: String::new(),
        at_ms: 0,
        recovered: false,
        fenced: vec![],
        departed: vec![],
    })
    .unwrap();
    let f = st.fleet_status();
    assert_eq!(
        f.fleet_version,
        Some(crate::FleetVersion {
            label: "v1".into(),
            version_id: target.parse().unwrap()
        })
    );
    assert!(f
        .workers
        .iter()
        .all(|w| w.admitted && w.resident_id == Some(ResidentVersion::parse(&target))));
    // The resident digest is the one inside the resident mx version id.
    assert!(f.workers.iter().all(|w| w.resident_version == Some(d)));
    assert_eq!(st.version_state("v1"), Some(VersionState::Committed));
    assert!(st.refit(1).unwrap().journal_gaps().is_empty());
    // A worker rejoining with other weights is not admitted.
    register(&mut st, "b", Some("disk:/ckpt".into()));
    let b = st
        .fleet_status()
        .workers
        .into_iter()
        .find(|w| w.worker_id == "b")
        .unwrap();
    assert!(
        !b.admitted && b.admission.contains("stale"),
        "{}",
        b.admission
    );
}

/// One engine call of refit `id` on worker `w`, answered `ok` (an APPLY answer names the
/// version it applied).
fn call(st: &mut State, id: u64, w: &str, action: Action, ok: bool) {
    let version = match &action {
        Action::Apply { version } if ok => Some(version.clone()),
        _ => None,
    };
    st.apply(Record::WorkerCall {
        id,
        worker_id: w.into(),
        action,
    })
    .unwrap();
    st.apply(Record::WorkerDone {
        id,
        worker_id: w.into(),
        result: CallResult {
            ok,
            version,
            error: if ok {
                String::new()
            } else {
                "engine gone".into()
            },
            ..CallResult::default()
        },
    })
    .unwrap();
}

fn end(id: u64, outcome: Outcome, fenced: &[&str]) -> Record {
    Record::RefitEnd {
        id,
        outcome,
        reason: "x".into(),
        at_ms: 0,
        recovered: false,
        fenced: fenced.iter().map(|w| w.to_string()).collect(),
        departed: vec![],
    }
}

fn worker(st: &State, id: &str) -> crate::types::WorkerStatus {
    st.fleet_status()
        .workers
        .into_iter()
        .find(|w| w.worker_id == id)
        .unwrap()
}

#[test]
fn a_version_overwritten_in_place_is_retired() {
    let (mut st, _) = ready_state();
    assert_eq!(st.retired_by("v1"), None);
    // Publishes one shard of `w` at `addr` as `label` from `slot` (agent `src<slot>`, or
    // `agent` when given).
    let publish = |st: &mut State, label: &str, slot: u32, addr: u64, agent: Option<&str>| {
        let mut sh = shard("w", &[4, 2], bx(&[u64::from(slot) * 2, 0], &[2, 2]));
        sh.addr = addr;
        let mut m = manifest(slot, vec![sh]);
        if let Some(a) = agent {
            m.agent_name = a.into();
        }
        st.apply(Record::Publish {
            label: label.into(),
            manifest: m,
        })
        .unwrap();
    };
    for label in ["v2", "v3"] {
        st.apply(Record::Declare {
            label: label.into(),
            trainer_layout: LAYOUT,
            tensors: vec![spec("w", &[4, 2])],
        })
        .unwrap();
    }
    // v2 from slot 1's agent at other addresses (a double-buffering publisher): v1 stays.
    publish(&mut st, "v2", 1, 1 << 20, None);
    assert_eq!(st.retired_by("v1"), None);
    // Slot 0's agent publishes v2 into the memory v1 used (4098.. overlaps v1's
    // 4096..4104): v1 is retired for slot 0; v2 is not.
    publish(&mut st, "v2", 0, 4098, None);
    assert_eq!(st.retired_by("v1"), Some((0, "v2".to_string())));
    assert_eq!(st.retired_by("v2"), None);
    // The status shows which slot was overwritten, by what.
    let v1 = &st.fleet_status().versions[0];
    assert_eq!((v1.label.as_str(), v1.slots), ("v1", 2));
    let retired: Vec<(u32, Option<&str>)> = v1
        .publishers
        .iter()
        .map(|p| (p.slot, p.retired_by.as_deref()))
        .collect();
    assert_eq!(retired, vec![(0, Some("v2")), (1, None)]);
    // Another agent at v2's slot-1 addresses (another process) retires nothing.
    publish(&mut st, "v3", 1, 1 << 20, Some("other"));
    assert_eq!(st.retired_by("v2"), None);
    // Touching but not overlapping ranges (v2's slot 1 is 1 MiB..+8) retire nothing either.
    publish(&mut st, "v3", 1, (1 << 20) + 8, None);
    assert_eq!(st.retired_by("v2"), None);
}

#[test]
fn a_fenced_worker_stays_gated_until_it_registers_again() {
    let (mut st, d) = ready_state();
    let target = VersionId(d).to_string();
    let apply = || Action::Apply {
        version: ResidentVersion::parse(&target),
    };
    // Refit 1 commits v1 on a and b.
    st.apply(begin(&st, d)).unwrap();
    for p in [Phase::Prepare, Phase::Apply] {
        st.apply(phase(1, p)).unwrap();
    }
    for w in ["a", "b"] {
        call(&mut st, 1, w, apply(), true);
    }
    for p in [Phase::Verify, Phase::Resume, Phase::Commit] {
        st.apply(phase(1, p)).unwrap();
    }
    st.apply(end(1, Outcome::Committed, &[])).unwrap();
    assert!(worker(&st, "a").admitted && worker(&st, "b").admitted);
    // Refit 2 of the same version fails at APPLY and rolls back; b cannot be brought back
    // (its engine is gone), a can.
    st.apply(begin(&st, d)).unwrap();
    for p in [Phase::Prepare, Phase::Apply] {
        st.apply(phase(2, p)).unwrap();
    }
    call(&mut st, 2, "b", apply(), false);
    st.apply(phase(2, Phase::Rollback)).unwrap();
    call(&mut st, 2, "a", Action::Resume, true);
    call(&mut st, 2, "b", Action::Pause, false);
    // Only FENCED names fenced workers, and only workers of the set.
    let err = st.check(&end(2, Outcome::RolledBack, &["b"])).unwrap_err();
    assert!(err.to_string().contains("fences no worker"), "{err}");
    let err = st.check(&end(2, Outcome::Fenced, &["zz"])).unwrap_err();
    assert!(err.to_string().contains("fenced worker zz"), "{err}");
    st.apply(end(2, Outcome::Fenced, &["b"])).unwrap();
    // b's last known version is still the committed one, but it is not admitted.
    let b = worker(&st, "b");
    assert_eq!(b.resident_id, Some(ResidentVersion::parse(&target)));
    assert!(
        !b.admitted && b.admission.contains("fenced by refit 2"),
        "{}",
        b.admission
    );
    assert_eq!(b.gate, Some(crate::Gate::Fenced));
    assert!(worker(&st, "a").admitted);
    // The gauges count it under its gate; a disconnected a is counted as disconnected.
    let t = st.tallies(|id| id != "a");
    assert_eq!(
        t.gated,
        [(crate::Gate::Fenced, 1), (crate::Gate::Disconnected, 1)].into()
    );
    assert_eq!((t.connected, t.admitted), (1, 0));
    // A later refit that aborts before touching b does not lift the fence.
    st.apply(begin(&st, d)).unwrap();
    st.apply(phase(3, Phase::Abort)).unwrap();
    st.apply(end(3, Outcome::Aborted, &[])).unwrap();
    let b = worker(&st, "b");
    assert!(!b.admitted && b.admission.contains("fenced by refit 2"));
    // Registering again, with the committed version resident, lifts it.
    register(&mut st, "b", Some(target.clone()));
    let b = worker(&st, "b");
    assert!(b.admitted, "{}", b.admission);
}

#[test]
fn refit_abort_restores_the_version_state_and_gaps_are_named() {
    let (mut st, d) = ready_state();
    st.apply(begin(&st, d)).unwrap();
    st.apply(Record::WorkerCall {
        id: 1,
        worker_id: "a".into(),
        action: Action::Pause,
    })
    .unwrap();
    let gaps = st.refit(1).unwrap().journal_gaps();
    assert_eq!(gaps.len(), 2, "{gaps:?}"); // no END, a call without result
    st.apply(phase(1, Phase::Abort)).unwrap();
    // END with a call in flight is refused.
    let end = Record::RefitEnd {
        id: 1,
        outcome: Outcome::Aborted,
        reason: "x".into(),
        at_ms: 0,
        recovered: false,
        fenced: vec![],
        departed: vec![],
    };
    assert!(st.check(&end).is_err());
    st.apply(Record::WorkerDone {
        id: 1,
        worker_id: "a".into(),
        result: CallResult::default(),
    })
    .unwrap();
    st.apply(end).unwrap();
    assert_eq!(st.version_state("v1"), Some(VersionState::Ready));
    assert_eq!(st.fleet_status().fleet_version, None);
}

/// Drives refit `id` (already begun on `set`) through APPLY, VERIFY, RESUME and COMMIT.
fn commit(st: &mut State, id: u64, set: &[&str], target: &str) {
    for p in [Phase::Prepare, Phase::Apply] {
        st.apply(phase(id, p)).unwrap();
    }
    for w in set {
        let version = ResidentVersion::parse(target);
        call(st, id, w, Action::Apply { version }, true);
    }
    for p in [Phase::Verify, Phase::Resume, Phase::Commit] {
        st.apply(phase(id, p)).unwrap();
    }
    st.apply(end(id, Outcome::Committed, &[])).unwrap();
}

/// Declares and publishes `label`: the same tensor as v1 with other bytes (another digest).
fn second_version(st: &mut State, label: &str) -> Digest {
    st.apply(Record::Declare {
        label: label.into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("w", &[4, 2])],
    })
    .unwrap();
    for slot in 0..2u32 {
        let mut sh = shard("w", &[4, 2], bx(&[u64::from(slot) * 2, 0], &[2, 2]));
        sh.digest = Digest::of(format!("{label}{slot}").as_bytes());
        sh.addr = 1 << 20;
        st.apply(Record::Publish {
            label: label.into(),
            manifest: manifest(slot, vec![sh]),
        })
        .unwrap();
    }
    st.version_info(label).unwrap().version_digest.unwrap()
}

#[test]
fn regression_a_commit_makes_every_worker_not_on_it_stale() {
    // Observed: after a refit committed V on a set, workers outside it that still held
    // V-1 stayed admitted.
    let (mut st, d1) = ready_state();
    let v1 = VersionId(d1).to_string();
    st.apply(begin(&st, d1)).unwrap();
    commit(&mut st, 1, &["a", "b"], &v1);
    assert!(worker(&st, "a").admitted && worker(&st, "b").admitted);
    let d2 = second_version(&mut st, "v2");
    let v2 = VersionId(d2).to_string();
    st.apply(begin_on(&st, "v2", d2, &[("a", Some(&v1))]))
        .unwrap();
    // b is outside the refit: still admitted on v1 while v2 is not committed.
    assert!(worker(&st, "b").admitted);
    assert!(!worker(&st, "a").admitted);
    commit(&mut st, 2, &["a"], &v2);
    let (a, b) = (worker(&st, "a"), worker(&st, "b"));
    assert!(a.admitted, "{}", a.admission);
    assert_eq!(b.resident_id, Some(ResidentVersion::parse(&v1)));
    assert!(
        !b.admitted && b.admission.contains("stale") && b.admission.contains(&v2),
        "{}",
        b.admission
    );
    assert_eq!((a.gate, b.gate), (None, Some(crate::Gate::Stale)));
    assert_eq!(
        (a.resident_label.as_deref(), b.resident_label.as_deref()),
        (Some("v2"), Some("v1"))
    );
    assert_eq!(
        st.fleet_status().fleet_version.map(|f| f.label),
        Some("v2".to_string())
    );
    let t = st.tallies(|_| true);
    assert_eq!((t.admitted, t.gated), (1, [(crate::Gate::Stale, 1)].into()));
    assert!(!st.worker_admitted("b") && st.worker_admitted("a"));
}

#[test]
fn a_worker_registering_again_during_a_refit_is_recorded_in_it() {
    let (mut st, d1) = ready_state();
    st.apply(begin(&st, d1)).unwrap();
    assert!(!st.refit(1).unwrap().workers["a"].lost_weights());
    // a restarts empty during STAGE; b reconnects holding what it had.
    for (w, resident) in [("a", None), ("b", Some("disk:/ckpt"))] {
        register(&mut st, w, resident.map(str::to_string));
    }
    let r = st.refit(1).unwrap();
    assert_eq!(
        r.workers["a"].reregistered,
        Some(crate::refit::Rejoined { resident: None })
    );
    assert!(r.workers["a"].lost_weights());
    assert!(r.workers["b"].reregistered.is_some() && !r.workers["b"].lost_weights());
    // Still in the refit, so not admitted; the refit still may abort.
    assert!(worker(&st, "a").admission.contains("refit 1"));
    assert!(st.check(&phase(1, Phase::Abort)).is_ok());
}

#[test]
fn a_refit_of_the_held_version_is_verify_only() {
    let (mut st, d1) = ready_state();
    let v1 = VersionId(d1).to_string();
    // A refit whose workers do not all hold the target cannot skip to VERIFY.
    st.apply(begin(&st, d1)).unwrap();
    assert!(!st.refit(1).unwrap().verify_only());
    assert!(st.check(&phase(1, Phase::Verify)).is_err());
    commit(&mut st, 1, &["a", "b"], &v1);
    // Both hold v1 now: the refit of v1 goes STAGE -> VERIFY, and may still abort there
    // (nothing was applied).
    st.apply(begin_on(
        &st,
        "v1",
        d1,
        &[("a", Some(&v1)), ("b", Some(&v1))],
    ))
    .unwrap();
    assert!(st.refit(2).unwrap().verify_only());
    st.apply(phase(2, Phase::Verify)).unwrap();
    assert!(st.check(&phase(2, Phase::Abort)).is_ok());
    // b's engine reads back another version: learned, and b is not admitted after END.
    st.apply(Record::WorkerCall {
        id: 2,
        worker_id: "b".into(),
        action: Action::ReadVersion,
    })
    .unwrap();
    st.apply(Record::WorkerDone {
        id: 2,
        worker_id: "b".into(),
        result: CallResult {
            ok: true,
            version: Some(ResidentVersion::parse("disk:/other")),
            ..CallResult::default()
        },
    })
    .unwrap();
    st.apply(phase(2, Phase::Abort)).unwrap();
    st.apply(end(2, Outcome::Aborted, &[])).unwrap();
    let b = worker(&st, "b");
    assert!(
        !b.admitted && b.admission.contains("disk:/other"),
        "{}",
        b.admission
    );
    assert!(worker(&st, "a").admitted);
}

#[test]
fn a_departed_worker_stays_gated_until_a_later_refit_settles_it() {
    let (mut st, d1) = ready_state();
    let v1 = VersionId(d1).to_string();
    st.apply(begin(&st, d1)).unwrap();
    commit(&mut st, 1, &["a", "b"], &v1);
    st.apply(begin_on(
        &st,
        "v1",
        d1,
        &[("a", Some(&v1)), ("b", Some(&v1))],
    ))
    .unwrap();
    st.apply(phase(2, Phase::Abort)).unwrap();
    let mut rec = end(2, Outcome::Aborted, &[]);
    if let Record::RefitEnd { departed, .. } = &mut rec {
        *departed = vec!["zz".into()];
    }
    let err = st.check(&rec).unwrap_err();
    assert!(err.to_string().contains("departed worker zz"), "{err}");
    if let Record::RefitEnd { departed, .. } = &mut rec {
        *departed = vec!["b".into()];
    }
    st.apply(rec).unwrap();
    let gated = |st: &State| {
        let b = worker(st, "b");
        !b.admitted
            && b.admission.contains("left during refit 2")
            && b.admission
                .contains("`mx refit --label v1 --workers b --join`")
    };
    assert!(gated(&st), "{}", worker(&st, "b").admission);
    // Registering again on the committed version does not lift it: its engine may still be
    // paused (it left before it was resumed).
    register(&mut st, "b", Some(v1.clone()));
    assert!(gated(&st));
    // A later refit of b that commits (it pauses, applies, resumes b) does.
    st.apply(begin_on(&st, "v1", d1, &[("b", Some(&v1))]))
        .unwrap();
    commit(&mut st, 3, &["b"], &v1);
    assert!(worker(&st, "b").admitted, "{}", worker(&st, "b").admission);
}

#[test]
fn a_refit_of_no_worker_is_refused() {
    let (st, d1) = ready_state();
    let err = st.check(&begin_on(&st, "v1", d1, &[])).unwrap_err();
    assert!(err.to_string().contains("empty worker set"), "{err}");
}

fn staged_ok(st: &mut State, w: &str, label: &str) {
    st.apply(Record::Staged {
        report: StagedReport {
            worker_id: w.into(),
            label: label.into(),
            ok: true,
            ..Default::default()
        },
    })
    .unwrap();
}

#[test]
fn a_version_is_released_once_staged_everywhere_or_never_to_be_staged() {
    // A plain Stage: released once every worker of the set reported STAGED, not before.
    let (mut st, d) = ready_state();
    st.apply(Record::Stage {
        label: "v1".into(),
        worker_ids: vec!["b".into(), "a".into()],
    })
    .unwrap();
    staged_ok(&mut st, "a", "v1");
    assert_eq!(st.release_of("v1"), None);
    staged_ok(&mut st, "b", "v1");
    let staged = Release::Staged {
        refit: None,
        workers: vec!["a".into(), "b".into()],
    };
    assert_eq!(st.release_of("v1"), Some(staged.clone()));
    assert_eq!(st.version_info("v1").unwrap().release, Some(staged.clone()));

    // A refit: released when it leaves STAGE (for PREPARE), naming the refit; a refit that
    // aborts in STAGE releases it as RefitEnded instead.
    let (mut st, d2) = ready_state();
    assert_eq!(d2, d);
    st.apply(begin(&st, d)).unwrap();
    assert_eq!(st.release_of("v1"), None);
    st.apply(phase(1, Phase::Prepare)).unwrap();
    assert_eq!(
        st.release_of("v1"),
        Some(Release::Staged {
            refit: Some(1),
            workers: vec!["a".into(), "b".into()],
        })
    );
    let (mut st, _) = ready_state();
    st.apply(begin(&st, d)).unwrap();
    st.apply(phase(1, Phase::Abort)).unwrap();
    assert_eq!(st.release_of("v1"), None);
    st.apply(end(1, Outcome::Aborted, &[])).unwrap();
    assert_eq!(
        st.release_of("v1"),
        Some(Release::RefitEnded {
            refit: 1,
            outcome: Outcome::Aborted,
        })
    );

    // A later version committed: an earlier one never staged is superseded.
    let (mut st, _) = ready_state();
    let d3 = second_version(&mut st, "v2");
    st.apply(begin_on(
        &st,
        "v2",
        d3,
        &[("a", Some("disk:/ckpt")), ("b", Some("disk:/ckpt"))],
    ))
    .unwrap();
    commit(&mut st, 1, &["a", "b"], &VersionId(d3).to_string());
    assert_eq!(
        st.release_of("v1"),
        Some(Release::Superseded { by: "v2".into() })
    );
    // A source's release is a no-op once released; on a fresh version it sticks.
    let rel = Record::Release {
        label: "v1".into(),
        slot: 0,
    };
    assert_eq!(st.check(&rel).unwrap(), Check::Noop);
    let (mut st, _) = ready_state();
    let bad = Record::Release {
        label: "v1".into(),
        slot: 2,
    };
    assert!(matches!(st.check(&bad), Err(Error::InvalidField { .. })));
    st.apply(rel).unwrap();
    assert_eq!(st.release_of("v1"), Some(Release::Source { slot: 0 }));
}

#[test]
fn a_member_that_moved_on_keeps_the_version_unreleased() {
    // The scan for "every member STAGED" resumes where it last stopped; a member checked
    // before (a) that moved on to another version must still hold the release back.
    let (mut st, _) = ready_state();
    second_version(&mut st, "v2");
    let stage = |label: &str, ws: &[&str]| Record::Stage {
        label: label.into(),
        worker_ids: ws.iter().map(|w| w.to_string()).collect(),
    };
    st.apply(stage("v1", &["a", "b"])).unwrap();
    staged_ok(&mut st, "a", "v1");
    st.apply(stage("v2", &["a"])).unwrap();
    staged_ok(&mut st, "b", "v1");
    assert_eq!(st.release_of("v1"), None);
    staged_ok(&mut st, "a", "v2");
    assert_eq!(
        st.release_of("v2"),
        Some(Release::Staged {
            refit: None,
            workers: vec!["a".into()],
        })
    );
    // A new Stage of v1 starts its scan afresh.
    st.apply(stage("v1", &["a"])).unwrap();
    assert_eq!(st.release_of("v1"), None);
    staged_ok(&mut st, "a", "v1");
    assert_eq!(
        st.release_of("v1"),
        Some(Release::Staged {
            refit: None,
            workers: vec!["a".into()],
        })
    );
}

#[test]
fn a_republish_that_only_adds_pieces_is_accepted_without_counting() {
    let (mut st, d) = ready_state();
    let held = st.version_info("v1").unwrap().manifests[0].clone();
    let piece = |rank: u32| mx_layout::DestPiece {
        layout: LayoutSpec {
            scheme: Scheme::VllmTp,
            world_size: 2,
        },
        dest_rank: rank,
        tensor: "w".into(),
        region: bx(&[0, 0], &[2, 1]),
        digest: Digest::of(b"piece"),
        packed_addr: None,
    };
    let mut m = held.clone();
    for n in 0..crate::limits::MAX_REPUBLISHES + 5 {
        m.pieces.push(piece(n % 2));
        st.apply(Record::Publish {
            label: "v1".into(),
            manifest: m.clone(),
        })
        .unwrap();
    }
    let info = st.version_info("v1").unwrap();
    assert_eq!(info.version_digest, Some(d));
    assert_eq!(info.manifests[0].pieces.len(), m.pieces.len());
    // Past the extension limit, refused naming it.
    for _ in crate::limits::MAX_REPUBLISHES + 5..crate::limits::MAX_PIECE_EXTENSIONS {
        m.pieces.push(piece(0));
        st.apply(Record::Publish {
            label: "v1".into(),
            manifest: m.clone(),
        })
        .unwrap();
    }
    m.pieces.push(piece(1));
    let e = st
        .apply(Record::Publish {
            label: "v1".into(),
            manifest: m.clone(),
        })
        .unwrap_err();
    assert!(e.to_string().contains("extended 64 times"), "{e}");
    // Dropping or reordering held pieces is no extension: it counts as a republish; changed
    // shard bytes stay refused.
    let mut fewer = held.clone();
    fewer.pieces.clear();
    fewer.agent_metadata = vec![9];
    st.apply(Record::Publish {
        label: "v1".into(),
        manifest: fewer,
    })
    .unwrap();
    assert_eq!(st.republishes.get(&("v1".to_string(), 0)), Some(&1));
    let mut changed = held;
    changed.shards[0].digest = Digest::of(b"other bytes");
    changed.pieces.push(piece(0));
    assert!(matches!(
        st.apply(Record::Publish {
            label: "v1".into(),
            manifest: changed,
        }),
        Err(Error::VersionState { .. })
    ));
}

#[test]
fn artifacts_are_recorded_with_their_lineage_and_checked() {
    use crate::types::{ArtifactKind, ArtifactRecord};
    let (mut st, d1) = ready_state();
    let canonical = ArtifactRecord {
        url: "s3://mx-runs/v1".into(),
        manifest_digest: Digest::of(b"m1"),
        kind: ArtifactKind::Canonical,
        base: None,
    };
    let rec = |label: &str, a: &ArtifactRecord| Record::Artifact {
        label: label.into(),
        artifact: a.clone(),
    };
    assert_eq!(st.check(&rec("v1", &canonical)).unwrap(), Check::Apply);
    st.apply(rec("v1", &canonical)).unwrap();
    // The same record again changes nothing; the same URL with another manifest is refused.
    assert_eq!(st.check(&rec("v1", &canonical)).unwrap(), Check::Noop);
    let other = ArtifactRecord {
        manifest_digest: Digest::of(b"m1'"),
        ..canonical.clone()
    };
    let e = st.check(&rec("v1", &other)).unwrap_err().to_string();
    assert!(
        e.contains("artifact.url") && e.contains("s3://mx-runs/v1"),
        "{e}"
    );
    // A delta needs a known base other than itself; a canonical artifact none.
    let d2 = second_version(&mut st, "v2");
    let delta = ArtifactRecord {
        url: "s3://mx-runs/v2".into(),
        manifest_digest: Digest::of(b"m2"),
        kind: ArtifactKind::Delta,
        base: Some(d1),
    };
    for (bad, field) in [
        (
            ArtifactRecord {
                base: None,
                ..delta.clone()
            },
            "base_version_digest",
        ),
        (
            ArtifactRecord {
                base: Some(d2),
                ..delta.clone()
            },
            "base_version_digest",
        ),
        (
            ArtifactRecord {
                base: Some(Digest::of(b"nope")),
                ..delta.clone()
            },
            "no READY version",
        ),
        (
            ArtifactRecord {
                kind: ArtifactKind::Canonical,
                ..delta.clone()
            },
            "no base",
        ),
        (
            ArtifactRecord {
                url: "s3://Bad/x".into(),
                ..delta.clone()
            },
            "artifact.url",
        ),
    ] {
        let e = st.check(&rec("v2", &bad)).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
    st.apply(rec("v2", &delta)).unwrap();
    let info = st.version_info("v2").unwrap();
    assert_eq!(info.artifacts, vec![delta]);
    assert_eq!(
        st.version_info("v1").unwrap().artifacts,
        vec![canonical.clone()]
    );
    // Only a READY version has artifacts.
    st.apply(Record::Declare {
        label: "v3".into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("w", &[4, 2])],
    })
    .unwrap();
    let e = st.check(&rec("v3", &canonical)).unwrap_err().to_string();
    assert!(e.contains("READY"), "{e}");
}

#[test]
fn peers_serve_only_what_is_resident_and_recorded_and_are_withdrawn_before_their_memory_changes() {
    let mut st = State::new();
    st.apply(Record::Declare {
        label: "v1".into(),
        trainer_layout: LAYOUT,
        tensors: vec![spec("w", &[4, 2])],
    })
    .unwrap();
    // Each trainer slot cut one piece for layout LAYOUT: its own rows, for the rank of its slot.
    let piece = |slot: u32, digest: Digest| mx_layout::DestPiece {
        layout: LAYOUT,
        dest_rank: slot,
        tensor: "w".into(),
        region: bx(&[u64::from(slot) * 2, 0], &[2, 2]),
        digest,
        packed_addr: None,
    };
    for slot in 0..2u32 {
        let sh = shard("w", &[4, 2], bx(&[u64::from(slot) * 2, 0], &[2, 2]));
        let mut m = manifest(slot, vec![sh.clone()]);
        m.pieces.push(piece(slot, sh.digest));
        st.apply(Record::Publish {
            label: "v1".into(),
            manifest: m,
        })
        .unwrap();
    }
    let d = st.version_info("v1").unwrap().version_digest.unwrap();
    let reg = |resident: Option<String>| Record::Register {
        worker_id: "p".into(),
        instance: "p".into(),
        ranks: vec![0, 1],
        layout: LAYOUT,
        engine: None,
        resident_version: resident.as_deref().map(ResidentVersion::parse),
        addresses: vec![],
    };
    // The peer's memory: both regions it verified, at its own addresses, with the record's
    // digests.
    let mut peer = manifest(0, vec![]);
    peer.agent_name = "peer-p".into();
    for slot in 0..2u32 {
        let mut sh = shard("w", &[4, 2], bx(&[u64::from(slot) * 2, 0], &[2, 2]));
        sh.addr = (1 << 30) | (u64::from(slot) * 8);
        peer.shards.push(sh);
    }
    peer.pieces.push(piece(1, peer.shards[1].digest));
    let serve = |m: &SourceManifest| Record::Peer {
        label: "v1".into(),
        worker_id: "p".into(),
        manifest: m.clone(),
    };
    // Not registered, then not resident: refused.
    assert!(st.check(&serve(&peer)).is_err());
    st.apply(reg(Some("disk:/ckpt".into()))).unwrap();
    let e = st.check(&serve(&peer)).unwrap_err().to_string();
    assert!(e.contains("only what is resident"), "{e}");
    st.apply(reg(Some(VersionId(d).to_string()))).unwrap();
    assert_eq!(st.check(&serve(&peer)).unwrap(), Check::Apply);
    // A shard that is not a region of the record, or a piece that contradicts it: refused,
    // naming the entry.
    let mut bad = peer.clone();
    bad.shards[1].digest = Digest::of(b"torn");
    let e = st.check(&serve(&bad)).unwrap_err().to_string();
    assert!(
        e.contains("manifest.shards[1]") && e.contains("not a region"),
        "{e}"
    );
    let mut bad = peer.clone();
    bad.pieces[0].digest = Digest::of(b"other");
    let e = st.check(&serve(&bad)).unwrap_err().to_string();
    assert!(
        e.contains("manifest.pieces[0]") && e.contains("the record has"),
        "{e}"
    );
    // Served, listed; the same again changes nothing.
    st.apply(serve(&peer)).unwrap();
    let peers = st.version_info("v1").unwrap().peers;
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].worker_id, "p");
    assert_eq!(peers[0].manifest, peer);
    assert_eq!(st.check(&serve(&peer)).unwrap(), Check::Noop);
    // Withdrawn by the worker, or by its re-registration (a new process).
    let withdraw = Record::PeerWithdraw {
        worker_id: "p".into(),
        label: None,
    };
    assert_eq!(st.check(&withdraw).unwrap(), Check::Apply);
    st.apply(withdraw.clone()).unwrap();
    assert!(st.version_info("v1").unwrap().peers.is_empty());
    assert_eq!(st.check(&withdraw).unwrap(), Check::Noop);
    st.apply(serve(&peer)).unwrap();
    st.apply(reg(Some(VersionId(d).to_string()))).unwrap();
    assert!(st.version_info("v1").unwrap().peers.is_empty());
}

/// Registers worker `id` of `instance` (rank 0 of LAYOUT) with an engine reaching `addresses`,
/// reporting `resident`.
fn register_at(st: &mut State, id: &str, instance: &str, addresses: &[&str], resident: &str) {
    st.apply(Record::Register {
        worker_id: id.into(),
        instance: instance.into(),
        ranks: vec![0],
        layout: LAYOUT,
        engine: Some(EngineEndpoint {
            api: crate::refit::EngineApi::Dynamo,
            system_url: format!("http://{}", addresses[0]),
            no_model: false,
            frontend: None,
        }),
        resident_version: Some(ResidentVersion::parse(resident)),
        addresses: addresses.iter().map(|a| a.to_string()).collect(),
    })
    .unwrap();
}

fn read_back(id: &str, refit: u64, resident: &str) -> Record {
    Record::ReadBack {
        worker_id: id.into(),
        refit,
        resident_version: Some(ResidentVersion::parse(resident)),
        at_ms: 0,
    }
}

#[test]
fn an_engine_another_workers_refit_reached_is_read_back_before_its_worker_is_trusted() {
    // Issue 29, item 1: a refit of worker x reached b's engine (x registered it under another
    // spelling while b was away); b reported what it believed and stayed admitted.
    let (mut st, d1) = ready_state();
    let v1 = VersionId(d1).to_string();
    st.apply(begin(&st, d1)).unwrap();
    commit(&mut st, 1, &["a", "b"], &v1);
    register_at(&mut st, "b", "b", &["loopback:7711"], &v1);
    register_at(&mut st, "c", "c", &["loopback:7712"], &v1);
    register_at(&mut st, "x", "x", &["10.0.0.9:80", "loopback:7711"], &v1);
    assert!(["a", "b", "c", "x"].iter().all(|w| st.worker_admitted(w)));
    let d2 = second_version(&mut st, "v2");
    let v2 = VersionId(d2).to_string();
    st.apply(begin_on(&st, "v2", d2, &[("x", Some(&v1))]))
        .unwrap();
    // b shares x's engine: gated from BEGIN; a (no address known) and c (another engine) not.
    let b = worker(&st, "b");
    assert!(
        !b.admitted
            && b.admission
                .contains("refit 2 called the engine of worker x")
            && b.admission.contains("loopback:7711")
            && b.admission.contains("once the refit ends"),
        "{}",
        b.admission
    );
    assert!(st.worker_admitted("a") && st.worker_admitted("c"));
    // Not while the refit runs: what the engine holds may still change.
    let err = st.check(&read_back("b", 2, &v2)).unwrap_err().to_string();
    assert!(err.contains("still open"), "{err}");
    assert!(st.read_backs_due(None).is_empty());
    commit(&mut st, 2, &["x"], &v2);
    assert_eq!(st.read_backs_due(None), vec![("b".to_string(), 2)]);
    assert_eq!(st.read_backs_due(Some(1)), vec![]);
    // What b reports when it registers again is not what its engine was shown to hold.
    register_at(&mut st, "b", "b", &["loopback:7711"], &v1);
    let b = worker(&st, "b");
    assert!(
        !b.admitted && b.admission.contains("when the worker registers again"),
        "{}",
        b.admission
    );
    // The engine's own answer decides: it holds v2, the fleet's version.
    st.apply(read_back("b", 2, &v2)).unwrap();
    assert!(st.worker_admitted("b"), "{}", worker(&st, "b").admission);
    assert_eq!(
        worker(&st, "b").resident_id,
        Some(ResidentVersion::parse(&v2))
    );
    assert!(st.read_backs_due(None).is_empty());
    // A read-back of a mark that is gone changes nothing.
    assert_eq!(st.check(&read_back("b", 2, &v1)).unwrap(), Check::Noop);
    // Another refit of x: b is gated again; an engine answering another version than the
    // fleet's leaves b stale, not admitted.
    st.apply(begin_on(&st, "v2", d2, &[("x", Some(&v2))]))
        .unwrap();
    st.apply(phase(3, Phase::Abort)).unwrap();
    st.apply(end(3, Outcome::Aborted, &[])).unwrap();
    st.apply(read_back("b", 3, &v1)).unwrap();
    let b = worker(&st, "b");
    assert!(
        !b.admitted && b.admission.contains("stale") && b.admission.contains(&v1),
        "{}",
        b.admission
    );
    // A refit of b itself that commits settles it (its VERIFY read its engine back).
    st.apply(begin_on(&st, "v2", d2, &[("b", Some(&v1))]))
        .unwrap();
    commit(&mut st, 4, &["b"], &v2);
    assert!(st.worker_admitted("b"), "{}", worker(&st, "b").admission);
    // Registering another engine drops the mark: the engine the refit reached is not b's.
    st.apply(begin_on(&st, "v2", d2, &[("x", Some(&v2))]))
        .unwrap();
    st.apply(phase(5, Phase::Abort)).unwrap();
    st.apply(end(5, Outcome::Aborted, &[])).unwrap();
    assert!(!st.worker_admitted("b"));
    register_at(&mut st, "b", "b", &["loopback:7799"], &v2);
    assert!(st.worker_admitted("b"), "{}", worker(&st, "b").admission);
    // Replayed from a snapshot, the marks are the same.
    st.apply(begin_on(&st, "v2", d2, &[("x", Some(&v2))]))
        .unwrap();
    let json = serde_json::to_string(&st).unwrap();
    let back: State = serde_json::from_str(&json).unwrap();
    assert_eq!(back, st);
}

#[test]
fn a_versions_expected_outputs_are_published_once_and_checked() {
    let (mut st, _) = ready_state();
    let outputs = |tokens: Vec<u32>| crate::check::GenerationCheck {
        probes: vec![crate::check::Probe {
            prompt_tokens: vec![1, 2],
            margins: vec![1.5; tokens.len()],
            tokens,
            logprobs: Vec::new(),
        }],
        max_new_tokens: 2,
        tie_margin: 0.25,
        source: String::new(),
    };
    let rec = |label: &str, o| Record::ExpectedOutputs {
        label: label.into(),
        outputs: o,
    };
    assert!(st.check(&rec("nope", outputs(vec![3, 4]))).is_err());
    let mut bad = outputs(vec![3, 4]);
    bad.probes[0].margins.pop();
    let e = st.check(&rec("v1", bad)).unwrap_err().to_string();
    assert!(e.contains("outputs.probes[0].margins"), "{e}");
    st.apply(rec("v1", outputs(vec![3, 4]))).unwrap();
    assert_eq!(st.expected_outputs("v1"), Some(&outputs(vec![3, 4])));
    assert_eq!(
        st.version_info("v1").unwrap().expected_outputs,
        Some(outputs(vec![3, 4]))
    );
    // The same again changes nothing; others are refused: a version's outputs do not change.
    assert_eq!(
        st.check(&rec("v1", outputs(vec![3, 4]))).unwrap(),
        Check::Noop
    );
    let e = st
        .check(&rec("v1", outputs(vec![3, 5])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already published"), "{e}");
    // A snapshot keeps them.
    let back: State = serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
    assert_eq!(back, st);
}
