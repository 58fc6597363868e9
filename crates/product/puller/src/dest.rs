//! Destination memory: where an engine's parameters live. The puller writes applied versions
//! into it in place and never moves or frees it.

use mx_layout::{DType, RankLayout};

use crate::exec::{RankSwap, RankTarget};
use crate::Error;

/// Memory an engine owns and registers with the puller: one parameter (or a whole rank laid
/// out as its [`RankLayout`]). Its address never changes while registered.
///
/// Host memory returns its bytes from [`DestMemory::host`] / [`DestMemory::host_mut`] and the
/// puller copies into them directly. Device memory returns `None` there and implements
/// [`DestMemory::write`] / [`DestMemory::read`] (e.g. with cudaMemcpy); the puller then
/// assembles each parameter in a host scratch buffer of that parameter's size and writes it
/// with one call.
pub trait DestMemory: Send + Sync {
    /// Length in bytes.
    fn len(&self) -> u64;

    /// True when empty (a zero-sized parameter).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address of the first byte in this process (a data pointer, device or host), for
    /// reports that check addresses stay put.
    fn data_ptr(&self) -> u64;

    /// The bytes, when they are host memory.
    fn host(&self) -> Option<&[u8]>;

    /// The bytes, writable, when they are host memory.
    fn host_mut(&mut self) -> Option<&mut [u8]>;

    /// Writes `bytes` at `offset` (device memory; host memory need not override this).
    ///
    /// # Errors
    /// A message saying why the memory refused.
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let len = self.len();
        let host = self
            .host_mut()
            .ok_or("device memory must implement DestMemory::write")?;
        let dst = usize::try_from(offset)
            .ok()
            .and_then(|lo| Some(lo..lo.checked_add(bytes.len())?))
            .and_then(|r| host.get_mut(r))
            .ok_or_else(|| format!("{offset}+{} is outside {len} bytes", bytes.len()))?;
        dst.copy_from_slice(bytes);
        Ok(())
    }

    /// Checks that the memory is still where it was registered, before the puller writes or
    /// reads it (an engine may have freed, moved or resized what is behind a raw pointer; a
    /// binding checks its tensor here). The default: nothing can move.
    ///
    /// # Errors
    /// A message saying what changed.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` (device memory; host memory need not override this).
    ///
    /// # Errors
    /// A message saying why the memory refused.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let len = self.len();
        let host = self
            .host()
            .ok_or("device memory must implement DestMemory::read")?;
        let src = usize::try_from(offset)
            .ok()
            .and_then(|lo| Some(lo..lo.checked_add(out.len())?))
            .and_then(|r| host.get(r))
            .ok_or_else(|| format!("{offset}+{} is outside {len} bytes", out.len()))?;
        out.copy_from_slice(src);
        Ok(())
    }
}

/// A host buffer the puller's caller hands over (the reference worker's rank buffers).
impl DestMemory for Vec<u8> {
    fn len(&self) -> u64 {
        Vec::len(self) as u64
    }

    fn data_ptr(&self) -> u64 {
        self.as_ptr() as u64
    }

    fn host(&self) -> Option<&[u8]> {
        Some(self)
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        Some(self)
    }
}

