//! The refit driver: sequences one refit's phases and engine calls, journaling each step before
//! it acts (see [`crate::refit`] for the lifecycle). One driver task runs per open refit; a
//! restarted control plane starts one for the refit its journal left open, and that driver first
//! settles every call whose result was never journaled, then finishes (after the COMMIT
//! decision) or rolls back (before it) — it never assumes what a call did.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mx_adapters::generate::Generation;
use mx_adapters::{client_for, Answer, EngineClient};
use mx_layout::{ResidentVersion, VersionId};

use crate::check::GenerationCheck;
use crate::observe;
use crate::record::{WorkerResult, MAX_BATCH_WORKERS};
use crate::refit::{
    now_ms, Action, CallResult, EngineApi, EngineEndpoint, Outcome, Phase, Refit, RefitSpec,
};
use crate::shared::Shared;
use crate::state::Record;
use crate::types::WorkerState;
use crate::Error;

/// The result a recovered control plane journals for a call it died during.
const CALL_LOST_IN_RESTART: &str =
    "the control plane died during this call; its effect is unknown and is read back";

/// The reason PREPARE and RESUME record when the orchestrator holds the safe point.
const GATED: &str = "orchestrator-gated: no engine pause/resume calls";

/// How long a rollback keeps retrying a worker before it is fenced, at least.
const MIN_ROLLBACK_DEADLINE: Duration = Duration::from_secs(30);
/// First and longest pause between a rollback's or abort's attempts to settle one worker.
const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(250);
const SETTLE_RETRY_MAX: Duration = Duration::from_secs(4);
/// How long a worker whose command stream closed may take to register again (a supervisor
/// restarting it) before a rollback or abort records it as departed instead of waiting out the
/// deadline: a process that is gone serves nothing, and it is gated until it registers again.
const DEPARTURE_GRACE: Duration = Duration::from_secs(10);

fn failed(e: impl std::fmt::Display) -> CallResult {
    CallResult {
        ok: false,
        error: e.to_string(),
        ..CallResult::default()
    }
}

/// A successful call with the engine's `message`.
fn done(message: impl Into<String>) -> CallResult {
    CallResult {
        ok: true,
        message: message.into(),
        ..CallResult::default()
    }
}

/// The result of a post-update generation the refit did not ask for.
fn no_check() -> CallResult {
    done("no check requested")
}

/// The post-update generation: every probe of `check` in turn on `engine`, each judged by the
/// rule of `crate::check` (`label`: the target version, for messages). The result holds the
/// tokens of the first probe that failed, else of the first probe.
async fn check_generations(
    engine: &dyn EngineClient,
    check: &GenerationCheck,
    label: &str,
) -> CallResult {
    use crate::check::{judge, Judged};
    let mut result = CallResult {
        ok: true,
        ..CallResult::default()
    };
    let (mut exact, mut ties, mut unchecked) = (0usize, Vec::new(), 0usize);
    for (i, probe) in check.probes.iter().enumerate() {
        let g: Generation = match engine
            .generate(&probe.prompt_tokens, check.max_new_tokens)
            .await
        {
            Ok(g) => g,
            Err(e) => return failed(format!("probe {i}: {e}")),
        };
        if i == 0 {
            result.tokens.clone_from(&g.output_ids);
            result.version = g.weight_version.clone();
        }
        match judge(probe, &g.output_ids, check.tie_margin) {
            Ok(Judged::Exact) => exact += 1,
            Ok(Judged::NearTie { position, margin }) => {
                ties.push(format!(
                    "probe {i} at token {position} (margin {margin:.3})"
                ));
            }
            Ok(Judged::Generated) => unchecked += 1,
            Err(why) => {
                let of = if check.source.is_empty() {
                    format!("expected of {label}")
                } else {
                    format!("expected of {label}, {}", check.source)
                };
                metrics::counter!(observe::VERIFICATION_FAILURES_TOTAL, "check" => "generation")
                    .increment(1);
                return CallResult {
                    tokens: g.output_ids.clone(),
                    version: g.weight_version,
                    ..failed(format!(
                        "post-update generation of probe {i}: {why}: gave {:?}, {of}: {:?}",
                        g.output_ids, probe.tokens
                    ))
                };
            }
        }
    }
    let mut parts = Vec::new();
    if exact > 0 {
        parts.push(format!("{exact} exact"));
    }
    if !ties.is_empty() {
        parts.push(format!("near-ties tolerated: {}", ties.join(", ")));
    }
    if unchecked > 0 {
        parts.push(format!(
            "{unchecked} without expected tokens (tokens returned)"
        ));
    }
    result.message = format!("{} probes: {}", check.probes.len(), parts.join("; "));
    result
}

/// One engine call made on behalf of `workers`: the workers (tensor-parallel ranks, each its own
/// process) that share one engine endpoint get one call, since the engine acts for all of them.
struct EngineCall {
    workers: Vec<String>,
    action: Action,
    endpoint: Option<EngineEndpoint>,
}

