//! `mx refit`: the orchestrator's command. Asks the control plane to move a worker set to a
//! version (STAGE, PREPARE, APPLY, VERIFY, RESUME, CHECK, COMMIT, or ABORT / ROLLBACK), waits
//! for the end and prints what happened on each worker. Exit status 0 only when COMMITTED
//! (the others are listed at `exit_code` in main.rs).

use std::path::PathBuf;
use std::time::Duration;

use crate::refits::{golden, print_refit, wait_end_reporting, Progress};
use anyhow::{bail, Context};
use mx_control::client::ControlClient;
use mx_control::{GenerationCheck, Outcome, PauseMode, RefitSpec};

/// Flags of `mx refit`.
#[derive(clap::Args, Debug, Clone)]
pub struct RefitArgs {
    /// Control plane address.
    #[arg(long, default_value = "http://127.0.0.1:7700")]
    pub control: String,
    /// Version label to move to (READY, or committed before).
    #[arg(long)]
    pub label: String,
    /// Target workers (comma-separated ids); default: every connected worker with engine routes
    /// (registered ids whose command stream is closed are left out and named; retire them with
    /// `mx retire`, or they are retired after the control plane's --retire-departed-after).
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Dynamo discovery URL (`GET {url}/v1/rl/workers`): the target set is every discovered
    /// worker that can be refitted (the others are listed with the reason and left out),
    /// matched to registered workers by the socket addresses of their engine URLs
    /// (every spelling of one address matches; every rank registered with a discovered engine
    /// is included).
    #[arg(long, conflicts_with = "workers")]
    pub discovery: Option<String>,
    /// A file holding the bearer token the discovery route requires (the workers'
    /// --http-token-file).
    #[arg(long, env = "MX_ENGINE_TOKEN_FILE")]
    pub engine_token_file: Option<PathBuf>,
    /// Elastic join: only the connected workers (of --workers, or every registered one) whose
    /// resident version is not --label, e.g. workers that registered into a running fleet. The
    /// fleet's other workers keep serving untouched; a worker stages a version committed before
    /// from peers and artifacts first. Nothing to join is success.
    #[arg(long)]
    pub join: bool,
    /// In-flight requests at PREPARE: keep, wait or abort.
    #[arg(long, default_value = "wait")]
    pub pause_mode: PauseMode,
    /// Proceed without workers that are not connected (default: a missing worker aborts).
    #[arg(long)]
    pub allow_partial: bool,
    /// The post-update check by default: the expected outputs the version's trainer published
    /// (greedy tokens of its probe prompts, exact up to a first near-tie); without them, each
    /// worker's generation of --check-tokens tokens after the SmolLM2 prompt "The capital of
    /// France is" must only return tokens. Give --prompt-tokens / --expect-tokens (or the
    /// demo's --golden-model) for a check of your own, --no-check for none.
    #[arg(long)]
    pub no_check: bool,
    /// Post-update generation prompt of a check of your own (token ids, comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Vec<u32>,
    /// The greedy tokens the engines must produce after --prompt-tokens (comma-separated;
    /// exact match), e.g. computed with your trainer's forward pass.
    #[arg(long, value_delimiter = ',', requires = "prompt_tokens")]
    pub expect_tokens: Vec<u32>,
    /// Tokens a check of your own decodes (0 = no post-update generation).
    #[arg(long, default_value_t = 4)]
    pub check_tokens: u32,
    /// The demo's golden tokens: computed from this checkpoint plus `--golden-version - 1`
    /// of mx's deterministic demo training steps (not a real trainer's: see --expect-tokens).
    #[arg(long, conflicts_with = "expect_tokens")]
    pub golden_model: Option<PathBuf>,
    /// Which demo version the golden tokens are for (1 = the checkpoint itself).
    #[arg(long)]
    pub golden_version: Option<u32>,
    /// Trainer step journaled with the refit.
    #[arg(long, default_value_t = 0)]
    pub framework_step: u64,
    /// STAGE deadline, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub stage_timeout_s: f64,
    /// Deadline of each engine call, seconds (a hung worker fails after it).
    #[arg(long, default_value_t = 60.0)]
    pub call_timeout_s: f64,
    /// Workers applying at once (0 = all of them, 1 = one after the other).
    #[arg(long, default_value_t = 0)]
    pub apply_parallelism: u32,
    /// The orchestrator holds the safe point (no generation in flight on these workers): no
    /// pause/resume engine calls.
    #[arg(long)]
    pub orchestrator_gated: bool,
    /// VERIFY takes each worker's resident version from its APPLY answer where the engine
    /// reported one (Dynamo), instead of a second get_weight_version call.
    #[arg(long)]
    pub verify_from_apply_answer: bool,
    /// Write the refit record as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn ms(s: f64, flag: &str) -> anyhow::Result<u64> {
    if !(s.is_finite() && s > 0.0 && s < 1e9) {
        bail!("--{flag} must be a positive number of seconds, got {s}");
    }
    Ok((s * 1000.0).round() as u64)
}

