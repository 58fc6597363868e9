#!/usr/bin/env bash
# Installs the NIXL 1.5.1 runtime libraries (from PyPI's nixl-cu12 wheel) into $REPO/.mx/nixl.
#
# nixl-sys (feature stub-api) dlopen()s libnixl_capi.so at run time, so mx builds without NIXL and
# uses these libraries when they are found. The wheel carries:
#   .nixl_cu12.mesonpy.libs/  libnixl.so, libnixl_capi.so, libnixl_build.so, ..., plugins/libplugin_*.so
#   nixl_cu12.libs/           the bundled UCX 1.23 (libucp, libuct, libucs, ucx/ modules) and friends
# Both are unpacked side by side into $REPO/.mx/nixl/ (the libraries find each other by rpath).
#
# Idempotent: a second run only prints the environment. Needs python3 with pip (no install: only
# `pip download`) and no root. Prints the library directory and the environment NIXL processes need.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="1.5.1"
WHEEL_PKG="nixl-cu12"
CACHE="$REPO/.mx/cache"
DEST="$REPO/.mx/nixl"
STAMP="$DEST/.installed-$WHEEL_PKG-$VERSION"

log() { printf 'install-nixl: %s\n' "$*" >&2; }

if [[ ! -f "$STAMP" ]]; then
    command -v python3 >/dev/null 2>&1 || { log "python3 is required (for pip download)"; exit 1; }
    mkdir -p "$CACHE"
    wheel="$(ls "$CACHE"/nixl_cu12-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
        log "downloading $WHEEL_PKG==$VERSION (about 69 MB) into $CACHE"
        if command -v pip >/dev/null 2>&1 && pip --version >/dev/null 2>&1; then
            pip download --no-deps "$WHEEL_PKG==$VERSION" -d "$CACHE"
        else
            python3 -m pip download --no-deps "$WHEEL_PKG==$VERSION" -d "$CACHE"
        fi
        wheel="$(ls "$CACHE"/nixl_cu12-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
        [[ -n "$wheel" ]] || { log "pip download produced no nixl_cu12-$VERSION wheel in $CACHE"; exit 1; }
    fi
    log "unpacking $(basename "$wheel") into $DEST"
    tmp="$(mktemp -d "$REPO/.mx/nixl-unpack.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # python's zipfile instead of unzip: one less system package to install.
    python3 - "$wheel" "$tmp" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
prefixes = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        for p in prefixes:
            if name.startswith(p) and not name.endswith("/"):
                rel = name[len(p):]
                if rel.startswith("/") or ".." in rel.split("/"):
                    sys.exit(f"unsafe path in wheel: {name}")
                target = os.path.join(out, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.chmod(target, 0o755)
                n += 1
if n == 0:
    sys.exit("the wheel holds none of " + ", ".join(prefixes))
print(f"extracted {n} files", file=sys.stderr)
PY
    for f in libnixl.so libnixl_capi.so plugins/libplugin_UCX.so; do
        [[ -f "$tmp/$f" ]] || { log "expected $f in the wheel, not found"; exit 1; }
    done
    rm -rf "$DEST"
    mv "$tmp" "$DEST"
    trap - EXIT
    touch "$STAMP"
else
    log "already installed in $DEST"
fi

cat <<EOF
NIXL $VERSION libraries: $DEST
mx binaries and tests built in this checkout find them there by themselves (mx-nixl dlopens
$DEST/libnixl_capi.so; NIXL finds plugins/ and the bundled UCX next to it).
Environment for NIXL processes:
  export UCX_MODULES=^efa          # mx-nixl sets this when unset; needed where rdma-core is installed
  export LD_LIBRARY_PATH=$DEST\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}   # only for binaries outside this checkout
  # (or MX_NIXL_DIR=$DEST); NIXL_PLUGIN_DIR=$DEST/plugins is optional (it is the default)
EOF
echo "$DEST"
