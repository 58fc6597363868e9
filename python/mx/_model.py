"""The model description shards and parameters are checked against."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _mx
from ._types import TensorSpec

if TYPE_CHECKING:
    from ._puller import ParamInfo


class Model:
    """A model: its checkpoint tensors (HF names, dtypes, global shapes) and the architecture
    fields layouts need (heads, kv heads, head dim, vocab size). Immutable.

    Make one with :meth:`from_dir` (an HF checkpoint directory: ``config.json`` and the
    safetensors headers; no weights are read) or :meth:`from_config`. Publishers check every
    shard against it and pullers derive each rank's parameters from it (vLLM's fused
    ``qkv_proj``/``gate_up_proj`` for ``tp`` layouts).
    """

    def __init__(self, inner: _mx.Model) -> None:
        if not isinstance(inner, _mx.Model):
            raise TypeError("use Model.from_dir(path) or Model.from_config(config, tensors)")
        self._inner = inner

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Model:
        """Reads ``config.json`` and the safetensors headers of the HF checkpoint at ``path``.

        Raises:
            MxError: an unreadable directory or header, no ``config.json``, or a config the
                layouts do not support (the message names the field).
        """
        return cls(_mx.Model.from_dir(os.fspath(path)))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str, tensors: Any) -> Model:
        """A model from an HF ``config.json`` (a mapping, or its JSON text) and its tensors in
        any form :meth:`mx.Control.declare` accepts (``name -> tensor``, ``name -> (dtype,
        shape)``, or a sequence of :class:`TensorSpec` / ``(name, dtype, shape)``).

        Raises:
            ValueError: bad JSON, a tensor named twice.
            MxError: a missing or inconsistent config field or tensor (named).
        """
        from ._control import _tensor_specs

        text = config if isinstance(config, str) else json.dumps(dict(config))
        return cls(_mx.Model.from_config(text, _tensor_specs(tensors)))

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every checkpoint tensor, sorted by name (dtypes as safetensors names)."""
        return tuple(TensorSpec(n, d, tuple(s)) for n, d, s in self._inner.tensors())

    def tensor(self, name: str) -> TensorSpec:
        """The checkpoint tensor ``name``.

        Raises:
            KeyError: the model has no such tensor.
        """
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"the model has no tensor {name!r}")

    def rank_layout(self, layout: str, rank: int) -> list[ParamInfo]:
        """Rank ``rank`` of ``layout``: its parameters as that layout names and fuses them
        (checkpoint names for ``fsdp:N``; vLLM's ``qkv_proj``/``gate_up_proj`` and fused
        experts for ``tp:N``/``tp-ep:N``; Megatron-Core's ``linear_qkv``/``linear_fc1``/
        ``local_experts`` for ``megatron:tp=T,pp=P,ep=E``), each with the checkpoint boxes it
        is made of, in layout order. Pure: nothing is connected or allocated.

        Raises:
            MxError: ``InvalidArgument`` for a malformed layout or a rank outside it; the
                layout's refusal naming the tensor it cannot cut (e.g. 3 query groups under
                tp=2).
        """
        from ._puller import _param_infos

        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**32:
            raise ValueError(f"rank must be an int in 0..2**32, got {rank!r}")
        return _param_infos([json.loads(self._inner.rank_layout(str(layout), rank))], None)

    def __repr__(self) -> str:
        return repr(self._inner)
