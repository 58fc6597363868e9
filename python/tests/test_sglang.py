"""mx refits a real SGLang 0.5.23 server (examples/engines.py's ``SglangServer``: its own
server on CPU, mx's loader allowed with ``--custom-weight-loader mx.sglang.load``) alone and in
one fleet with a vLLM server: one commit across both engine kinds, or a rollback on both.

mx as a user runs it: :func:`mx.sglang.attach` starts each rank's puller through one
weight-update session; a refit pauses (``retract``), installs in one session naming the version
to mx's loader (no weight bytes over HTTP), flushes, reads back (``/model_info`` and the rank's
own report), continues and generates. The installed weights are checked in SGLang's own terms:
its ``/weights_checker`` checksums after mx's install equal those after SGLang loads the same
version's checkpoint from disk itself, and so do its greedy tokens. Then the faults: an install
failing midway (mx's loader restores the previous version; SGLang still answers success; the
rank's report rolls the refit back on both engines), an ``in_place`` pause with a failing
update (rolled back, the SGLang worker reinstalled on the previous version, not trusted), and
last SGLang killed during an install (nothing commits; vLLM ends on the previous version,
serving it, unpaused). One engine of each kind for the module (start-up 30-75 s, in parallel).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engines import COLD_TOKENS, MODEL, PROMPT, SglangServer, VllmServer
from safetensors.torch import load_file, save_file

import mx

SGLANG = "sglang-a-tp0"
VLLM = "vllm-a-tp0"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    work = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(2) as ex:
        futures = {
            "sglang": ex.submit(SglangServer, work / "sglang"),
            "vllm": ex.submit(VllmServer, work / "vllm"),
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
    ``sglang-a`` and the vLLM server initialized as ``vllm-a``."""
    work = tmp_path_factory.mktemp("control")
    with mx.ControlPlane(journal=work / "journal.jsonl") as cp:
        control = mx.Control(cp.url, timeout=30.0)
        weights = load_file(str(MODEL / "model.safetensors"))
        pub = mx.Publisher(cp.url, model=mx.Model.from_dir(MODEL), layout="replicated:1", slot=0)
        pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
        assert engines["sglang"].init_mx(cp.url, "sglang-a") == [SGLANG]
        engines["vllm"].init_mx(cp.url, "vllm-a")
        deadline = time.monotonic() + 30
        while not all(
            any(w.worker_id == x and w.connected for w in control.status().workers)
            for x in (SGLANG, VLLM)
        ):
            assert time.monotonic() < deadline, control.status()
            time.sleep(0.2)
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


def _refit(fleet, label: str, expected=None, workers=(SGLANG, VLLM), pause_mode="keep"):
    check = mx.GenerationCheck(PROMPT, len(COLD_TOKENS), expected or [])
    return fleet["control"].refit(
        label,
        list(workers),
        pause_mode=pause_mode,
        check=check,
        stage_timeout=120,
        call_timeout=120,
    )


def _serving(engines, version: str, tokens: list[int], vllm_tokens: list[int] | None = None):
    """Both engines hold ``version``, generate ``tokens`` (vLLM: ``vllm_tokens`` when given:
    on weights far from the checkpoint the two engines' kernels may round a greedy choice
    apart) and are not paused."""
    s, v = engines["sglang"], engines["vllm"]
    assert s.model_info()["weight_version"] == version
    assert s.generate(PROMPT) == tokens
    assert v.call("GET", "/weight_info") == (200, {"weight_version": version})
    assert v.call("GET", "/is_paused") == (200, {"is_paused": False})
    assert v.generate(PROMPT) == (tokens if vllm_tokens is None else vllm_tokens)


