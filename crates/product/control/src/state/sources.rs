//! The sources of a version in the state machine: checks of publishes, republishes, peers and
//! artifacts, and the retirement of slots a publisher overwrote in place.

use super::*;

impl State {
    /// Marks, in every other version, the slot `m.slot` retired when it was published by the
    /// same NIXL agent with a shard byte range overlapping one of `m`'s: a publisher that
    /// applies a training step in place serves only its newest version. Versions already
    /// retired for that slot are skipped, so each publish checks about one older version.
    pub(super) fn retire_overwritten(&mut self, label: &str, m: &SourceManifest) {
        let mut new: Vec<(u64, u64)> = m
            .shards
            .iter()
            .map(|s| (s.addr, s.addr.saturating_add(s.len)))
            .collect();
        new.sort_unstable();
        // reach[k]: the largest end among the first k + 1 ranges (by start).
        let reach: Vec<u64> = new
            .iter()
            .scan(0u64, |m, r| {
                *m = (*m).max(r.1);
                Some(*m)
            })
            .collect();
        let overlaps = |old: &SourceManifest| {
            old.shards.iter().any(|s| {
                let (a, e) = (s.addr, s.addr.saturating_add(s.len));
                // Some new range starting before `e` ends after `a`.
                let k = new.partition_point(|r| r.0 < e);
                e > a && k > 0 && reach[k - 1] > a
            })
        };
        for (l, v) in self.versions.iter_mut() {
            if l == label || v.retired.contains_key(&m.slot) {
                continue;
            }
            let hit = v
                .slots
                .get(&m.slot)
                .is_some_and(|old| old.agent_name == m.agent_name && overlaps(old));
            if hit {
                v.retired.insert(m.slot, label.to_string());
            }
        }
    }

    pub(super) fn check_publish(&self, label: &str, m: &SourceManifest) -> Result<Check, Error> {
        crate::limits::label("label", label)?;
        crate::limits::manifest("manifest", m)?;
        let v = self.version(label)?;
        let slot = m.slot;
        if let Some(check) = self.check_republish(label, v, m)? {
            return Ok(check);
        }
        let bad = |tensor: &str, reason: String| Error::BadManifest {
            label: label.to_string(),
            slot,
            tensor: tensor.to_string(),
            reason,
        };
        if slot >= v.trainer_layout.world_size {
            return Err(bad(
                "",
                format!(
                    "slot {slot} is out of range 0..{} of trainer layout {}",
                    v.trainer_layout.world_size, v.trainer_layout
                ),
            ));
        }
        if m.layout != v.trainer_layout {
            return Err(bad(
                "",
                format!(
                    "manifest layout {} is not the declared trainer layout {}",
                    m.layout, v.trainer_layout
                ),
            ));
        }
        let declared: BTreeMap<&str, &TensorSpec> =
            v.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let spec_of = |tensor: &str| {
            declared
                .get(tensor)
                .copied()
                .ok_or_else(|| Error::UndeclaredTensor {
                    label: label.to_string(),
                    slot,
                    tensor: tensor.to_string(),
                })
        };
        for s in &m.shards {
            let spec = spec_of(&s.tensor)?;
            if s.dtype != spec.dtype {
                return Err(Error::Mismatch {
                    label: label.to_string(),
                    slot,
                    tensor: s.tensor.clone(),
                    what: "dtype",
                    published: s.dtype.to_string(),
                    declared: spec.dtype.to_string(),
                });
            }
            if s.global_shape != spec.shape {
                return Err(Error::Mismatch {
                    label: label.to_string(),
                    slot,
                    tensor: s.tensor.clone(),
                    what: "shape",
                    published: shape_str(&s.global_shape),
                    declared: shape_str(&spec.shape),
                });
            }
            if s.shard.global_offset.len() != s.shard.local_shape.len() {
                return Err(bad(&s.tensor, "box offset and shape differ in rank".into()));
            }
            if !s.shard.fits_in(&spec.shape) {
                return Err(bad(
                    &s.tensor,
                    format!(
                        "box {} does not fit global shape {}",
                        s.shard,
                        shape_str(&spec.shape)
                    ),
                ));
            }
            let want = s
                .shard
                .numel()
                .and_then(|n| n.checked_mul(spec.dtype.size_bytes()))
                .ok_or_else(|| bad(&s.tensor, "byte length overflows u64".into()))?;
            if s.len != want {
                return Err(bad(
                    &s.tensor,
                    format!(
                        "len {} bytes, but box {} of {} needs {want}",
                        s.len, s.shard, spec.dtype
                    ),
                ));
            }
            if s.addr.checked_add(s.len).is_none() {
                return Err(bad(&s.tensor, "addr + len overflows u64".into()));
            }
        }
        for p in &m.pieces {
            let spec = spec_of(&p.tensor)?;
            if p.region.global_offset.len() != p.region.local_shape.len()
                || !p.region.fits_in(&spec.shape)
            {
                return Err(bad(
                    &p.tensor,
                    format!(
                        "piece for {} rank {}: region {} does not fit global shape {}",
                        p.layout,
                        p.dest_rank,
                        p.region,
                        shape_str(&spec.shape)
                    ),
                ));
            }
            if p.dest_rank >= p.layout.world_size {
                return Err(bad(
                    &p.tensor,
                    format!(
                        "piece dest_rank {} out of range for {}",
                        p.dest_rank, p.layout
                    ),
                ));
            }
        }
        if let Some(fixed) = v.digest {
            let next = version_digest(
                v.slots
                    .iter()
                    .filter(|(s, _)| **s != slot)
                    .flat_map(|(_, m)| &m.shards)
                    .chain(&m.shards),
            );
            if next != fixed {
                return Err(Error::VersionState {
                    label: label.to_string(),
                    state: v.state,
                    reason: format!(
                        "republishing slot {slot} would change the version digest {fixed} to {next}"
                    ),
                });
            }
        }
        Ok(Check::Apply)
    }

