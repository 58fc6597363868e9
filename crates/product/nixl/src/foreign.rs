//! Registration of memory mx does not own ([`ForeignMemory`]): a trainer's tensors, an engine's
//! parameters. And [`HostBuffer`], an unregistered huge-page buffer a caller may own and register
//! that way.

use nixl_sys::{MemType, RegistrationHandle};

use crate::agent::Agent;
use crate::arena::{register, HugeMap, Region};
use crate::Error;

/// Where a [`ForeignMemory`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory, registered as NIXL DRAM (device id 0).
    Host,
    /// Device memory of CUDA device `device`, registered as NIXL VRAM (device id = ordinal).
    Cuda {
        /// CUDA device ordinal.
        device: u32,
    },
}

/// A range of memory the caller owns, registered with an [`Agent`] so that peers can READ it.
///
/// Made by the `unsafe` constructors ([`ForeignMemory::register_host`], and
/// `ForeignMemory::register_cuda` with feature `cuda`), whose contract makes the safe methods
/// sound. Dropping it deregisters the range (the guard holds the agent alive until then); the
/// memory itself is the caller's, before and after. Cheap to move, `Send + Sync`.
pub struct ForeignMemory {
    // Field order is drop order: deregister (in Drop), then release the agent.
    reg: Option<RegistrationHandle>,
    agent: Agent,
    addr: u64,
    len: u64,
    kind: MemoryKind,
}

// SAFETY: a ForeignMemory is an address range plus a registration handle. The constructor's
// contract makes the range valid for reads from any thread for the guard's whole life (the caller
// does not free it and does not write it while mx reads it), and the handle is only touched in
// Drop (&mut self). Reads through `as_slice` are shared reads, so sending or sharing the guard
// across threads is as sound as for a `&'static [u8]`.
unsafe impl Send for ForeignMemory {}
// SAFETY: see Send; every method takes &self and only reads.
unsafe impl Sync for ForeignMemory {}

impl std::fmt::Debug for ForeignMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignMemory")
            .field("agent", &self.agent.name())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

/// Checks a range: non-empty, `addr + len` does not overflow, addressable here, not at 0.
fn check_range(addr: u64, len: u64) -> Result<(usize, usize), Error> {
    if len == 0 {
        return Err(Error::BadLength {
            len,
            reason: "zero",
        });
    }
    if addr == 0 {
        return Err(Error::BadLength {
            len,
            reason: "null address",
        });
    }
    let end = addr.checked_add(len).ok_or(Error::BadLength {
        len,
        reason: "address + length overflows u64",
    })?;
    let too_big = Error::BadLength {
        len,
        reason: "range outside this address space",
    };
    usize::try_from(end).map_err(|_| too_big)?;
    // Both fit: end does, and addr, len < end.
    Ok((addr as usize, len as usize))
}

impl ForeignMemory {
    /// Registers `len` bytes of host memory at `addr` with `agent` (NIXL DRAM), so that peers
    /// holding the agent's metadata can READ them, and mx can read them through
    /// [`ForeignMemory::as_slice`].
    ///
    /// # Safety
    /// The caller guarantees, for as long as the returned guard lives:
    /// - `addr .. addr + len` is one allocation of this process, mapped and initialized, valid
    ///   for reads (it is not freed or unmapped before the guard is dropped);
    /// - nobody writes it while mx reads it: while a publish digests, cuts or copies it, and
    ///   while peers may READ the version published from it (until the publisher says the
    ///   memory is handed back, e.g. `wait_staged`). Writes at other times are allowed, through
    ///   the caller's own pointers (never through slices mx handed out).
    ///
    /// # Errors
    /// [`Error::BadLength`] for `len` 0, a null address, `addr + len` overflowing or beyond this
    /// address space; [`Error::Nixl`] when NIXL refuses the registration.
    pub unsafe fn register_host(agent: &Agent, addr: u64, len: u64) -> Result<Self, Error> {
        let (a, l) = check_range(addr, len)?;
        let region = Region {
            addr: a,
            len: l,
            mem: MemType::Dram,
            dev_id: 0,
        };
        let reg = register(agent, &region)?;
        Ok(ForeignMemory {
            reg: Some(reg),
            agent: agent.clone(),
            addr,
            len,
            kind: MemoryKind::Host,
        })
    }

    /// Registers `len` bytes of CUDA device memory at device address `addr` on device `device`
    /// with `agent` (NIXL VRAM). Without libcuda nothing is called and
    /// [`Error::CudaMissing`] is returned.
    ///
    /// # Safety
    /// As [`ForeignMemory::register_host`], for device memory: `addr .. addr + len` is one live
    /// device allocation on `device` (e.g. a torch tensor's storage) for the guard's whole
    /// life, not written while mx reads it or peers may READ it.
    ///
    /// # Errors
    /// [`Error::CudaMissing`], [`Error::BadLength`] as for host memory, [`Error::Cuda`] when
    /// the device cannot be opened, [`Error::Nixl`] when NIXL refuses the registration (its UCX
    /// backend needs CUDA support for VRAM).
    #[cfg(feature = "cuda")]
    pub unsafe fn register_cuda(
        agent: &Agent,
        device: u32,
        addr: u64,
        len: u64,
    ) -> Result<Self, Error> {
        crate::vram::cuda_available()?;
        let (a, l) = check_range(addr, len)?;
        // Make sure the device exists (and the primary context is created) before NIXL sees it.
        crate::vram::context(device)?;
        let region = Region {
            addr: a,
            len: l,
            mem: MemType::Vram,
            dev_id: u64::from(device),
        };
        let reg = register(agent, &region)?;
        Ok(ForeignMemory {
            reg: Some(reg),
            agent: agent.clone(),
            addr,
            len,
            kind: MemoryKind::Cuda { device },
        })
    }

