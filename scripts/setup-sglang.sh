#!/usr/bin/env bash
# Installs SGLang 0.5.23 (its own server, `python -m sglang.launch_server`) into a venv of its own,
# $REPO/.mx/venv-sglang, idempotently: SGLang pins torch==2.14.1, which cannot share .mx/venv's
# torch 2.13.0 (vLLM's). The same python as .mx/venv (3.11; the sglang wheel is cp311).
#
# A plain `pip install sglang==0.5.23` pulls CUDA-only kernels that do not install or run here. So
# (see ../shared/FACTS.md, "A real SGLang on this CPU machine"):
#   1. torch==2.14.1 (PyPI's CUDA build; it runs on CPU);
#   2. `pip download --no-deps sglang==0.5.23 sglang-kernel==0.4.10` into .mx/cache/sglang-wheel and
#      `pip install --no-deps` of both (sglang-kernel is CUDA-only; it is installed for its Python
#      layer, which python/stand-ins/sgl_kernel loads without its CUDA library);
#   3. the sglang wheel's other Requires-Dist (read from its METADATA, markers kept, extras left
#      out) minus the torch family (torchaudio==2.11.0 would pin another torch), sglang-kernel and
#      the GPU-only kernel packages (flashinfer, flash-attn-4, nvidia-cutlass-dsl, humming/quack
#      kernels, sgl-deep-ep/deep-gemm/flash-mla, tilelang, nvshmem4py, nvidia-mathdx, cuda-python,
#      torch_memory_saver), under a constraints file pinning torch;
#   4. the package mx (the wheel scripts/setup-python.sh's `pip install .` left in
#      $CARGO_TARGET_DIR/wheels or $REPO/target/wheels, `--no-deps`; reinstalled whenever that
#      wheel changes), nixl-cu12==1.5.1, safetensors and numpy: mx's loader runs inside SGLang.
# pip then reports "ERROR: pip's dependency resolver ..." and "sglang 0.5.23 requires <each package
# left out>, which is not installed": expected.
# The server then runs with PYTHONPATH=$REPO/python/stand-ins first and SGLANG_USE_CPU_ENGINE=1
# (examples/engines.py, SglangServer).
# About 5 minutes and 8.7 GB the first time (the venv 8.3 GB: torch's nvidia-* CUDA libraries 3.2,
# which `import torch` needs, torch 1.2, sgl_kernel's unused CUDA libraries 1.15, triton 0.9; the
# two wheels 0.4 in .mx/cache/sglang-wheel), plus whatever pip keeps in .mx/cache/pip; a second run
# checks the versions (no import) and the mx wheel and returns in about a second.
# torch's CPU build (download.pytorch.org/whl/cpu) would save ~4 GB, but that host does not
# resolve from the machines this was written on (only PyPI is reachable), so it is not used.
#
#   scripts/setup-sglang.sh
#   MX_SETUP_SGLANG=0 scripts/setup-sglang.sh   does nothing
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
MAIN_PY="$MX/venv/bin/python"
VENV="$MX/venv-sglang"
PY="$VENV/bin/python"
STAMP="$VENV/.mx-package-stamp"
SGLANG_VERSION=0.5.23
KERNEL_VERSION=0.4.10
TORCH_PIN=torch==2.14.1
NIXL_PIN=nixl-cu12==1.5.1
STAND_INS="$REPO/python/stand-ins"
MIN_FREE_GB="${MX_SETUP_MIN_FREE_GB:-9}"
WHEELS_DIR="${CARGO_TARGET_DIR:-$REPO/target}/wheels"

log() { printf 'setup-sglang: %s\n' "$*" >&2; }
t0=$SECONDS

if [[ "${MX_SETUP_SGLANG:-1}" == 0 ]]; then
    log "skipped (MX_SETUP_SGLANG=0)"
    exit 0
fi
[[ -x "$MAIN_PY" ]] || { log "no venv at $MX/venv: run scripts/setup-python.sh first"; exit 1; }

pip_() {
    PIP_CACHE_DIR="$MX/cache/pip" PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip "$@"
}

# The package mx: the wheel setup-python.sh built, when it differs from the one installed here.
ensure_mx() {
    local whl sum
    whl="$(ls -t "$WHEELS_DIR"/mx-*-cp310-abi3-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$whl" ]]; then
        log "no mx wheel in $WHEELS_DIR (setup-python.sh builds it): the package mx left out"
        return
    fi
    sum="$(sha256sum <"$whl" | cut -d' ' -f1)"
    if [[ "$sum" == "$(cat "$STAMP" 2>/dev/null || true)" ]] \
        && "$PY" -c 'import mx._mx' >/dev/null 2>&1; then
        return
    fi
    log "installing the package mx from $whl"
    rm -f "$STAMP"
    pip_ install --quiet --progress-bar off --no-deps --force-reinstall "$whl" >&2
    "$PY" -c 'import mx._mx' || { log "the package mx does not import in $VENV"; exit 1; }
    echo "$sum" >"$STAMP"
}