/// Host memory the engine owns, given to the puller as a raw pointer and length (a torch
/// tensor's `data_ptr()`, a C `malloc`): the C ABI and the Python package register parameters
/// through it. The puller never frees or moves it.
#[derive(Debug)]
pub struct HostRegion {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: `HostRegion::new`'s contract makes the range valid for reads and writes from any
// thread while the puller holds it, and reserves it to the puller during stage/apply/rollback;
// the puller accesses destination memory only through `&mut self` or under its owner's lock.
#[allow(unsafe_code)]
unsafe impl Send for HostRegion {}
// SAFETY: see Send; shared access only reads.
#[allow(unsafe_code)]
unsafe impl Sync for HostRegion {}

#[allow(unsafe_code)]
impl HostRegion {
    /// Wraps `len` bytes at `addr`.
    ///
    /// # Errors
    /// A message (to be prefixed with the parameter's name) for a NULL `addr` with a non-zero
    /// `len`, a `len` above `isize::MAX`, or a range that wraps the address space.
    ///
    /// # Safety
    /// Until the region is dropped (the puller that holds it is dropped), `addr .. addr + len`
    /// stays allocated, readable and writable, and nothing else writes it while the puller
    /// writes it (during apply and rollback) or reads it while the puller writes it.
    pub unsafe fn new(addr: u64, len: u64) -> Result<HostRegion, String> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| format!("length {len} is too large"))?;
        let ptr = match std::ptr::NonNull::new(addr as usize as *mut u8) {
            Some(p) => p,
            None if len == 0 => std::ptr::NonNull::dangling(),
            None => return Err("NULL pointer".into()),
        };
        if (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(format!("address {addr:#x} + length {len} overflows"));
        }
        Ok(HostRegion { ptr, len })
    }
}

#[allow(unsafe_code)]
impl DestMemory for HostRegion {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn data_ptr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn host(&self) -> Option<&[u8]> {
        // SAFETY: non-null (or dangling with len 0), len <= isize::MAX, one allocation that
        // stays readable while held (HostRegion::new's checks and contract).
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    fn host_mut(&mut self) -> Option<&mut [u8]> {
        // SAFETY: as host(), and writable; the contract reserves the range to the puller while
        // it writes, so no other reference to it is used meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }
}

/// One destination tensor as an engine registers it: the parameter's dtype and shape (checked
/// against the layout) and its memory.
pub struct DestTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape of this rank's parameter, e.g. `[qkv rows, hidden]` for a fused qkv.
    pub shape: Vec<u64>,
    /// Where its bytes live (row-major, contiguous).
    pub memory: Box<dyn DestMemory>,
}

impl std::fmt::Debug for DestTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DestTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("data_ptr", &format_args!("{:#x}", self.memory.data_ptr()))
            .field("len", &self.memory.len())
            .finish()
    }
}

/// One registered range of a rank's layout.
struct Span {
    /// Offset in the rank's layout.
    offset: u64,
    len: u64,
    /// The parameter's name, or `None` for a whole-rank buffer.
    param: Option<String>,
    memory: Box<dyn DestMemory>,
}

/// A rank's destination memory: either one buffer laid out as the whole [`RankLayout`], or one
/// memory per parameter. Offsets are the layout's.
pub(crate) struct RankMemory {
    rank: u32,
    total: u64,
    /// Sorted by offset, disjoint.
    spans: Vec<Span>,
}

impl std::fmt::Debug for RankMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankMemory")
            .field("rank", &self.rank)
            .field("spans", &self.spans.len())
            .finish()
    }
}

impl RankMemory {
    /// Nothing registered yet for `rl`.
    pub(crate) fn new(rl: &RankLayout) -> RankMemory {
        RankMemory {
            rank: rl.rank,
            total: rl.total_bytes,
            spans: Vec::new(),
        }
    }

    /// Registers one buffer laid out as the whole rank.
    ///
    /// # Errors
    /// [`Error::BadDestination`] when something is registered already or the length differs.
    pub(crate) fn set_whole(&mut self, memory: Box<dyn DestMemory>) -> Result<(), Error> {
        let bad = |reason: String| Error::BadDestination {
            rank: self.rank,
            param: "(whole rank)".into(),
            reason,
        };
        if !self.spans.is_empty() {
            return Err(bad("parameters of this rank are registered already".into()));
        }
        if memory.len() != self.total {
            return Err(bad(format!(
                "{} bytes registered; the rank's layout has {}",
                memory.len(),
                self.total
            )));
        }
        self.spans.push(Span {
            offset: 0,
            len: self.total,
            param: None,
            memory,
        });
        Ok(())
    }

