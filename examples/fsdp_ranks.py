"""Counting an FSDP2 trainer's collectives, for the examples whose trainer processes must show
that a weight sync gathers nothing (``examples/vllm_trainer_api.py``,
``examples/verl_engine.py``): :class:`CollectiveCounter` wraps ``torch.distributed``'s
collectives, the functional collectives and ``DTensor.full_tensor`` / ``redistribute`` in the
process that installs it, independently of mx, and counts calls and bytes per phase."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any

COLLECTIVES = (
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_object",
    "all_gather_coalesced",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
)
FUNCTIONAL = (
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_reduce",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
)


def _tensor_bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives (the module, ``distributed_c10d`` and the
    functional collectives) and ``DTensor.full_tensor`` / ``redistribute`` in this process;
    counts calls and the bytes of the tensors handed to them, per :attr:`phase` (the outermost
    call only: a collective built on another counts once)."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._depth = threading.local()

    def _wrap(self, name: str, fn: Any, size: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.calls[self.phase][name] += 1
                self.bytes[self.phase][name] += size(args, kwargs)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def install(self) -> CollectiveCounter:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d
        from torch.distributed.tensor import DTensor

        def args_bytes(args: Any, kwargs: Any) -> int:
            return _tensor_bytes(list(args)) + _tensor_bytes(list(kwargs.values()))

        def global_bytes(args: Any, kwargs: Any) -> int:
            t = args[0]
            return t.numel() * t.element_size()

        for module, names, prefix in (
            (dist, COLLECTIVES, ""),
            (c10d, COLLECTIVES, ""),
            (funcol, FUNCTIONAL, "funcol."),
        ):
            for name in names:
                fn = getattr(module, name, None)
                if fn is not None:
                    setattr(module, name, self._wrap(prefix + name, fn, args_bytes))
        for name in ("full_tensor", "redistribute"):
            fn = getattr(DTensor, name)
            setattr(DTensor, name, self._wrap(f"DTensor.{name}", fn, global_bytes))
        return self

    @contextlib.contextmanager
    def counting(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def gathered_bytes(self, phase: str) -> int:
        """Bytes handed to all-gathers, gathers and full-tensor materializations in ``phase``."""
        return sum(
            b
            for name, b in self.bytes[phase].items()
            if "gather" in name or name.startswith("DTensor.")
        )

    def summary(self) -> dict[str, Any]:
        return {
            p: {"calls": dict(self.calls[p]), "bytes": dict(self.bytes[p])}
            for p in sorted(self.calls)
        }


def sha256(t: Any) -> str:
    """sha256 (hex) of a tensor's row-major bytes (the checkers' digest, not mx's)."""
    import hashlib

    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def one_rank_fsdp_llama(model_dir: str, layers: int = 1) -> tuple[Any, Any, dict[str, Any]]:
    """A one-rank gloo group (an in-process store) and FSDP2 over a bf16 llama of the
    checkpoint's shape cut to ``layers`` decoder layers (weights uninitialized), for tests of
    what reads FSDP2 shards; returns the module, its mesh and its config."""
    import json
    import os

    import torch
    import torch.distributed as dist
    from llama_fsdp import Llama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=layers)
    with torch.device("meta"):
        net = Llama(config)
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    fully_shard(net, mesh=mesh)
    return net, mesh, config
