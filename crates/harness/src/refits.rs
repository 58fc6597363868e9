//! Refit helpers shared by the harness and the `mx refit` command: golden tokens of a demo
//! version, waiting for a refit's end, printing one.

use std::time::Duration;

use anyhow::{bail, Context};
use mx_control::client::ControlClient;
use mx_control::Refit;

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
    let t = std::time::Instant::now();
    loop {
        match client.wait_refit(id, Duration::from_secs(2)).await {
            Ok((true, Some(r))) => return Ok(r),
            Ok((_, None)) => bail!("refit {id} is unknown to the control plane"),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("waiting for refit {id}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if t.elapsed() > timeout {
            bail!("refit {id} did not end within {timeout:?}");
        }
    }
}

/// Prints a refit: outcome, phases, and per worker previous -> resulting version with its calls.
pub fn print_refit(r: &Refit) {
    let short = |v: &Option<String>| match v {
        Some(v) if v.len() > 15 => format!("{}…", &v[..15]),
        Some(v) => v.clone(),
        None => "(none)".into(),
    };
    println!(
        "refit {} -> {} ({}): {}{}{}",
        r.id,
        r.spec.label,
        &r.target[..r.target.len().min(15)],
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
        println!(
            "  {:<10} {:<17} {:<17} {:>8.3} {:>8} {:>8} {:>8}  {tiers}{tokens}",
            id,
            short(&w.previous),
            short(&w.resident),
            w.stage_seconds,
            apply,
            verify,
            check
        );
    }
}
