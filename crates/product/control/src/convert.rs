//! Conversions between the wire messages ([`crate::pb`]) and the typed forms (mx-layout types and
//! [`crate::types`]). Decoding refuses anything malformed with [`Error::InvalidField`] naming the
//! field path, e.g. `manifest.shards[2].digest`; encoding cannot fail. Counts and sizes are
//! bounded ([`crate::limits`]) before anything is converted or sized from them.

use std::collections::BTreeMap;

use mx_layout::merkle::VersionProof;
use mx_layout::{
    DType, DestPiece, Digest, LayoutSpec, MemDevice, RankDigests, ResidentVersion, Scheme,
    ShardEntry, SourceManifest, TensorBox, TensorSpec, Want,
};

use crate::limits;
use crate::pb;
use crate::refit::{
    EngineApi, EngineEndpoint, GenerationCheck, ModelLimits, Outcome, PauseMode, Refit, RefitSpec,
};
use crate::types::{
    ArtifactKind, ArtifactRecord, Command, CoverageGap, FleetStatus, FleetVersion, Gate, Liveness,
    PeerSource, PublisherStatus, Release, StagedReport, VersionInfo, VersionState, VersionSummary,
    WorkerState, WorkerStatus,
};
use crate::Error;

fn invalid(field: &str, reason: impl Into<String>) -> Error {
    Error::InvalidField {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn required<'a, T>(v: &'a Option<T>, field: &str) -> Result<&'a T, Error> {
    v.as_ref().ok_or_else(|| invalid(field, "missing"))
}

/// Decodes a 32-byte digest.
pub(crate) fn digest(b: &[u8], field: &str) -> Result<Digest, Error> {
    Digest::from_slice(b).map_err(|_| invalid(field, format!("{} bytes, expected 32", b.len())))
}

/// Decodes an optional digest (empty = none).
pub(crate) fn opt_digest(b: &[u8], field: &str) -> Result<Option<Digest>, Error> {
    if b.is_empty() {
        Ok(None)
    } else {
        digest(b, field).map(Some)
    }
}

fn digest_pb(d: Option<Digest>) -> Vec<u8> {
    d.map(|d| d.0.to_vec()).unwrap_or_default()
}

fn finite_seconds(v: f64, field: &str) -> Result<f64, Error> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(invalid(
            field,
            format!("{v} is not a finite, non-negative number of seconds"),
        ))
    }
}

pub(crate) fn non_empty(s: &str, field: &str) -> Result<String, Error> {
    if s.is_empty() {
        Err(invalid(field, "empty"))
    } else {
        Ok(s.to_string())
    }
}

/// Decodes a version label: not empty, at most [`limits::MAX_LABEL_BYTES`].
pub(crate) fn label(s: &str, field: &str) -> Result<String, Error> {
    limits::label(field, s)?;
    Ok(s.to_string())
}

fn dtype(s: &str, field: &str) -> Result<DType, Error> {
    s.parse()
        .map_err(|e: mx_layout::Error| invalid(field, e.to_string()))
}

/// Decodes a layout spec.
pub(crate) fn layout(p: &pb::LayoutSpec, field: &str) -> Result<LayoutSpec, Error> {
    let scheme = match pb::Scheme::try_from(p.scheme) {
        Ok(pb::Scheme::Replicated) => Scheme::Replicated,
        Ok(pb::Scheme::Fsdp) => Scheme::Fsdp,
        Ok(pb::Scheme::VllmTp) => Scheme::VllmTp,
        Ok(pb::Scheme::VllmTpEp) => Scheme::VllmTpEp,
        Ok(pb::Scheme::Megatron) => {
            let l = LayoutSpec::megatron(p.tp, p.pp, p.ep)
                .map_err(|e| invalid(&format!("{field}.tp"), e.to_string()))?;
            if l.world_size != p.world_size {
                return Err(invalid(
                    &format!("{field}.world_size"),
                    format!(
                        "{} is not tp x pp x ep = {} of {l}",
                        p.world_size, l.world_size
                    ),
                ));
            }
            return Ok(l);
        }
        Ok(pb::Scheme::Unspecified) | Err(_) => {
            return Err(invalid(
                &format!("{field}.scheme"),
                format!("unknown scheme {}", p.scheme),
            ))
        }
    };
    limits::world_size(&format!("{field}.world_size"), p.world_size)?;
    Ok(LayoutSpec {
        scheme,
        world_size: p.world_size,
    })
}

/// Decodes a required layout field.
pub(crate) fn req_layout(p: &Option<pb::LayoutSpec>, field: &str) -> Result<LayoutSpec, Error> {
    layout(required(p, field)?, field)
}

/// Encodes a layout spec.
pub(crate) fn layout_pb(l: &LayoutSpec) -> pb::LayoutSpec {
    let (scheme, [tp, pp, ep]) = match l.scheme {
        Scheme::Replicated => (pb::Scheme::Replicated, [0; 3]),
        Scheme::Fsdp => (pb::Scheme::Fsdp, [0; 3]),
        Scheme::VllmTp => (pb::Scheme::VllmTp, [0; 3]),
        Scheme::VllmTpEp => (pb::Scheme::VllmTpEp, [0; 3]),
        Scheme::Megatron(d) => (pb::Scheme::Megatron, [d.tp, d.pp, d.ep]),
    };
    pb::LayoutSpec {
        scheme: scheme as i32,
        world_size: l.world_size,
        tp,
        pp,
        ep,
    }
}

