//! `mx-lab validate --chaos N --seed S`: N refits in a row against the embedded fleet, each with a
//! SIGKILL of one randomly chosen process (the control plane, a worker, a publisher) at a random
//! moment, restarted at once as a supervisor would. After every refit the lifecycle's promises
//! are checked from the engines themselves, never from the control plane's word alone:
//!
//! - every admitted worker serves the committed version: its engine reports that version (Dynamo
//!   `get_weight_version`; SGLang has no read-back) and its greedy generation equals the golden
//!   tokens of that version, computed from the checkpoint outside the workers' path;
//! - the refit ended within its deadline bound (no refit stays open);
//! - the journal on disk replays to the state the control plane serves (fleet version, every
//!   worker's resident version, the refit's outcome) and the refit's record is complete;
//! - the fleet is back to at least one admitted worker within [`RECOVERY_BOUND`] of the kill.
//!
//! The victim is chosen uniformly; the kill comes uniformly within 1.2x the duration of the last
//! committed refit after the refit starts, so most kills land inside a refit.
//!
//! The fleet runs [`super::Sources::EachVersionServed`]: step-1 and step-2 stay pullable from
//! their own publishers, so a worker restarted empty can be brought to either and FENCED is
//! expected only while V-1's publishers are themselves down. Each refit targets the version the
//! fleet has not committed, so every refit changes weights.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_control::{EngineApi, Refit};
use serde::Serialize;
use serde_json::json;

use super::{connect, next_refit_id, s, Fleet, WORKERS};
use crate::fleet::WorkDir;
use mx_cli::refits::{print_refit, wait_end};

/// Longest a fleet may take, from the kill, to have an admitted worker again.
const RECOVERY_BOUND: Duration = Duration::from_secs(90);
/// The kill comes uniformly within this share of the last refit's duration (BEGIN to END),
/// in percent: most kills land inside a refit, in every phase, and some after it.
const KILL_WINDOW_PERCENT: u64 = 120;
/// The refit duration assumed before one was measured, in milliseconds.
const FIRST_REFIT_MS: u64 = 1_000;

/// A small deterministic generator (SplitMix64): the same seed gives the same schedule.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One refit of the run, as reported.
#[derive(Debug, Clone, Serialize)]
struct Round {
    round: u32,
    target: String,
    victim: String,
    kill_delay_ms: u64,
    refit: Option<u64>,
    outcome: String,
    reason: String,
    /// BEGIN to END, from the refit's record.
    refit_seconds: f64,
    /// The kill came before the refit's END (otherwise between refits).
    killed_during_refit: bool,
    recovery_seconds: f64,
    violations: Vec<String>,
}

/// Runs the chaos loop on a started fleet and reports; fails when any invariant was violated.
pub(super) async fn run(
    mut f: Fleet,
    work: &WorkDir,
    n: u32,
    seed: u64,
    report: Option<&Path>,
) -> anyhow::Result<()> {
    let mut rng = SplitMix(seed);
    let mut victims: Vec<String> = vec![s("control")];
    victims.extend(WORKERS.iter().map(|w| format!("worker-{w}")));
    victims.extend(f.publishers.iter().map(|(name, _)| name.clone()));
    let mut rounds = Vec::new();
    let mut outcomes: BTreeMap<&'static str, u32> = [
        ("committed", 0),
        ("aborted", 0),
        ("rolled_back", 0),
        ("fenced", 0),
        ("refused", 0),
    ]
    .into_iter()
    .collect();
    let mut last_refit_ms = FIRST_REFIT_MS;
    for round in 1..=n {
        let victim = victims[rng.below(victims.len() as u64) as usize].clone();
        let delay = rng.below(last_refit_ms * KILL_WINDOW_PERCENT / 100 + 1);
        let r = one_round(&mut f, round, &victim, delay).await?;
        if r.outcome == "COMMITTED" {
            last_refit_ms = (r.refit_seconds * 1e3) as u64;
        }
        let key = match r.outcome.as_str() {
            "COMMITTED" => "committed",
            "ABORTED" => "aborted",
            "ROLLED_BACK" => "rolled_back",
            "FENCED" => "fenced",
            _ => "refused",
        };
        *outcomes.entry(key).or_default() += 1;
        eprintln!(
            "chaos {round}/{n}: refit {:?} to {} with {} killed after {} ms ({}): {} ({:.1} s, recovered in {:.1} s){}",
            r.refit,
            r.target,
            r.victim,
            r.kill_delay_ms,
            if r.killed_during_refit {
                "during the refit"
            } else {
                "after its end"
            },
            r.outcome,
            r.refit_seconds,
            r.recovery_seconds,
            if r.violations.is_empty() {
                String::new()
            } else {
                format!("; VIOLATIONS: {}", r.violations.join("; "))
            }
        );
        rounds.push(r);
    }
    let violations: Vec<String> = rounds
        .iter()
        .flat_map(|r| {
            r.violations
                .iter()
                .map(move |v| format!("round {}: {v}", r.round))
        })
        .collect();
    let during = rounds.iter().filter(|r| r.killed_during_refit).count();
    let recovery_max = rounds
        .iter()
        .map(|r| r.recovery_seconds)
        .fold(0.0f64, f64::max);
    println!(
        "chaos: {n} refits, seed {seed}, {during} kills during a refit: {} committed, {} aborted, {} rolled back, {} fenced, {} refused; {} invariant violations; recovery at most {recovery_max:.1} s",
        outcomes["committed"],
        outcomes["aborted"],
        outcomes["rolled_back"],
        outcomes["fenced"],
        outcomes["refused"],
        violations.len()
    );
    if let Some(p) = report {
        let doc = json!({
            "passed": violations.is_empty(),
            "chaos": {
                "refits": n,
                "seed": seed,
                "outcomes": outcomes,
                "invariant_violations": violations,
                "recovery_seconds_max": recovery_max,
                "kills_during_refit": during,
                "rounds": rounds,
            },
            "versions": f.versions.iter().map(|(l, (id, g))| json!({"label": l, "version": id, "golden_tokens": g})).collect::<Vec<_>>(),
        });
        mx_cli::report::write_report(p, &doc)?;
    }
    if let Some(v) = violations.first() {
        bail!(
            "{} invariant violations, the first: {v} (logs in {}{})",
            violations.len(),
            work.path.display(),
            if work.keep {
                ""
            } else {
                ", pass --keep to keep them"
            }
        );
    }
    Ok(())
}

