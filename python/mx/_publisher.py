"""A trainer rank publishing the weight shards it holds, from its own tensors."""

from __future__ import annotations

import bisect
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _memory, _mx
from ._model import Model


@dataclass(frozen=True)
class Shard:
    """One shard a trainer rank holds: the box of global tensor ``tensor`` that starts at
    ``offset`` (elements, per dim; default all zeros) and has ``data``'s shape, stored in
    ``data`` row-major.

    ``data`` is a contiguous host tensor or array (torch, numpy, ``__dlpack__``, or a byte
    buffer holding whole rows of dim 0) whose dtype is the model's: e.g. an FSDP rank's local
    shard of a dim-0 sharded parameter, ``Shard(name, param, (row0, 0))``. Pass the parameter
    itself rather than ``param.data`` (a new tensor object on every access): then a later
    ``param.data = other`` is caught at the next publish instead of publishing the old memory.
    """

    tensor: str
    data: Any
    offset: Sequence[int] | None = None


def _shards(shards: Any) -> list[Shard]:
    if isinstance(shards, Mapping):
        out = []
        for name, v in shards.items():
            if isinstance(v, tuple) and len(v) == 2:
                out.append(Shard(name, v[0], v[1]))
            else:
                out.append(Shard(name, v))
        return out
    if isinstance(shards, Iterable) and not isinstance(shards, (str, bytes)):
        out = list(shards)
        for i, s in enumerate(out):
            if not isinstance(s, Shard):
                raise TypeError(f"shards[{i}]: expected mx.Shard, got {type(s).__name__}")
        return out
    raise TypeError(
        "shards must be a sequence of mx.Shard or a mapping name -> tensor / (tensor, offset), "
        f"not {type(shards).__name__}"
    )


_MAX_INDEX = 2**63 - 1
_TORCH_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
"""torch dtype names -> the safetensors names layouts use (the float types trainers publish)."""


def _offset(offset: Any, ndim: int, what: str) -> list[int]:
    """A box offset: ``ndim`` non-negative ints (None: all zeros)."""
    if offset is None:
        return [0] * ndim
    if isinstance(offset, (str, bytes)) or not isinstance(offset, Sequence):
        raise TypeError(f"{what}: offset must be a sequence of ints, got {offset!r}")
    out = []
    for d, o in enumerate(offset):
        if isinstance(o, bool) or not hasattr(o, "__index__"):  # ints, numpy ints; not 1.5
            raise TypeError(f"{what}: offset[{d}] must be an int, got {o!r}")
        o = operator.index(o)
        if not 0 <= o <= _MAX_INDEX:
            raise ValueError(f"{what}: offset[{d}] = {o} is outside 0..2**63")
        out.append(int(o))
    if len(out) != ndim:
        raise ValueError(f"{what}: offset has {len(out)} dims, the tensor has {ndim}")
    return out


