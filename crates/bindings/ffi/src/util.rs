//! The checked layer under every `extern "C"` entry: the panic guard and last error
//! ([`call`]), error-to-status mapping, the shared tokio runtime, and the pointer, string and
//! slice checks every argument from C goes through.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crate::{
    Status, MX_ERR_CONTROL, MX_ERR_INTERNAL, MX_ERR_INVALID_ARGUMENT, MX_ERR_IO, MX_ERR_LAYOUT,
    MX_ERR_NIXL, MX_ERR_PANIC, MX_ERR_STATE, MX_ERR_TIMEOUT, MX_ERR_UNKNOWN_VERSION, MX_ERR_VERIFY,
    MX_OK,
};

/// The most dimensions a shape passed from C may have.
pub(crate) const MAX_DIMS: usize = crate::MX_MAX_DIMS;

/// An error on its way to C: the status and the message [`crate::mx_last_error`] returns.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub(crate) status: Status,
    pub(crate) message: String,
}

pub(crate) type FfiResult<T = ()> = Result<T, FfiError>;

impl FfiError {
    pub(crate) fn new(status: Status, message: impl Into<String>) -> FfiError {
        FfiError {
            status,
            message: message.into(),
        }
    }

    /// [`MX_ERR_INVALID_ARGUMENT`] naming the argument `field`.
    pub(crate) fn arg(field: &str, problem: impl std::fmt::Display) -> FfiError {
        FfiError::new(MX_ERR_INVALID_ARGUMENT, format!("{field}: {problem}"))
    }

    /// The same status, with `context` before the message (e.g. the function's name).
    pub(crate) fn context(mut self, context: impl std::fmt::Display) -> FfiError {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

/// `e` and its sources, `: `-separated, leaving out a source whose text the message already
/// holds (thiserror's `#[from]` variants print their source themselves): the `{:#}` chain.
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let t = s.to_string();
        if !msg.contains(&t) {
            msg.push_str(": ");
            msg.push_str(&t);
        }
        cur = s.source();
    }
    msg
}

fn control_status(e: &mx_control::Error) -> Status {
    match e {
        mx_control::Error::UnknownVersion { .. } => MX_ERR_UNKNOWN_VERSION,
        mx_control::Error::WaitNotReached { .. } => MX_ERR_TIMEOUT,
        mx_control::Error::InvalidField { .. } => MX_ERR_INVALID_ARGUMENT,
        mx_control::Error::Rpc { code, .. } if *code == tonic::Code::NotFound => {
            MX_ERR_UNKNOWN_VERSION
        }
        mx_control::Error::Rpc { code, .. } if *code == tonic::Code::InvalidArgument => {
            MX_ERR_INVALID_ARGUMENT
        }
        _ => MX_ERR_CONTROL,
    }
}

fn puller_status(e: &mx_puller::Error) -> Status {
    use mx_puller::Error as E;
    match e {
        E::Layout(_) => MX_ERR_LAYOUT,
        E::Nixl(_)
        | E::NoDataPlane
        | E::SourceUnreachable { .. }
        | E::Pull { .. }
        | E::SourceRange { .. } => MX_ERR_NIXL,
        E::Verify { .. } | E::WrongManifests { .. } | E::Unproven { .. } | E::Incomplete { .. } => {
            MX_ERR_VERIFY
        }
        E::BadDestination { .. } | E::UnknownRank { .. } | E::BadRanks { .. } => {
            MX_ERR_INVALID_ARGUMENT
        }
        E::Unregistered { .. } | E::NoRollback { .. } | E::DestinationChanged { .. } => {
            MX_ERR_STATE
        }
        E::UnknownVersion { .. } => MX_ERR_UNKNOWN_VERSION,
        _ => MX_ERR_INTERNAL,
    }
}

impl From<mx_publisher::Error> for FfiError {
    fn from(e: mx_publisher::Error) -> FfiError {
        use mx_publisher::Error as E;
        let status = match &e {
            E::Layout(_) => MX_ERR_LAYOUT,
            E::Nixl(_) => MX_ERR_NIXL,
            E::Control(c) => control_status(c),
            E::Timeout { .. } => MX_ERR_TIMEOUT,
            E::BadSlot { .. } | E::BadShard { .. } | E::ForeignAgent { .. } => {
                MX_ERR_INVALID_ARGUMENT
            }
            E::NoShards { .. } => MX_ERR_STATE,
            _ => MX_ERR_INTERNAL,
        };
        FfiError::new(status, chain(&e))
    }
}

impl From<mx_puller::Error> for FfiError {
    fn from(e: mx_puller::Error) -> FfiError {
        FfiError::new(puller_status(&e), chain(&e))
    }
}

impl From<mx_control::Error> for FfiError {
    fn from(e: mx_control::Error) -> FfiError {
        FfiError::new(control_status(&e), chain(&e))
    }
}