fn tensor_box(p: &Option<pb::TensorBox>, field: &str) -> Result<TensorBox, Error> {
    let b = required(p, field)?;
    if b.global_offset.len() != b.local_shape.len() {
        return Err(invalid(
            field,
            format!(
                "global_offset has {} dims, local_shape {}",
                b.global_offset.len(),
                b.local_shape.len()
            ),
        ));
    }
    Ok(TensorBox {
        global_offset: b.global_offset.clone(),
        local_shape: b.local_shape.clone(),
    })
}

fn tensor_box_pb(b: &TensorBox) -> pb::TensorBox {
    pb::TensorBox {
        global_offset: b.global_offset.clone(),
        local_shape: b.local_shape.clone(),
    }
}

/// Decodes a tensor spec.
pub(crate) fn tensor_spec(p: &pb::TensorSpec, field: &str) -> Result<TensorSpec, Error> {
    Ok(TensorSpec {
        name: non_empty(&p.name, &format!("{field}.name"))?,
        dtype: dtype(&p.dtype, &format!("{field}.dtype"))?,
        shape: p.shape.clone(),
    })
}

/// Encodes a tensor spec.
pub(crate) fn tensor_spec_pb(t: &TensorSpec) -> pb::TensorSpec {
    pb::TensorSpec {
        name: t.name.clone(),
        dtype: t.dtype.to_string(),
        shape: t.shape.clone(),
    }
}

/// Decodes a list of tensor specs (`field[i]` in errors).
pub(crate) fn tensor_specs(p: &[pb::TensorSpec], field: &str) -> Result<Vec<TensorSpec>, Error> {
    limits::count(field, p.len(), limits::MAX_TENSORS)?;
    p.iter()
        .enumerate()
        .map(|(i, t)| tensor_spec(t, &format!("{field}[{i}]")))
        .collect()
}

fn shard(p: &pb::ShardEntry, field: &str) -> Result<ShardEntry, Error> {
    let device = match pb::DeviceKind::try_from(p.device) {
        Ok(pb::DeviceKind::Dram) => MemDevice::Dram,
        Ok(pb::DeviceKind::Vram) => MemDevice::Vram(p.device_ordinal),
        Ok(pb::DeviceKind::Unspecified) | Err(_) => {
            return Err(invalid(
                &format!("{field}.device"),
                format!("unknown device kind {}", p.device),
            ))
        }
    };
    Ok(ShardEntry {
        tensor: non_empty(&p.tensor, &format!("{field}.tensor"))?,
        dtype: dtype(&p.dtype, &format!("{field}.dtype"))?,
        global_shape: p.global_shape.clone(),
        shard: tensor_box(&p.shard, &format!("{field}.shard"))?,
        addr: p.addr,
        len: p.len,
        device,
        digest: digest(&p.digest, &format!("{field}.digest"))?,
    })
}

fn shard_pb(s: &ShardEntry) -> pb::ShardEntry {
    let (device, device_ordinal) = match s.device {
        MemDevice::Dram => (pb::DeviceKind::Dram, 0),
        MemDevice::Vram(o) => (pb::DeviceKind::Vram, o),
    };
    pb::ShardEntry {
        tensor: s.tensor.clone(),
        dtype: s.dtype.to_string(),
        global_shape: s.global_shape.clone(),
        shard: Some(tensor_box_pb(&s.shard)),
        addr: s.addr,
        len: s.len,
        device: device as i32,
        device_ordinal,
        digest: s.digest.0.to_vec(),
    }
}

fn piece(p: &pb::DestPiece, field: &str) -> Result<DestPiece, Error> {
    Ok(DestPiece {
        layout: req_layout(&p.layout, &format!("{field}.layout"))?,
        dest_rank: p.dest_rank,
        tensor: non_empty(&p.tensor, &format!("{field}.tensor"))?,
        region: tensor_box(&p.region, &format!("{field}.region"))?,
        digest: digest(&p.digest, &format!("{field}.digest"))?,
        packed_addr: p.packed_addr,
    })
}

fn piece_pb(p: &DestPiece) -> pb::DestPiece {
    pb::DestPiece {
        layout: Some(layout_pb(&p.layout)),
        dest_rank: p.dest_rank,
        tensor: p.tensor.clone(),
        region: Some(tensor_box_pb(&p.region)),
        digest: p.digest.0.to_vec(),
        packed_addr: p.packed_addr,
    }
}

/// Decodes a source manifest.
pub(crate) fn manifest(p: &pb::SourceManifest, field: &str) -> Result<SourceManifest, Error> {
    use prost::Message as _;
    let bytes = p.encoded_len();
    if bytes > limits::MAX_MANIFEST_BYTES {
        return Err(invalid(
            field,
            format!(
                "encoded size {bytes} bytes is over the limit of {}",
                limits::MAX_MANIFEST_BYTES
            ),
        ));
    }
    limits::bytes(
        &format!("{field}.agent_metadata"),
        p.agent_metadata.len(),
        limits::MAX_AGENT_METADATA_BYTES,
    )?;
    limits::count(
        &format!("{field}.shards"),
        p.shards.len(),
        limits::MAX_SHARDS,
    )?;
    limits::count(
        &format!("{field}.pieces"),
        p.pieces.len(),
        limits::MAX_PIECES,
    )?;
    Ok(SourceManifest {
        slot: p.slot,
        layout: req_layout(&p.layout, &format!("{field}.layout"))?,
        agent_name: p.agent_name.clone(),
        agent_metadata: p.agent_metadata.clone(),
        shards: p
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| shard(s, &format!("{field}.shards[{i}]")))
            .collect::<Result<_, _>>()?,
        pieces: p
            .pieces
            .iter()
            .enumerate()
            .map(|(i, s)| piece(s, &format!("{field}.pieces[{i}]")))
            .collect::<Result<_, _>>()?,
        pack_seconds: finite_seconds(p.pack_seconds, &format!("{field}.pack_seconds"))?,
    })
}

