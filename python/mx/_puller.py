"""An inference rank's side of mx: stage versions beside the engine's weights, apply them in
place into the engine's own tensors, roll back, and optionally serve the control plane."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _memory, _mx
from ._model import Model


@dataclass(frozen=True)
class Piece:
    """A box of a checkpoint tensor inside an engine parameter: the parameter's bytes at
    ``offset .. offset + prod(box_shape) * dtype size`` are the row-major box (``box_offset``,
    ``box_shape``, elements) of checkpoint tensor ``tensor`` (global shape ``global_shape``)."""

    tensor: str
    dtype: str
    global_shape: tuple[int, ...]
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a held rank as the layout gives it: the engine's name (vLLM names for
    ``tp`` layouts: fused ``qkv_proj`` / ``gate_up_proj``), dtype, this rank's shape, bytes,
    and the checkpoint boxes it is made of (bytes in no piece, e.g. vocab padding, are zero)."""

    rank: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    pieces: tuple[Piece, ...]
    offset: int = 0
    """Where the parameter starts in a buffer laid out as the whole rank (bytes)."""


def _param_infos(layouts: Sequence[Mapping[str, Any]], rank: int | None) -> list[ParamInfo]:
    """The parameters of the rank layouts (JSON as the extension writes them) of ``rank``
    (None: every rank), in layout order."""
    out = []
    for rl in layouts:
        if rank is not None and rl["rank"] != rank:
            continue
        for p in rl["params"]:
            pieces = tuple(
                Piece(
                    pc["tensor"],
                    pc["dtype"],
                    tuple(pc["global_shape"]),
                    tuple(pc["box_offset"]),
                    tuple(pc["box_shape"]),
                    pc["offset"],
                )
                for pc in p["pieces"]
            )
            shape = tuple(p["shape"])
            out.append(
                ParamInfo(
                    rl["rank"], p["name"], p["dtype"], shape, p["nbytes"], pieces, p["offset"]
                )
            )
    return out


@dataclass(frozen=True)
class StageReport:
    """What a stage did: seconds planning, pulling and verifying (after the last READ), READ
    descriptors, bytes on the wire and useful ones, staging bytes the plan used, and whether
    the version was already resident or retained (no pull)."""

    label: str | None
    version_id: str
    plan_s: float
    plan_reused: bool
    pull_s: float
    verify_s: float
    descriptors: int
    wire_bytes: int
    useful_bytes: int
    staging_bytes: int
    lanes: int
    resident: bool


@dataclass(frozen=True)
class ApplyReport:
    """What an apply or rollback did: the version resident now, how (``"staged"``: copied
    from staging; ``"restored"``: from the retained copy; ``"already_resident"``), the version
    retained now, seconds retaining first and seconds copying into the engine's memory."""

    version_id: str
    kind: str
    retained: str | None
    retain_s: float
    copy_s: float


@dataclass(frozen=True)
class MemoryReport:
    """Bytes the puller holds beside the engine's own, by role, and the process's resident set.

    ``rank_bytes``: per held rank, its registered memory (the resident version: what peers pull
    from, live digests read and a rollback restores into); ``staging_bytes`` now and
    ``staging_bytes_peak`` (the version being pulled, kept allocated for the next stage; at most
    the ranks' bytes where a plan fits); ``retained_bytes``: the previous version, the source of
    a rollback with nothing pulled (0 without retention, or with it kept in staging);
    ``process_rss_bytes`` and ``process_rss_bytes_peak``: this process's resident set now and
    at its peak (``VmRSS`` and ``VmHWM``; 0 where the platform does not say)."""

    rank_bytes: dict[int, int]
    staging_bytes: int
    staging_bytes_peak: int
    retained_bytes: int
    process_rss_bytes: int = 0
    process_rss_bytes_peak: int = 0


@dataclass(frozen=True)
class Versions:
    """Version ids held: in the engine's memory, in the retained copy, in staging."""

    resident: str | None
    retained: str | None
    staged: str | None


