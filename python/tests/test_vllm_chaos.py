"""The real-engine chaos (``examples/chaos_vllm.py``, issue 29 item 7) in its small fixed-seed
form: two refits across two real vLLM servers, with the control plane and then a trainer
SIGKILLed (seed 14), every promise checked from the servers themselves. The full run (10 refits,
every victim kind, vLLM servers included) is a tool run: see README, "Chaos on real engines"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "examples" / "chaos_vllm.py"


def test_two_refits_with_kills_keep_every_promise(tmp_path):
    report = tmp_path / "chaos.json"
    p = subprocess.run(
        [sys.executable, str(TOOL), "--refits", "2", "--seed", "14", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    doc = json.loads(report.read_text())
    c = doc["chaos"]
    assert doc["passed"] and c["invariant_violations"] == [], c
    assert (c["refits"], c["seed"]) == (2, 14)
    assert [r["victim"] for r in c["rounds"]] == ["control", "trainer-hot"]
    assert c["outcomes"]["fenced"] == 0
    assert sum(c["outcomes"].values()) == 2
    versions = {v["label"]: v["golden_tokens"] for v in doc["versions"]}
    assert len(versions["cold"]) == 4 and versions["cold"] != versions["hot"]
