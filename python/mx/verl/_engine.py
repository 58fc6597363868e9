"""mx's ``CheckpointEngine`` for verl 0.9.1 (see :mod:`mx.verl` for the contract)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .._control import Control
from .._http import url_problem
from .._memory import _DTYPES
from .._model import Model
from .._mx import MxError
from .._publisher import Publisher
from .._puller import Puller

BACKEND = "mx"
"""The name the engine registers under (``checkpoint_engine.backend=mx``)."""

ENGINE_KWARGS = {
    "control_url": "mx's control plane, http(s)://host:port (required)",
    "model": "the checkpoint directory (config.json + safetensors headers) (required)",
    "layout": "the actor's layout: fsdp:N (FSDP2 dim-0 shards) or replicated:N, N the actor "
    "world size (required)",
    "label_prefix": "version labels are <label_prefix>-g<global_steps>-s<sync> (default verl)",
    "worker_prefix": "rollout rank r registers with the control plane as <worker_prefix>-<r> "
    "(default <label_prefix>-rollout)",
    "publish_timeout": "seconds an actor rank waits for the declaration and every rank "
    "(default 600)",
    "stage_timeout": "seconds a rollout rank waits for the version and pulls it (default 600)",
}
"""The keys of ``checkpoint_engine.engine_kwargs.mx``."""

LAYOUT_KINDS = ("fsdp", "replicated")
_WHERE = "checkpoint_engine.engine_kwargs.mx"
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def _need(cond: bool, key: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{_WHERE}.{key}: {what}")


def _seconds(key: str, v: Any) -> float:
    """A positive number of seconds (YAML may hand a numeric string)."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    _need(ok, key, f"must be a positive number of seconds, got {v!r}")
    return float(v)


def parse_layout(layout: Any) -> tuple[str, int]:
    """``("fsdp" | "replicated", N)`` of ``layout``.

    Raises:
        ValueError: anything but ``fsdp:N`` or ``replicated:N`` (N >= 1), the key named.
    """
    _need(isinstance(layout, str), "layout", f"must be a str such as 'fsdp:2', got {layout!r}")
    kind, _, n = layout.partition(":")
    _need(
        kind in LAYOUT_KINDS and n.isascii() and n.isdigit() and int(n) > 0,
        "layout",
        f"must be fsdp:N or replicated:N (N >= 1, the actor world size), got {layout!r}",
    )
    return kind, int(n)


@dataclass(frozen=True)
class EngineConfig:
    """``engine_kwargs.mx``, checked (see :data:`ENGINE_KWARGS`)."""

    control_url: str
    model: str
    layout: str
    label_prefix: str = "verl"
    worker_prefix: str = ""
    publish_timeout: float = 600.0
    stage_timeout: float = 600.0
    world_size: int = field(init=False, default=0)

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> EngineConfig:
        """The config of ``kwargs``.

        Raises:
            ValueError: an unknown or missing key, or a value out of its domain (the key
                named: ``checkpoint_engine.engine_kwargs.mx.<key>: ...``).
        """
        unknown = sorted(set(kwargs) - set(ENGINE_KWARGS))
        _need(
            not unknown,
            unknown[0] if unknown else "",
            f"unknown key (known: {list(ENGINE_KWARGS)})",
        )
        for key in ("control_url", "model", "layout"):
            _need(key in kwargs, key, f"required ({ENGINE_KWARGS[key]})")
        url = kwargs["control_url"]
        bad = url_problem(url)
        _need(bad is None, "control_url", str(bad))
        model = kwargs["model"]
        _need(
            isinstance(model, str) and model != "", "model", f"must be a directory, got {model!r}"
        )
        _need(
            os.path.isfile(os.path.join(model, "config.json")),
            "model",
            f"{model!r} has no config.json",
        )
        _, world = parse_layout(kwargs["layout"])
        out = {"control_url": url, "model": model, "layout": kwargs["layout"]}
        for key in ("label_prefix", "worker_prefix"):
            if key in kwargs:
                v = kwargs[key]
                _need(
                    isinstance(v, str)
                    and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v) is not None,
                    key,
                    f"must be a non-empty name of letters, digits, '_', '.', '-', got {v!r}",
                )
                out[key] = v
        for key in ("publish_timeout", "stage_timeout"):
            if key in kwargs:
                out[key] = _seconds(key, kwargs[key])
        cfg = cls(**out)
        object.__setattr__(cfg, "world_size", world)
        if not cfg.worker_prefix:
            object.__setattr__(cfg, "worker_prefix", f"{cfg.label_prefix}-rollout")
        return cfg


