"""The one checker of the examples' JSON reports (scripts/test.sh runs it after each example).

Run it::

    .mx/venv/bin/python examples/check_report.py KIND REPORT.json

``KIND`` is the example that wrote the report (``python_refit``, ``rl_loop``,
``moe_refit``, ``vllm_trainer_api``, ``verl_engine``). Exit status 0
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
  weights; ``null`` on a step a ``--ci`` run did not cold-start, never on the last step) and
  ``tokens_changed`` (they differ from the previous step's: the refit changed the model); both
  must be true.

Per kind, on top: ``python_refit``: at least 2 versions and the example's checks
(``all_verified``, ``addresses_unchanged``, ``loss_fell``, ``rollback_verified``,
``staging_within_rank_bytes``); ``rl_loop``: ``config.steps`` steps, each path of
``config.paths`` with one row per step whose ``stall_s`` and ``end_to_end_s`` are positive;
``moe_refit``: see :func:`moe_refit`; ``vllm_trainer_api``: see :func:`vllm_trainer_api`;
``verl_engine``: see :func:`verl_engine`.
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
            if i.get("tokens_changed") is not True:
                bad.append(f"step {s.get('step')} {i.get('id')}: tokens_changed is not true")
            # None: a step a --ci run did not cold-start (the last step always is, below).
            if i.get("tokens_match_cold_start") not in (True, None):
                bad.append(f"step {s.get('step')} {i.get('id')}: tokens_match_cold_start false")
    steps = r.get("steps") or []
    if steps and any(i.get("tokens_match_cold_start") is not True for i in steps[-1]["instances"]):
        bad.append(f"step {steps[-1].get('step')}: the last step is not checked on a cold start")
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
    engines = cfg.get("engines", ["vllm"])
    want = cfg["instances"] + len([k for k in engines if k != "vllm"])
    for s in steps:
        if len(s["instances"]) != want:
            bad.append(f"step {s['step']}: {want} instances")
        kinds = {i.get("kind") for i in s["instances"]}
        if kinds != set(engines):
            bad.append(f"step {s['step']}: instances of kinds {sorted(engines)}, got {kinds}")

    for name in cfg["paths"]:
        rows = r["paths"].get(name, [])
        if len(rows) != len(steps) or any(
            x["stall_s"] <= 0 or x["end_to_end_s"] <= 0 for x in rows
        ):
            bad.append(f"paths.{name}: a positive stall and end-to-end figure per step")
    bad += rl_loop_mx(r)
    return bad


PHASES = ("pause_s", "install_s", "cache_reset_s", "readback_s", "resume_s")


def rl_loop_mx(r: dict[str, Any]) -> list[str]:
    """The mx path's stall accounting (issue 33): per step ``phases`` adding up to
    ``stall_s``, ``prepare_s`` outside the pause, every vLLM install an exchange of a prepared
    set, the request stream's tokens/s; the rollback step (a forward refit and the refit back,
    both exchanges on vLLM) verified."""
    bad = []
    for x in r["paths"].get("mx", []):
        ph = x.get("phases", {})
        if set(ph) != set(PHASES) or any(ph[k] < 0 for k in ph):
            bad.append(f"paths.mx step {x['step']}: phases {ph}, want {PHASES}, none negative")
        elif abs(sum(ph.values()) - x["stall_s"]) > 1e-3:
            bad.append(f"paths.mx step {x['step']}: phases add up to {sum(ph.values())}")
        if not x.get("prepare_s", 0) > 0:
            bad.append(f"paths.mx step {x['step']}: no prepare_s ({x.get('prepare_s')})")
        if x.get("install_modes") != ["exchange"]:
            bad.append(f"paths.mx step {x['step']}: installs {x.get('install_modes')}")
        stream = x.get("stream_tokens_per_s", {})
        if not stream.get("steady", 0) > 0 or stream.get("during_stage", -1) < 0:
            bad.append(f"paths.mx step {x['step']}: stream_tokens_per_s {stream}")
    rb = r.get("rollback")
    if not isinstance(rb, dict) or not (
        rb.get("ran") and rb.get("verified") and rb.get("stall_s", 0) > 0
    ):
        bad.append(f"rollback: not run, verified and timed: {rb}")
    elif rb.get("install_modes") != ["exchange"] or rb["forward"].get("install_modes") != [
        "exchange"
    ]:
        bad.append(f"rollback: installs {rb.get('install_modes')}, forward {rb['forward']}")
    bad += rl_loop_memory(r.get("memory"))
    return bad


def rl_loop_memory(memory: Any) -> list[str]:
    """Each vLLM rank's memory between two mx refits (issue 33), by role: the registered host
    copy one rank's bytes, the previous version retained in staging (no copy of its own: an
    apply exchanged them), staging at most the rank's bytes, the processed set exchanged out
    held as the rollback source, a prepare's largest window below the rank's bytes (it read
    staging a layer at a time), vLLM's weights and the process's resident set (now <= peak)
    measured."""
    rows = (memory or {}).get("between_refits")
    if not rows:
        return [f"memory.between_refits: missing ({memory})"]
    bad = []
    for m in rows:
        who, mx_ = f"memory rank {m.get('rank')}", m.get("mx", {})
        reg = mx_.get("registered_bytes", 0)
        other = mx_.get("other_set") or {}
        if not (
            reg > 0
            and mx_.get("retained_bytes") == 0
            and mx_.get("retained_in_staging") is True
            and mx_.get("retained_version") == other.get("version_id")
            and 0 < mx_.get("staging_bytes", 0) <= reg
        ):
            bad.append(f"{who}: registered {reg}, retained and staging {mx_}")
        if other.get("role") != "rollback source" or not other.get("tensor_bytes", 0) > 0:
            bad.append(f"{who}: the set beside vLLM's is {other}, want the rollback source")
        if not 0 < (mx_.get("prepare_window_bytes_peak") or 0) < reg:
            bad.append(f"{who}: a prepare's largest window {mx_.get('prepare_window_bytes_peak')}")
        w = m.get("vllm_weights", {})
        if not w.get("tensor_bytes", 0) > 0 or not (w.get("rss_bytes") or 0) > 0:
            bad.append(f"{who}: vLLM's weights {w}")
        if not 0 < m.get("process_rss_bytes", 0) <= m.get("process_rss_bytes_peak", 0):
            bad.append(f"{who}: resident set {m.get('process_rss_bytes')} / peak")
    return bad


MOE_KEYS = (
    "model",
    "experts",
    "trainer_layouts",
    "engine_layouts",
    "steps",
    "rollback_verified",
    "fp8",
    "all_checks_hold",
    "failed_checks",
)
MOE_INSTANCE_KEYS = (
    "id",
    "source",
    "engine_layout",
    "tokens",
    "cold_tokens",
    "tokens_match_cold_start",
    "tokens_changed",
    "rank_bytes",
    "wire_bytes",
)


def moe_refit(r: dict[str, Any]) -> list[str]:
    """At least 3 steps alternating ``fsdp:2`` (odd) and ``megatron:tp=2,pp=2,ep=2`` (even),
    every refit COMMITTED, every instance's tokens equal to its cold start and different from
    its tokens at the previous step, the tp:1 server's installs exchanges of a prepared set,
    bytes pulled per rank in (0, rank bytes]; tp:1 ran; a layout that did not run says why; the
    rollback verified; fp8's keys."""
    bad = [f"missing key {k}" for k in MOE_KEYS if k not in r]
    if bad:
        return bad
    m = r["model"]
    if m.get("model_type") != "qwen3_moe" or r["experts"] != 8 or m.get("experts") != 8:
        bad.append(f"model: a qwen3_moe with 8 experts, got {m} / experts {r['experts']}")
    if r["trainer_layouts"] != ["fsdp:2", "megatron:tp=2,pp=2,ep=2"]:
        bad.append(f"trainer_layouts: {r['trainer_layouts']}")
    ran = {}
    for e in r["engine_layouts"]:
        ran[e["layout"]] = e["ran"]
        if not e["ran"] and not e.get("error"):
            bad.append(f"engine_layouts: {e['layout']} did not run and says no error")
    if ran.get("tp:1") is not True:
        bad.append("engine_layouts: tp:1 did not run")
    steps = r["steps"]
    if len(steps) < 3:
        bad.append(f"at least 3 steps, got {len(steps)}")
    seen: dict[str, list[int]] = {}  # instance id -> its tokens at the previous step
    ids = []
    for k, s in enumerate(steps, start=1):
        want = "fsdp:2" if k % 2 else "megatron:tp=2,pp=2,ep=2"
        if s["source"] != want:
            bad.append(f"{s['label']}: source {s['source']}, expected {want}")
        if s["outcome"] != "COMMITTED":
            bad.append(f"{s['label']}: outcome {s['outcome']}")
        ids.append(s["version_id"])
        for i in s["instances"]:
            missing = [x for x in MOE_INSTANCE_KEYS if x not in i]
            if missing:
                bad.append(f"{s['label']}: instance without {missing}")
                continue
            where = f"{s['label']} {i['id']} ({i['engine_layout']})"
            if ran.get(i["engine_layout"]) is not True:
                bad.append(f"{where}: its engine layout is not listed as ran")
            if not i["tokens"] or i["tokens"] != i["cold_tokens"]:
                bad.append(f"{where}: tokens {i['tokens']} != cold start {i['cold_tokens']}")
            # The tp:1 server prepares each version while serving (its MoE experts included).
            if i["engine_layout"] == "tp:1" and i.get("install_mode") != "exchange":
                bad.append(f"{where}: installed by {i.get('install_mode')}, not an exchange")
            if i["tokens_match_cold_start"] is not (i["tokens"] == i["cold_tokens"]):
                bad.append(f"{where}: tokens_match_cold_start disagrees with the tokens")
            if i["tokens"] == seen.get(i["id"]) or i["tokens_changed"] is not True:
                bad.append(f"{where}: the tokens did not change since the previous step")
            seen[i["id"]] = i["tokens"]
            ranks = i["rank_bytes"]
            if set(i["wire_bytes"]) != set(ranks) or not all(
                0 < b <= ranks[rank] for rank, b in i["wire_bytes"].items()
            ):
                bad.append(f"{where}: wire_bytes {i['wire_bytes']} vs rank_bytes {ranks}")
    if len(set(ids)) != len(ids) or not all(str(v).startswith("mx:") for v in ids):
        bad.append(f"steps: version ids not distinct mx ids: {ids}")
    sources = {s["source"] for s in steps}
    if sources != set(r["trainer_layouts"]):
        bad.append(f"steps: sources {sorted(sources)}, not both trainer layouts")
    if steps and not any(i["engine_layout"] == "tp:1" for i in steps[-1]["instances"]):
        bad.append("the last step has no tp:1 instance")
    if r["rollback_verified"] is not True:
        bad.append("rollback_verified is not true")
    fp8 = r["fp8"]
    fp8_keys = ("tensors", "blocks", "bytes_equal_reference", "ran_in_vllm", "vllm_error")
    if not isinstance(fp8, dict) or any(k not in fp8 for k in fp8_keys):
        bad.append(f"fp8: missing keys of {fp8_keys}")
        return bad
    if fp8["bytes_equal_reference"] is not True or not fp8["tensors"] or not fp8["blocks"]:
        bad.append(f"fp8: bytes {fp8['bytes_equal_reference']} over {fp8['tensors']} tensors")
    engine = fp8.get("engine") or {}
    if fp8["ran_in_vllm"]:
        if engine.get("outcome") != "COMMITTED" or not engine.get("tokens"):
            bad.append(f"fp8: the FP8 vLLM's refit: {engine.get('outcome')}")
        elif engine["tokens"] != engine.get("cold_tokens"):
            bad.append(f"fp8: tokens {engine['tokens']} != cold start {engine.get('cold_tokens')}")
    elif not fp8["vllm_error"]:
        bad.append("fp8: did not run in vLLM and says no error")
    return bad


