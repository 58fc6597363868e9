"""`import mx` in a clean environment, and NIXL loaded from the nixl-cu12 wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_python(code: str, env: dict[str, str]) -> dict:
    """Runs `code` in a fresh interpreter with exactly `env`; returns the JSON it prints last."""
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


REPORT = """
    import json, os, mx
    s = mx.nixl_available(probe=True)
    print(json.dumps({"available": bool(s), "loaded_from": s.loaded_from, "reason": s.reason,
                      "nixl_dir": s.nixl_dir, "source": s.source,
                      "MX_NIXL_DIR": os.environ.get("MX_NIXL_DIR"),
                      "UCX_MODULES": os.environ.get("UCX_MODULES"),
                      "version": mx.__version__, "file": mx.__file__}))
"""


def test_import_with_no_environment_finds_nixl_in_the_wheel():
    # No variables at all: not MX_NIXL_DIR, not LD_LIBRARY_PATH, not UCX_MODULES, not HOME.
    r = run_python(REPORT, env={})
    assert r["available"], r
    assert r["reason"] is None
    lib_dir = Path(r["nixl_dir"])
    assert lib_dir.name == ".nixl_cu12.mesonpy.libs", r
    assert lib_dir.parent.name == "site-packages", r
    assert r["loaded_from"] == str(lib_dir / "libnixl_capi.so"), r
    assert r["source"].startswith("from the installed wheel nixl-cu12 1.5.1"), r
    assert r["MX_NIXL_DIR"] == str(lib_dir)
    assert r["UCX_MODULES"] == "^efa"
    # The installed package, not a source tree.
    assert "site-packages" in r["file"], r
    assert r["version"]


def test_the_environment_wins_over_the_wheel_and_a_missing_library_is_an_answer(tmp_path):
    empty = tmp_path / "no-nixl-here"
    empty.mkdir()
    r = run_python(REPORT, env={"MX_NIXL_DIR": str(empty), "UCX_MODULES": "tcp"})
    assert not r["available"], r
    assert r["nixl_dir"] == str(empty)
    assert r["source"] == "MX_NIXL_DIR was set by the environment"
    assert "MX_NIXL_DIR" in r["reason"] and "libnixl_capi.so" in r["reason"], r
    assert r["UCX_MODULES"] == "tcp"


def test_nixl_available_in_this_process():
    import mx

    s = mx.nixl_available(probe=True)
    assert s, s
    assert s.loaded_from and s.loaded_from.endswith("libnixl_capi.so")
    assert os.environ["MX_NIXL_DIR"] == s.nixl_dir


def test_public_names_are_documented():
    import mx

    for name in mx.__all__:
        obj = getattr(mx, name)
        if name == "__version__":
            continue
        assert obj.__doc__ and obj.__doc__.strip(), f"mx.{name} has no docstring"
    for cls in (mx.Control, mx.ControlPlane):
        for attr, member in vars(cls).items():
            if not attr.startswith("_"):
                assert getattr(member, "__doc__", None), (
                    f"mx.{cls.__name__}.{attr} has no docstring"
                )


def test_mx_error_is_an_exception_with_a_code():
    import mx

    assert issubclass(mx.MxError, Exception)
    assert mx.MxError.code is None
    assert mx.MxError.__module__ == "mx"
    with pytest.raises(mx.MxError):
        raise mx.MxError("x")
