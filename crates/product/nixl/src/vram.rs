//! Device memory registered with NIXL as VRAM (feature `cuda`), through cudarc.
//!
//! Every entry point first checks that the CUDA driver library can be loaded
//! ([`cuda_available`]): cudarc's `CudaContext::new` panics without it, so nothing here calls
//! into CUDA on a GPU-less machine; it returns [`Error::CudaMissing`] instead.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use nixl_sys::{MemType, RegistrationHandle};

use crate::agent::Agent;
use crate::arena::{register, Region};
use crate::Error;

fn cuda_err(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        status: e.to_string(),
    }
}

/// Ok when the CUDA driver library (libcuda.so) can be loaded on this machine.
///
/// # Errors
/// [`Error::CudaMissing`] otherwise.
pub fn cuda_available() -> Result<(), Error> {
    // SAFETY: is_culib_present only tries to dlopen the CUDA driver library by its standard names
    // (running its initializers, as any use of CUDA would) and reports whether that worked.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(Error::CudaMissing)
    }
}

/// The primary context of CUDA device `device`, retained once per process and kept (a trainer's
/// framework holds it too; releasing it here could tear down its allocations).
pub(crate) fn context(device: u32) -> Result<Arc<CudaContext>, Error> {
    use std::collections::BTreeMap;
    use std::sync::{Mutex, OnceLock};
    static CONTEXTS: OnceLock<Mutex<BTreeMap<u32, Arc<CudaContext>>>> = OnceLock::new();
    cuda_available()?;
    let mut map = CONTEXTS
        .get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(c) = map.get(&device) {
        return Ok(Arc::clone(c));
    }
    let c = CudaContext::new(device as usize).map_err(cuda_err("CudaContext::new"))?;
    map.insert(device, Arc::clone(&c));
    Ok(c)
}

/// Copies `out.len()` bytes from device address `addr` of device `device` to `out`, in
/// synchronous copies of at most [`crate::DTOH_CHUNK`] bytes.
///
/// The caller (a [`crate::ForeignMemory`] of kind `Cuda`) guarantees `addr .. addr + out.len()`
/// lies in a live device allocation of `device`.
pub(crate) fn read_device(device: u32, addr: u64, out: &mut [u8]) -> Result<(), Error> {
    let ctx = context(device)?;
    ctx.bind_to_thread().map_err(cuda_err("bind_to_thread"))?;
    let mut at = addr;
    for chunk in out.chunks_mut(crate::DTOH_CHUNK) {
        // SAFETY: `chunk` is a valid host slice; `at .. at + chunk.len()` lies inside a live
        // device allocation on `device` (the ForeignMemory constructor's contract, range checked
        // by read_into), whose context is current on this thread.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(chunk, at) }
            .map_err(cuda_err("cuMemcpyDtoH"))?;
        at += chunk.len() as u64;
    }
    Ok(())
}

/// A zeroed device buffer on GPU `device`, registered with an [`Agent`] as NIXL VRAM (device id =
/// the CUDA ordinal). Dropping it deregisters first, then frees the device memory.
pub struct VramBuffer {
    // Field order is drop order (see Drop): registration, agent, memory, stream.
    reg: Option<RegistrationHandle>,
    agent: Agent,
    buf: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    addr: u64,
    len: u64,
    device: usize,
}

impl std::fmt::Debug for VramBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VramBuffer")
            .field("agent", &self.agent.name())
            .field("device", &self.device)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl VramBuffer {
    /// Allocates `len` zeroed bytes on CUDA device `device` and registers them with `agent`.
    ///
    /// # Errors
    /// [`Error::CudaMissing`] without libcuda, [`Error::BadLength`] for 0 or an unaddressable size,
    /// [`Error::Cuda`] when the driver fails (no such device, out of memory), [`Error::Nixl`] when
    /// registration fails (the UCX backend needs CUDA support for VRAM).
    pub fn new(agent: &Agent, device: usize, len: u64) -> Result<VramBuffer, Error> {
        cuda_available()?;
        if len == 0 {
            return Err(Error::BadLength {
                len,
                reason: "zero",
            });
        }
        let n = usize::try_from(len).map_err(|_| Error::BadLength {
            len,
            reason: "too large for this address space",
        })?;
        let ctx = CudaContext::new(device).map_err(cuda_err("CudaContext::new"))?;
        let stream = ctx.default_stream();
        let buf = stream
            .alloc_zeros::<u8>(n)
            .map_err(cuda_err("alloc_zeros"))?;
        let addr = {
            let (ptr, _sync) = buf.device_ptr(&stream);
            ptr
        };
        stream.synchronize().map_err(cuda_err("synchronize"))?;
        let region = Region {
            addr: addr as usize,
            len: n,
            mem: MemType::Vram,
            dev_id: device as u64,
        };
        let reg = register(agent, &region)?;
        Ok(VramBuffer {
            reg: Some(reg),
            agent: agent.clone(),
            buf,
            stream,
            addr,
            len,
            device,
        })
    }

    /// Device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: buffers have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CUDA device ordinal (also the NIXL device id).
    pub fn device(&self) -> usize {
        self.device
    }

    /// Copies `src` to the start of the buffer and waits for the copy.
    ///
    /// # Errors
    /// [`Error::BadLength`] when `src` is longer than the buffer, [`Error::Cuda`].
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), Error> {
        if src.len() as u64 > self.len {
            return Err(Error::BadLength {
                len: src.len() as u64,
                reason: "source longer than the VRAM buffer",
            });
        }
        self.stream
            .memcpy_htod(src, &mut self.buf)
            .map_err(cuda_err("memcpy_htod"))?;
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    /// Copies the whole buffer to host memory.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn to_host(&self) -> Result<Vec<u8>, Error> {
        self.stream
            .clone_dtoh(&self.buf)
            .map_err(cuda_err("clone_dtoh"))
    }
}

