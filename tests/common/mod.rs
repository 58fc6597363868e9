//! Helpers shared by the cross-crate tests.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;

/// The repository root.
pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The model dir, or None (with a message) when setup has not run and NIXL is not required.
pub(crate) fn model(name: &str) -> Option<PathBuf> {
    let dir = repo().join(".mx/models").join(name);
    if dir.join("config.json").exists() && mx_nixl::nixl_available().is_ok() {
        return Some(dir);
    }
    if std::env::var("MX_REQUIRE_NIXL").as_deref() == Ok("1") {
        panic!(
            "{} or NIXL missing and MX_REQUIRE_NIXL=1: run scripts/setup.sh",
            dir.display()
        );
    }
    eprintln!(
        "skipping: {} or NIXL missing (run scripts/setup.sh)",
        dir.display()
    );
    None
}
