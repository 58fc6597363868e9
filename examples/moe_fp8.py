"""FP8 on the way: a bf16 trainer publishes bf16, an engine serving 128x128 block FP8 gets e4m3
weights and f32 block scales for exactly its rank's slice (``mx.fp8``, quantized on the inference
side from the rank's pulled bytes; why there: mx-layout's ``fp8`` module).

``fp8_report(work)``: a random Qwen3-MoE with FP8-sized dimensions (hidden 256, 4 heads of 128 in
2 query groups, 8 experts of intermediate 256, 2 layers, bf16) published by two ``fsdp:2`` slots,
pulled over NIXL by one worker holding both ranks of vLLM's ``tp:2`` layout, quantized per rank
with ``mx.fp8.quantize_rank``, and compared byte for byte with the reference: vLLM 0.32.0's own
``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``; its Python run eagerly) applied to each
whole checkpoint tensor, then sliced as vLLM's loaders slice a DeepSeek-V3-style FP8 checkpoint
(weights by the rank's boxes, ``weight_scale_inv`` by the boxes' block grids). Then the engine
path: a real vLLM started on that FP8 checkpoint (``quant_method: fp8``, ``weight_block_size:
[128, 128]``, routers and ``lm_head`` left bf16) with mx's backend is refitted to a new bf16
version (mx quantizes the rank's pulled bytes and installs e4m3 weights and scales through
vLLM's loaders), and its greedy tokens are compared with a cold start of vLLM on the reference
FP8 checkpoint of that version. ``ran_in_vllm`` is false, with the error, where vLLM's CPU build
cannot serve block FP8 (its CPU kernels need AMX tiles).

Run alone: ``.mx/venv/bin/python examples/moe_fp8.py`` (prints the report).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from procs import publish_all

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "hidden": 256,
    "layers": 2,
    "experts": 8,
    "top_k": 2,
    "moe_intermediate": 256,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 128,
    "vocab": 1024,
}
LAYOUT = "tp:2"
PROMPT = [5, 17, 99, 300, 7]


def _vllm_block_quantizer():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    # The function under vLLM's torch.compile wrapper: its own Python, run eagerly.
    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)


def _box(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + e) for o, e in zip(offset, shape, strict=True))


def _pull_and_compare(
    model_dir: str, full: dict[str, torch.Tensor], work: str
) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Publishes ``full`` from two fsdp:2 slots, pulls tp:2, quantizes each rank, compares."""
    import mx

    model = mx.Model.from_dir(model_dir)
    vllm_q = _vllm_block_quantizer()
    reference = {n: vllm_q(t) for n, t in full.items() if t.dim() == 2 and "_proj." in n}
    pubs, puller = [], None
    mismatches: list[str] = []
    blocks = 0
    tensors: set[str] = set()
    with mx.ControlPlane(journal=os.path.join(work, "fp8-journal.jsonl")) as cp:
        control = mx.Control(cp.url)
        try:
            for slot in range(2):
                pub = mx.Publisher(cp.url, model=model, layout="fsdp:2", slot=slot)
                shards = {}
                for n, t in full.items():
                    rows = -(-t.shape[0] // 2)
                    lo, hi = min(slot * rows, t.shape[0]), min((slot + 1) * rows, t.shape[0])
                    if hi > lo:
                        shards[n] = (t[lo:hi].clone(), [lo] + [0] * (t.dim() - 1))
                pub.set_shards(shards)
                pubs.append(pub)
            puller = mx.Puller(
                cp.url, model=model, layout=LAYOUT, ranks=[0, 1], worker_id="fp8-engine"
            )
            params = {
                r: {p.name: torch.zeros(p.shape, dtype=torch.bfloat16) for p in puller.params(r)}
                for r in (0, 1)
            }
            for r, ps in params.items():
                puller.register(r, ps)
            control.declare("fp8-v1", full, trainer_layout="fsdp:2")
            vid = publish_all(pubs, "fp8-v1", 120.0)
            staged = puller.stage("fp8-v1")
            puller.apply()
            t0 = time.perf_counter()
            quantized = {r: mx.fp8.quantize_rank(model, LAYOUT, r, params[r]) for r in (0, 1)}
            quantize_s = time.perf_counter() - t0
            for r in (0, 1):
                layout = {p.name: p for p in model.rank_layout(LAYOUT, r)}
                for f8 in mx.fp8.fp8_layout(model, LAYOUT, r):
                    w = quantized[r][f8.name].view(torch.uint8).reshape(-1)
                    s = quantized[r][f8.scale_name].reshape(-1)
                    for pc, sp in zip(layout[f8.name].pieces, f8.pieces, strict=True):
                        q_ref, s_ref = reference[pc.tensor]
                        box = tuple(
                            slice(o, o + e)
                            for o, e in zip(pc.box_offset, pc.box_shape, strict=True)
                        )
                        want = q_ref[box].contiguous().view(torch.uint8).reshape(-1)
                        start = pc.offset // 2
                        grid = tuple(
                            slice(o, o + e)
                            for o, e in zip(sp.grid_offset, sp.grid_box, strict=True)
                        )
                        want_s = s_ref[grid].reshape(-1)
                        got_s = s[sp.offset // 4 : sp.offset // 4 + want_s.numel()]
                        if not torch.equal(w[start : start + want.numel()], want):
                            mismatches.append(f"rank {r} {f8.name} <- {pc.tensor}: e4m3 bytes")
                        if not torch.equal(got_s, want_s):
                            mismatches.append(f"rank {r} {f8.scale_name} <- {pc.tensor}: scales")
                        blocks += want_s.numel()
                        tensors.add(pc.tensor)
        finally:
            if puller is not None:
                puller.close()
            for p in pubs:
                p.close()
    report = {
        "layout": LAYOUT,
        "version_id": vid,
        "tensors": len(tensors),
        "blocks": blocks,
        "wire_bytes": staged.wire_bytes,
        "e4m3_bytes": sum(
            t.numel() for q in quantized.values() for t in q.values() if t.element_size() == 1
        ),
        "quantize_s": quantize_s,
        "bytes_equal_reference": bool(tensors) and not mismatches,
        "mismatches": mismatches[:10],
    }
    return report, reference


def _write_fp8_checkpoint(
    model_dir: str, full: dict, reference: dict, out: str, config: dict
) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for n, t in full.items():
        if n in reference:
            q, s = reference[n]
            tensors[n], tensors[n.replace(".weight", ".weight_scale_inv")] = q, s
        else:
            tensors[n] = t
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        # Left bf16, as in released Qwen3-MoE FP8 checkpoints: routers and the output layer.
        "modules_to_not_convert": ["lm_head"]
        + [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])],
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def _engine_path(
    model_dir: str, full: dict, reference: dict, work: str, timeout: float
) -> dict[str, Any]:
    """A real vLLM serving the FP8 checkpoint of ``full``, refitted by mx to a new bf16 version
    (``full`` after one perturbation of every matrix): its tokens against a cold start of vLLM on
    the reference FP8 checkpoint of that version."""
    from engines import VllmServer

    import mx

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    start_dir, cold_dir = os.path.join(work, "fp8-start"), os.path.join(work, "fp8-cold")
    _write_fp8_checkpoint(model_dir, full, reference, start_dir, config)
    g = torch.Generator().manual_seed(11)
    new = {
        n: (t + 0.2 * torch.randn(t.shape, generator=g).to(t.dtype)) if t.dim() > 1 else t.clone()
        for n, t in full.items()
    }
    vllm_q = _vllm_block_quantizer()
    _write_fp8_checkpoint(model_dir, new, {n: vllm_q(new[n]) for n in reference}, cold_dir, config)
    out: dict[str, Any] = {"tokens": None, "cold_tokens": None}
    server = pub = None
    with mx.ControlPlane(journal=os.path.join(work, "fp8-engine.jsonl")) as cp:
        control = mx.Control(cp.url)
        try:
            server = VllmServer(
                os.path.join(work, "fp8-vllm"), model=start_dir, startup_timeout=timeout
            )
            server.init_mx(cp.url, "fp8")
            pub = mx.Publisher(cp.url, model=mx.Model.from_dir(model_dir), layout="fsdp:1", slot=0)
            pub.set_shards({n: (t, [0] * t.dim()) for n, t in new.items()})
            control.declare("fp8-v2", new, trainer_layout="fsdp:1")
            pub.publish("fp8-v2", timeout=timeout)
            r = control.refit(
                "fp8-v2", ["fp8-tp0"], no_check=True, stage_timeout=timeout, call_timeout=timeout
            )
            out.update(outcome=str(r.outcome), refit_s=r.seconds)
            out["tokens"] = server.generate(PROMPT, 8)
        finally:
            if pub is not None:
                pub.close()
            if server is not None:
                out["log_tail"] = server.tail(600)
                server.stop()
    cold = VllmServer(os.path.join(work, "fp8-vllm"), model=cold_dir, startup_timeout=timeout)
    try:
        out["cold_tokens"] = cold.generate(PROMPT, 8)
    finally:
        cold.stop()
    out["tokens_match_cold_start"] = out["tokens"] == out["cold_tokens"]
    if out["tokens_match_cold_start"]:
        out.pop("log_tail", None)
    return out


