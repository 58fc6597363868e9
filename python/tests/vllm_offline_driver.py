"""Drives vLLM's offline ``LLM`` through its weight-transfer contract with the ``mx`` backend,
the way vLLM's own weight-transfer tests drive a backend (``weight_transfer_config``, then
``init -> start -> update -> finish`` through ``LLM``'s RL methods), and prints what it observed
as one JSON object on the last line of stdout: each step's error message (``None`` when it
succeeded), the weight versions vLLM reported and the greedy tokens it generated after each
step. ``test_vllm_contract.py`` runs it in a process of its own (vLLM's engine runs in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and asserts on the result.

Usage: ``python vllm_offline_driver.py MODEL_DIR`` (the whole contract; it also writes the
version its prepared install exchanges in, the checkpoint x1.5, as a model directory under
``$MX_DRIVER_WORK/scaled``), then ``python vllm_offline_driver.py --cold MODEL_DIR`` (a cold
start of that directory: what the same generation observes, per layer, on a fresh ``LLM``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PROMPT = [504, 3575, 282, 4649, 314]


def start(model: str) -> Any:
    """vLLM's offline ``LLM`` as every run of this driver starts it."""
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        weight_transfer_config={"backend": "mx"},
    )


def main(model: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    import mx

    out: dict[str, Any] = {}
    load_general_plugins()
    out["registered"] = "mx" in WeightTransferEngineFactory._registry
    llm = start(model)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)

    def tokens() -> list[int]:
        [o] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        return list(o.outputs[0].token_ids)

    def err(fn, *args) -> str | None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the message is the observation
            return str(e)
        return None

    out["engine_class"] = llm.collective_rpc(lambda w: type(w.weight_transfer_engine).__name__)
    out["tokens_cold"] = tokens()
    out["version_cold"] = llm.get_weight_version()

    # Lifecycle calls before init.
    out["start_before_init"] = err(llm.start_weight_update)
    out["update_before_init"] = err(llm.update_weights, {"update_info": {"version_id": "x"}})
    out["finish_before_init"] = err(llm.finish_weight_update)
    # init_info validation: nothing is initialized by a refused init_info.
    out["init_empty"] = err(llm.init_weight_transfer_engine, {"init_info": {}})
    bad_url = {"control_url": "ftp://x", "instance_id": "i", "engine_url": "http://127.0.0.1:9"}
    out["init_bad_url"] = err(llm.init_weight_transfer_engine, {"init_info": bad_url})
    out["init_unknown_key"] = err(
        llm.init_weight_transfer_engine, {"init_info": {**bad_url, "colour": "red"}}
    )
    out["start_after_refused_init"] = err(llm.start_weight_update)

    with mx.ControlPlane(journal=Path(os.environ["MX_DRIVER_WORK"]) / "journal.jsonl") as cp:
        info = {"control_url": cp.url, "instance_id": "offline", "engine_url": "http://127.0.0.1:9"}
        out["init"] = err(llm.init_weight_transfer_engine, {"init_info": info})
        out["init_twice"] = err(llm.init_weight_transfer_engine, {"init_info": info})
        other = {**info, "instance_id": "other", "fill_nan": True}
        out["init_other"] = err(llm.init_weight_transfer_engine, {"init_info": other})
        resident = f"disk:{model}"

        # Session rules (vLLM's worker).
        out["update_without_start"] = err(
            llm.update_weights, {"update_info": {"version_id": resident}}
        )
        out["finish_without_start"] = err(llm.finish_weight_update)
        out["start"] = err(llm.start_weight_update)
        out["start_twice"] = err(llm.start_weight_update)
        out["finish_empty_session"] = err(llm.finish_weight_update)

        # Updates refused before the install begins: each ends vLLM's session, and vLLM keeps
        # serving the previous version (issue 29: the model was left on the meta device).
        early = {
            "no_version_id": {},
            "unknown_key": {"version_id": resident, "colour": "red"},
            "malformed_id": {"version_id": "mx:not-hex"},
            "never_staged": {"version_id": "mx:" + "ab" * 32},
        }
        out["early"] = {}
        for name, update_info in early.items():
            started = err(llm.start_weight_update)
            refused = err(llm.update_weights, {"update_info": update_info})
            out["early"][name] = {
                "start": started,
                "update": refused,
                "tokens": tokens(),
                "finish_after": err(llm.finish_weight_update),
            }

        # The full flow, version bookkeeping through finish_weight_update.
        out["flow_start"] = err(llm.start_weight_update)
        out["flow_update"] = err(llm.update_weights, {"update_info": {"version_id": resident}})
        out["flow_version_before_finish"] = llm.get_weight_version()
        out["flow_finish"] = err(llm.finish_weight_update, "step-42")
        out["flow_version"] = llm.get_weight_version()
        out["flow_tokens"] = tokens()
        llm.update_weight_version("manual-version")
        out["manual_version"] = llm.get_weight_version()
        out["last_install"] = llm.collective_rpc(
            lambda w: w.weight_transfer_engine.last_install.get("kind")
        )

        # Shutdown, then init again.
        out["shutdown"] = err(llm.shutdown_weight_transfer_engine)
        out["start_after_shutdown"] = err(llm.start_weight_update)
        out["reinit"] = err(llm.init_weight_transfer_engine, {"init_info": info})
        out["reinit_flow"] = [
            err(llm.start_weight_update),
            err(llm.update_weights, {"update_info": {"version_id": resident}}),
            err(llm.finish_weight_update, "step-43"),
        ]
        out["reinit_version"] = llm.get_weight_version()
        out["reinit_tokens"] = tokens()
        out["shutdown_end"] = err(llm.shutdown_weight_transfer_engine)
        # Following another control plane after a shutdown: the version served is not one its
        # journal knows, so the worker registers there with none (a resident version it never
        # declared would halt it).
        with mx.ControlPlane(journal=Path(os.environ["MX_DRIVER_WORK"]) / "j2.jsonl") as cp2:
            moved = {**info, "control_url": cp2.url}
            out["init_other_control_plane"] = err(
                llm.init_weight_transfer_engine, {"init_info": moved}
            )
            status = mx.Control(cp2.url).status()
            w = status.worker("offline-tp0")
            out["other_control_plane"] = {
                "halted": status.halted,
                "resident": None if w is None else w.resident_id,
                "connected": None if w is None else w.connected,
            }
            out["shutdown_other"] = err(llm.shutdown_weight_transfer_engine)
    out["prepared"] = prepared_check(llm, model)
    return out