impl From<mx_layout::Error> for FfiError {
    fn from(e: mx_layout::Error) -> FfiError {
        FfiError::new(MX_ERR_LAYOUT, chain(&e))
    }
}

impl From<mx_nixl::Error> for FfiError {
    fn from(e: mx_nixl::Error) -> FfiError {
        FfiError::new(MX_ERR_NIXL, chain(&e))
    }
}

impl From<mx_checkpoint::Error> for FfiError {
    fn from(e: mx_checkpoint::Error) -> FfiError {
        FfiError::new(MX_ERR_IO, chain(&e))
    }
}

impl From<mx_follower::Error> for FfiError {
    fn from(e: mx_follower::Error) -> FfiError {
        let status = match &e {
            mx_follower::Error::Puller(p) => puller_status(p),
            mx_follower::Error::Control(c) => control_status(c),
            mx_follower::Error::Nixl(_) => MX_ERR_NIXL,
            mx_follower::Error::Layout(_) => MX_ERR_LAYOUT,
            mx_follower::Error::UnknownVersionId { .. } => MX_ERR_UNKNOWN_VERSION,
            mx_follower::Error::NoControlPlane
            | mx_follower::Error::VersionNotReady { .. }
            | mx_follower::Error::NothingStaged
            | mx_follower::Error::AlreadyServed
            | mx_follower::Error::ServedPuller { .. } => MX_ERR_STATE,
            mx_follower::Error::Bind { .. } => MX_ERR_INVALID_ARGUMENT,
            mx_follower::Error::Task(_) => MX_ERR_PANIC,
            _ => MX_ERR_CONTROL,
        };
        FfiError::new(status, chain(&e))
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Sets this thread's last error (interior NULs become spaces).
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error; the pointer stays valid until the next call that sets it.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Runs the body of an `extern "C"` function `name`: no panic crosses the boundary
/// ([`MX_ERR_PANIC`]), an error sets the last error to `name: message` and returns its status,
/// success clears the last error and returns [`MX_OK`].
pub(crate) fn call(name: &str, f: impl FnOnce() -> FfiResult) -> Status {
    set_last_error("");
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => MX_OK,
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", e.message));
            e.status
        }
        Err(p) => {
            set_last_error(&format!("{name}: panic: {}", panic_message(&*p)));
            MX_ERR_PANIC
        }
    }
}

/// [`call`] for functions that return nothing (the `*_free` functions): a panic is caught and
/// recorded, and otherwise ignored.
pub(crate) fn call_void(name: &str, f: impl FnOnce()) {
    let _ = call(name, || {
        f();
        Ok(())
    });
}

/// The runtime every handle blocks on (created on first use; two worker threads). Calls from C
/// never run inside it: they block the calling thread on it.
pub(crate) fn runtime() -> FfiResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("mx-ffi")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| FfiError::new(MX_ERR_INTERNAL, format!("starting the tokio runtime: {e}")))
}

/// Locks a handle's state. A handle whose earlier call panicked mid-way refuses further calls.
pub(crate) fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> FfiResult<MutexGuard<'a, T>> {
    m.lock().map_err(|_| {
        FfiError::new(
            MX_ERR_PANIC,
            format!("{what}: an earlier call on this handle panicked; free the handle"),
        )
    })
}

/// `ms` milliseconds, or `default` for 0.
pub(crate) fn millis_or(ms: u64, default: Duration) -> Duration {
    if ms == 0 {
        default
    } else {
        Duration::from_millis(ms)
    }
}

/// The handle behind `p`.
///
/// # Safety
/// `p` is NULL or a pointer a `*_create` function of this library returned for a `T`, not
/// freed yet.
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> FfiResult<&'a T> {
    // SAFETY: non-null pointers are live handles of type T by the caller's contract; handles
    // are only read through shared references (their state sits behind a mutex).
    unsafe { p.as_ref() }.ok_or_else(|| FfiError::arg(what, "NULL handle"))
}

/// The UTF-8 string at `p`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged during the
/// call.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, field: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(FfiError::arg(field, "NULL string"));
    }
    // SAFETY: non-null, and NUL-terminated and live for the call by the caller's contract.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str()
        .map_err(|e| FfiError::arg(field, format!("not UTF-8 ({e})")))
}

/// The UTF-8 string at `p`, or `None` for NULL.
///
/// # Safety
/// As [`cstr`].
pub(crate) unsafe fn opt_cstr<'a>(p: *const c_char, field: &str) -> FfiResult<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract, as cstr's.
    unsafe { cstr(p, field) }.map(Some)
}

/// The `n` elements at `p` (NULL is allowed only for `n == 0`).
///
/// # Safety
/// When `n > 0`, `p` points to `n` initialized elements that stay valid and unchanged during the
/// call.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, field: &str) -> FfiResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(FfiError::arg(field, format!("NULL array of {n} elements")));
    }
    if !p.is_aligned() {
        return Err(FfiError::arg(field, "misaligned array"));
    }
    if n.checked_mul(std::mem::size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(FfiError::arg(field, format!("{n} elements is too many")));
    }
    // SAFETY: non-null, aligned, size within isize::MAX (checked), and n initialized elements
    // live for the call by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A shape (or box offset/extent) of `ndim` dims at `p`, at most [`MAX_DIMS`].
