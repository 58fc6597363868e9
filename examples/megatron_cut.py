"""Cut full HF-named tensors into what each Megatron-Core rank holds, and back: the reference of
the examples for a Megatron-Core trainer's layout (transformer-engine layer spec, SequentialMLP
experts), with tensor (TP), pipeline (PP) and expert (EP) parallelism.

``cut(full, config, tp, pp, ep)`` returns one dict per source slot, slot
``s = (pp_rank * ep + ep_rank) * tp + tp_rank`` (Megatron-Core's rank order tp-cp-ep-dp-pp,
with context parallel 1 and data parallel = ep, so the EP ranks of a stage are its data parallel
ranks), mapping Megatron-Core parameter names to new contiguous tensors (copies, never views):
exactly what that rank holds. ``uncut(ranks, config, tp, pp, ep)`` is its inverse. Both are
torch only. Families: llama-style dense, Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral (config
``model_type`` "mixtral": its HF names). Every size comes from the config (``head_dim``, or
hidden / heads; the expert count from ``num_experts`` or ``num_local_experts``); which optional
tensors a layer has (biases, q/k norms, MoE or dense, shared expert) from the tensors' names.

The rules (r: the TP rank, s: the EP rank, p: the PP stage; "r-rows of X": rows
[r*R/tp, (r+1)*R/tp) of X, R = X.shape[0]; "r-columns" likewise along dim 1):

- Layers: L = ``num_hidden_layers``; L % pp != 0 is refused. Stage p holds global layers
  [p*L/pp, (p+1)*L/pp), named with their LOCAL index i = g - p*L/pp: ``decoder.layers.{i}.``.
- Stage 0 only: ``embedding.word_embeddings.weight`` = ``model.embed_tokens.weight``,
  vocab-parallel with Megatron's padding: Vp = ceil(V / (128*tp)) * (128*tp); TP rank r holds
  padded rows [r*Vp/tp, (r+1)*Vp/tp); rows >= V are zeros.
- Last stage only: ``decoder.final_layernorm.weight`` = ``model.norm.weight`` (whole);
  ``output_layer.weight`` = ``lm_head.weight``, vocab-parallel as the embedding. Tied
  embeddings (``tie_word_embeddings``) are refused for now.
- Per layer, on every TP and EP rank of its stage:

  - ``self_attention.linear_qkv.layer_norm_weight`` = ``input_layernorm.weight`` (whole).
  - ``self_attention.linear_qkv.weight`` (and ``.bias`` when ``q_proj.bias`` exists): query
    groups G = ``num_key_value_heads``, qpg = ``num_attention_heads`` / G query heads per group,
    head dim d; G % tp != 0 is refused. TP rank r holds groups [r*G/tp, (r+1)*G/tp); for each,
    in order: that group's q rows (``q_proj`` rows [g*qpg*d, (g+1)*qpg*d)), then ``k_proj``
    rows [g*d, (g+1)*d), then ``v_proj`` rows [g*d, (g+1)*d); concatenated along dim 0.
  - ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` = ``self_attn.q_norm`` /
    ``k_norm`` (whole), when present (Qwen3).
  - ``self_attention.linear_proj.weight`` = r-columns of ``o_proj``.
  - Dense MLP layer (``mlp.gate_proj``): ``mlp.linear_fc1.layer_norm_weight`` =
    ``post_attention_layernorm.weight``; ``mlp.linear_fc1.weight`` = cat(r-rows of
    ``gate_proj``, r-rows of ``up_proj``) (NOT rows r of the fused [gate; up]);
    ``mlp.linear_fc2.weight`` = r-columns of ``down_proj``.
  - MoE layer: ``pre_mlp_layernorm.weight`` = ``post_attention_layernorm.weight``;
    ``mlp.router.weight`` = the router (``mlp.gate.weight``; Mixtral
    ``block_sparse_moe.gate.weight``), whole. E experts, E % ep != 0 is refused, n = E/ep: EP
    rank s holds global experts e = s*n + k as local k in [0, n), each cut by TP (expert tensor
    parallel = tp, Megatron's default): ``mlp.experts.local_experts.{k}.linear_fc1.weight`` =
    cat(r-rows of gate, r-rows of up) of expert e, ``...linear_fc2.weight`` = r-columns of its
    down. HF experts: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen),
    ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral: gate, up, down).
  - Qwen2-MoE shared expert: ``mlp.shared_experts.linear_fc1.weight`` = cat(r-rows of
    ``shared_expert.gate_proj``, r-rows of ``shared_expert.up_proj``),
    ``mlp.shared_experts.linear_fc2.weight`` = r-columns of ``shared_expert.down_proj``,
    ``mlp.shared_experts.gate_weight`` = ``mlp.shared_expert_gate.weight`` (whole).

- Every HF tensor must be placed: one the rules do not place, one missing, or one of another
  shape than the config implies raises ValueError naming it. A size the cut does not divide
  (G, an intermediate size, E, L) raises ValueError naming it.

Both directions run from one plan (``_plan``): per slot, each Megatron tensor as the dim-0
concatenation of parts, a part being a slice of one HF tensor along dim 0 or 1, or zero rows
(vocab padding). ``uncut`` checks that replicated tensors agree across ranks and that every
element of every HF tensor is covered; it ignores the padding rows (a trained output layer's
padding rows need not be zero).

Self-check (from the repository root; a few seconds)::

    .mx/venv/bin/python examples/megatron_cut.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

VOCAB_DIVISIBLE = 128  # Megatron's make_vocab_size_divisible_by default


@dataclass(frozen=True)
class Part:
    """Rows of a Megatron tensor: ``[start, stop)`` along ``dim`` of HF tensor ``hf`` (all of it
    when ``stop`` is 0), or (``hf`` None) ``stop`` zero rows."""

    hf: str | None
    dim: int = 0
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer has (read from HF names by ``cut``, Megatron names by ``uncut``)."""

    qkv_bias: bool
    qk_norm: bool
    moe: bool  # else a dense SwiGLU MLP
    shared: bool  # a Qwen2-MoE shared expert
    shared_gate: bool


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    layers: int
    ffn: int  # dense MLP intermediate size
    moe_ffn: int  # one expert's intermediate size
    shared_ffn: int
    experts: int
    moe_prefix: str  # "mlp" (Qwen) or "block_sparse_moe" (Mixtral)


