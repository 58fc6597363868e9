//! The tonic service: converts requests at the edge, runs them through the journal and the state
//! machine, wakes command streams and waiters.

use std::collections::BTreeMap;

use crate::refit::{now_ms, Phase, Refit, RefitSpec, RefitWorker};
use crate::WorkerState;
use mx_layout::{ResidentVersion, VersionId};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::auth;
use crate::convert;
use crate::journal::Journal;
use crate::observe;
use crate::pb;
use crate::pb::control_plane_server::{ControlPlane, ControlPlaneServer};
use crate::state::{Record, State};
use crate::types::VersionState;
use crate::Error;

pub(crate) use crate::limits::MAX_MESSAGE_BYTES;

mod config;
mod replica;

pub use config::{ControlPlaneConfig, Security, TlsIdentity};
pub use replica::spawn_ha;

use crate::commit::lock;
use crate::shared::{Mailbox, Owner, Shared, StreamGuard};

/// The gRPC service.
struct Service {
    shared: Arc<Shared>,
}

type CommandStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::WorkerCommand, Status>> + Send + 'static>>;

/// Forwards the worker's outstanding command to its stream whenever it changes, until the stream
/// is replaced, the client goes away or the server shuts down.
async fn pump(
    shared: Arc<Shared>,
    worker_id: String,
    mailbox: Arc<Mailbox>,
    gen: u64,
    tx: mpsc::Sender<Result<pb::WorkerCommand, Status>>,
) {
    let mut closing = shared.closing.subscribe();
    let mut last_sent = None;
    mailbox.open_streams.fetch_add(1, Ordering::SeqCst);
    shared.changes.send_modify(|n| *n = n.wrapping_add(1));
    shared.testimony.notify_waiters();
    let _guard = StreamGuard {
        shared: Arc::clone(&shared),
        mailbox: Arc::clone(&mailbox),
    };
    loop {
        let notified = mailbox.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if mailbox.stream_gen.load(Ordering::SeqCst) != gen || *closing.borrow_and_update() {
            break;
        }
        let pending = shared.read_durable(|s| s.pending_command(&worker_id)).await;
        if let Some((seq, cmd)) = pending {
            if last_sent != Some(seq) {
                tracing::debug!(worker = %worker_id, ?cmd, "sending command");
                if tx.send(Ok(convert::command_pb(&cmd))).await.is_err() {
                    break;
                }
                last_sent = Some(seq);
                continue;
            }
        }
        tokio::select! {
            _ = &mut notified => {}
            _ = tx.closed() => break,
            _ = closing.changed() => {}
        }
    }
    tracing::debug!(worker = %worker_id, "command stream ended");
}

/// A worker id must be 1 to 128 characters of ASCII letters, digits, `.`, `_`, `-` and `:` (it
/// is printed in tables, journal records and log lines, and used in failpoint names). Checked
/// when a worker registers, not when the journal is replayed ([`crate::limits::worker_id`]).
fn check_worker_id(id: &str) -> Result<(), Error> {
    crate::limits::worker_id("worker_id", id)
}

fn wait_reached(state: Option<VersionState>, wanted: VersionState) -> bool {
    state.is_some_and(|s| s.reaches(wanted))
}

