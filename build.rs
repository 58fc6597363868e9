//! Stamps the build's provenance into the `mx` binary: the git commit and whether the tree was
//! dirty, the rustc version, the profile and the enabled cargo features. `mx --version` prints
//! it and every JSON report carries it (`"build": {...}`), so each measured number names the
//! exact build that produced it. (ripgrep's root build.rs does the same for its version line.)

use std::process::Command;

/// Runs `cmd args` and returns its trimmed stdout when it succeeds.
fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    // Rerun when the commit, the index or the sources change (not on every file of the
    // checkout: .mx holds models and a Python environment).
    for p in [
        ".git/HEAD",
        ".git/index",
        ".git/refs",
        "src",
        "crates",
        "proto",
        "Cargo.toml",
        "build.rs",
    ] {
        println!("cargo:rerun-if-changed={p}");
    }
    let commit = output("git", &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = match output("git", &["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) => (!s.is_empty()).to_string(),
        None => "unknown".into(),
    };
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = output(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into());
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| k.strip_prefix("CARGO_FEATURE_").map(|f| f.to_lowercase()))
        .collect();
    features.sort();
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=MX_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=MX_BUILD_DIRTY={dirty}");
    println!("cargo:rustc-env=MX_BUILD_RUSTC={rustc_version}");
    println!("cargo:rustc-env=MX_BUILD_FEATURES={}", features.join(","));
    println!("cargo:rustc-env=MX_BUILD_PROFILE={profile}");
}
