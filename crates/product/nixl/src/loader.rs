//! Finding and loading `libnixl_capi.so` before nixl-sys's stubs look for it.
//!
//! The stubs `dlopen("libnixl_capi.so")` once, on the first NIXL call, and cache the answer. A
//! library that is already loaded is found by its soname, so loading it here first by full path
//! lets binaries built in this checkout find `$REPO/.mx/nixl` without `LD_LIBRARY_PATH`.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::Error;

/// Environment variable naming the directory that holds `libnixl_capi.so` (and the rest of the
/// unpacked wheel). When set, only that directory is tried.
pub const NIXL_DIR_ENV: &str = "MX_NIXL_DIR";

const CAPI_SONAME: &str = "libnixl_capi.so";

/// Result of the one load attempt per process: where NIXL came from, or why it is missing.
static LOADED: OnceLock<Result<String, String>> = OnceLock::new();

/// `$REPO/.mx/nixl` for the checkout this crate was compiled in (the workspace root: the first
/// folder above this crate that holds `Cargo.lock`).
fn default_dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("Cargo.lock").is_file())
        .unwrap_or(manifest)
        .join(".mx")
        .join("nixl")
}

/// Checks that the real NIXL library is loaded (loading it on the first call), without ever
/// calling into the stubs that abort.
///
/// The first call also sets `UCX_MODULES=^efa` when the variable is unset (the bundled UCX
/// otherwise crashes at process exit on machines with rdma-core); call this, or [`Agent::new`],
/// early, before the process starts threads that read the environment.
///
/// # Errors
/// [`Error::NixlMissing`] with the dlopen errors and the install instructions.
///
/// [`Agent::new`]: crate::Agent::new
pub fn nixl_available() -> Result<(), Error> {
    match LOADED.get_or_init(load) {
        Ok(_) => Ok(()),
        Err(reason) => Err(Error::NixlMissing {
            reason: reason.clone(),
            default_dir: default_dir().display().to_string(),
        }),
    }
}

/// Environment variable that turns "skip" into "fail" in [`nixl_or_skip`]: CI sets
/// `MX_REQUIRE_NIXL=1` so a missing NIXL cannot pass silently.
pub const REQUIRE_NIXL_ENV: &str = "MX_REQUIRE_NIXL";

/// For tests that need NIXL: true when it is available; otherwise writes
/// `SKIPPED <test>: <why>` to stderr (past the test harness's capture) and returns false.
///
/// # Panics
/// When NIXL is missing and `MX_REQUIRE_NIXL=1`, so CI fails instead of skipping.
pub fn nixl_or_skip(test: &str) -> bool {
    use std::io::Write;
    match nixl_available() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var(REQUIRE_NIXL_ENV).as_deref() == Ok("1") {
                panic!("{test}: {REQUIRE_NIXL_ENV}=1 but {e}");
            }
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {e}");
            false
        }
    }
}

/// Where the NIXL C API was loaded from (a path, or the loader search path), once
/// [`nixl_available`] succeeded; `None` before that or when it failed.
pub fn loaded_from() -> Option<&'static str> {
    LOADED
        .get()
        .and_then(|r| r.as_ref().ok())
        .map(String::as_str)
}

fn load() -> Result<String, String> {
    if std::env::var_os("UCX_MODULES").is_none() {
        // Runs once, before NIXL or UCX exist in this process (they read it at UCX init).
        std::env::set_var("UCX_MODULES", "^efa");
    }
    let mut tried = Vec::new();
    let mut from = None;
    if let Some(dir) = std::env::var_os(NIXL_DIR_ENV) {
        let path = Path::new(&dir).join(CAPI_SONAME);
        match dlopen_keep(&path.display().to_string()) {
            Ok(()) => from = Some(path.display().to_string()),
            Err(e) => tried.push(format!("{NIXL_DIR_ENV}: {e}")),
        }
    } else {
        match dlopen_keep(CAPI_SONAME) {
            Ok(()) => from = Some(format!("{CAPI_SONAME} (loader search path)")),
            Err(e) => {
                tried.push(format!("loader search path: {e}"));
                let path = default_dir().join(CAPI_SONAME);
                match dlopen_keep(&path.display().to_string()) {
                    Ok(()) => from = Some(path.display().to_string()),
                    Err(e) => tried.push(format!("checkout: {e}")),
                }
            }
        }
    }
    // Safe to call whatever happened above: it only reports whether the stubs found the library.
    if nixl_sys::is_stub() {
        if tried.is_empty() {
            tried.push("libnixl_capi.so loaded but nixl-sys still reports its stub".to_string());
        }
        return Err(tried.join("; "));
    }
    let from = from.unwrap_or_else(|| CAPI_SONAME.to_string());
    tracing::debug!(from = %from, "loaded NIXL C API");
    Ok(from)
}

/// `dlopen(name, RTLD_NOW | RTLD_LOCAL)` and never close it.
fn dlopen_keep(name: &str) -> Result<(), String> {
    let c_name = CString::new(name).map_err(|_| format!("{name:?} contains a NUL byte"))?;
    // SAFETY: c_name is a valid NUL-terminated string for the duration of the call. Loading runs the
    // library's static initializers, which is what loading NIXL means; the handle is deliberately
    // leaked so the library stays mapped for the stubs, which find it again by soname.
    let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if !handle.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on this
    // thread; it is copied out immediately.
    let msg = unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            String::from("unknown dlopen error")
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    };
    Err(msg)
}
