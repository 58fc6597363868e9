//! Reading an engine's version back before a worker is trusted again (issue 29, item 1).
//!
//! Registration refuses an engine that shares an address with a *connected* worker's, and a
//! refit asks an engine whose it is before changing it (`crate::identity`). Neither covers
//! everything: an engine without an identity route is called on the strength of its address,
//! a worker id registered while the engine's own worker was away is accepted, and the
//! ranks of one instance share their engine, so a refit of some ranks changes what the
//! others serve. So a refit's reach is state: when it begins, every worker outside its set
//! whose engine shares an address with an engine it calls is gated
//! (`State::admission`, [`crate::record::Record::ReadBack`]); once it has ended, the control
//! plane reads each such engine's version itself, through the engine's own route, and
//! journals what it answered. The worker is admitted again only if that is the fleet's
//! version. A read that fails (the engine is away, or its contract has no read-back, as
//! SGLang's) leaves it gated, and is tried again whenever the worker registers; a refit
//! of the worker that commits or rolls back cleanly also settles it.

use std::sync::Arc;
use std::time::Duration;

use mx_adapters::client_for;
use mx_layout::ResidentVersion;

use crate::observe;
use crate::record::Record;
use crate::shared::Shared;
use crate::state::State;

/// How long one read-back waits for the engine's answer.
const READ_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads back, in the background, the engines of the workers refit `refit` gated (call once it
/// has ended).
pub(crate) fn after_refit(shared: &Arc<Shared>, refit: u64) {
    for (worker_id, marked_by) in shared.read(|s| s.read_backs_due(Some(refit))) {
        tokio::spawn(read_back(Arc::clone(shared), worker_id, marked_by));
    }
}

/// Reads back, in the background, the engine of `worker_id` if an ended refit gated it (call
/// after it registered).
pub(crate) fn after_registration(shared: &Arc<Shared>, worker_id: &str) {
    let due = shared.read(|s| {
        s.read_backs_due(None)
            .into_iter()
            .find(|(w, _)| w == worker_id)
    });
    if let Some((worker_id, marked_by)) = due {
        tokio::spawn(read_back(Arc::clone(shared), worker_id, marked_by));
    }
}

/// Asks `worker_id`'s engine for its version and journals the answer; logs (and counts in
/// `mx_engine_read_backs_total`) why when it cannot.
async fn read_back(shared: Arc<Shared>, worker_id: String, refit: u64) {
    let result = match read(&shared, &worker_id).await {
        Ok(resident_version) => {
            let rec = Record::ReadBack {
                worker_id: worker_id.clone(),
                refit,
                resident_version: resident_version.clone(),
                at_ms: crate::refit::now_ms(),
            };
            match shared.mutate(rec).await {
                Ok(()) => {
                    tracing::info!(
                        worker = %worker_id,
                        refit,
                        resident = %resident_version.map_or_else(|| "none".to_string(), |v| v.to_string()),
                        "engine read back after a refit reached an address it shares"
                    );
                    "read"
                }
                Err(e) => {
                    tracing::warn!(worker = %worker_id, refit, "journaling a read-back: {e}");
                    "failed"
                }
            }
        }
        Err(why) => {
            tracing::warn!(
                worker = %worker_id,
                refit,
                "its engine's version could not be read back ({why}): it stays gated; read again when it registers"
            );
            "failed"
        }
    };
    metrics::counter!(observe::ENGINE_READ_BACKS_TOTAL, "result" => result).increment(1);
    shared.changes.send_modify(|n| *n = n.wrapping_add(1));
}

/// The version `worker_id`'s engine answers it holds (`None`: none).
async fn read(shared: &Shared, worker_id: &str) -> Result<Option<ResidentVersion>, String> {
    shared.acting().map_err(|e| e.to_string())?;
    let endpoint = shared
        .read(|s: &State| s.worker_engine(worker_id).map(|(e, _)| e))
        .flatten()
        .ok_or_else(|| format!("worker {worker_id} has no engine endpoint"))?;
    let engine = client_for(
        endpoint.api,
        &shared.http,
        &endpoint.system_url,
        endpoint.frontend.as_ref(),
        1,
        READ_BACK_TIMEOUT,
    );
    match engine.read_version().await {
        Ok(answer) => match answer.version {
            Some(v) => Ok(Some(v)),
            None => Err(format!(
                "the engine at {} answered no version: {}",
                endpoint.system_url, answer.message
            )),
        },
        Err(mx_adapters::Error::NoVersion { .. }) => Ok(None),
        Err(e) => Err(format!("the engine at {}: {e}", endpoint.system_url)),
    }
}