#[tonic::async_trait]
impl ControlPlane for Service {
    async fn declare_version(
        &self,
        req: Request<pb::DeclareVersionRequest>,
    ) -> Result<Response<pb::DeclareVersionResponse>, Status> {
        let r = req.into_inner();
        let rec = Record::Declare {
            label: convert::label(&r.label, "label")?,
            trainer_layout: convert::req_layout(&r.trainer_layout, "trainer_layout")?,
            tensors: convert::tensor_specs(&r.tensors, "tensors")?,
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::DeclareVersionResponse {}))
    }

    async fn publish(
        &self,
        req: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        if let Some(m) = &r.manifest {
            who.check_slot(m.slot)?;
        }
        let manifest = r
            .manifest
            .as_ref()
            .ok_or_else(|| Error::InvalidField {
                field: "manifest".into(),
                reason: "missing".into(),
            })
            .and_then(|m| convert::manifest(m, "manifest"))?;
        let label = convert::label(&r.label, "label")?;
        self.shared.hear(&manifest.agent_name);
        self.shared
            .mutate(Record::Publish {
                label: label.clone(),
                manifest,
            })
            .await?;
        let (state, digest) = self
            .shared
            .read_durable(|s| {
                s.version_info(&label)
                    .map(|v| (v.state, v.version_digest))
                    .ok_or(Error::UnknownVersion { label })
            })
            .await?;
        Ok(Response::new(pb::PublishResponse {
            state: convert::version_state_pb(state),
            version_digest: digest.map(|d| d.0.to_vec()).unwrap_or_default(),
        }))
    }

    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        check_worker_id(&r.worker_id)?;
        crate::limits::instance("instance", &r.instance)?;
        who.check_worker(&r.worker_id)?;
        let limits = r.model_limits.as_ref().map(convert::model_limits);
        let id = r.worker_id.clone();
        let incarnation = r.incarnation;
        let engine = r
            .engine
            .as_ref()
            .map(|e| convert::engine(e, "engine"))
            .transpose()?;
        let system_url = engine.as_ref().map(|e| e.system_url.clone());
        let addresses = match &system_url {
            Some(url) => crate::identity::engine_addresses(url)
                .await
                .map_err(|reason| Error::InvalidField {
                    field: "engine.system_url".into(),
                    reason,
                })?,
            None => Vec::new(),
        };
        let (instance, ranks) = (r.instance.clone(), r.ranks.clone());
        let rank_report = crate::ranks::RankReport {
            incarnation,
            resident: (!r.resident_version.is_empty())
                .then(|| ResidentVersion::parse(&r.resident_version)),
            error: String::new(),
        };
        let testimony = crate::testimony::Testimony {
            worker_id: id.clone(),
            resident: (!r.resident_version.is_empty())
                .then(|| ResidentVersion::parse(&r.resident_version)),
            last_refit: r.last_refit_id,
            epoch: r.leader_epoch,
        };
        let rec = Record::Register {
            layout: convert::req_layout(&r.layout, "layout")?,
            engine,
            resident_version: (!r.resident_version.is_empty())
                .then(|| ResidentVersion::parse(&r.resident_version)),
            worker_id: r.worker_id,
            instance: r.instance,
            ranks: r.ranks,
            addresses: addresses.clone(),
        };
        let mailbox = self.shared.mailbox(&id);
        let _one = mailbox.registering.lock().await;
        self.shared.check_takeover(
            &id,
            &mailbox,
            incarnation,
            system_url.as_deref(),
            &addresses,
            &instance,
            &ranks,
        )?;
        self.shared.mutate(rec).await?;
        let new_addresses = addresses.clone();
        let previous = std::mem::replace(
            &mut *lock(&mailbox.owner),
            Owner {
                incarnation,
                system_url,
                addresses,
                instance,
                ranks,
            },
        );
        lock(&self.shared.engines).set(&id, &previous.addresses, &new_addresses);
        if previous.incarnation != 0 && previous.incarnation != incarnation {
            tracing::warn!(
                worker = %id,
                incarnation = format_args!("{incarnation:#x}"),
                previous = format_args!("{:#x}", previous.incarnation),
                "worker id taken over by a new process: the previous one's command stream is gone, and it will be refused if it comes back"
            );
        }
        {
            let mut map = lock(&self.shared.limits);
            match limits {
                Some(l) => map.insert(id.clone(), l),
                None => map.remove(&id),
            };
        }
        self.shared.ranks.record(&id, rank_report);
        self.shared.testify(&testimony);
        crate::readback::after_registration(&self.shared, &id);
        Ok(Response::new(pb::RegisterWorkerResponse {}))
    }

    async fn accept_journal(
        &self,
        req: Request<pb::AcceptJournalRequest>,
    ) -> Result<Response<pb::AcceptJournalResponse>, Status> {
        let reason = req.into_inner().reason;
        let (accepted, (versions, refit_floor), stopped) = {
            let h = lock(&self.shared.halt);
            if !h.halted() {
                return Err(Status::failed_precondition(
                    "nothing to accept: the fleet has not contradicted the journal",
                ));
            }
            (h.contradictions.clone(), h.accepted(), h.stopped_refit)
        };
        self.shared
            .mutate(Record::AcceptJournal {
                versions,
                refit_floor,
                reason: reason.clone(),
                at_ms: crate::refit::now_ms(),
            })
            .await?;
        {
            let mut h = lock(&self.shared.halt);
            h.contradictions.retain(|c| !accepted.contains(c));
            if !h.halted() {
                h.stopped_refit = None;
            }
        }
        let words: Vec<String> = accepted.iter().map(ToString::to_string).collect();
        tracing::warn!(reason, accepted = ?words, "the journal was accepted as it stands: acting on the fleet again");
        let open = self.shared.read(State::open_refit_id);
        let resumed = stopped.filter(|id| open == Some(*id) && self.shared.acting().is_ok());
        if let Some(id) = resumed {
            tokio::spawn(crate::driver::drive(Arc::clone(&self.shared), id, true));
        }
        self.shared.changes.send_modify(|n| *n = n.wrapping_add(1));
        Ok(Response::new(pb::AcceptJournalResponse {
            accepted: words,
            resumed_refit: resumed.unwrap_or(0),
        }))
    }

    async fn retire_worker(
        &self,
        req: Request<pb::RetireWorkerRequest>,
    ) -> Result<Response<pb::RetireWorkerResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        let is_worker = who.role() == Some(auth::Role::Worker);
        if is_worker {
            who.check_worker(&r.worker_id)?;
        }
        let mailbox = self.shared.mailbox(&r.worker_id);
        let _one = mailbox.registering.lock().await;
        let owner = lock(&mailbox.owner).incarnation;
        let own = r.incarnation != 0 && r.incarnation == owner;
        if is_worker && !own {
            return Err(Error::WorkerIdInUse {
                worker_id: r.worker_id,
                reason: format!(
                    "a worker retires an id only from the process of its last registration (incarnation {owner:#x}, this call {:#x})",
                    r.incarnation
                ),
            }
            .into());
        }
        if !own && self.shared.connected(&r.worker_id) {
            return Err(Error::WorkerIdInUse {
                worker_id: r.worker_id,
                reason: "its command stream is connected: stop the worker (it retires its id on a clean exit) or retire it once it departed".into(),
            }
            .into());
        }
        self.shared.retire(&r.worker_id, r.reason).await?;
        tracing::info!(worker = %r.worker_id, "worker id retired");
        Ok(Response::new(pb::RetireWorkerResponse {}))
    }

    async fn list_layouts(
        &self,
        req: Request<pb::ListLayoutsRequest>,
    ) -> Result<Response<pb::ListLayoutsResponse>, Status> {
        let r = req.into_inner();
        crate::limits::name("agent_name", &r.agent_name)?;
        self.shared.hear(&r.agent_name);
        let layouts = self.shared.read_durable(State::layouts).await;
        Ok(Response::new(pb::ListLayoutsResponse {
            layouts: layouts.iter().map(convert::layout_pb).collect(),
        }))
    }

    type WatchCommandsStream = CommandStream;

    async fn watch_commands(
        &self,
        req: Request<pb::WatchCommandsRequest>,
    ) -> Result<Response<Self::WatchCommandsStream>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        let worker_id = r.worker_id;
        who.check_worker(&worker_id)?;
        if !self.shared.read(|s| s.has_worker(&worker_id)) {
            return Err(Error::UnknownWorker { worker_id }.into());
        }
        let mailbox = self.shared.mailbox(&worker_id);
        let owner = lock(&mailbox.owner).incarnation;
        if owner != r.incarnation {
            // Only the process of the last accepted registration may follow the id's commands
            // (an older one that lost the id learns it here and stops serving).
            return Err(Error::WorkerIdInUse {
                worker_id,
                reason: format!(
                    "it was registered last by incarnation {owner:#x}, this stream is incarnation {:#x}",
                    r.incarnation
                ),
            }
            .into());
        }
        let gen = mailbox.stream_gen.fetch_add(1, Ordering::SeqCst) + 1;
        // Wake (and so end) the stream this one replaces.
        mailbox.notify.notify_waiters();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(pump(Arc::clone(&self.shared), worker_id, mailbox, gen, tx));
        let mut resp =
            Response::new(Box::pin(ReceiverStream::new(rx)) as Self::WatchCommandsStream);
        if let Some(e) = self.shared.epoch {
            // A worker refuses a stream from a lower epoch than it has seen: a deposed leader's.
            resp.metadata_mut().insert(
                mx_adapters::EPOCH_HEADER,
                tonic::metadata::MetadataValue::from(e),
            );
        }
        Ok(resp)
    }

    async fn stage(
        &self,
        req: Request<pb::StageRequest>,
    ) -> Result<Response<pb::StageResponse>, Status> {
        let r = req.into_inner();
        convert::label(&r.label, "label")?;
        // A worker in an open refit is staged by that refit's driver (which journals its own
        // Stage); a stage from outside would replace what the refit is about to apply.
        let busy = self.shared.read(|s| {
            r.worker_ids
                .iter()
                .find_map(|w| s.open_refit_of_worker(w).map(|r| (w.clone(), r)))
        });
        if let Some((w, (id, label))) = busy {
            return Err(Error::Refit {
                id,
                reason: format!(
                    "worker {w} is in this open refit to {label}: the refit stages it (stage again after it ended)"
                ),
            }
            .into());
        }
        self.shared
            .mutate(Record::Stage {
                label: r.label,
                worker_ids: r.worker_ids,
            })
            .await?;
        Ok(Response::new(pb::StageResponse {}))
    }

    async fn report_staged(
        &self,
        req: Request<pb::StagedReport>,
    ) -> Result<Response<pb::ReportStagedResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        who.check_worker(&r.worker_id)?;
        let report = convert::staged(&r, "")?;
        self.shared.mutate(Record::Staged { report }).await?;
        Ok(Response::new(pb::ReportStagedResponse {}))
    }

    async fn report_resident(
        &self,
        req: Request<pb::ResidentReport>,
    ) -> Result<Response<pb::ReportResidentResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        check_worker_id(&r.worker_id)?;
        who.check_worker(&r.worker_id)?;
        if r.error.len() > crate::ranks::MAX_ERROR_BYTES
            || !r.error.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
        {
            return Err(Error::InvalidField {
                field: "error".into(),
                reason: format!(
                    "printable ASCII of at most {} bytes",
                    crate::ranks::MAX_ERROR_BYTES
                ),
            }
            .into());
        }
        // Looked up, not created: a report names a registered worker.
        let owner = lock(&self.shared.mail)
            .get(&r.worker_id)
            .map_or(0, |m| lock(&m.owner).incarnation);
        if r.incarnation == 0 || r.incarnation != owner {
            return Err(Status::failed_precondition(format!(
                "worker {}: incarnation {:#x} is not the one of its last registration ({owner:#x})",
                r.worker_id, r.incarnation
            )));
        }
        let resident =
            (!r.resident_version.is_empty()).then(|| ResidentVersion::parse(&r.resident_version));
        tracing::info!(
            worker = %r.worker_id,
            resident = %resident.as_ref().map_or_else(|| "none".to_string(), ToString::to_string),
            error = %r.error,
            "the engine's rank reported what it holds"
        );
        self.shared.ranks.record(
            &r.worker_id,
            crate::ranks::RankReport {
                incarnation: r.incarnation,
                resident,
                error: r.error,
            },
        );
        Ok(Response::new(pb::ReportResidentResponse {}))
    }

    async fn get_version(
        &self,
        req: Request<pb::GetVersionRequest>,
    ) -> Result<Response<pb::VersionInfo>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        let label = convert::label(&r.label, "label")?;
        let want = r
            .want
            .as_ref()
            .map(|w| convert::want(w, "want"))
            .transpose()?;
        let fanout = &self.shared.fanout;
        let info = self
            .shared
            .read_durable(|s| match &want {
                None => s.version_info(&label).map(Ok),
                Some(w) => s
                    .version_sources(&label)
                    .map(|(info, src)| crate::fanout::answer(fanout, info, src, w)),
            })
            .await
            .ok_or(Error::UnknownVersion { label })??;
        Ok(Response::new(redact(convert::version_info_pb(&info), &who)))
    }

    async fn get_status(
        &self,
        req: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::FleetStatus>, Status> {
        let digests = req.into_inner().digests;
        let mut status = self.shared.read_durable(State::fleet_status).await;
        status.halted = self.shared.halt_reason();
        self.shared.fill_liveness(&mut status.versions);
        for w in &mut status.workers {
            w.connected = self.shared.connected(&w.worker_id);
            // Admission also needs an open command stream: a worker the control plane cannot
            // reach cannot be gated by the next refit.
            if w.admitted && !w.connected {
                w.admitted = false;
                w.gate = Some(crate::Gate::Disconnected);
                w.admission = "disconnected from the control plane (its process is gone or cut off: restart it, or `mx retire` its id)".into();
            }
            if !digests {
                // Per-tensor digests are most of a status (thousands per worker): on request.
                if let Some(s) = &mut w.last_staged {
                    s.ranks.clear();
                }
            }
        }
        Ok(Response::new(convert::fleet_pb(&status)))
    }

    async fn wait_workers(
        &self,
        req: Request<pb::WaitWorkersRequest>,
    ) -> Result<Response<pb::WaitWorkersResponse>, Status> {
        let r = req.into_inner();
        let want = convert::worker_state_pb(convert::worker_state(r.state, "state")?);
        // The probe runs after every state change (thousands while a fleet stages): it only
        // looks, without copies; the answer is built once, at the end.
        let want_state = convert::worker_state(r.state, "state")?;
        self.shared
            .long_poll(r.timeout_ms, |s| {
                let mut reached = true;
                for id in &r.worker_ids {
                    match s.worker_stage(id) {
                        None | Some((WorkerState::Failed, _)) => return (true, ()),
                        Some((state, label)) => {
                            reached &= state == want_state && label == Some(r.label.as_str());
                        }
                    }
                }
                (reached, ())
            })
            .await?;
        let workers: Vec<pb::WorkerBrief> = self
            .shared
            .read_durable(|s| {
                r.worker_ids
                    .iter()
                    .map(|id| {
                        let (state, label, error) = s.worker_brief(id).unwrap_or((
                            WorkerState::Failed,
                            None,
                            Some("not registered".into()),
                        ));
                        pb::WorkerBrief {
                            worker_id: id.clone(),
                            state: convert::worker_state_pb(state),
                            label: label.unwrap_or_default(),
                            error: error.unwrap_or_default(),
                        }
                    })
                    .collect()
            })
            .await;
        let reached = workers
            .iter()
            .all(|b| b.state == want && b.label == r.label);
        Ok(Response::new(pb::WaitWorkersResponse { reached, workers }))
    }

    async fn refit(
        &self,
        req: Request<pb::RefitRequest>,
    ) -> Result<Response<pb::RefitResponse>, Status> {
        let req = req.into_inner();
        let spec = convert::refit_spec(&req)?;
        let refit_id = start_refit(&self.shared, spec, req.request_id).await?;
        Ok(Response::new(pb::RefitResponse { refit_id }))
    }

    async fn wait_refit(
        &self,
        req: Request<pb::WaitRefitRequest>,
    ) -> Result<Response<pb::WaitRefitResponse>, Status> {
        let r = req.into_inner();
        // The probe runs after every state change: it only looks; the record (which grows with
        // every engine call of the refit) is copied once, at the end.
        let id = self
            .shared
            .long_poll(r.timeout_ms, |s| {
                let id = if r.refit_id == 0 {
                    s.next_refit_id().saturating_sub(1)
                } else {
                    r.refit_id
                };
                (s.refit(id).is_none_or(|x| x.outcome.is_some()), id)
            })
            .await?;
        let refit = self.shared.read_durable(|s| s.refit(id).cloned()).await;
        Ok(Response::new(pb::WaitRefitResponse {
            ended: refit.as_ref().is_some_and(|x| x.outcome.is_some()),
            refit: refit.as_ref().map(convert::refit_pb),
        }))
    }

    async fn wait_version(
        &self,
        req: Request<pb::WaitVersionRequest>,
    ) -> Result<Response<pb::WaitVersionResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        convert::label(&r.label, "label")?;
        let wanted = convert::version_state(r.state, "state")?;
        let reached = self
            .shared
            .long_poll(r.timeout_ms, |s| {
                let reached = wait_reached(s.version_state(&r.label), wanted);
                (reached, reached)
            })
            .await?;
        // The full record (manifests) only once, at the end.
        let info = self.shared.read_durable(|s| s.version_info(&r.label)).await;
        Ok(Response::new(pb::WaitVersionResponse {
            reached,
            version: info
                .as_ref()
                .map(|i| redact(convert::version_info_pb(i), &who)),
        }))
    }

    async fn wait_released(
        &self,
        req: Request<pb::WaitReleasedRequest>,
    ) -> Result<Response<pb::WaitReleasedResponse>, Status> {
        let r = req.into_inner();
        convert::label(&r.label, "label")?;
        let release = self
            .shared
            .long_poll(r.timeout_ms, |s| {
                let release = s.release_of(&r.label);
                (release.is_some(), release)
            })
            .await?;
        Ok(Response::new(pb::WaitReleasedResponse {
            release: release.as_ref().map(convert::release_pb),
        }))
    }

    async fn release_version(
        &self,
        req: Request<pb::ReleaseVersionRequest>,
    ) -> Result<Response<pb::ReleaseVersionResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        who.check_slot(r.slot)?;
        let rec = Record::Release {
            label: convert::label(&r.label, "label")?,
            slot: r.slot,
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::ReleaseVersionResponse {}))
    }

    async fn register_artifact(
        &self,
        req: Request<pb::RegisterArtifactRequest>,
    ) -> Result<Response<pb::RegisterArtifactResponse>, Status> {
        let r = req.into_inner();
        let artifact = r
            .artifact
            .as_ref()
            .ok_or_else(|| Error::InvalidField {
                field: "artifact".into(),
                reason: "missing".into(),
            })
            .and_then(|a| convert::artifact(a, "artifact"))?;
        let rec = Record::Artifact {
            label: convert::label(&r.label, "label")?,
            artifact,
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::RegisterArtifactResponse {}))
    }

    async fn publish_expected_outputs(
        &self,
        req: Request<pb::PublishExpectedOutputsRequest>,
    ) -> Result<Response<pb::PublishExpectedOutputsResponse>, Status> {
        let r = req.into_inner();
        let mut outputs = r
            .outputs
            .as_ref()
            .ok_or_else(|| Error::InvalidField {
                field: "outputs".into(),
                reason: "missing".into(),
            })
            .and_then(|c| convert::generation_check(c, "outputs"))?;
        if outputs.tie_margin == 0.0 && outputs.probes.iter().any(|p| !p.margins.is_empty()) {
            outputs.tie_margin = crate::check::DEFAULT_TIE_MARGIN;
        }
        let rec = Record::ExpectedOutputs {
            label: convert::label(&r.label, "label")?,
            outputs,
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::PublishExpectedOutputsResponse {}))
    }

    async fn serve_peer(
        &self,
        req: Request<pb::ServePeerRequest>,
    ) -> Result<Response<pb::ServePeerResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        who.check_worker(&r.worker_id)?;
        let manifest = r
            .manifest
            .as_ref()
            .ok_or_else(|| Error::InvalidField {
                field: "manifest".into(),
                reason: "missing".into(),
            })
            .and_then(|m| convert::manifest(m, "manifest"))?;
        let rec = Record::Peer {
            label: convert::label(&r.label, "label")?,
            worker_id: convert::non_empty(&r.worker_id, "worker_id")?,
            manifest,
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::ServePeerResponse {}))
    }

    async fn withdraw_peer(
        &self,
        req: Request<pb::WithdrawPeerRequest>,
    ) -> Result<Response<pb::WithdrawPeerResponse>, Status> {
        let who = auth::principal(&req)?;
        let r = req.into_inner();
        who.check_worker(&r.worker_id)?;
        let rec = Record::PeerWithdraw {
            worker_id: convert::non_empty(&r.worker_id, "worker_id")?,
            label: if r.label.is_empty() {
                None
            } else {
                Some(convert::label(&r.label, "label")?)
            },
        };
        self.shared.mutate(rec).await?;
        Ok(Response::new(pb::WithdrawPeerResponse {}))
    }
}