    /// Registers parameter `name` of `rl`.
    ///
    /// # Errors
    /// [`Error::BadDestination`] naming the parameter when the rank has no such parameter, its
    /// dtype, shape or byte length differs, or it is registered already.
    pub(crate) fn set_param(
        &mut self,
        rl: &RankLayout,
        name: &str,
        t: DestTensor,
    ) -> Result<(), Error> {
        let bad = |reason: String| Error::BadDestination {
            rank: rl.rank,
            param: name.to_string(),
            reason,
        };
        let p = rl.param(name).ok_or_else(|| {
            bad(format!(
                "rank {} of layout {} holds no such parameter",
                rl.rank, rl.layout
            ))
        })?;
        if t.dtype != p.dtype {
            return Err(bad(format!(
                "dtype {} registered; the layout has {}",
                t.dtype, p.dtype
            )));
        }
        if t.shape != p.shape {
            return Err(bad(format!(
                "shape {:?} registered; the layout has {:?}",
                t.shape, p.shape
            )));
        }
        if t.memory.len() != p.len {
            return Err(bad(format!(
                "{} bytes of memory registered; {:?} {} is {} bytes",
                t.memory.len(),
                p.shape,
                p.dtype,
                p.len
            )));
        }
        let at = self.spans.partition_point(|s| s.offset < p.offset);
        if self.spans.iter().any(|s| s.param.is_none()) {
            return Err(bad(
                "the whole rank is registered as one buffer already".into()
            ));
        }
        if self.spans.get(at).is_some_and(|s| s.offset == p.offset) {
            return Err(bad("registered twice".into()));
        }
        self.spans.insert(
            at,
            Span {
                offset: p.offset,
                len: p.len,
                param: Some(name.to_string()),
                memory: t.memory,
            },
        );
        Ok(())
    }