@dataclass(frozen=True)
class StagedPiece:
    """One staged piece, copied out (:meth:`Puller.staged_tensors`): the row-major bytes of
    box (``box_offset``, ``box_shape``) of checkpoint tensor ``tensor``, for parameter
    ``param`` of ``rank``."""

    rank: int
    param: str
    tensor: str
    dtype: str
    global_shape: tuple[int, ...]
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    data: bytes


def _stage_report(d: Mapping[str, Any]) -> StageReport:
    return StageReport(
        d["label"],
        d["version_id"],
        d["plan_s"],
        d["plan_reused"],
        d["pull_s"],
        d["verify_s"],
        d["descriptors"],
        d["wire_bytes"],
        d["useful_bytes"],
        d["staging_bytes"],
        d["lanes"],
        d["resident"],
    )


def _apply_report(text: str) -> ApplyReport:
    d = json.loads(text)
    return ApplyReport(d["version_id"], d["kind"], d["retained"], d["retain_s"], d["copy_s"])


class Puller:
    """An inference rank's side of mx, over parameter memory the engine owns.

    Args:
        control: the control plane's URL, or None to stage only from given manifests.
        model: the :class:`Model`.
        layout: the engine's inference layout (``"tp:N"``: vLLM's per-rank shards with fused
            ``qkv_proj``/``gate_up_proj``; ``"fsdp:N"``, ``"replicated:N"``).
        ranks: the ranks of ``layout`` this process holds.
        worker_id: with ``control``, register the layout under this id at once so publishers
            cut for it before the engine serves.
        retain: keep a host copy of the previously applied version (1x the ranks' bytes), so
            :meth:`rollback` needs no source; ``"in_staging"``: keep it in staging instead,
            with no buffer of its own (an apply from staging exchanges the staged and the
            registered bytes, so staging then holds the version resident before; a rollback
            is the same exchange back; the next stage overwrites it; plans that read a staging
            byte twice apply by copy and retain nothing).

    Raises:
        MxError: NIXL is missing, the control plane is unreachable, a rank outside ``layout``
            or a layout that cannot place the model (``InvalidArgument``).

    Register every parameter of every held rank (:meth:`register`), then :meth:`stage` a
    version (pull + verify into staging; the engine keeps serving) and :meth:`apply` it at a
    safe point (copies in place: the tensors' addresses never change), or :meth:`serve` it to
    the control plane, whose refits then drive stage and apply. **Contract**: the engine does
    not read or write the registered tensors while a stage, apply or rollback runs (including
    those a served control plane drives, between its pause and resume calls). The puller
    keeps a reference to every registered tensor until :meth:`close` and, before every write or
    read of their memory (including the applies a served puller's control plane drives), checks
    that none was resized, re-pointed or re-typed: an error naming it, and nothing written.
    """

    def __init__(
        self,
        control: str | None = None,
        *,
        model: Model,
        layout: str,
        ranks: Sequence[int],
        worker_id: str | None = None,
        retain: bool | str = True,
    ) -> None:
        if retain not in (True, False, "in_staging"):
            raise ValueError(f"retain must be True, False or 'in_staging', not {retain!r}")
        if not isinstance(model, Model):
            raise TypeError(f"model must be an mx.Model, not {type(model).__name__}")
        if isinstance(ranks, int) or not isinstance(ranks, Sequence):
            raise TypeError("ranks must be a sequence of ints, e.g. [0]")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < 2**32:
                raise ValueError(f"ranks: each rank must be an int in 0..2**32, got {r!r}")
        if worker_id is not None and control is None:
            raise ValueError("worker_id needs a control plane (control=None registers nothing)")
        self._inner = _mx.Puller(
            control,
            worker_id,
            layout,
            [int(r) for r in ranks],
            model._inner,
            bool(retain),
            retain == "in_staging",
        )
        self._layouts = json.loads(self._inner.rank_layouts())
        self._regions: dict[tuple[int, str], _memory.Region] = {}

    def params(self, rank: int | None = None) -> list[ParamInfo]:
        """The parameters of held rank ``rank`` (None: of every held rank), in layout order."""
        out = _param_infos(self._layouts, rank)
        if rank is not None and not out:
            held = [rl["rank"] for rl in self._layouts]
            raise _memory._error(f"rank {rank} is not held (held: {held})", "InvalidArgument")
        return out

    def register(self, rank: int, params: Mapping[str, Any]) -> None:
        """Registers the engine's tensors of held rank ``rank`` as ``name -> tensor``: every
        parameter of the rank, each a contiguous, writable host tensor with the layout's dtype
        and shape (see :meth:`params`). Their addresses are what apply writes into.

        Raises:
            MxError: ``InvalidArgument`` naming the rank and parameter: unknown, missing, or
                with another dtype, shape or size than the layout's; device memory;
                non-contiguous or read-only memory; registered already.
        """
        infos = {p.name: p for p in self.params(rank)}
        missing = [n for n in infos if n not in params]
        unknown = [n for n in params if n not in infos]
        if unknown or missing:
            raise _memory._error(
                f"rank {rank}: parameters the layout does not have: {unknown}; parameters "
                f"not given: {missing}",
                "InvalidArgument",
            )
        regions = {}
        for name, info in infos.items():
            what = f"rank {rank} parameter {name}"
            region = _memory.describe(params[name], what, writable=True)
            if region.dtype is not None and (region.dtype, region.shape) != (
                info.dtype,
                info.shape,
            ):
                raise _memory._error(
                    f"{what}: the tensor is {region.dtype} {list(region.shape)}, the layout "
                    f"says {info.dtype} {list(info.shape)}",
                    "InvalidArgument",
                )
            if region.nbytes != info.nbytes:
                raise _memory._error(
                    f"{what}: {region.nbytes} bytes, the layout says {info.nbytes}",
                    "InvalidArgument",
                )
            regions[name] = region
        for name, region in regions.items():
            info = infos[name]
            self._inner.register_param(
                rank,
                name,
                region.addr,
                region.nbytes,
                info.dtype,
                list(info.shape),
                functools.partial(_memory.check_unchanged, region),
            )
            self._regions[(rank, name)] = region

    def _check(self) -> None:
        for region in self._regions.values():
            _memory.check_unchanged(region)

    def stage(self, version: str) -> StageReport:
        """Stages ``version`` (a label, or an id ``mx:<hex>`` of a READY version) from the
        control plane's manifests: pulls exactly the held ranks' bytes over NIXL into staging
        and verifies every region against its source's digest. The engine's tensors are not
        touched. Blocks for the pull (the GIL is released).

        Raises:
            MxError: ``FailedPrecondition`` (no control plane, not READY, a tensor changed),
                ``NotFound``, ``Unavailable`` (a source unreachable), ``DataLoss`` (bytes that
                do not verify).
        """
        self._check()
        return _stage_report(json.loads(self._inner.stage(version)))

    def stage_manifests(self, version_id: str, manifests: Any) -> StageReport:
        """Stages ``version_id`` from its source manifests (a list as the control plane serves
        them, or its JSON text) without a control plane.

        Raises:
            MxError: ``DataLoss`` (manifests of another version, bytes that do not verify), and
                those of :meth:`stage`.
        """
        text = manifests if isinstance(manifests, str) else json.dumps(manifests)
        self._check()
        return _stage_report(json.loads(self._inner.stage_manifests(version_id, text)))

    def apply(self, version_id: str | None = None) -> ApplyReport:
        """Installs ``version_id`` (None: the staged version) into the registered tensors in
        place: from staging, from the retained copy, or nothing when resident already. The
        version resident before becomes the retained one. Call it at a safe point.

        Raises:
            MxError: ``NotFound`` (neither staged, retained nor resident: all three named),
                ``FailedPrecondition`` (nothing staged, a tensor changed or unregistered).
        """
        self._check()
        return _apply_report(self._inner.apply(version_id))

    def rollback(self) -> ApplyReport:
        """Restores the retained copy (the version applied before the current one) in place,
        with no source involved.

        Raises:
            MxError: ``FailedPrecondition`` (retention off or nothing retained yet).
        """
        self._check()
        return _apply_report(self._inner.rollback())

    @property
    def versions(self) -> Versions:
        """The versions held now."""
        return Versions(*self._inner.versions())

    def memory_report(self) -> MemoryReport:
        """Bytes held beside the engine's own, by role, and the process's resident set."""
        d = json.loads(self._inner.memory_report())
        return MemoryReport(
            {r["rank"]: r["bytes"] for r in d["rank_bytes"]},
            d["staging_bytes"],
            d["staging_bytes_peak"],
            d["retained_bytes"],
            d["process_rss_bytes"],
            d["process_rss_bytes_peak"],
        )

    def live_digests(self) -> dict[int, dict[str, str]]:
        """blake3 (hex) of every registered parameter's bytes, per held rank."""
        self._check()
        return {d["rank"]: dict(d["tensors"]) for d in json.loads(self._inner.live_digests())}

    def addresses(self, rank: int) -> dict[str, int]:
        """The data pointer of every registered parameter of ``rank`` (they never change)."""
        return dict(self._inner.addresses(int(rank)))

    def copy_staged(self, version_id: str, rank: int, buffer: Any, offset: int = 0) -> None:
        """Copies bytes ``offset .. offset + len(buffer)`` of held rank ``rank`` of the staged
        version ``version_id`` into ``buffer`` (a contiguous, writable host tensor or array;
        the rank laid out whole: parameter ``p`` at ``p.offset``; bytes of no piece zeroed):
        the bytes :meth:`apply` would install there, into memory of the caller's, so an engine
        can prepare a version while it serves another, one window (say one decoder layer's
        parameters) at a time. Staging, the registered tensors and the versions held are not
        touched. Allowed while following.

        Raises:
            MxError: ``NotFound`` (``version_id`` is not the staged version: what is staged,
                retained and resident named), ``InvalidArgument`` (a rank not held, a window
                outside the rank's bytes, device or read-only memory).
            ValueError: a negative ``offset``.
        """
        if int(offset) < 0:
            raise ValueError(f"offset must be >= 0 (got {offset})")
        region = _memory.describe(buffer, f"rank {rank} staged copy", writable=True)
        self._inner.copy_staged_rank(version_id, int(rank), int(offset), region.addr, region.nbytes)

    def staged_tensors(self) -> list[StagedPiece]:
        """The staged version piece by piece, copied out as bytes, for engines that install
        weights through their own loaders (e.g. ``load_weights``) instead of :meth:`apply`.

        Raises:
            MxError: ``NotFound`` when nothing is staged.
        """
        return [
            StagedPiece(r, p, t, d, tuple(g), tuple(o), tuple(s), bytes(b))
            for r, p, t, d, g, o, s, b in self._inner.staged_tensors()
        ]

    def serve(
        self, worker_id: str, *, listen: str = "127.0.0.1:0", engine_api: str = "dynamo"
    ) -> str:
        """Serves the puller as worker ``worker_id`` of its control plane and returns the URL
        of its engine routes: the HTTP contract of ``engine_api`` (``"dynamo"``: Dynamo's vLLM
        RL routes; ``"dynamo_sglang"``: a Dynamo SGLang worker's) for pause, resume, apply (of
        staged or retained versions) and version read-back; no generation: the engine declares
        no model, so refits skip their post-update generation. Staging follows the control
        plane's command stream in the background. Every parameter must be registered.

        Raises:
            MxError: ``FailedPrecondition`` (no control plane, served already, a parameter
                unregistered or changed), ``AlreadyExists`` (the worker id is held by another
                live process).
        """
        self._check()
        return self._inner.serve(worker_id, listen, engine_api)

    def set_resident(self, version: str | None) -> None:
        """Declares that the registered tensors hold version ``version`` now (any id, e.g.
        ``"disk:<dir>"`` for the checkpoint the engine loaded at start-up, or None): nothing is
        copied, and the next :meth:`apply` retains these bytes as that version, so a rollback
        can return to them. Only before :meth:`serve` / :meth:`follow`.

        Raises:
            MxError: ``FailedPrecondition`` once served.
        """
        self._inner.set_resident(version)

    def follow(
        self,
        worker_id: str,
        *,
        instance: str,
        engine_url: str,
        engine_api: str = "vllm",
        limits: tuple[int, int] | None = None,
        frontend: tuple[str, str, int] | None = None,
        on_staged: Callable[[str], Any] | None = None,
    ) -> str:
        """Follows the control plane as worker ``worker_id`` of inference instance
        ``instance`` whose engine serves ``engine_api``'s routes itself at ``engine_url`` (a
        vLLM server running mx's weight-transfer backend): the control plane stages versions
        into this puller over its command stream while the engine generates, and calls the
        engine's routes at the safe point, which install by calling :meth:`apply` (or
        :meth:`rollback`) here. ``limits``: ``(vocab_size, max_positions)`` of the served model,
        checked against a refit's post-update generation before anything pauses.
        ``frontend``: ``(url, served model, instance id)`` where a Dynamo worker generates (its
        frontend's ``/v1/completions``, pinned by ``nvext.backend_instance_id``).
        ``on_staged(version_id)``: called (on a thread of the puller's, with the GIL) with
        every version pulled into staging, before the control plane hears it is staged, so
        before it pauses the engine: the engine prepares the version there (e.g. with
        :meth:`copy_staged`); what it raises is logged and the version still counts as staged.
        Returns ``engine_url``. Every parameter must be registered.

        Raises:
            MxError: as :meth:`serve`.
        """
        self._check()
        lim = None if limits is None else (int(limits[0]), int(limits[1]))
        fe = None if frontend is None else (str(frontend[0]), str(frontend[1]), int(frontend[2]))
        return self._inner.follow(worker_id, instance, engine_url, engine_api, lim, fe, on_staged)

    def report_resident(self, error: str = "") -> None:
        """Tells the control plane what this rank holds in the engine's live weights now (its
        resident version), after an install the engine ran through mx; ``error`` says why the
        install failed and what was restored (empty when it succeeded). Blocks until the
        control plane recorded it (at most 10 s). For engines that answer every install with
        success whatever happened, so the control plane learns the outcome from the rank
        itself: mx's SGLang loader (:mod:`mx.sglang`) calls it before it returns.

        Raises:
            MxError: ``Control`` when the control plane refused (another process holds the
                worker id) or did not answer; before :meth:`follow` or :meth:`serve`.
        """
        self._check()
        self._inner.report_resident(str(error))

    def engine_identity(self) -> dict[str, str] | None:
        """Whose engine this is once :meth:`serve` or :meth:`follow` started a worker, else
        ``None``: ``{"worker_id", "instance", "incarnation_digest"}``. The control plane asks an
        engine for it before any call that changes the engine and refuses an engine whose
        answer names another worker; an engine serving its own routes answers it (mx's vLLM
        plugin: through vLLM's ``collective_rpc``). The process incarnation itself never
        leaves the process, only a one-way digest of it."""
        self._check()
        return self._inner.engine_identity()

    def close(self) -> None:
        """Stops serving (its routes answer 410 Gone) and drops the puller; the tensors stay
        the engine's and are not touched after this returns. Idempotent."""
        self._inner.close()
        self._regions.clear()

    def __enter__(self) -> Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ranks = [rl["rank"] for rl in self._layouts]
        return f"Puller(ranks={ranks}, registered={len(self._regions)}, open={self._inner.open})"