///
/// # Safety
/// As [`slice`].
pub(crate) unsafe fn dims(p: *const u64, ndim: usize, field: &str) -> FfiResult<Vec<u64>> {
    if ndim > MAX_DIMS {
        return Err(FfiError::arg(
            field,
            format!("{ndim} dims; at most {MAX_DIMS}"),
        ));
    }
    // SAFETY: the caller's contract, as slice's.
    unsafe { slice(p, ndim, field) }.map(<[u64]>::to_vec)
}

/// Writes `v` to `*out`.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(out: *mut T, v: T, field: &str) -> FfiResult {
    if out.is_null() {
        return Err(FfiError::arg(field, "NULL output pointer"));
    }
    if !out.is_aligned() {
        return Err(FfiError::arg(field, "misaligned output pointer"));
    }
    // SAFETY: non-null and aligned (checked), valid for writes by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

/// A string the caller frees with [`crate::mx_string_free`].
pub(crate) fn owned_string(s: &str) -> *mut c_char {
    CString::new(s.replace('\0', " "))
        .unwrap_or_default()
        .into_raw()
}

/// Writes an owned copy of `s` (or NULL for `None`) to `*out`, when `out` is not NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of a pointer.
pub(crate) unsafe fn write_opt_string(out: *mut *mut c_char, s: Option<&str>) -> FfiResult {
    if out.is_null() {
        return Ok(());
    }
    let p = s.map_or(std::ptr::null_mut(), owned_string);
    // SAFETY: the caller's contract, as write_out's.
    unsafe { write_out(out, p, "string output") }
}

/// Writes an owned copy of `s` to `*out` (required).
///
/// # Safety
/// `out` is NULL or valid for a write of a pointer.
pub(crate) unsafe fn write_string(out: *mut *mut c_char, s: &str, field: &str) -> FfiResult {
    if out.is_null() {
        return Err(FfiError::arg(field, "NULL output pointer"));
    }
    // SAFETY: the caller's contract.
    unsafe { write_opt_string(out, Some(s)) }
}

/// The static C name of a dtype.
pub(crate) fn dtype_cstr(d: mx_layout::DType) -> &'static CStr {
    use mx_layout::DType as D;
    match d {
        D::Bool => c"BOOL",
        D::U8 => c"U8",
        D::I8 => c"I8",
        D::I16 => c"I16",
        D::I32 => c"I32",
        D::I64 => c"I64",
        D::F16 => c"F16",
        D::BF16 => c"BF16",
        D::F32 => c"F32",
        D::F64 => c"F64",
        D::F8E4M3 => c"F8_E4M3",
        D::F8E5M2 => c"F8_E5M2",
        _ => c"UNKNOWN",
    }
}

/// Parses a dtype string from C, naming the field on error.
pub(crate) fn parse_dtype(s: &str, field: &str) -> FfiResult<mx_layout::DType> {
    s.parse()
        .map_err(|e: mx_layout::Error| FfiError::arg(field, e))
}

/// Parses a layout string (`fsdp:2`, `tp:3`, `replicated:1`), naming the field on error.
pub(crate) fn parse_layout(s: &str, field: &str) -> FfiResult<mx_layout::LayoutSpec> {
    s.parse()
        .map_err(|e: mx_layout::Error| FfiError::arg(field, e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests: panics are failures")]

    use super::*;

    fn last() -> String {
        // SAFETY: last_error_ptr points to this thread's NUL-terminated last error.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_poisons_its_handle() {
        let m = Mutex::new(0u32);
        let st = call("mx_test", || {
            let _g = lock(&m, "thing")?;
            panic!("boom");
        });
        assert_eq!(st, MX_ERR_PANIC);
        assert_eq!(last(), "mx_test: panic: boom");
        let st = call("mx_test", || lock(&m, "thing").map(drop));
        assert_eq!(st, MX_ERR_PANIC);
        assert!(
            last().contains("an earlier call on this handle panicked"),
            "{}",
            last()
        );
        assert_eq!(call("mx_test", || Ok(())), MX_OK);
        assert_eq!(last(), "");
        call_void("mx_test_free", || panic!("in free"));
        assert_eq!(last(), "mx_test_free: panic: in free");
    }

    #[test]
    fn chains_skip_sources_the_message_already_holds() {
        let e = mx_publisher::Error::Nixl(mx_nixl::Error::BadLength {
            len: 0,
            reason: "zero",
        });
        let c = chain(&e);
        assert_eq!(c.matches("zero").count(), 1, "{c}");
        let e = FfiError::from(e);
        assert_eq!(e.status, MX_ERR_NIXL);
    }
}