/// Encodes a source manifest.
pub(crate) fn manifest_pb(m: &SourceManifest) -> pb::SourceManifest {
    pb::SourceManifest {
        slot: m.slot,
        layout: Some(layout_pb(&m.layout)),
        agent_name: m.agent_name.clone(),
        agent_metadata: m.agent_metadata.clone(),
        shards: m.shards.iter().map(shard_pb).collect(),
        pieces: m.pieces.iter().map(piece_pb).collect(),
        pack_seconds: m.pack_seconds,
    }
}

fn rank_digests(p: &[pb::RankDigests], field: &str) -> Result<Vec<RankDigests>, Error> {
    p.iter()
        .enumerate()
        .map(|(i, r)| {
            let tensors = r
                .tensors
                .iter()
                .map(|(name, d)| {
                    Ok((
                        name.clone(),
                        digest(d, &format!("{field}[{i}].tensors[{name}]"))?,
                    ))
                })
                .collect::<Result<_, Error>>()?;
            Ok(RankDigests {
                rank: r.rank,
                tensors,
            })
        })
        .collect()
}

fn rank_digests_pb(r: &[RankDigests]) -> Vec<pb::RankDigests> {
    r.iter()
        .map(|r| pb::RankDigests {
            rank: r.rank,
            tensors: r
                .tensors
                .iter()
                .map(|(k, d)| (k.clone(), d.0.to_vec()))
                .collect(),
        })
        .collect()
}

/// Decodes a staged report.
pub(crate) fn staged(p: &pb::StagedReport, field: &str) -> Result<StagedReport, Error> {
    Ok(StagedReport {
        worker_id: non_empty(&p.worker_id, &format!("{field}worker_id"))?,
        label: label(&p.label, &format!("{field}label"))?,
        ok: p.ok,
        error: p.error.clone(),
        ranks: rank_digests(&p.ranks, &format!("{field}ranks"))?,
        bytes: p.bytes,
        descriptors: p.descriptors,
        seconds: finite_seconds(p.seconds, &format!("{field}seconds"))?,
        strategies: p.strategies.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        source: p.source.clone(),
        wire_bytes: p.wire_bytes,
    })
}

/// Encodes a staged report.
pub(crate) fn staged_pb(r: &StagedReport) -> pb::StagedReport {
    pb::StagedReport {
        worker_id: r.worker_id.clone(),
        label: r.label.clone(),
        ok: r.ok,
        error: r.error.clone(),
        ranks: rank_digests_pb(&r.ranks),
        bytes: r.bytes,
        descriptors: r.descriptors,
        seconds: r.seconds,
        strategies: r.strategies.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        source: r.source.clone(),
        wire_bytes: r.wire_bytes,
    }
}

/// Decodes a version state.
pub(crate) fn version_state(v: i32, field: &str) -> Result<VersionState, Error> {
    Ok(match pb::VersionState::try_from(v) {
        Ok(pb::VersionState::Declared) => VersionState::Declared,
        Ok(pb::VersionState::Publishing) => VersionState::Publishing,
        Ok(pb::VersionState::Ready) => VersionState::Ready,
        Ok(pb::VersionState::Committing) => VersionState::Committing,
        Ok(pb::VersionState::Committed) => VersionState::Committed,
        Ok(pb::VersionState::Unspecified) | Err(_) => {
            return Err(invalid(field, format!("unknown version state {v}")))
        }
    })
}

/// Encodes a version state.
pub(crate) fn version_state_pb(s: VersionState) -> i32 {
    (match s {
        VersionState::Declared => pb::VersionState::Declared,
        VersionState::Publishing => pb::VersionState::Publishing,
        VersionState::Ready => pb::VersionState::Ready,
        VersionState::Committing => pb::VersionState::Committing,
        VersionState::Committed => pb::VersionState::Committed,
    }) as i32
}

pub(crate) fn worker_state(v: i32, field: &str) -> Result<WorkerState, Error> {
    Ok(match pb::WorkerState::try_from(v) {
        Ok(pb::WorkerState::Idle) => WorkerState::Idle,
        Ok(pb::WorkerState::Staging) => WorkerState::Staging,
        Ok(pb::WorkerState::Staged) => WorkerState::Staged,
        Ok(pb::WorkerState::Failed) => WorkerState::Failed,
        Ok(pb::WorkerState::Unspecified) | Err(_) => {
            return Err(invalid(field, format!("unknown worker state {v}")))
        }
    })
}

pub(crate) fn worker_state_pb(s: WorkerState) -> i32 {
    (match s {
        WorkerState::Idle => pb::WorkerState::Idle,
        WorkerState::Staging => pb::WorkerState::Staging,
        WorkerState::Staged => pb::WorkerState::Staged,
        WorkerState::Failed => pb::WorkerState::Failed,
    }) as i32
}