impl Drop for VramBuffer {
    fn drop(&mut self) {
        if let Some(mut reg) = self.reg.take() {
            if let Err(e) = reg.deregister() {
                tracing::warn!(agent = self.agent.name(), error = %e, "deregistering VRAM failed");
            }
        }
        // Then the agent, the device memory and the stream drop in field order.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vram_needs_libcuda_or_skips() {
        match cuda_available() {
            Err(Error::CudaMissing) => eprintln!("SKIPPED vram test: no libcuda on this machine"),
            Err(e) => panic!("unexpected {e}"),
            Ok(()) => {
                if crate::nixl_available().is_err() {
                    eprintln!("SKIPPED vram test: NIXL missing");
                    return;
                }
                let agent = Agent::new(&format!("mx-vram-{}", std::process::id()))
                    .unwrap_or_else(|e| panic!("agent: {e}"));
                let mut buf = match VramBuffer::new(&agent, 0, 1 << 20) {
                    Ok(b) => b,
                    Err(e @ (Error::Cuda { .. } | Error::Nixl { .. })) => {
                        eprintln!("SKIPPED vram test: {e}");
                        return;
                    }
                    Err(e) => panic!("unexpected {e}"),
                };
                let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
                buf.copy_from_host(&data)
                    .unwrap_or_else(|e| panic!("htod: {e}"));
                assert_eq!(buf.to_host().unwrap_or_else(|e| panic!("dtoh: {e}")), data);
            }
        }
    }

    #[test]
    fn foreign_device_memory_reads_back_in_chunks_or_skips() {
        if let Err(e) = cuda_available() {
            eprintln!("SKIPPED foreign device memory test: {e}");
            return;
        }
        if crate::nixl_available().is_err() {
            eprintln!("SKIPPED foreign device memory test: NIXL missing");
            return;
        }
        let owner = Agent::new(&format!("mx-vram-owner-{}", std::process::id()))
            .unwrap_or_else(|e| panic!("agent: {e}"));
        let len = crate::DTOH_CHUNK + 4096 + 3;
        let mut buf = match VramBuffer::new(&owner, 0, len as u64) {
            Ok(b) => b,
            Err(e @ (Error::Cuda { .. } | Error::Nixl { .. })) => {
                eprintln!("SKIPPED foreign device memory test: {e}");
                return;
            }
            Err(e) => panic!("unexpected {e}"),
        };
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        buf.copy_from_host(&data)
            .unwrap_or_else(|e| panic!("htod: {e}"));
        // The device memory as a caller (a torch tensor) would hand it over.
        let other = Agent::new(&format!("mx-vram-foreign-{}", std::process::id()))
            .unwrap_or_else(|e| panic!("agent: {e}"));
        // SAFETY: `buf` is a live device allocation of `len` bytes on device 0 that outlives
        // `mem` (dropped first) and is not written meanwhile.
        let mem = match unsafe {
            crate::ForeignMemory::register_cuda(&other, 0, buf.addr(), buf.len())
        } {
            Ok(m) => m,
            Err(e @ Error::Nixl { .. }) => {
                eprintln!("SKIPPED foreign device memory test: {e}");
                return;
            }
            Err(e) => panic!("unexpected {e}"),
        };
        assert_eq!(mem.kind(), crate::MemoryKind::Cuda { device: 0 });
        assert!(mem.as_slice().is_none());
        let mut back = vec![0u8; len - 7];
        mem.read_into(7, &mut back)
            .unwrap_or_else(|e| panic!("dtoh: {e}"));
        assert_eq!(back, data[7..]);
        drop(mem);
    }
}