def _sizes(config: dict[str, Any]) -> Sizes:
    if config.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings: tied embeddings are not supported yet")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of {groups} kv heads")
    mixtral = config.get("model_type") == "mixtral"
    ffn = int(config.get("intermediate_size") or 0)
    return Sizes(
        vocab=int(config["vocab_size"]),
        hidden=hidden,
        heads=heads,
        groups=groups,
        head_dim=int(config.get("head_dim") or hidden // heads),  # Mixtral writes head_dim null
        layers=int(config["num_hidden_layers"]),
        ffn=ffn,
        moe_ffn=ffn if mixtral else int(config.get("moe_intermediate_size") or 0),
        shared_ffn=int(config.get("shared_expert_intermediate_size") or 0),
        # transformers 5.x writes num_local_experts for Qwen3-MoE and Mixtral, num_experts for
        # Qwen2-MoE.
        experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
        moe_prefix="block_sparse_moe" if mixtral else "mlp",
    )


def _split(what: str, size: int, by: str, parts: int, rank: int) -> tuple[int, int]:
    """Block ``rank`` of ``parts`` equal blocks of ``range(size)``."""
    if size % parts:
        raise ValueError(f"{what} {size} is not a multiple of {by} {parts}")
    n = size // parts
    return rank * n, (rank + 1) * n


def _plan(
    z: Sizes, specs: list[LayerSpec], tp: int, pp: int, ep: int
) -> tuple[dict[str, tuple[int, ...]], list[dict[str, list[Part]]]]:
    """The HF tensors' shapes and, per slot, each Megatron tensor as a list of parts."""
    if min(tp, pp, ep) < 1:
        raise ValueError(f"tp {tp}, pp {pp}, ep {ep}: each must be at least 1")
    if z.layers % pp:
        raise ValueError(f"num_hidden_layers {z.layers} is not a multiple of pp {pp}")
    if z.groups % tp:
        raise ValueError(f"num_key_value_heads {z.groups} is not a multiple of tp {tp}")
    h, d, qpg = z.hidden, z.head_dim, z.heads // z.groups
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (z.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (z.vocab, h),
    }
    per_stage = z.layers // pp
    step = VOCAB_DIVISIBLE * tp
    vp = -(-z.vocab // step) * step

    def vocab_rows(hf: str, r: int) -> list[Part]:
        a, b = r * vp // tp, (r + 1) * vp // tp
        parts = [Part(hf, 0, a, min(b, z.vocab))] if a < z.vocab else []
        if b > z.vocab:
            parts.append(Part(None, 0, 0, b - max(a, z.vocab)))
        return parts

    def swiglu(gate: str, up: str, down: str, size: int, r: int) -> tuple[list[Part], list[Part]]:
        a, b = _split(f"{gate}: rows", size, "tp", tp, r)
        shapes.update({gate: (size, h), up: (size, h), down: (h, size)})
        return [Part(gate, 0, a, b), Part(up, 0, a, b)], [Part(down, 1, a, b)]

    slots: list[dict[str, list[Part]]] = []
    for p in range(pp):
        for s in range(ep):
            for r in range(tp):
                out: dict[str, list[Part]] = {}
                if p == 0:
                    out["embedding.word_embeddings.weight"] = vocab_rows(
                        "model.embed_tokens.weight", r
                    )
                for i in range(per_stage):
                    g = p * per_stage + i
                    hf, mg = f"model.layers.{g}.", f"decoder.layers.{i}."
                    spec = specs[g]
                    att, mlp = f"{hf}self_attn.", f"{hf}{z.moe_prefix if spec.moe else 'mlp'}."
                    shapes.update(
                        {
                            f"{hf}input_layernorm.weight": (h,),
                            f"{hf}post_attention_layernorm.weight": (h,),
                            f"{att}q_proj.weight": (z.heads * d, h),
                            f"{att}k_proj.weight": (z.groups * d, h),
                            f"{att}v_proj.weight": (z.groups * d, h),
                            f"{att}o_proj.weight": (h, z.heads * d),
                        }
                    )
                    out[f"{mg}self_attention.linear_qkv.layer_norm_weight"] = [
                        Part(f"{hf}input_layernorm.weight")
                    ]
                    for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
                        parts = []
                        for grp in range(r * z.groups // tp, (r + 1) * z.groups // tp):
                            parts += [
                                Part(f"{att}q_proj.{kind}", 0, grp * qpg * d, (grp + 1) * qpg * d),
                                Part(f"{att}k_proj.{kind}", 0, grp * d, (grp + 1) * d),
                                Part(f"{att}v_proj.{kind}", 0, grp * d, (grp + 1) * d),
                            ]
                        out[f"{mg}self_attention.linear_qkv.{kind}"] = parts
                    if spec.qkv_bias:
                        shapes.update(
                            {
                                f"{att}q_proj.bias": (z.heads * d,),
                                f"{att}k_proj.bias": (z.groups * d,),
                                f"{att}v_proj.bias": (z.groups * d,),
                            }
                        )
                    if spec.qk_norm:
                        for q in ("q", "k"):
                            shapes[f"{att}{q}_norm.weight"] = (d,)
                            out[f"{mg}self_attention.{q}_layernorm.weight"] = [
                                Part(f"{att}{q}_norm.weight")
                            ]
                    a, b = _split(f"{att}o_proj: columns", z.heads * d, "tp", tp, r)
                    out[f"{mg}self_attention.linear_proj.weight"] = [
                        Part(f"{att}o_proj.weight", 1, a, b)
                    ]
                    norm = [Part(f"{hf}post_attention_layernorm.weight")]
                    if not spec.moe:
                        out[f"{mg}mlp.linear_fc1.layer_norm_weight"] = norm
                        fc1, fc2 = swiglu(
                            f"{mlp}gate_proj.weight",
                            f"{mlp}up_proj.weight",
                            f"{mlp}down_proj.weight",
                            z.ffn,
                            r,
                        )
                        out[f"{mg}mlp.linear_fc1.weight"] = fc1
                        out[f"{mg}mlp.linear_fc2.weight"] = fc2
                        continue
                    out[f"{mg}pre_mlp_layernorm.weight"] = norm
                    shapes[f"{mlp}gate.weight"] = (z.experts, h)
                    out[f"{mg}mlp.router.weight"] = [Part(f"{mlp}gate.weight")]
                    e0, e1 = _split("num_experts", z.experts, "ep", ep, s)
                    for k, e in enumerate(range(e0, e1)):
                        x = f"{mlp}experts.{e}."
                        if z.moe_prefix == "block_sparse_moe":
                            names = (f"{x}w1.weight", f"{x}w3.weight", f"{x}w2.weight")
                        else:
                            names = tuple(f"{x}{n}_proj.weight" for n in ("gate", "up", "down"))
                        fc1, fc2 = swiglu(*names, z.moe_ffn, r)
                        out[f"{mg}mlp.experts.local_experts.{k}.linear_fc1.weight"] = fc1
                        out[f"{mg}mlp.experts.local_experts.{k}.linear_fc2.weight"] = fc2
                    if spec.shared:
                        x = f"{mlp}shared_expert."
                        fc1, fc2 = swiglu(
                            f"{x}gate_proj.weight",
                            f"{x}up_proj.weight",
                            f"{x}down_proj.weight",
                            z.shared_ffn,
                            r,
                        )
                        out[f"{mg}mlp.shared_experts.linear_fc1.weight"] = fc1
                        out[f"{mg}mlp.shared_experts.linear_fc2.weight"] = fc2
                    if spec.shared_gate:
                        shapes[f"{mlp}shared_expert_gate.weight"] = (1, h)
                        out[f"{mg}mlp.shared_experts.gate_weight"] = [
                            Part(f"{mlp}shared_expert_gate.weight")
                        ]
                if p == pp - 1:
                    out["decoder.final_layernorm.weight"] = [Part("model.norm.weight")]
                    out["output_layer.weight"] = vocab_rows("lm_head.weight", r)
                slots.append(out)
    return shapes, slots


def _rows(part: Part, shapes: dict[str, tuple[int, ...]]) -> int:
    """How many Megatron rows ``part`` fills."""
    if part.hf is None:
        return part.stop
    if part.dim == 0 and part.stop:
        return part.stop - part.start
    return shapes[part.hf][0]  # a column slice or the whole tensor


def _hf_view(t: torch.Tensor, part: Part) -> torch.Tensor:
    return t if part.stop == 0 else t.narrow(part.dim, part.start, part.stop - part.start)


def cut(
    full: dict[str, torch.Tensor], config: dict[str, Any], tp: int, pp: int, ep: int
) -> list[dict[str, torch.Tensor]]:
    """One dict per slot ``(pp_rank * ep + ep_rank) * tp + tp_rank``: Megatron-Core name -> a
    new contiguous tensor, what that rank holds (the rules: the module docstring)."""
    z = _sizes(config)
    specs = []
    for g in range(z.layers):
        x = f"model.layers.{g}."
        dense, router = f"{x}mlp.gate_proj.weight", f"{x}{z.moe_prefix}.gate.weight"
        if (dense in full) == (router in full):
            raise ValueError(f"layer {g}: neither or both of {dense} and {router}")
        specs.append(
            LayerSpec(
                qkv_bias=f"{x}self_attn.q_proj.bias" in full,
                qk_norm=f"{x}self_attn.q_norm.weight" in full,
                moe=router in full,
                shared=f"{x}mlp.shared_expert.gate_proj.weight" in full,
                shared_gate=f"{x}mlp.shared_expert_gate.weight" in full,
            )
        )
    shapes, plan = _plan(z, specs, tp, pp, ep)
    extra = sorted(set(full) - set(shapes))
    if extra:
        raise ValueError(f"HF tensors the rules do not place: {extra[:5]}")
    missing = sorted(set(shapes) - set(full))
    if missing:
        raise ValueError(f"HF tensors missing: {missing[:5]}")
    for name, shape in shapes.items():
        if tuple(full[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(full[name].shape)}, the config says {shape}")
    dtype = full["model.embed_tokens.weight"].dtype
    h = z.hidden
    out = []
    for slot in plan:
        tensors = {}
        for name, parts in slot.items():
            pieces = [
                torch.zeros(p.stop, h, dtype=dtype) if p.hf is None else _hf_view(full[p.hf], p)
                for p in parts
            ]
            tensors[name] = torch.cat(pieces, dim=0)  # always a new contiguous tensor
        out.append(tensors)
    return out


def uncut(
    ranks: list[dict[str, torch.Tensor]], config: dict[str, Any], tp: int, pp: int, ep: int
) -> dict[str, torch.Tensor]:
    """The HF tensors reassembled from every slot's Megatron tensors (``cut``'s output)."""
    z = _sizes(config)
    if len(ranks) != tp * pp * ep:
        raise ValueError(f"{len(ranks)} slots for tp {tp} x pp {pp} x ep {ep}")
    if z.layers % pp:
        raise ValueError(f"num_hidden_layers {z.layers} is not a multiple of pp {pp}")
    per_stage = z.layers // pp
    specs = []
    for g in range(z.layers):
        first = ranks[(g // per_stage) * ep * tp]  # ep rank 0, tp rank 0 of the layer's stage
        x = f"decoder.layers.{g % per_stage}."
        specs.append(
            LayerSpec(
                qkv_bias=f"{x}self_attention.linear_qkv.bias" in first,
                qk_norm=f"{x}self_attention.q_layernorm.weight" in first,
                moe=f"{x}mlp.router.weight" in first,
                shared=f"{x}mlp.shared_experts.linear_fc1.weight" in first,
                shared_gate=f"{x}mlp.shared_experts.gate_weight" in first,
            )
        )
    shapes, plan = _plan(z, specs, tp, pp, ep)
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}  # which elements are written
    for index, (slot, tensors) in enumerate(zip(plan, ranks, strict=True)):
        extra = sorted(set(tensors) - set(slot))
        if extra:
            raise ValueError(f"slot {index}: tensors the rules do not place: {extra[:5]}")
        for name, parts in slot.items():
            if name not in tensors:
                raise ValueError(f"slot {index}: {name} is missing")
            t = tensors[name]
            rows = sum(_rows(p, shapes) for p in parts)
            if t.shape[0] != rows:
                raise ValueError(f"slot {index}: {name}: {t.shape[0]} rows, the plan says {rows}")
            off = 0
            for p in parts:
                n = _rows(p, shapes)
                piece, off = t.narrow(0, off, n), off + n
                if p.hf is None:
                    continue  # vocab padding
                if p.hf not in full:
                    full[p.hf] = torch.empty(shapes[p.hf], dtype=t.dtype)
                    seen[p.hf] = torch.zeros(shapes[p.hf], dtype=torch.bool)
                dst, mask = _hf_view(full[p.hf], p), _hf_view(seen[p.hf], p)
                if dst.shape != piece.shape:
                    raise ValueError(f"slot {index}: {name}: a piece {tuple(piece.shape)} for {p}")
                if bool(mask.all()):
                    if not torch.equal(dst, piece):
                        raise ValueError(f"slot {index}: {name}: replicas of {p.hf} differ")
                elif bool(mask.any()):
                    raise ValueError(f"slot {index}: {name}: overlapping pieces of {p.hf}")
                else:
                    dst.copy_(piece)
                    mask.fill_(True)
    for name in shapes:
        if name not in seen or not bool(seen[name].all()):
            raise ValueError(f"{name}: not covered by the slots")
    return full


# --------------------------------------------------------------------------------------------
# Self-check.


def _checkpoints(root: str) -> dict[str, str]:
    """Tiny checkpoints of each family, written by transformers: name -> directory."""
    import os

    import moe_fsdp
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )
    from transformers.utils import logging

    logging.disable_progress_bar()
    dirs = {k: os.path.join(root, k) for k in ("qwen3_moe", "qwen2_moe", "mixtral", "llama")}
    moe_fsdp.make_checkpoint(dirs["qwen3_moe"], layers=4, vocab=1000)
    common = dict(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    models = {
        # layer 1 dense (mlp_only_layers): a dense MLP inside an MoE model
        "qwen2_moe": Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **common,
                intermediate_size=96,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=8,
                num_experts_per_tok=2,
                mlp_only_layers=[1],
            )
        ),
        "mixtral": MixtralForCausalLM(
            MixtralConfig(**common, intermediate_size=48, num_local_experts=8)
        ),
        "llama": LlamaForCausalLM(LlamaConfig(**common, intermediate_size=96)),
    }
    for name, model in models.items():
        model.to(torch.bfloat16).save_pretrained(dirs[name])
    return dirs


def _table(ranks: list[dict[str, torch.Tensor]], tp: int, ep: int) -> str:
    names = list(dict.fromkeys(n for r in ranks for n in r))
    heads = [f"p{s // (ep * tp)}e{s // tp % ep}t{s % tp}" for s in range(len(ranks))]
    width = max(len(n) for n in names)
    lines = [f"{'slot (pp,ep,tp)':<{width}} " + " ".join(f"{h:>9}" for h in heads)]
    for n in names:
        cells = ["x".join(map(str, r[n].shape)) if n in r else "-" for r in ranks]
        lines.append(f"{n:<{width}} " + " ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def _expect_error(what: str, fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return f"{what}: ValueError({e})"
    raise AssertionError(f"{what}: no ValueError")


def _spot_checks(full: dict[str, torch.Tensor], config: dict[str, Any], family: str) -> int:
    """Hand-computed slices against cut(.., tp 2, pp 2, ep 2); returns how many held."""
    tp, pp, ep = 2, 2, 2
    ranks = cut(full, config, tp, pp, ep)
    z = _sizes(config)
    per_stage, n = z.layers // pp, max(z.experts // ep, 1)
    d, qpg, h = z.head_dim, z.heads // z.groups, z.hidden
    checks = 0

    def slot(p: int, s: int, r: int) -> dict[str, torch.Tensor]:
        return ranks[(p * ep + s) * tp + r]

    for p in range(pp):
        for s in range(ep):
            for r in range(tp):
                mine = slot(p, s, r)
                for t in mine.values():
                    assert t.is_contiguous() and all(
                        t.untyped_storage().data_ptr() != f.untyped_storage().data_ptr()
                        for f in full.values()
                    ), "a cut tensor shares memory with the input"
                for i in range(per_stage):
                    g = p * per_stage + i
                    hf, mg = f"model.layers.{g}.", f"decoder.layers.{i}."
                    # QKV: whole groups, each [q heads of the group; k; v].
                    qkv = mine[f"{mg}self_attention.linear_qkv.weight"]
                    per_group = (qpg + 2) * d
                    assert qkv.shape == (z.groups // tp * per_group, h)
                    for j in range(z.groups // tp):
                        grp = r * z.groups // tp + j
                        want = torch.cat(
                            (
                                full[f"{hf}self_attn.q_proj.weight"][
                                    grp * qpg * d : (grp + 1) * qpg * d
                                ],
                                full[f"{hf}self_attn.k_proj.weight"][grp * d : (grp + 1) * d],
                                full[f"{hf}self_attn.v_proj.weight"][grp * d : (grp + 1) * d],
                            )
                        )
                        assert torch.equal(qkv[j * per_group : (j + 1) * per_group], want)
                        checks += 1
                    o = full[f"{hf}self_attn.o_proj.weight"]
                    c = o.shape[1] // tp
                    assert torch.equal(
                        mine[f"{mg}self_attention.linear_proj.weight"], o[:, r * c : (r + 1) * c]
                    )
                    checks += 1
                    if f"{hf}mlp.gate_proj.weight" in full:  # dense
                        gate, up = (
                            full[f"{hf}mlp.gate_proj.weight"],
                            full[f"{hf}mlp.up_proj.weight"],
                        )
                        i_r = gate.shape[0] // tp
                        fc1 = mine[f"{mg}mlp.linear_fc1.weight"]
                        sl = slice(r * i_r, (r + 1) * i_r)
                        assert torch.equal(fc1, torch.cat((gate[sl], up[sl])))
                        fused = torch.cat((gate, up))  # the wrong cut: rows r of [gate; up]
                        assert not torch.equal(fc1, fused[r * 2 * i_r : (r + 1) * 2 * i_r])
                        checks += 1
                        continue
                    pre = "block_sparse_moe" if family == "mixtral" else "mlp"
                    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate", "up", "down")
                    suffix = "" if family == "mixtral" else "_proj"
                    for k in range(n):
                        e = s * n + k  # expert k of EP rank s
                        x = f"{hf}{pre}.experts.{e}."
                        gate, up, down = (full[f"{x}{w}{suffix}.weight"] for w in names)
                        i_r = gate.shape[0] // tp
                        sl = slice(r * i_r, (r + 1) * i_r)
                        y = f"{mg}mlp.experts.local_experts.{k}."
                        fc1, fc2 = mine[f"{y}linear_fc1.weight"], mine[f"{y}linear_fc2.weight"]
                        assert torch.equal(fc1, torch.cat((gate[sl], up[sl])))
                        assert not torch.equal(fc1, torch.cat((gate, up))[2 * r * i_r :][: 2 * i_r])
                        assert torch.equal(fc2, down[:, sl])
                        # and no other expert matches
                        for other in range(z.experts):
                            if other != e:
                                og = full[f"{hf}{pre}.experts.{other}.{names[2]}{suffix}.weight"]
                                assert not torch.equal(fc2, og[:, sl])
                        checks += 1
                    if f"{hf}mlp.shared_expert.gate_proj.weight" in full:
                        x = f"{hf}mlp.shared_expert."
                        gate, up = full[f"{x}gate_proj.weight"], full[f"{x}up_proj.weight"]
                        i_r = gate.shape[0] // tp
                        sl = slice(r * i_r, (r + 1) * i_r)
                        fc1 = mine[f"{mg}mlp.shared_experts.linear_fc1.weight"]
                        assert torch.equal(fc1, torch.cat((gate[sl], up[sl])))
                        fc2 = mine[f"{mg}mlp.shared_experts.linear_fc2.weight"]
                        assert torch.equal(fc2, full[f"{x}down_proj.weight"][:, sl])
                        checks += 1
                # Vocab-parallel embedding / output layer with zero padding rows.
                step = VOCAB_DIVISIBLE * tp
                vp = -(-z.vocab // step) * step
                a, b = r * vp // tp, (r + 1) * vp // tp
                for hf, mg, has in (
                    ("model.embed_tokens.weight", "embedding.word_embeddings.weight", p == 0),
                    ("lm_head.weight", "output_layer.weight", p == pp - 1),
                ):
                    if not has:
                        assert mg not in mine
                        continue
                    t = mine[mg]
                    assert t.shape == (vp // tp, h)
                    real = max(0, min(b, z.vocab) - a)
                    assert torch.equal(t[:real], full[hf][a : a + real])
                    assert not t[real:].any()
                    checks += 1
    return checks


def main() -> int:
    import json
    import os
    import tempfile

    from llama_fsdp import read_safetensors

    layouts = [(1, 1, 1), (2, 2, 2), (2, 1, 4), (1, 2, 1)]
    with tempfile.TemporaryDirectory(prefix="megatron-cut-") as root:
        dirs = _checkpoints(root)
        g = torch.Generator().manual_seed(7)
        kept = {}
        for family, model_dir in dirs.items():
            with open(os.path.join(model_dir, "config.json")) as f:
                config = json.load(f)
            # Distinct random values everywhere (norms too), so any misplacement shows.
            full = {
                k: torch.randn(v.shape, generator=g).to(v.dtype)
                for k, v in sorted(read_safetensors(model_dir).items())
            }
            for tp, pp, ep in layouts:
                ranks = cut(full, config, tp, pp, ep)
                back = uncut(ranks, config, tp, pp, ep)
                assert sorted(back) == sorted(full), f"{family}: names differ"
                for k, v in full.items():
                    assert back[k].dtype == v.dtype and torch.equal(back[k], v), f"{family}: {k}"
                total = sum(t.numel() for r in ranks for t in r.values())
                print(
                    f"{family:9} tp {tp} pp {pp} ep {ep}: {len(ranks)} slots, "
                    f"{sum(len(r) for r in ranks)} tensors, {total} elements; "
                    f"uncut(cut(x)) == x for all {len(full)} HF tensors",
                    flush=True,
                )
            checks = _spot_checks(full, config, family)
            print(f"{family:9} tp 2 pp 2 ep 2: {checks} hand-computed slices agree", flush=True)
            kept[family] = (full, config)

        full, config = kept["qwen3_moe"]
        print("\nqwen3_moe at tp 2, pp 2, ep 2 (slot = (pp*ep + ep_rank)*tp + tp_rank):")
        print(_table(cut(full, config, 2, 2, 2), 2, 2), flush=True)
        bad = dict(full)
        bad["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
        refusals = [
            _expect_error("pp 3", lambda: cut(full, config, 1, 3, 1)),
            _expect_error("tp 4", lambda: cut(full, config, 4, 1, 1)),
            _expect_error("ep 3", lambda: cut(full, config, 1, 1, 3)),
            _expect_error("extra", lambda: cut(bad, config, 1, 1, 1)),
            _expect_error(
                "tied", lambda: cut(full, {**config, "tie_word_embeddings": True}, 1, 1, 1)
            ),
        ]
        for line in refusals:
            print(line, flush=True)
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
