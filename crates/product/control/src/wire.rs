//! The control plane's wire messages from raw bytes, for fuzzing and tools: each message a
//! peer can send is decoded (prost) and converted exactly as its receiver converts it (the
//! control plane for requests, clients for answers), then encoded back from the typed form.
//!
//! The encoding of what was understood is canonical: [`canonical`] of it gives it back
//! unchanged, which the fuzz target `wire` checks for every message.

use prost::Message;

use crate::convert;
use crate::pb;
use crate::Error;

/// A message that arrives from the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireMessage {
    /// `DeclareVersionRequest` (orchestrator -> control plane).
    DeclareVersion,
    /// `PublishRequest` (publisher -> control plane): a label and a source manifest.
    Publish,
    /// `RegisterWorkerRequest` (worker -> control plane).
    RegisterWorker,
    /// `StagedReport` (worker -> control plane).
    ReportStaged,
    /// `RefitRequest` (orchestrator -> control plane).
    Refit,
    /// `RegisterArtifactRequest` (exporter -> control plane).
    RegisterArtifact,
    /// `ServePeerRequest` (worker -> control plane): a peer's manifest.
    ServePeer,
    /// `VersionInfo` (control plane -> worker, publisher).
    VersionInfo,
    /// `FleetStatus` (control plane -> reader).
    FleetStatus,
    /// `RefitInfo` (control plane -> orchestrator).
    RefitInfo,
    /// `Release` (control plane -> publisher).
    Release,
    /// `WorkerCommand` (control plane -> worker).
    WorkerCommand,
    /// `GetVersionRequest` (worker -> control plane): a label and what its plan reads.
    GetVersion,
}

impl WireMessage {
    /// Every message, in a fixed order (a fuzz input's first byte picks one).
    pub const ALL: [WireMessage; 13] = [
        WireMessage::DeclareVersion,
        WireMessage::Publish,
        WireMessage::RegisterWorker,
        WireMessage::ReportStaged,
        WireMessage::Refit,
        WireMessage::RegisterArtifact,
        WireMessage::ServePeer,
        WireMessage::VersionInfo,
        WireMessage::FleetStatus,
        WireMessage::RefitInfo,
        WireMessage::Release,
        WireMessage::WorkerCommand,
        WireMessage::GetVersion,
    ];
}

fn decode<M: Message + Default>(bytes: &[u8], what: &str) -> Result<M, Error> {
    M::decode(bytes).map_err(|e| Error::InvalidField {
        field: what.to_string(),
        reason: format!("not a protobuf message: {e}"),
    })
}

fn missing(field: &str) -> Error {
    Error::InvalidField {
        field: field.to_string(),
        reason: "missing".into(),
    }
}