/// Encodes a version info.
pub(crate) fn version_info_pb(v: &VersionInfo) -> pb::VersionInfo {
    pb::VersionInfo {
        label: v.label.clone(),
        state: version_state_pb(v.state),
        trainer_layout: Some(layout_pb(&v.trainer_layout)),
        tensors: v.tensors.iter().map(tensor_spec_pb).collect(),
        version_digest: digest_pb(v.version_digest),
        published_slots: v.published_slots.clone(),
        missing_slots: v.missing_slots.clone(),
        missing_tensors: v.missing_tensors.clone(),
        coverage_gaps: v
            .coverage_gaps
            .iter()
            .map(|g| pb::CoverageGap {
                tensor: g.tensor.clone(),
                region: Some(tensor_box_pb(&g.region)),
            })
            .collect(),
        manifests: v.manifests.iter().map(manifest_pb).collect(),
        commit_workers: v.commit_workers.clone(),
        release: v.release.as_ref().map(release_pb),
        artifacts: v.artifacts.iter().map(artifact_pb).collect(),
        peers: v
            .peers
            .iter()
            .map(|p| pb::PeerSource {
                worker_id: p.worker_id.clone(),
                manifest: Some(manifest_pb(&p.manifest)),
            })
            .collect(),
        proof: v.proof.as_ref().map(proof_pb),
        expected_outputs: v.expected_outputs.as_ref().map(generation_check_pb),
    }
}

/// Decodes what a worker wants of a version: at most [`limits::MAX_WANT_REGIONS`] boxes, each of
/// a named tensor (name and dims bounded); ranks only with a layout, each inside it.
pub(crate) fn want(p: &pb::VersionWant, field: &str) -> Result<Want, Error> {
    limits::count(
        &format!("{field}.regions"),
        p.regions.len(),
        limits::MAX_WANT_REGIONS,
    )?;
    let mut regions: BTreeMap<String, Vec<TensorBox>> = BTreeMap::new();
    for (i, r) in p.regions.iter().enumerate() {
        let f = format!("{field}.regions[{i}]");
        limits::name(&format!("{f}.tensor"), &r.tensor)?;
        let tensor = non_empty(&r.tensor, &format!("{f}.tensor"))?;
        let b = tensor_box(&r.region, &format!("{f}.region"))?;
        limits::dims(&format!("{f}.region"), b.ndim())?;
        regions.entry(tensor).or_default().push(b);
    }
    for boxes in regions.values_mut() {
        boxes.sort();
        boxes.dedup();
    }
    let dest = match &p.layout {
        None if p.ranks.is_empty() => None,
        None => return Err(invalid(&format!("{field}.ranks"), "ranks without a layout")),
        Some(l) => {
            let l = layout(l, &format!("{field}.layout"))?;
            let mut ranks = p.ranks.clone();
            if let Some(r) = ranks.iter().find(|&&r| r >= l.world_size) {
                return Err(invalid(
                    &format!("{field}.ranks"),
                    format!("rank {r} is outside {l}"),
                ));
            }
            ranks.sort_unstable();
            ranks.dedup();
            Some((l, ranks))
        }
    };
    Ok(Want { regions, dest })
}

/// Encodes what a worker wants of a version.
pub(crate) fn want_pb(w: &Want) -> pb::VersionWant {
    pb::VersionWant {
        regions: w
            .regions
            .iter()
            .flat_map(|(t, boxes)| {
                boxes.iter().map(move |b| pb::TensorRegion {
                    tensor: t.clone(),
                    region: Some(tensor_box_pb(b)),
                })
            })
            .collect(),
        layout: w.dest.as_ref().map(|(l, _)| layout_pb(l)),
        ranks: w.dest.as_ref().map(|(_, r)| r.clone()).unwrap_or_default(),
    }
}

/// Encodes a version proof (its hashes concatenated).
pub(crate) fn proof_pb(p: &VersionProof) -> pb::VersionProof {
    pb::VersionProof {
        leaf_count: p.leaf_count,
        positions: p.positions.clone(),
        nodes: p.nodes.concat(),
    }
}

/// Decodes a version proof: hashes of 32 bytes, at most [`limits::MAX_PROOF_NODES`] (its shape
/// is checked against the tree when it is verified).
pub(crate) fn proof(p: &pb::VersionProof, field: &str) -> Result<VersionProof, Error> {
    if !p.nodes.len().is_multiple_of(32) {
        return Err(invalid(
            &format!("{field}.nodes"),
            format!("{} bytes: not a multiple of 32", p.nodes.len()),
        ));
    }
    limits::count(
        &format!("{field}.nodes"),
        p.nodes.len() / 32,
        limits::MAX_PROOF_NODES,
    )?;
    let nodes = p
        .nodes
        .chunks_exact(32)
        .map(|c| {
            let mut h = [0u8; 32];
            h.copy_from_slice(c);
            h
        })
        .collect();
    Ok(VersionProof {
        leaf_count: p.leaf_count,
        positions: p.positions.clone(),
        nodes,
    })
}

