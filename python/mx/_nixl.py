"""Finding NIXL inside the installed ``nixl-cu12`` wheel, before anything loads it.

The wheel ``nixl-cu12==1.5.1`` (a dependency of this package) installs two directories beside
its Python package in ``site-packages``:

- ``.nixl_cu12.mesonpy.libs/``: ``libnixl.so``, ``libnixl_capi.so`` (the C API that mx's Rust
  data plane loads at run time) and ``plugins/`` (``libplugin_UCX.so``, ...);
- ``nixl_cu12.libs/``: the bundled UCX 1.23 and its other libraries, found through rpaths.

mx's loader (Rust crate ``mx-nixl``) loads ``$MX_NIXL_DIR/libnixl_capi.so`` when ``MX_NIXL_DIR``
is set, once per process, at the first NIXL call. :func:`configure` (run by ``import mx``) sets
``MX_NIXL_DIR`` to the wheel's library directory unless the user set it already, and
``UCX_MODULES=^efa`` unless set (the bundled UCX otherwise crashes at process exit on machines
with rdma-core). NIXL finds ``plugins/`` next to ``libnixl.so`` by itself, so
``NIXL_PLUGIN_DIR`` is left alone.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

#: The distribution mx loads NIXL from.
NIXL_DISTRIBUTION = "nixl-cu12"
#: Its directory holding libnixl_capi.so, relative to site-packages.
LIB_DIR = ".nixl_cu12.mesonpy.libs"
CAPI = "libnixl_capi.so"

#: What configure() decided, for nixl_available() to report: (directory or None, how).
_configured: tuple[str | None, str] = (None, "mx.configure_nixl() has not run")


def wheel_lib_dir() -> tuple[str | None, str]:
    """The directory of ``libnixl_capi.so`` inside the installed ``nixl-cu12``, and how it was
    found (or why not)."""
    try:
        dist = importlib.metadata.distribution(NIXL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, f"the {NIXL_DISTRIBUTION} distribution is not installed"
    lib_dir = Path(str(dist.locate_file(LIB_DIR)))
    if not (lib_dir / CAPI).is_file():
        return None, (
            f"{NIXL_DISTRIBUTION} {dist.version} is installed but {lib_dir / CAPI} is missing"
        )
    return str(lib_dir), f"{NIXL_DISTRIBUTION} {dist.version}"


def configure() -> tuple[str | None, str]:
    """Points mx's NIXL loader at the ``nixl-cu12`` wheel (``MX_NIXL_DIR``) unless the
    environment already names a directory, and sets ``UCX_MODULES=^efa`` when unset.

    Returns ``(directory, how)``: the directory the loader will use (None: the loader searches
    the dynamic loader path and the checkout's ``.mx/nixl``) and a sentence saying why.
    Runs once at ``import mx``; calling it again changes nothing once NIXL was loaded.
    """
    global _configured
    os.environ.setdefault("UCX_MODULES", "^efa")
    user_dir = os.environ.get("MX_NIXL_DIR")
    if user_dir:
        _configured = (user_dir, "MX_NIXL_DIR was set by the environment")
        return _configured
    lib_dir, how = wheel_lib_dir()
    if lib_dir is not None:
        os.environ["MX_NIXL_DIR"] = lib_dir
        _configured = (lib_dir, f"from the installed wheel {how}")
    else:
        _configured = (None, how)
    return _configured
