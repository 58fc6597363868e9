#!/usr/bin/env bash
# Runs the mx test suite on this machine, installing what it needs first (scripts/setup.sh).
#
#   scripts/test.sh                 the whole workspace, release profile
#   scripts/test.sh -p mx-layout    arguments go to `cargo test` unchanged
#   MX_LINT=1 scripts/test.sh       also `cargo fmt --check`, clippy -D warnings (as the workspace
#                                   compiles) and ruff (CI does)
#   scripts/test_ffi_c.sh           only the C ABI test (run here after the Rust tests)
#
# After the Rust tests (they include tests/fuzz_corpus.rs: every stored input of the fuzz targets
# through the target's check; the long fuzzing runs are scripts/fuzz.sh), the C ABI test
# (scripts/test_ffi_c.sh) and the Python package's tests (python/tests, pytest in .mx/venv,
# against the package scripts/setup-python.sh installs); a skipped Python test fails the suite.
# The examples run end to end, each with a check of its report (three of them after the other
# modules, one at a time):
# examples/python_refit.py (trainers and engines in Python processes, a real checkpoint),
# examples/rl_loop.py --ci --engines vllm,dynamo,sglang (an FSDP2 trainer refitting a real vLLM
# server, a Dynamo vLLM worker and an SGLang server in one refit, 1 step and a perturbed one that
# rolls back, the mx path; the full side-by-side run with the disk and broadcast paths is
# `scripts/bench.sh --rl-loop`), examples/moe_refit.py --ci (a Qwen3-MoE from FSDP2 and
# Megatron-Core layouts into a real vLLM, and FP8), examples/vllm_trainer_api.py --ci and
# examples/verl_engine.py --ci. Python tests are left out when arguments select Rust packages
# (`-p ...`), or with MX_PYTHON_TESTS=0.
#
# Tests with many variants of one property run a fixed sample covering every kind of variant
# (tests/lifecycle.rs: the HA leader killed at 3 of the 9 refit transitions, chaos over 4 refits);
# MX_EXHAUSTIVE=1 runs every variant (`scripts/bench.sh --exhaustive`).
#
# Each crate is compiled once per profile and feature set: clippy lints the workspace's crates as
# the release build compiles them (clippy-driver as cargo's workspace wrapper), the `cuda` feature of
# mx-nixl is linted, not built (it only has to compile here), and the Python package is built
# after the workspace so that maturin reuses the workspace's release artifacts (the bindings'
# dependency features equal the workspace's: scripts/check-features.sh, run after the build).
# A step timer prints each step's minutes at the end of every run, passed or failed.
#
# NIXL tests fail (instead of skipping) when the NIXL libraries are missing: MX_REQUIRE_NIXL=1;
# the HA tests likewise when etcd is missing: MX_REQUIRE_ETCD=1.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
cd "$REPO"

log() { printf 'test: %s\n' "$*" >&2; }

# --- the step timer ---------------------------------------------------------------------------------
run_t0=$SECONDS
step=setup
step_t0=$SECONDS
timings=()
minutes() { awk -v s="$1" 'BEGIN { printf "%5.1f", s / 60 }'; }
# Ends the running step (its minutes go into the table) and starts the step named "$1".
begin() {
    timings+=("$(minutes $((SECONDS - step_t0))) min  $step")
    step="$1"
    step_t0=$SECONDS
    log "$step"
}
finish() {
    local rc=$?
    [[ -z "${engines_pid:-}" ]] || kill -- "-$engines_pid" 2>/dev/null || true
    timings+=("$(minutes $((SECONDS - step_t0))) min  $step")
    {
        echo
        echo "mx tests: step timer (minutes)"
        printf '  %s\n' "${timings[@]}"
        echo "  $(minutes $((SECONDS - run_t0))) min  total"
    } >&2
    if ((rc)); then
        echo "mx tests: FAILED at step \"$step\" (exit $rc)"
    else
        echo "mx tests: PASSED"
    fi
}
trap finish EXIT

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

