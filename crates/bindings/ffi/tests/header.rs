//! The checked-in header `crates/bindings/ffi/include/mx.h` must be what cbindgen generates from this crate now
//! (build.rs writes it to `$OUT_DIR/mx.h`): a changed `extern "C"` item without a regenerated
//! header fails here. `MX_BLESS_HEADER=1` rewrites the checked-in copy instead.
#![allow(clippy::unwrap_used, reason = "tests: panics are failures")]

use std::path::PathBuf;

const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/mx.h"));

#[test]
fn checked_in_header_is_the_generated_one() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include/mx.h");
    if std::env::var("MX_BLESS_HEADER").as_deref() == Ok("1") {
        std::fs::write(&path, GENERATED).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != GENERATED {
        let first = checked_in
            .lines()
            .zip(GENERATED.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(GENERATED.lines().count()));
        panic!(
            "{} is out of date with the extern \"C\" items of crates/bindings/ffi/src (first difference at line \
             {}): regenerate it with `MX_BLESS_HEADER=1 cargo test -p mx-ffi --test header` and \
             commit it",
            path.display(),
            first + 1
        );
    }
}
