#!/usr/bin/env bash
# Runs the mx demo: installs what it needs (scripts/setup.sh), builds the release `mx` binary and
# runs `mx demo` with this script's arguments (e.g. `scripts/demo.sh --report demo.json`).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# Stay in the caller's directory, so relative paths such as `--report out.json` mean what they say.

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

bash "$SCRIPT_DIR/setup.sh"

printf 'demo: %s\n' "cargo build --release --bin mx" >&2
cargo build --release --bin mx --manifest-path "$REPO/Cargo.toml"

export UCX_MODULES="${UCX_MODULES:-^efa}"
# Where cargo put the binary: CARGO_TARGET_DIR when set (relative to this directory, as for cargo).
MX_BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/mx"
exec "$MX_BIN" demo "$@"
