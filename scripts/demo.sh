#!/usr/bin/env bash
# Runs the mx demo: installs only what it needs (scripts/setup.sh --demo: Debian packages, the
# models, NIXL; not torch, vLLM or the Python package), builds the release binaries `mx` and
# `mx-lab` and runs `mx-lab demo` (the harness; its fleet runs the same commands as `mx`) with
# this script's arguments (e.g. `scripts/demo.sh --report demo.json`).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# Stay in the caller's directory, so relative paths such as `--report out.json` mean what they say.

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

bash "$SCRIPT_DIR/setup.sh" --demo

# The product binary (`mx`: control plane, workers) and the harness's (`mx-lab`: the demo and its
# trainer ranks), in one build.
printf 'demo: %s\n' "cargo build --release --bin mx --bin mx-lab" >&2
cargo build --release --bin mx --bin mx-lab --manifest-path "$REPO/Cargo.toml"

export UCX_MODULES="${UCX_MODULES:-^efa}"
# Where cargo put the binary: CARGO_TARGET_DIR when set (relative to this directory, as for cargo).
MX_LAB="${CARGO_TARGET_DIR:-$REPO/target}/release/mx-lab"
exec "$MX_LAB" demo "$@"