def fp8_report(work: str, *, serve: bool = True, timeout: float = 300.0) -> dict[str, Any]:
    """The ``fp8`` section of examples/moe_refit.py's report (see the module docs): ``tensors``,
    ``blocks``, ``bytes_equal_reference``, ``ran_in_vllm`` (mx refitted a real FP8 vLLM) with
    ``engine`` (its tokens against a cold start's) or ``vllm_error``, the pull's
    ``wire_bytes``."""
    import moe_fsdp
    from safetensors.torch import load_file

    model_dir = os.path.join(work, "fp8-bf16")
    moe_fsdp.make_checkpoint(model_dir, seed=7, **{k: SIZES[k] for k in SIZES})
    full: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            full.update(load_file(os.path.join(model_dir, name)))
    report, reference = _pull_and_compare(model_dir, full, work)
    report.update(model=dict(SIZES), ran_in_vllm=False, vllm_error=None, engine=None)
    if not serve:
        report["vllm_error"] = "not tried (serve=False)"
        return report
    try:
        report["engine"] = _engine_path(model_dir, full, reference, work, timeout)
        report["ran_in_vllm"] = True
    except Exception as e:  # noqa: BLE001 - reported: vLLM's CPU FP8 kernels need AMX tiles
        report["vllm_error"] = f"{type(e).__name__}: {e}"[-1500:]
    return report


def main() -> int:
    os.makedirs(os.path.join(REPO, ".mx", "tmp"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="fp8-", dir=os.path.join(REPO, ".mx", "tmp"))
    try:
        r = fp8_report(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(r, indent=1))
    engine_ok = not r["ran_in_vllm"] or r["engine"]["tokens_match_cold_start"]
    return 0 if r["bytes_equal_reference"] and engine_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
