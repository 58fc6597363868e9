#!/usr/bin/env bash
# Builds and runs mx's fuzz targets (fuzz/fuzz_targets/, cargo-fuzz + libFuzzer) over their
# corpus (fuzz/corpus/<target>/, kept in the repository); fails when a target crashes, panics,
# times out or runs out of memory, leaving the input under fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh                      every target, 60 s each (MX_FUZZ_SECONDS)
#   scripts/fuzz.sh wire journal_replay  only these targets
#   MX_FUZZ_SECONDS=600 scripts/fuzz.sh  longer runs
#   MX_FUZZ_MERGE=1 scripts/fuzz.sh      also merge what the runs found into fuzz/corpus
#                                        (-merge=1 keeps only inputs that add coverage)
#   MX_FUZZ_JOBS=1                       targets run this many at a time (default: CPU count)
#
# Stable toolchain: cargo-fuzz builds with `--sanitizer none` (coverage instrumentation only,
# -Cpasses=sancov-module, which stable rustc accepts; AddressSanitizer needs -Zsanitizer, i.e.
# nightly). Rust code is memory-safe outside `unsafe`, and the parsers fuzzed here have none;
# what the fuzzers look for is panics (debug assertions and overflow checks are on), unbounded
# allocation (-rss_limit_mb, -malloc_limit_mb) and hangs (-timeout).
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
TARGETS=(safetensors_header safetensors_index config_json manifest wire journal_replay)

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
FUZZ="$REPO/fuzz"
seconds="${MX_FUZZ_SECONDS:-60}"
jobs="${MX_FUZZ_JOBS:-$(nproc)}"
((jobs >= 1)) || jobs=1

log() { printf 'fuzz: %s\n' "$*" >&2; }

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

if (($#)); then
    TARGETS=("$@")
fi

t0=$SECONDS
if [[ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    log "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
t_install=$((SECONDS - t0))

t0=$SECONDS
log "cargo fuzz build --sanitizer none --debug-assertions (fuzz/target)"
(cd "$FUZZ" && cargo fuzz build --sanitizer none --debug-assertions)
t_build=$((SECONDS - t0))
bin_dir="$FUZZ/target/$(rustc -vV | sed -n 's/^host: //p')/release"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# One target: new inputs go to a scratch corpus first (the repository's is read, not written),
# crashes to fuzz/artifacts/<target>/.
run_one() {
    local t="$1" corpus="$FUZZ/corpus/$1" art="$FUZZ/artifacts/$1/"
    mkdir -p "$corpus" "$art" "$scratch/$t"
    if [[ -z "$(ls -A "$corpus")" ]]; then
        python3 "$FUZZ/seeds/make_seeds.py"
    fi
    "$bin_dir/$t" "$scratch/$t" "$corpus" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -max_len=65536 -artifact_prefix="$art" -print_final_stats=1 \
        >"$scratch/$t.log" 2>&1
}

t0=$SECONDS
declare -A pids=()
failed=()
for t in "${TARGETS[@]}"; do
    [[ -x "$bin_dir/$t" ]] || { log "no target $t (fuzz/Cargo.toml)"; exit 2; }
    while ((${#pids[@]} >= jobs)); do
        wait -n -p done_pid || true
        for k in "${!pids[@]}"; do [[ "${pids[$k]}" == "$done_pid" ]] && unset "pids[$k]"; done
    done
    log "running $t for ${seconds}s"
    run_one "$t" &
    pids[$t]=$!
done
rc_all=0
for t in "${!pids[@]}"; do wait "${pids[$t]}" || true; done
for t in "${TARGETS[@]}"; do
    log_file="$scratch/$t.log"
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log_file" | tail -1)"
    rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log_file" | tail -1)"
    if grep -qE '^(==[0-9]+== ERROR|SUMMARY: libFuzzer|.*panicked at|Test unit written)' "$log_file"; then
        failed+=("$t")
        log "$t: FAILED"
        tail -40 "$log_file" >&2
        ls "$FUZZ/artifacts/$t/" >&2
    else
        log "$t: ok, ${execs:-?} runs, ${rate:-?} exec/s"
    fi
done
t_run=$((SECONDS - t0))

if [[ "${MX_FUZZ_MERGE:-0}" == 1 ]]; then
    for t in "${TARGETS[@]}"; do
        log "merging new inputs of $t into fuzz/corpus/$t"
        "$bin_dir/$t" -merge=1 -max_len=65536 "$FUZZ/corpus/$t" "$scratch/$t" >"$scratch/$t.merge.log" 2>&1
    done
fi

log "times: install ${t_install}s, build ${t_build}s, runs ${t_run}s"
if ((${#failed[@]})); then
    log "crashed: ${failed[*]} (inputs under fuzz/artifacts/)"
    exit 1
fi
log "all ${#TARGETS[@]} targets ran ${seconds}s each without a crash"
