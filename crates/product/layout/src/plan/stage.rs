//! Phase 3 of a plan: staging offsets of the wire runs in (source, addr) order, identical runs
//! staged once, and the reads, coalesced.

use super::order::order_wires;
use super::output::Read;
use crate::Error;

/// Where the wire runs are staged and the reads that stage them.
pub(super) struct Staged {
    /// Staging offset of each wire run, by id.
    pub(super) staging: Vec<u64>,
    /// Coalesced READ descriptors, in (source, address) order.
    pub(super) reads: Vec<Read>,
    /// Size of the staging buffer (bytes).
    pub(super) staging_bytes: u64,
    /// Whether two digest checks may share staging bytes (and so be merged).
    pub(super) shared_staging: bool,
}

/// Phase 3: stages the `wire` runs (sources below `n_sources`) of the groups `member_at`
/// delimits.
///
/// # Errors
/// [`Error::Overflow`] when the staging size overflows u64.
pub(super) fn stage(
    wire: &[(usize, u64, u64)],
    n_sources: usize,
    member_at: &[usize],
) -> Result<Staged, Error> {
    let worder = order_wires(wire, n_sources);
    // Two items can share staging bytes (and be merged) only through a wire run staged once
    // for several (below) or a group of several intersections.
    let mut shared_staging = member_at.windows(2).any(|w| w[1] - w[0] > 1);
    let mut staging = vec![0u64; wire.len()];
    let mut off = 0u64;
    let mut reads: Vec<Read> = Vec::new();
    let mut prev: Option<usize> = None;
    for &i in &worder {
        let (si, a, l) = wire[i];
        if let Some(p) = prev.filter(|&p| wire[p] == wire[i]) {
            staging[i] = staging[p];
            shared_staging = true;
            continue;
        }
        prev = Some(i);
        staging[i] = off;
        match reads.last_mut() {
            Some(r)
                if r.source == si && r.src_addr + r.len == a && r.staging_offset + r.len == off =>
            {
                r.len += l
            }
            _ => reads.push(Read {
                source: si,
                src_addr: a,
                len: l,
                staging_offset: off,
            }),
        }
        off = off.checked_add(l).ok_or(Error::Overflow {
            what: "staging size",
            tensor: String::new(),
        })?;
    }
    drop(worder);
    Ok(Staged {
        staging,
        reads,
        staging_bytes: off,
        shared_staging,
    })
}