# The pinned versions (one interpreter start, no heavy import: the fast path takes about a second).
present() {
    "$PY" - "$SGLANG_VERSION" "$KERNEL_VERSION" "$TORCH_PIN" "$NIXL_PIN" <<'PY'
import importlib.metadata as m
import importlib.util
import os
import sys

sglang, kernel, torch, nixl = sys.argv[1:5]
assert m.version("sglang") == sglang, m.version("sglang")
assert m.version("sglang-kernel") == kernel, m.version("sglang-kernel")
assert m.version("torch").split("+")[0] == torch.split("==")[1], m.version("torch")
assert m.version("nixl-cu12") == nixl.split("==")[1], m.version("nixl-cu12")
for name in ("safetensors", "numpy", "transformers", "fastapi", "uvicorn", "msgspec", "xgrammar"):
    m.version(name)
spec = importlib.util.find_spec("sglang")  # found, not imported (that takes seconds)
assert os.path.isfile(os.path.join(spec.submodule_search_locations[0], "launch_server.py"))
PY
}

# What the server imports, with the stand-in (after an install).
imports() {
    PYTHONPATH="$STAND_INS" SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c \
        'import safetensors, sgl_kernel, sglang.srt.server_args, sglang.srt.entrypoints.http_server'
}

if [[ -x "$PY" ]] && present >/dev/null 2>&1; then
    ensure_mx
    log "sglang $SGLANG_VERSION present in $VENV ($((SECONDS - t0)) s)"
    exit 0
fi

mkdir -p "$MX/cache"
free_kb="$(df -Pk "$MX" | awk 'NR == 2 { print $4 }')"
free_gb=$((free_kb / 1024 / 1024))
if ((free_gb < MIN_FREE_GB)); then
    log "not enough disk space: ${free_gb} GB free on the filesystem of $MX, need ${MIN_FREE_GB} GB"
    log "(torch==2.14.1 with its nvidia-* wheels, SGLang and its kernels take ~9 GB)"
    exit 1
fi
kb() { { du -sk "$@" 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }'; }
kb_before="$(kb "$VENV" "$MX/cache/pip" "$MX/cache/sglang-wheel")"

if [[ ! -x "$PY" ]] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    base="$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')"
    log "creating the venv $VENV ($("$base" --version))"
    rm -rf "$VENV"
    "$base" -m venv "$VENV"
fi

work="$MX/cache/sglang-wheel"
mkdir -p "$work"
constraints="$work/constraints.txt"
printf '%s\n' "$TORCH_PIN" >"$constraints"

log "installing sglang==$SGLANG_VERSION on $TORCH_PIN into $VENV (${free_gb} GB free)"
pip_ install --quiet --progress-bar off "$TORCH_PIN" >&2

wheels=()
for spec in "sglang==$SGLANG_VERSION" "sglang-kernel==$KERNEL_VERSION"; do
    dist="${spec%%==*}"
    dist="${dist//-/_}"
    whl="$(ls "$work/$dist-${spec##*==}"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$whl" ]]; then
        pip_ download --quiet --progress-bar off --no-deps --only-binary=:all: -d "$work" \
            "$spec" >&2
        whl="$(ls "$work/$dist-${spec##*==}"-*.whl | head -n1)"
    fi
    wheels+=("$whl")
done

# The sglang wheel's requirements, with their markers, minus what is installed or left out above.
reqs="$work/requirements.txt"
"$PY" - "${wheels[0]}" >"$reqs" <<'PY'
import re
import sys
import zipfile

SKIP = {
    # the torch family: torch is pinned above; torchaudio==2.11.0 would pin torch 2.11
    # (torchvision comes in anyway, through timm: the build that matches torch 2.14.1)
    "torch", "torchvision", "torchaudio",
    # CUDA-only kernels and CUDA libraries (the CPU engine falls back to plain PyTorch ops)
    "sglang-kernel", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "humming-kernels",
    "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "tilelang",
    "nvshmem4py-cu13", "nvidia-mathdx", "cuda-python", "torch-memory-saver",
}
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
    if name not in SKIP:
        print(req)
PY
pip_ install --quiet --progress-bar off --no-deps "${wheels[@]}" >&2
# (apache-tvm-ffi==0.1.11, which sglang's JIT kernel modules import, is among them.)
pip_ install --quiet --progress-bar off -c "$constraints" -r "$reqs" >&2
# mx's side: NIXL (the local wheel setup-python.sh's install-nixl.sh left, when there is one).
pip_ install --quiet --progress-bar off -c "$constraints" --find-links "$MX/cache" \
    "$NIXL_PIN" safetensors numpy >&2

present >&2 && imports || { log "sglang installed but does not import"; exit 1; }
ensure_mx
kb_after="$(kb "$VENV" "$MX/cache/pip" "$MX/cache/sglang-wheel")"
log "sglang $SGLANG_VERSION installed in $((SECONDS - t0)) s," \
    "$(((kb_after - kb_before) / 1024)) MiB more on disk ($(($(kb "$VENV") / 1024)) MiB in $VENV)"