/// Decodes `bytes` as `kind`, converts it as its receiver does, and encodes the typed result
/// back: the canonical bytes of what was understood.
///
/// # Errors
/// [`Error::InvalidField`] naming the field (or the message, for bytes that are not protobuf)
/// that the receiver refuses.
pub fn canonical(kind: WireMessage, bytes: &[u8]) -> Result<Vec<u8>, Error> {
    Ok(match kind {
        WireMessage::DeclareVersion => {
            let r: pb::DeclareVersionRequest = decode(bytes, "DeclareVersionRequest")?;
            let label = convert::label(&r.label, "label")?;
            let layout = convert::req_layout(&r.trainer_layout, "trainer_layout")?;
            let tensors = convert::tensor_specs(&r.tensors, "tensors")?;
            pb::DeclareVersionRequest {
                label,
                trainer_layout: Some(convert::layout_pb(&layout)),
                tensors: tensors.iter().map(convert::tensor_spec_pb).collect(),
            }
            .encode_to_vec()
        }
        WireMessage::Publish => {
            let r: pb::PublishRequest = decode(bytes, "PublishRequest")?;
            let m = r.manifest.as_ref().ok_or_else(|| missing("manifest"))?;
            let m = convert::manifest(m, "manifest")?;
            pb::PublishRequest {
                label: convert::label(&r.label, "label")?,
                manifest: Some(convert::manifest_pb(&m)),
            }
            .encode_to_vec()
        }
        WireMessage::RegisterWorker => {
            let r: pb::RegisterWorkerRequest = decode(bytes, "RegisterWorkerRequest")?;
            let limits = r.model_limits.as_ref().map(convert::model_limits);
            let engine = r
                .engine
                .as_ref()
                .map(|e| convert::engine(e, "engine"))
                .transpose()?;
            let layout = convert::req_layout(&r.layout, "layout")?;
            pb::RegisterWorkerRequest {
                worker_id: r.worker_id,
                instance: r.instance,
                ranks: r.ranks,
                layout: Some(convert::layout_pb(&layout)),
                engine: engine.as_ref().map(convert::engine_pb),
                resident_version: r.resident_version,
                model_limits: limits.as_ref().map(convert::model_limits_pb),
                incarnation: r.incarnation,
                last_refit_id: r.last_refit_id,
                leader_epoch: r.leader_epoch,
            }
            .encode_to_vec()
        }
        WireMessage::ReportStaged => {
            let r: pb::StagedReport = decode(bytes, "StagedReport")?;
            convert::staged_pb(&convert::staged(&r, "")?).encode_to_vec()
        }
        WireMessage::Refit => {
            let r: pb::RefitRequest = decode(bytes, "RefitRequest")?;
            pb::RefitRequest {
                request_id: r.request_id,
                ..convert::refit_request_pb(&convert::refit_spec(&r)?)
            }
            .encode_to_vec()
        }
        WireMessage::RegisterArtifact => {
            let r: pb::RegisterArtifactRequest = decode(bytes, "RegisterArtifactRequest")?;
            let a = r.artifact.as_ref().ok_or_else(|| missing("artifact"))?;
            let a = convert::artifact(a, "artifact")?;
            pb::RegisterArtifactRequest {
                label: convert::label(&r.label, "label")?,
                artifact: Some(convert::artifact_pb(&a)),
            }
            .encode_to_vec()
        }
        WireMessage::ServePeer => {
            let r: pb::ServePeerRequest = decode(bytes, "ServePeerRequest")?;
            let m = r.manifest.as_ref().ok_or_else(|| missing("manifest"))?;
            let m = convert::manifest(m, "manifest")?;
            pb::ServePeerRequest {
                label: convert::label(&r.label, "label")?,
                worker_id: convert::non_empty(&r.worker_id, "worker_id")?,
                manifest: Some(convert::manifest_pb(&m)),
            }
            .encode_to_vec()
        }
        WireMessage::VersionInfo => {
            let r: pb::VersionInfo = decode(bytes, "VersionInfo")?;
            convert::version_info_pb(&convert::version_info(&r)?).encode_to_vec()
        }
        WireMessage::FleetStatus => {
            let r: pb::FleetStatus = decode(bytes, "FleetStatus")?;
            convert::fleet_pb(&convert::fleet(&r)?).encode_to_vec()
        }
        WireMessage::RefitInfo => {
            let r: pb::RefitInfo = decode(bytes, "RefitInfo")?;
            convert::refit_pb(&convert::refit(&r)?).encode_to_vec()
        }
        WireMessage::Release => {
            let r: pb::Release = decode(bytes, "Release")?;
            convert::release_pb(&convert::release(&r, "release")?).encode_to_vec()
        }
        WireMessage::WorkerCommand => {
            let r: pb::WorkerCommand = decode(bytes, "WorkerCommand")?;
            convert::command_pb(&convert::command(&r)?).encode_to_vec()
        }
        WireMessage::GetVersion => {
            let r: pb::GetVersionRequest = decode(bytes, "GetVersionRequest")?;
            let want = r
                .want
                .as_ref()
                .map(|w| convert::want(w, "want"))
                .transpose()?;
            pb::GetVersionRequest {
                label: convert::label(&r.label, "label")?,
                want: want.as_ref().map(convert::want_pb),
            }
            .encode_to_vec()
        }
    })
}

/// Encodes a version's record as the control plane answers `GetVersion` (`VersionInfo`): its
/// size is what the answer costs on the wire.
pub fn version_info_to_wire(info: &crate::VersionInfo) -> Vec<u8> {
    convert::version_info_pb(info).encode_to_vec()
}

/// Encodes a source manifest as its wire message (`SourceManifest`).
pub fn manifest_to_wire(m: &mx_layout::SourceManifest) -> Vec<u8> {
    convert::manifest_pb(m).encode_to_vec()
}

/// Decodes a source manifest from its wire message and checks it as the control plane does
/// when a publisher or peer sends one.
///
/// # Errors
/// [`Error::InvalidField`] naming the field at fault, e.g. `manifest.shards[2].digest`.
pub fn manifest_from_wire(bytes: &[u8]) -> Result<mx_layout::SourceManifest, Error> {
    let p: pb::SourceManifest = decode(bytes, "manifest")?;
    convert::manifest(&p, "manifest")
}
