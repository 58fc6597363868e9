//! Coverage of a version's declared tensors by its published shards: the readiness of a
//! version and the first gap of each tensor left uncovered.

use super::*;

impl Version {
    /// Recomputes coverage, state and digest after a publish.
    pub(super) fn evaluate(&mut self) {
        // Slots are checked to be < world_size: all are in when there are world_size of them.
        let all_in = self.slots.len() == self.trainer_layout.world_size as usize;
        if !all_in {
            self.missing_tensors.clear();
            self.gaps.clear();
            if self.state == VersionState::Declared {
                self.state = VersionState::Publishing;
            }
            return;
        }
        let mut boxes: BTreeMap<&str, Vec<&TensorBox>> = BTreeMap::new();
        for s in self.slots.values().flat_map(|m| &m.shards) {
            boxes.entry(s.tensor.as_str()).or_default().push(&s.shard);
        }
        let mut missing = Vec::new();
        let mut gaps = Vec::new();
        for t in &self.tensors {
            match boxes.get(t.name.as_str()) {
                None => missing.push(t.name.clone()),
                Some(bs) => {
                    if let Some(region) = first_gap(&t.shape, bs) {
                        gaps.push(CoverageGap {
                            tensor: t.name.clone(),
                            region,
                        });
                    }
                }
            }
        }
        self.missing_tensors = missing;
        self.gaps = gaps;
        match self.state {
            VersionState::Declared | VersionState::Publishing => {
                if self.missing_tensors.is_empty() && self.gaps.is_empty() {
                    self.state = VersionState::Ready;
                    self.digest = Some(version_digest(self.slots.values().flat_map(|m| &m.shards)));
                } else {
                    self.state = VersionState::Publishing;
                }
            }
            // A republish after READY was checked to keep the digest (and so the boxes).
            _ => {}
        }
    }
}

/// The first box of `shape` that no box in `boxes` covers, `None` when the union covers it all.
/// Boxes must have the same rank as `shape`; overlaps (replicated sources) are fine.
pub(super) fn first_gap(shape: &[u64], boxes: &[&TensorBox]) -> Option<TensorBox> {
    let region = TensorBox::full(shape);
    if region.is_empty() {
        return None;
    }
    let live: Vec<&TensorBox> = boxes
        .iter()
        .copied()
        .filter(|b| b.ndim() == shape.len() && !b.is_empty())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    gap_in(region, live, 0)
}

/// Sweeps dim `dim` of `region`: splits it at every box edge, and for each slab recurses into
/// the next dim with the boxes spanning the whole slab.
fn gap_in(region: TensorBox, mut boxes: Vec<&TensorBox>, dim: usize) -> Option<TensorBox> {
    if dim == region.ndim() {
        return if boxes.is_empty() { Some(region) } else { None };
    }
    let lo = region.global_offset[dim];
    let hi = lo + region.local_shape[dim];
    let start = |b: &TensorBox| b.global_offset[dim].clamp(lo, hi);
    let end = |b: &TensorBox| {
        b.global_offset[dim]
            .saturating_add(b.local_shape[dim])
            .clamp(lo, hi)
    };
    boxes.retain(|b| start(b) < end(b));
    boxes.sort_by_key(|b| start(b));
    let mut cuts: Vec<u64> = vec![lo, hi];
    for b in &boxes {
        cuts.push(start(b));
        cuts.push(end(b));
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut next = 0;
    let mut active: Vec<&TensorBox> = Vec::new();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        while next < boxes.len() && start(boxes[next]) <= a {
            active.push(boxes[next]);
            next += 1;
        }
        active.retain(|x| end(x) > a);
        let mut slab = region.clone();
        slab.global_offset[dim] = a;
        slab.local_shape[dim] = b - a;
        if active.is_empty() {
            return Some(slab);
        }
        if let Some(g) = gap_in(slab, active.clone(), dim + 1) {
            return Some(g);
        }
    }
    None
}