/// Encodes an artifact record.
pub(crate) fn artifact_pb(a: &ArtifactRecord) -> pb::ArtifactRecord {
    pb::ArtifactRecord {
        url: a.url.clone(),
        manifest_digest: a.manifest_digest.as_bytes().to_vec(),
        kind: match a.kind {
            ArtifactKind::Canonical => pb::ArtifactKind::Canonical,
            ArtifactKind::Delta => pb::ArtifactKind::Delta,
        } as i32,
        base_version_digest: a.base.map(|b| b.as_bytes().to_vec()).unwrap_or_default(),
    }
}

/// Decodes an artifact record (the URL is checked where it is recorded).
pub(crate) fn artifact(p: &pb::ArtifactRecord, field: &str) -> Result<ArtifactRecord, Error> {
    let kind = match pb::ArtifactKind::try_from(p.kind) {
        Ok(pb::ArtifactKind::Canonical) => ArtifactKind::Canonical,
        Ok(pb::ArtifactKind::Delta) => ArtifactKind::Delta,
        _ => {
            return Err(invalid(
                &format!("{field}.kind"),
                format!("unknown artifact kind {}", p.kind),
            ))
        }
    };
    Ok(ArtifactRecord {
        url: non_empty(&p.url, &format!("{field}.url"))?,
        manifest_digest: digest(&p.manifest_digest, &format!("{field}.manifest_digest"))?,
        kind,
        base: opt_digest(
            &p.base_version_digest,
            &format!("{field}.base_version_digest"),
        )?,
    })
}

/// Encodes a release.
pub(crate) fn release_pb(r: &Release) -> pb::Release {
    let mut out = pb::Release::default();
    match r {
        Release::Staged { refit, workers } => {
            out.kind = pb::ReleaseKind::Staged.into();
            out.refit_id = refit.unwrap_or(0);
            out.workers = workers.clone();
        }
        Release::RefitEnded { refit, outcome } => {
            out.kind = pb::ReleaseKind::RefitEnded.into();
            out.refit_id = *refit;
            out.outcome = outcome.to_string();
        }
        Release::Superseded { by } => {
            out.kind = pb::ReleaseKind::Superseded.into();
            out.by_label = by.clone();
        }
        Release::Source { slot } => {
            out.kind = pb::ReleaseKind::Source.into();
            out.slot = *slot;
        }
    }
    out
}

/// Decodes a release.
pub(crate) fn release(p: &pb::Release, field: &str) -> Result<Release, Error> {
    Ok(match pb::ReleaseKind::try_from(p.kind) {
        Ok(pb::ReleaseKind::Staged) => Release::Staged {
            refit: (p.refit_id != 0).then_some(p.refit_id),
            workers: p.workers.clone(),
        },
        Ok(pb::ReleaseKind::RefitEnded) => Release::RefitEnded {
            refit: p.refit_id,
            outcome: match p.outcome.as_str() {
                "COMMITTED" => Outcome::Committed,
                "ABORTED" => Outcome::Aborted,
                "ROLLED_BACK" => Outcome::RolledBack,
                "FENCED" => Outcome::Fenced,
                o => {
                    return Err(invalid(
                        &format!("{field}.outcome"),
                        format!("unknown outcome {o:?}"),
                    ))
                }
            },
        },
        Ok(pb::ReleaseKind::Superseded) => Release::Superseded {
            by: non_empty(&p.by_label, &format!("{field}.by_label"))?,
        },
        Ok(pb::ReleaseKind::Source) => Release::Source { slot: p.slot },
        Ok(pb::ReleaseKind::Unspecified) | Err(_) => {
            return Err(invalid(
                &format!("{field}.kind"),
                format!("unknown release kind {}", p.kind),
            ))
        }
    })
}

/// Decodes a version info.
pub(crate) fn version_info(p: &pb::VersionInfo) -> Result<VersionInfo, Error> {
    Ok(VersionInfo {
        label: p.label.clone(),
        state: version_state(p.state, "state")?,
        trainer_layout: req_layout(&p.trainer_layout, "trainer_layout")?,
        tensors: tensor_specs(&p.tensors, "tensors")?,
        version_digest: opt_digest(&p.version_digest, "version_digest")?,
        published_slots: p.published_slots.clone(),
        missing_slots: p.missing_slots.clone(),
        missing_tensors: p.missing_tensors.clone(),
        coverage_gaps: p
            .coverage_gaps
            .iter()
            .enumerate()
            .map(|(i, g)| {
                Ok(CoverageGap {
                    tensor: g.tensor.clone(),
                    region: tensor_box(&g.region, &format!("coverage_gaps[{i}].region"))?,
                })
            })
            .collect::<Result<_, Error>>()?,
        manifests: p
            .manifests
            .iter()
            .enumerate()
            .map(|(i, m)| manifest(m, &format!("manifests[{i}]")))
            .collect::<Result<_, _>>()?,
        artifacts: p
            .artifacts
            .iter()
            .enumerate()
            .map(|(i, a)| artifact(a, &format!("artifacts[{i}]")))
            .collect::<Result<_, _>>()?,
        peers: p
            .peers
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let field = format!("peers[{i}]");
                Ok(PeerSource {
                    worker_id: non_empty(&x.worker_id, &format!("{field}.worker_id"))?,
                    manifest: x
                        .manifest
                        .as_ref()
                        .ok_or_else(|| invalid(&format!("{field}.manifest"), "missing"))
                        .and_then(|m| manifest(m, &format!("{field}.manifest")))?,
                })
            })
            .collect::<Result<_, Error>>()?,
        commit_workers: p.commit_workers.clone(),
        release: p
            .release
            .as_ref()
            .map(|r| release(r, "release"))
            .transpose()?,
        proof: p.proof.as_ref().map(|x| proof(x, "proof")).transpose()?,
        expected_outputs: p
            .expected_outputs
            .as_ref()
            .map(|c| generation_check(c, "expected_outputs"))
            .transpose()?,
    })
}