class Observer:
    """What one greedy generation of ``PROMPT`` shows: its tokens, the top-2 log-probabilities
    of every position, and a digest of every decoder layer's and the final norm's output,
    chained over the generation's forward passes (the prefill and each decode step)."""

    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        self.digests: dict[str, Any] = {}
        self.hooked = llm.apply_model(self._hook_all)[0]

    def _hook_all(self, m: Any) -> int:
        import hashlib

        import torch

        def hook(name: str):
            def f(_module: Any, _args: Any, output: Any) -> None:
                h = self.digests.setdefault(name, hashlib.blake2b(digest_size=16))
                for t in output if isinstance(output, tuple) else (output,):
                    if isinstance(t, torch.Tensor):
                        h.update(t.detach().float().contiguous().numpy().tobytes())

            return f

        n = 0
        for name, module in m.named_modules():
            if name.startswith("model.layers.") and name.count(".") == 2 or name == "model.norm":
                module.register_forward_hook(hook(name))
                n += 1
        return n

    def observe(self) -> list[Any]:
        self.digests.clear()
        [o] = self.llm.generate([{"prompt_token_ids": PROMPT}], self.params, use_tqdm=False)
        c = o.outputs[0]
        top = [sorted((k, v.logprob) for k, v in p.items()) for p in c.logprobs]
        layers = {k: h.hexdigest() for k, h in sorted(self.digests.items())}
        return [list(c.token_ids), top, layers]