pub(crate) async fn run(a: RefitArgs) -> anyhow::Result<()> {
    let client = ControlClient::connect(&a.control).await?;
    let status = client.get_status().await?;
    let workers = if let Some(url) = &a.discovery {
        // The discovery route of an `mx worker` started with --http-token-file needs the token.
        let token = match &a.engine_token_file {
            Some(f) => Some(mx_control::auth::read_token_file(f)?),
            None => None,
        };
        let http = mx_adapters::http_client(token.as_deref()).map_err(anyhow::Error::msg)?;
        let d = mx_adapters::dynamo::DynamoClient::with_client(http, url, Duration::from_secs(10))
            .discover()
            .await?;
        for (w, why) in &d.left_out {
            println!(
                "left out (discovered, cannot be refitted): worker {} ({}): {why}",
                w.instance_id,
                w.system_url.as_deref().unwrap_or("no system_url")
            );
        }
        let mut registered = Vec::new();
        for w in &status.workers {
            if let Some(e) = &w.engine {
                let at = mx_control::engine_addresses(&e.system_url)
                    .await
                    .unwrap_or_default();
                registered.push((w.worker_id.clone(), at));
            }
        }
        let mut discovered = Vec::new();
        for w in &d.workers {
            let url = w.system_url.clone().unwrap_or_default();
            let at = mx_control::engine_addresses(&url)
                .await
                .map_err(|e| anyhow::anyhow!("discovered worker {}: {e}", w.instance_id))?;
            discovered.push((format!("{} ({url})", w.instance_id), at));
        }
        match_discovered(&discovered, &registered)?
    } else if a.workers.is_empty() {
        let (live, away): (Vec<_>, Vec<_>) = status
            .workers
            .iter()
            .filter(|w| w.engine.is_some())
            .partition(|w| w.connected);
        if !away.is_empty() {
            let ids: Vec<&str> = away.iter().map(|w| w.worker_id.as_str()).collect();
            println!(
                "left out (registered, not connected; `mx retire --workers {}` forgets them): {}",
                ids.join(","),
                ids.join(", ")
            );
        }
        live.iter().map(|w| w.worker_id.clone()).collect()
    } else {
        a.workers.clone()
    };
    let workers = if a.join {
        let info = client.get_version(&a.label).await?;
        let target = info
            .version_digest
            .with_context(|| format!("{} is not READY: nothing to join", a.label))?;
        let joining: Vec<String> = workers
            .into_iter()
            .filter(|id| {
                status.workers.iter().any(|w| {
                    w.worker_id == *id && w.connected && w.resident_version != Some(target)
                })
            })
            .collect();
        if joining.is_empty() {
            println!(
                "nothing to join: every connected target worker runs {}",
                a.label
            );
            return Ok(());
        }
        joining
    } else {
        workers
    };
    if workers.is_empty() {
        bail!("no target workers: none connected with engine routes (start `mx worker`)");
    }
    let (check, no_check) = refit_check(&a, &client).await?;
    let spec = RefitSpec {
        label: a.label.clone(),
        worker_ids: workers,
        pause_mode: a.pause_mode,
        allow_partial: a.allow_partial,
        check,
        no_check,
        framework_step: a.framework_step,
        stage_timeout_ms: ms(a.stage_timeout_s, "stage-timeout-s")?,
        call_timeout_ms: ms(a.call_timeout_s, "call-timeout-s")?,
        apply_parallelism: a.apply_parallelism,
        orchestrator_gated: a.orchestrator_gated,
        verify_from_apply_answer: a.verify_from_apply_answer,
    };
    let mut restarts = 0;
    let refit = loop {
        let id = client.refit(&spec).await?;
        eprintln!("refit {id}: {} on {:?}", spec.label, spec.worker_ids);
        let refit = wait_with_progress(&client, id, Duration::from_secs(3600)).await?;
        // A control plane that took over (or restarted) ended it for that alone, with every
        // worker back on its previous version: ask for it again, a few times at most.
        if refit.ended_by_restart() && restarts < MAX_RESTARTS {
            restarts += 1;
            eprintln!(
                "refit {id} was ended by a control plane that took over ({}): every worker is back on its previous version; asking again ({restarts} of {MAX_RESTARTS})",
                refit.reason
            );
            continue;
        }
        break refit;
    };
    print_refit(&refit);
    if let Some(p) = &a.json {
        crate::report::write_report(p, &refit)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    NotCommitted::check(&refit)
}

/// Waits for refit `id` to end, printing a line on stderr at every phase (and every staged
/// worker count in STAGE); gives up once the control plane stayed unreachable for
/// [`UNREACHABLE_AFTER`].
pub(crate) async fn wait_with_progress(
    client: &ControlClient,
    id: u64,
    timeout: Duration,
) -> anyhow::Result<mx_control::Refit> {
    let mut progress = Progress::default();
    wait_end_reporting(client, id, timeout, Some(UNREACHABLE_AFTER), |r| {
        for line in progress.lines(r) {
            eprintln!("{line}");
        }
    })
    .await
}

/// How many times `mx refit` asks again for a refit that a control plane ended only because it
/// took over after a restart or failover ([`mx_control::Refit::ended_by_restart`]).
pub(crate) const MAX_RESTARTS: u32 = 3;

/// How long `mx refit` and `mx commit` wait for an unreachable control plane (a restart takes
/// seconds: the journal is replayed and the open refit recovered) before exiting 69.
pub(crate) const UNREACHABLE_AFTER: Duration = Duration::from_secs(60);

/// A refit that ended without COMMITTED: the error `mx refit` and `mx commit` exit with (its
/// outcome picks the exit status, see `exit_code` in main.rs).
#[derive(Debug)]
pub(crate) struct NotCommitted {
    pub id: u64,
    pub label: String,
    pub outcome: Option<Outcome>,
    pub reason: String,
}

impl NotCommitted {
    /// `Ok` for a COMMITTED refit, the error otherwise.
    pub(crate) fn check(r: &mx_control::Refit) -> anyhow::Result<()> {
        if r.outcome == Some(Outcome::Committed) {
            return Ok(());
        }
        Err(NotCommitted {
            id: r.id,
            label: r.spec.label.clone(),
            outcome: r.outcome,
            reason: r.reason.clone(),
        }
        .into())
    }
}

impl std::fmt::Display for NotCommitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "refit {} to {} ended {}: {}",
            self.id,
            self.label,
            self.outcome
                .map_or_else(|| "OPEN".to_string(), |o| o.to_string()),
            self.reason
        )
    }
}

