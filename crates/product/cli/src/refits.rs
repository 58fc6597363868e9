//! Refit helpers shared by the harness and the `mx refit` command: golden tokens of a demo
//! version, waiting for a refit's end, printing one.

use std::time::Duration;

use anyhow::{bail, Context};
use mx_control::client::ControlClient;
use mx_control::Refit;
use mx_layout::ResidentVersion;

/// Golden tokens of demo version `version` for `prompt`: a forward pass over the checkpoint plus
/// the known training steps, never over pulled bytes.
pub fn golden(
    model: &std::path::Path,
    version: u32,
    prompt: &[u32],
    n: u32,
) -> anyhow::Result<Vec<u32>> {
    mx_engine::golden::golden_tokens(model, version, prompt, n as usize).with_context(|| {
        format!(
            "golden tokens of version {version} from {}",
            model.display()
        )
    })
}

/// Long-polls refit `id` until it ended (reconnecting while the control plane restarts).
pub async fn wait_end(client: &ControlClient, id: u64, timeout: Duration) -> anyhow::Result<Refit> {
    wait_end_reporting(client, id, timeout, None, |_| {}).await
}

/// [`wait_end`], calling `report` with the refit as it stands after every poll (about every
/// 2 s, and at its end), and giving up with the control plane's error once it stayed
/// unreachable for `unreachable_after` (`None`: until `timeout`).
///
/// # Errors
/// The refit is unknown; it did not end within `timeout`; the last [`mx_control::Error`] of
/// the control plane when it stayed unreachable.
pub async fn wait_end_reporting(
    client: &ControlClient,
    id: u64,
    timeout: Duration,
    unreachable_after: Option<Duration>,
    mut report: impl FnMut(&Refit),
) -> anyhow::Result<Refit> {
    let t = std::time::Instant::now();
    let mut away_since: Option<std::time::Instant> = None;
    loop {
        match client.wait_refit(id, Duration::from_secs(2)).await {
            Ok((true, Some(r))) => {
                report(&r);
                return Ok(r);
            }
            Ok((_, None)) => bail!("refit {id} is unknown to the control plane"),
            Ok((false, Some(r))) => {
                away_since = None;
                report(&r);
            }
            Err(e) => {
                tracing::debug!("waiting for refit {id}: {e}");
                let since = *away_since.get_or_insert_with(std::time::Instant::now);
                if unreachable_after.is_some_and(|d| since.elapsed() >= d) {
                    return Err(anyhow::Error::new(e).context(format!(
                        "waiting for refit {id}: the control plane stayed unreachable for {:.0} s",
                        since.elapsed().as_secs_f64()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if t.elapsed() > timeout {
            bail!("refit {id} did not end within {timeout:?}");
        }
    }
}

/// Lines of a refit's progress for a terminal while it runs: one per phase entered (with its
/// start, seconds after BEGIN, from the journaled record, so phases shorter than a poll are
/// shown too), one per change of the staged count during STAGE, and the outcome.
#[derive(Debug, Default)]
pub struct Progress {
    phases: usize,
    staged: Option<usize>,
    ended: bool,
}

impl Progress {
    /// The lines for what changed in `r` since the last call (none when nothing did).
    pub fn lines(&mut self, r: &Refit) -> Vec<String> {
        let mut out = Vec::new();
        let at = |ms: u64| ms.saturating_sub(r.started_ms) as f64 / 1e3;
        for (phase, began) in r.phases.iter().skip(self.phases) {
            out.push(format!("refit {} [{:7.1} s] {phase}", r.id, at(*began)));
        }
        self.phases = r.phases.len();
        if r.phase == mx_control::Phase::Stage && r.outcome.is_none() {
            let staged = r
                .workers
                .values()
                .filter(|w| w.stage_seconds > 0.0 || w.stage_bytes > 0)
                .count();
            if self.staged != Some(staged) {
                self.staged = Some(staged);
                let bytes: u64 = r.workers.values().map(|w| w.stage_bytes).sum();
                out.push(format!(
                    "refit {} [{:7.1} s] STAGE: {staged}/{} workers staged, {:.1} MB pulled",
                    r.id,
                    at(mx_control::refit::now_ms()),
                    r.workers.len(),
                    bytes as f64 / 1e6
                ));
            }
        }
        if let (Some(o), false) = (r.outcome, self.ended) {
            self.ended = true;
            let end = r.ended_ms.unwrap_or_else(mx_control::refit::now_ms);
            out.push(format!("refit {} [{:7.1} s] {o}", r.id, at(end)));
        }
        out
    }
}

/// Prints a refit: outcome, phases, and per worker previous -> resulting version with its calls.
pub fn print_refit(r: &Refit) {
    // The first 15 characters (a label may hold any UTF-8).
    let short = |v: &Option<ResidentVersion>| match v.as_ref().map(ToString::to_string) {
        Some(v) if v.chars().count() > 15 => format!("{}…", v.chars().take(15).collect::<String>()),
        Some(v) => v,
        None => "(none)".into(),
    };
    println!(
        "refit {} -> {} ({}): {}{}{}",
        r.id,
        r.spec.label,
        r.target.to_string().chars().take(15).collect::<String>(),
        r.outcome
            .map(|o| o.to_string())
            .unwrap_or_else(|| "OPEN".into()),
        if r.reason.is_empty() {
            String::new()
        } else {
            format!(" — {}", r.reason)
        },
        if r.recovered {
            " (recovered after a control-plane restart)"
        } else {
            ""
        },
    );
    let phases: Vec<String> = r.phases.iter().map(|(p, _)| p.to_string()).collect();
    println!("  phases: {}", phases.join(" -> "));
    println!(
        "  {:<10} {:<17} {:<17} {:>8} {:>8} {:>8} {:>8}  tiers cleared / tokens",
        "worker", "previous", "resulting", "stage s", "apply s", "verify s", "check s"
    );
    for (id, w) in &r.workers {
        // Seconds over the calls of a kind, "-" when there was none (an empty f64 sum is -0.0).
        let secs = |f: &dyn Fn(&mx_control::Action) -> bool| -> String {
            let t: Vec<f64> = w
                .calls
                .iter()
                .filter(|c| f(&c.action))
                .filter_map(|c| c.result.as_ref().map(|x| x.seconds))
                .collect();
            if t.is_empty() {
                "-".to_string()
            } else {
                format!("{:.3}", t.iter().sum::<f64>())
            }
        };
        let apply = secs(&|a| matches!(a, mx_control::Action::Apply { .. }));
        let verify = secs(&|a| matches!(a, mx_control::Action::ReadVersion));
        let check = secs(&|a| matches!(a, mx_control::Action::Generate));
        let tiers = w
            .calls
            .iter()
            .filter_map(|c| c.result.as_ref())
            .rev()
            .find(|x| !x.cache_tiers_cleared.is_empty())
            .map(|x| x.cache_tiers_cleared.join(","))
            .unwrap_or_default();
        let tokens = w
            .calls
            .iter()
            .filter(|c| c.action == mx_control::Action::Generate)
            .filter_map(|c| c.result.as_ref())
            .next_back()
            .map(|x| format!(" {:?}", x.tokens))
            .unwrap_or_default();
        // A worker whose last call failed (or never answered) has no established version.
        let last_failed = w
            .calls
            .last()
            .is_some_and(|c| c.result.as_ref().is_none_or(|x| !x.ok));
        let resulting = if last_failed && r.outcome.is_some() {
            "unknown (failed)".to_string()
        } else {
            short(&w.resident)
        };
        println!(
            "  {:<10} {:<17} {:<17} {:>8.3} {:>8} {:>8} {:>8}  {tiers}{tokens}",
            id,
            short(&w.previous),
            resulting,
            w.stage_seconds,
            apply,
            verify,
            check
        );
    }
    let next = match r.outcome {
        Some(mx_control::Outcome::Aborted) => Some(format!(
            "nothing was applied and every worker kept its version: fix the cause above, then `mx refit --label {}` again",
            r.spec.label
        )),
        Some(mx_control::Outcome::RolledBack) => Some(format!(
            "every worker is back on its previous version: fix the cause above, then `mx refit --label {}` again",
            r.spec.label
        )),
        Some(mx_control::Outcome::Fenced) => Some(
            "the fenced workers are gated until they register anew (restart them) or a refit of them settles: `mx refit --label <the fleet's version, mx status> --workers <them> --join`".to_string(),
        ),
        _ => None,
    };
    if let Some(n) = next {
        println!("  next: {n}");
    }
}