def _spans(storages: Iterable[tuple[int, int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """Each storage ``(address, bytes)`` -> the span registered for it: storages that touch or
    overlap (tensors carved out of one buffer, e.g. safetensors' ``load_file``) are registered
    as one span, so that a READ the puller coalesces across two adjacent tensors lies inside one
    registration (NIXL refuses a descriptor that spans two)."""
    merged: list[list[int]] = []
    for a, n in sorted(set(storages)):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], a + n)
        else:
            merged.append([a, a + n])
    los = [lo for lo, _ in merged]
    out = {}
    for a, n in set(storages):
        lo, hi = merged[bisect.bisect_right(los, a) - 1]
        out[(a, n)] = (lo, hi - lo)
    return out


def _whole_tensors(
    tensors: Any, model: Model, what: str
) -> list[tuple[str, str, list[int], int, int, Any]]:
    """``name -> torch tensor`` as the extension's export takes them: ``(name, dtype, shape,
    address, nbytes, owner)``, each a whole, host (CPU), dense, contiguous tensor of the model's
    dtype and shape (``owner`` keeps it and its storage referenced)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"{what} must be a mapping name -> torch.Tensor, not {type(tensors).__name__}"
        )
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"{what}: tensor names must be str, got {name!r}")
        at = f"{what}[{name!r}]"
        if not _memory._is_torch(t):
            raise ValueError(f"{at}: expected a torch.Tensor, got {type(t).__name__}")
        if hasattr(t, "full_tensor") or hasattr(t, "_local_tensor"):
            raise ValueError(
                f"{at}: a DTensor (one rank's shard); export takes whole tensors: pass "
                "t.full_tensor() (gathered on the exporting rank)"
            )
        if t.device.type != "cpu":
            raise ValueError(
                f"{at}: a {t.device.type} tensor; export reads host memory: pass t.cpu()"
            )
        if str(t.layout) != "torch.strided":
            raise ValueError(f"{at}: a {t.layout} tensor; export needs a dense tensor")
        if not t.is_contiguous():
            raise ValueError(
                f"{at}: not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
                "pass t.contiguous()"
            )
        dtype = _memory._DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{at}: dtype {t.dtype} has no safetensors equivalent")
        try:
            spec = model.tensor(name)
        except KeyError:
            raise ValueError(f"{at}: the model has no such tensor") from None
        shape = tuple(int(d) for d in t.shape)
        if (dtype, shape) != (spec.dtype, tuple(spec.shape)):
            raise ValueError(
                f"{at}: {dtype} {list(shape)}, but the model's tensor is {spec.dtype} "
                f"{list(spec.shape)}: export takes whole tensors"
            )
        region = _memory.describe(t, at, writable=False)
        out.append((name, dtype, list(shape), region.addr, region.nbytes, region))
    return out


def _extra_files(extra_files: Any) -> list[tuple[str, bytes]]:
    if extra_files is None:
        return []
    if not isinstance(extra_files, Mapping):
        raise TypeError(
            f"extra_files must be a mapping name -> bytes, not {type(extra_files).__name__}"
        )
    out = []
    for name, data in extra_files.items():
        if not isinstance(name, str):
            raise TypeError(f"extra_files: file names must be str, got {name!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"extra_files[{name!r}]: expected bytes, got {type(data).__name__} "
                "(encode text first, e.g. json.dumps(config).encode())"
            )
        out.append((name, bytes(data)))
    return out


class Publisher:
    """A trainer rank's side of mx: publishes the shards it holds, from the memory that holds
    them, as policy versions workers pull exactly their bytes from.

    Args:
        control: the control plane's URL (``http://HOST:PORT``).
        model: the :class:`Model` shards are checked against.
        layout: the trainer layout (``"fsdp:N"``: slot ``r`` holds rows of every tensor's dim
            0; ``"replicated:N"``, ``"tp:N"``; ``"megatron:tp=T,pp=P,ep=E"``: Megatron-Core's
            ranks, published with :meth:`set_params`); the version's declaration must name
            the same.
        slot: this rank's slot in ``layout`` (its rank).
        pack: pack strided destination regions contiguously on the source side.
        token: the control-plane token this publisher presents (a ``publisher`` principal's),
            in place of the process's ``MX_CONTROL_TOKEN`` / ``MX_CONTROL_TOKEN_FILE``: for a
            process whose other clients hold other roles (a trainer rank that also
            orchestrates). At most one of ``token`` and ``token_file``.
        token_file: a file holding that token (as ``MX_CONTROL_TOKEN_FILE``).

    Raises:
        MxError: NIXL is missing, the control plane is unreachable, a slot outside ``layout``,
            a token file that cannot be read or holds no valid token (the file named).

    The memory of every shard is registered with NIXL once (per distinct storage) and read
    again at every :meth:`publish`, so after an in-place optimizer step the next publish sends
    the new bytes without registering again. **Contract**: published in place (the default),
    the trainer must not write the shards until the version is handed back
    (:meth:`wait_staged`, :meth:`wait_committed` or :meth:`release` returned); with
    ``copy=True`` it may write as soon as :meth:`publish` returns. The publisher keeps a
    reference to every shard's tensor (and its storage) until :meth:`close`, and before each
    publish checks that none was resized, re-pointed or re-typed (an error naming it).
    Not usable in a ``fork`` child: make it in the process that uses it.
    """

    def __init__(
        self,
        control: str,
        *,
        model: Model,
        layout: str,
        slot: int,
        pack: bool = True,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be an mx.Model, not {type(model).__name__}")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < 2**32:
            raise ValueError(f"slot must be an int in 0..2**32, got {slot!r}")
        self._model = model
        self._layout = str(layout)
        self._inner = _mx.Publisher(
            control,
            layout,
            int(slot),
            model._inner,
            pack,
            token=token,
            token_file=None if token_file is None else os.fspath(token_file),
        )
        self._slot = int(slot)
        # registered span (address, bytes) -> (memory id, a region inside it)
        self._memories: dict[tuple[int, int], tuple[int, _memory.Region]] = {}
        self._regions: list[_memory.Region] = []

    @property
    def agent_name(self) -> str:
        """The NIXL agent's name (it appears in manifests and logs)."""
        return self._inner.agent_name

    def set_shards(self, shards: Iterable[Shard] | Mapping[str, Any]) -> None:
        """Sets the shards this rank holds, replacing any set before. Registers the memory of
        each distinct storage once; nothing is read yet.

        Args:
            shards: :class:`Shard` objects, or a mapping ``name -> tensor`` (the whole tensor,
                offset 0) or ``name -> (tensor, offset)``.

        Raises:
            MxError: ``InvalidArgument`` naming the shard and tensor: a tensor the model does
                not have, a dtype or global shape differing from the model's, a box outside
                the tensor, two boxes that overlap, device memory, a non-contiguous tensor.
        """
        described = []
        for i, s in enumerate(_shards(shards)):
            what = f"shards[{i}] (tensor {s.tensor}, slot {self._slot})"
            try:
                spec = self._model.tensor(s.tensor)
            except KeyError:
                raise _memory._error(
                    f"{what}: the model has no such tensor", "InvalidArgument"
                ) from None
            region = _memory.describe(s.data, what, writable=False)
            if region.nbytes == 0:
                raise _memory._error(
                    f"{what}: an empty shard (0 bytes); leave it out", "InvalidArgument"
                )
            shape = region.shape if region.dtype is not None else self._box_shape(spec, s, region)
            offset = _offset(s.offset, len(spec.shape), what)
            dtype = region.dtype if region.dtype is not None else spec.dtype
            described.append((s, spec, region, shape, offset, dtype))
        spans = _spans([d[2].storage for d in described])
        specs = []
        regions = []
        for s, spec, region, shape, offset, dtype in described:
            memory, base = self._register(spans[region.storage], region)
            specs.append(
                (
                    s.tensor,
                    dtype,
                    list(spec.shape),
                    offset,
                    list(shape),
                    memory,
                    region.addr - base,
                )
            )
            regions.append(region)
        self._inner.set_shards(specs)
        self._regions = regions

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Sets the shards this rank holds from its parameters as its layout names them, e.g.
        a Megatron-Core rank's ``decoder.layers.0.self_attention.linear_qkv.weight`` under
        ``megatron:tp=2,pp=2,ep=2`` (see :meth:`Model.rank_layout`): each checkpoint box of
        each parameter becomes a :class:`Shard` viewing the parameter's memory (no copy), so
        after an in-place optimizer step the next :meth:`publish` sends the new bytes, as with
        :meth:`set_shards` (whose contract applies). Replaces any shards set before.

        Args:
            params: ``layout name -> torch.Tensor`` for every parameter the layout gives this
                slot: host, contiguous, of the layout's dtype and shape (vocabulary padding
                rows are not read).

        Raises:
            MxError: ``InvalidArgument`` naming the parameter: one the layout does not give
                this slot, one missing, a dtype or shape other than the layout's, a
                non-contiguous tensor.
        """
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping name -> tensor, not {type(params).__name__}")
        infos = self._model.rank_layout(self._layout, self._slot)
        want = {p.name: p for p in infos}
        where = f"slot {self._slot} of {self._layout}"
        extra = sorted(set(params) - set(want))
        if extra:
            raise _memory._error(
                f"params[{extra[0]!r}]: the layout gives {where} no such parameter "
                f"({len(extra)} unknown; it has e.g. {sorted(want)[:3]})",
                "InvalidArgument",
            )
        missing = [n for n in want if n not in params]
        if missing:
            raise _memory._error(
                f"params: {where} holds {missing[0]!r} ({len(missing)} missing)",
                "InvalidArgument",
            )
        shards = []
        for info in infos:
            t = params[info.name]
            what = f"params[{info.name!r}] ({where})"
            if not hasattr(t, "reshape") or not hasattr(t, "element_size"):
                raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
            dtype = str(t.dtype).removeprefix("torch.")
            if tuple(t.shape) != info.shape or _TORCH_NAMES.get(dtype) != info.dtype:
                raise _memory._error(
                    f"{what}: {dtype} {list(t.shape)}, the layout's is {info.dtype} "
                    f"{list(info.shape)}",
                    "InvalidArgument",
                )
            if not t.is_contiguous():
                raise _memory._error(f"{what}: not contiguous", "InvalidArgument")
            flat = t.detach().reshape(-1)
            size = t.element_size()
            for pc in info.pieces:
                start = pc.offset // size
                n = 1
                for d in pc.box_shape:
                    n *= d
                view = flat[start : start + n].view(pc.box_shape)
                shards.append(Shard(pc.tensor, view, pc.box_offset))
        self.set_shards(shards)

    def _box_shape(self, spec: Any, s: Shard, region: _memory.Region) -> tuple[int, ...]:
        """The box of an untyped byte buffer: the tensor's trailing dims, and as many rows of
        dim 0 as its bytes hold (they must be whole rows)."""
        from ._memory import _error

        size = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "F16": 2}
        size |= {"BF16": 2, "I32": 4, "F32": 4, "I64": 8, "F64": 8}
        if not spec.shape:
            return ()
        row = size[spec.dtype]
        for d in spec.shape[1:]:
            row *= d
        if row == 0 or region.nbytes % row:
            raise _error(
                f"{region.what}: an untyped buffer of {region.nbytes} bytes is not a whole "
                f"number of {spec.dtype} rows of {list(spec.shape[1:])} ({row} bytes each)",
                "InvalidArgument",
            )
        return (region.nbytes // row, *spec.shape[1:])

    def _register(self, span: tuple[int, int], region: _memory.Region) -> tuple[int, int]:
        """The memory id registering ``span`` (address, bytes), registered on first use, and
        its base address."""
        hit = self._memories.get(span)
        if hit is None:
            memory = self._inner.register_host(span[0], span[1])
            self._memories[span] = (memory, region)
            return memory, span[0]
        return hit[0], span[0]

    def publish(self, label: str, *, copy: bool = False, timeout: float = 600.0) -> str:
        """Publishes the shards' current bytes as version ``label`` (which the orchestrator
        declares; this waits for the declaration) and returns the version id (``mx:<hex>``)
        once every slot published it (READY).

        Args:
            copy: snapshot the shards into an mx arena first (one copy of this rank's bytes), so
                the trainer may write them as soon as this returns. Without it (in place), do
                not write them until the version is handed back (:meth:`wait_staged`).
            timeout: seconds to wait for the declaration, a free snapshot and READY.

        Raises:
            MxError: ``FailedPrecondition`` (no shards set, or a shard's tensor was resized,
                re-pointed or re-typed since :meth:`set_shards`: the message names it),
                ``DeadlineExceeded``, ``InvalidArgument`` (the manifest disagrees with the
                declaration: the tensor is named), ``Unavailable``.
        """
        for region in self._regions:
            _memory.check_unchanged(region)
        return self._inner.publish(label, bool(copy), float(timeout))

    def wait_staged(self, label: str, *, timeout: float = 600.0) -> dict[str, Any]:
        """Blocks until version ``label`` is handed back: every worker of its last stage staged
        (and verified) it, a refit to it ended before any stage completed, a later version was
        committed, or a source released it. Then the shards may be written again.

        Returns:
            Why, e.g. ``{"Staged": {"refit": 3, "workers": ["w0", "w1"]}}``.

        Raises:
            MxError: ``DeadlineExceeded`` (the version stays held), ``NotFound``.
        """
        return json.loads(self._inner.wait_staged(label, float(timeout)))

    def wait_committed(self, label: str, *, timeout: float = 600.0) -> None:
        """Blocks until version ``label`` is COMMITTED (then it is handed back too).

        Raises:
            MxError: ``DeadlineExceeded``, ``NotFound``.
        """
        self._inner.wait_committed(label, float(timeout))

    def release(self, label: str, *, timeout: float = 600.0) -> None:
        """Stops serving version ``label`` from this slot (the shards may be written at once)
        and tells the control plane: workers that did not stage it can no longer pull it.

        Raises:
            MxError: ``NotFound``, ``DeadlineExceeded``.
        """
        self._inner.release(label, float(timeout))

    def export(
        self,
        label: str,
        tensors: Mapping[str, Any],
        *,
        to: str,
        base: tuple[str, Mapping[str, Any]] | None = None,
        extra_files: Mapping[str, bytes] | None = None,
        chunk_bytes: int = 4 << 20,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Exports READY version ``label`` to object storage at ``to`` and records the artifact
        at the control plane, from the version's whole tensors.

        Before writing anything it proves that ``tensors`` are the version: every trainer
        shard published for ``label`` (by any slot) must equal, by blake3, its box of these
        tensors, and their Merkle root must be the version id. Bytes that differ (a tensor
        written since it was published, the wrong step) are refused, naming the tensor.

        Without ``base`` it writes a canonical Hugging Face checkpoint: ``model-0000K-of-
        0000N.safetensors`` files with ``model.safetensors.index.json``, the ``extra_files``
        beside them (e.g. ``config.json``), and the mx manifest ``mx-artifact.json``. With
        ``base=(base_label, base_tensors)`` it writes an exact-base XOR delta: ``base_label``
        must be a READY version and ``base_tensors`` exactly its whole tensors (the trainer
        keeps, or can rebuild, the bytes of the version it deltas against; when the base was
        exported, they are checked against its artifact's tensor digests, and every reader
        checks the result against this version's digests); ranges of ``chunk_bytes`` where the
        two are equal store nothing, the rest are the zstd-compressed XOR. Readers apply a delta
        only onto that exact base.

        The trainer assembles the whole tensors and one rank (typically rank 0) exports them:
        for FSDP2 every rank calls ``p.full_tensor()`` (a collective) on each DTensor and rank
        0 keeps ``{checkpoint_name: full.cpu()}``. They are read in place (no copy): do not
        write them until this returns. The object store is configured from the standard AWS
        environment of this process: ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``), and ``AWS_ALLOW_HTTP=true`` for an
        ``http://`` endpoint.

        Args:
            label: the version (READY: every slot published it).
            tensors: ``name -> torch.Tensor``, every tensor of the version, each whole, on the
                CPU and contiguous, of the model's dtype and shape; written in this order.
            to: ``s3://bucket/prefix``, a fresh prefix for this version.
            base: ``(base_label, base_tensors)`` for a delta; None for a canonical checkpoint.
            extra_files: ``name -> bytes`` written beside a canonical checkpoint.
            chunk_bytes: a delta's range size (bytes of a tensor fetched and checked as one).
            timeout: seconds for the whole export (the artifact is recorded only once
                complete; objects written before a timeout stay under ``to``).

        Returns:
            ``{"url", "manifest_digest" (blake3 hex of the manifest), "kind" ("canonical" or
            "delta"), "label", "version" ("mx:<hex>"), "base" (the base's "mx:<hex>" or None),
            "base_url", "tensors", "data_bytes" (bytes of the objects written, manifest
            excluded), "seconds"}``.

        Raises:
            ValueError: a tensor that is not a whole, CPU, contiguous torch tensor of the
                model's dtype and shape (named); a bad ``to``, ``chunk_bytes`` or file name;
                ``extra_files`` with a delta.
            MxError: ``InvalidArgument`` (bytes that are not the version, naming the tensor),
                ``FailedPrecondition`` (the version or the base not READY), ``NotFound`` (no
                such version), ``Unavailable`` (the object store), ``DeadlineExceeded``.
        """
        if not isinstance(label, str) or not isinstance(to, str):
            raise TypeError("label and to must be str")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
            raise TypeError(f"chunk_bytes must be an int, got {chunk_bytes!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        whole = _whole_tensors(tensors, self._model, "tensors")
        base_label, base_whole = None, None
        if base is not None:
            if not (isinstance(base, tuple) and len(base) == 2 and isinstance(base[0], str)):
                raise TypeError("base must be a tuple (base_label, {name: tensor})")
            base_label = base[0]
            base_whole = _whole_tensors(base[1], self._model, "base")
        text = self._inner.export(
            label,
            whole,
            to,
            base_label,
            base_whole,
            _extra_files(extra_files),
            int(chunk_bytes),
            float(timeout),
        )
        return json.loads(text)

    def close(self) -> None:
        """Stops serving and deregisters the memory (which stays the caller's); drops the
        references to the shards. Idempotent."""
        self._inner.close()
        self._memories.clear()
        self._regions = []

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Publisher(slot={self._slot}, agent={self.agent_name!r}, "
            f"shards={len(self._regions)}, open={self._inner.open})"
        )
