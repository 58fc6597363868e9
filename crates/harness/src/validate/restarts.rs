//! Scenarios of `mx-lab validate` in which a worker's engine changes under the control plane: a
//! process restarted (empty) during APPLY or PREPARE, and weights loaded from disk behind its
//! back. Each returns (expected, observed, passed, detail) like the rows of the matrix.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mx_adapters::dynamo::wire::UpdateWeightsRequest;
use mx_control::{Action, Outcome, Refit};
use serde_json::json;

use super::{holds, outcome_str, s, Fleet};
use mx_cli::refits::{print_refit, wait_end};

/// Polls refit `id` until `ready` holds for it (or it ended, or a minute passed).
pub(super) async fn wait_refit_until(
    f: &Fleet,
    id: u64,
    what: &str,
    ready: impl Fn(&Refit) -> bool,
) -> anyhow::Result<Refit> {
    let t = Instant::now();
    loop {
        if let Ok((_, Some(r))) = f.client.wait_refit(id, Duration::from_millis(50)).await {
            if ready(&r) {
                return Ok(r);
            }
            if r.outcome.is_some() {
                bail!(
                    "refit {id} ended ({}) before {what}: {}",
                    r.outcome.map(|o| o.to_string()).unwrap_or_default(),
                    r.reason
                );
            }
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("refit {id}: {what} did not happen within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGKILLs worker `id` and starts it again empty, as a supervisor would; returns once the new
/// process registered.
pub(super) async fn restart_worker(f: &mut Fleet, id: &str) -> anyhow::Result<()> {
    let name = format!("worker-{id}");
    f.procs.kill(&name)?;
    let a = f.worker_args(id, false);
    let work = f.work.clone();
    f.procs.spawn(&name, &work, &a)?;
    f.wait_registered(id).await
}

/// `update_weights_from_disk` of the checkpoint on worker `id`'s Dynamo route, resident as
/// `weight_version`, inside a `pause_generation` / `resume_generation` (Dynamo refuses an
/// update of a worker that is not paused): whether the update answered `status: "ok"`, and
/// its body (Dynamo answers HTTP 200 either way).
async fn disk_load(f: &Fleet, id: &str, weight_version: &str) -> anyhow::Result<(bool, String)> {
    let base = f.system_url(id).await?;
    let route = |r: &str| format!("{base}/engine/{r}");
    f.http
        .post(route("pause_generation"))
        .json(&serde_json::json!({}))
        .send()
        .await?
        .error_for_status()?;
    let body = UpdateWeightsRequest {
        model_path: Some(f.model.display().to_string()),
        weight_version: Some(weight_version.to_string()),
    };
    let r = f
        .http
        .post(route("update_weights_from_disk"))
        .json(&body)
        .send()
        .await?;
    let (status, text) = (r.status().as_u16(), r.text().await?);
    f.http
        .post(route("resume_generation"))
        .json(&serde_json::json!({}))
        .send()
        .await?
        .error_for_status()?;
    let ok = status == 200
        && serde_json::from_str::<mx_adapters::dynamo::wire::EngineResponse>(&text)
            .is_ok_and(|a| a.status == mx_adapters::dynamo::wire::ReplyStatus::Ok);
    Ok((ok, text))
}

/// w0 is killed while it applies step-1 and comes back empty: its pinned step-2 is gone, so the
/// rollback stages step-2 again from the publishers (which still serve it) and applies it.
pub(super) async fn worker_restarted_during_apply(
    f: &mut Fleet,
) -> anyhow::Result<(String, String, bool, String)> {
    f.ensure("step-2").await?;
    f.failpoints("w0", json!({"apply.sleep_ms": 5_000})).await?;
    let id = f.client.refit(&f.spec_on("step-1", &["w0"])?).await?;
    wait_refit_until(f, id, "w0's apply in flight", |r| {
        r.workers["w0"]
            .calls
            .last()
            .is_some_and(|c| matches!(c.action, Action::Apply { .. }) && c.result.is_none())
    })
    .await?;
    let t = Instant::now();
    restart_worker(f, "w0").await?;
    let r = wait_end(&f.client, id, Duration::from_secs(300)).await?;
    let secs = t.elapsed().as_secs_f64();
    print_refit(&r);
    let staged_again = r.workers["w0"].calls.iter().filter(|c| matches!(&c.action, Action::Apply { version } if version.to_string() == f.versions["step-2"].0)).count();
    let ok = r.outcome == Some(Outcome::RolledBack)
        && holds(&r.workers["w0"].resident, &f.versions["step-2"].0)
        && staged_again >= 1;
    Ok((
        s("ROLLED_BACK: w0 staged step-2 again from its sources, all on step-2"),
        format!("{} {secs:.1} s after the kill", outcome_str(&r)),
        ok,
        r.reason.clone(),
    ))
}

/// An engine's weights changed behind the control plane: a disk load carrying an `mx:` version
/// is refused; one under its own label is taken, and the refit of the committed version (verify
/// only) reads it back, ABORTS and leaves w0 gated; a real refit then brings it back.
pub(super) async fn engine_changed(
    f: &mut Fleet,
) -> anyhow::Result<(String, String, bool, String)> {
    f.ensure("step-2").await?;
    let v2 = f.versions["step-2"].0.clone();
    let (claimed, body) = disk_load(f, "w0", &v2).await?;
    let refused = !claimed && body.contains("weight_version");
    let (plain, _) = disk_load(f, "w0", "disk:behind-the-back").await?;
    let r = f.refit("step-2").await?;
    print_refit(&r);
    let st = f.status().await?;
    let w0 = st
        .workers
        .iter()
        .find(|w| w.worker_id == "w0")
        .context("w0")?;
    let gated = !w0.admitted && w0.admission.contains("disk:behind-the-back");
    let again = f.refit("step-2").await?;
    let ok = refused
        && plain
        && r.outcome == Some(Outcome::Aborted)
        && r.reason.contains("disk:behind-the-back")
        && gated
        && again.outcome == Some(Outcome::Committed);
    Ok((
        s("mx: disk load refused (status error); verify-only refit ABORTED naming w0's real version, w0 gated; then COMMITTED"),
        format!(
            "mx: load ok {claimed}, plain load ok {plain}; verify-only {}; w0 gated {gated}; refit again {}",
            outcome_str(&r),
            outcome_str(&again)
        ),
        ok,
        r.reason.clone(),
    ))
}

/// w0 answers its pause and is then killed and restarted (empty) while w1 is still pausing: the
/// refit ABORTS before APPLY instead of driving w0 through APPLY and fencing it.
pub(super) async fn worker_restarted_during_prepare(
    f: &mut Fleet,
) -> anyhow::Result<(String, String, bool, String)> {
    f.ensure("step-2").await?;
    // w0 off the fleet version (a disk load, learned by a verify-only refit that aborts), so
    // the refit of step-2 is a real one.
    disk_load(f, "w0", "disk:prepare").await?;
    let learn = f.refit("step-2").await?;
    if learn.outcome != Some(Outcome::Aborted) {
        bail!(
            "the verify-only refit did not notice w0's disk load: {}",
            outcome_str(&learn)
        );
    }
    f.failpoints("w1", json!({"pause.sleep_ms": 8_000})).await?;
    let id = f.client.refit(&f.spec("step-2")?).await?;
    wait_refit_until(f, id, "w0 paused", |r| {
        r.phase == mx_control::Phase::Prepare
            && r.workers["w0"]
                .calls
                .iter()
                .any(|c| c.action == Action::Pause && c.result.as_ref().is_some_and(|x| x.ok))
    })
    .await?;
    let t = Instant::now();
    restart_worker(f, "w0").await?;
    let r = wait_end(&f.client, id, Duration::from_secs(300)).await?;
    let secs = t.elapsed().as_secs_f64();
    print_refit(&r);
    let applied = r.past_no_return();
    let again = f.refit("step-2").await?;
    let ok = r.outcome == Some(Outcome::Aborted)
        && !applied
        && r.reason.contains("registered again")
        && again.outcome == Some(Outcome::Committed);
    Ok((
        s("ABORTED before APPLY (w0 registered again), not FENCED; then COMMITTED"),
        format!(
            "{} {secs:.1} s after the kill, applied: {applied}; refit again {}",
            outcome_str(&r),
            outcome_str(&again)
        ),
        ok,
        r.reason.clone(),
    ))
}

/// A worker restarted empty (no version before the refit) in a refit that fails past APPLY: it
/// has nothing to go back to, so the rollback reads its version back and resumes it (it is not
/// admitted off the committed version anyway) instead of retrying until the deadline and
/// fencing it, as it did before (FENCED after 60-70 s, on every later failing refit).
pub(super) async fn empty_worker_in_a_failed_refit(
    f: &mut Fleet,
) -> anyhow::Result<(String, String, bool, String)> {
    f.ensure("step-2").await?;
    // w0 to step-1 alone (it holds step-1 pinned), so the refit of both to step-2 changes it.
    let r = f.refit_on("step-1", &["w0"]).await?;
    if r.outcome != Some(Outcome::Committed) {
        bail!("refit of w0 to step-1 did not commit: {}", r.reason);
    }
    restart_worker(f, "w1").await?;
    f.failpoints("w1", json!({"generate.fail": true})).await?;
    let t = Instant::now();
    let r = f.refit("step-2").await?;
    let secs = t.elapsed().as_secs_f64();
    print_refit(&r);
    f.failpoints("w1", json!({"generate.fail": null})).await?;
    let w0_back = holds(&r.workers["w0"].resident, &f.versions["step-1"].0);
    // w1's rollback: one read-back and one resume, both answered (no retry until a deadline).
    let w1_rollback: Vec<String> = r.workers["w1"]
        .calls
        .iter()
        .filter(|c| c.phase == mx_control::Phase::Rollback)
        .map(|c| format!("{}:{}", c.action, c.result.as_ref().is_some_and(|x| x.ok)))
        .collect();
    let settled_once = w1_rollback == ["read_version:true", "resume:true"];
    // Bring the fleet to one version again.
    let again = f.refit("step-2").await?;
    let ok = r.outcome == Some(Outcome::RolledBack)
        && w0_back
        && settled_once
        && again.outcome == Some(Outcome::Committed);
    Ok((
        s("ROLLED_BACK within seconds: w0 back on step-1, w1 (empty before) read back, not FENCED; then COMMITTED"),
        format!(
            "{} in {secs:.1} s, w0 back on step-1: {w0_back}, w1's rollback calls {w1_rollback:?}; refit again {}",
            outcome_str(&r),
            outcome_str(&again)
        ),
        ok,
        r.reason.clone(),
    ))
}

/// A refit of the committed version (verify-only) whose post-update generation fails on w1: w1
/// reports the version but cannot be trusted with it, so it is FENCED (gated) while w0 stays
/// admitted; once its generation works again, the next refit of the version verifies it, commits
/// and lifts the fence.
pub(super) async fn verify_only_check_fails(
    f: &mut Fleet,
) -> anyhow::Result<(String, String, bool, String)> {
    f.ensure("step-2").await?;
    f.failpoints("w1", json!({"generate.fail": true})).await?;
    let r = f.refit("step-2").await?;
    print_refit(&r);
    f.failpoints("w1", json!({"generate.fail": null})).await?;
    let st = f.status().await?;
    let admitted = |id: &str| {
        st.workers
            .iter()
            .find(|w| w.worker_id == id)
            .map(|w| (w.admitted, w.admission.clone()))
    };
    let (w0, w1) = (admitted("w0").context("w0")?, admitted("w1").context("w1")?);
    let again = f.refit("step-2").await?;
    let st = f.status().await?;
    let all_admitted = st.workers.iter().all(|w| w.admitted);
    let ok = r.outcome == Some(Outcome::Fenced)
        && !r.past_no_return()
        && w0.0
        && !w1.0
        && w1.1.contains("fenced")
        && again.outcome == Some(Outcome::Committed)
        && all_admitted;
    Ok((
        s("FENCED w1 only (nothing applied), w0 admitted; then verify-only COMMITTED, both admitted"),
        format!(
            "{}; w0 admitted {}, w1 admitted {} ({}); refit again {}, all admitted {all_admitted}",
            outcome_str(&r),
            w0.0,
            w1.0,
            w1.1,
            outcome_str(&again)
        ),
        ok,
        r.reason.clone(),
    ))
}
