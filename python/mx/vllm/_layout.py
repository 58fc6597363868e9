"""A vLLM rank's destination layout, derived from the vLLM model itself and checked against
mx's vLLM rules; and the checkpoint-format tensors an install feeds vLLM's loaders.

The derivation is a placeholder pass through vLLM's own weight loaders (as vLLM's sharded_rdt
backend bakes its plan): a second instance of the model class is built on the meta device
(under a private prefix, so its attention layers do not collide with the live ones), and one
decoder layer at a time its parameters are materialized as float64 tensors filled with -1
while ``load_weights`` loads placeholders whose every element holds its own identity
(``tensor_index * 2**33 + flat_index``, exact in float64). Reading the parameters back says,
for every element of every parameter of this rank, which element of which checkpoint tensor
vLLM puts there. The live model is not touched. Memory: one decoder layer's parameters and
checkpoint tensors, 8 bytes per element, at a time.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .._memory import _error
from .._puller import ParamInfo, Piece

_SHADOW = "mx_placeholder"
"""The module-name prefix of the placeholder pass's shadow model."""
_ELEM_BITS = 33
"""Flat indices of a checkpoint tensor take the low 33 bits of a placeholder element (8.6 G
elements per tensor); the tensor's index the bits above (float64 is exact to 2**53)."""

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``.

    Raises:
        MxError: ``InvalidArgument`` for a dtype torch has no type for here.
    """
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise _error(f"dtype {name} has no torch type here", "InvalidArgument") from None


def _stack_key(name: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the first integer segment of a dotted name (its decoder layer),
    None for names outside the layer stack (embeddings, final norm)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layer_groups(names: Sequence[str]) -> list[list[str]]:
    """Checkpoint names grouped by decoder layer, in layer order: the names outside the stack
    first (embeddings, final norm), then one group per layer."""
    outside: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for n in names:
        key = _stack_key(n)
        if key is None:
            outside.append(n)
        else:
            stacks.setdefault(key, []).append(n)
    groups = [outside] if outside else []
    groups += [stacks[k] for k in sorted(stacks)]
    return groups


def _box(pc: Piece) -> tuple[slice, ...]:
    """The index of piece ``pc``'s box in its checkpoint tensor."""
    return tuple(slice(o, o + n) for o, n in zip(pc.box_offset, pc.box_shape, strict=True))


@dataclass(frozen=True)
class Disagreement:
    """Where vLLM's loaders and mx's layout disagree about one parameter."""

    param: str
    reason: str


def _expected_ids(info: ParamInfo, index_of: dict[str, int]) -> torch.Tensor:
    """The placeholder identity mx's layout puts at every element of ``info`` (-1 where no
    piece lands, e.g. vocabulary padding)."""
    numel = math.prod(info.shape)
    size = torch.empty((), dtype=torch_dtype(info.dtype)).element_size()
    out = torch.full((numel,), -1.0, dtype=torch.float64)
    for pc in info.pieces:
        base = float(index_of[pc.tensor] << _ELEM_BITS)
        ids = torch.arange(math.prod(pc.global_shape), dtype=torch.float64).view(pc.global_shape)
        box = ids[_box(pc)]
        start = pc.offset // size
        out[start : start + box.numel()] = box.reshape(-1) + base
    return out


def _describe(value: float, names: Sequence[str]) -> str:
    if value < 0:
        return "nothing"
    v = int(value)
    t, i = v >> _ELEM_BITS, v & ((1 << _ELEM_BITS) - 1)
    name = names[t] if t < len(names) else f"tensor #{t}"
    return f"{name}[flat {i}]"