/// One refit with one kill; the invariants checked after it.
async fn one_round(f: &mut Fleet, round: u32, victim: &str, delay: u64) -> anyhow::Result<Round> {
    let status = f.status().await?;
    let target = match status.fleet_version.as_ref().map(|f| f.label.as_str()) {
        Some("step-1") => "step-2",
        _ => "step-1",
    };
    let first_id = next_refit_id(f).await?;
    let spec = f.spec(target)?;
    let t0 = Instant::now();
    let started = f.client.refit(&spec).await;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let killed_at = Instant::now();
    let killed_ms = mx_control::refit::now_ms();
    kill_and_restart(f, victim).await?;
    // The refit id: the answer, or (the control plane died before it answered) the journal.
    let id = match started {
        Ok(id) => Some(id),
        Err(e) => {
            let next = next_refit_id(f).await?;
            if next > first_id {
                Some(first_id)
            } else {
                tracing::info!("chaos round {round}: refit refused: {e}");
                None
            }
        }
    };
    let mut violations = Vec::new();
    let bound = deadline_bound(&spec);
    let refit = match id {
        Some(id) => match wait_end(&f.client, id, bound).await {
            Ok(r) => Some(r),
            Err(e) => {
                violations.push(format!("refit {id} still open after {bound:?}: {e:#}"));
                None
            }
        },
        None => None,
    };
    let (refit_seconds, killed_during_refit) = match &refit {
        Some(r) => {
            print_refit(r);
            let end = r.ended_ms.unwrap_or(u64::MAX);
            (
                end.saturating_sub(r.started_ms) as f64 / 1e3,
                killed_ms < end,
            )
        }
        None => (t0.elapsed().as_secs_f64(), true),
    };
    let recovery = recover(f, killed_at).await;
    let recovery_seconds = match recovery {
        Ok(d) => d.as_secs_f64(),
        Err(e) => {
            violations.push(format!("{e:#}"));
            killed_at.elapsed().as_secs_f64()
        }
    };
    violations.extend(check_engines(f).await?);
    violations.extend(check_journal(f, refit.as_ref()).await?);
    Ok(Round {
        round,
        target: s(target),
        victim: s(victim),
        kill_delay_ms: delay,
        refit: id,
        outcome: refit
            .as_ref()
            .and_then(|r| r.outcome)
            .map_or_else(|| s("REFUSED"), |o| o.to_string()),
        reason: refit.as_ref().map(|r| r.reason.clone()).unwrap_or_default(),
        refit_seconds,
        killed_during_refit,
        recovery_seconds,
        violations,
    })
}

/// The longest a refit of `spec` may stay open, killed control plane included: STAGE, one call
/// deadline per later phase, the rollback deadline, a departure grace and a restart.
fn deadline_bound(spec: &mx_control::RefitSpec) -> Duration {
    let call = Duration::from_millis(spec.call_timeout_ms);
    Duration::from_millis(spec.stage_timeout_ms)
        + call * 5
        + (call * 4).max(Duration::from_secs(30))
        + Duration::from_secs(10 + 30)
}

