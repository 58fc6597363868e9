"""Faults with real vLLM servers: one of two servers dies (SIGKILL) in the middle of APPLY.

The other one ends on the version it had and serves it; the dead one is taken out of the refit
(departed) and, once restarted and initialized again, registers with the checkpoint it loaded
and serves the cold tokens.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engines import COLD_TOKENS, MODEL, PROMPT, VllmServer
from safetensors.torch import load_file

import mx


def _start(tmp_path, name: str) -> VllmServer:
    fp = tmp_path / f"{name}.failpoint"
    s = VllmServer(tmp_path / name, env={"MX_VLLM_FAILPOINT_FILE": str(fp)})
    s.failpoint = fp
    return s


@pytest.fixture
def fleet(tmp_path):
    with mx.ControlPlane(journal=tmp_path / "journal.jsonl") as cp:
        servers = {}
        try:
            # Both servers start at once: a start is ~16 s of one core, two take ~17 s on two.
            with ThreadPoolExecutor(2) as ex:
                futures = {n: ex.submit(_start, tmp_path, n) for n in ("vllm-a", "vllm-b")}
            # Every server that started is stopped below, also when the other one failed.
            servers.update({n: f.result() for n, f in futures.items() if not f.exception()})
            for f in futures.values():
                f.result()
            for name, s in servers.items():
                s.init_mx(cp.url, name)
            weights = load_file(str(MODEL / "model.safetensors"))
            pub = mx.Publisher(
                cp.url, model=mx.Model.from_dir(MODEL), layout="replicated:1", slot=0
            )
            pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
            yield cp, servers, pub, weights, tmp_path
            pub.close()
        finally:
            for s in servers.values():
                s.stop()


def _workers(control: mx.Control) -> dict:
    return {w.worker_id: w for w in control.status().workers}


def test_server_killed_during_apply(fleet):
    cp, servers, pub, weights, tmp_path = fleet
    control = mx.Control(cp.url, timeout=30.0)
    control.declare("hot", weights, trainer_layout="replicated:1")
    with torch.no_grad():
        for t in weights.values():
            t.mul_(1.5)
    pub.publish("hot", copy=True, timeout=60)
    a, b = servers["vllm-a"], servers["vllm-b"]
    a.failpoint.write_text("die_after:12")
    # The process that replaces vllm-a boots beside the refit (~16 s of one core); it is
    # nothing to the control plane until it is initialized as vllm-a, after vllm-a died (below).
    spare = ThreadPoolExecutor(1)
    restarted = spare.submit(VllmServer, tmp_path / "vllm-a-restarted")
    spare.shutdown(wait=False)
    try:
        r = control.refit(
            "hot",
            ["vllm-a-tp0", "vllm-b-tp0"],
            pause_mode="keep",
            check=mx.GenerationCheck(PROMPT, len(COLD_TOKENS), []),
            stage_timeout=120,
            call_timeout=60,
        )
        assert a.proc.wait(30) == -9, a.tail()
        assert not a.pids(), "the killed server left processes behind"
        assert str(r.outcome) in ("ROLLED_BACK", "FENCED"), r
        assert "vllm-a-tp0" in r.reason, r.reason
        # The survivor is back on the checkpoint it had, serving it.
        w = _workers(control)
        assert w["vllm-b-tp0"].resident_id == f"disk:{MODEL}", w["vllm-b-tp0"]
        assert b.generate(PROMPT) == COLD_TOKENS
        assert b.call("GET", "/is_paused") == (200, {"is_paused": False})
        # The dead one restarts (a supervisor would) and registers with what it loaded.
        a2 = restarted.result()
        a2.init_mx(cp.url, "vllm-a")
        deadline = time.monotonic() + 30
        while True:
            wa = _workers(control)["vllm-a-tp0"]
            if wa.connected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert wa.connected and wa.resident_id == f"disk:{MODEL}", wa
        assert a2.generate(PROMPT) == COLD_TOKENS
    finally:
        if restarted.exception() is None:
            restarted.result().stop()