def compare(
    derived: torch.Tensor,
    info: ParamInfo,
    names: Sequence[str],
    index_of: dict[str, int] | None = None,
) -> str | None:
    """None when the placeholder identities vLLM's loaders wrote into parameter ``info``
    (``derived``, any shape, float64) are exactly what mx's layout says; else what differs.
    ``index_of``: ``names`` -> position, when the caller has it already (built here otherwise)."""
    if tuple(derived.shape) != tuple(info.shape):
        return f"vLLM's parameter is {list(derived.shape)}, mx's layout says {list(info.shape)}"
    if index_of is None:
        index_of = {n: i for i, n in enumerate(names)}
    expected = _expected_ids(info, index_of)
    flat = derived.reshape(-1)
    if torch.equal(flat, expected):
        return None
    bad = (flat != expected).nonzero()[0].item()
    count = int((flat != expected).sum())
    return (
        f"{count} of {flat.numel()} elements differ; the first, flat element {bad}, is "
        f"{_describe(flat[bad].item(), names)} in vLLM and "
        f"{_describe(expected[bad].item(), names)} in mx's layout"
    )


def _materialize(param: torch.nn.Parameter) -> None:
    """Swaps a meta parameter for a host float64 one filled with -1, keeping its class and
    attributes (``weight_loader``, ``output_dim``...)."""
    attrs = dict(param.__dict__)
    cls = type(param)
    new = torch.nn.Parameter(torch.full(param.shape, -1.0, dtype=torch.float64), False)
    torch.utils.swap_tensors(param, new)
    if type(param) is not cls:
        param.__class__ = cls
    for k, v in attrs.items():
        if k not in param.__dict__:
            setattr(param, k, v)


def _dematerialize(param: torch.nn.Parameter) -> None:
    """Drops a materialized placeholder parameter's memory."""
    param.data = torch.empty(0, dtype=param.dtype)


@contextlib.contextmanager
def _skips_under_prefix(vllm_config, prefix: str) -> Iterator[None]:
    """Makes the quantization config skip the same layers in the shadow model (whose module
    names start with ``prefix.``) as in the live one: e.g. an FP8 checkpoint's
    ``modules_to_not_convert`` routers, which would otherwise be built quantized."""
    qc = getattr(vllm_config, "quant_config", None)
    ignored = getattr(qc, "ignored_layers", None)
    if not isinstance(ignored, list) or not ignored:
        yield
        return
    qc.ignored_layers = ignored + [f"{prefix}.{n}" for n in ignored]
    try:
        yield
    finally:
        qc.ignored_layers = ignored


@contextlib.contextmanager
def _expert_maps_on_host() -> Iterator[None]:
    """Builds vLLM's expert maps (which global expert is which local one under expert
    parallelism: small int32 tensors the expert loaders read by value) on the host while the
    shadow model is built on the meta device, where they would have no values."""
    try:
        from vllm.model_executor.layers.fused_moe import expert_map_manager as emm
    except ImportError:  # a vLLM without expert maps
        yield
        return
    cls = emm.ExpertMapManager
    original = cls.__init__

    def on_host(self, *args, **kwargs):
        with torch.device("cpu"):
            original(self, *args, **kwargs)

    cls.__init__ = on_host
    try:
        yield
    finally:
        cls.__init__ = original


