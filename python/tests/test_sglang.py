"""mx refits SGLang 0.5.23 both ways it is deployed, in one fleet: its own server
(examples/engines.py's ``SglangServer``) and NVIDIA Dynamo's SGLang worker behind a Dynamo
frontend (``DynamoSglang``), both on CPU with mx's loader allowed (``--custom-weight-loader
mx.sglang.load``): one commit across the two engine kinds (``sglang``, ``dynamo_sglang``), or a
rollback on both.

First the harness against the real server: its answers equal the ones the Rust client's tests
are built on (``crates/engine-clients/adapters/tests/fixtures/sglang-0.5.23.json``), and the
Dynamo worker's routes answer as ``mx_adapters::dynamo_sglang`` reads them.

mx as a user runs it: :func:`mx.sglang.attach` starts each rank's puller through one
weight-update session, :func:`mx.dynamo.attach_sglang` through the worker's
``/engine/control/update_weights_from_tensor``; a refit pauses (``retract``), installs naming
the version to mx's loader (no weight bytes over HTTP), flushes, reads back (the ranks' own
reports), continues and generates (the Dynamo worker through its frontend). The installed
weights are checked in SGLang's own terms: its ``/weights_checker`` checksums after mx's install
equal those after SGLang loads the same version's checkpoint from disk itself, and so do its
greedy tokens, on both kinds. Then the faults: an install failing midway in either kind (mx's
loader restores the previous version; SGLang still answers success; the rank's report rolls the
refit back on both engines), an ``in_place`` pause with a failing update (rolled back, the
SGLang server reinstalled on the previous version, not trusted; the Dynamo worker refuses
``in_place``), and last SGLang's own server killed during an install (nothing commits; the
Dynamo worker ends on the previous version, serving it, unpaused). One engine of each kind for
the module (start-up 30-75 s, in parallel).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engines import COLD_TOKENS, DYNAMO_MODEL, MODEL, PROMPT, DynamoSglang, SglangServer
from safetensors.torch import load_file, save_file

import mx

SGLANG = "sglang-a-tp0"
DYNAMO = "dsg-a-tp0"
FIXTURES = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "crates/engine-clients/adapters/tests/fixtures/sglang-0.5.23.json"
    ).read_text()
)
HOT_SCALE = 1.1
"""The ``hot`` version: every weight x1.1. Its greedy tokens for ``PROMPT`` are far from ties (a
torch forward of it: top-2 margins 0.75-11.6 nats, against 0.0 at x1.5, whose tokens moved with
how SGLang computed a cached prompt on an AMD EPYC with AVX512-BF16), so every path that
computes it (mx's loader, SGLang's disk loader, a cached or a fresh prefix) must agree."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    work = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(2) as ex:
        futures = {
            "sglang": ex.submit(SglangServer, work / "sglang"),
            "dynamo": ex.submit(DynamoSglang, work / "dynamo"),
        }
    started = {k: f.result() for k, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def fleet(engines, tmp_path_factory):
    """A control plane, a trainer holding the checkpoint's tensors, the SGLang server attached as
    ``sglang-a`` and the Dynamo SGLang worker as ``dsg-a``."""
    work = tmp_path_factory.mktemp("control")
    with mx.ControlPlane(journal=work / "journal.jsonl") as cp:
        control = mx.Control(cp.url, timeout=30.0)
        weights = load_file(str(MODEL / "model.safetensors"))
        pub = mx.Publisher(cp.url, model=mx.Model.from_dir(MODEL), layout="replicated:1", slot=0)
        pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
        assert engines["sglang"].init_mx(cp.url, "sglang-a") == [SGLANG]
        assert engines["dynamo"].init_mx(cp.url, "dsg-a") == [DYNAMO]
        yield {"cp": cp, "control": control, "pub": pub, "weights": weights, "work": work}
        pub.close()


def _scaled(fleet, scale: float) -> dict[str, torch.Tensor]:
    return {n: (t * scale).to(t.dtype) for n, t in fleet["weights"].items()}


def _publish(fleet, label: str, scale: float) -> str:
    """Publishes the checkpoint scaled by ``scale`` (1.0: exactly the checkpoint) as ``label``."""
    w = fleet["weights"]
    fleet["control"].declare(label, w, trainer_layout="replicated:1")
    original = {n: t.clone() for n, t in w.items()}
    scaled = _scaled(fleet, scale)
    with torch.no_grad():
        for n, t in w.items():
            t.copy_(scaled[n])
    try:
        return fleet["pub"].publish(label, copy=True, timeout=60)
    finally:
        with torch.no_grad():
            for n, t in w.items():
                t.copy_(original[n])


def _refit(fleet, label: str, expected=None, workers=(SGLANG, DYNAMO), pause_mode="keep"):
    check = mx.GenerationCheck(PROMPT, len(COLD_TOKENS), expected or [])
    return fleet["control"].refit(
        label,
        list(workers),
        pause_mode=pause_mode,
        check=check,
        stage_timeout=120,
        call_timeout=120,
    )


def _resident(fleet, worker: str) -> str:
    w = {x.worker_id: x for x in fleet["control"].status().workers}[worker]
    assert w.connected, w
    return w.resident_id


def _serving(fleet, engines, version: str, tokens: list[int], dynamo_version: str | None = None):
    """Both engines hold ``version`` (the Dynamo worker ``dynamo_version`` when given: at start
    each holds its own checkpoint directory), generate ``tokens`` (the Dynamo worker through its
    frontend, which routes no request to a paused worker) and are not paused."""
    s, d = engines["sglang"], engines["dynamo"]
    assert s.model_info()["weight_version"] == version
    assert _resident(fleet, SGLANG) == version
    assert s.generate(PROMPT) == tokens
    assert _resident(fleet, DYNAMO) == (dynamo_version or version)
    assert d.generate(PROMPT) == tokens


def _checksums(sglang) -> dict[str, str]:
    status, body = sglang.call("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200 and body["success"], body
    [rank] = body["ranks"]
    return rank["checksums"]


def _call(engine: SglangServer, name: str):
    """Replays the fixture ``name``'s request: ``(status, body)``."""
    method, route = FIXTURES[name]["route"].split(" ", 1)
    return engine.call(method, route, FIXTURES[name].get("request"))


def _fixture(name: str):
    return FIXTURES[name]["status"], FIXTURES[name]["body"]


def test_sglang_answers_as_the_fixtures_say(engines):
    """Before anything is attached: the greedy tokens, the initial version, a pause/continue
    round and the weight-update session's answers are the fixtures' (the Rust client's tests)."""
    sglang = engines["sglang"]
    assert sglang.generate(PROMPT) == COLD_TOKENS
    status, body = _call(sglang, "generate_ok")
    want_status, want = _fixture("generate_ok")
    assert status == want_status and body["output_ids"] == want["output_ids"] == COLD_TOKENS
    assert sorted(body["meta_info"]) == sorted(want["meta_info"])
    info = sglang.model_info()
    assert info["weight_version"] == "default"
    # The fixture's, but for the model directory (the checkout's path on this machine).
    paths = dict.fromkeys(("model_path", "served_model_name", "tokenizer_path"), str(MODEL))
    assert info == {**_fixture("model_info")[1], **paths}
    for name in (
        "pause_retract",
        "continue_ok",
        "begin_ok",
        "begin_already_open",
        "end_ok",
        "end_no_session",
        "tensor_outside_session",
    ):
        assert _call(sglang, name) == _fixture(name), name
    assert sglang.generate(PROMPT) == COLD_TOKENS


def test_dynamo_sglang_routes_answer_as_mx_reads_them(engines):
    """Dynamo's SGLang worker, before anything is attached: its tokens through the frontend are
    SGLang's own server's; pause/continue answer ``{"status": "ok"}``; a handler that raised is
    HTTP 500 ``Handler error``; an unknown route 404; the session routes and the tensor route
    answer SGLang's ``{success, message}`` with HTTP 200 (``mx_adapters::dynamo_sglang``)."""
    d = engines["dynamo"]
    assert d.generate(PROMPT) == COLD_TOKENS
    assert d.route("pause_generation", {"mode": "retract"}) == (200, {"status": "ok"})
    assert d.route("continue_generation", {"torch_empty_cache": False}) == (200, {"status": "ok"})
    status, body = d.route("control/update_weight_version", {})
    assert status == 500 and body["error"] == "Handler error", body
    assert "new_version" in body["message"], body
    status, body = d.route("get_weight_version", {})
    assert status == 404 and body["error"] == "Route not found", body
    # The weight-update session (configured routes): SGLang's answers, HTTP 200 throughout.
    ok = (200, {"success": True, "message": "Success"})
    assert d.route("begin_weight_update", {"selector": "all"}) == ok
    status, body = d.route("begin_weight_update", {"selector": "all"})
    assert (status, body["success"]) == (200, False) and "already open" in body["message"], body
    assert d.route("end_weight_update", {}) == ok
    status, body = d.route("end_weight_update", {})
    assert (status, body["success"]) == (200, False) and "no weight-update" in body["message"]
    status, body = d.route("control/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert (status, body["success"]) == (200, False), body
    assert "between begin_weight_update() and end_weight_update()" in body["message"], body
    assert d.generate(PROMPT) == COLD_TOKENS


def test_attach_registers_each_rank_with_what_sglang_loaded(fleet, engines):
    w = {x.worker_id: x for x in fleet["control"].status().workers}[SGLANG]
    assert w.connected and w.resident_id == f"disk:{MODEL}", w
    assert (w.engine["api"], w.engine["system_url"]) == ("sglang", engines["sglang"].url), w.engine
    d = {x.worker_id: x for x in fleet["control"].status().workers}[DYNAMO]
    assert d.connected and d.resident_id == f"disk:{DYNAMO_MODEL}", d
    dyn = engines["dynamo"]
    assert (d.engine["api"], d.engine["system_url"]) == ("dynamo_sglang", dyn.system_url), d
    assert d.engine["frontend"] == {
        "url": dyn.frontend_url,
        "model": dyn.served_model,
        "instance_id": dyn.instance_id,
    }, d.engine
    # attach changed nothing SGLang serves.
    assert engines["sglang"].generate(PROMPT) == COLD_TOKENS
    assert engines["sglang"].model_info()["weight_version"] == "default"
    assert dyn.generate(PROMPT) == COLD_TOKENS


def test_refits_commit_on_both_kinds_and_match_sglang_s_own_disk_load(fleet, engines):
    sglang = engines["sglang"]
    before = _checksums(sglang)
    cold = _publish(fleet, "cold", 1.0)
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    _serving(fleet, engines, cold, COLD_TOKENS)
    # The checkpoint's bytes through mx's loader: SGLang's weights as they were.
    assert _checksums(sglang) == before
    for w in (SGLANG, DYNAMO):
        read = [c for c in r.workers[w].calls if c.action == "read_version"]
        assert read and read[-1].version == cold and "the ranks hold" in read[-1].message, read
    hot = _publish(fleet, "hot", HOT_SCALE)
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    hot_tokens = sglang.generate(PROMPT)
    assert hot_tokens != COLD_TOKENS
    after_mx = _checksums(sglang)
    assert after_mx != before
    fleet["hot"], fleet["hot_tokens"] = hot, hot_tokens
    # The same engine both ways it is deployed: the same tokens.
    _serving(fleet, engines, hot, hot_tokens)
    # SGLang's own disk loader on the same version's checkpoint: the same weights, byte for byte
    # in its checksums, and the same tokens.
    d = fleet["work"] / "hot-checkpoint"
    d.mkdir()
    (d / "config.json").write_text((MODEL / "config.json").read_text())
    save_file(_scaled(fleet, HOT_SCALE), str(d / "model.safetensors"))
    status, body = sglang.call(
        "POST", "/update_weights_from_disk", {"model_path": str(d), "weight_version": "disk-hot"}
    )
    assert status == 200 and body["success"], body
    assert _checksums(sglang) == after_mx
    assert sglang.generate(PROMPT) == hot_tokens
    # Back to mx's versions: the retained host copy of `cold`, no pull.
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert _checksums(sglang) == before
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    _serving(fleet, engines, hot, hot_tokens)


@pytest.mark.parametrize("failing", [SGLANG, DYNAMO])
def test_an_install_failing_midway_rolls_back_both(fleet, engines, failing):
    """mx's loader in one engine fails after 20 tensors went into SGLang's ``load_weights``: it
    restores the previous version and reports it; SGLang answers success; the rank's report
    fails the read-back and the refit rolls back on both engines."""
    hot = fleet["hot"]
    engine = engines["sglang" if failing == SGLANG else "dynamo"]
    _publish(fleet, "cold", 1.0)
    engine.failpoint.write_text("install_after:20")
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "ROLLED_BACK", r
    assert not engine.failpoint.exists(), "the failpoint fired"
    assert "install_after:20" in r.reason and failing in r.reason, r.reason
    assert f"restored {hot}" in r.reason, r.reason
    # The rollback reinstalled `hot` on both.
    _serving(fleet, engines, hot, fleet["hot_tokens"])


def test_the_failed_version_installs_on_the_next_try(fleet, engines):
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    cold = _resident(fleet, SGLANG)
    _serving(fleet, engines, cold, COLD_TOKENS)
    fleet["cold"] = cold


def test_in_place_pause_with_a_failing_update_is_reinstalled_not_trusted(fleet, engines):
    sglang, cold = engines["sglang"], fleet["cold"]
    _publish(fleet, "warm", 1.25)
    sglang.failpoint.write_text("install_after:40")
    r = _refit(fleet, "warm", workers=(SGLANG,), pause_mode="in_place")
    assert str(r.outcome) == "ROLLED_BACK", r.reason
    calls = r.workers[SGLANG].calls
    assert [c.action for c in calls if c.phase == "PREPARE"][:1] == ["pause"], calls
    # The rollback paused it again and installed `cold` through mx's loader before it resumed.
    back = [c for c in calls if c.phase == "ROLLBACK"]
    assert [c.action for c in back] == ["pause", "apply", "read_version", "resume"], back
    assert all(c.ok for c in back) and back[2].version == cold, back
    _serving(fleet, engines, cold, COLD_TOKENS)


def test_dynamo_sglang_refuses_an_in_place_pause(fleet, engines):
    """Its update flushes the cache, which SGLang asserts on while ``in_place`` holds requests:
    mx refuses the mode before pausing anything; both engines stay on ``cold``."""
    cold = fleet["cold"]
    r = _refit(fleet, "warm", pause_mode="in_place")
    assert str(r.outcome) != "COMMITTED", r
    assert "in_place" in r.reason and DYNAMO in r.reason, r.reason
    _serving(fleet, engines, cold, COLD_TOKENS)


def test_sglang_killed_during_install_nothing_commits(fleet, engines):
    """Last: SGLang's own server's process group is SIGKILLed by mx's loader during the install;
    the refit ends without committing, and the Dynamo SGLang worker ends on the previous
    version, serving it, unpaused."""
    sglang, cold = engines["sglang"], fleet["cold"]
    sglang.failpoint.write_text("die_after:12")
    r = _refit(fleet, "warm")
    assert str(r.outcome) in ("ROLLED_BACK", "FENCED"), r
    assert SGLANG in r.reason, r.reason
    assert sglang.proc.wait(30) == -9, sglang.tail()
    assert not sglang.pids(), "the killed server left processes behind"
    assert _resident(fleet, DYNAMO) == cold
    assert engines["dynamo"].generate(PROMPT) == COLD_TOKENS
    w = {x.worker_id: x for x in fleet["control"].status().workers}[SGLANG]
    assert not w.connected, w