/// Validates a refit request, journals its BEGIN and starts its driver; returns its id. A refit
/// of the version every worker of the set already runs, right after a committed refit of the
/// same set, changes nothing and answers that refit's id (idempotent).
///
/// `request_id` (0: none) names the request: a request whose id a refit already carries is
/// answered that refit's id and starts nothing, so a client that lost the answer (a leader
/// that died after journaling the BEGIN) can send it again, to any replica.
async fn start_refit(
    shared: &Arc<Shared>,
    mut spec: RefitSpec,
    request_id: u64,
) -> Result<u64, Error> {
    // One request at a time from here to its BEGIN: a repeated request waits for the first
    // and finds its id.
    let _one = shared.starting.lock().await;
    if request_id != 0 {
        let known = shared.read(|s| {
            s.refits()
                .find(|r| r.request_id == request_id)
                .map(|r| r.id)
        });
        if let Some(id) = known {
            tracing::info!(
                refit = id,
                request_id,
                "a repeated refit request: answered its refit"
            );
            return Ok(id);
        }
    }
    // Right after a start (or a failover), the set's workers are given the rest of the
    // testimony wait to register again before one that is not back counts as missing.
    shared.await_testimony(&spec.worker_ids).await;
    shared.acting()?;
    let mut seen = std::collections::BTreeSet::new();
    for (i, w) in spec.worker_ids.iter().enumerate() {
        if w.is_empty() || !seen.insert(w.clone()) {
            return Err(Error::InvalidField {
                field: format!("worker_ids[{i}]"),
                reason: format!("empty or duplicate worker id {w:?}"),
            });
        }
    }
    if seen.is_empty() {
        return Err(Error::InvalidField {
            field: "worker_ids".into(),
            reason: "empty worker set".into(),
        });
    }
    spec.worker_ids = seen.into_iter().collect();
    // Without a check of its own, a refit checks against the outputs the version's trainer
    // published (`crate::check`), unless it asked for none.
    if spec.check.is_none() && !spec.no_check {
        let label = spec.label.clone();
        spec.check = shared
            .read(|s| s.expected_outputs(&label).cloned())
            .map(|mut c| {
                c.source = format!("published with {label} by its trainer");
                c
            });
    }
    // The post-update check must be one every engine of the set accepts: refused now, before
    // anything pauses, rather than after the fleet applied and must roll back.
    if let Some(check) = &spec.check {
        let limits = lock(&shared.limits);
        for w in &spec.worker_ids {
            if let Some(Err((field, reason))) = limits.get(w).map(|l| l.check(check)) {
                return Err(Error::InvalidField {
                    field,
                    reason: format!("{reason} of worker {w}; nothing was paused"),
                });
            }
        }
    }
    let begin = shared
        .read_durable(|s| -> Result<Refit, Error> {
            let info = s
                .version_info(&spec.label)
                .ok_or_else(|| Error::UnknownVersion {
                    label: spec.label.clone(),
                })?;
            let digest = info.version_digest.ok_or_else(|| Error::VersionState {
                label: spec.label.clone(),
                state: info.state,
                reason: "a refit needs a READY version".into(),
            })?;
            let target = VersionId(digest);
            let mut workers = BTreeMap::new();
            let mut dropped = Vec::new();
            for w in &spec.worker_ids {
                let (engine, resident) =
                    s.worker_engine(w).ok_or_else(|| Error::UnknownWorker {
                        worker_id: w.clone(),
                    })?;
                if engine.is_none() {
                    return Err(Error::InvalidField {
                        field: "worker_ids".into(),
                        reason: format!(
                            "worker {w} registered no engine routes: it cannot be refitted"
                        ),
                    });
                }
                if !shared.connected(w) {
                    dropped.push((w.clone(), "not connected to the control plane".to_string()));
                    if spec.allow_partial {
                        continue;
                    }
                }
                workers.insert(
                    w.clone(),
                    RefitWorker {
                        previous: resident.clone(),
                        resident,
                        stage_seconds: 0.0,
                        stage_bytes: 0,
                        calls: Vec::new(),
                        reregistered: None,
                    },
                );
            }
            // A refit of the version every worker already holds is not skipped: it runs
            // verify-only (VERIFY reads each engine's version back, CHECK runs the post-update
            // generation), so a worker that only claims the version is caught.
            if workers.is_empty() {
                return Err(Error::InvalidField {
                    field: "worker_ids".into(),
                    reason: format!(
                        "no worker of the set is connected ({} dropped): nothing to refit",
                        dropped.len()
                    ),
                });
            }
            spec.worker_ids = workers.keys().cloned().collect();
            Ok(Refit {
                id: s.next_refit_id(),
                digest,
                target,
                dropped,
                phase: Phase::Stage,
                phases: vec![(Phase::Stage, now_ms())],
                workers,
                outcome: None,
                reason: String::new(),
                started_ms: now_ms(),
                ended_ms: None,
                recovered: false,
                spec: spec.clone(),
                trimmed: None,
                request_id,
            })
        })
        .await?;
    let refit = begin;
    let id = refit.id;
    shared
        .mutate(Record::RefitBegin {
            refit: Box::new(refit),
        })
        .await?;
    tokio::spawn(crate::driver::drive(Arc::clone(shared), id, false));
    Ok(id)
}