def derive(
    vllm_config, checkpoint: Sequence[tuple[str, str, tuple[int, ...]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Runs the placeholder pass for this process's rank: yields ``(vLLM parameter name,
    float64 tensor of placeholder identities)`` for every parameter of the model, one decoder
    layer at a time (see the module docs). ``checkpoint``: every checkpoint tensor as
    ``(name, safetensors dtype, shape)``; the identities index it in this order.

    Raises:
        MxError: ``InvalidArgument`` when vLLM's loaders refuse the checkpoint's names or shapes.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    ctx = vllm_config.compilation_config.static_forward_context
    before = set(ctx)
    try:
        with (
            set_current_vllm_config(vllm_config),
            torch.device("meta"),
            _expert_maps_on_host(),
            _skips_under_prefix(vllm_config, _SHADOW),
        ):
            shadow = initialize_model(vllm_config, prefix=_SHADOW)
    finally:
        # The shadow's attention layers registered themselves for the forward context.
        for k in set(ctx) - before:
            del ctx[k]
    params = dict(shadow.named_parameters())
    by_group: dict[tuple[str, int] | None, list[str]] = {}
    for n in params:
        by_group.setdefault(_stack_key(n), []).append(n)
    names = [n for n, _, _ in checkpoint]
    index_of = {n: i for i, n in enumerate(names)}
    shapes = {n: s for n, _, s in checkpoint}
    for group in layer_groups(names):
        key = _stack_key(group[0])
        targets = by_group.pop(key, [])
        for n in targets:
            _materialize(params[n])
        placeholders = []
        for n in group:
            i = index_of[n]
            numel = math.prod(shapes[n])
            ph = torch.arange(numel, dtype=torch.float64) + float(i << _ELEM_BITS)
            placeholders.append((n, ph.view(shapes[n])))
        try:
            with set_current_vllm_config(vllm_config):
                shadow.load_weights(placeholders)
        except Exception as e:
            raise _error(
                f"vLLM's weight loaders refused the checkpoint's tensors {group[:4]}...: {e}",
                "InvalidArgument",
            ) from e
        del placeholders
        for n in targets:
            yield n, params[n].data
            _dematerialize(params[n])
    # Parameters outside every checkpoint group (nothing of the checkpoint loads into them).
    for rest in by_group.values():
        for n in rest:
            yield n, torch.full(params[n].shape, -1.0, dtype=torch.float64)


def check(vllm_config, rank: int, infos: Sequence[ParamInfo], checkpoint) -> list[Disagreement]:
    """Every disagreement between the placeholder pass (:func:`derive`) and mx's layout of
    ``rank`` (``infos``): parameters only one of them has, and elements that differ."""
    want = {p.name: p for p in infos}
    names = [n for n, _, _ in checkpoint]
    index_of = {n: i for i, n in enumerate(names)}
    out: list[Disagreement] = []
    seen = set()
    for name, ids in derive(vllm_config, checkpoint):
        seen.add(name)
        info = want.get(name)
        if info is None:
            # A parameter no checkpoint element loads into (an FP8 server's attention q/k/v
            # scales, defaults kept) is nothing mx installs either.
            if not bool((ids >= 0).any()):
                continue
            out.append(Disagreement(name, f"vLLM's rank {rank} has it, mx's layout does not"))
            continue
        why = compare(ids, info, names, index_of)
        if why is not None:
            out.append(Disagreement(name, why))
    for name in want:
        if name not in seen:
            out.append(Disagreement(name, f"mx's layout has it, vLLM's rank {rank} does not"))
    return out


class CheckpointView:
    """The checkpoint-format tensors of one rank's parameters, for vLLM's loaders: for each
    checkpoint tensor this rank holds a piece of, a full-shaped tensor of which only those
    pieces are filled (from the rank's parameter tensors, ``params``); the rest is left
    uninitialized, or NaN with ``fill_nan`` (vLLM's loaders read only this rank's slice). A
    tensor the rank holds whole is a view of ``params`` (no copy; read-only to the loaders)."""

    def __init__(
        self,
        infos: Sequence[ParamInfo],
        params: dict[str, torch.Tensor],
        checkpoint: Sequence[tuple[str, str, tuple[int, ...]]],
    ) -> None:
        self._pieces: dict[str, list[tuple[torch.Tensor, Piece]]] = {}
        for info in infos:
            flat = params[info.name].reshape(-1)
            size = flat.element_size()
            for pc in info.pieces:
                n = math.prod(pc.box_shape)
                start = pc.offset // size
                src = flat[start : start + n].view(pc.box_shape)
                self._pieces.setdefault(pc.tensor, []).append((src, pc))
        spec = {n: (n, dtype, tuple(shape)) for n, dtype, shape in checkpoint}
        self._order = [
            spec[n] for group in layer_groups(list(spec)) for n in group if n in self._pieces
        ]

    @property
    def tensor_count(self) -> int:
        """How many checkpoint tensors the rank holds a piece of."""
        return len(self._order)

    def tensors(self, fill_nan: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, full-shaped tensor)`` in decoder-layer order (so vLLM's
        layerwise reload finishes each layer before the next begins)."""
        for name, dtype, shape in self._order:
            pieces = self._pieces[name]
            if len(pieces) == 1 and tuple(pieces[0][1].box_shape) == tuple(shape):
                # The rank holds the whole tensor (tp=1, or a replicated norm): a view of the
                # rank's bytes, no copy.
                yield name, pieces[0][0]
                continue
            t = torch.empty(shape, dtype=torch_dtype(dtype))
            if fill_nan and t.is_floating_point():
                t.fill_(float("nan"))
            for src, pc in self._pieces[name]:
                t[_box(pc)] = src
            yield name, t


def layer_windows(
    infos: Sequence[ParamInfo],
    checkpoint: Sequence[tuple[str, str, tuple[int, ...]]],
) -> list[tuple[list[tuple[int, int]], list[ParamInfo], list[tuple[str, str, tuple[int, ...]]]]]:
    """The rank's bytes window by window, one per :func:`layer_groups` group (the tensors
    outside the stack, then each decoder layer), in that order: ``(runs, params, checkpoint
    tensors)`` where ``params`` are the rank's parameters holding a piece of the group's
    checkpoint tensors and ``runs`` the ``(lo, hi)`` byte ranges of the rank's layout they
    occupy, adjacent parameters merged (the embeddings and the final norm lie at the two ends
    of a rank: two runs). A parameter with pieces in two groups is in both."""
    held = {pc.tensor for p in infos for pc in p.pieces}
    spec = {n: (n, dtype, tuple(shape)) for n, dtype, shape in checkpoint}
    windows = []
    for group in layer_groups([n for n in spec if n in held]):
        names = set(group)
        params = [p for p in infos if any(pc.tensor in names for pc in p.pieces)]
        if not params:
            continue
        runs: list[tuple[int, int]] = []
        for p in sorted(params, key=lambda p: p.offset):
            if runs and runs[-1][1] >= p.offset:
                runs[-1] = (runs[-1][0], max(runs[-1][1], p.offset + p.nbytes))
            else:
                runs.append((p.offset, p.offset + p.nbytes))
        windows.append((runs, params, [spec[n] for n in group]))
    return windows


def read_runs(
    runs: Sequence[tuple[int, int]],
    infos: Sequence[ParamInfo],
    read: Callable[[torch.Tensor, int], None],
) -> dict[str, torch.Tensor]:
    """The parameters ``infos`` as tensors over fresh buffers, one per run of
    :func:`layer_windows`, each filled by ``read(buffer, offset in the rank's layout)``."""
    params = {}
    for lo, hi in runs:
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        read(buf, lo)
        for p in infos:
            if lo <= p.offset and p.offset + p.nbytes <= hi:
                at = p.offset - lo
                params[p.name] = buf[at : at + p.nbytes].view(torch_dtype(p.dtype)).view(p.shape)
    return params


def read_rank(model_dir: str, infos: Sequence[ParamInfo], params: dict[str, torch.Tensor]) -> None:
    """Fills this rank's parameter tensors (``params``, laid out as ``infos``) with their
    pieces of the safetensors checkpoint in ``model_dir`` (what vLLM loaded at start-up), reading
    only those boxes.

    Raises:
        MxError: ``NotFound`` when a tensor is in no shard of the checkpoint.
    """
    import glob
    import os

    from safetensors import safe_open

    where: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                where[k] = path
    by_file: dict[str, list[tuple[ParamInfo, Piece]]] = {}
    for info in infos:
        for pc in info.pieces:
            if pc.tensor not in where:
                raise _error(f"{model_dir}: no shard holds tensor {pc.tensor}", "NotFound")
            by_file.setdefault(where[pc.tensor], []).append((info, pc))
    for path, items in by_file.items():
        with safe_open(path, "pt") as f:
            for info, pc in items:
                box = f.get_slice(pc.tensor)[_box(pc)]
                flat = params[info.name].reshape(-1)
                start = pc.offset // flat.element_size()
                flat[start : start + box.numel()] = box.reshape(-1)


_VERSION = re.compile(r"^mx:[0-9a-f]{64}$")


def is_mx_version(v: str) -> bool:
    """True for an mx version id ``mx:<64 lowercase hex>``."""
    return bool(_VERSION.match(v))