impl std::error::Error for NotCommitted {}

/// The post-update check `mx refit` asks for, and whether it asks for none (see
/// [`RefitArgs::no_check`]); says which on stdout.
async fn refit_check(
    a: &RefitArgs,
    client: &ControlClient,
) -> anyhow::Result<(Option<GenerationCheck>, bool)> {
    if a.no_check || a.check_tokens == 0 {
        println!("post-update check: none (--no-check)");
        return Ok((None, true));
    }
    let own = !a.prompt_tokens.is_empty() || a.golden_model.is_some();
    if !own {
        let published = client
            .get_version(&a.label)
            .await?
            .expected_outputs
            .map(|c| c.probes.len());
        if let Some(n) = published {
            println!(
                "post-update check: the {n} probes' expected outputs published with {} by its trainer",
                a.label
            );
            return Ok((None, false));
        }
    }
    let prompt = if a.prompt_tokens.is_empty() {
        mx_engine::golden::CHECK_PROMPT.to_vec()
    } else {
        a.prompt_tokens.clone()
    };
    let (expected, source) = match (&a.golden_model, a.golden_version) {
        (Some(m), Some(v)) => {
            println!(
                "post-update check: computing the demo's golden tokens of version {v} from {}",
                m.display()
            );
            let tokens = golden(m, v, &prompt, a.check_tokens)?;
            let source = format!(
                "the demo's golden tokens of version {v}, computed by mx refit from {}",
                m.display()
            );
            (tokens, source)
        }
        (None, None) if !a.expect_tokens.is_empty() => {
            (a.expect_tokens.clone(), "given to mx refit".to_string())
        }
        (None, None) => (Vec::new(), String::new()),
        _ => bail!("--golden-model and --golden-version go together"),
    };
    let n = if a.expect_tokens.is_empty() {
        a.check_tokens
    } else {
        u32::try_from(a.expect_tokens.len()).context("--expect-tokens: too many")?
    };
    if expected.is_empty() {
        println!(
            "post-update check: no expected outputs published with {}: each worker's {n}-token generation only has to return tokens",
            a.label
        );
    }
    let mut check = GenerationCheck::tokens(prompt, n, expected);
    check.source = source;
    Ok((Some(check), false))
}