/// Replays the journal and returns the service with its shared state; starts the recovery of a
/// refit the journal left open.
fn build(cfg: &ControlPlaneConfig) -> Result<(ControlPlaneServer<Service>, Arc<Shared>), Error> {
    cfg.security.check(cfg.listen)?;
    let shared = Arc::new(Shared::open(
        &cfg.journal_path,
        cfg.security.engine_token.as_deref(),
        cfg.compaction,
    )?);
    Ok(serve_shared(shared))
}

/// The service over `shared`; starts the recovery of a refit its journal left open.
fn serve_shared(shared: Arc<Shared>) -> (ControlPlaneServer<Service>, Arc<Shared>) {
    if let Some(id) = shared.read(State::open_refit_id) {
        tokio::spawn(crate::driver::drive(Arc::clone(&shared), id, true));
    }
    let svc = ControlPlaneServer::new(Service {
        shared: Arc::clone(&shared),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    (svc, shared)
}

async fn run(
    svc: ControlPlaneServer<Service>,
    shared: Arc<Shared>,
    security: Security,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Nagle + delayed ACKs would add ~40 ms to small RPCs on loopback: set TCP_NODELAY on every
    // accepted connection.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    run_on(svc, shared, security, incoming, addr, shutdown).await
}

/// The retention rule ([`crate::snapshot::Compaction::retire_departed_after`]): every quarter of
/// `after` (at most 30 s), retires the registered ids whose command stream has been closed
/// longer than `after` and that no open refit holds. Stops when the server closes.
async fn retire_departed(shared: Arc<Shared>, after: std::time::Duration) {
    use std::time::{Duration, Instant};
    let tick = (after / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
    let mut away: std::collections::HashMap<String, Instant> = Default::default();
    let mut closing = shared.closing.subscribe();
    loop {
        tokio::select! {
            () = tokio::time::sleep(tick) => {}
            _ = closing.changed() => {}
        }
        if *closing.borrow() {
            return;
        }
        let ids = shared.read(State::worker_ids);
        away.retain(|id, _| ids.binary_search(id).is_ok());
        for id in ids {
            if shared.connected(&id) {
                away.remove(&id);
                continue;
            }
            let since = *away.entry(id.clone()).or_insert_with(Instant::now);
            if since.elapsed() < after || shared.read(|s| s.open_refit_of_worker(&id).is_some()) {
                continue;
            }
            let mailbox = shared.mailbox(&id);
            let _one = mailbox.registering.lock().await;
            if shared.connected(&id) {
                continue;
            }
            let reason = format!(
                "departed for more than {} s (retire_departed_after)",
                after.as_secs_f64()
            );
            match shared.retire(&id, reason).await {
                Ok(()) => {
                    away.remove(&id);
                    tracing::info!(worker = %id, "departed worker id retired");
                }
                Err(e) => tracing::warn!(worker = %id, "retiring a departed worker id: {e}"),
            }
        }
    }
}

/// [`run`] over accepted connections from `incoming`.
async fn run_on(
    svc: ControlPlaneServer<Service>,
    shared: Arc<Shared>,
    security: Security,
    incoming: impl tokio_stream::Stream<Item = Result<tokio::net::TcpStream, std::io::Error>>
        + Send
        + 'static,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    if let Some(after) = shared.retire_departed_after {
        tokio::spawn(retire_departed(Arc::clone(&shared), after));
    }
    let closing = async move {
        shutdown.await;
        tracing::info!("control plane shutting down");
        shared.closing.send_replace(true);
    };
    let server = transport(&security, addr)?;
    server
        .tcp_nodelay(true)
        // A worker whose host vanished without closing its connection must not hold its id
        // (and block its replacement) for longer than a missed ping.
        .http2_keepalive_interval(Some(crate::client::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(crate::client::KEEPALIVE_INTERVAL))
        .layer(auth::AuthLayer {
            table: security.tokens.clone(),
        })
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, closing)
        .await
        .map_err(|source| Error::Transport {
            addr: addr.to_string(),
            source,
        })
}

/// The gRPC server builder for `addr`: TLS with `security.tls` when set (the leader and a
/// follower of an HA control plane speak the same protocol on the same port, so a client's
/// TLS settings work with either).
///
/// # Errors
/// [`Error::Transport`] when the certificate or key is refused.
pub(crate) fn transport(
    security: &Security,
    addr: SocketAddr,
) -> Result<tonic::transport::Server, Error> {
    let mut server = tonic::transport::Server::builder();
    if let Some(id) = &security.tls {
        auth::install_crypto_provider();
        server = server
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(&id.cert_pem, &id.key_pem),
            ))
            .map_err(|source| Error::Transport {
                addr: addr.to_string(),
                source,
            })?;
    }
    Ok(server)
}

