"""The suite's own rule: a skipped test fails the run (conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def test_a_skipped_test_fails_the_suite(tmp_path):
    here = Path(__file__).parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_skipped():\n    pytest.skip('no accelerator here')\n"
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "SKIPPED (counts as a failure)" in p.stdout and "no accelerator here" in p.stdout
    p = subprocess.run(
        [*args, "--allow-skips"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
