"""One SGLang rank's side of mx (inside its scheduler process): the puller started by
:func:`mx.sglang.attach`'s session, and installs by version id. See :mod:`mx.sglang`.

Nothing here raises into SGLang (an exception in a custom weight loader kills the server):
every failure is logged, reported to the control plane, and leaves the rank serving the version
it held.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from .. import _failpoints
from .._model import Model
from .._puller import Puller
from ..vllm import _layout
from . import INIT_PREFIX

logger = logging.getLogger("mx.sglang")

FAILPOINT_ENV = "MX_SGLANG_FAILPOINT_FILE"
"""The environment variable naming the failpoint file of the server's processes (tests)."""


class _Rank:
    """This rank's puller, its host copy of the rank's parameters (the resident version, and the
    retained previous one inside the puller) and the checkpoint-format view SGLang's
    ``load_weights`` reads."""

    def __init__(self, model: Any, info: dict[str, Any]) -> None:
        from sglang.srt.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        model_dir = str(info["model_dir"])
        t0 = time.perf_counter()
        mx_model = Model.from_dir(model_dir)
        checkpoint = [(t.name, t.dtype, tuple(t.shape)) for t in mx_model.tensors]
        puller = Puller(
            str(info["control_url"]),
            model=mx_model,
            layout=f"tp:{tp}",
            ranks=[rank],
            retain=bool(info.get("retain", True)),
        )
        try:
            infos = puller.params(rank)
            params = {
                p.name: torch.empty(p.shape, dtype=_layout.torch_dtype(p.dtype)) for p in infos
            }
            # The rank's slice of the checkpoint SGLang started from: resident until the first
            # refit, restorable by its id afterwards.
            _layout.read_rank(model_dir, infos, params)
            puller.register(rank, params)
            puller.set_resident(f"disk:{model_dir}")
            self.worker_id = f"{info['instance']}-tp{rank}"
            config = getattr(model, "config", None)
            limits = None
            vocab = getattr(config, "vocab_size", None)
            positions = getattr(config, "max_position_embeddings", None)
            if vocab and positions:
                limits = (int(vocab), int(positions))
            frontend = info.get("frontend")
            puller.follow(
                self.worker_id,
                instance=str(info["instance"]),
                engine_url=str(info["engine_url"]),
                engine_api=str(info.get("engine_api", "sglang")),
                limits=limits,
                frontend=None if frontend is None else tuple(frontend),
            )
            puller.report_resident("")
        except BaseException:
            puller.close()
            raise
        self.puller, self.rank, self.model = puller, rank, model
        self.view = _layout.CheckpointView(infos, params, checkpoint)
        logger.info(
            "mx: SGLang rank %d of tp:%d follows %s as %s (%d parameters, %d bytes; set up in "
            "%.2f s)",
            rank,
            tp,
            info["control_url"],
            self.worker_id,
            len(infos),
            sum(p.nbytes for p in infos),
            time.perf_counter() - t0,
        )

    def _to_host(self, version: str) -> str:
        """Makes ``version`` resident in the host parameters; returns how."""
        v = self.puller.versions
        if version == v.resident:
            return "already_resident"
        if version == v.retained:
            return self.puller.rollback().kind
        if not _layout.is_mx_version(version):
            raise ValueError(
                f"version {version!r} is not resident ({v.resident}), retained ({v.retained}) "
                "or an mx version id"
            )
        return self.puller.apply(version).kind

    def _into_sglang(self, failpoint: bool) -> None:
        """Feeds the host parameters to SGLang's ``load_weights`` (checkpoint names, this rank's
        slices in full-shaped tensors: SGLang's loaders take their slice, as at start-up)."""
        tensors = self.view.tensors()
        armed = _failpoints.take(FAILPOINT_ENV) if failpoint else None
        if armed is not None:
            tensors = _failpoints.fail_after(tensors, armed)
        with torch.no_grad():
            self.model.load_weights(tensors)

    def install(self, version: str) -> None:
        """Installs ``version`` (staged, resident or retained), feeding SGLang's loaders every
        time (a reinstall of the resident version too: a rollback after a failed update must
        not trust what SGLang holds). On failure restores what the rank held, and reports."""
        before = self.puller.versions.resident
        t0 = time.perf_counter()
        error = ""
        try:
            kind = self._to_host(version)
            t1 = time.perf_counter()
            self._into_sglang(failpoint=True)
            logger.info(
                "mx: rank %d installed %s (%s; host copy %.3f s, into SGLang %.3f s)",
                self.rank,
                version,
                kind,
                t1 - t0,
                time.perf_counter() - t1,
            )
        except Exception as e:  # noqa: BLE001 - nothing may raise into SGLang
            error = f"installing {version} failed: {e}"
            logger.error("mx: rank %d: %s; restoring %s", self.rank, error, before)
            error += self._restore(before)
        try:
            self.puller.report_resident(error)
        except Exception as e:  # noqa: BLE001
            logger.critical("mx: rank %d: reporting what it holds failed: %s", self.rank, e)

    def _restore(self, previous: str | None) -> str:
        """After a failed install: the host parameters back to ``previous`` and SGLang reloaded
        from them; returns what to add to the report."""
        try:
            v = self.puller.versions
            if previous is not None and v.resident != previous and v.retained == previous:
                self.puller.rollback()
            self._into_sglang(failpoint=False)
            return f"; restored {previous}"
        except Exception as e:  # noqa: BLE001
            logger.critical("mx: rank %d: restoring %s failed too: %s", self.rank, previous, e)
            return (
                f"; restoring {previous} failed too ({e}): this SGLang's weights are "
                "undefined, restart it"
            )


_RANK: _Rank | None = None


def handle(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """:func:`mx.sglang.load`'s body (see there)."""
    global _RANK
    try:
        if len(named_tensors) != 1:
            raise ValueError(
                f"mx's loader takes one named tensor per request, got {len(named_tensors)}: "
                "load weights through mx's refit, not through this load_format"
            )
        name = str(named_tensors[0][0])
        if name.startswith(INIT_PREFIX):
            if _RANK is not None:
                logger.warning(
                    "mx: this rank follows the control plane already as %s: init ignored",
                    _RANK.worker_id,
                )
                return
            _RANK = _Rank(model, json.loads(name[len(INIT_PREFIX) :]))
            return
        if _RANK is None:
            raise RuntimeError(
                f"asked to install {name!r} before mx.sglang.attach started this rank's puller"
            )
        _RANK.install(name)
    except Exception:  # noqa: BLE001 - nothing may raise into SGLang
        logger.exception("mx: SGLang's custom weight loader call failed (nothing changed)")