/// Binds `addr` (port 0 picks one): the listener and the address bound.
pub(crate) async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    Ok((listener, bound))
}

/// Replays the journal, then serves the control plane on `cfg.listen` until `shutdown`
/// completes (open command streams and waits end then).
///
/// # Errors
/// [`Error::JournalIo`], [`Error::JournalCorrupt`] or [`Error::Replay`] when the journal cannot be
/// replayed; [`Error::Bind`] when the address cannot be bound; [`Error::Transport`] when serving
/// fails.
pub async fn serve(
    cfg: ControlPlaneConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let (svc, shared) = build(&cfg)?;
    let (listener, bound) = bind(cfg.listen).await?;
    log_listening(&cfg, bound);
    run(svc, shared, cfg.security, listener, bound, shutdown).await
}

fn log_listening(cfg: &ControlPlaneConfig, bound: SocketAddr) {
    let sec = &cfg.security;
    let auth = match &sec.tokens {
        Some(t) => format!("bearer tokens ({} principals)", t.len()),
        None => "NONE".to_string(),
    };
    let tls = if sec.tls.is_some() { "on" } else { "off" };
    tracing::info!(addr = %bound, journal = %cfg.journal_path.display(), %auth, tls, "control plane listening");
    if sec.tokens.is_none() {
        tracing::warn!(
            addr = %bound,
            "serving WITHOUT authentication (--insecure-loopback): any local process can \
             publish, register workers and refit the fleet"
        );
    }
}