def vllm_trainer_api(r: dict[str, Any]) -> list[str]:
    """vLLM's trainer API with mx behind it: at least 2 committed versions, each verified on
    both servers (one step row per version, two instances each); the step whose install failed
    on one server raised on every rank and engine and left both servers on the previous version
    (``rollback``, ``rollback_verified``); nothing gathered in ``trainer_init``/``send_weights``
    (``gathered_bytes`` and ``collective_calls_in_send`` 0) while the same wrappers saw
    training's FSDP2 all-gathers (``training_gathered_bytes`` > 0); one publication and one
    refit per step; the trainer's restart (``restart``) left both servers serving the committed
    version, admitted, and the labels counted on (``step-<n>``, n the step)."""
    bad = []
    versions = r["versions"]
    restart = r.get("restart") or {}
    if restart.get("verified") is not True:
        bad.append(f"restart: not verified: {restart}")
    labels = [v["label"] for v in versions]
    if labels != [f"step-{k}" for k in range(1, len(versions) + 1)]:
        bad.append(f"labels {labels}: not step-1, step-2, ... across the restart")
    if len(versions) < 2:
        bad.append(f"at least 2 versions, got {len(versions)}")
    if len(r["steps"]) != len(versions):
        bad.append(f"{len(versions)} steps, got {len(r['steps'])}")
    servers = r["servers"]
    if len(servers) != 2:
        bad.append(f"two servers, got {servers}")
    for s in r["steps"]:
        if sorted(i["id"] for i in s["instances"]) != sorted(servers):
            bad.append(f"step {s['step']}: instances {[i['id'] for i in s['instances']]}")
    for k in ("all_verified", "rollback_verified", "one_publication_per_step"):
        if r.get(k) is not True:
            bad.append(f"{k} is not true")
    rb = r["rollback"]
    if rb.get("outcome") not in ("ROLLED_BACK", "ABORTED") or not rb.get(
        "raised_on_every_rank_and_engine"
    ):
        bad.append(f"rollback: outcome {rb.get('outcome')}, raised everywhere: {rb}")
    if rb.get("version_id") in [v["version_id"] for v in versions]:
        bad.append("rollback: its version is listed as committed")
    for k in ("gathered_bytes", "collective_calls_in_send"):
        if r.get(k) != 0:
            bad.append(f"{k} is {r.get(k)}, not 0")
    if not r.get("training_gathered_bytes", 0) > 0:
        bad.append("training_gathered_bytes: the wrappers saw no FSDP2 all-gather in training")
    return bad


