#!/usr/bin/env bash
# Installs the Python side of mx into the project venv $REPO/.mx/venv, idempotently:
#   - pinned tools: torch==2.13.0 (PyPI's CUDA build, ~2.8 GB of wheels with its nvidia-*
#     dependencies; it runs on CPU), nixl-cu12==1.5.1 (NIXL's libraries, which the package `mx`
#     loads), maturin (builds the package), pytest, pytest-xdist (the test modules two at a time)
#     and ruff (tests and lint), moto[server] (the
#     S3-compatible server the artifact tests start on loopback), numpy;
#   - the package `mx` itself (python/mx + the PyO3 extension crates/bindings/python), built and installed
#     the way a user would: `pip install .` from the checkout (maturin, release profile; the
#     build shares cargo's target directory, $CARGO_TARGET_DIR or $REPO/target).
#
# A second run is fast: packages whose installed version already matches are not touched, and
# the package is rebuilt only when its sources changed (a SHA-256 over the Rust crates, proto/,
# python/mx and the build files, kept in $VENV/.mx-package-stamp).
# Before downloading torch it checks the free disk space (MX_SETUP_MIN_FREE_GB, default 8).
#
#   scripts/setup-python.sh            as above
#   MX_SETUP_FORCE_BUILD=1 scripts/setup-python.sh    rebuild the package even if unchanged
#   MX_SETUP_PACKAGE=0 scripts/setup-python.sh        only the pinned packages, not the package mx
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
MX="$REPO/.mx"
VENV="$MX/venv"
PY="$VENV/bin/python"
STAMP="$VENV/.mx-package-stamp"
MIN_FREE_GB="${MX_SETUP_MIN_FREE_GB:-8}"

# Exact pins (name==version); numpy is only required to be present.
PINS=(torch==2.13.0 nixl-cu12==1.5.1 maturin==1.16.0 pytest==9.2.0 pytest-xdist==3.8.0 ruff==0.17.5
    'moto[server]==5.2.1')
PRESENT=(numpy)

log() { printf 'setup-python: %s\n' "$*" >&2; }
t0=$SECONDS

mkdir -p "$MX/cache"
if [[ ! -x "$PY" ]] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    command -v python3 >/dev/null 2>&1 || { log "python3 is required (scripts/setup.sh installs it)"; exit 1; }
    log "creating the venv $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
fi

pip_install() {
    # PyPI's answers here are not always cacheable; where they are, pip keeps them in .mx/cache.
    PIP_CACHE_DIR="$MX/cache/pip" PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$PY" -m pip install --quiet --progress-bar off "$@"
}

# --- pinned packages ---------------------------------------------------------------------------
# One interpreter start for all checks (pip show would take ~0.5 s per package).
mapfile -t missing < <("$PY" - "${PINS[@]}" -- "${PRESENT[@]}" <<'PY'
import importlib.metadata as md
import sys

args = sys.argv[1:]
sep = args.index("--")
for pin in args[:sep]:
    name, want = pin.split("==")
    name = name.split("[")[0]  # extras are not part of the distribution's name
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    # torch's local version tag (+cu130...) is not part of the pin.
    if have is None or have.split("+")[0] != want:
        print(pin)
for name in args[sep + 1:]:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(name)
PY
)

if ((${#missing[@]})); then
    need_gb=1
    for p in "${missing[@]}"; do [[ "$p" == torch==* ]] && need_gb="$MIN_FREE_GB"; done
    free_kb="$(df -Pk "$MX" | awk 'NR == 2 { print $4 }')"
    free_gb=$((free_kb / 1024 / 1024))
    if ((free_gb < need_gb)); then
        log "not enough disk space: ${free_gb} GB free on the filesystem of $MX, need ${need_gb} GB"
        log "(torch==2.13.0 with its nvidia-* wheels takes ~5 GB installed); free some space and rerun"
        exit 1
    fi
    log "installing ${missing[*]} (${free_gb} GB free)"
    # All in one resolver run: nixl-cu12 requires torch without a pin, so torch's pin must be
    # part of the same request.
    pip_install "${PINS[@]}" "${PRESENT[@]}" >&2
else
    log "pinned packages present: ${PINS[*]} ${PRESENT[*]}"
fi

# --- the package mx ----------------------------------------------------------------------------
sources_hash() {
    (
        cd "$REPO"
        {
            printf '%s\n' pyproject.toml Cargo.toml Cargo.lock .cargo/config.toml README.md
            find crates proto python/mx -type f \
                \( -name '*.rs' -o -name '*.toml' -o -name '*.proto' -o -name '*.py' \
                   -o -name '*.pyi' -o -name 'py.typed' \) 2>/dev/null
        } | LC_ALL=C sort -u | while read -r f; do
            [[ -f "$f" ]] && printf '%s %s\n' "$(sha256sum <"$f" | cut -d' ' -f1)" "$f"
        done
    ) | sha256sum | cut -d' ' -f1
}

if [[ "${MX_SETUP_PACKAGE:-1}" == 0 ]]; then
    # scripts/test.sh builds the package after the workspace's release build, which it reuses.
    log "ready in $((SECONDS - t0)) s (the package mx left out: MX_SETUP_PACKAGE=0)"
    exit 0
fi

want="$(sources_hash)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "${MX_SETUP_FORCE_BUILD:-0}" != 1 && "$want" == "$have" ]] \
    && "$PY" -c 'import mx._mx' >/dev/null 2>&1; then
    log "package mx up to date (sources unchanged)"
else
    log "building and installing the package mx (pip install .; maturin, release)"
    b0=$SECONDS
    rm -f "$STAMP"
    # maturin's build backend runs the `maturin` command: the venv's bin goes first on PATH.
    # No build isolation: the build uses the venv's pinned maturin instead of downloading one.
    PATH="$VENV/bin:$PATH" pip_install --no-build-isolation "$REPO" >&2
    "$PY" -c 'import mx._mx' || { log "the installed package mx does not import"; exit 1; }
    echo "$want" >"$STAMP"
    log "package mx built and installed in $((SECONDS - b0)) s"
fi

log "ready in $((SECONDS - t0)) s: $("$PY" -c 'import importlib.metadata as m; print(", ".join(f"{n} {m.version(n)}" for n in ("mx", "torch", "nixl-cu12")))')"