/// Encodes the fleet status.
pub(crate) fn fleet_pb(f: &FleetStatus) -> pb::FleetStatus {
    pb::FleetStatus {
        versions: f
            .versions
            .iter()
            .map(|v| pb::VersionSummary {
                label: v.label.clone(),
                state: version_state_pb(v.state),
                version_digest: digest_pb(v.version_digest),
                slots: v.slots,
                publishers: v
                    .publishers
                    .iter()
                    .map(|p| pb::PublisherStatus {
                        slot: p.slot,
                        agent_name: p.agent_name.clone(),
                        retired_by: p.retired_by.clone().unwrap_or_default(),
                        last_seen_ms: p.last_seen_ms,
                        liveness: p.liveness.as_str().to_string(),
                    })
                    .collect(),
                peers: v.peers.clone(),
                artifacts: v.artifacts.clone(),
                release: v.release.as_ref().map(release_pb),
            })
            .collect(),
        workers: f
            .workers
            .iter()
            .map(|w| pb::WorkerStatus {
                worker_id: w.worker_id.clone(),
                instance: w.instance.clone(),
                ranks: w.ranks.clone(),
                layout: Some(layout_pb(&w.layout)),
                state: worker_state_pb(w.state),
                label: w.label.clone().unwrap_or_default(),
                version_digest: digest_pb(w.version_digest),
                resident_version: digest_pb(w.resident_version),
                last_error: w.last_error.clone().unwrap_or_default(),
                last_staged: w.last_staged.as_ref().map(staged_pb),
                engine: w.engine.as_ref().map(engine_pb),
                resident_id: w
                    .resident_id
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                admitted: w.admitted,
                admission: w.admission.clone(),
                connected: w.connected,
                gate: w.gate.map(|g| g.as_str().to_string()).unwrap_or_default(),
                resident_label: w.resident_label.clone().unwrap_or_default(),
            })
            .collect(),
        fleet_label: f
            .fleet_version
            .as_ref()
            .map(|v| v.label.clone())
            .unwrap_or_default(),
        fleet_version: f
            .fleet_version
            .as_ref()
            .map(|v| v.version_id.to_string())
            .unwrap_or_default(),
        open_refit: f.open_refit.unwrap_or(0),
        halted: f.halted.clone().unwrap_or_default(),
    }
}

/// Encodes an engine endpoint.
pub(crate) fn engine_pb(e: &EngineEndpoint) -> pb::EngineEndpoint {
    pb::EngineEndpoint {
        api: match e.api {
            EngineApi::Dynamo => pb::EngineApi::Dynamo as i32,
            EngineApi::DynamoSglang => pb::EngineApi::DynamoSglang as i32,
            EngineApi::Sglang => pb::EngineApi::Sglang as i32,
            EngineApi::Vllm => pb::EngineApi::Vllm as i32,
        },
        system_url: e.system_url.clone(),
        no_model: e.no_model,
        frontend: e.frontend.as_ref().map(|f| pb::EngineFrontend {
            url: f.url.clone(),
            model: f.model.clone(),
            instance_id: f.instance_id,
        }),
    }
}

/// Encodes a worker's model limits.
pub(crate) fn model_limits_pb(l: &ModelLimits) -> pb::ModelLimits {
    pb::ModelLimits {
        vocab_size: l.vocab_size,
        max_positions: l.max_positions,
    }
}

/// Decodes a worker's model limits (every value is accepted).
pub(crate) fn model_limits(p: &pb::ModelLimits) -> ModelLimits {
    ModelLimits {
        vocab_size: p.vocab_size,
        max_positions: p.max_positions,
    }
}

/// Decodes an engine endpoint: a known api and an http(s) system_url.
pub(crate) fn engine(p: &pb::EngineEndpoint, field: &str) -> Result<EngineEndpoint, Error> {
    let api = match pb::EngineApi::try_from(p.api) {
        Ok(pb::EngineApi::Dynamo) => EngineApi::Dynamo,
        Ok(pb::EngineApi::DynamoSglang) => EngineApi::DynamoSglang,
        Ok(pb::EngineApi::Sglang) => EngineApi::Sglang,
        Ok(pb::EngineApi::Vllm) => EngineApi::Vllm,
        _ => {
            return Err(invalid(
                &format!("{field}.api"),
                format!("unknown engine api {}", p.api),
            ))
        }
    };
    if !(p.system_url.starts_with("http://") || p.system_url.starts_with("https://")) {
        return Err(invalid(
            &format!("{field}.system_url"),
            format!("{:?} is not an http(s) URL", p.system_url),
        ));
    }
    let frontend = match &p.frontend {
        None => None,
        Some(f) => {
            if !(f.url.starts_with("http://") || f.url.starts_with("https://")) {
                return Err(invalid(
                    &format!("{field}.frontend.url"),
                    format!("{:?} is not an http(s) URL", f.url),
                ));
            }
            if f.model.is_empty() {
                return Err(invalid(
                    &format!("{field}.frontend.model"),
                    "empty: the frontend routes by the served model name".to_string(),
                ));
            }
            Some(mx_adapters::dynamo::Frontend {
                url: f.url.clone(),
                model: f.model.clone(),
                instance_id: f.instance_id,
            })
        }
    };
    Ok(EngineEndpoint {
        api,
        system_url: p.system_url.clone(),
        no_model: p.no_model,
        frontend,
    })
}

