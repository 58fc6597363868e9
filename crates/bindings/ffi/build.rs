//! Generates the C header from the `extern "C"` items of src/ with cbindgen, into
//! `$OUT_DIR/mx.h`. tests/header.rs compares it with the checked-in `include/mx.h` (and writes it
//! with `MX_BLESS_HEADER=1`), so the header and the library cannot drift.

use std::path::PathBuf;

/// The source files (cbindgen follows the `mod` declarations of lib.rs itself; the rest are
/// listed for rerun-if-changed).
const SOURCES: [&str; 6] = [
    "src/lib.rs",
    "src/model.rs",
    "src/publisher.rs",
    "src/puller.rs",
    "src/control.rs",
    "src/util.rs",
];

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    println!("cargo:rerun-if-changed=cbindgen.toml");
    for s in SOURCES {
        println!("cargo:rerun-if-changed={s}");
    }
    let config = match cbindgen::Config::from_file(dir.join("cbindgen.toml")) {
        Ok(c) => c,
        Err(e) => {
            println!("cargo:warning=cbindgen.toml: {e}");
            std::process::exit(1);
        }
    };
    let b = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join(SOURCES[0]));
    match b.generate() {
        Ok(bindings) => {
            bindings.write_to_file(out.join("mx.h"));
        }
        Err(e) => {
            println!("cargo:warning=cbindgen failed to generate mx.h: {e}");
            std::process::exit(1);
        }
    }
}
