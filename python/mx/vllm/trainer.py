"""mx behind vLLM's trainer-side weight-transfer API: the trainer engine ``"mx"``.

vLLM 0.32 lets a trainer pick its weight-sync path by name: an init info whose ``backend`` names
an engine registered in ``WeightTransferTrainerFactory``, built on every trainer rank by
``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``, then
``engine.send_weights()`` after each optimizer step. Importing this module registers mx's engine
there under ``"mx"`` (vLLM has no entry point for the trainer side; :func:`mx.vllm.register`,
vLLM's general plugin, registers it too)::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from mx.vllm.trainer import MxTrainerInitInfo

    info = MxTrainerInitInfo(control_url, "vllm-a", "fsdp:2", model_dir, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(server_url), source=ModuleSource(fsdp_module))
    for step in ...:
        train_step()
        engine.send_weights()          # every rank; raises MxRefitError if the fleet rolled back

The contract (who does what):

- **Nothing is gathered.** The source must be vLLM's ``ModuleSource`` over the trainer's module;
  mx never iterates it (its ``__iter__`` calls ``full_tensor()``, an all-gather). Each rank hands
  the local shard of every parameter (``DTensor.to_local()``: FSDP2's dim-0 rows, in place) to an
  :class:`mx.Publisher` once, at ``trainer_init``; every ``send_weights`` publishes the shards'
  current bytes from that memory (no copy), and inference workers pull exactly their byte ranges
  over NIXL. Any other source, placement or layout is refused at ``trainer_init`` with the
  parameter at fault named.
- **Who drives.** ``trainer_init`` and ``send_weights`` run on every trainer rank. Every rank
  publishes its shards. Only the sender (``rank == 0``) touches the vLLM client (once, at
  ``trainer_init``: ``init_weight_transfer_engine`` with mx's server-side init info, so the
  server's workers register with mx's control plane) and drives the control plane (declare,
  refit). The other ranks talk to the control plane only as publishers of their shards and to
  read the refit's outcome, so every rank returns or raises alike, with no collective.
- **Who pauses, installs and commits.** mx's control plane, in one refit of every server this
  trainer process initialized: STAGE (the servers pull and verify while they generate), then
  pause, install (vLLM's own ``start_weight_update`` / ``update_weights {"version_id"}`` /
  ``finish_weight_update`` session on each server, called by the control plane), prefix-cache
  reset, read-back, resume, the post-update check (``check_prompt``, or the expected outputs
  published with the version), and COMMIT; or the whole fleet rolls back.
  The engine never calls the client's ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` itself (that would install twice).
- **Several servers.** vLLM's API gives one client, so one engine, per server. The engines of
  one trainer process with the same control plane, layout and rank share one publication: the
  first ``send_weights`` of a step publishes a new version and refits every server of those
  engines at once; the other engines' ``send_weights`` of the same step find their server
  already in that refit and return its result (raise its failure) without publishing or
  installing again.
- **What a failure leaves.** A refit that does not commit (ABORTED, ROLLED_BACK, FENCED) raises
  :class:`MxRefitError` on every rank with the control plane's reason: every server is back on
  the version it served before (a FENCED worker stays out of rollouts until a later refit), the
  published version is handed back (the trainer may write its shards again) and the next
  ``send_weights`` publishes a new one. A sender that fails after publishing but before the
  refit starts releases the version, so the other ranks raise too rather than wait; one that
  fails before publishing (the declaration refused, the process gone) leaves them waiting until
  ``publish_timeout``, then raising ``MxError`` (``DeadlineExceeded``).
- **Restarts.** A restarted trainer builds its engines again with the same init infos: a server
  already following the control plane with the same init accepts it unchanged (its version, its
  rollback copy, its registration); another init is refused with the fields that differ (raised
  here as ``RuntimeError`` with the server's reason). Labels continue after the last
  ``<label_prefix>-<n>`` the control plane holds READY or later. ``shutdown()`` leaves the
  servers as they are.
- **Tokens.** A rank's publisher and control client hold different roles
  (``publisher_token_file``, ``orchestrator_token_file``); each falls back to the process's
  ``MX_CONTROL_TOKEN`` / ``MX_CONTROL_TOKEN_FILE``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from .._control import Control
from .._http import url_problem
from .._memory import _DTYPES
from .._model import Model
from .._publisher import Publisher
from .._types import GenerationCheck, RefitResult
from . import BACKEND

LAYOUT_KINDS = ("fsdp", "replicated")
"""Trainer layouts this engine publishes: ``fsdp:N`` (FSDP2 dim-0 shards) and ``replicated:N``
(every rank holds whole tensors; plain, non-DTensor parameters)."""

PAUSE_MODES = ("keep", "wait", "abort")
SERVER_FIELDS = ("control_url", "instance_id", "engine_url")


def _need(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"mx trainer init_info.{name}: {what}")


def _parse_layout(layout: str) -> tuple[str, int]:
    """``("fsdp" | "replicated", N)`` of ``layout``.

    Raises:
        ValueError: another layout kind, or a world size that is not a positive integer.
    """
    _need(isinstance(layout, str), "layout", f"must be a str such as 'fsdp:2', got {layout!r}")
    kind, _, n = layout.partition(":")
    _need(
        kind in LAYOUT_KINDS and n.isascii() and n.isdigit() and int(n) > 0,
        "layout",
        f"must be fsdp:N or replicated:N (N >= 1), got {layout!r} (a Megatron-Core trainer "
        "publishes with mx.Publisher.set_params)",
    )
    return kind, int(n)


@dataclass
class MxTrainerInitInfo(TrainerInitInfo):
    """The trainer-side init info of mx's engine (``backend = "mx"``), one per vLLM server.

    Attributes:
        control_url: mx's control plane, ``http(s)://host:port``.
        instance_id: the instance id the client's server registers as (its workers are
            ``<instance_id>-tp<rank>``); distinct per server.
        layout: this trainer's layout, ``"fsdp:N"`` (FSDP2 over a 1-D mesh of N ranks, each
            parameter a DTensor ``Shard(0)``) or ``"replicated:N"`` (plain tensors).
        model: the checkpoint directory (config.json + safetensors headers) or an
            :class:`mx.Model`: the names, dtypes and global shapes every version declares.
        engine_url: the server's base URL as the control plane reaches it; empty: the client's
            ``base_url`` (``HTTPVLLMWeightSyncClient``).
        rank: this trainer process's rank (keyword-only; rank 0 is the sender).
        label_prefix: versions are labelled ``<label_prefix>-<n>``; n continues after the
            highest ``<label_prefix>-<n>`` the control plane holds READY or later (so a
            restarted trainer goes on where it left off: 1 on a fresh control plane). One
            trainer per prefix on a control plane.
        pause_mode: how the servers hold in-flight requests at the safe point: ``"keep"``,
            ``"wait"`` or ``"abort"``.
        publish_timeout: seconds a publish may wait for the declaration and every rank.
        stage_timeout: seconds the refit's STAGE phase may take (the servers' pulls).
        call_timeout: seconds each engine call of the refit may take (pause, install, ...).
        register_timeout: seconds the sender waits at ``trainer_init`` for the server's
            workers to register with the control plane.
        server_options: further fields of the server's init info (:class:`mx.vllm._engine.
            MxInitInfo`: ``prepare``, ``install``, ``retain``, ``fill_nan``, ...).
        check_prompt: token ids of a post-update check: after installing, before resuming
            rollouts, every server decodes ``check_tokens`` greedy tokens after it, and a
            server that fails to rolls the refit back. Empty (the default): the check of the
            expected outputs published with the version, if any.
        check_tokens: how many tokens the check decodes (1..1024).
        publisher_token_file: a file holding the token this rank's :class:`mx.Publisher`
            presents to a control plane that checks tokens (a ``publisher`` principal, scoped
            to this rank's slot if you like); empty: the process's ``MX_CONTROL_TOKEN`` /
            ``MX_CONTROL_TOKEN_FILE``.
        orchestrator_token_file: a file holding the token this rank's control client presents:
            an ``orchestrator`` principal's on the sender (it declares, lists workers, starts
            the refit), an ``orchestrator`` or ``reader`` principal's on the other ranks (they
            wait for the refit); empty: the process's token. A control plane that checks
            tokens needs at least one of the two files, since one token has one role.

    Raises (at construction):
        ValueError: a field out of its domain, named (``mx trainer init_info.<field>: ...``).
    """

    backend: ClassVar[str] = BACKEND

    control_url: str
    instance_id: str
    layout: str
    model: str | os.PathLike[str] | Model
    engine_url: str = ""
    label_prefix: str = "step"
    pause_mode: str = "wait"
    publish_timeout: float = 600.0
    stage_timeout: float = 300.0
    call_timeout: float = 120.0
    register_timeout: float = 60.0
    server_options: dict[str, Any] = field(default_factory=dict)
    check_prompt: tuple[int, ...] | list[int] = ()
    check_tokens: int = 8
    publisher_token_file: str = ""
    orchestrator_token_file: str = ""

    def __post_init__(self) -> None:
        r = self.rank
        _need(isinstance(r, int) and not isinstance(r, bool) and r >= 0, "rank", f"got {r!r}")
        for name in ("control_url", "instance_id"):
            v = getattr(self, name)
            _need(isinstance(v, str) and v != "", name, f"must be a non-empty str, got {v!r}")
        bad = url_problem(self.control_url)
        _need(bad is None, "control_url", str(bad))
        v = self.engine_url
        bad = None if v == "" else url_problem(v)
        _need(
            bad is None,
            "engine_url",
            f"the server's http(s) URL or empty (the client's base_url): {bad}",
        )
        _, world = _parse_layout(self.layout)
        _need(r < world, "rank", f"{r} is outside layout {self.layout} (ranks 0..{world - 1})")
        m = self.model
        if not isinstance(m, Model):
            _need(
                isinstance(m, (str, os.PathLike)),
                "model",
                f"must be a checkpoint directory or an mx.Model, got {type(m).__name__}",
            )
            config = os.path.join(os.fspath(m), "config.json")
            _need(os.path.isfile(config), "model", f"{os.fspath(m)!r} has no config.json")
        v = self.label_prefix
        _need(isinstance(v, str) and v.strip() != "", "label_prefix", f"empty: {v!r}")
        _need(self.pause_mode in PAUSE_MODES, "pause_mode", f"must be one of {PAUSE_MODES}")
        for name in ("publish_timeout", "stage_timeout", "call_timeout", "register_timeout"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            _need(ok, name, f"must be a positive number of seconds, got {v!r}")
        opts = self.server_options
        _need(isinstance(opts, dict), "server_options", f"must be a dict, got {opts!r}")
        clash = sorted(set(opts) & set(SERVER_FIELDS))
        _need(not clash, "server_options", f"{clash} are fields of their own here")
        p = self.check_prompt
        _need(
            isinstance(p, (tuple, list))
            and len(p) <= 4096
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p),
            "check_prompt",
            f"must be up to 4096 token ids (ints >= 0), got {p!r}",
        )
        n = self.check_tokens
        ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024
        _need(ok, "check_tokens", f"must be an int in 1..1024, got {n!r}")
        for name in ("publisher_token_file", "orchestrator_token_file"):
            v = getattr(self, name)
            _need(
                isinstance(v, (str, os.PathLike)) and (v == "" or os.path.isfile(v)),
                name,
                f"must be a readable file holding a control-plane token, or empty: {v!r}",
            )
            if v != "":
                _need(_token_file_ok(v), name, f"{os.fspath(v)!r} holds no token: {_TOKEN_RULE}")
        # The server's init info is checked here too, so a bad option fails on the trainer.
        self.server_init_info("http://engine.invalid")

    def server_init_info(self, engine_url: str) -> dict[str, Any]:
        """The ``init_info`` the sender hands the server (mx's
        :class:`~mx.vllm._engine.MxInitInfo`, as a dict), with ``engine_url`` unless set here.

        Raises:
            ValueError: the server would refuse it (its field named).
        """
        from ._engine import MxInitInfo

        info = {
            "control_url": self.control_url,
            "instance_id": self.instance_id,
            "engine_url": self.engine_url or engine_url,
            **self.server_options,
        }
        try:
            MxInitInfo(**info)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mx trainer init_info.server_options: {e}") from None
        return info

    def mx_model(self) -> Model:
        """:attr:`model` as an :class:`mx.Model`."""
        return self.model if isinstance(self.model, Model) else Model.from_dir(self.model)


_TOKEN_RULE = "a token is at least 24 printable ASCII characters (no spaces)"
# Publication-wide fields: engines sharing a publication (same control plane, layout and rank)
# refit together, so these must agree; the rest is per server.
_PER_SERVER = ("instance_id", "engine_url", "server_options", "register_timeout")


def _token_file_ok(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds one token as the control plane's clients read it (surrounding
    whitespace trimmed)."""
    try:
        with open(path, "rb") as f:
            t = f.read(4096).strip()
    except OSError:
        return False
    return len(t) >= 24 and all(0x21 <= b <= 0x7E for b in t)


class MxRefitError(RuntimeError):
    """A ``send_weights`` whose refit did not commit: every server is back on its previous
    version (or fenced), the published version is handed back.

    Attributes:
        label: the version's label.
        version_id: its id (``mx:<hex>``), or ``""`` when the publish did not complete.
        outcome: ``"ABORTED"``, ``"ROLLED_BACK"``, ``"FENCED"``, ``"NOT_STARTED"`` (the
            refit never started: the version was handed back), or ``"NOT_ENDED"`` (the refit
            was still running after ``stage_timeout + 8 * call_timeout + 60`` seconds: it may
            yet commit or roll back, read it with ``mx.Control.wait_refit``; the version is
            not handed back until it ends).
        reason: the control plane's message (or why the refit never started).
        result: the control plane's record of the refit, where there was one.
    """

    def __init__(
        self,
        label: str,
        version_id: str,
        outcome: str,
        reason: str,
        result: RefitResult | None = None,
    ) -> None:
        super().__init__(
            f"mx refit of {label} ({version_id or 'unpublished'}) ended {outcome}: {reason}"
        )
        self.label, self.version_id, self.outcome = label, version_id, outcome
        self.reason, self.result = reason, result


def _local_shards(
    module: torch.nn.Module, info: MxTrainerInitInfo, model: Model
) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Every parameter's local shard on this rank (a view of its memory) with the global offset
    of its box; no collective. Empty shards are left out.

    Raises:
        ValueError: a parameter the model lacks (or the reverse), a dtype or global shape other
            than the model's, a placement the layout does not describe, a plain tensor under
            ``fsdp:N`` (e.g. FSDP2 left the module unsharded: call ``module.reshard()``).
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    kind, world = _parse_layout(info.layout)
    specs = {t.name: t for t in model.tensors}
    out: dict[str, tuple[torch.Tensor, list[int]]] = {}
    seen = set()
    for name, p in module.named_parameters():
        what = f"parameter {name!r} (rank {info.rank}, layout {info.layout})"
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"{what}: the model {model} has no tensor of that name")
        seen.add(name)
        dtype = _DTYPES.get(str(p.dtype).removeprefix("torch."))
        if dtype != spec.dtype or tuple(p.shape) != tuple(spec.shape):
            raise ValueError(
                f"{what}: {p.dtype} {list(p.shape)}, the model's is {spec.dtype} {list(spec.shape)}"
            )
        if isinstance(p, DTensor):
            mesh, placements = p.device_mesh, tuple(p.placements)
            if kind != "fsdp" or mesh.ndim != 1 or placements != (Shard(0),):
                raise ValueError(
                    f"{what}: a DTensor placed {placements} on a {mesh.ndim}-D mesh; mx reads "
                    "FSDP2 dim-0 shards (Shard(0) on a 1-D mesh) under layout fsdp:N in place"
                )
            if mesh.size() != world or mesh.get_local_rank() != info.rank:
                raise ValueError(
                    f"{what}: this process is rank {mesh.get_local_rank()} of a mesh of "
                    f"{mesh.size()}, init_info says rank {info.rank} of {world}"
                )
            local = p.to_local()
            shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
            if tuple(local.shape) != tuple(shape):
                raise ValueError(f"{what}: local shard {list(local.shape)}, expected {list(shape)}")
        else:
            if kind != "replicated":
                raise ValueError(
                    f"{what}: a plain tensor, not an FSDP2 DTensor shard (a module FSDP2 left "
                    "unsharded after a forward without backward: call module.reshard() first)"
                )
            local, offset = p, (0,) * p.dim()
        if local.numel() == 0:
            continue
        out[name] = (local.detach(), list(offset))
    missing = sorted(set(specs) - seen)
    if missing:
        raise ValueError(
            f"the module has no parameter {missing[0]!r} of the model ({len(missing)} missing)"
        )
    return out


def _check_world(layout: str, world: int) -> None:
    """Raises ValueError when ``replicated:N`` disagrees with the trainer's process count
    (torch.distributed's world size; 1 when it is not initialized): the version would wait for
    ranks that never publish."""
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size != world:
        raise ValueError(
            f"mx trainer init_info.layout: {layout} names {world} publishing ranks, the trainer "
            f"runs {size} (torch.distributed's world size"
            f"{'' if size > 1 else ', not initialized: 1'}); every rank publishes under "
            "replicated:N"
        )


class ControlPlaneHalted(RuntimeError):
    """The control plane refuses to act on its fleet (``FleetStatus.halted``): it found the
    fleet contradicting its journal; an operator decides (operator.md, "The journal")."""


def _module_of(source: WeightSource | None) -> torch.nn.Module:
    """The module of vLLM's ``ModuleSource``, read in place (never iterated: a gather).

    Raises:
        ValueError: no source.
        TypeError: a source other than ``ModuleSource``.
    """
    if source is None:
        raise ValueError(
            "mx publishes the trainer's own tensors: pass source=ModuleSource(module) "
            "(per-round payloads to send_weights are not supported)"
        )
    module = getattr(source, "_module", None)
    if not isinstance(source, ModuleSource) or not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"mx reads a vLLM ModuleSource's parameters in place; a {type(source).__name__} "
            "yields materialized tensors (for FSDP a gather), which mx refuses: pass "
            "ModuleSource(module), or publish with mx.Publisher directly"
        )
    return module


def _same_refit_options(info: MxTrainerInitInfo, first: MxTrainerInitInfo) -> None:
    """Raises ValueError naming each publication-wide field in which ``info`` differs from the
    first engine's (they refit one fleet together, with one label, refit and check)."""
    from dataclasses import fields

    differ = [
        f"{f.name} {getattr(first, f.name)!r} -> {getattr(info, f.name)!r}"
        for f in fields(MxTrainerInitInfo)
        if f.name not in _PER_SERVER and getattr(info, f.name) != getattr(first, f.name)
    ]
    if differ:
        raise ValueError(
            f"mx trainer init_info: the engines of one trainer process with the same control "
            f"plane, layout and rank share one publication and refit their servers together, "
            f"so only {list(_PER_SERVER)} may differ between them; this one differs from the "
            f"first ({first.instance_id!r}) in {', '.join(differ)}"
        )


def _last_number(control: Control, prefix: str) -> int:
    """The highest n of the versions labelled ``<prefix>-<n>`` that reached READY or later on
    the control plane (0: none). Versions still DECLARED or PUBLISHING do not count: every
    rank reads the same n whether or not the sender has declared the next one, and a version a
    dead trainer left unfinished is published again under its label."""
    head = f"{prefix}-"
    last = 0
    for v in control.status().versions:
        n = v.label[len(head) :] if v.label.startswith(head) else ""
        if n.isascii() and n.isdigit() and str(v.state) not in ("DECLARED", "PUBLISHING"):
            last = max(last, int(n))
    return last


@dataclass
class _Round:
    """One publication and its refit."""

    number: int
    label: str
    version_id: str
    instances: frozenset[str]
    outcome: str
    reason: str
    result: RefitResult | None


class _Publication:
    """What the engines of one trainer process share per (control plane, layout, rank): the
    publisher of this rank's shards, the servers (instances) to refit, the rounds."""

    _all: ClassVar[dict[tuple[str, str, int], _Publication]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, info: MxTrainerInitInfo, model: Model, shards: dict[str, Any]) -> None:
        self.key = (info.control_url, info.layout, info.rank)
        self.info, self.model = info, model
        self.ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
        self.control = Control(
            info.control_url, timeout=60.0, token_file=info.orchestrator_token_file or None
        )
        self.publisher = Publisher(
            info.control_url,
            model=model,
            layout=info.layout,
            slot=info.rank,
            token_file=info.publisher_token_file or None,
        )
        try:
            self.publisher.set_shards(shards)
            # The number of the last version labelled <prefix>-<n> (labels are never reused).
            self.published = _last_number(self.control, info.label_prefix)
        except BaseException:
            self.publisher.close()
            raise
        self.instances: list[str] = []
        self.engines = 0
        self.last: _Round | None = None
        self._send = threading.Lock()  # one round at a time, whatever thread calls

    @classmethod
    def join(cls, info: MxTrainerInitInfo, module: torch.nn.Module) -> _Publication:
        """The publication of ``info``'s key (made on first use), with ``info.instance_id``.

        Raises:
            ValueError: another engine of this process publishes another module or model under
                the same key, or already serves ``instance_id``.
        """
        key = (info.control_url, info.layout, info.rank)
        with cls._lock:
            pub = cls._all.get(key)
            if pub is None:
                model = info.mx_model()
                pub = cls(info, model, _local_shards(module, info, model))
                cls._all[key] = pub
            else:
                _same_refit_options(info, pub.info)
                shards = _local_shards(module, info, pub.model)
                ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
                if ptrs != pub.ptrs:
                    moved = sorted(n for n in ptrs if ptrs[n] != pub.ptrs.get(n))
                    raise ValueError(
                        f"engines of one trainer process share one publication per control "
                        f"plane, layout and rank: this source's parameter {moved[:1]} is not "
                        "the memory the first engine publishes"
                    )
            if info.instance_id in pub.instances:
                raise ValueError(
                    f"mx trainer init_info.instance_id: {info.instance_id!r} already has an "
                    "engine in this process"
                )
            pub.instances.append(info.instance_id)
            pub.engines += 1
            return pub

    def leave(self, instance_id: str) -> None:
        """Forgets ``instance_id``; the last engine to leave closes the publisher."""
        with self._lock:
            if instance_id in self.instances:
                self.instances.remove(instance_id)
                self.engines -= 1
            if self.engines == 0 and self._all.get(self.key) is self:
                del self._all[self.key]
                self.publisher.close()

    def workers(self, instances: list[str]) -> list[str]:
        """The connected worker ids of ``instances`` on the control plane.

        Raises:
            RuntimeError: an instance with no connected worker.
        """
        status = self.control.status()
        if status.halted:
            raise ControlPlaneHalted(
                f"the control plane at {self.info.control_url} is halted (no refit can run until "
                f"an operator acts: mx.Control.accept_journal or a restored journal): "
                f"{status.halted}"
            )
        out = []
        for inst in instances:
            ws = [w for w in status.workers if w.instance == inst and w.connected]
            if not ws:
                raise RuntimeError(
                    f"server instance {inst!r} has no worker connected to the control plane "
                    f"at {self.info.control_url}"
                )
            out += sorted(w.worker_id for w in ws)
        return out

    def check_unmoved(self, module: torch.nn.Module) -> None:
        """Raises ValueError when a published parameter's memory moved since trainer_init."""
        shards = _local_shards(module, self.info, self.model)
        moved = sorted(n for n, (t, _) in shards.items() if t.data_ptr() != self.ptrs.get(n))
        if moved:
            raise ValueError(
                f"parameter {moved[0]!r} was re-allocated since trainer_init ({len(moved)} "
                "moved): mx publishes the memory registered then; build the engines again"
            )

    def send(self, engine: MxTrainerWeightTransferEngine) -> _Round:
        """The round ``engine``'s ``send_weights`` belongs to: the last one when it refit the
        engine's server and the engine has not seen it, else a new one."""
        with self._send:
            last = self.last
            if last and engine.instance_id in last.instances and engine.round < last.number:
                return last
            self.check_unmoved(engine.module)
            self.published += 1
            number = self.published
            label = f"{self.info.label_prefix}-{number}"
            instances = frozenset(self.instances)
            rnd = self._publish_and_refit(number, label, engine.is_sender)
            self.last = _Round(number, label, rnd[0], instances, rnd[1], rnd[2], rnd[3])
            return self.last

    def _publish_and_refit(
        self, number: int, label: str, sender: bool
    ) -> tuple[str, str, str, RefitResult | None]:
        info = self.info
        if sender:
            self.control.declare(label, self.model.tensors, trainer_layout=info.layout)
        version_id = self.publisher.publish(label, timeout=info.publish_timeout)
        wait = info.stage_timeout + 8 * info.call_timeout + 60.0
        if sender:
            try:
                workers = self.workers(list(self.instances))
                check = None
                if info.check_prompt:
                    check = GenerationCheck(tuple(info.check_prompt), info.check_tokens)
                refit_id = self.control.start_refit(
                    label,
                    workers,
                    check=check,
                    pause_mode=info.pause_mode,
                    stage_timeout=info.stage_timeout,
                    call_timeout=info.call_timeout,
                    framework_step=number,
                )
            except Exception as e:
                # The other ranks wait for this refit: hand the version back so they raise too.
                self.publisher.release(label, timeout=60.0)
                return version_id, "NOT_STARTED", f"{type(e).__name__}: {e}", None
        else:
            why = self.publisher.wait_staged(label, timeout=wait)
            body = next(iter(why.values()), None) if isinstance(why, dict) else None
            refit_id = body.get("refit") if isinstance(body, dict) else None
            if refit_id is None:
                return version_id, "NOT_STARTED", f"the sender started no refit: {why}", None
        r = self.control.wait_refit(int(refit_id), timeout=wait)
        if not r.ended:
            return version_id, "NOT_ENDED", f"refit {refit_id} still in {r.phase}", r
        return version_id, str(r.outcome), r.reason, r


def _init_server(client: VLLMWeightSyncClient, url: str, info: dict[str, Any]) -> None:
    """``client.init_weight_transfer_engine(info)``, with the server's reason in the error:
    vLLM's HTTP client raises ``requests.HTTPError`` whose message leaves the body out.

    Raises:
        RuntimeError: the server refused the init (its status and body; the cause chained).
    """
    try:
        client.init_weight_transfer_engine(info)
    except Exception as e:
        response = getattr(e, "response", None)
        if response is None:
            raise
        body = (getattr(response, "text", "") or "").strip()
        raise RuntimeError(
            f"the vLLM server at {url} refused mx's init_weight_transfer_engine "
            f"(instance {info.get('instance_id')!r}): HTTP {response.status_code}: "
            f"{body[:2000] or '(no body)'}"
        ) from e


class MxTrainerWeightTransferEngine(TrainerWeightTransferEngine[MxTrainerInitInfo]):
    """mx's trainer engine: publishes this rank's shards in place and has mx's control plane
    refit every server of this process's engines to them (see the module's contract).

    Attributes (mx's, beside vLLM's ``client``, ``source``, ``is_sender``):
        instance_id: the server this engine was built for.
        label, version_id: the version of its last ``send_weights`` (``""`` before).
        last_refit: the control plane's record of that refit (``None`` before, and on ranks
            where no refit started).
    """

    init_info_cls = MxTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.module = _module_of(source)
        self.instance_id = ""
        self.round = 0
        self.label = ""
        self.version_id = ""
        self.last_refit: RefitResult | None = None
        self._pub: _Publication | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: MxTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> MxTrainerWeightTransferEngine:
        """Builds the engine on every rank: registers this rank's shards with an
        :class:`mx.Publisher` (once per process, shared by its engines); on the sender, also
        initializes the server's mx backend through ``client`` and waits until its workers
        registered with the control plane.

        Raises:
            TypeError: ``init_info`` is not an :class:`MxTrainerInitInfo`, or the source is not
                a ``ModuleSource``.
            ValueError: no source; a parameter mx cannot read in place (named); an instance id
                already served by an engine of this process; the server's init info refused.
            TimeoutError: the server's workers did not register within ``register_timeout``.
            ControlPlaneHalted: the control plane is halted (its reason; no refit could run).
            MxError: the control plane or NIXL failed (the message names what).
            RuntimeError: the server refused the init (its HTTP status and reason; a server
                initialized for another control plane or instance says so); another client's
                own error passes through.
        """
        if not isinstance(init_info, MxTrainerInitInfo):
            raise TypeError(
                f"init_info must be an MxTrainerInitInfo, not {type(init_info).__name__}"
            )
        if init_info.layout.startswith("replicated:"):
            _check_world(init_info.layout, _parse_layout(init_info.layout)[1])
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.instance_id = init_info.instance_id
        engine_url = init_info.engine_url or str(getattr(client, "base_url", ""))
        if not engine_url:
            raise ValueError(
                "mx trainer init_info.engine_url: not given, and the client has no base_url"
            )
        server_info = init_info.server_init_info(engine_url)
        pub = _Publication.join(init_info, engine.module)
        try:
            if engine.is_sender:
                _init_server(client, engine_url, server_info)
                deadline = time.monotonic() + init_info.register_timeout
                while True:
                    try:
                        pub.workers([init_info.instance_id])
                        break
                    except ControlPlaneHalted:
                        raise
                    except RuntimeError as e:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"{e} {init_info.register_timeout} s after its init"
                            ) from None
                        time.sleep(0.2)
        except BaseException:
            pub.leave(init_info.instance_id)
            raise
        engine._pub = pub
        # The rounds before this engine existed did not refit its server.
        engine.round = pub.published
        return engine

    def send_weights(self) -> None:
        """Publishes this rank's shards as a new version (every rank, in place: do not write
        them until this returns) and, on the sender, has the control plane refit every server
        of this process's engines to it; returns once the refit committed. A second engine's
        call in the same step (its server already refit with the first) publishes nothing.

        Raises:
            MxRefitError: the refit did not commit (the control plane's reason; every server
                back on its previous version), on every rank.
            ValueError: a published parameter was re-allocated since ``trainer_init``.
            RuntimeError: called after :meth:`shutdown`.
            MxError: publishing failed (e.g. ``DeadlineExceeded`` waiting for the other ranks).
        """
        if self._pub is None:
            raise RuntimeError(f"mx trainer engine for {self.instance_id!r} was shut down")
        rnd = self._pub.send(self)
        self.round, self.label, self.version_id = rnd.number, rnd.label, rnd.version_id
        self.last_refit = rnd.result
        if rnd.outcome != "COMMITTED":
            raise MxRefitError(rnd.label, rnd.version_id, rnd.outcome, rnd.reason, rnd.result)

    def shutdown(self) -> None:
        """Leaves the shared publication (the last engine of the process closes the publisher).
        The server keeps serving the version it holds and stays registered; nothing is sent to
        it. Idempotent."""
        if self._pub is not None:
            self._pub.leave(self.instance_id)
            self._pub = None


def _register() -> None:
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MxTrainerWeightTransferEngine)


_register()

__all__ = [
    "ControlPlaneHalted",
    "MxRefitError",
    "MxTrainerInitInfo",
    "MxTrainerWeightTransferEngine",
]