def verl_engine(r: dict[str, Any]) -> list[str]:
    """verl's checkpoint engine with mx behind it: at least 2 synced versions, each with every
    tensor verl's installer handed vLLM equal to the trainer's (``syncs[]``:
    ``tensors_verified == tensors``); the failed pull raised ``DataLoss`` before anything
    reached vLLM, which kept the previous version (``rollback``, ``rollback_verified``);
    nothing gathered in the sync windows (``gathered_bytes`` and ``collective_calls_in_sync``
    0) while the same wrappers saw training's FSDP2 all-gathers."""
    bad = []
    versions = r["versions"]
    if len(versions) < 2:
        bad.append(f"at least 2 versions, got {len(versions)}")
    syncs = r.get("syncs", [])
    if len(syncs) != len(versions):
        bad.append(f"{len(versions)} syncs, got {len(syncs)}")
    for s in syncs:
        if not s.get("tensors") or s.get("tensors_verified") != s.get("tensors"):
            bad.append(
                f"sync {s.get('global_steps')}: {s.get('tensors_verified')} of "
                f"{s.get('tensors')} tensors verified"
            )
    for k in ("all_verified", "rollback_verified"):
        if r.get(k) is not True:
            bad.append(f"{k} is not true")
    rb = r.get("rollback", {})
    if rb.get("outcome") != "ABORTED" or rb.get("code") != "DataLoss":
        bad.append(f"rollback: outcome {rb.get('outcome')}, code {rb.get('code')}")
    if rb.get("vllm_calls_after_failure"):
        bad.append(f"rollback: vLLM was called: {rb['vllm_calls_after_failure']}")
    if rb.get("version_id") in [v["version_id"] for v in versions]:
        bad.append("rollback: its version is listed as committed")
    for k in ("gathered_bytes", "collective_calls_in_sync"):
        if r.get(k) != 0:
            bad.append(f"{k} is {r.get(k)}, not 0")
    if not r.get("training_gathered_bytes", 0) > 0:
        bad.append("training_gathered_bytes: the wrappers saw no FSDP2 all-gather in training")
    return bad


KINDS = {
    "python_refit": python_refit,
    "rl_loop": rl_loop,
    "moe_refit": moe_refit,
    "vllm_trainer_api": vllm_trainer_api,
    "verl_engine": verl_engine,
}


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
