#!/usr/bin/env bash
# Runs mx's benchmarks (see BENCHMARKS.md): installs what they need (scripts/setup.sh), builds the
# release `mx-lab` binary (the harness) and runs `mx-lab bench all`, which measures side by side
# in one run
#   - NIXL pull of SmolLM2 (FSDP-4 -> TP-3, and the identity layout) vs memcpy of the same bytes,
#   - refit vs the disk path (write a checkpoint, update_weights_from_disk), end to end,
#   - the planner at Kimi-K2 / DeepSeek-V3 scale and a Kimi-K2 projection onto real hardware,
#   - the control plane's stage/commit round with 1,000 simulated workers,
#   - real AdamW steps of SmolLM2 exported as XOR deltas vs the full checkpoint (delta_vs_full),
# and writes one JSON report (keys pull_vs_memcpy, refit_vs_disk_speedup,
# plan_ms_per_worker_kimi_k2, commit_ms_1000_workers, then every part's details).
#
#   scripts/bench.sh --report bench.json          quick mode (about 5 minutes on 2 cores)
#   scripts/bench.sh --report bench.json --full   more repetitions, every variant, DeepSeek-V3
#   scripts/bench.sh --criterion                  also the planner's criterion benches
#   scripts/bench.sh --rl-loop                    also examples/rl_loop.py at full size (an FSDP2
#                                                 trainer, two real vLLM servers, 3 steps, mx side
#                                                 by side with the disk and broadcast paths; about
#                                                 10 minutes): its report goes under "rl_loop",
#                                                 with real_vllm_stall_ratio_vs_disk and
#                                                 real_vllm_stall_ratio_vs_broadcast (medians)
#   scripts/bench.sh --exhaustive                 also every variant that CI samples (--full
#                                                 implies it): MX_EXHAUSTIVE=1 cargo test --release
#                                                 --test lifecycle, the HA leader killed at all 9
#                                                 refit transitions and 3 points of `mx refit`,
#                                                 chaos over 10 refits (about 4 minutes more)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# Stay in the caller's directory, so relative paths such as `--report out.json` mean what they say.

if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

report="bench.json"
args=()
criterion=0
rl_loop=0
exhaustive=0
while (($#)); do
    case "$1" in
        --report) report="$2"; shift 2 ;;
        --report=*) report="${1#--report=}"; shift ;;
        --criterion) criterion=1; shift ;;
        --rl-loop) rl_loop=1; shift ;;
        --exhaustive) exhaustive=1; shift ;;
        --full) args+=("$1"); exhaustive=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

bash "$SCRIPT_DIR/setup.sh"

printf 'bench: %s\n' "cargo build --release --bin mx-lab" >&2
cargo build --release --bin mx-lab --manifest-path "$REPO/Cargo.toml"

export UCX_MODULES="${UCX_MODULES:-^efa}"
# Where cargo put the binary: CARGO_TARGET_DIR when set (relative to this directory, as for cargo).
MX_LAB="${CARGO_TARGET_DIR:-$REPO/target}/release/mx-lab"
"$MX_LAB" bench all --report "$report" "${args[@]}"

# Real AdamW steps of SmolLM2 (fp32 master weights served as bf16) exported as XOR deltas through
# mx's Python API into a loopback S3 server: the delta's size against the full checkpoint.
delta_json="$(mktemp)"
printf 'bench: %s\n' "examples/delta_vs_full.py" >&2
(cd "$REPO/examples" && "$REPO/.mx/venv/bin/python" delta_vs_full.py --report "$delta_json")
"$REPO/.mx/venv/bin/python" - "$report" "$delta_json" <<'PY'
import json
import sys

report_path, delta_path = sys.argv[1:3]
with open(report_path) as f:
    report = json.load(f)
with open(delta_path) as f:
    report["delta_vs_full"] = json.load(f)["delta_vs_full"]
with open(report_path, "w") as f:
    json.dump(report, f, indent=2)
PY
rm -f "$delta_json"

if ((rl_loop)); then
    rl_json="$(mktemp)"
    printf 'bench: %s\n' "examples/rl_loop.py (full size)" >&2
    (cd "$REPO" && .mx/venv/bin/python examples/rl_loop.py --report "$rl_json")
    "$REPO/.mx/venv/bin/python" "$REPO/examples/check_report.py" rl_loop "$rl_json"
    "$REPO/.mx/venv/bin/python" - "$report" "$rl_json" <<'PY'
import json
import sys

report_path, rl_path = sys.argv[1:3]
with open(report_path) as f:
    report = json.load(f)
with open(rl_path) as f:
    rl = json.load(f)
s = rl["summary"]
report["rl_loop"] = {
    "summary": s,
    "paths": rl["paths"],
    "config": rl["config"],
    "rollback": rl["rollback"],
}
# Medians over the run's steps, the same servers for every path (issue 33's targets: <= 0.5
# against disk, <= 0.3 against broadcast; the rollback within 1.2x of a forward install).
report["real_vllm_stall_ratio_vs_disk"] = s["stall_ratio_mx_to_disk"]
report["real_vllm_stall_ratio_vs_broadcast"] = s["stall_ratio_mx_to_broadcast"]
report["real_vllm_rollback_stall_ratio"] = s["rollback"]["stall_ratio_to_forward"]
with open(report_path, "w") as f:
    json.dump(report, f, indent=2)
PY
    rm -f "$rl_json"
fi

if ((exhaustive)); then
    # What CI runs as a fixed sample (scripts/test.sh), every variant: MX_EXHAUSTIVE=1.
    printf 'bench: %s\n' "MX_EXHAUSTIVE=1 cargo test --release --test lifecycle" >&2
    MX_EXHAUSTIVE=1 MX_REQUIRE_NIXL="${MX_REQUIRE_NIXL:-1}" MX_REQUIRE_ETCD="${MX_REQUIRE_ETCD:-1}" \
        cargo test --release --manifest-path "$REPO/Cargo.toml" --test lifecycle
fi

if ((criterion)); then
    printf 'bench: %s\n' "cargo bench --bench planner" >&2
    cargo bench --manifest-path "$REPO/Cargo.toml" --bench planner
fi
