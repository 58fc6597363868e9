#!/usr/bin/env bash
# Installs the RL frameworks whose plug points mx fills into the project venv $REPO/.mx/venv, beside
# vLLM, idempotently (about 50 s and ~0.4 GB the first time; a second run checks two versions):
#   - TRL 1.16.0 (its GRPO trainer in server mode against a real vLLM; python/tests/test_trl.py);
#   - verl 0.9.1 (its CheckpointEngine interface; mx.verl, examples/verl_engine.py), installed
#     --no-deps with the dependencies its checkpoint engines and workers import (ray, hydra-core,
#     tensordict, ...): its own pins (transformers<5.11, vllm's) would downgrade what vLLM 0.32 runs on.
# Everything already in the venv is frozen (a constraints file of `pip freeze`), except
# antlr4-python3-runtime: hydra's omegaconf 2.3 needs 4.9.x, moto[server] (the only other user, for
# its step functions, which no test starts) takes any version.
# See ../shared/FACTS.md ("TRL 1.16.0", "verl 0.9.1").
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
PY="$MX/venv/bin/python"
TRL_PINS=(trl==1.16.0 accelerate==1.16.0 datasets==5.2.0)
VERL_PIN=verl==0.9.1
VERL_DEPS=(ray==2.60.0 codetiming==1.4.0 hydra-core==1.3.2 omegaconf==2.3.0
    antlr4-python3-runtime==4.9.3 tensordict==0.8.3 pybind11==3.1.0 pylatexenc==2.11
    torchdata==0.11.0 peft==0.21.2 dill==0.4.1)

log() { printf 'setup-frameworks: %s\n' "$*" >&2; }
t0=$SECONDS

[[ -x "$PY" ]] || { log "no venv at $MX/venv: run scripts/setup-python.sh first"; exit 1; }

if "$PY" - <<'PY' 2>/dev/null; then
import importlib.metadata as m
assert m.version("trl") == "1.16.0" and m.version("verl") == "0.9.1"
import omegaconf, ray, tensordict  # noqa: F401  (verl's checkpoint engines import these)
from omegaconf import MISSING  # noqa: F401  (omegaconf 2.x)
PY
    log "trl 1.16.0 and verl 0.9.1 present"
    exit 0
fi

pip_() {
    PIP_CACHE_DIR="$MX/cache/pip" PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip "$@"
}
work="$MX/cache/frameworks"
mkdir -p "$work"
# What is installed now stays as it is (editable installs and local wheels are left out: they
# are not on the index, and pip keeps them anyway).
pip_ freeze --exclude-editable | grep -v -i -e '^antlr4-python3-runtime==' -e ' @ ' >"$work/frozen.txt"

log "installing ${TRL_PINS[*]}"
pip_ install --quiet --progress-bar off -c "$work/frozen.txt" "${TRL_PINS[@]}" >&2
log "installing $VERL_PIN (--no-deps) and ${VERL_DEPS[*]}"
pip_ install --quiet --progress-bar off --no-deps "$VERL_PIN" >&2
# pip's resolver reports verl's own pins (transformers<5.11, ...) as conflicts: left as they are.
rc=0
pip_ install --quiet --progress-bar off -c "$work/frozen.txt" "${VERL_DEPS[@]}" >"$work/pip.log" 2>&1 || rc=$?
grep -v -e "^ERROR: pip's dependency resolver" -e "^verl 0.9.1 requires" "$work/pip.log" >&2 || true
((rc == 0)) || { log "pip failed ($rc) installing verl's dependencies"; exit 1; }
"$PY" -c 'import trl, verl.checkpoint_engine; from omegaconf import MISSING' \
    || { log "trl or verl does not import after the install"; exit 1; }
log "done in $((SECONDS - t0)) s"