    /// Start address (what peers put in their read ops).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes (at least 1).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: registrations have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or CUDA device memory.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The agent the range is registered with.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The bytes, for host memory; `None` for device memory (use
    /// [`ForeignMemory::read_into`]).
    ///
    /// The caller must not write the memory while the slice is alive: that is the constructor's
    /// contract (no writes while mx reads it).
    pub fn as_slice(&self) -> Option<&[u8]> {
        match self.kind {
            // SAFETY: register_host's contract: the range is one live, initialized allocation
            // of this process for the guard's life (the slice borrows the guard), and it is not
            // written while mx reads it, which is while this slice is alive.
            MemoryKind::Host => Some(unsafe {
                std::slice::from_raw_parts(self.addr as *const u8, self.len as usize)
            }),
            MemoryKind::Cuda { .. } => None,
        }
    }

    /// Copies `out.len()` bytes starting `offset` bytes into the range into `out`: a memcpy for
    /// host memory; for device memory, synchronous device-to-host copies of at most
    /// [`DTOH_CHUNK`] bytes each (so a large shard never needs a large pinned buffer).
    ///
    /// # Errors
    /// [`Error::BadLength`] when `offset + out.len()` is past the end, [`Error::Cuda`] when a
    /// device copy fails.
    pub fn read_into(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let n = out.len() as u64;
        let end = offset.checked_add(n).filter(|e| *e <= self.len);
        if end.is_none() {
            return Err(Error::BadLength {
                len: n,
                reason: "read past the end of the registered range",
            });
        }
        match self.kind {
            MemoryKind::Host => {
                if let Some(s) = self.as_slice() {
                    let o = offset as usize;
                    out.copy_from_slice(&s[o..o + out.len()]);
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            MemoryKind::Cuda { device } => {
                crate::vram::read_device(device, self.addr + offset, out)
            }
            #[cfg(not(feature = "cuda"))]
            MemoryKind::Cuda { .. } => Err(Error::CudaMissing),
        }
    }
}

/// Largest single device-to-host copy of [`ForeignMemory::read_into`]: 64 MiB.
pub const DTOH_CHUNK: usize = 64 << 20;

impl Drop for ForeignMemory {
    fn drop(&mut self) {
        if let Some(mut reg) = self.reg.take() {
            if let Err(e) = reg.deregister() {
                tracing::warn!(
                    agent = self.agent.name(),
                    error = %e,
                    "deregistering foreign memory failed"
                );
            }
        }
    }
}

/// An unregistered host buffer a caller owns: an anonymous mapping, 2 MiB aligned, huge pages
/// advised, pre-faulted, zeroed (the arena's memory, without the registration). A trainer that
/// has no tensors of its own (the demo trainer, tests) keeps its shards here and registers them
/// with [`ForeignMemory::register_host`]. Unmapped on drop.
pub struct HostBuffer {
    map: HugeMap,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl HostBuffer {
    /// Maps `len` zeroed bytes.
    ///
    /// # Errors
    /// [`Error::BadLength`] for 0 or an unmappable size, [`Error::Mmap`] when the kernel refuses.
    pub fn new(len: u64) -> Result<HostBuffer, Error> {
        Ok(HostBuffer {
            map: HugeMap::new(len)?,
        })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.map.addr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Always false: buffers have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_slice()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_mut_slice()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn bad_ranges_are_typed_errors_before_nixl() {
        let reason = |r: Result<(usize, usize), Error>| match r {
            Err(Error::BadLength { reason, .. }) => reason,
            other => panic!("expected BadLength, got {other:?}"),
        };
        assert_eq!(reason(check_range(4096, 0)), "zero");
        assert_eq!(reason(check_range(0, 16)), "null address");
        assert_eq!(
            reason(check_range(u64::MAX - 4, 16)),
            "address + length overflows u64"
        );
        assert_eq!(check_range(4096, 16).unwrap(), (4096, 16));
    }

    #[test]
    fn host_buffers_are_zeroed_and_writable() {
        let mut b = HostBuffer::new(5000).unwrap();
        assert_eq!(b.len(), 5000);
        assert_eq!(b.addr() % (2 << 20), 0);
        assert!(b.as_slice().iter().all(|x| *x == 0));
        b.as_mut_slice()[4999] = 7;
        assert_eq!(b.as_slice()[4999], 7);
        assert!(HostBuffer::new(0).is_err());
    }
}