class MxReceiveError(RuntimeError):
    """A rollout rank's pull of a version failed or did not verify; nothing was yielded, the
    rollout keeps the weights it had.

    Attributes:
        label: the version's label.
        code: mx's error code (``DataLoss``: bytes that do not verify; ``DeadlineExceeded``:
            the version did not become READY in ``stage_timeout``; ``NotFound``, ...).
    """

    def __init__(self, label: str, code: str, message: str) -> None:
        super().__init__(f"mx pull of {label} failed ({code}): {message}")
        self.label, self.code = label, code


@dataclass
class Suspension:
    """What :func:`suspended_full_tensor` saw: ``full_tensor`` calls answered without a gather,
    and the ids of the DTensors ``.to(...)`` copied."""

    calls: int = 0
    copies: set[int] = field(default_factory=set)


def _caller_name() -> str:
    """The ``name`` local of verl's generator expression calling ``full_tensor`` (for the
    message of a refusal), or ``"?"``."""
    with contextlib.suppress(Exception):
        name = sys._getframe(2).f_locals.get("name")
        if isinstance(name, str):
            return name
    return "?"


@contextlib.contextmanager
def suspended_full_tensor() -> Iterator[Suspension]:
    """While open, ``DTensor.full_tensor()`` returns the DTensor itself (no all-gather), and
    ``DTensor.to(...)`` records when it made a copy. Both are restored in ``finally``. A class
    attribute of torch's: iterate one generator at a time per process.

    Raises (from ``full_tensor`` inside):
        ValueError: a 3-D (packed MoE experts) DTensor, which verl's ``unfuse_moe_params``
            would split into new per-expert tensors (each split a collective): refused before.
    """
    from torch.distributed.tensor import DTensor

    seen = Suspension()
    full = DTensor.__dict__.get("full_tensor")
    own_to = DTensor.__dict__.get("to")
    base_to = DTensor.to

    def full_tensor(self: Any, *, grad_placements: Any = None) -> Any:
        if self.dim() == 3:
            raise ValueError(
                f"parameter {_caller_name()!r} {list(self.shape)}: packed MoE experts, which "
                "verl's unfuse_moe_params splits into new per-expert tensors (a collective "
                "each): mx publishes parameters in place only (publish such a trainer with "
                "mx.Publisher.set_params)"
            )
        seen.calls += 1
        return self

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base_to(self, *args, **kwargs)
        if out is not self:
            seen.copies.add(id(out))
        return out

    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    DTensor.to = to  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        DTensor.full_tensor = full  # type: ignore[method-assign]
        if own_to is None:
            del DTensor.to
        else:
            DTensor.to = own_to  # type: ignore[method-assign]


