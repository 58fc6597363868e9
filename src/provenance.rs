//! The build's provenance, stamped by the root `build.rs`: printed by `mx --version` (and
//! `mx-lab --version`) and recorded at start ([`mx_cli::report::set_build`]), so that every JSON
//! report carries it as `"build"`.

use mx_cli::report::Build;

/// This binary's build.
pub(crate) const BUILD: Build = Build {
    version: env!("CARGO_PKG_VERSION"),
    commit: env!("MX_BUILD_COMMIT"),
    dirty: env!("MX_BUILD_DIRTY"),
    rustc: env!("MX_BUILD_RUSTC"),
    profile: env!("MX_BUILD_PROFILE"),
    features: env!("MX_BUILD_FEATURES"),
};

/// The long `--version` text.
pub(crate) const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit ",
    env!("MX_BUILD_COMMIT"),
    " (dirty: ",
    env!("MX_BUILD_DIRTY"),
    ")\n",
    env!("MX_BUILD_RUSTC"),
    "\nprofile ",
    env!("MX_BUILD_PROFILE"),
    ", features [",
    env!("MX_BUILD_FEATURES"),
    "]"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_carry_the_build_and_keep_their_fields() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let p = dir.path().join("r.json");
        mx_cli::report::set_build(BUILD);
        mx_cli::report::write_report(&p, &serde_json::json!({"ratio": 0.83}))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v["ratio"], 0.83);
        let b = &v["build"];
        assert_eq!(b["version"], env!("CARGO_PKG_VERSION"));
        let commit = b["commit"].as_str().unwrap_or_default();
        assert!(
            commit == "unknown"
                || (commit.len() == 40 && commit.bytes().all(|c| c.is_ascii_hexdigit())),
            "{commit}"
        );
        assert!(["true", "false", "unknown"].contains(&b["dirty"].as_str().unwrap_or_default()));
        assert!(
            b["rustc"]
                .as_str()
                .unwrap_or_default()
                .starts_with("rustc "),
            "{b}"
        );
        assert!(LONG_VERSION.contains(commit));
    }
}
