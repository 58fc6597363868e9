"""Runs an example of ``examples/`` at CI's size for a test: ``--ci --report`` in a subprocess
importing the ``mx`` the test imports, its exit status and the harness's report checker
(``examples/check_report.py``) asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import check_report

import mx

REPO = Path(__file__).resolve().parents[2]


def run_example_ci(
    name: str, tmp_path: Path, args: tuple[str, ...] = ("--ci",), timeout: float = 1800.0
) -> dict[str, Any]:
    """The report of ``examples/<name>.py`` with ``args`` (CI's size: ``--ci`` unless given;
    every wait inside bounded at 600 s), checked as kind ``name``. Fails the test with the
    example's output tail when it exits non-zero."""
    report = tmp_path / f"{name}.json"
    env = dict(os.environ)
    here = Path(mx.__file__).resolve().parents[1]
    if here.name != "site-packages":
        env["PYTHONPATH"] = os.pathsep.join([str(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / f"{name}.py"), *args]
        + ["--report", str(report), "--timeout", "600"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(report.read_text())
    assert check_report.check(name, r) == []
    return r
