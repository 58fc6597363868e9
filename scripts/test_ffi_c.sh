#!/usr/bin/env bash
# The C ABI from C: compiles crates/bindings/ffi/tests/c/refit.c with the system C compiler
# against crates/bindings/ffi/include/mx.h and the release libmx.so, and runs it (a control plane in the test process,
# two trainer processes publishing from malloc'd memory, the engine pulling into its own
# malloc'd parameters over NIXL, a refit, a rollback, and bad input). scripts/test.sh runs it
# after the Rust tests; it can also run alone (it builds libmx.so first when missing or stale).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
cd "$REPO"

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
CC="${CC:-cc}"
command -v "$CC" >/dev/null 2>&1 || { echo "test_ffi_c: no C compiler ($CC): apt-get install -y gcc" >&2; exit 1; }

TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
LIBDIR="$TARGET/release"
cargo build --release -p mx-ffi --lib
OUT="$TARGET/ffi-c"
mkdir -p "$OUT"
"$CC" -std=gnu11 -O1 -g -Wall -Wextra -Werror -I crates/bindings/ffi/include crates/bindings/ffi/tests/c/refit.c \
    -L "$LIBDIR" -lmx -Wl,-rpath,"$LIBDIR" -o "$OUT/refit"

export UCX_MODULES="${UCX_MODULES:-^efa}"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 600 "$OUT/refit"
