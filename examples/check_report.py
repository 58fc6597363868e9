"""The one checker of the examples' JSON reports (scripts/test.sh runs it after each example).

Run it::

    .mx/venv/bin/python examples/check_report.py KIND REPORT.json

``KIND`` is the example that wrote the report (``python_refit``, ``rl_loop``). Exit status 0
when every check holds; otherwise 1 and one line per failed check.

The report schema every example writes (extra keys are allowed):

- ``all_checks_hold`` (bool): the example's own verdict, true only when every check held;
- ``failed_checks`` (list): what failed, empty when ``all_checks_hold``;
- ``versions`` (list): one entry per policy version the example refitted, each with
  ``version_id`` (``mx:<64 hex>``, distinct across entries) and ``outcome`` (the refit's
  outcome; every one ``COMMITTED``);
- ``steps`` (list, examples that run engines step by step): each with ``instances``, one per
  engine instance: ``id``, ``kind`` (``vllm``, ``mx-worker``, ...), ``engine_layout``
  (``tp:1``), ``source`` (how the weights arrived: ``mx``, ``disk``, ``broadcast``),
  ``tokens_match_cold_start`` (its greedy tokens equal a cold start of the engine on the step's
  weights) and ``tokens_changed`` (they differ from the previous step's: the refit changed the
  model); both must be true.

Per kind, on top: ``python_refit``: at least 2 versions and the example's checks
(``all_verified``, ``addresses_unchanged``, ``loss_fell``, ``rollback_verified``,
``staging_within_rank_bytes``); ``rl_loop``: ``config.steps`` steps, each path of
``config.paths`` with one row per step whose ``stall_s`` and ``end_to_end_s`` are positive.
"""

from __future__ import annotations

import json
import sys
from typing import Any

INSTANCE_KEYS = ("id", "kind", "engine_layout", "source")


def common(r: dict[str, Any]) -> list[str]:
    """The checks every report passes."""
    bad = []
    if r.get("all_checks_hold") is not True:
        bad.append("all_checks_hold is not true")
    if r.get("failed_checks"):
        bad.append(f"failed_checks: {r['failed_checks']}")
    versions = r.get("versions")
    if not isinstance(versions, list) or not versions:
        return bad + ["versions: missing or empty"]
    ids = [v.get("version_id") for v in versions]
    if any(not isinstance(i, str) or not i.startswith("mx:") for i in ids):
        bad.append(f"versions: a version_id is not an mx version id: {ids}")
    if len(set(ids)) != len(ids):
        bad.append(f"versions: version ids repeat: {ids}")
    outcomes = [v.get("outcome") for v in versions]
    if any(o != "COMMITTED" for o in outcomes):
        bad.append(f"versions: not every refit COMMITTED: {outcomes}")
    for s in r.get("steps", []):
        for i in s.get("instances", []):
            missing = [k for k in INSTANCE_KEYS if k not in i]
            if missing:
                bad.append(f"step {s.get('step')}: instance without {missing}")
            for k in ("tokens_match_cold_start", "tokens_changed"):
                if i.get(k) is not True:
                    bad.append(f"step {s.get('step')} {i.get('id')}: {k} is not true")
    return bad


def python_refit(r: dict[str, Any]) -> list[str]:
    bad = []
    if len(r["versions"]) < 2:
        bad.append("at least 2 versions")
    for k in (
        "all_verified",
        "addresses_unchanged",
        "loss_fell",
        "rollback_verified",
        "staging_within_rank_bytes",
    ):
        if r.get(k) is not True:
            bad.append(f"{k} is not true")
    return bad


def rl_loop(r: dict[str, Any]) -> list[str]:
    bad = []
    cfg = r["config"]
    steps = r["steps"]
    if len(steps) != cfg["steps"]:
        bad.append(f"{cfg['steps']} steps, got {len(steps)}")
    for s in steps:
        if len(s["instances"]) != cfg["instances"]:
            bad.append(f"step {s['step']}: {cfg['instances']} instances")
    for name in cfg["paths"]:
        rows = r["paths"].get(name, [])
        if len(rows) != len(steps) or any(
            x["stall_s"] <= 0 or x["end_to_end_s"] <= 0 for x in rows
        ):
            bad.append(f"paths.{name}: a positive stall and end-to-end figure per step")
    return bad


KINDS = {"python_refit": python_refit, "rl_loop": rl_loop}


def check(kind: str, report: dict[str, Any]) -> list[str]:
    """Every failed check of ``report`` as written by the example ``kind`` (empty: all hold)."""
    bad = common(report)
    try:
        bad += KINDS[kind](report)
    except (KeyError, TypeError) as e:
        bad.append(f"report malformed: {type(e).__name__}: {e}")
    return bad


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        print(f"usage: check_report.py {{{','.join(KINDS)}}} REPORT.json", file=sys.stderr)
        return 2
    kind, path = sys.argv[1:]
    with open(path) as f:
        report = json.load(f)
    bad = check(kind, report)
    for b in bad:
        print(f"{kind} report {path}: {b}", file=sys.stderr)
    if not bad:
        print(f"{kind} report: every check holds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
