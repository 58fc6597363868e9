"""The broadcast path, as NCCL-broadcast RL frameworks refit vLLM today, on CPU over gloo: the
baseline ``rl_loop.py`` measures mx against.

Trainer rank 0 gathers every full tensor (FSDP2 ``full_tensor()``, a collective of all trainer
ranks), packs them into buckets of contiguous bytes and broadcasts each bucket to every vLLM rank
of a gloo group (trainer rank 0 is rank 0 of it); each vLLM rank receives a bucket into one
buffer, cuts it into views (no copy) and feeds them in checkpoint format to vLLM's layerwise
reload. This mirrors vLLM 0.32.0's ``nccl`` weight-transfer engine (``packed_tensor.py``:
``pack_tensors`` / ``unpack_tensor``, 1 GiB buckets by default) with gloo in place of NCCL.

On the vLLM side it is a worker extension (``--worker-extension-cls
gloo_broadcast.GlooBroadcastExtension``), reached through ``POST /collective_rpc`` (dev mode):
the server's weight-transfer backend stays ``mx``, so the same servers serve all three paths.
``collective_rpc`` passes only strings, hence the JSON arguments.
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 1 << 30
"""vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (1 GiB)."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _group(host: str, port: int, world: int, rank: int) -> Any:
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=300))
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=600))


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def plan_buckets(
    specs: list[tuple[str, str, list[int]]], bucket_bytes: int = BUCKET_BYTES
) -> list[list[int]]:
    """Tensor indices per bucket, in order: a bucket closes once it holds ``bucket_bytes`` (a
    tensor larger than that is a bucket of its own)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        if buckets[-1] and size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    return [b for b in buckets if b]


class Sender:
    """Trainer rank 0's end: rank 0 of the group, hosting its store at ``host:port``."""

    def __init__(self, host: str, port: int, world: int) -> None:
        self.group = _group(host, port, world, 0)

    def send(self, tensors: list[tuple[str, torch.Tensor]], buckets: list[list[int]]) -> int:
        """Packs and broadcasts ``tensors`` bucket by bucket; returns the bytes sent (per
        receiver)."""
        sent = 0
        for b in buckets:
            flat = [tensors[i][1].contiguous().view(-1).view(torch.uint8) for i in b]
            packed = torch.cat(flat)  # the one copy NCCL's packed path makes too
            _broadcast(self.group, packed)
            sent += packed.numel()
        return sent


class GlooBroadcastExtension:
    """Methods mixed into vLLM's worker (``--worker-extension-cls``), called through
    ``/collective_rpc`` with string arguments."""

    def gloo_init(self, host: str, port: str, world: str, rank: str) -> None:
        """Joins the broadcast group as ``rank`` (1.. for vLLM ranks)."""
        self._mx_gloo = _group(host, int(port), int(world), int(rank))

    def perturb_logits(self, scale: str) -> int:
        """A test hook of the examples, not of mx: adds a fixed random bias of ``scale`` nats
        (seeded) to every logit this engine computes from now on, whatever weights it holds,
        so its greedy tokens differ from the trainer's where no near-tie excuses them.
        Returns the vocabulary size biased."""
        model = self.model_runner.get_model()
        bias: dict[str, torch.Tensor] = {}

        def hook(_module, _inputs, out):
            if out is None:
                return out
            if "b" not in bias or bias["b"].shape[-1] != out.shape[-1]:
                g = torch.Generator().manual_seed(20261206)
                bias["b"] = float(scale) * torch.randn(out.shape[-1], generator=g)
            return out + bias["b"].to(out.dtype)

        self._mx_perturb = model.logits_processor.register_forward_hook(hook)
        return int(model.config.vocab_size)

    def unperturb_logits(self) -> None:
        """Removes :meth:`perturb_logits`' bias."""
        handle = getattr(self, "_mx_perturb", None)
        if handle is not None:
            handle.remove()
            self._mx_perturb = None

    def gloo_receive(self, meta: str) -> dict[str, float]:
        """Receives one full set of weights (``meta``: JSON ``{"specs": [[name, dtype, shape],
        ...], "buckets": [[indices], ...]}``) and installs it through vLLM's layerwise reload.
        Returns ``{"bytes", "receive_s", "load_s"}``."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        m = json.loads(meta)
        specs = [(n, d, list(s)) for n, d, s in m["specs"]]
        model = self.model_runner.get_model()
        received = 0
        recv_s = load_s = 0.0
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            for b in m["buckets"]:
                sizes = [
                    math.prod(specs[i][2])
                    * torch.empty((), dtype=DTYPES[specs[i][1]]).element_size()
                    for i in b
                ]
                t0 = time.perf_counter()
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
                _broadcast(self._mx_gloo, buf)
                t1 = time.perf_counter()
                views = [
                    (specs[i][0], part.view(DTYPES[specs[i][1]]).view(specs[i][2]))
                    for i, part in zip(b, buf.split(sizes), strict=True)
                ]
                model.load_weights(views)
                load_s += time.perf_counter() - t1
                recv_s += t1 - t0
                received += buf.numel()
                del views, buf
            t2 = time.perf_counter()
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            load_s += time.perf_counter() - t2
        return {"bytes": received, "receive_s": recv_s, "load_s": load_s}
