"""TRL 1.16's GRPO trainer syncing a real vLLM server through mx, with the smallest patch.

TRL 1.16's server mode hard-wires vLLM's NCCL trainer engine (CUDA only).
``docs/patches/trl-1.16.0-mx.patch`` lets its ``VLLMClient`` build the engine of whatever
backend the server runs (``/server_info``'s ``weight_transfer_config``) through vLLM's
``WeightTransferTrainerFactory``, from a new ``GRPOConfig.vllm_weight_transfer_init_info``;
nccl keeps its own path. This module applies the patch to a copy of the installed TRL (never
to the installed one) and runs TRL's own ``GRPOTrainer`` (``use_vllm=True,
vllm_mode="server"``) on CPU against one real vLLM server started with ``{"backend": "mx"}``
and mx's control plane, for 2 steps (``trl_grpo_driver.py``). Each of TRL's syncs publishes
the trainer's parameters in place and has the control plane refit and commit the server; after
each, the server's live weights (read through its own GEMM kernels: ``vllm_weight_probe.py``)
equal the trainer's byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engines import MODEL, VllmServer

import mx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PATCH = REPO / "docs" / "patches" / "trl-1.16.0-mx.patch"
TOKENIZER = MODEL.parent / "smollm2-135m-dynamo"
"""SmolLM2's tokenizer (the checkpoint directory has none; the server runs without one)."""
STEPS = 2