def _checksums(sglang) -> dict[str, str]:
    status, body = sglang.call("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200 and body["success"], body
    [rank] = body["ranks"]
    return rank["checksums"]


def test_attach_registers_each_rank_with_what_sglang_loaded(fleet, engines):
    w = {x.worker_id: x for x in fleet["control"].status().workers}[SGLANG]
    assert w.connected and w.resident_id == f"disk:{MODEL}", w
    assert (w.engine["api"], w.engine["system_url"]) == ("sglang", engines["sglang"].url), w.engine
    # attach's session changed nothing SGLang serves.
    assert engines["sglang"].generate(PROMPT) == COLD_TOKENS
    assert engines["sglang"].model_info()["weight_version"] == "default"


def test_refits_commit_on_both_kinds_and_match_sglang_s_own_disk_load(fleet, engines):
    sglang = engines["sglang"]
    before = _checksums(sglang)
    cold = _publish(fleet, "cold", 1.0)
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    _serving(engines, cold, COLD_TOKENS)
    # The checkpoint's bytes through mx's loader: SGLang's weights as they were.
    assert _checksums(sglang) == before
    read = [c for c in r.workers[SGLANG].calls if c.action == "read_version"]
    assert read and read[-1].version == cold and "the ranks hold" in read[-1].message, read
    hot = _publish(fleet, "hot", 1.5)
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    hot_tokens = sglang.generate(PROMPT)
    assert hot_tokens != COLD_TOKENS
    after_mx = _checksums(sglang)
    assert after_mx != before
    vllm_hot = engines["vllm"].generate(PROMPT)
    assert vllm_hot != COLD_TOKENS
    fleet["hot"], fleet["hot_tokens"], fleet["vllm_hot"] = hot, hot_tokens, vllm_hot
    _serving(engines, hot, hot_tokens, vllm_hot)
    # SGLang's own disk loader on the same version's checkpoint: the same weights, byte for byte
    # in its checksums, and the same tokens.
    d = fleet["work"] / "hot-checkpoint"
    d.mkdir()
    (d / "config.json").write_text((MODEL / "config.json").read_text())
    save_file(_scaled(fleet, 1.5), str(d / "model.safetensors"))
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
    _serving(engines, hot, hot_tokens, vllm_hot)


def test_an_install_failing_midway_rolls_back_both(fleet, engines):
    """mx's loader fails after 20 tensors went into SGLang's ``load_weights``: it restores the
    previous version and reports it; SGLang answers success and records the new version; the
    rank's report fails the read-back and the refit rolls back on both engines."""
    sglang, hot = engines["sglang"], fleet["hot"]
    cold = _publish(fleet, "cold", 1.0)
    sglang.failpoint.write_text("install_after:20")
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "ROLLED_BACK", r
    assert not sglang.failpoint.exists(), "the failpoint fired"
    assert "install_after:20" in r.reason and SGLANG in r.reason, r.reason
    assert f"restored {hot}" in r.reason, r.reason
    # SGLang recorded the version the failed update named; the rollback reinstalled `hot`.
    _serving(engines, hot, fleet["hot_tokens"], fleet["vllm_hot"])
    w = {x.worker_id: x for x in fleet["control"].status().workers}[SGLANG]
    assert w.connected and w.resident_id == hot, w
    # The version that failed installs on the next try.
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    _serving(engines, cold, COLD_TOKENS)
    fleet["cold"] = cold


def test_in_place_pause_with_a_failing_update_is_reinstalled_not_trusted(fleet, engines):
    sglang, cold = engines["sglang"], fleet["cold"]
    _publish(fleet, "warm", 1.25)
    sglang.failpoint.write_text("install_after:40")
    r = _refit(fleet, "warm", pause_mode="in_place")
    assert str(r.outcome) == "ROLLED_BACK", r.reason
    calls = r.workers[SGLANG].calls
    assert [c.action for c in calls if c.phase == "PREPARE"][:1] == ["pause"], calls
    # The rollback paused it again and installed `cold` through mx's loader before it resumed.
    back = [c for c in calls if c.phase == "ROLLBACK"]
    assert [c.action for c in back] == ["pause", "apply", "read_version", "resume"], back
    assert all(c.ok for c in back) and back[2].version == cold, back
    _serving(engines, cold, COLD_TOKENS)


def test_sglang_killed_during_install_nothing_commits(fleet, engines):
    """Last: SGLang's process group is SIGKILLed by mx's loader during the install; the refit
    ends without committing, and the vLLM server ends on the previous version, unpaused."""
    sglang, cold = engines["sglang"], fleet["cold"]
    sglang.failpoint.write_text("die_after:12")
    r = _refit(fleet, "warm")
    assert str(r.outcome) in ("ROLLED_BACK", "FENCED"), r
    assert SGLANG in r.reason, r.reason
    assert sglang.proc.wait(30) == -9, sglang.tail()
    assert not sglang.pids(), "the killed server left processes behind"
    v = engines["vllm"]
    assert v.call("GET", "/weight_info") == (200, {"weight_version": cold})
    assert v.call("GET", "/is_paused") == (200, {"is_paused": False})
    assert v.generate(PROMPT) == COLD_TOKENS
    w = {x.worker_id: x for x in fleet["control"].status().workers}[SGLANG]
    assert not w.connected, w
