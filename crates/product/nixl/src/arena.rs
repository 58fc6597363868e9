//! Huge-page-backed anonymous mappings and the registered [`Arena`].

use std::ptr::NonNull;

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};

use crate::agent::{check, Agent};
use crate::Error;

/// 2 MiB: the x86-64 transparent huge page size, the arena's alignment and length granule.
pub(crate) const HUGE_PAGE: u64 = 2 << 20;

/// An anonymous private mapping of `len` bytes at a 2 MiB-aligned address, advised for huge
/// pages and pre-faulted. Unmapped on drop.
pub(crate) struct HugeMap {
    ptr: NonNull<u8>,
    /// Bytes mapped (len rounded up to 2 MiB).
    map_len: usize,
    /// Bytes offered to users.
    len: usize,
}

// SAFETY: HugeMap owns its mapping exclusively (like a Vec<u8>); access goes through &self / &mut
// self, so moving or sharing it across threads is as safe as for Vec<u8>.
unsafe impl Send for HugeMap {}
// SAFETY: see Send; &HugeMap only gives shared reads.
unsafe impl Sync for HugeMap {}

impl HugeMap {
    pub(crate) fn new(len: u64) -> Result<HugeMap, Error> {
        HugeMap::with_pages(len, true)
    }

    /// As [`HugeMap::new`]; `huge: false` leaves the mapping on 4 KiB pages (`MADV_NOHUGEPAGE`),
    /// for measuring what huge pages are worth.
    pub(crate) fn with_pages(len: u64, huge_pages: bool) -> Result<HugeMap, Error> {
        if len == 0 {
            return Err(Error::BadLength {
                len,
                reason: "zero",
            });
        }
        let too_big = Error::BadLength {
            len,
            reason: "too large for this address space",
        };
        let map_len = len
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or(too_big)?;
        let huge = HUGE_PAGE as usize;
        let reserve = map_len.checked_add(huge).ok_or(Error::BadLength {
            len,
            reason: "too large for this address space",
        })?;
        // SAFETY: anonymous private mapping with no address hint; the kernel picks a free range.
        // No existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::Mmap {
                len: reserve as u64,
                source: std::io::Error::last_os_error(),
            });
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(huge);
        let head = aligned - start;
        let tail = reserve - head - map_len;
        // SAFETY: [start, start+head) and [aligned+map_len, start+reserve) lie inside the mapping
        // just created and nothing refers to them; unmapping them leaves [aligned, aligned+map_len).
        let trimmed = unsafe {
            (head == 0 || libc::munmap(raw, head) == 0)
                && (tail == 0 || libc::munmap((aligned + map_len) as *mut libc::c_void, tail) == 0)
        };
        if !trimmed {
            let source = std::io::Error::last_os_error();
            // SAFETY: best effort release of the whole reservation (parts may already be gone,
            // which munmap accepts).
            unsafe { libc::munmap(raw, reserve) };
            return Err(Error::Mmap {
                len: reserve as u64,
                source,
            });
        }
        let advice = if huge_pages {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: the range is our own mapping; madvise only changes how the kernel backs it.
        let advised = unsafe { libc::madvise(aligned as *mut libc::c_void, map_len, advice) };
        if advised != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "MADV_HUGEPAGE refused; the arena uses 4 KiB pages"
            );
        }
        let ptr = NonNull::new(aligned as *mut u8).ok_or(Error::Mmap {
            len: reserve as u64,
            source: std::io::Error::other("mmap returned address 0"),
        })?;
        let len = usize::try_from(len).map_err(|_| Error::BadLength {
            len,
            reason: "too large for this address space",
        })?;
        let mut map = HugeMap { ptr, map_len, len };
        map.prefault();
        Ok(map)
    }

    /// Touches every 4 KiB page so the memory is resident (as 2 MiB pages where the kernel can)
    /// before NIXL registers it and transfers land in it.
    fn prefault(&mut self) {
        let all = self.as_mut_slice();
        for page in all.chunks_mut(4096) {
            page[0] = 0;
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is mapped read/write for the life of self and initialized (anonymous
        // memory is zero-filled); &self excludes writers through this type.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugeMap {
    fn drop(&mut self) {
        // SAFETY: exactly the range mapped in new (after trimming), unmapped once; no slices into
        // it outlive self.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "munmap of arena failed");
        }
    }
}

/// A memory range as nixl-sys wants it for registration.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem: MemType,
    pub(crate) dev_id: u64,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.mem
    }

    fn device_id(&self) -> u64 {
        self.dev_id
    }
}

/// Registers `region` with `agent`'s UCX backend.
pub(crate) fn register(agent: &Agent, region: &Region) -> Result<RegistrationHandle, Error> {
    let mut args = check("nixl_capi_create_opt_args", nixl_sys::OptArgs::new())?;
    check(
        "nixl_capi_opt_args_add_backend",
        args.add_backend(&agent.inner.backend),
    )?;
    check(
        "nixl_capi_register_mem",
        agent.inner.nixl.register_memory(region, Some(&args)),
    )
}

/// One huge-page-backed DRAM buffer registered with an [`Agent`] (NIXL DRAM, device id 0).
///
/// Length is what was asked; the mapping is rounded up to 2 MiB. The memory starts zeroed.
/// Dropping the arena deregisters it from NIXL first (the guard holds the agent alive), then
/// unmaps it. Peers may READ it at any time while it is registered and their metadata is loaded;
/// mx never lets peers WRITE it.
pub struct Arena {
    // Field order is drop order: deregister, release the agent, then unmap.
    reg: Option<RegistrationHandle>,
    agent: Agent,
    map: HugeMap,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("agent", &self.agent.name())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl Arena {
    /// Maps `len` bytes (2 MiB aligned, huge pages advised, pre-faulted) and registers them with
    /// `agent` as DRAM.
    ///
    /// # Errors
    /// [`Error::BadLength`] for 0 or an unmappable size, [`Error::Mmap`] when the kernel refuses,
    /// [`Error::Nixl`] when registration fails.
    pub fn new(agent: &Agent, len: u64) -> Result<Arena, Error> {
        Arena::with_pages(agent, len, true)
    }

    /// As [`Arena::new`]; `huge: false` maps 4 KiB pages (`MADV_NOHUGEPAGE`) instead, to measure
    /// what huge pages are worth (per-page pinning and TLB cost in UCX's CMA path).
    ///
    /// # Errors
    /// As [`Arena::new`].
    pub fn with_pages(agent: &Agent, len: u64, huge: bool) -> Result<Arena, Error> {
        let map = HugeMap::with_pages(len, huge)?;
        let region = Region {
            addr: map.addr(),
            len: map.len(),
            mem: MemType::Dram,
            dev_id: 0,
        };
        let reg = register(agent, &region)?;
        Ok(Arena {
            reg: Some(reg),
            agent: agent.clone(),
            map,
        })
    }

    /// Start address in this process (what peers put in their [`ReadOp::remote_addr`]).
    ///
    /// [`ReadOp::remote_addr`]: crate::ReadOp::remote_addr
    pub fn addr(&self) -> u64 {
        self.map.addr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Always false: arenas have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The agent this arena is registered with.
    pub fn agent(&self) -> &Agent {
        &self.agent
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

impl Drop for Arena {
    fn drop(&mut self) {
        if let Some(mut reg) = self.reg.take() {
            if let Err(e) = reg.deregister() {
                tracing::warn!(agent = self.agent.name(), error = %e, "deregistering arena failed");
            }
        }
        // Then `agent` and `map` drop in that order: the memory is unmapped after deregistration.
    }
}