class _Staged:
    """The staged version as verl's installer takes it: ``(name, tensor)`` views of one host
    buffer holding the rank's bytes, iterable and async-iterable."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self._items = items

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items)

    async def __aiter__(self) -> Any:
        for item in self._items:
            yield item

    def __len__(self) -> int:
        return len(self._items)


_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@CheckpointEngineRegistry.register(BACKEND)
class MxCheckpointEngine(CheckpointEngine):
    """mx behind verl's ``CheckpointEngine`` (see :mod:`mx.verl`).

    Built by verl: ``CheckpointEngineRegistry.new("mx", is_master=..., bucket_size=...,
    **engine_kwargs["mx"])`` on every actor rank (engine_workers.py), ``new("mx",
    bucket_size=..., **engine_kwargs["mx"])`` on every rollout worker (base.py's
    ``CheckpointEngineWorker``): ``is_master`` is passed to actor engines only, so its
    absence makes this the rollout side.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes << 20``. mx does not bucket
            (each rank's bytes move as NIXL regions); verl's own ``BucketedWeightSender``
            re-buckets what ``receive_weights`` yields. Where that path cannot take a tensor
            larger than a bucket (shared memory, no CUDA IPC), ``receive_weights`` refuses
            before pulling, naming the tensor and the size needed.
        is_master: actor side: whether this is rank 0 (it declares each version).
        **kwargs: ``engine_kwargs.mx`` (:data:`ENGINE_KWARGS`).

    Raises:
        ValueError: a key unknown, missing or out of its domain (named), a bad bucket size.

    Attributes:
        role: ``"actor"`` or ``"rollout"``.
        rank: this worker's rank in its group (``None`` before ``prepare`` /
            ``init_process_group``).
        label, version_id: the last version sent or received (``""`` before).
        last_metrics: what the last ``send_weights`` / ``receive_weights`` measured.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool | None = None, **kwargs: Any) -> None:
        ok = isinstance(bucket_size, int) and not isinstance(bucket_size, bool) and bucket_size > 0
        if not ok:
            raise ValueError(
                f"bucket_size (update_weights_bucket_megabytes << 20) must be a positive int, "
                f"got {bucket_size!r}"
            )
        if is_master is not None and not isinstance(is_master, bool):
            raise ValueError(f"is_master must be a bool, got {is_master!r}")
        self.config = EngineConfig.parse(kwargs)
        self.model = Model.from_dir(self.config.model)
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.role = "rollout" if is_master is None else "actor"
        self.rank: int | None = None
        self.sync = ""
        self.label = ""
        self.version_id = ""
        self.last_metrics: dict[str, float] = {}
        self._syncs = 0
        self._run = secrets.token_hex(3)
        self._topology: dict[str, Any] | None = None
        self._control_client: Control | None = None
        self._publisher: Publisher | None = None
        self._ptrs: dict[str, int] = {}
        self._held = ""  # a label published and not handed back
        self._puller: Puller | None = None
        self._buffer: torch.Tensor | None = None

    @property
    def _control(self) -> Control:
        """The control plane's client, connected on first use (not at construction)."""
        if self._control_client is None:
            self._control_client = Control(self.config.control_url, timeout=60.0)
        return self._control_client

    # --- topology ---------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """This worker's metadata for ``build_topology``: ``role``, ``rank`` (an actor's
        ``torch.distributed`` rank), ``layout``, ``is_master``, ``sync`` (the master's new sync
        number), ``agent`` (an actor's NIXL agent), ``host``, ``pid``. An actor also releases
        a version a failed sync left held.

        Raises:
            ValueError: the actor world size is not the layout's N.
            MxError: the control plane is unreachable (an actor's publisher).
        """
        self._release_held()
        meta: dict[str, Any] = {
            "role": self.role,
            "rank": None,
            "layout": self.config.layout,
            "is_master": self.is_master,
            "sync": None,
            "agent": None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if self.role == "actor":
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            _need(
                world == self.config.world_size,
                "layout",
                f"{self.config.layout} names {self.config.world_size} ranks, the actor "
                f"group has {world}",
            )
            self.rank = rank
            if self._publisher is None:
                self._publisher = Publisher(
                    self.config.control_url, model=self.model, layout=self.config.layout, slot=rank
                )
            meta.update(rank=rank, agent=self._publisher.agent_name)
            if self.is_master:
                self._syncs += 1
                meta["sync"] = f"{self._run}.{self._syncs}"
        return meta

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank r publishes slot r of the layout; rollout rank r pulls as
        ``<worker_prefix>-<r>``. Every list has its group's length (the manager asserts it).

        Raises:
            ValueError: metadata out of order (actors first, by rank), not exactly one master,
                or a layout disagreeing with the actor world size.
        """
        a, r = actor_wg_world_size, rollout_world_size
        if len(metadata) != a + r:
            raise ValueError(f"mx build_topology: {len(metadata)} metadata for {a} + {r} workers")
        actors, rollouts = metadata[:a], metadata[a:]
        for k, m in enumerate(actors):
            if m.get("role") != "actor" or m.get("rank") != k:
                raise ValueError(f"mx build_topology: actor {k}'s metadata is {m}")
        for k, m in enumerate(rollouts):
            if m.get("role") != "rollout":
                raise ValueError(f"mx build_topology: rollout {k}'s metadata is {m}")
        masters = [m for m in actors if m.get("is_master")]
        if len(masters) != 1 or not masters[0].get("sync"):
            raise ValueError(f"mx build_topology: {len(masters)} master actors (need 1)")
        layouts = {m.get("layout") for m in metadata}
        _, n = parse_layout(masters[0]["layout"])
        if len(layouts) != 1 or n != a:
            raise ValueError(
                f"mx build_topology: layouts {sorted(map(str, layouts))} for {a} actor ranks"
            )
        sync = masters[0]["sync"]
        actor_kwargs = {
            "role": ["actor"] * a,
            "rank": list(range(a)),
            "world_size": [a] * a,
            "sync": [sync] * a,
            "peers": [rollouts] * a,
        }
        rollout_kwargs = {
            "role": ["rollout"] * r,
            "rank": list(range(r)),
            "world_size": [r] * r,
            "sync": [sync] * r,
            "peers": [actors] * r,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(
        self, role: str, rank: int, world_size: int, sync: str, peers: list[dict]
    ) -> None:
        """Records this worker's place in the sync (mx has no process group: actors and
        rollouts meet on the control plane, bytes move over NIXL). A rollout rank registers
        its layout with the control plane here, so every actor cuts for it when it publishes.

        Raises:
            ValueError: a role or rank other than this worker's.
            MxError: the control plane refused the rollout worker id (held by a live process).
        """
        if role != self.role or (self.role == "actor" and rank != self.rank):
            raise ValueError(
                f"mx init_process_group: assigned {role} rank {rank}, this is {self.role} "
                f"rank {self.rank}"
            )
        self._topology = {"world_size": world_size, "peers": peers}
        self.sync = str(sync)
        if self.role == "rollout":
            if self._puller is not None and self.rank != rank:
                self._puller.close()
                self._puller = None
            self.rank = rank
            if self._puller is None:
                self._puller = Puller(
                    self.config.control_url,
                    model=self.model,
                    layout="replicated:1",
                    ranks=[0],
                    worker_id=f"{self.config.worker_prefix}-{rank}",
                    retain=False,
                )

    def _label(self, global_steps: int | None) -> str:
        if not self.sync:
            raise RuntimeError(
                f"mx {self.role} engine: no sync (call prepare, build_topology and "
                "init_process_group first, as verl's CheckpointEngineManager does)"
            )
        step = "" if global_steps is None else f"-g{int(global_steps)}"
        return f"{self.config.label_prefix}{step}-s{self.sync}"

    def _need_role(self, role: str, what: str) -> None:
        if self.role != role:
            raise RuntimeError(f"mx {what} runs on the {role} side; this engine is {self.role}'s")

    # --- actor ------------------------------------------------------------------------------
    def _shards(self, weights: Any) -> tuple[dict[str, tuple[torch.Tensor, list[int]]], int]:
        """This rank's shard of every parameter verl's generator yields (views of the
        parameters' memory) with their global offsets, and the suspended ``full_tensor``
        calls; nothing is gathered.

        Raises:
            ValueError: a parameter mx cannot publish in place, named.
            TypeError: an async iterator.
        """
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if hasattr(weights, "__aiter__") and not hasattr(weights, "__iter__"):
            raise TypeError(
                "mx reads verl's per-tensor generator (get_per_tensor_param) in place; an async "
                "iterator would run other code while full_tensor is suspended"
            )
        kind, world = parse_layout(self.config.layout)
        specs = {t.name: t for t in self.model.tensors}
        out: dict[str, tuple[torch.Tensor, list[int]]] = {}
        seen: set[str] = set()
        with suspended_full_tensor() as sus:
            for name, t in weights:
                what = f"parameter {name!r} (actor rank {self.rank}, layout {self.config.layout})"
                spec = specs.get(name)
                if spec is None:
                    if _EXPERT.search(name):
                        raise ValueError(
                            f"{what}: a per-expert tensor verl's unfuse_moe_params split from "
                            "packed experts (new memory): mx publishes parameters in place only"
                        )
                    raise ValueError(f"{what}: the model {self.model} has no tensor of that name")
                if name in seen:
                    raise ValueError(f"{what}: yielded twice")
                seen.add(name)
                dtype = _DTYPES.get(str(t.dtype).removeprefix("torch."))
                if dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
                    raise ValueError(
                        f"{what}: {t.dtype} {list(t.shape)}, the model's is {spec.dtype} "
                        f"{list(spec.shape)}"
                    )
                if isinstance(t, DTensor):
                    if kind != "fsdp":
                        raise ValueError(f"{what}: a DTensor under a {kind} layout")
                    if id(t) in sus.copies:
                        raise ValueError(
                            f"{what}: verl's .to(device) copied it (e.g. FSDP2 CPU offload "
                            "onto an accelerator): mx publishes the parameter's own memory"
                        )
                    mesh, placements = t.device_mesh, tuple(t.placements)
                    if mesh.ndim != 1 or mesh.size() != world or placements != (Shard(0),):
                        raise ValueError(
                            f"{what}: placements {placements} over a mesh of shape "
                            f"{tuple(mesh.shape)}; {self.config.layout} is Shard(0) over "
                            f"{world} ranks"
                        )
                    if mesh.get_local_rank() != self.rank:
                        raise ValueError(
                            f"{what}: mesh rank {mesh.get_local_rank()}, this is rank {self.rank}"
                        )
                    local = t.to_local()
                    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
                    if tuple(local.shape) != tuple(shape):
                        raise ValueError(f"{what}: local shard {list(local.shape)}, not {shape}")
                else:
                    if kind == "fsdp":
                        raise ValueError(
                            f"{what}: a plain tensor, not an FSDP2 DTensor shard (verl's "
                            "generator gathered it, or FSDP2 left the module unsharded)"
                        )
                    local, offset = t, (0,) * t.dim()
                if local.device.type != "cpu":
                    raise ValueError(f"{what}: on {local.device}; mx publishes host memory")
                if not local.is_contiguous():
                    raise ValueError(f"{what}: the local shard is not contiguous")
                if local.numel():
                    out[name] = (local.detach(), list(offset))
        missing = sorted(set(specs) - seen)
        if missing:
            raise ValueError(
                f"verl's generator left out {missing[0]!r} of the model ({len(missing)} missing)"
            )
        return out, sus.calls

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publishes this rank's shard of every parameter ``weights`` yields, in place, as the
        sync's version (the master declares it first) and returns once every actor rank
        published it (READY). Do not write the shards until ``finalize``.

        Returns:
            verl's per-sync metrics: ``mx/publish_s``, ``mx/shard_bytes`` (this rank's),
            ``mx/tensors``, ``mx/suspended_full_tensor_calls``.

        Raises:
            ValueError: a parameter mx cannot publish in place (named).
            RuntimeError: not an actor engine, or no sync set up.
            MxError: publishing failed (e.g. ``DeadlineExceeded`` waiting for the other ranks).
        """
        self._need_role("actor", "send_weights")
        label = self._label(global_steps)
        t0 = time.perf_counter()
        shards, calls = self._shards(weights)
        assert self._publisher is not None  # made by prepare, which _label required
        ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
        if ptrs != self._ptrs:
            self._publisher.set_shards(shards)  # registers new memory only
            self._ptrs = ptrs
        if self.is_master:
            self._control.declare(label, self.model.tensors, trainer_layout=self.config.layout)
        timeout = self.config.publish_timeout
        vid = await asyncio.to_thread(self._publisher.publish, label, timeout=timeout)
        self._held, self.label, self.version_id = label, label, vid
        nbytes = sum(t.numel() * t.element_size() for t, _ in shards.values())
        self.last_metrics = {
            "mx/publish_s": time.perf_counter() - t0,
            "mx/shard_bytes": float(nbytes),
            "mx/tensors": float(len(shards)),
            "mx/suspended_full_tensor_calls": float(calls),
        }
        return dict(self.last_metrics)

    def _release_held(self) -> None:
        if self._held and self._publisher is not None:
            with contextlib.suppress(MxError):
                self._publisher.release(self._held, timeout=60.0)
        self._held = ""

    # --- rollout ----------------------------------------------------------------------------
    def _check_buckets(self) -> None:
        from verl.utils.device import is_support_ipc

        if is_support_ipc():
            return  # verl's sender hands a larger tensor over by CUDA IPC, unbucketed
        size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "F64": 8, "I32": 4, "U8": 1, "I8": 1}
        for t in self.model.tensors:
            n = math.prod(t.shape) * size.get(t.dtype, 4)
            if n > self.bucket_size:
                mib = -(-n // (1 << 20))
                raise ValueError(
                    f"checkpoint_engine.update_weights_bucket_megabytes: tensor {t.name!r} is "
                    f"{n} bytes, more than a bucket ({self.bucket_size}); verl's shared-memory "
                    f"path (no CUDA IPC here) cannot take it: set it to at least {mib}"
                )

    def receive_weights(self, global_steps: int | None = None) -> _Staged:  # type: ignore[override]
        """Stages the sync's version for this rank, NOW (before returning): waits until every
        actor rank published it, pulls exactly this rank's bytes over NIXL and verifies every
        region's digest, then copies them into one host buffer. Returns ``(name, tensor)``
        views of it in checkpoint order (iterable and async-iterable) for verl's installer;
        they stay valid until ``finalize``.

        verl's ``CheckpointEngineWorker`` calls this without awaiting and hands the result to
        ``ServerAdapter.update_weights``: a failure raises here, before the adapter opens its
        transfer to the vLLM workers, so nothing reaches the installer.

        Raises:
            MxReceiveError: the version did not become READY in ``stage_timeout``, a pull
                failed, or bytes did not verify (``code``: ``DataLoss``).
            ValueError: a tensor larger than verl's bucket where its path cannot take one.
            RuntimeError: not a rollout engine, or no sync set up.
        """
        self._need_role("rollout", "receive_weights")
        label = self._label(global_steps)
        self._check_buckets()
        assert self._puller is not None  # made by init_process_group, which _label required
        self._buffer = None
        t0 = time.perf_counter()
        try:
            self._control.wait_version(label, timeout=self.config.stage_timeout)
            report = self._puller.stage(label)
            params = self._puller.params(0)
            buf = torch.empty(sum(p.nbytes for p in params), dtype=torch.uint8)
            self._puller.copy_staged(report.version_id, 0, buf)
        except MxError as e:
            raise MxReceiveError(label, str(getattr(e, "code", None) or "Unknown"), str(e)) from e
        items = []
        for p in params:
            t = buf[p.offset : p.offset + p.nbytes].view(_TORCH[p.dtype]).view(p.shape)
            items.append((p.name, t))
        self._buffer = buf
        self.label, self.version_id = label, report.version_id
        self.last_metrics = {
            "mx/receive_s": time.perf_counter() - t0,
            "mx/pull_s": report.pull_s,
            "mx/verify_s": report.verify_s,
            "mx/wire_bytes": float(report.wire_bytes),
        }
        return _Staged(items)

    # --- both -------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Ends the sync: an actor hands its version back (its shards may be written again), a
        rollout drops the buffer it yielded from (staging stays allocated for the next)."""
        self._release_held()
        self._buffer = None
        self._topology = None
        self.sync = ""

    def close(self) -> None:
        """Closes the publisher or puller (the memory stays the caller's). Idempotent."""
        self._release_held()
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._puller is not None:
            self._puller.close()
            self._puller = None
