"""FP8 128x128 block quantization of a rank's pulled bf16 parameters, for an engine serving the
block format vLLM loads for DeepSeek-V3-style checkpoints (``quant_method: fp8``,
``weight_block_size: [128, 128]``): e4m3 weights plus one f32 scale per block.

Quantization happens on the inference side, from the rank's own bytes, so the trainer publishes
bf16 and stays unaware (see mx-layout's ``fp8`` module for why and for which parameters). Each
piece of a rank's parameter is a block-aligned box of one checkpoint tensor (a layout that cuts
a block is refused naming the tensor and block), so quantizing it alone gives exactly the bytes
and scales of quantizing the whole tensor and slicing it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._memory import _error
from ._model import Model

if TYPE_CHECKING:
    from ._puller import ParamInfo

BLOCK = 128
"""The block edge (``weight_block_size: [128, 128]``)."""
FP8_MAX = 448.0
"""The largest finite e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``)."""
SCALE_FLOOR = 1e-4
"""The floor of a block's amax (vLLM's ``clamp(1e-4)``): an all-zero block's scale is
``1e-4 / 448``."""


def quantize_blocks(x: Any) -> tuple[Any, Any]:
    """Quantizes ``x`` (a float torch tensor, ``[..., m, n]``; leading dims are batched) in
    128x128 blocks of its last two dims, as vLLM 0.32.0's ``per_block_cast_to_fp8``
    (``vllm/utils/deep_gemm.py``, lines 979-1003, ``use_ue8m0=False``) does, without its
    ``torch.compile``: zero-pad to multiples of 128; per block ``amax = max |x|`` in float32,
    clamped below at 1e-4; ``scale = amax / 448`` (float32); ``q = (x * (1 / scale))`` in
    float32, cast to ``float8_e4m3fn`` (round to nearest even; ``|q| <= 448`` by
    construction); crop back to ``[m, n]``.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn of ``x``'s shape; ``scale`` float32
        ``[..., ceil(m/128), ceil(n/128)]`` (the multiplier vLLM calls ``weight_scale_inv``:
        ``x ~= q * scale``).

    Raises:
        ValueError: ``x`` has fewer than 2 dims or is not a floating-point tensor.
    """
    import torch

    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"quantize_blocks: a float tensor of 2+ dims, got {x.dtype} {x.shape}")
    *lead, m, n = x.shape
    mb, nb = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.zeros((*lead, mb * BLOCK, nb * BLOCK), dtype=x.dtype)
    padded[..., :m, :n] = x
    view = padded.view(*lead, mb, BLOCK, nb, BLOCK)
    amax = view.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(SCALE_FLOOR)
    scale = amax / FP8_MAX
    q = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    q = q.view(*lead, mb * BLOCK, nb * BLOCK)[..., :m, :n].contiguous()
    return q, scale.view(*lead, mb, nb)


@dataclass(frozen=True)
class ScalePiece:
    """One piece's scales: the box (``grid_offset``, ``grid_box``) of checkpoint tensor
    ``tensor``'s scale grid (shape ``grid_shape``), at byte ``offset`` of the scale parameter."""

    tensor: str
    grid_shape: tuple[int, ...]
    grid_offset: tuple[int, ...]
    grid_box: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Fp8Param:
    """A parameter an FP8 engine holds as e4m3 ``name`` (``shape``) plus float32
    ``scale_name`` (``scale_shape``); ``pieces`` in the parameter's piece order."""

    name: str
    shape: tuple[int, ...]
    scale_name: str
    scale_shape: tuple[int, ...]
    pieces: tuple[ScalePiece, ...]


def fp8_layout(model: Model, layout: str, rank: int) -> list[Fp8Param]:
    """The parameters of rank ``rank`` of ``layout`` (``tp:N``, ``tp-ep:N``) an FP8 block
    engine quantizes (linear weights; see mx-layout's ``fp8``), with their scale parameters.

    Raises:
        MxError: ``InvalidArgument`` naming the tensor and block a rank's slice cuts.
    """
    out = []
    for p in json.loads(model._inner.fp8_layout(str(layout), int(rank))):
        pieces = tuple(
            ScalePiece(
                pc["tensor"],
                tuple(pc["grid_shape"]),
                tuple(pc["grid_offset"]),
                tuple(pc["grid_box"]),
                pc["offset"],
            )
            for pc in p["pieces"]
        )
        out.append(
            Fp8Param(p["name"], tuple(p["shape"]), p["scale_name"], tuple(p["scale_shape"]), pieces)
        )
    return out


def quantize_rank(
    model: Model, layout: str, rank: int, params: Mapping[str, Any]
) -> dict[str, Any]:
    """The FP8 form of rank ``rank``'s parameters ``params`` (``name -> bf16 torch tensor`` in
    the layout's shapes, e.g. a :class:`mx.Puller`'s registered tensors after an apply): each
    quantized parameter's e4m3 tensor under its name and its scales under ``{name}_scale_inv``,
    every other parameter as given (the same tensor).

    Raises:
        MxError: ``InvalidArgument`` for a layout that cuts a block, or a parameter missing or
            not in the layout's shape.
    """
    infos = model.rank_layout(layout, rank)
    return quantize_params(infos, fp8_layout(model, layout, rank), params)


def quantize_params(
    infos: Sequence[ParamInfo], quantized: Sequence[Fp8Param], params: Mapping[str, Any]
) -> dict[str, Any]:
    """:func:`quantize_rank` with the rank's layout (``infos``, :meth:`Model.rank_layout`) and
    FP8 parameters (``quantized``, :func:`fp8_layout`) looked up once by the caller, e.g. at an
    engine's init rather than at every install.

    Raises:
        MxError: ``InvalidArgument`` for a parameter missing or not in the layout's shape.
    """
    import torch

    by_name = {p.name: p for p in quantized}
    out: dict[str, Any] = {}
    for info in infos:
        name = info.name
        src = params.get(name)
        if src is None or tuple(src.shape) != info.shape or not src.is_contiguous():
            got = None if src is None else tuple(src.shape)
            raise _error(
                f"params[{name!r}]: expected a contiguous {info.dtype} {list(info.shape)} "
                f"tensor of rank {info.rank}, got {got}",
                "InvalidArgument",
            )
        f8 = by_name.get(name)
        if f8 is None:
            out[name] = src
            continue
        flat = src.reshape(-1)
        size = src.element_size()
        weight = torch.empty(info.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(f8.scale_shape, dtype=torch.float32)
        wflat, sflat = weight.view(-1), scales.view(-1)
        for pc, sp in zip(info.pieces, f8.pieces, strict=True):
            start, n = pc.offset // size, math.prod(pc.box_shape)
            q, s = quantize_blocks(flat[start : start + n].view(pc.box_shape))
            if tuple(s.shape) != sp.grid_box:
                raise _error(
                    f"{name}: {pc.tensor}'s scales are {list(s.shape)}, the layout's "
                    f"{list(sp.grid_box)}",
                    "Internal",
                )
            wflat[start : start + n] = q.reshape(-1)
            s0 = sp.offset // 4
            sflat[s0 : s0 + s.numel()] = s.reshape(-1)
        out[name] = weight
        out[f8.scale_name] = scales
    return out
