"""A vLLM server serving 128x128 block FP8 (a DeepSeek-V3-style checkpoint: ``quant_method:
fp8``, ``weight_block_size: [128, 128]``) refitted from bf16 versions: the rank pulls its bf16
bytes, quantizes them with :func:`mx.fp8.quantize_rank` and installs e4m3 weights plus
``weight_scale_inv`` scales (see mx-layout's ``fp8`` module for why on this side).

The versions are bf16 (what the trainer holds): the source model is the FP8 checkpoint's
tensors with their ``*_scale_inv`` tensors dropped and their e4m3 weights read as bf16. The
weights the server started with are FP8 only, so they are not a version mx can serve to peers
or roll back to: the rank's first install has no rollback source.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Sequence

from .._memory import _error
from .._model import Model
from .._puller import ParamInfo, Piece
from ..fp8 import Fp8Param

FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"


def is_block_fp8(vllm_config) -> bool:
    """True for a server quantized as 128x128 block FP8, False for an unquantized one.

    Raises:
        ValueError: any other quantization (mx would not know the parameters' form).
    """
    qc = getattr(vllm_config, "quant_config", None)
    if qc is None:
        return False
    block = list(getattr(qc, "weight_block_size", None) or [])
    if type(qc).__name__ == "Fp8Config" and block == [128, 128]:
        return True
    raise ValueError(
        f"mx: vLLM's quantization {type(qc).__name__} (weight_block_size {block or None}) is not "
        "supported: mx installs unquantized servers and 128x128 block FP8 ones"
    )


def checkpoint_tensors(model_dir: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of every tensor in ``model_dir``'s safetensors
    files, sorted by name (headers only)."""
    from safetensors import safe_open

    out = []
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                out.append((k, s.get_dtype(), tuple(s.get_shape())))
    return sorted(out)


def source_model(model_dir: str, checkpoint: Sequence[tuple[str, str, tuple[int, ...]]]) -> Model:
    """The bf16 model versions of an FP8 checkpoint have: its tensors without the scales,
    e4m3 weights as bf16."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    tensors = [
        (n, "BF16" if d == FP8 else d, list(s))
        for n, d, s in checkpoint
        if not n.endswith(SCALE_SUFFIX)
    ]
    return Model.from_config(config, tensors)


def _scale_piece(sp) -> Piece:
    """A piece of a scale parameter: a box of checkpoint tensor ``{tensor}_scale_inv``."""
    name = sp.tensor + SCALE_SUFFIX
    return Piece(name, "F32", sp.grid_shape, sp.grid_offset, sp.grid_box, sp.offset)


def engine_infos(infos: Sequence[ParamInfo], quantized: Sequence[Fp8Param]) -> list[ParamInfo]:
    """The rank's parameters as the FP8 server holds them: each quantized parameter in e4m3
    (its pieces at the same elements, 1 byte each) followed by its f32 scale parameter (pieces:
    boxes of the checkpoint's ``{tensor}_scale_inv`` grids); the others as in ``infos``.

    ``quantized``: the rank's FP8 parameters (:func:`mx.fp8.fp8_layout`).

    Raises:
        MxError: ``InvalidArgument`` for a quantized parameter that is not a float type.
    """
    by_name = {p.name: p for p in quantized}
    out: list[ParamInfo] = []
    for info in infos:
        f8 = by_name.get(info.name)
        if f8 is None:
            out.append(info)
            continue
        size = 2 if info.dtype in ("BF16", "F16") else 4
        if info.dtype not in ("BF16", "F16", "F32"):
            raise _error(f"{info.name}: {info.dtype} cannot be quantized", "InvalidArgument")
        pieces = tuple(
            Piece(pc.tensor, FP8, pc.global_shape, pc.box_offset, pc.box_shape, pc.offset // size)
            for pc in info.pieces
        )
        out.append(ParamInfo(info.rank, info.name, FP8, info.shape, info.nbytes // size, pieces))
        scales = tuple(_scale_piece(sp) for sp in f8.pieces)
        nbytes = 4 * math.prod(f8.scale_shape)
        out.append(ParamInfo(info.rank, f8.scale_name, "F32", f8.scale_shape, nbytes, scales))
    return out
