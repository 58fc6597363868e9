//! The build's provenance, stamped by the root `build.rs`: printed by `mx --version` and
//! written into every JSON report as `"build"`.

use std::path::Path;

use serde::Serialize;

/// Which build produced a result.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Build {
    /// The `mx` package version.
    pub(crate) version: &'static str,
    /// `git rev-parse HEAD` at build time (`unknown` outside a git checkout).
    pub(crate) commit: &'static str,
    /// Whether tracked files differed from that commit (`true`, `false` or `unknown`).
    pub(crate) dirty: &'static str,
    /// `rustc --version` of the compiler.
    pub(crate) rustc: &'static str,
    /// Cargo profile (`release`, `debug`).
    pub(crate) profile: &'static str,
    /// Enabled features of the `mx` package, comma-separated (e.g. `cuda`).
    pub(crate) features: &'static str,
}

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

/// Writes `value` as pretty JSON to `path`, with `"build": BUILD` added at the top level (a
/// report that is not a JSON object is wrapped as `{"build": ..., "report": value}`).
///
/// # Errors
/// Serialization or I/O errors, naming the file.
pub(crate) fn write_report(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    use anyhow::Context;
    let build = serde_json::to_value(BUILD)?;
    let v = match serde_json::to_value(value)? {
        serde_json::Value::Object(mut m) => {
            m.insert("build".into(), build);
            serde_json::Value::Object(m)
        }
        other => serde_json::json!({"build": build, "report": other}),
    };
    std::fs::write(path, serde_json::to_vec_pretty(&v)?)
        .with_context(|| format!("writing report {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_carry_the_build_and_keep_their_fields() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let p = dir.path().join("r.json");
        write_report(&p, &serde_json::json!({"ratio": 0.83})).unwrap_or_else(|e| panic!("{e:#}"));
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