/// The registered worker ids (`registered`: id and engine addresses) whose engines the
/// discovered workers (`discovered`: a name for messages and engine addresses) are, in
/// discovery order, each once: every spelling of one socket address matches
/// ([`mx_control::engine_addresses`]), and every rank of an instance registered with the
/// discovered engine is in the set (a refit calls their shared engine once).
///
/// # Errors
/// A discovered worker no registered worker's engine matches, naming it.
fn match_discovered(
    discovered: &[(String, Vec<String>)],
    registered: &[(String, Vec<String>)],
) -> anyhow::Result<Vec<String>> {
    let mut ids: Vec<String> = Vec::new();
    for (name, at) in discovered {
        let mut found = false;
        for (id, theirs) in registered {
            if theirs.iter().any(|a| at.contains(a)) {
                found = true;
                if !ids.contains(id) {
                    ids.push(id.clone());
                }
            }
        }
        if !found {
            bail!(
                "discovered worker {name} (reaching {}) is not registered with the control plane",
                at.join(", ")
            );
        }
    }
    Ok(ids)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;

    #[tokio::test]
    async fn discovered_engines_match_registered_ones_by_address() {
        let at = |u: &str| {
            let u = u.to_string();
            async move { mx_control::engine_addresses(&u).await.unwrap() }
        };
        let registered = vec![
            ("a-tp0".to_string(), at("http://127.0.0.1:8081").await),
            ("a-tp1".to_string(), at("http://localhost:8081/").await),
            ("b".to_string(), at("http://10.0.0.2:8081").await),
            ("c".to_string(), at("http://10.0.0.3:8081").await),
        ];
        let discovered = vec![
            ("1 (b)".to_string(), at("http://10.0.0.2:8081/").await),
            (
                "2 (a)".to_string(),
                at("http://[::ffff:127.0.0.1]:8081").await,
            ),
        ];
        assert_eq!(
            match_discovered(&discovered, &registered).unwrap(),
            vec!["b".to_string(), "a-tp0".into(), "a-tp1".into()]
        );
        let stray = vec![("9 (z)".to_string(), at("http://10.0.0.9:8081").await)];
        let e = match_discovered(&stray, &registered)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("9 (z)") && e.contains("10.0.0.9:8081") && e.contains("not registered"),
            "{e}"
        );
    }
}
