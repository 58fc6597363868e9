#!/usr/bin/env bash
# Checks that the language bindings reuse the workspace's release build: run right after
# `cargo build --release --workspace --lib --bins --tests` (scripts/test.sh does), it builds each binding
# alone, as maturin's `pip install .` and scripts/test_ffi_c.sh do, and fails naming every crate
# that had to be compiled again.
#
# Why: cargo resolves features per build. A `--workspace` build of the tests unifies every
# member's (and every dev-dependency's) features; `-p mx-python` only the features its own
# dependencies ask for, separately for build scripts and proc macros (host) and for the program
# (target). A crate whose features differ is compiled twice, and every crate above it too (the
# Python package took 6-12 minutes that way). The bindings' Cargo.toml files pin the features the
# workspace turns on (their block "features the workspace build turns on").
#
# When it fails: `CARGO_LOG=cargo::core::compiler::fingerprint=info cargo build --release -p P`
# names the first unit that differs; the deepest crate in the list is usually the cause, with
# features (or a host-side copy, under [build-dependencies]) to add to that block.
#
#   scripts/check-features.sh            mx-python and mx-ffi
#   scripts/check-features.sh mx-ffi     only these packages
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
cd "$REPO"

packages=("$@")
((${#packages[@]})) || packages=(mx-python mx-ffi)

bad=0
for p in "${packages[@]}"; do
    # The binding itself compiles (its dependency list differs from the workspace's view of it);
    # nothing else may.
    compiled="$(cargo build --release --locked -p "$p" --lib 2>&1 | sed -n 's/^ *Compiling \([^ ]*\) .*/\1/p' \
        | grep -vx -e "$p" -e 'pyo3.*' || true)"
    if [[ -n "$compiled" ]]; then
        bad=1
        echo "check-features: building $p alone compiled again: $(paste -sd' ' <<<"$compiled")" >&2
    fi
done
if ((bad)); then
    # Which features differ, as cargo tree resolves them (a hint: a unit compiled again because a
    # dependency changed is listed above, not here). `-e normal` is the program's side (proc macros'
    # own dependencies included); `-e normal,build` adds the build scripts' side.
    norm() { sed 's/ (\*)$//; s/ (proc-macro)//; s/ ([/][^)]*)//' | sort -u; }
    for edges in normal normal,build; do
        ws="$(cargo tree --workspace -e "$edges" -f '{p} [{f}]' --prefix none 2>/dev/null | norm)"
        for p in "${packages[@]}"; do
            cargo tree -p "$p" -e "$edges" -f '{p} [{f}]' --prefix none 2>/dev/null | norm \
                | comm -23 - <(printf '%s\n' "$ws") | grep -v '^mx-' \
                | sed "s/^/check-features: $p (-e $edges) has only: /" >&2 || true
        done
    done
    echo "check-features: the bindings' features differ from the workspace's; see this script's header" >&2
    exit 1
fi
echo "check-features: ${packages[*]} reuse the workspace's release build"