def _patched_trl(dest: Path) -> Path:
    """A copy of the installed TRL under ``dest`` with the patch applied (checked to apply
    exactly: no offset, no fuzz); returns the directory to put first on ``PYTHONPATH``."""
    import shutil

    import trl

    installed = Path(trl.__file__).parent
    assert trl.__version__ == "1.16.0", trl.__version__
    root = dest / "trl-patched"
    shutil.copytree(installed, root / "trl", ignore=shutil.ignore_patterns("__pycache__"))
    # git apply, not patch(1) (git is there wherever the repository is): exact context, and
    # -v names every hunk that only applied at an offset. The ceiling keeps git from finding a
    # repository above the copy.
    p = subprocess.run(
        ["git", "apply", "-v", str(PATCH)],
        cwd=root,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(dest)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "offset" not in out and out.count(" cleanly.") == 4, out
    return root


def test_the_patch_touches_four_files_of_trl_and_is_small():
    text = PATCH.read_text()
    files = [line.split(" b/")[1] for line in text.splitlines() if line.startswith("diff --git")]
    assert files == [
        "trl/generation/vllm_client.py",
        "trl/generation/vllm_generation.py",
        "trl/trainer/grpo_config.py",
        "trl/trainer/grpo_trainer.py",
    ]
    added = [x for x in text.splitlines() if x.startswith("+") and not x.startswith("+++")]
    removed = [x for x in text.splitlines() if x.startswith("-") and not x.startswith("---")]
    assert len(added) <= 64 and len(removed) <= 3, (len(added), len(removed))


@pytest.fixture(scope="module")
def patched_trl(tmp_path_factory) -> Path:
    return _patched_trl(tmp_path_factory.mktemp("trl"))


def test_patched_trl_keeps_nccl_s_path_and_names_an_unknown_backend(patched_trl, tmp_path):
    """A server on nccl still gets TRL's own NCCL path (its CUDA check first, on this machine),
    without building any trainer engine; a backend no package registered is named. Checked on
    the patched client with the server's answers stubbed."""
    script = r"""
import sys, torch
from trl.generation.vllm_client import VLLMClient
c = VLLMClient.__new__(VLLMClient)
c.base_url, c.group_port, c.communicator, c.trainer_engine = "http://127.0.0.1:9", 1, None, None
c.get_server_info = lambda: {"weight_transfer_config": {"backend": "nccl"}}
c.get_world_size = lambda: 1
try:
    c.init_communicator(device="cpu", model=torch.nn.Linear(2, 2), init_info={"x": 1})
except NotImplementedError as e:
    print("NCCL-PATH", "NCCL weight-transfer engine" in str(e), c.trainer_engine is None)
c.get_server_info = lambda: {"weight_transfer_config": {"backend": "bogus"}}
try:
    c.init_communicator(device="cpu", model=torch.nn.Linear(2, 2), init_info={})
except ValueError as e:
    print("UNKNOWN", str(e))
import trl
print("FROM", trl.__file__)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_trl), *sys.path])}
    p = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "NCCL-PATH True True" in p.stdout, p.stdout
    assert (
        "UNKNOWN The vLLM server at http://127.0.0.1:9 runs the weight-transfer backend 'bogus', "
        "which has no trainer engine here" in p.stdout
    ), p.stdout
    assert f"FROM {patched_trl}" in p.stdout, p.stdout


def test_trl_grpo_server_mode_syncs_a_real_vllm_through_mx(patched_trl, tmp_path):
    t0 = time.perf_counter()
    report = tmp_path / "report.json"
    work = tmp_path / "work"
    failpoint = tmp_path / "vllm.failpoint"
    with mx.ControlPlane(journal=tmp_path / "journal.jsonl") as cp:
        server = VllmServer(
            tmp_path / "vllm",
            env={
                "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
                "MX_VLLM_FAILPOINT_FILE": str(failpoint),
            },
            extra_args=["--worker-extension-cls", "vllm_weight_probe.WeightProbe"],
        )
        try:
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(patched_trl), str(HERE), *sys.path]),
                "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1",
                "HF_HOME": str(tmp_path / "hf"),
                "TOKENIZERS_PARALLELISM": "false",
            }
            args = [sys.executable, str(HERE / "trl_grpo_driver.py"), "--steps", str(STEPS)]
            args += ["--server", server.url, "--control", cp.url, "--model", str(MODEL)]
            args += ["--tokenizer", str(TOKENIZER), "--report", str(report)]
            args += ["--work", str(work), "--failpoint", str(failpoint)]
            p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:] + server.tail()
            status = mx.Control(cp.url, timeout=30.0).status()
        finally:
            server.stop()
    r = json.loads(report.read_text())
    print(
        json.dumps(
            {
                "seconds": r["seconds"],
                "train_s": r["train_s"],
                "steps_s": [s["seconds"] for s in r["steps"]],
                "syncs_s": [s["seconds"] for s in r["syncs"]],
                "probe_s": [s["probe_s"] for s in r["syncs"]],
                "refit_phase_s": [s["phase_seconds"] for s in r["syncs"]],
                "module_s": time.perf_counter() - t0,
                "trainer_peak_rss_gib": r["peak_rss_bytes"] / 2**30,
            }
        )
    )
    # The patched copy ran, with mx's engine picked by the server's backend name, no NCCL.
    assert r["trl"] == "1.16.0" and r["trl_file"].startswith(str(patched_trl)), r["trl_file"]
    assert r["engine"] == "mx.vllm.trainer.MxTrainerWeightTransferEngine"
    assert r["client_backend"]["backend"] == "mx" and r["no_nccl_communicator"]
    # Before any sync: the server serves the checkpoint the trainer loaded (the probe agrees).
    before = r["before"]
    assert before["server"] == before["trainer"]
    assert len(before["server"]) == 2 + 30 * 6, len(before["server"])
    # TRL synced before each step's generation (global steps 0, 1) and once after the last step.
    syncs, steps = r["syncs"], r["steps"]
    assert [s["global_step"] for s in syncs] == list(range(STEPS + 1))
    assert [s["global_step"] for s in steps] == list(range(1, STEPS + 1))
    vids = [s["version_id"] for s in syncs]
    assert [s["label"] for s in syncs] == [f"step-{k}" for k in range(1, STEPS + 2)]
    assert len(set(vids)) == len(vids) and all(v.startswith("mx:") for v in vids), vids
    for s in syncs:
        # Committed through mx, read back from the server, and the server's live weights are
        # the trainer's, byte for byte.
        assert s["outcome"] == "COMMITTED", s["label"]
        assert s["weight_info"] == s["version_id"], s["label"]
        diff = sorted(n for n in s["trainer"] if s["server"].get(n) != s["trainer"][n])
        assert s["server"] == s["trainer"], (s["label"], diff[:5], len(diff))
    # The weights after step k are what the sync at global step k sent, and they changed.
    assert syncs[0]["trainer"] == before["trainer"]
    for k, step in enumerate(steps, start=1):
        assert syncs[k]["trainer"] == step["trainer"], k
        changed = [n for n in step["trainer"] if step["trainer"][n] != syncs[k - 1]["trainer"][n]]
        assert len(changed) > len(step["trainer"]) // 2, (k, len(changed))
    # A failed sync (the server's install fails): TRL's sync raised mx's MxRefitError, the
    # refit rolled back, and the server serves the last committed version, unpaused.
    f, last = r["failed_sync"], syncs[-1]
    assert f["error"] and f["error"]["type"] == "MxRefitError", f["error"]
    assert f["error"]["outcome"] in ("ROLLED_BACK", "ABORTED"), f["error"]
    assert f["label"] == f"step-{STEPS + 2}" and f["version_id"] not in vids
    assert f["failpoint_consumed"] and f["is_paused"] is False
    assert f["weight_info"] == last["version_id"]
    assert f["server"] == last["server"] and f["trainer"] != last["trainer"]
    # The control plane's record: every synced version committed (the failed one not), the
    # fleet (and the server) on the last one.
    committed = {v.label: v for v in status.versions if str(v.state) == "COMMITTED"}
    assert set(committed) == {s["label"] for s in syncs}, status.versions
    for s in syncs:
        assert f"mx:{committed[s['label']].version_digest}" == s["version_id"]
    assert status.fleet_version == (syncs[-1]["label"], syncs[-1]["version_id"])
    (worker,) = status.workers
    assert worker.worker_id == "trl-vllm-tp0" and worker.resident_id == syncs[-1]["version_id"]
    # GRPO trained: 2 logged steps with a loss.
    assert [h["step"] for h in r["log_history"] if "loss" in h] == [1, 2], r["log_history"]