# --- what arguments select ---------------------------------------------------------------------------
# `--workspace` would override a `-p/--package` given here, so it is added only without one.
scope=(--workspace)
for arg in "$@"; do
    case "$arg" in
        --) break ;;
        -p | -p* | --package | --package=*) scope=() ;;
    esac
done
python_tests=0
if ((${#scope[@]})) && (($# == 0)) && [[ "${MX_PYTHON_TESTS:-1}" != 0 ]]; then
    python_tests=1
fi

# Everything but the package mx, which is built after the workspace (below). What the workspace's
# build needs (Debian packages, models, NIXL: `setup.sh --demo`) first; the venv's packages and
# the engines (`setup.sh --engines`: ~5 minutes of downloads and unpacking on a fresh machine) in
# the background while clippy and the build run (they need none of it), waited for before
# anything uses the venv. Its output is shown when it ends.
engines_log="$REPO/.mx/tmp/setup-engines.log"
engines_pid=""
MX_SETUP_PACKAGE=0 bash "$SCRIPT_DIR/setup.sh" --demo
mkdir -p "$REPO/.mx/tmp"
# its own process group (setsid), so that a failing run stops it and the installers it started
# pip compiles the installed modules' bytecode here (it costs the build about a core for a few
# minutes, but the tests' processes run without writing bytecode: PIP_COMPILE=0 made pytest
# 1.5x slower, every process compiling torch and vLLM from source).
MX_SETUP_PACKAGE=0 setsid bash "$SCRIPT_DIR/setup.sh" --engines >"$engines_log" 2>&1 &
engines_pid=$!
wait_engines() {
    [[ -n "$engines_pid" ]] || return 0
    local rc=0
    wait "$engines_pid" || rc=$?
    engines_pid=""
    cat "$engines_log" >&2
    ((rc == 0)) || { log "scripts/setup.sh --engines failed (exit $rc)"; exit "$rc"; }
}

export MX_REQUIRE_NIXL=1
export MX_REQUIRE_ETCD=1
export UCX_MODULES='^efa'

# moto answers a ranged GET by reading the whole object first (~165 ms per range of SmolLM2's
# 270 MB checkpoint, however short the range; an artifact is read in hundreds of ranges):
# every test that starts moto (mx_harness::s3's LoopbackS3, python/tests/test_artifact.py) runs
# python/tests/moto_ranged.py instead, moto reading only the range.
if [[ -z "${MX_MOTO_SERVER:-}" ]]; then
    mkdir -p "$REPO/.mx/tmp"
    printf '#!/usr/bin/env bash\nexec %q %q "$@"\n' "$REPO/.mx/venv/bin/python" \
        "$REPO/python/tests/moto_ranged.py" >"$REPO/.mx/tmp/moto_server"
    chmod +x "$REPO/.mx/tmp/moto_server"
    export MX_MOTO_SERVER="$REPO/.mx/tmp/moto_server"
fi

build_targets=(--lib --bins --tests)
if [[ "${MX_LINT:-0}" == 1 ]]; then
    begin "cargo fmt --check"
    cargo fmt --all --check
    # The VRAM path (cudarc, dynamic loading) must compile on GPU-less machines too: linting it
    # compiles it (only mx-nixl and cudarc differ from the workspace's build).
    begin "cargo clippy --release -p mx-nixl --features cuda --all-targets -- -D warnings"
    cargo clippy --release -p mx-nixl --features cuda --all-targets -- -D warnings
    # Clippy lints the workspace's crates while they compile for the tests: clippy-driver as
    # cargo's workspace wrapper (what `cargo clippy` runs, there in check mode) with clippy's
    # `-D warnings`, so the dependencies are compiled once, not also checked (a separate
    # `cargo clippy --all-targets` took 2.5-5.3 min in CI). Exported: cargo test and maturin
    # below then find the same build fresh. The benchmarks are built too, to be linted
    # (`--all-targets` would add only this crate's examples, which are Python).
    RUSTC_WORKSPACE_WRAPPER="$(command -v clippy-driver)"
    export RUSTC_WORKSPACE_WRAPPER
    export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
    build_targets+=(--benches)
fi

# What `cargo test` runs (libraries, binaries, test targets; the benchmarks only to lint them:
# scripts/bench.sh builds and runs them). With packages given (`-p ...`), `cargo test` below
# builds what they need.
if ((${#scope[@]})); then
    begin "cargo build --release ${scope[*]} ${build_targets[*]}${CLIPPY_ARGS:+ (clippy -D warnings)}"
    cargo build --release "${scope[@]}" "${build_targets[@]}"
fi

begin "waiting for scripts/setup.sh --engines (started before clippy)"
wait_engines
if [[ "${MX_LINT:-0}" == 1 ]]; then
    begin "ruff check + ruff format --check (python/ examples/)"
    "$REPO/.mx/venv/bin/ruff" check --no-cache python examples
    "$REPO/.mx/venv/bin/ruff" format --no-cache --check python examples
fi

if ((${#scope[@]})); then
    begin "scripts/check-features.sh (the bindings reuse the workspace's build)"
    bash "$SCRIPT_DIR/check-features.sh"
    begin "scripts/cli-docs.sh --check (docs/cli.md against the binaries' --help)"
    bash "$SCRIPT_DIR/cli-docs.sh" --check
fi

if ((python_tests)); then
    # maturin's release build of the extension reuses the artifacts just built.
    begin "the package mx (scripts/setup-python.sh: pip install ., maturin)"
    bash "$SCRIPT_DIR/setup-python.sh"
fi

# The whole workspace: the targets built above (no crate has documentation tests: rustdoc would
# be run over each of the 14 libraries to find none).
targets=()
if ((${#scope[@]})) && (($# == 0)); then
    targets=(--lib --bins --tests)
fi
test_cmd=(cargo test --release --no-fail-fast "${scope[@]}" "${targets[@]}" "$@")
# One test target at a time: tests/lifecycle.rs beside the others (tried at 0ccd889) timed out
# its reference engines' applies (10 s) on CI's 2 loaded cores.
begin "${test_cmd[*]}"
"${test_cmd[@]}"

# The C ABI from C (crates/bindings/ffi/tests/c/refit.c against crates/bindings/ffi/include/mx.h and libmx.so; the header's
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
    begin "C ABI test (scripts/test_ffi_c.sh)"
    bash "$SCRIPT_DIR/test_ffi_c.sh"
fi

# The README's secured fleet (TLS, a token per role, two workers, two trainer ranks, a refit),
# its commands run verbatim: the quickstart cannot drift from what works.
if ((${#scope[@]})); then
    begin "scripts/readme-fleet.sh (the README's secured fleet, verbatim)"
    bash "$SCRIPT_DIR/readme-fleet.sh"
fi

if ((python_tests)); then
    PY="$REPO/.mx/venv/bin/python"
    # conftest.py turns any skip into a failure; -p no:cacheprovider keeps the tree clean. Two
    # test modules at a time (pytest-xdist, a module's tests in one worker, its fixtures shared
    # as before): most of a real-engine module's time is spent waiting on its engines (a refit's
    # phases, timeouts, restarts), and the engines' memory is budgeted across processes
    # (examples/engines.py's MemoryBudget).
    examples=(python/tests/test_python_refit.py python/tests/test_rl_loop.py python/tests/test_moe_refit.py)
    begin "pytest python/tests (but the examples)"
    "$PY" -m pytest python/tests -q -rs -p no:cacheprovider --durations=30 -n 2 --dist loadfile \
        "${examples[@]/#/--ignore=}"

    # The examples end to end (each checks its report with examples/check_report.py), one at a
    # time after the modules above: the RL loop runs three engines and a cold start at once, and
    # beside other modules' engines it starved them (a trainer OOM-killed, an engine past its
    # memory-budget wait; tried at 190f1bc).
    begin "pytest ${examples[*]} (one at a time)"
    "$PY" -m pytest "${examples[@]}" -q -rs -p no:cacheprovider --durations=5
fi