/// What a caller gets of a version's record: NIXL agent metadata only for workers, manifests
/// only for workers and publishers ([`crate::auth`]).
fn redact(mut info: pb::VersionInfo, who: &auth::Principal) -> pb::VersionInfo {
    if !who.sees_manifests() {
        info.manifests.clear();
        info.peers.clear();
        info.proof = None;
    } else if !who.sees_sources() {
        for m in &mut info.manifests {
            m.agent_metadata.clear();
        }
        for p in &mut info.peers {
            if let Some(m) = &mut p.manifest {
                m.agent_metadata.clear();
            }
        }
    }
    info
}

/// A control plane running in a background task (see [`spawn`]).
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
    shared: std::sync::Weak<Shared>,
    /// The token table the server authenticates against (shared with it), for
    /// [`ServerHandle::reload_tokens`].
    tokens: Option<Arc<auth::TokenTable>>,
}

impl ServerHandle {
    /// Runs the server `serve` returns in a background task: `serve` is given the future that
    /// resolves when the handle is shut down or dropped (a dropped handle stops the server too).
    fn start<Fut>(
        bound: SocketAddr,
        shared: std::sync::Weak<Shared>,
        serve: impl FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    ) -> ServerHandle
    where
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = Box::pin(async move {
            let _ = stopped.await;
        });
        ServerHandle {
            addr: bound,
            stop: Some(stop),
            task: tokio::spawn(serve(shutdown)),
            shared,
            tokens: None,
        }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Reads the token file again (`mx control` does on SIGHUP): when it parses whole, every
    /// later call is authenticated against it (added principals get in, removed ones are
    /// refused; calls in flight keep their principal), and a `tokens_reloaded` record (the
    /// number of principals and the file's blake3, no secret) is journaled where this replica
    /// leads. A file that does not parse changes nothing.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and line, or saying the control plane runs without a
    /// token file.
    pub async fn reload_tokens(&self) -> Result<auth::Reloaded, Error> {
        let table = self.tokens.as_ref().ok_or_else(|| Error::Config {
            what: "token file".into(),
            reason: "this control plane runs without --tokens: nothing to reload".into(),
        })?;
        let r = table.reload()?;
        if let Some(shared) = self.shared.upgrade() {
            let rec = Record::TokensReloaded {
                principals: r.after as u64,
                file_digest: r.file_digest.clone(),
                at_ms: crate::refit::now_ms(),
            };
            if let Err(e) = shared.mutate(rec).await {
                tracing::warn!("token file reloaded, but not journaled: {e}");
            }
        }
        tracing::warn!(
            before = r.before,
            after = r.after,
            file = %r.file_digest,
            "token file reloaded"
        );
        Ok(r)
    }