/// Decodes a pause mode (unspecified = wait).
pub(crate) fn pause_mode(v: i32, field: &str) -> Result<PauseMode, Error> {
    match pb::PauseMode::try_from(v) {
        Ok(pb::PauseMode::Unspecified | pb::PauseMode::Wait) => Ok(PauseMode::Wait),
        Ok(pb::PauseMode::Keep) => Ok(PauseMode::Keep),
        Ok(pb::PauseMode::Abort) => Ok(PauseMode::Abort),
        Ok(pb::PauseMode::Retract) => Ok(PauseMode::Retract),
        Ok(pb::PauseMode::InPlace) => Ok(PauseMode::InPlace),
        Err(_) => Err(invalid(field, format!("unknown pause mode {v}"))),
    }
}

/// Encodes a pause mode.
pub(crate) fn pause_mode_pb(m: PauseMode) -> i32 {
    match m {
        PauseMode::Keep => pb::PauseMode::Keep as i32,
        PauseMode::Wait => pb::PauseMode::Wait as i32,
        PauseMode::Abort => pb::PauseMode::Abort as i32,
        PauseMode::Retract => pb::PauseMode::Retract as i32,
        PauseMode::InPlace => pb::PauseMode::InPlace as i32,
    }
}

/// Decodes a refit request into a spec (defaults filled in; checks the check).
pub(crate) fn refit_spec(p: &pb::RefitRequest) -> Result<RefitSpec, Error> {
    let check = p
        .check
        .as_ref()
        .map(|c| generation_check(c, "check"))
        .transpose()?;
    Ok(RefitSpec {
        label: label(&p.label, "label")?,
        worker_ids: p.worker_ids.clone(),
        pause_mode: pause_mode(p.pause_mode, "pause_mode")?,
        allow_partial: p.allow_partial,
        check,
        no_check: p.no_check,
        framework_step: p.framework_step,
        stage_timeout_ms: if p.stage_timeout_ms == 0 {
            crate::refit::DEFAULT_STAGE_TIMEOUT_MS
        } else {
            p.stage_timeout_ms
        },
        call_timeout_ms: if p.call_timeout_ms == 0 {
            crate::refit::DEFAULT_CALL_TIMEOUT_MS
        } else {
            p.call_timeout_ms
        },
        apply_parallelism: p.apply_parallelism,
        orchestrator_gated: p.orchestrator_gated,
        verify_from_apply_answer: p.verify_from_apply_answer,
    })
}

/// Encodes a refit spec as a request.
pub(crate) fn refit_request_pb(s: &RefitSpec) -> pb::RefitRequest {
    pb::RefitRequest {
        label: s.label.clone(),
        worker_ids: s.worker_ids.clone(),
        pause_mode: pause_mode_pb(s.pause_mode),
        allow_partial: s.allow_partial,
        check: s.check.as_ref().map(generation_check_pb),
        no_check: s.no_check,
        framework_step: s.framework_step,
        stage_timeout_ms: s.stage_timeout_ms,
        call_timeout_ms: s.call_timeout_ms,
        apply_parallelism: s.apply_parallelism,
        orchestrator_gated: s.orchestrator_gated,
        verify_from_apply_answer: s.verify_from_apply_answer,
        request_id: 0,
    }
}

/// Decodes a post-update check (`field`: where it sits in the request), either form (probes,
/// or one prompt with its golden tokens), and checks it ([`GenerationCheck::validate`]).
pub(crate) fn generation_check(
    c: &pb::GenerationCheck,
    field: &str,
) -> Result<GenerationCheck, Error> {
    let single = !c.prompt_tokens.is_empty() || !c.expected_tokens.is_empty();
    if single && !c.probes.is_empty() {
        return Err(invalid(
            &format!("{field}.probes"),
            "give probes or prompt_tokens/expected_tokens, not both",
        ));
    }
    let probes = if single {
        vec![crate::check::Probe {
            prompt_tokens: c.prompt_tokens.clone(),
            tokens: c.expected_tokens.clone(),
            ..crate::check::Probe::default()
        }]
    } else {
        c.probes
            .iter()
            .map(|p| crate::check::Probe {
                prompt_tokens: p.prompt_tokens.clone(),
                tokens: p.tokens.clone(),
                margins: p.margins.clone(),
                logprobs: p.logprobs.clone(),
            })
            .collect()
    };
    let check = GenerationCheck {
        probes,
        max_new_tokens: c.max_new_tokens,
        tie_margin: c.tie_margin,
        source: c.source.clone(),
    };
    check
        .validate()
        .map_err(|(f, reason)| invalid(&format!("{field}.{f}"), reason))?;
    Ok(check)
}