    /// `Ok` when every parameter of `rl` has memory.
    ///
    /// # Errors
    /// [`Error::Unregistered`] naming the first parameter without memory.
    pub(crate) fn check_complete(&self, rl: &RankLayout) -> Result<(), Error> {
        for s in &self.spans {
            s.memory
                .check()
                .map_err(|reason| Error::DestinationChanged {
                    rank: self.rank,
                    param: s.param.clone().unwrap_or_else(|| "(whole rank)".into()),
                    reason,
                })?;
        }
        if self.spans.len() == 1 && self.spans[0].param.is_none() {
            return Ok(());
        }
        for p in &rl.params {
            if !self
                .spans
                .iter()
                .any(|s| s.offset == p.offset && s.len == p.len)
            {
                return Err(Error::Unregistered {
                    rank: rl.rank,
                    param: p.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// `(name, first address, one past the last)` of every registered non-empty span.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = (&str, u64, u64)> + '_ {
        self.spans.iter().filter(|s| s.len > 0).map(|s| {
            let lo = s.memory.data_ptr();
            (
                s.param.as_deref().unwrap_or("(whole rank)"),
                lo,
                lo.saturating_add(s.len),
            )
        })
    }

    /// The host address of layout bytes `offset..offset + len` when they lie in one host span.
    pub(crate) fn host_addr(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        let s = self
            .spans
            .iter()
            .find(|s| s.offset <= offset && end <= s.offset.saturating_add(s.len))?;
        s.memory.host()?;
        s.memory.data_ptr().checked_add(offset - s.offset)
    }

    /// (host address, length) of every non-empty host span (for NIXL registration); `None` when
    /// a span is device memory.
    pub(crate) fn host_spans(&self) -> Option<Vec<(u64, u64)>> {
        self.spans
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| s.memory.host().map(|_| (s.memory.data_ptr(), s.len)))
            .collect()
    }

    /// The whole rank's bytes when it is one host buffer.
    pub(crate) fn whole_host(&self) -> Option<&[u8]> {
        match self.spans.as_slice() {
            [s] if s.param.is_none() => s.memory.host(),
            _ => None,
        }
    }

    /// (name, data pointer) of every registered span, in layout order (`(whole rank)` for a
    /// whole-rank buffer).
    pub(crate) fn addresses(&self) -> Vec<(String, u64)> {
        self.spans
            .iter()
            .map(|s| {
                (
                    s.param.clone().unwrap_or_else(|| "(whole rank)".into()),
                    s.memory.data_ptr(),
                )
            })
            .collect()
    }

    /// Reads the layout range `offset..offset + out.len()` (may cross spans).
    ///
    /// # Errors
    /// [`Error::Memory`] when a span refuses or the range is not registered.
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let rank = self.rank;
        self.for_spans(offset, out.len() as u64, |s, at, done, n| {
            let dst = &mut out[done as usize..(done + n) as usize];
            match s.memory.host() {
                Some(h) => {
                    let src =
                        h.get(at as usize..(at + n) as usize)
                            .ok_or_else(|| Error::Memory {
                                rank,
                                offset: s.offset + at,
                                len: n,
                                reason: format!(
                                    "host memory holds {} bytes, not {}",
                                    h.len(),
                                    s.len
                                ),
                            })?;
                    dst.copy_from_slice(src);
                    Ok(())
                }
                None => s.memory.read(at, dst).map_err(|reason| Error::Memory {
                    rank,
                    offset: s.offset + at,
                    len: n,
                    reason,
                }),
            }
        })
    }

    /// Writes every span from `src` (a host copy of the whole rank laid out as its layout), one
    /// write per span.
    ///
    /// # Errors
    /// [`Error::Memory`] when a span refuses.
    pub(crate) fn write_all(&mut self, src: &[u8]) -> Result<(), Error> {
        let rank = self.rank;
        for s in &mut self.spans {
            let from = src
                .get(s.offset as usize..(s.offset + s.len) as usize)
                .ok_or_else(|| Error::Memory {
                    rank,
                    offset: s.offset,
                    len: s.len,
                    reason: "the source copy is shorter than the rank".into(),
                })?;
            match s.memory.host_mut() {
                Some(h) if h.len() == from.len() => h.copy_from_slice(from),
                Some(h) => {
                    return Err(Error::Memory {
                        rank,
                        offset: s.offset,
                        len: s.len,
                        reason: format!("host memory holds {} bytes, not {}", h.len(), s.len),
                    })
                }
                None => s.memory.write(0, from).map_err(|reason| Error::Memory {
                    rank,
                    offset: s.offset,
                    len: s.len,
                    reason,
                })?,
            }
        }
        Ok(())
    }

    /// Calls `f(span, offset in span, bytes done, bytes)` for each piece of the layout range
    /// `offset..offset + len`, across spans.
    fn for_spans(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Span, u64, u64, u64) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| self.unregistered(offset, len))?;
        let (mut off, mut done) = (offset, 0);
        while off < end {
            let k = self
                .spans
                .partition_point(|s| s.offset <= off)
                .saturating_sub(1);
            let s = self
                .spans
                .get(k)
                .filter(|s| s.offset <= off && off < s.offset + s.len)
                .ok_or_else(|| self.unregistered(off, end - off))?;
            let n = (end - off).min(s.offset + s.len - off);
            f(s, off - s.offset, done, n)?;
            done += n;
            off += n;
        }
        Ok(())
    }

    fn unregistered(&self, offset: u64, len: u64) -> Error {
        Error::Memory {
            rank: self.rank,
            offset,
            len,
            reason: "no destination memory is registered there".into(),
        }
    }
}

/// The host spans of a rank's memory as a copy target: writes land straight in host memory;
/// bytes for device spans are skipped (they are assembled per parameter in a [`Window`] and
/// written with one call each).
pub(crate) struct HostSpans<'a>(pub(crate) &'a mut RankMemory);

