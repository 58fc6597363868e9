//! Batched, polled NIXL READs into a local [`Arena`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nixl_sys::{MemType, XferDescList, XferOp, XferRequest, XferStatus};

use crate::agent::{check, Agent};
use crate::arena::Arena;
use crate::Error;

/// One READ descriptor: `len` bytes at `remote_addr` in the remote agent's registered DRAM go to
/// `local_offset` in the local arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadOp {
    /// Address in the remote process (inside memory it registered and published).
    pub remote_addr: u64,
    /// Bytes to read; must be > 0.
    pub len: u64,
    /// Destination offset in the local arena; `local_offset + len <= arena.len()`.
    pub local_offset: u64,
}

/// How [`Agent::read`] batches and waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// Most descriptors in one NIXL transfer request (> 0).
    pub batch: usize,
    /// Most transfer requests posted and not yet complete (> 0).
    pub max_in_flight: usize,
    /// Deadline for the whole call, measured from its start.
    pub timeout: Duration,
}

impl Default for ReadOptions {
    /// 1024 descriptors per request, 4 requests in flight, 60 s.
    fn default() -> Self {
        ReadOptions {
            batch: 1024,
            max_in_flight: 4,
            timeout: Duration::from_secs(60),
        }
    }
}

/// What one [`Agent::read`] moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct XferStats {
    /// READ descriptors executed (one per [`ReadOp`]).
    pub descriptors: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Wall time of the call, seconds.
    pub seconds: f64,
}