    /// Sets the token table [`ServerHandle::reload_tokens`] reloads.
    pub(crate) fn with_tokens(mut self, tokens: Option<Arc<auth::TokenTable>>) -> ServerHandle {
        self.tokens = tokens;
        self
    }

    /// The control plane's readiness and fleet gauges, for [`observe::router`]: ready while it
    /// serves (journal replayed, listening, not shutting down); each scrape sets
    /// [`observe::WORKERS`], [`observe::WORKERS_CONNECTED`], [`observe::WORKERS_ADMITTED`],
    /// [`observe::VERSIONS`] and [`observe::REFIT_OPEN`].
    pub fn probe(&self) -> Arc<dyn observe::Probe> {
        Arc::new(ControlProbe {
            shared: self.shared.clone(),
        })
    }

    /// Stops the server and waits until it has stopped (journal closed).
    ///
    /// # Errors
    /// The error the server ended with, or [`Error::Task`] when its task panicked.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        if let Some(stop) = self.stop.take() {
            // The receiver is gone only if the server already ended; its result tells why.
            let _ = stop.send(());
        }
        (&mut self.task).await.map_err(|e| Error::Task {
            reason: e.to_string(),
        })?
    }
}

/// Replays the journal, binds `cfg.listen` (port 0 picks one) and serves in a background task.
/// Returns the bound address and a handle to stop it.
///
/// # Errors
/// As [`serve`], for replay and binding.
pub async fn spawn(cfg: ControlPlaneConfig) -> Result<(SocketAddr, ServerHandle), Error> {
    let (svc, shared) = build(&cfg)?;
    let (listener, bound) = bind(cfg.listen).await?;
    log_listening(&cfg, bound);
    let tokens = cfg.security.tokens.clone();
    let handle = ServerHandle::start(bound, Arc::downgrade(&shared), |shutdown| {
        run(svc, shared, cfg.security, listener, bound, shutdown)
    })
    .with_tokens(tokens);
    Ok((bound, handle))
}