impl HostSpans<'_> {
    /// Calls `f(host bytes of the span, offset in span, bytes done, n)` per host piece of
    /// `offset..offset + len`.
    fn each(
        &mut self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut [u8], usize, usize, usize),
    ) -> Result<(), Error> {
        let m = &mut *self.0;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| m.unregistered(offset, len))?;
        let (mut off, mut done) = (offset, 0usize);
        while off < end {
            let k = m
                .spans
                .partition_point(|s| s.offset <= off)
                .saturating_sub(1);
            let unreg = m.unregistered(off, end - off);
            let s = m
                .spans
                .get_mut(k)
                .filter(|s| s.offset <= off && off < s.offset + s.len)
                .ok_or(unreg)?;
            let n = (end - off).min(s.offset + s.len - off) as usize;
            let at = (off - s.offset) as usize;
            let rank = m.rank;
            if let Some(h) = s.memory.host_mut() {
                if h.len() < at + n {
                    return Err(Error::Memory {
                        rank,
                        offset: off,
                        len: n as u64,
                        reason: format!("host memory holds {} bytes, not {}", h.len(), s.len),
                    });
                }
                f(h, at, done, n);
            }
            done += n;
            off += n as u64;
        }
        Ok(())
    }
}

impl RankTarget for HostSpans<'_> {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        self.each(offset, bytes.len() as u64, |h, at, done, n| {
            h[at..at + n].copy_from_slice(&bytes[done..done + n]);
        })
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        self.each(offset, len, |h, at, _, n| h[at..at + n].fill(0))
    }
}

impl RankSwap for HostSpans<'_> {
    fn swap(&mut self, offset: u64, bytes: &mut [u8]) -> Result<(), Error> {
        self.each(offset, bytes.len() as u64, |h, at, done, n| {
            h[at..at + n].swap_with_slice(&mut bytes[done..done + n]);
        })
    }
}

/// A window `lo..lo + buf.len()` of a rank's layout, buffered on the host: writes outside it are
/// dropped. Applies a plan to one device parameter at a time.
pub(crate) struct Window<'a> {
    pub(crate) lo: u64,
    pub(crate) buf: &'a mut [u8],
}

impl RankTarget for Window<'_> {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let hi = self.lo + self.buf.len() as u64;
        let end = offset.saturating_add(bytes.len() as u64);
        let (a, b) = (offset.max(self.lo), end.min(hi));
        if a < b {
            let src = &bytes[(a - offset) as usize..(b - offset) as usize];
            self.buf[(a - self.lo) as usize..(b - self.lo) as usize].copy_from_slice(src);
        }
        Ok(())
    }

    fn zero(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        let hi = self.lo + self.buf.len() as u64;
        let (a, b) = (offset.max(self.lo), offset.saturating_add(len).min(hi));
        if a < b {
            self.buf[(a - self.lo) as usize..(b - self.lo) as usize].fill(0);
        }
        Ok(())
    }
}

impl RankMemory {
    /// The spans that are device memory: (offset, len) in the layout.
    pub(crate) fn device_spans(&self) -> Vec<(u64, u64)> {
        self.spans
            .iter()
            .filter(|s| s.memory.host().is_none())
            .map(|s| (s.offset, s.len))
            .collect()
    }

    /// Writes a whole span (by its layout offset) from `bytes`.
    ///
    /// # Errors
    /// [`Error::Memory`] when the span refuses or none starts at `offset`.
    pub(crate) fn write_span(&mut self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let rank = self.rank;
        let s = self
            .spans
            .iter_mut()
            .find(|s| s.offset == offset)
            .ok_or_else(|| Error::Memory {
                rank,
                offset,
                len: bytes.len() as u64,
                reason: "no span starts there".into(),
            })?;
        s.memory.write(0, bytes).map_err(|reason| Error::Memory {
            rank,
            offset,
            len: bytes.len() as u64,
            reason,
        })
    }
}