/// The intents of `calls` as journal records: one [`Record::WorkerCalls`] per action (in the
/// order of its first call), each of at most [`MAX_BATCH_WORKERS`] workers.
fn batch_intents(id: u64, calls: &[EngineCall]) -> Vec<Record> {
    let mut by_action: Vec<(Action, Vec<String>)> = Vec::new();
    for c in calls {
        match by_action.iter_mut().find(|(a, _)| *a == c.action) {
            Some((_, ws)) => ws.extend(c.workers.iter().cloned()),
            None => by_action.push((c.action.clone(), c.workers.clone())),
        }
    }
    by_action
        .into_iter()
        .flat_map(|(action, ws)| {
            ws.chunks(MAX_BATCH_WORKERS)
                .map(|chunk| Record::WorkerCalls {
                    id,
                    action: action.clone(),
                    worker_ids: chunk.to_vec(),
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The results in `done` as journal records: [`Record::WorkerResults`] of at most
/// [`MAX_BATCH_WORKERS`] workers each.
fn batch_results(id: u64, done: &[(String, CallResult)]) -> Vec<Record> {
    done.chunks(MAX_BATCH_WORKERS)
        .map(|chunk| Record::WorkerResults {
            id,
            results: chunk
                .iter()
                .map(|(w, result)| WorkerResult {
                    worker_id: w.clone(),
                    result: result.clone(),
                })
                .collect(),
        })
        .collect()
}

/// Groups `calls` (with each worker's endpoint) so that workers with the same endpoint and
/// action make one [`EngineCall`], in the order of each group's first call.
fn group_by_engine(
    calls: Vec<(String, Action)>,
    endpoints: Vec<Option<EngineEndpoint>>,
) -> Vec<EngineCall> {
    let mut out: Vec<EngineCall> = Vec::with_capacity(calls.len());
    let mut index: std::collections::HashMap<(String, String), usize> = Default::default();
    for ((w, action), endpoint) in calls.into_iter().zip(endpoints) {
        if let Some(ep) = &endpoint {
            let key = (ep.system_url.clone(), action.to_string());
            if let Some(&i) = index.get(&key) {
                if out[i].endpoint.as_ref() == Some(ep) && out[i].action == action {
                    out[i].workers.push(w);
                    continue;
                }
            }
            index.insert(key, out.len());
        }
        out.push(EngineCall {
            workers: vec![w],
            action,
            endpoint,
        });
    }
    out
}

/// What a pause, read-back or resume answered: its version (resume: only its message).
/// A resident version for a message: `none` when there is none.
fn shown(v: Option<&ResidentVersion>) -> String {
    v.map_or_else(|| "none".into(), ToString::to_string)
}

fn answered(a: Result<Answer, mx_adapters::Error>, with_version: bool) -> CallResult {
    match a {
        Ok(a) => CallResult {
            version: a.version.filter(|_| with_version),
            ..done(a.message)
        },
        Err(e) => failed(e),
    }
}

/// Performs one engine call and judges its answer (status AND body, then the values), the same
/// way whatever contract `engine` speaks.
async fn perform(engine: &dyn EngineClient, action: &Action, spec: &RefitSpec) -> CallResult {
    let mut r = match action {
        Action::Pause => answered(engine.pause(spec.pause_mode).await, true),
        Action::Apply { version } => match engine.apply(version).await {
            Ok(a) => CallResult {
                version: a.version,
                cache_tiers_cleared: a.cache_tiers_cleared,
                paused_requests: a.paused_requests,
                steps: a.steps,
                ..done(a.message)
            },
            Err(e) => failed(e),
        },
        Action::ReadVersion => answered(engine.read_version().await, true),
        Action::Resume => answered(engine.resume().await, false),
        Action::Generate => match &spec.check {
            None => no_check(),
            // Judged probe by probe, inside.
            Some(check) => return check_generations(engine, check, &spec.label).await,
        },
    };
    // Judge the values, not only the transport.
    if r.ok {
        let problem = match action {
            Action::Apply { version } => match &r.version {
                // Which tiers were cleared is recorded, not trusted: an engine with caches that
                // skipped clearing them is caught by the post-update generation.
                Some(v) if v != version => Some(format!(
                    "engine reports version {v} after applying {version}"
                )),
                _ => None,
            },
            _ => None,
        };
        if let Some(p) = problem {
            metrics::counter!(observe::VERIFICATION_FAILURES_TOTAL, "check" => "version")
                .increment(1);
            r.ok = false;
            r.error = p;
        }
    }
    r
}

/// `action` as a metric label.
fn action_label(action: &Action) -> &'static str {
    match action {
        Action::Pause => "pause",
        Action::Apply { .. } => "apply",
        Action::ReadVersion => "read_version",
        Action::Resume => "resume",
        Action::Generate => "generate",
    }
}

/// Drives refit `id` to its end. Errors are journaling failures (the driver stops; a restart
/// recovers from the journal).
pub(crate) async fn drive(shared: Arc<Shared>, id: u64, recovering: bool) {
    use tracing::Instrument;
    let span = tracing::info_span!("refit", id, recovering);
    if let Err(e) = drive_inner(&shared, id, recovering).instrument(span).await {
        if matches!(e, Error::Halted { .. }) {
            // It goes on, as after a restart, once an operator accepts the journal.
            crate::commit::lock(&shared.halt).stopped_refit = Some(id);
        }
        tracing::error!(refit = id, "refit driver stopped: {e}");
    }
}

/// Why [`Ctx::prove`] did not let a call through.
enum Refusal {
    /// The engine said it serves other workers: nothing is sent to it, ever, in this refit.
    NotTheirs(String),
    /// The engine did not answer the question (a transient failure, like any call's).
    Unanswered(String),
}

struct Ctx<'a> {
    shared: &'a Arc<Shared>,
    id: u64,
    /// The refit's spec (fixed at BEGIN), read once: a call must not copy the whole refit
    /// record, which grows with every call of a thousand workers.
    spec: RefitSpec,
    /// One HTTP client (one pool of kept-alive connections) for every engine call.
    http: reqwest::Client,
    /// This driver recovers the refit after a restart.
    recovering: bool,
    /// APPLY calls whose intent was journaled (for the `apply-sent:<n>` failpoint).
    applies_sent: AtomicUsize,
    /// The phase this driver entered last and when, for [`observe::REFIT_PHASE_SECONDS`].
    current: std::sync::Mutex<Option<(Phase, Instant)>>,
}

impl Ctx<'_> {
    fn refit(&self) -> Result<Refit, Error> {
        self.shared
            .read(|s| s.refit(self.id).cloned())
            .ok_or_else(|| Error::Refit {
                id: self.id,
                reason: "vanished".into(),
            })
    }

    async fn phase(&self, phase: Phase, reason: String, recovered: bool) -> Result<(), Error> {
        self.shared.acting()?;
        tracing::info!(refit = self.id, %phase, reason, "refit phase");
        self.phase_ended(Some(phase));
        self.shared
            .mutate(Record::RefitPhase {
                id: self.id,
                phase,
                at_ms: now_ms(),
                reason,
                recovered,
            })
            .await?;
        crate::crash::at(&phase.to_string().to_lowercase());
        Ok(())
    }

    /// Performs `calls` (worker, action), at most `limit` at once (0 = all at once), journaling
    /// in batches: the intents of the calls started together are journaled in one group commit
    /// before any of them is sent, and the results that arrived together are journaled together
    /// once they are in (the journal holds the same records, one per intent and one per result,
    /// as calls made one by one). `on_result(worker, result)` sees each result after it is
    /// durable, in order of arrival; returning `false` starts no more calls (those in flight
    /// finish).
    ///
    /// # Errors
    /// Journaling failures only; an engine's failure is a result with `ok == false`.
    async fn call_many(
        &self,
        calls: Vec<(String, Action)>,
        limit: u32,
        mut on_result: impl FnMut(&str, &CallResult) -> bool,
    ) -> Result<(), Error> {
        use futures_util::stream::{FuturesUnordered, StreamExt};
        use futures_util::FutureExt;
        let limit = match limit {
            0 => calls.len(),
            n => n as usize,
        }
        .max(1);
        let timeout = Duration::from_millis(self.spec.call_timeout_ms);
        let endpoints: Vec<Option<EngineEndpoint>> = self.shared.read(|s| {
            calls
                .iter()
                .map(|(w, _)| s.worker_engine(w).and_then(|(e, _)| e))
                .collect()
        });
        let mut queue = group_by_engine(calls, endpoints).into_iter();
        let mut in_flight = FuturesUnordered::new();
        let mut more = true;
        loop {
            let room = if more { limit - in_flight.len() } else { 0 };
            let start: Vec<EngineCall> = queue.by_ref().take(room).collect();
            if !start.is_empty() {
                self.shared
                    .mutate_all(batch_intents(self.id, &start))
                    .await?;
                for call in start {
                    if let Action::Apply { .. } = call.action {
                        let sent = self.applies_sent.fetch_add(1, Ordering::SeqCst);
                        crate::crash::at(&format!("apply-sent:{sent}"));
                    }
                    in_flight.push(self.perform_call(call, timeout));
                }
            }
            let Some(first) = in_flight.next().await else {
                break;
            };
            // Whatever else has already arrived is journaled with it.
            let mut done = first;
            while let Some(Some(r)) = in_flight.next().now_or_never() {
                done.extend(r);
            }
            self.shared
                .mutate_all(batch_results(self.id, &done))
                .await?;
            for (w, result) in &done {
                more &= on_result(w, result);
            }
        }
        Ok(())
    }

    /// Performs one engine call for every worker of `call` (they share the engine) and gives
    /// each its result, naming it in the error.
    async fn perform_call(&self, call: EngineCall, timeout: Duration) -> Vec<(String, CallResult)> {
        let EngineCall {
            workers,
            action,
            endpoint,
        } = call;
        let t0 = Instant::now();
        let first = workers.first().cloned().unwrap_or_default();
        let seen = self.rejoined(&first);
        let mut result = match &endpoint {
            // The fleet contradicted the journal: nothing more is sent (the driver stops at
            // its next phase).
            _ if self.shared.acting().is_err() => CallResult {
                not_sent: true,
                ..failed(format!(
                    "not sent: {}",
                    self.shared.halt_reason().unwrap_or_default()
                ))
            },
            None => failed(format!("worker {first} has no engine endpoint")),
            Some(ep) if ep.no_model && matches!(action, Action::Generate) => CallResult {
                ok: true,
                message: "skipped: the engine declared no model (it only holds weights)".into(),
                ..CallResult::default()
            },
            Some(ep) => {
                let engine = client_for(
                    ep.api,
                    &self.http,
                    &ep.system_url,
                    ep.frontend.as_ref(),
                    workers.len(),
                    timeout,
                );
                // Every request carries the refit's id (mx_adapters::REFIT_HEADER).
                mx_adapters::for_refit(self.id, async {
                    match self.prove(&workers, &ep.system_url, &*engine).await {
                        Err(Refusal::NotTheirs(why)) => CallResult {
                            not_sent: true,
                            ..failed(why)
                        },
                        Err(Refusal::Unanswered(why)) => failed(why),
                        Ok(()) => tokio::select! {
                            r = perform(&*engine, &action, &self.spec) => {
                                self.judged_by_ranks(ep.api, &workers, &action, r)
                            }
                            why = self.reregistration(&first, seen) => failed(why),
                        },
                    }
                })
                .await
            }
        };
        result.seconds = t0.elapsed().as_secs_f64();
        let what = action_label(&action);
        let outcome = if result.ok { "ok" } else { "failed" };
        metrics::counter!(observe::ENGINE_CALLS_TOTAL, "action" => what, "result" => outcome)
            .increment(1);
        metrics::histogram!(observe::ENGINE_CALL_SECONDS, "action" => what).record(result.seconds);
        if workers.len() > 1 {
            result.message = format!(
                "one call for the {} workers of engine {}: {}",
                workers.len(),
                endpoint.as_ref().map_or("?", |e| e.system_url.as_str()),
                result.message
            );
        }
        let error = std::mem::take(&mut result.error);
        workers
            .into_iter()
            .map(|w| {
                let mut r = result.clone();
                if !r.ok {
                    r.error = format!("worker {w}: {action}: {error}");
                    tracing::warn!(refit = self.id, worker = w, "{}", r.error);
                }
                (w, r)
            })
            .collect()
    }

    /// A read-back of an engine whose ranks report what they hold
    /// ([`EngineApi::resident_from_ranks`]): the version is the ranks' (`crate::ranks`), and a
    /// rank whose install failed, ranks that disagree, or an engine naming another mx version
    /// than its ranks hold fail the call.
    fn judged_by_ranks(
        &self,
        api: EngineApi,
        workers: &[String],
        action: &Action,
        mut r: CallResult,
    ) -> CallResult {
        if !(r.ok && matches!(action, Action::ReadVersion) && api.resident_from_ranks()) {
            return r;
        }
        match self.shared.ranks.resident(workers, r.version.as_ref()) {
            Ok(v) => {
                r.message = format!(
                    "the ranks hold {} (the engine says {})",
                    shown(v.as_ref()),
                    shown(r.version.as_ref())
                );
                r.version = v;
                r
            }
            Err(why) => {
                metrics::counter!(observe::VERIFICATION_FAILURES_TOTAL, "check" => "version")
                    .increment(1);
                failed(why)
            }
        }
    }

    /// Asks the engine at `url` whose it is before the first call to it for `workers` (once per
    /// worker process and URL: the answer holds until the worker registers anew, see
    /// `Shared::proven`): the call is refused, with nothing sent, unless the engine names every
    /// one of them with the instance and incarnation the control plane accepted
    /// (`crate::identity`). An engine without an identity route is called on the strength of its
    /// address (unique among connected workers, checked at registration).
    async fn prove(
        &self,
        workers: &[String],
        url: &str,
        engine: &dyn EngineClient,
    ) -> Result<(), Refusal> {
        use crate::commit::lock;
        use crate::identity::{judge, Expected, Verdict};
        let incarnations: Vec<u64> = workers
            .iter()
            .map(|w| lock(&self.shared.mailbox(w).owner).incarnation)
            .collect();
        let known = {
            let proven = lock(&self.shared.proven);
            workers
                .iter()
                .zip(&incarnations)
                .all(|(w, i)| proven.get(w).is_some_and(|(u, inc)| u == url && inc == i))
        };
        if known {
            return Ok(());
        }
        let expected: Vec<Expected> = self.shared.read(|s| {
            workers
                .iter()
                .zip(&incarnations)
                .map(|(w, &incarnation)| Expected {
                    worker_id: w.clone(),
                    instance: s.worker_instance(w).unwrap_or_default().to_string(),
                    incarnation,
                })
                .collect()
        });
        let proof = engine
            .identify()
            .await
            .map_err(|e| Refusal::Unanswered(format!("asking the engine whose it is: {e}")))?;
        match judge(url, &proof, &expected) {
            Verdict::Refused(why) => {
                metrics::counter!(observe::ENGINE_PROOFS_TOTAL, "result" => "refused").increment(1);
                return Err(Refusal::NotTheirs(why));
            }
            Verdict::Unproven(why) => {
                metrics::counter!(observe::ENGINE_PROOFS_TOTAL, "result" => "not_offered")
                    .increment(1);
                tracing::info!(
                    refit = self.id,
                    engine = url,
                    "the engine cannot say whose it is ({why}): called on the strength of its address"
                );
            }
            Verdict::Proven => {
                metrics::counter!(observe::ENGINE_PROOFS_TOTAL, "result" => "proven").increment(1);
            }
        }
        lock(&self.shared.proven).extend(
            expected
                .into_iter()
                .map(|e| (e.worker_id, (url.to_string(), e.incarnation))),
        );
        Ok(())
    }

    /// `action` on a group of workers that share one engine (one engine call for all; a lone
    /// worker is a group of one): the first failed result, else the first result.
    async fn call_on(&self, ws: &[String], action: Action) -> Result<CallResult, Error> {
        let calls = ws.iter().map(|w| (w.clone(), action.clone())).collect();
        let (mut ok, mut bad) = (None, None);
        self.call_many(calls, 0, |_, r| {
            if !r.ok && bad.is_none() {
                bad = Some(r.clone());
            } else if ok.is_none() {
                ok = Some(r.clone());
            }
            true
        })
        .await?;
        bad.or(ok).ok_or_else(|| Error::Task {
            reason: format!("the call to workers {ws:?} gave no result"),
        })
    }

    /// Runs `action` on every worker in `ids` concurrently; the first failure, if any.
    async fn call_all(&self, ids: &[String], action: Action) -> Result<Option<String>, Error> {
        let calls = ids.iter().map(|w| (w.clone(), action.clone())).collect();
        let mut first = None;
        self.call_many(calls, 0, |_, r| {
            if !r.ok && first.is_none() {
                first = Some(r.error.clone());
            }
            true
        })
        .await?;
        Ok(first)
    }

    /// The first worker of the set that registered again during the refit (it restarted or
    /// reconnected: what it staged may be gone), as an abort reason naming `phase`.
    fn lost_worker(&self, phase: &str) -> Result<Option<String>, Error> {
        let refit = self.refit()?;
        Ok(refit.workers.iter().find_map(|(w, rw)| {
            rw.reregistered.as_ref().map(|j| {
                format!(
                    "worker {w} registered again during {phase} (resident now {}): what it staged may be gone; nothing was applied",
                    shown(j.resident.as_ref())
                )
            })
        }))
    }

    /// What `worker_id` last reported when it registered again during this refit.
    fn rejoined(&self, worker_id: &str) -> Option<crate::refit::Rejoined> {
        self.shared.read(|s| {
            s.refit(self.id)
                .and_then(|r| r.workers.get(worker_id))
                .and_then(|w| w.reregistered.clone())
        })
    }

    /// Resolves once `worker_id` registers again (anew since `seen`), with the reason a call in
    /// flight to it fails at once: the process that was called is not the one registered now.
    async fn reregistration(
        &self,
        worker_id: &str,
        seen: Option<crate::refit::Rejoined>,
    ) -> String {
        self.shared
            .until_worker(worker_id, || {
                self.rejoined(worker_id)
                    .filter(|now| Some(now) != seen.as_ref())
                    .map(|now| {
                        format!(
                            "the worker registered again during the call (resident now {}): the process called is gone",
                            shown(now.resident.as_ref())
                        )
                    })
            })
            .await
    }

    /// Records the duration of the phase entered last and remembers `next` as the current one.
    fn phase_ended(&self, next: Option<Phase>) {
        let mut cur = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((p, since)) = cur.take() {
            metrics::histogram!(observe::REFIT_PHASE_SECONDS, "phase" => p.to_string().to_lowercase())
                .record(since.elapsed().as_secs_f64());
        }
        *cur = next.map(|p| (p, Instant::now()));
    }

    async fn end(&self, outcome: Outcome, reason: String) -> Result<(), Error> {
        self.end_with(outcome, reason, Vec::new(), Vec::new()).await
    }

    /// Ends the refit after `settle_each`: `done` when every worker still here was settled,
    /// otherwise FENCED, the reason followed by `what` and why each unsettled worker was not
    /// (they stay gated until they register again). Departed workers (gone before they could
    /// be settled) are listed in the END and stay gated too, without making it FENCED.
    async fn end_settled(
        &self,
        done: Outcome,
        reason: String,
        what: &str,
        s: Settled,
    ) -> Result<(), Error> {
        let mut reason = reason;
        if !s.departed.is_empty() {
            // The version they are to join: the target if it committed, else the fleet's.
            let label = if done == Outcome::Committed {
                Some(self.spec.label.clone())
            } else {
                self.shared
                    .read(|st| st.fleet_version().map(|(l, _)| l.clone()))
            };
            let ids = s.departed.join(",");
            reason = format!(
                "{reason}; departed before they could be settled (gated, their engines may still be paused): {}; once they are back: `mx refit --label {} --workers {ids} --join`",
                s.departed.join(", "),
                label.as_deref().unwrap_or("LABEL"),
            );
        }
        if s.unsettled.is_empty() {
            return self.end_with(done, reason, Vec::new(), s.departed).await;
        }
        let why: Vec<&str> = s.unsettled.iter().map(|(_, why)| why.as_str()).collect();
        let reason = format!("{reason}; {what}: {}", why.join("; "));
        let ids = s.unsettled.into_iter().map(|(w, _)| w).collect();
        self.end_with(Outcome::Fenced, reason, ids, s.departed)
            .await
    }

    /// Journals the END: `fenced` (worker ids) only for FENCED; `departed` for any outcome.
    async fn end_with(
        &self,
        outcome: Outcome,
        reason: String,
        fenced: Vec<String>,
        departed: Vec<String>,
    ) -> Result<(), Error> {
        self.shared.acting()?;
        if fenced.is_empty() && departed.is_empty() {
            tracing::info!(refit = self.id, %outcome, reason, "refit ended");
        } else {
            tracing::warn!(refit = self.id, %outcome, reason, ?fenced, ?departed, "refit ended");
        }
        self.phase_ended(None);
        let at_ms = now_ms();
        let outcome_label = outcome.to_string().to_lowercase();
        if let Some(began) = self.shared.read(|s| s.refit(self.id).map(|r| r.started_ms)) {
            metrics::histogram!(observe::REFIT_SECONDS, "outcome" => outcome_label.clone())
                .record(at_ms.saturating_sub(began) as f64 / 1e3);
        }
        metrics::counter!(observe::REFITS_TOTAL, "outcome" => outcome_label).increment(1);
        self.shared
            .mutate(Record::RefitEnd {
                id: self.id,
                outcome,
                reason,
                at_ms,
                recovered: self.recovering,
                fenced,
                departed,
            })
            .await?;
        crate::readback::after_refit(self.shared, self.id);
        Ok(())
    }
}

async fn drive_inner(shared: &Arc<Shared>, id: u64, recovering: bool) -> Result<(), Error> {
    let refit = shared
        .read(|s| s.refit(id).cloned())
        .ok_or_else(|| Error::Refit {
            id,
            reason: "vanished".into(),
        })?;
    let applies_sent = refit
        .workers
        .values()
        .flat_map(|w| &w.calls)
        .filter(|c| matches!(c.action, Action::Apply { .. }))
        .count();
    let ctx = Ctx {
        shared,
        id,
        spec: refit.spec.clone(),
        http: shared.http.clone(),
        recovering,
        applies_sent: AtomicUsize::new(applies_sent),
        // BEGIN entered the first phase; a recovered refit's phase is timed from the recovery.
        current: std::sync::Mutex::new(Some((refit.phase, Instant::now()))),
    };
    if recovering {
        return recover(&ctx).await;
    }
    let ids: Vec<String> = refit.spec.worker_ids.clone();

    // STAGE (the BEGIN record put the refit in STAGE).
    crate::crash::at("stage");
    if let Some(reason) = stage(&ctx, &refit).await? {
        return abort(&ctx, reason, false).await;
    }
    if refit.verify_only() {
        return verify_only(&ctx, &refit).await;
    }
    if let Some(reason) = ctx.lost_worker("STAGE")? {
        return abort(&ctx, reason, false).await;
    }
    // PREPARE: the safe point.
    if ctx.spec.orchestrator_gated {
        ctx.phase(Phase::Prepare, GATED.into(), false).await?;
    } else {
        ctx.phase(Phase::Prepare, String::new(), false).await?;
        if let Some(reason) = ctx.call_all(&ids, Action::Pause).await? {
            return abort(&ctx, reason, false).await;
        }
    }
    // A worker that restarted before the point of no return lost what it staged: abort rather
    // than drive it through APPLY and roll it back.
    if let Some(reason) = ctx.lost_worker("PREPARE")? {
        return abort(&ctx, reason, false).await;
    }
    // APPLY, `apply_parallelism` workers at a time (the first intent is the point of no
    // return).
    ctx.phase(Phase::Apply, String::new(), false).await?;
    if let Some(reason) = apply_all(&ctx, &ids, refit.target).await? {
        return rollback(&ctx, reason, false).await;
    }
    // VERIFY: read the resident version back from every worker (or take it from its APPLY
    // answer, when the spec allows and the engine reported one).
    let answered: std::collections::HashSet<String> = if ctx.spec.verify_from_apply_answer {
        ctx.shared.read(|s| {
            s.refit(ctx.id)
                .map(|r| {
                    r.workers
                        .iter()
                        .filter(|(_, w)| {
                            w.calls.last().is_some_and(|c| {
                                matches!(c.action, Action::Apply { .. })
                                    && c.result.as_ref().is_some_and(|r| {
                                        r.ok && r
                                            .version
                                            .as_ref()
                                            .is_some_and(|v| v.is(refit.target))
                                    })
                            })
                        })
                        .map(|(id, _)| id.clone())
                        .collect()
                })
                .unwrap_or_default()
        })
    } else {
        std::collections::HashSet::new()
    };
    let reason = if answered.is_empty() {
        String::new()
    } else {
        format!(
            "{} of {} resident versions taken from the APPLY answers",
            answered.len(),
            ids.len()
        )
    };
    ctx.phase(Phase::Verify, reason, false).await?;
    let reads = ids
        .iter()
        .filter(|w| !answered.contains(*w))
        .map(|w| (w.clone(), Action::ReadVersion))
        .collect();
    let mut failure = None;
    ctx.call_many(reads, 0, |w, r| {
        let wrong = match &r.version {
            Some(v) if !v.is(refit.target) => {
                metrics::counter!(observe::VERIFICATION_FAILURES_TOTAL, "check" => "version")
                    .increment(1);
                Some(format!(
                    "worker {w}: resident version {v} is not {} ({})",
                    refit.target, refit.spec.label
                ))
            }
            _ => None,
        };
        if failure.is_none() {
            failure = (!r.ok).then(|| r.error.clone()).or(wrong);
        }
        true
    })
    .await?;
    if let Some(reason) = failure {
        return rollback(&ctx, reason, false).await;
    }
    // RESUME the engines (rollouts stay gated by the control plane until COMMIT).
    if ctx.spec.orchestrator_gated {
        ctx.phase(Phase::Resume, GATED.into(), false).await?;
    } else {
        ctx.phase(Phase::Resume, String::new(), false).await?;
        if let Some(reason) = ctx.call_all(&ids, Action::Resume).await? {
            return rollback(&ctx, reason, false).await;
        }
    }
    // CHECK: one post-update generation per worker against the golden tokens. Without golden
    // tokens the phase record says that only a non-empty answer was required.
    if let Some(check) = &refit.spec.check {
        let what = check_summary(check);
        ctx.phase(Phase::Check, what, false).await?;
        if let Some(reason) = ctx.call_all(&ids, Action::Generate).await? {
            return rollback(&ctx, reason, false).await;
        }
    }
    ctx.phase(Phase::Commit, String::new(), false).await?;
    crate::crash::at("end");
    ctx.end(Outcome::Committed, String::new()).await
}

/// What CHECK requires, for its phase record.
fn check_summary(check: &GenerationCheck) -> String {
    let from = if check.source.is_empty() {
        String::new()
    } else {
        format!(" ({})", check.source)
    };
    let probes = match check.probes.len() {
        1 => "its probe".to_string(),
        n => format!("{n} probes"),
    };
    let tolerant = check.tie_margin > 0.0 && check.probes.iter().any(|p| !p.margins.is_empty());
    if check.has_expected() && tolerant {
        format!(
            "each worker's greedy generation of {probes} must equal the expected tokens{from}, exact up to a first near-tie below {} nats",
            check.tie_margin
        )
    } else if check.has_expected() {
        format!(
            "each worker's greedy generation of {probes} must equal the expected tokens{from} exactly"
        )
    } else {
        format!(
            "no expected tokens: each worker's {}-token generation of {probes} only had to return tokens",
            check.max_new_tokens
        )
    }
}

/// APPLY on every worker of `ids`, at most `apply_parallelism` at once (0 = all). After the
/// first failure no new apply starts; those in flight finish. `Some(reason)` on failure.
/// Failpoints: `apply:<n>` when `n` applies have finished (`apply:0` before the first).
async fn apply_all(
    ctx: &Ctx<'_>,
    ids: &[String],
    target: VersionId,
) -> Result<Option<String>, Error> {
    let calls = ids
        .iter()
        .map(|w| {
            let version = target.into();
            (w.clone(), Action::Apply { version })
        })
        .collect();
    let mut failure = None;
    let mut finished = 0usize;
    crate::crash::at("apply:0");
    ctx.call_many(calls, ctx.spec.apply_parallelism, |_, r| {
        finished += 1;
        crate::crash::at(&format!("apply:{finished}"));
        if !r.ok && failure.is_none() {
            failure = Some(r.error.clone());
        }
        failure.is_none()
    })
    .await?;
    Ok(failure)
}

/// STAGE: every worker not already running the target pulls and verifies it. `Some(reason)` when
/// the stage failed.
async fn stage(ctx: &Ctx<'_>, refit: &Refit) -> Result<Option<String>, Error> {
    if !refit.dropped.is_empty() && !refit.spec.allow_partial {
        let (w, why) = &refit.dropped[0];
        return Ok(Some(format!("worker {w} is missing: {why}")));
    }
    // Workers already running the target, or already STAGED for it (e.g. `mx stage` before
    // `mx commit`), do not pull again.
    let need: Vec<String> = refit
        .workers
        .iter()
        .filter(|(_, w)| !w.previous.as_ref().is_some_and(|p| p.is(refit.target)))
        .filter(|(id, _)| {
            !matches!(
                ctx.shared.read(|s| s.worker_brief(id)),
                Some((WorkerState::Staged, Some(l), _)) if l == refit.spec.label
            )
        })
        .map(|(id, _)| id.clone())
        .collect();
    if need.is_empty() {
        return Ok(None);
    }
    if let Some(w) = need.iter().find(|w| !ctx.shared.connected(w)) {
        return Ok(Some(format!(
            "worker {w} is not connected to the control plane (missing)"
        )));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(refit.spec.stage_timeout_ms);
    stage_and_wait(ctx, &refit.spec.label, &need, deadline).await
}

/// Journals a Stage of `label` on `need` and waits until every one of them STAGED it, one
/// failed, disconnected or registered again (its process restarted: the command it was
/// following is gone), or `deadline` passed. `Some(reason)` unless all staged.
async fn stage_and_wait(
    ctx: &Ctx<'_>,
    label: &str,
    need: &[String],
    deadline: tokio::time::Instant,
) -> Result<Option<String>, Error> {
    ctx.shared
        .mutate(Record::Stage {
            label: label.to_string(),
            worker_ids: need.to_vec(),
        })
        .await?;
    let rejoined: Vec<_> = need.iter().map(|w| ctx.rejoined(w)).collect();
    let mut changes = ctx.shared.subscribe();
    loop {
        changes.borrow_and_update();
        let mut all = true;
        for (w, seen) in need.iter().zip(&rejoined) {
            if ctx.rejoined(w) != *seen {
                return Ok(Some(format!(
                    "worker {w} registered again while staging {label}: what it was staging is gone"
                )));
            }
            match ctx.shared.read(|s| s.worker_brief(w)) {
                Some((WorkerState::Staged, Some(l), _)) if l == label => {}
                Some((WorkerState::Failed, _, err)) => {
                    return Ok(Some(format!(
                        "worker {w} failed to stage {label}: {}",
                        err.unwrap_or_default()
                    )))
                }
                None => return Ok(Some(format!("worker {w} is no longer registered"))),
                Some((WorkerState::Staging, Some(l), _)) if l == label => {
                    all = false;
                    if !ctx.shared.connected(w) {
                        return Ok(Some(format!("worker {w} disconnected while staging {label}")));
                    }
                }
                Some((state, l, _)) => {
                    return Ok(Some(format!(
                        "worker {w} is {state:?} ({}) instead of staging {label}: it registered again or another stage replaced this one",
                        l.unwrap_or_default()
                    )))
                }
            }
        }
        if all {
            return Ok(None);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                return Ok(Some(format!("stage of {label} did not finish before its deadline")));
            }
            // Connection changes bump the same channel; a short tick covers the rest.
            _ = changes.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// A refit of a version every worker of the set already holds: nothing is staged, paused or
/// applied. VERIFY reads every engine's version back; CHECK runs the post-update generation. A
/// worker whose engine reports another version is not admitted (what it reported is recorded)
/// and the refit ABORTS; one that reports the target but fails the check is FENCED: what it
/// holds is not what it claims.
async fn verify_only(ctx: &Ctx<'_>, refit: &Refit) -> Result<(), Error> {
    let ids: Vec<String> = refit.workers.keys().cloned().collect();
    ctx.phase(
        Phase::Verify,
        format!(
            "verify-only: every worker held {} when the refit began; nothing is staged, paused or applied",
            refit.target
        ),
        false,
    )
    .await?;
    let reads = ids
        .iter()
        .map(|w| (w.clone(), Action::ReadVersion))
        .collect();
    let mut failure = None;
    ctx.call_many(reads, 0, |w, r| {
        if failure.is_none() {
            failure = (!r.ok).then(|| r.error.clone()).or_else(|| match &r.version {
                Some(v) if !v.is(refit.target) => Some(format!(
                    "worker {w}: resident version {v} is not {} ({}): it is not admitted until a refit brings it there",
                    refit.target, refit.spec.label
                )),
                _ => None,
            });
        }
        true
    })
    .await?;
    if let Some(reason) = failure {
        return abort(ctx, reason, false).await;
    }
    ctx.phase(
        Phase::Resume,
        "verify-only: nothing was paused".into(),
        false,
    )
    .await?;
    if refit.spec.check.is_some() {
        ctx.phase(
            Phase::Check,
            "verify-only: each worker's generation is checked".into(),
            false,
        )
        .await?;
        let calls = ids.iter().map(|w| (w.clone(), Action::Generate)).collect();
        let mut wrong = None;
        ctx.call_many(calls, 0, |_, r| {
            if !r.ok && wrong.is_none() {
                wrong = Some(r.error.clone());
            }
            true
        })
        .await?;
        if let Some(reason) = wrong {
            return abort(ctx, reason, false).await;
        }
    }
    ctx.phase(Phase::Commit, String::new(), false).await?;
    ctx.end(Outcome::Committed, String::new()).await
}

/// ABORT: nobody applied. Engines paused by this refit are resumed.
async fn abort(ctx: &Ctx<'_>, reason: String, recovered: bool) -> Result<(), Error> {
    if ctx.refit()?.phase != Phase::Abort {
        ctx.phase(Phase::Abort, reason.clone(), recovered).await?;
    }
    let refit = ctx.refit()?;
    let paused: Vec<String> = refit
        .workers
        .iter()
        .filter(|(_, w)| {
            w.calls.iter().any(|c| {
                c.action == Action::Pause && !c.result.as_ref().is_some_and(|r| r.not_sent)
            })
        })
        .map(|(id, _)| id.clone())
        .collect();
    let mut settled = settle_each(ctx, &paused, false).await?;
    if refit.verify_only() {
        // Nothing was paused or applied. A worker whose read-back or check failed (as journaled,
        // so a control plane that recovers this refit sees the same) reports a version it
        // cannot be trusted with: fenced. One that read back another version is not: that
        // version is recorded, so it is simply not admitted.
        settled
            .unsettled
            .extend(refit.workers.iter().filter_map(|(id, w)| {
                let c = w
                    .calls
                    .iter()
                    .rev()
                    .find(|c| matches!(c.action, Action::ReadVersion | Action::Generate))?;
                let r = c.result.as_ref()?;
                (!r.ok && r.error != CALL_LOST_IN_RESTART).then(|| (id.clone(), r.error.clone()))
            }));
        return ctx
            .end_settled(
                Outcome::Aborted,
                reason,
                "reports the version but failed its read-back or check",
                settled,
            )
            .await;
    }
    ctx.end_settled(Outcome::Aborted, reason, "could not resume", settled)
        .await
}

/// ROLLBACK: every worker of the set goes back to the version it had (pinned, or staged again
/// from its sources when the pinned copy is gone), is verified and resumed; one that cannot be
/// brought back is fenced (stays gated), one that left is recorded as departed.
async fn rollback(ctx: &Ctx<'_>, reason: String, recovered: bool) -> Result<(), Error> {
    if ctx.refit()?.phase != Phase::Rollback {
        ctx.phase(Phase::Rollback, reason.clone(), recovered)
            .await?;
    }
    let refit = ctx.refit()?;
    let ids: Vec<String> = refit.workers.keys().cloned().collect();
    let settled = settle_each(ctx, &ids, true).await?;
    ctx.end_settled(Outcome::RolledBack, reason, "not rolled back", settled)
        .await
}

/// What [`settle_each`] could not settle.
#[derive(Default)]
struct Settled {
    /// (worker, why): reachable but not brought back (V-1 could not be had, or its engine
    /// kept failing until the deadline): FENCED.
    unsettled: Vec<(String, String)>,
    /// Workers whose command stream closed and that did not register again within
    /// [`DEPARTURE_GRACE`].
    departed: Vec<String>,
}

/// How one attempt to settle a worker ended.
enum Attempt {
    Done,
    /// Try again after a pause (a transient failure).
    Retry(String),
    /// No retry can help (the previous version cannot be had): fence it now rather than wait
    /// out the deadline.
    Fence(String),
}

/// Brings each worker back to its previous version (when `restore`) and resumes it, retrying
/// until the rollback deadline; workers are settled concurrently (each one's calls stay in
/// order), so a rollback of a thousand workers takes about as long as one worker's. Retries back
/// off from 250 ms to 4 s between attempts. A worker whose command stream is closed is given
/// [`DEPARTURE_GRACE`] to register again (then it is settled like the others) before it is
/// recorded as departed.
async fn settle_each(ctx: &Ctx<'_>, ids: &[String], restore: bool) -> Result<Settled, Error> {
    let deadline = Instant::now()
        + MIN_ROLLBACK_DEADLINE.max(Duration::from_millis(
            ctx.spec.call_timeout_ms.saturating_mul(4),
        ));
    // Workers sharing an engine (the ranks of one tensor-parallel engine) are settled together:
    // one engine call each step, on behalf of all of them.
    let endpoints = ctx.shared.read(|s| {
        ids.iter()
            .map(|w| s.worker_engine(w).and_then(|(e, _)| e))
            .collect()
    });
    let groups = group_by_engine(
        ids.iter().map(|w| (w.clone(), Action::Resume)).collect(),
        endpoints,
    );
    let settle = groups.into_iter().map(|g| async move {
        let ws = g.workers;
        let mut last = String::new();
        let mut pause = SETTLE_RETRY_FIRST;
        let mut away_since: Option<Instant> = None;
        while Instant::now() < deadline {
            if let Some(w) = ws.iter().find(|w| !ctx.shared.connected(w)) {
                let since = *away_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= DEPARTURE_GRACE {
                    return Ok::<_, Error>(Some(Err((ws.clone(), w.clone()))));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            away_since = None;
            match settle_one(ctx, &ws, restore, deadline).await? {
                Attempt::Done => return Ok(None),
                Attempt::Fence(e) => return Ok(Some(Ok((ws, e)))),
                Attempt::Retry(e) => {
                    last = e;
                    let left = deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(SETTLE_RETRY_MAX);
                }
            }
        }
        if let Some(w) = ws.iter().find(|w| !ctx.shared.connected(w)) {
            let w = w.clone();
            return Ok(Some(Err((ws, w))));
        }
        Ok(Some(Ok((ws, last))))
    });
    let mut out = Settled::default();
    for r in futures_util::future::join_all(settle).await {
        match r? {
            None => {}
            Some(Ok((ws, e))) => {
                for w in ws {
                    let why = format!("worker {w}: {e}");
                    out.unsettled.push((w, why));
                }
            }
            // One rank gone takes its engine's other ranks with it: none can be settled alone.
            Some(Err((ws, _gone))) => out.departed.extend(ws),
        }
    }
    Ok(out)
}

/// A failed settling call: retried, unless nothing was sent because the engine at the worker's
/// URL is another worker's (no retry can reach the worker's own engine): fenced at once.
fn retry_or_fence(r: CallResult) -> Attempt {
    if r.not_sent {
        Attempt::Fence(r.error)
    } else {
        Attempt::Retry(r.error)
    }
}

/// One attempt: pause, apply the worker's previous version (when `restore`), read back, resume.
/// When the apply fails (the pinned copy is gone: the worker restarted, or its engine keeps no
/// previous version), the previous version is staged again from its sources and applied; when
/// that stage fails the previous version cannot be had: [`Attempt::Fence`].
async fn settle_one(
    ctx: &Ctx<'_>,
    ws: &[String],
    restore: bool,
    deadline: Instant,
) -> Result<Attempt, Error> {
    let w = ws.first().map(String::as_str).unwrap_or_default();
    let gated = ctx.spec.orchestrator_gated;
    let resume = |r: CallResult| {
        if r.ok {
            Attempt::Done
        } else {
            retry_or_fence(r)
        }
    };
    if !restore {
        return Ok(if gated {
            Attempt::Done
        } else {
            resume(ctx.call_on(ws, Action::Resume).await?)
        });
    }
    // This worker's record only: copying the whole refit per worker would make a rollback of a
    // large set quadratic.
    let Some((previous, apply_issued)) = ctx.shared.read(|s| {
        s.refit(ctx.id)
            .and_then(|r| r.workers.get(w))
            .map(|x| (x.previous.clone(), x.apply_issued()))
    }) else {
        return Ok(Attempt::Fence("not in the refit's set".into()));
    };
    // A version not installed by mx (`disk:…`) cannot be applied again by mx: like no version;
    // except on an engine running mx inside (vLLM's backend, SGLang's loader), which retains
    // whatever it held (its start-up checkpoint included) and restores it by id.
    let restores_any = ctx.shared.read(|s| {
        s.worker_engine(w)
            .and_then(|(e, _)| e)
            .is_some_and(|e| e.api.restores_any_version())
    });
    let Some(prev) = previous.filter(|p| restores_any || p.mx().is_some()) else {
        // It held nothing before the refit: there is nothing to go back to, and nothing to
        // guard either: it is admitted only on the fleet's committed version. Its version is
        // read back (so what it holds is known), then it resumes.
        if apply_issued {
            let r = ctx.call_on(ws, Action::ReadVersion).await?;
            if !r.ok {
                return Ok(retry_or_fence(r));
            }
        }
        return Ok(if gated {
            Attempt::Done
        } else {
            resume(ctx.call_on(ws, Action::Resume).await?)
        });
    };
    if !gated {
        let r = ctx.call_on(ws, Action::Pause).await?;
        if !r.ok {
            return Ok(retry_or_fence(r));
        }
    }
    let apply = Action::Apply {
        version: prev.clone(),
    };
    let mut r = ctx.call_on(ws, apply.clone()).await?;
    if !r.ok {
        // The pinned copy may be gone: stage the previous version again from its sources.
        let Some(label) = ctx.shared.read(|s| s.label_of(&prev)) else {
            return Ok(Attempt::Fence(format!(
                "apply of {prev} failed ({}) and no declared version has that id to stage again",
                r.error
            )));
        };
        tracing::warn!(
            refit = ctx.id,
            worker = w,
            label,
            "apply of the previous version failed: staging it again"
        );
        let until = tokio::time::Instant::from_std(deadline);
        if let Some(why) = stage_and_wait(ctx, &label, ws, until).await? {
            // Sources that moved on will not serve it again: fence now. Otherwise (a source
            // restarting, a worker that restarted again) try again until the deadline.
            if let Some((slot, by)) = ctx.shared.read(|s| s.retired_by(&label)) {
                return Ok(Attempt::Fence(format!(
                    "its previous version {label} ({prev}) is not pinned and cannot be had: source slot {slot} now serves {by} from the same memory ({why})"
                )));
            }
            return Ok(Attempt::Retry(format!(
                "its previous version {label} ({prev}) is not pinned and staging it again failed: {why}"
            )));
        }
        r = ctx.call_on(ws, apply).await?;
        if !r.ok {
            return Ok(Attempt::Retry(r.error));
        }
    }
    let r = ctx.call_on(ws, Action::ReadVersion).await?;
    if !r.ok {
        return Ok(Attempt::Retry(r.error));
    }
    if let Some(v) = &r.version {
        if v != &prev {
            return Ok(Attempt::Retry(format!(
                "resident {v} after rollback to {prev}"
            )));
        }
    }
    Ok(if gated {
        Attempt::Done
    } else {
        resume(ctx.call_on(ws, Action::Resume).await?)
    })
}

/// After a restart: settle calls left without a result, then finish or roll back.
async fn recover(ctx: &Ctx<'_>) -> Result<(), Error> {
    let refit = ctx.refit()?;
    tracing::warn!(refit = refit.id, phase = %refit.phase, "recovering an open refit after restart");
    // The journal may have lost what happened after it (a cut reads like a torn write): the
    // refit's workers say what they hold before anything is settled (`crate::testimony`).
    let ids: Vec<String> = refit.workers.keys().cloned().collect();
    ctx.shared.await_testimony(&ids).await;
    ctx.shared.acting()?;
    for (w, rw) in &refit.workers {
        if rw.calls.last().is_some_and(|c| c.result.is_none()) {
            ctx.shared
                .mutate(Record::WorkerDone {
                    id: refit.id,
                    worker_id: w.clone(),
                    result: CallResult {
                        ok: false,
                        error: CALL_LOST_IN_RESTART.into(),
                        ..CallResult::default()
                    },
                })
                .await?;
        }
    }
    let refit = ctx.refit()?;
    let why = format!("{} {}", crate::refit::RESTART_REASON, refit.phase);
    match refit.phase {
        Phase::Commit => ctx.end(Outcome::Committed, String::new()).await,
        Phase::Abort => abort(ctx, refit.reason.clone(), true).await,
        Phase::Rollback => rollback(ctx, refit.reason.clone(), true).await,
        _ if refit.past_no_return() => rollback(ctx, why, true).await,
        _ => abort(ctx, why, true).await,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose
#[path = "driver_tests.rs"]
mod tests;