/// Encodes a post-update check (always as probes).
pub(crate) fn generation_check_pb(c: &GenerationCheck) -> pb::GenerationCheck {
    pb::GenerationCheck {
        probes: c
            .probes
            .iter()
            .map(|p| pb::Probe {
                prompt_tokens: p.prompt_tokens.clone(),
                tokens: p.tokens.clone(),
                margins: p.margins.clone(),
                logprobs: p.logprobs.clone(),
            })
            .collect(),
        max_new_tokens: c.max_new_tokens,
        tie_margin: c.tie_margin,
        source: c.source.clone(),
        ..pb::GenerationCheck::default()
    }
}

/// Encodes a refit (summary fields plus the JSON record).
pub(crate) fn refit_pb(r: &Refit) -> pb::RefitInfo {
    pb::RefitInfo {
        id: r.id,
        label: r.spec.label.clone(),
        phase: r.phase.to_string(),
        outcome: r.outcome.map(|o| o.to_string()).unwrap_or_default(),
        reason: r.reason.clone(),
        detail_json: serde_json::to_vec(r).unwrap_or_default(),
    }
}

/// Decodes a refit from its JSON record.
pub(crate) fn refit(p: &pb::RefitInfo) -> Result<Refit, Error> {
    mx_layout::strict_json::from_slice(&p.detail_json)
        .map_err(|e| invalid("detail_json", format!("refit {}: {e}", p.id)))
}

fn opt_string(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// Decodes the fleet status.
pub(crate) fn fleet(p: &pb::FleetStatus) -> Result<FleetStatus, Error> {
    Ok(FleetStatus {
        versions: p
            .versions
            .iter()
            .enumerate()
            .map(|(i, v)| {
                Ok(VersionSummary {
                    label: v.label.clone(),
                    state: version_state(v.state, &format!("versions[{i}].state"))?,
                    version_digest: opt_digest(
                        &v.version_digest,
                        &format!("versions[{i}].version_digest"),
                    )?,
                    slots: v.slots,
                    publishers: v
                        .publishers
                        .iter()
                        .enumerate()
                        .map(|(k, p)| {
                            Ok(PublisherStatus {
                                slot: p.slot,
                                agent_name: p.agent_name.clone(),
                                retired_by: opt_string(&p.retired_by),
                                last_seen_ms: p.last_seen_ms,
                                liveness: Liveness::parse(&p.liveness).ok_or_else(|| {
                                    invalid(
                                        &format!("versions[{i}].publishers[{k}].liveness"),
                                        format!("unknown liveness {:?}", p.liveness),
                                    )
                                })?,
                            })
                        })
                        .collect::<Result<_, Error>>()?,
                    peers: v.peers.clone(),
                    artifacts: v.artifacts.clone(),
                    release: v
                        .release
                        .as_ref()
                        .map(|r| release(r, &format!("versions[{i}].release")))
                        .transpose()?,
                })
            })
            .collect::<Result<_, Error>>()?,
        workers: p
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let f = |name: &str| format!("workers[{i}].{name}");
                Ok(WorkerStatus {
                    worker_id: w.worker_id.clone(),
                    instance: w.instance.clone(),
                    ranks: w.ranks.clone(),
                    layout: req_layout(&w.layout, &f("layout"))?,
                    state: worker_state(w.state, &f("state"))?,
                    label: opt_string(&w.label),
                    version_digest: opt_digest(&w.version_digest, &f("version_digest"))?,
                    resident_version: opt_digest(&w.resident_version, &f("resident_version"))?,
                    last_error: opt_string(&w.last_error),
                    last_staged: w
                        .last_staged
                        .as_ref()
                        .map(|r| staged(r, &f("last_staged.")))
                        .transpose()?,
                    engine: w
                        .engine
                        .as_ref()
                        .map(|e| engine(e, &f("engine")))
                        .transpose()?,
                    resident_id: opt_string(&w.resident_id).map(|r| ResidentVersion::parse(&r)),
                    admitted: w.admitted,
                    admission: w.admission.clone(),
                    connected: w.connected,
                    gate: match w.gate.as_str() {
                        "" => None,
                        g => {
                            Some(Gate::parse(g).ok_or_else(|| {
                                invalid(&f("gate"), format!("unknown gate {g:?}"))
                            })?)
                        }
                    },
                    resident_label: opt_string(&w.resident_label),
                })
            })
            .collect::<Result<_, Error>>()?,
        fleet_version: match p.fleet_version.as_str() {
            "" => None,
            v => Some(FleetVersion {
                label: p.fleet_label.clone(),
                version_id: v
                    .parse()
                    .map_err(|e: mx_layout::Error| invalid("fleet_version", e.to_string()))?,
            }),
        },
        open_refit: (p.open_refit != 0).then_some(p.open_refit),
        halted: opt_string(&p.halted),
    })
}

/// Encodes a worker command.
pub(crate) fn command_pb(c: &Command) -> pb::WorkerCommand {
    use pb::worker_command::Command as C;
    let command = match c {
        Command::Stage {
            label,
            version_digest,
        } => C::Stage(pb::StageCommand {
            label: label.clone(),
            version_digest: version_digest.0.to_vec(),
        }),
    };
    pb::WorkerCommand {
        command: Some(command),
    }
}

/// Decodes a worker command.
pub(crate) fn command(p: &pb::WorkerCommand) -> Result<Command, Error> {
    use pb::worker_command::Command as C;
    match required(&p.command, "command")? {
        C::Stage(s) => Ok(Command::Stage {
            label: s.label.clone(),
            version_digest: digest(&s.version_digest, "command.stage.version_digest")?,
        }),
    }
}
