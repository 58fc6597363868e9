"""Byte-exact digests of the weights a live vLLM server computes with, and of a Hugging Face
Llama's parameters under vLLM's names, for the TRL test (``test_trl.py``).

vLLM on CPU repacks every Linear weight for its GEMM kernels after loading and leaves the
parameter empty, so the live weights cannot be read as tensors. :class:`WeightProbe` (a vLLM
worker extension: ``--worker-extension-cls vllm_weight_probe.WeightProbe``, called through
``POST /collective_rpc {"method": "probe_weight_digests"}``) reads them through the kernels
themselves: a Linear layer applied to the identity matrix returns its weight, transposed,
exactly (each output is one bf16 product with 1.0 summed with exact zeros in a wider
accumulator; only the sign of a zero weight is lost, so both sides digest ``w + 0.0``). Every
other parameter (embeddings, norms) keeps its memory and is digested as it is.

:func:`hf_llama_digests` digests a Hugging Face Llama's parameters the same way, fusing
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` as vLLM does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def digest(t: torch.Tensor) -> str:
    """SHA-256 of ``t``'s bytes (contiguous, row-major)."""
    t = t.detach().contiguous()
    return hashlib.sha256(t.view(torch.uint8).reshape(-1).numpy()).hexdigest()


def _unsigned_zero(t: torch.Tensor) -> torch.Tensor:
    return t.detach() + 0.0


def hf_llama_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Digests of a Hugging Face Llama's parameters under vLLM's names (fused projections;
    every 2-D ``*_proj`` weight with its zeros unsigned, as :class:`WeightProbe` reads them)."""
    params = {n: p for n, p in named}
    out: dict[str, str] = {}
    fused_parts = {}
    for fused, parts in FUSED.items():
        for i, part in enumerate(parts):
            fused_parts[part] = (fused, i)
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, p in params.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in fused_parts and leaf == "weight":
            fused, i = fused_parts[proj]
            groups.setdefault(f"{parent}.{fused}.{leaf}", []).append((i, p))
        elif proj.endswith("_proj") and leaf == "weight":
            out[name] = digest(_unsigned_zero(p))
        else:
            out[name] = digest(p)
    for name, parts in groups.items():
        whole = torch.cat([p.detach() for _, p in sorted(parts, key=lambda x: x[0])], dim=0)
        out[name] = digest(_unsigned_zero(whole))
    return out


class WeightProbe:
    """vLLM worker extension: :meth:`probe_weight_digests` of the worker's live model."""

    def probe_weight_digests(self) -> dict[str, str]:
        """``{vLLM parameter name: digest}``: Linear weights read through their own kernel
        (the identity in, the weight transposed out), every other parameter as it is."""
        from vllm.model_executor.layers.linear import LinearBase

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out: dict[str, str] = {}
        probed = set()
        with torch.inference_mode():
            for mname, module in model.named_modules():
                if not isinstance(module, LinearBase):
                    continue
                k = module.input_size
                eye = torch.eye(k, dtype=module.params_dtype)
                y = module(eye)
                y = y[0] if isinstance(y, tuple) else y
                out[f"{mname}.weight"] = digest(_unsigned_zero(y.t()))
                probed.add(f"{mname}.weight")
            for name, p in model.named_parameters():
                if name not in probed:
                    out[name] = digest(p)
        return out