def write_scaled(model: str, scaled: dict[str, Any]) -> Path:
    """``model``'s directory with ``scaled`` as its checkpoint, under ``$MX_DRIVER_WORK``."""
    import shutil

    from safetensors.torch import save_file

    out = Path(os.environ["MX_DRIVER_WORK"]) / "scaled"
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    save_file({n: t.contiguous() for n, t in scaled.items()}, str(out / "model.safetensors"))
    return out


def cold(model: str) -> dict[str, Any]:
    """A cold start of ``model``: what :class:`Observer` sees on a fresh ``LLM``."""
    obs = Observer(start(model))
    return {"hooked_modules": obs.hooked, "cold": obs.observe()}


def prepared_check(llm: Any, model: str) -> dict[str, Any]:
    """Issue 33's prepared install (``mx.vllm._prepared``): shadows of the model loaded with
    the checkpoint x1.5 and processed while nothing is paused, exchanged in, exchanged back,
    then compared with vLLM's own layerwise reload of the same weights (what :class:`Observer`
    sees, exactly; the test compares it with a cold start of the same weights too); an
    exchange failing halfway changes nothing served."""
    import torch
    from safetensors.torch import load_file

    from mx.vllm import _layout
    from mx.vllm._engine import _refresh_tied_heads
    from mx.vllm._prepared import Prepared

    weights = load_file(os.path.join(model, "model.safetensors"))
    scaled = {n: (t * 1.5).to(t.dtype) for n, t in weights.items()}
    write_scaled(model, scaled)
    mc = llm.llm_engine.model_config
    box: dict[str, Prepared] = {}

    def build(m: Any) -> int:
        # One window per decoder layer (and one of the rest), as the backend reads staging:
        # each layer processed as soon as it is loaded.
        windows = [[(n, scaled[n]) for n in g] for g in _layout.layer_groups(list(scaled))]
        box["p"] = Prepared.build(m, mc, torch.device("cpu"), windows)
        return len(box["p"]._pairs)

    def reload(m: Any) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(m)
        with torch.no_grad():
            m.load_weights(iter(scaled.items()))
        finalize_layerwise_reload(m, mc)
        _refresh_tied_heads(m)

    obs = Observer(llm)
    observed = obs.observe
    out: dict[str, Any] = {"hooked_modules": obs.hooked}
    out["before"] = observed()
    out["modules_exchanged"] = llm.apply_model(build)[0]
    out["while_prepared"] = observed()
    half = out["modules_exchanged"] // 2

    def fail_halfway(m: Any) -> str:
        try:
            box["p"].exchange(failpoint=("install_after", half))
        except RuntimeError as e:
            return str(e)
        return "no error"

    out["failed_halfway"] = llm.apply_model(fail_halfway)[0]
    out["after_failed_exchange"] = observed()
    llm.apply_model(lambda m: box["p"].exchange())
    out["exchanged"] = observed()
    llm.apply_model(lambda m: box["p"].exchange())
    out["exchanged_back"] = observed()

    def plan_in_place(m: Any) -> dict[str, Any]:
        try:
            return {"tensor_pairs": box["p"].plan_in_place()}
        except ValueError as e:
            return {"refused": str(e)}

    # The GPU path (bytes exchanged, addresses kept) where this vLLM's processed form allows it.
    out["in_place"] = llm.apply_model(plan_in_place)[0]
    if "tensor_pairs" in out["in_place"]:
        llm.apply_model(lambda m: box["p"].exchange(in_place=True))
        out["in_place"]["exchanged"] = observed()
        llm.apply_model(lambda m: box["p"].exchange(in_place=True))
        out["in_place"]["exchanged_back"] = observed()
    llm.apply_model(reload)
    out["layerwise_reload"] = observed()
    return out


if __name__ == "__main__":
    result = cold(sys.argv[2]) if sys.argv[1] == "--cold" else main(sys.argv[1])
    sys.stdout.flush()
    print(json.dumps(result))