    /// A publish of a slot already published: `Noop` when the manifest is the one held (and the
    /// slot not retired, so applying it again would change nothing), an error once the slot was
    /// republished [`crate::limits::MAX_REPUBLISHES`] times; `None` to check it as a new publish.
    pub(super) fn check_republish(
        &self,
        label: &str,
        v: &Version,
        m: &SourceManifest,
    ) -> Result<Option<Check>, Error> {
        let Some(held) = v.slots.get(&m.slot) else {
            return Ok(None);
        };
        if held == m && !v.retired.contains_key(&m.slot) {
            return Ok(Some(Check::Noop));
        }
        if is_extension(held, m) {
            let n = self
                .extensions
                .get(&(label.to_string(), m.slot))
                .copied()
                .unwrap_or(0);
            if n >= crate::limits::MAX_PIECE_EXTENSIONS {
                return Err(Error::VersionState {
                    label: label.to_string(),
                    state: v.state,
                    reason: format!(
                        "slot {} was already extended {n} times with pieces for more layouts, the limit",
                        m.slot
                    ),
                });
            }
            // Checked as a new publish (its pieces), without counting as a republish.
            return Ok(None);
        }
        let n = self
            .republishes
            .get(&(label.to_string(), m.slot))
            .copied()
            .unwrap_or(0);
        if n >= crate::limits::MAX_REPUBLISHES {
            return Err(Error::VersionState {
                label: label.to_string(),
                state: v.state,
                reason: format!(
                    "slot {} was already published again {n} times with a different manifest, the limit (a publisher restarting that often is broken; declare a new version)",
                    m.slot
                ),
            });
        }
        Ok(None)
    }

    /// Whether `worker_id` serves `label` (any version when `None`) as a peer.
    pub(super) fn serving(&self, worker_id: &str, label: Option<&str>) -> bool {
        self.versions
            .iter()
            .any(|(l, v)| label.is_none_or(|x| x == l) && v.peers.contains_key(worker_id))
    }

    /// Stops `worker_id` serving `label` (every version when `None`).
    pub(super) fn withdraw_peer(&mut self, worker_id: &str, label: Option<&str>) {
        for (l, v) in &mut self.versions {
            if label.is_none_or(|x| x == l) {
                v.peers.remove(worker_id);
            }
        }
    }

