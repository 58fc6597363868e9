"""TRL's own ``GRPOTrainer`` in server mode against a real vLLM server whose weight-transfer
backend is mx, run by ``test_trl.py`` in a process of its own with the patched TRL first on
``PYTHONPATH`` (``docs/patches/trl-1.16.0-mx.patch``); prints nothing the test reads, writes a
JSON report.

The only mx-specific line of the training script is ``GRPOConfig(vllm_weight_transfer_init_info=
{...})`` (the patch's setting: the fields of :class:`mx.vllm.trainer.MxTrainerInitInfo`); TRL
finds the backend's name on the server and builds mx's trainer engine through vLLM's
``WeightTransferTrainerFactory``. The rest is observation: each of TRL's weight syncs
(``VLLMGeneration.sync_weights``, wrapped) records the trainer's parameter digests, the server's
live weight digests (``vllm_weight_probe.WeightProbe`` through ``/collective_rpc``), the server's
``/weight_info`` and the version mx published and committed; a callback records the trainer's
digests after each optimizer step. TRL syncs before each step's generation (global step 0, 1,
...), so the weights after the last step are synced by one more call of TRL's own
``sync_weights`` after ``train()`` (what the next step's generation would do).

Usage: ``python trl_grpo_driver.py --server URL --control URL --model DIR --tokenizer DIR
--report PATH --work DIR --failpoint PATH [--steps 2]`` (``--failpoint``: the server's
``MX_VLLM_FAILPOINT_FILE``, armed for a last sync that must fail)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import requests
import torch
from vllm_weight_probe import hf_llama_digests

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The first president of the United States was",
    "A square has four sides and",
]


def vowels(completions: list[str], **_: Any) -> list[float]:
    """A reward that varies between completions (GRPO learns only from differences)."""
    return [float(sum(c in "aeiou" for c in text.lower())) for text in completions]


def server_digests(url: str) -> dict[str, str]:
    r = requests.post(f"{url}/collective_rpc", json={"method": "probe_weight_digests"}, timeout=600)
    r.raise_for_status()
    (rank0,) = r.json()["results"]
    return rank0


def main() -> None:
    ap = argparse.ArgumentParser()
    names = ("--server", "--control", "--model", "--tokenizer", "--report", "--work", "--failpoint")
    for a in names:
        ap.add_argument(a, required=True)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    t_start = time.perf_counter()
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = GRPOConfig(
        output_dir=args.work,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=args.server,
        vllm_server_timeout=60.0,
        # The patch's setting: mx's trainer init info (MxTrainerInitInfo's fields, but rank),
        # as a JSON string, the way `--vllm_weight_transfer_init_info '{...}'` on TRL's command
        # line hands it (GRPOConfig parses it into a dict).
        vllm_weight_transfer_init_info=json.dumps(
            {
                "control_url": args.control,
                "instance_id": "trl-vllm",
                "layout": "replicated:1",
                "model": args.model,
            }
        ),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,  # large enough to move bf16 weights in one step
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    steps: list[dict[str, Any]] = []
    step_t0 = [time.perf_counter()]

    class Record(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            step_t0[0] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append(
                {
                    "global_step": state.global_step,
                    "seconds": time.perf_counter() - step_t0[0],
                    "trainer": hf_llama_digests(model.named_parameters()),
                }
            )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowels,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    gen = trainer.vllm_generation
    client = gen.vllm_client
    engine = client.trainer_engine
    before = {
        "trainer": hf_llama_digests(model.named_parameters()),
        "server": server_digests(args.server),
        "weight_info": client._get(f"{args.server}/weight_info")["weight_version"],
    }
    syncs: list[dict[str, Any]] = []
    sync = gen.sync_weights

    def observed_sync() -> None:
        t0 = time.perf_counter()
        sync()
        seconds = time.perf_counter() - t0
        r = engine.last_refit
        t1 = time.perf_counter()
        server = server_digests(args.server)
        probe_s = time.perf_counter() - t1
        syncs.append(
            {
                "global_step": trainer.state.global_step,
                "seconds": seconds,
                "label": engine.label,
                "version_id": engine.version_id,
                "outcome": None if r is None else str(r.outcome),
                "phase_seconds": None if r is None else dict(r.phase_seconds),
                "weight_info": client._get(f"{args.server}/weight_info")["weight_version"],
                "trainer": hf_llama_digests(model.named_parameters()),
                "server": server,
                "probe_s": probe_s,
            }
        )

    gen.sync_weights = observed_sync
    t_train = time.perf_counter()
    out = trainer.train()
    train_s = time.perf_counter() - t_train
    gen.sync_weights()  # the sync the next step's generation would do: the weights after the last

    # A sync whose install fails on the server (mx's failpoint): TRL's sync raises (so would its
    # step), the server stays on the last committed version.
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # in place: a change to send
    with open(args.failpoint, "w") as f:
        f.write("install_after:12")
    error = None
    try:
        sync()
    except Exception as e:
        error = {"type": type(e).__name__, "outcome": getattr(e, "outcome", None), "str": str(e)}
    failed = {
        "error": error,
        "label": engine.label,
        "version_id": engine.version_id,
        "failpoint_consumed": not os.path.exists(args.failpoint),
        "weight_info": client._get(f"{args.server}/weight_info")["weight_version"],
        "is_paused": client._get(f"{args.server}/is_paused")["is_paused"],
        "trainer": hf_llama_digests(model.named_parameters()),
        "server": server_digests(args.server),
    }
    report = {
        "trl": trl.__version__,
        "trl_file": trl.__file__,
        "engine": type(engine).__module__ + "." + type(engine).__qualname__,
        "client_backend": client.get_server_info()["weight_transfer_config"],
        "no_nccl_communicator": client.communicator is None,
        "train_loss": out.training_loss,
        "log_history": trainer.state.log_history,
        "before": before,
        "syncs": syncs,
        "failed_sync": failed,
        "steps": steps,
        "train_s": train_s,
        "seconds": time.perf_counter() - t_start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    client.close_communicator()
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
