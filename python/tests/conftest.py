"""Shared fixtures, and the rule that a skipped test fails the run.

A test that cannot run here (no NIXL, no torch...) must fail loudly rather than pass as
skipped: the session ends with exit status 1 when any test or module was skipped. Pass
``--allow-skips`` to see the skips without failing (local runs only; scripts/test.sh never does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The examples' helpers (examples/engines.py: real engines, such as a vLLM server with mx's
# backend) are shared with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

_skipped: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--allow-skips",
        action="store_true",
        help="do not fail the run when tests were skipped (the default is to fail)",
    )


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        _skipped.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0 and not session.config.getoption("--allow-skips"):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _skipped and not config.getoption("--allow-skips"):
        terminalreporter.section("skipped tests fail this suite")
        for line in _skipped:
            terminalreporter.write_line(f"SKIPPED (counts as a failure) {line}")


@pytest.fixture
def control_plane(tmp_path):
    """A control plane embedded in this process, on an ephemeral port, with a fresh journal."""
    import mx

    with mx.ControlPlane(journal=tmp_path / "control" / "journal.jsonl") as cp:
        yield cp


@pytest.fixture
def control(control_plane):
    """The orchestrator's client of ``control_plane``."""
    import mx

    return mx.Control(control_plane.url, timeout=10.0)