/// SIGKILLs `victim` and starts it again with the arguments it started with.
async fn kill_and_restart(f: &mut Fleet, victim: &str) -> anyhow::Result<()> {
    let work = f.work.clone();
    f.procs.kill(victim)?;
    if victim == "control" {
        let args = f.control_args();
        f.procs.spawn_env("control", &work, &args, &[])?;
        f.client = connect(&f.control, Duration::from_secs(30)).await?;
    } else if let Some(w) = victim.strip_prefix("worker-") {
        let args = f.worker_args(w, false);
        f.procs.spawn_env(victim, &work, &args, &[])?;
    } else {
        let args = f
            .publishers
            .iter()
            .find(|(name, _)| name == victim)
            .map(|(_, a)| a.clone())
            .with_context(|| format!("no publisher {victim}"))?;
        f.procs.spawn_env(victim, &work, &args, &[])?;
    }
    Ok(())
}

/// Waits until every worker is registered and connected again and at least one is admitted;
/// the time since the kill.
async fn recover(f: &Fleet, killed_at: Instant) -> anyhow::Result<Duration> {
    loop {
        if let Ok(st) = f.client.get_status().await {
            let all_back = WORKERS
                .iter()
                .all(|w| st.workers.iter().any(|x| x.worker_id == *w && x.connected));
            if all_back && st.workers.iter().any(|w| w.admitted) {
                return Ok(killed_at.elapsed());
            }
        }
        if killed_at.elapsed() > RECOVERY_BOUND {
            bail!("no admitted worker (or a worker not back) {RECOVERY_BOUND:?} after the kill");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every admitted worker serves the committed version: asked from its engine (version read
/// back where the contract has one, greedy generation against the golden tokens always).
async fn check_engines(f: &Fleet) -> anyhow::Result<Vec<String>> {
    let st = f.status().await?;
    let mut out = Vec::new();
    let Some(mx_control::FleetVersion {
        label,
        version_id: fleet,
    }) = st.fleet_version.clone()
    else {
        if st.workers.iter().any(|w| w.admitted) {
            out.push(s(
                "a worker is admitted while the fleet has committed no version",
            ));
        }
        return Ok(out);
    };
    let golden = &f.versions.get(&label).context("fleet version label")?.1;
    for w in st.workers.iter().filter(|w| w.admitted) {
        let e = w.engine.as_ref().context("engine of an admitted worker")?;
        if e.api == EngineApi::Dynamo {
            let v = mx_adapters::dynamo::DynamoWorkerClient::new(
                &e.system_url,
                Duration::from_secs(30),
            )
            .get_weight_version()
            .await
            .unwrap_or_else(|err| format!("(error: {err})"));
            if v != fleet.to_string() {
                out.push(format!(
                    "admitted worker {} reports {v}, the fleet committed {label} ({fleet})",
                    w.worker_id
                ));
            }
        }
        match f.rollout(&w.worker_id).await {
            Ok(tokens) if tokens == *golden => {}
            Ok(tokens) => out.push(format!(
                "admitted worker {} generates {tokens:?}, not the golden tokens {golden:?} of {label}",
                w.worker_id
            )),
            Err(err) => out.push(format!(
                "admitted worker {} cannot generate: {err:#}",
                w.worker_id
            )),
        }
    }
    Ok(out)
}

/// The journal on disk replays to the state the control plane serves, and the refit's record is
/// complete.
async fn check_journal(f: &Fleet, refit: Option<&Refit>) -> anyhow::Result<Vec<String>> {
    let live = f.status().await?;
    let st = mx_control::journal::load_state(&f.journal)?;
    let replayed = st.fleet_status();
    let mut out = Vec::new();
    if replayed.fleet_version != live.fleet_version {
        out.push(format!(
            "journal replays to fleet version {:?}, the control plane serves {:?}",
            replayed.fleet_version, live.fleet_version
        ));
    }
    for w in &live.workers {
        let again = replayed.workers.iter().find(|x| x.worker_id == w.worker_id);
        if again.map(|x| &x.resident_id) != Some(&w.resident_id) {
            out.push(format!(
                "journal replays worker {} resident as {:?}, the control plane serves {:?}",
                w.worker_id,
                again.map(|x| &x.resident_id),
                w.resident_id
            ));
        }
    }
    if let Some(r) = refit {
        match st.refit(r.id) {
            None => out.push(format!("refit {} is not in the journal", r.id)),
            Some(j) => {
                if j.outcome != r.outcome {
                    out.push(format!(
                        "journal replays refit {} as {:?}, the control plane served {:?}",
                        r.id, j.outcome, r.outcome
                    ));
                }
                out.extend(j.journal_gaps());
            }
        }
    }
    Ok(out)
}