/// [`ServerHandle::probe`].
struct ControlProbe {
    shared: std::sync::Weak<Shared>,
}

impl observe::Probe for ControlProbe {
    fn ready(&self) -> Result<(), String> {
        match self.shared.upgrade() {
            None => Err("the control plane has stopped".into()),
            Some(s) if *s.closing.borrow() => Err("the control plane is shutting down".into()),
            Some(_) => Ok(()),
        }
    }

    fn refresh(&self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        // Connections first (the mail lock), then the state (the core lock): never both held.
        let connected = shared.connected_ids();
        let t = shared.read(|s| s.tallies(|id| connected.contains(id)));
        for w in [
            WorkerState::Idle,
            WorkerState::Staging,
            WorkerState::Staged,
            WorkerState::Failed,
        ] {
            let n = t.workers.get(&w).copied().unwrap_or(0);
            metrics::gauge!(observe::WORKERS, "state" => w.to_string().to_lowercase())
                .set(n as f64);
        }
        metrics::gauge!(observe::WORKERS_CONNECTED).set(t.connected as f64);
        metrics::gauge!(observe::WORKERS_ADMITTED).set(t.admitted as f64);
        for g in crate::Gate::ALL {
            let n = t.gated.get(&g).copied().unwrap_or(0);
            metrics::gauge!(observe::WORKERS_GATED, "reason" => g.as_str()).set(n as f64);
        }
        // Publishers of versions still served (not released).
        let mut versions = shared.read(|s| s.version_summaries(true));
        shared.fill_liveness(&mut versions);
        for l in [
            crate::Liveness::Live,
            crate::Liveness::Silent,
            crate::Liveness::Unknown,
        ] {
            let n = versions
                .iter()
                .flat_map(|v| &v.publishers)
                .filter(|p| p.liveness == l && p.retired_by.is_none())
                .count();
            metrics::gauge!(observe::PUBLISHERS, "liveness" => l.as_str()).set(n as f64);
        }
        for v in [
            VersionState::Declared,
            VersionState::Publishing,
            VersionState::Ready,
            VersionState::Committing,
            VersionState::Committed,
        ] {
            let n = t.versions.get(&v).copied().unwrap_or(0);
            metrics::gauge!(observe::VERSIONS, "state" => v.to_string().to_lowercase())
                .set(n as f64);
        }
        metrics::gauge!(observe::REFIT_OPEN).set(if t.refit_open { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn worker_ids_are_checked_at_registration() {
        for ok in ["w0", "sim-00012", "node-3.gpu_7", "pod:7", &"a".repeat(128)] {
            assert!(check_worker_id(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "empty worker id"),
            ("w 9/../x", "has ' '"),
            ("w/1", "has '/'"),
            ("wé", "has 'é'"),
        ] {
            let e = check_worker_id(bad).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidField { field, reason } if field == "worker_id" && reason.contains(why)),
                "{bad:?}: {e}"
            );
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
        }
        let e = check_worker_id(&"a".repeat(129)).unwrap_err();
        assert!(e.to_string().contains("129 characters, at most 128"), "{e}");
    }
}