    /// A worker may serve a version as a peer when it is registered, the version is READY and
    /// resident on it (as the control plane last learned), its manifest is well formed, every
    /// shard is a region the version's record holds for the worker's layout with the same
    /// digest (the trainers' pieces it verified when it staged), and every piece it cut for a
    /// (layout, rank, region) the record already holds has the recorded digest.
    pub(super) fn check_peer(
        &self,
        label: &str,
        worker_id: &str,
        m: &SourceManifest,
    ) -> Result<Check, Error> {
        let v = self.version(label)?;
        let Some(digest) = v.digest else {
            return Err(invalid(
                "label",
                format!(
                    "version {label} is {}: only a READY version is served",
                    v.state
                ),
            ));
        };
        let w = self
            .workers
            .get(worker_id)
            .ok_or_else(|| Error::UnknownWorker {
                worker_id: worker_id.to_string(),
            })?;
        let id = VersionId(digest);
        if !w.resident_id.as_ref().is_some_and(|r| r.is(id)) {
            return Err(invalid(
                "worker_id",
                format!(
                    "worker {worker_id} holds {}, not {label} ({id}): it can serve only what is resident",
                    w.resident_id
                        .as_ref()
                        .map_or_else(|| "nothing".into(), ToString::to_string)
                ),
            ));
        }
        crate::limits::manifest("manifest", m)?;
        mx_layout::plan::validate_manifest(m).map_err(|e| invalid("manifest", e.to_string()))?;
        // The record: every piece the trainers published, by (layout, rank, tensor, region).
        let mut record: std::collections::HashMap<(LayoutSpec, u32, &str, &TensorBox), Digest> =
            std::collections::HashMap::new();
        for s in v.slots.values() {
            for p in &s.pieces {
                record.insert(
                    (p.layout, p.dest_rank, p.tensor.as_str(), &p.region),
                    p.digest,
                );
            }
        }
        let held: std::collections::HashSet<(&str, &TensorBox, Digest)> = v
            .slots
            .values()
            .flat_map(|s| s.pieces.iter())
            .filter(|p| p.layout == w.layout)
            .map(|p| (p.tensor.as_str(), &p.region, p.digest))
            .collect();
        for (i, s) in m.shards.iter().enumerate() {
            if !held.contains(&(s.tensor.as_str(), &s.shard, s.digest)) {
                return Err(invalid(
                    format!("manifest.shards[{i}]"),
                    format!(
                        "tensor {} region {} with digest {} is not a region of {label}'s record for layout {}",
                        s.tensor, s.shard, s.digest, w.layout
                    ),
                ));
            }
        }
        for (i, p) in m.pieces.iter().enumerate() {
            if let Some(d) = record.get(&(p.layout, p.dest_rank, p.tensor.as_str(), &p.region)) {
                if *d != p.digest {
                    return Err(invalid(
                        format!("manifest.pieces[{i}]"),
                        format!(
                            "tensor {} region {} for {} rank {}: digest {}, the record has {d}",
                            p.tensor, p.region, p.layout, p.dest_rank, p.digest
                        ),
                    ));
                }
            }
        }
        if v.peers.get(worker_id) == Some(m) {
            return Ok(Check::Noop);
        }
        if !v.peers.contains_key(worker_id) && v.peers.len() >= crate::limits::MAX_PEERS {
            return Err(invalid(
                "worker_id",
                format!(
                    "{label} has {} peers already (at most {})",
                    v.peers.len(),
                    crate::limits::MAX_PEERS
                ),
            ));
        }
        Ok(Check::Apply)
    }

    /// An artifact may be recorded for a READY (or later) version: its URL parses, a delta names
    /// a known version other than this one as its base, a canonical artifact none. The same URL
    /// again with the same record changes nothing; with another is refused (an artifact is
    /// written once: export a new version to a new prefix).
    pub(super) fn check_artifact(&self, label: &str, a: &ArtifactRecord) -> Result<Check, Error> {
        let v = self.version(label)?;
        let Some(digest) = v.digest else {
            return Err(invalid(
                "label",
                format!(
                    "version {label} is {}: only a READY version has artifacts",
                    v.state
                ),
            ));
        };
        crate::limits::artifact_url("artifact.url", &a.url)?;
        match (a.kind, a.base) {
            (ArtifactKind::Canonical, Some(_)) => {
                return Err(invalid(
                    "artifact.base_version_digest",
                    "a canonical artifact has no base",
                ))
            }
            (ArtifactKind::Delta, None) => {
                return Err(invalid(
                    "artifact.base_version_digest",
                    "a delta names its base version",
                ))
            }
            (ArtifactKind::Delta, Some(b)) => {
                if b == digest {
                    return Err(invalid(
                        "artifact.base_version_digest",
                        "a delta's base is another version",
                    ));
                }
                if !self.versions.values().any(|o| o.digest == Some(b)) {
                    return Err(invalid(
                        "artifact.base_version_digest",
                        format!("no READY version has id mx:{b} (the base must be recorded first)"),
                    ));
                }
            }
            (ArtifactKind::Canonical, None) => {}
        }
        if let Some(old) = v.artifacts.iter().find(|o| o.url == a.url) {
            return if old == a {
                Ok(Check::Noop)
            } else {
                Err(invalid(
                    "artifact.url",
                    format!(
                        "{} is recorded for {label} already, with another manifest or kind",
                        a.url
                    ),
                ))
            };
        }
        if v.artifacts.len() >= crate::limits::MAX_ARTIFACTS {
            return Err(invalid(
                "artifact",
                format!(
                    "{label} has {} artifacts already (at most {})",
                    v.artifacts.len(),
                    crate::limits::MAX_ARTIFACTS
                ),
            ));
        }
        Ok(Check::Apply)
    }
}

/// Whether `m` only extends `held`: the same source (slot, layout, agent name and metadata),
/// identical shards (so the same version digest) and pack time, and `held`'s pieces followed by
/// at least one more (pieces for a destination layout that registered after the publish).
pub(super) fn is_extension(held: &SourceManifest, m: &SourceManifest) -> bool {
    m.pieces.len() > held.pieces.len()
        && m.slot == held.slot
        && m.layout == held.layout
        && m.agent_name == held.agent_name
        && m.agent_metadata == held.agent_metadata
        && m.pack_seconds.to_bits() == held.pack_seconds.to_bits()
        && m.shards == held.shards
        && m.pieces[..held.pieces.len()] == held.pieces[..]
}
