//! Reports: every JSON report the harness writes carries the build that produced it
//! (`"build"`: commit, dirty flag, rustc, profile, features), set once by the binary from its
//! build script's stamp.

use std::path::Path;
use std::sync::OnceLock;

use serde::Serialize;

/// Which build produced a result.
#[derive(Debug, Clone, Serialize)]
pub struct Build {
    /// The `mx` package version.
    pub version: &'static str,
    /// `git rev-parse HEAD` at build time (`unknown` outside a git checkout).
    pub commit: &'static str,
    /// Whether tracked files differed from that commit (`true`, `false` or `unknown`).
    pub dirty: &'static str,
    /// `rustc --version` of the compiler.
    pub rustc: &'static str,
    /// Cargo profile (`release`, `debug`).
    pub profile: &'static str,
    /// Enabled features of the `mx` package, comma-separated (e.g. `cuda`).
    pub features: &'static str,
}

static BUILD: OnceLock<Build> = OnceLock::new();

/// Records this process's build (the first call wins); reports written before it say
/// `"build": null`.
pub fn set_build(b: Build) {
    let _ = BUILD.set(b);
}

/// The build recorded by [`set_build`].
pub fn build() -> Option<&'static Build> {
    BUILD.get()
}

/// Writes `value` as pretty JSON to `path`, with `"build"` (see [`set_build`]) added at the top level (a
/// report that is not a JSON object is wrapped as `{"build": ..., "report": value}`).
///
/// # Errors
/// Serialization or I/O errors, naming the file.
pub fn write_report(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    use anyhow::Context;
    let build = serde_json::to_value(build())?;
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