impl XferStats {
    /// Bytes per second divided by 1e9 (0 when nothing was timed).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

impl ReadOptions {
    fn validate(&self) -> Result<(), Error> {
        if self.batch == 0 {
            return Err(Error::BadReadOptions {
                field: "batch",
                reason: "must be at least 1",
            });
        }
        if self.max_in_flight == 0 {
            return Err(Error::BadReadOptions {
                field: "max_in_flight",
                reason: "must be at least 1",
            });
        }
        Ok(())
    }
}

/// Checks every op against the arena and address-space bounds; returns the total byte count.
pub(crate) fn validate_ops(ops: &[ReadOp], arena_len: u64) -> Result<u64, Error> {
    let mut total: u64 = 0;
    for (index, op) in ops.iter().enumerate() {
        let bad = |reason: String| Error::BadReadOp { index, reason };
        if op.len == 0 {
            return Err(bad("len is 0".to_string()));
        }
        let local_end = op.local_offset.checked_add(op.len).ok_or_else(|| {
            bad(format!(
                "local_offset {} + len {} overflows u64",
                op.local_offset, op.len
            ))
        })?;
        if local_end > arena_len {
            return Err(bad(format!(
                "local range [{}, {}) ends past the arena ({} bytes)",
                op.local_offset, local_end, arena_len
            )));
        }
        let remote_end = op.remote_addr.checked_add(op.len).ok_or_else(|| {
            bad(format!(
                "remote_addr {:#x} + len {} overflows u64",
                op.remote_addr, op.len
            ))
        })?;
        if usize::try_from(remote_end).is_err() {
            return Err(bad(format!(
                "remote range ends at {remote_end:#x}, past this platform's address space"
            )));
        }
        total = total
            .checked_add(op.len)
            .ok_or_else(|| bad("total bytes overflow u64".to_string()))?;
    }
    Ok(total)
}

/// A posted request and how many descriptors it carries.
struct InFlight {
    req: XferRequest,
    descriptors: usize,
}

impl Agent {
    /// Executes READs from the `remote` agent's DRAM (device id 0) into `local`.
    ///
    /// Every op is validated first (length > 0, `local_offset + len` within the arena with checked
    /// arithmetic, remote end within the address space). Ops are then cut into NIXL transfer
    /// requests of at most `opts.batch` descriptors (one descriptor per op, in order) and *all*
    /// requests are created, which makes NIXL check every remote range against the memory the
    /// peer registered; only then are they posted, at most `opts.max_in_flight` at once, and
    /// polled with `get_xfer_status` (which also drives UCX progress) until all complete. So a bad
    /// op, local or remote, fails the call with nothing posted.
    ///
    /// Ops whose local ranges overlap leave those bytes in an unspecified one of the sources.
    ///
    /// # Errors
    /// Nothing is posted for [`Error::BadReadOptions`], [`Error::BadReadOp`],
    /// [`Error::ForeignArena`] (`local` belongs to another agent), [`Error::UnknownRemote`]
    /// (`remote` not loaded with [`Agent::load_remote`]) and [`Error::Nixl`] with call
    /// `nixl_capi_create_xfer_req` (a remote range outside the peer's registered memory). After
    /// [`Error::Nixl`] from posting or polling (a transfer failed, e.g. the peer died) or
    /// [`Error::Timeout`] the arena's contents are unspecified; requests still in flight are
    /// released before returning.
    pub fn read(
        &self,
        remote: &str,
        ops: &[ReadOp],
        local: &mut Arena,
        opts: &ReadOptions,
    ) -> Result<XferStats, Error> {
        let start = Instant::now();
        opts.validate()?;
        if !self.same_agent(local.agent()) {
            return Err(Error::ForeignArena {
                agent: self.name().to_string(),
                arena_agent: local.agent().name().to_string(),
            });
        }
        let bytes = validate_ops(ops, local.len())?;
        if !self.has_remote(remote) {
            return Err(Error::UnknownRemote {
                agent: self.name().to_string(),
                remote: remote.to_string(),
            });
        }
        let base = local.addr();
        let mut args = check("nixl_capi_create_opt_args", nixl_sys::OptArgs::new())?;
        check(
            "nixl_capi_opt_args_add_backend",
            args.add_backend(&self.inner.backend),
        )?;
        // Phase 1: create every request. NIXL checks each remote range against the peer's
        // registered memory here, so a bad range fails the call before any byte moves.
        let mut prepared: VecDeque<InFlight> = ops
            .chunks(opts.batch)
            .map(|chunk| {
                Ok(InFlight {
                    req: self.prepare_read(remote, base, chunk, &args)?,
                    descriptors: chunk.len(),
                })
            })
            .collect::<Result<_, Error>>()?;
        // Phase 2: post with at most max_in_flight outstanding, polling (which drives progress).
        let mut in_flight: VecDeque<InFlight> = VecDeque::with_capacity(opts.max_in_flight);
        loop {
            while in_flight.len() < opts.max_in_flight {
                let Some(next) = prepared.pop_front() else {
                    break;
                };
                let in_progress = check(
                    "nixl_capi_post_xfer_req",
                    self.inner.nixl.post_xfer_req(&next.req, Some(&args)),
                )?;
                if in_progress {
                    in_flight.push_back(next);
                }
            }
            if in_flight.is_empty() {
                break;
            }
            let mut i = 0;
            while i < in_flight.len() {
                let status = check(
                    "nixl_capi_get_xfer_status",
                    self.inner.nixl.get_xfer_status(&in_flight[i].req),
                )?;
                if status == XferStatus::Success {
                    // Dropping the request releases it.
                    in_flight.remove(i);
                } else {
                    i += 1;
                }
            }
            if !in_flight.is_empty() && start.elapsed() > opts.timeout {
                return Err(Error::Timeout {
                    remote: remote.to_string(),
                    waited: start.elapsed(),
                    pending_requests: in_flight.len(),
                    pending_descriptors: in_flight
                        .iter()
                        .chain(prepared.iter())
                        .map(|f| f.descriptors)
                        .sum(),
                });
            }
        }
        Ok(XferStats {
            descriptors: ops.len() as u64,
            bytes,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Creates (does not post) one READ request for `chunk` (already validated).
    fn prepare_read(
        &self,
        remote: &str,
        base: u64,
        chunk: &[ReadOp],
        args: &nixl_sys::OptArgs,
    ) -> Result<XferRequest, Error> {
        let mut local_list = check(
            "nixl_capi_create_xfer_dlist",
            XferDescList::new(MemType::Dram),
        )?;
        let mut remote_list = check(
            "nixl_capi_create_xfer_dlist",
            XferDescList::new(MemType::Dram),
        )?;
        for op in chunk {
            // Validated: local_offset + len <= arena len, so base + local_offset is inside the
            // mapping; remote_addr + len fits usize.
            local_list.add_desc((base + op.local_offset) as usize, op.len as usize, 0);
            remote_list.add_desc(op.remote_addr as usize, op.len as usize, 0);
        }
        check(
            "nixl_capi_create_xfer_req",
            self.inner.nixl.create_xfer_req(
                XferOp::Read,
                &local_list,
                &remote_list,
                remote,
                Some(args),
            ),
        )
    }
}
