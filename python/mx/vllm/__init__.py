"""mx as a vLLM weight-transfer backend.

Installing the package ``mx`` registers the backend ``"mx"`` in every vLLM process through
vLLM's ``vllm.general_plugins`` entry point (:func:`register`), so a server started with::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server \\
        --model DIR --weight-transfer-config '{"backend": "mx"}' ...

takes part in mx refits with no change to vLLM. The orchestrator then calls the server's
``POST /init_weight_transfer_engine`` once with ``{"init_info": {"control_url": ...,
"instance_id": ..., "engine_url": ...}}`` (:class:`MxInitInfo`): each vLLM worker process
(one per tensor-parallel rank) derives its rank's destination layout from the vLLM model,
checks it against mx's own vLLM rules, registers with the control plane and follows its
command stream (staging happens there, in the background, while vLLM generates). A refit then
drives the server's native RL routes (pause, start/update/finish weight update, weight info,
prefix-cache reset, resume): ``update_weights`` with ``{"update_info": {"version_id":
"mx:<hex>"}}`` (:class:`MxUpdateInfo`) installs that version at the safe point
(:class:`MxWeightTransferEngine`).

The trainer side: :mod:`mx.vllm.trainer` registers mx's engine in vLLM's
``WeightTransferTrainerFactory`` under ``"mx"`` (:class:`~mx.vllm.trainer.MxTrainerInitInfo`,
:class:`~mx.vllm.trainer.MxTrainerWeightTransferEngine`), so a trainer using vLLM's trainer API
(``trainer_init``, ``send_weights``) refits through mx's control plane.

Importing this module does not import vLLM; :func:`register`, the engine and the names of the
trainer side (imported on first use) do.
"""

from __future__ import annotations

from typing import Any

BACKEND = "mx"
"""The name the backend registers under (``--weight-transfer-config '{"backend": "mx"}'``)."""


IDENTITY_METHOD = "mx_engine_identity"
"""The worker method :func:`register` adds to vLLM's workers: the control plane calls it through
vLLM's ``POST /collective_rpc`` (dev mode) to learn which mx worker each rank follows as, before
any call that changes the engine."""


INSTALL_METHOD = "mx_install"
"""The worker method :func:`register` adds to vLLM's workers: one weight-update session that
installs ``version_id`` through mx's backend (start, update with ``{"version_id": ...}``,
finish), so a single ``collective_rpc`` installs a version. A Dynamo worker's
``update_weights_from_distributed`` route calls it (``{"engine_rpc": "mx_install",
"version_id": V, "weight_version": V}``)."""


TIMINGS_METHOD = "mx_timings"
"""The worker method :func:`register` adds to vLLM's workers: the backend's record of its last
install (``version_id``, ``kind``, ``mode``: ``exchange``/``reload``/``inplace``/``none``,
``host_s``, ``vllm_s``) and its last prepare (``version_id``, ``prepare_s``: seconds spent
outside the pause), through ``POST /collective_rpc``."""


MEMORY_METHOD = "mx_memory"
"""The worker method :func:`register` adds to vLLM's workers: what the rank holds by role, in
bytes (vLLM's live weights; mx's registered host copy, staging, retained copy, the processed set
beside vLLM's as ``prepared`` or ``rollback source``), and the process's resident set now and at
its peak (:meth:`mx.vllm._engine.MxWeightTransferEngine.memory`); ``None`` before the backend is
initialized, through ``POST /collective_rpc``."""


def _memory(worker: Any) -> dict[str, Any] | None:
    """:data:`MEMORY_METHOD` on one vLLM worker."""
    engine = getattr(worker, "weight_transfer_engine", None)
    memory = getattr(engine, "memory", None)
    if not callable(memory) or getattr(engine, "_puller", None) is None:
        return None
    return memory()


def _timings(worker: Any) -> dict[str, Any]:
    """:data:`TIMINGS_METHOD` on one vLLM worker (empty records before any)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return {
        "install": dict(getattr(engine, "last_install", {})),
        "prepare": dict(getattr(engine, "last_prepare", {})),
    }


def _install(worker: Any, version_id: str) -> dict[str, Any]:
    """``mx_install`` on one vLLM worker: installs ``version_id`` (staged, resident or retained)
    in one weight-update session; returns the backend's record of the install. A failed install
    raises after the backend restored the previous version (vLLM ends the session itself)."""
    worker.start_weight_update()
    worker.update_weights({"version_id": version_id})
    worker.finish_weight_update()
    engine = getattr(worker, "weight_transfer_engine", None)
    return dict(getattr(engine, "last_install", {}))


def _engine_identity(worker: object) -> dict[str, str] | None:
    """A vLLM worker's mx identity (``{"worker_id", "instance", "incarnation_digest"}``), or
    ``None`` when its weight-transfer backend is not mx's or not initialized."""
    engine = getattr(worker, "weight_transfer_engine", None)
    identity = getattr(engine, "engine_identity", None)
    return identity() if callable(identity) else None


def register() -> None:
    """Registers the ``"mx"`` weight-transfer backend with vLLM's factory (lazily: the engine
    module is imported only when a server selects it) and adds :data:`IDENTITY_METHOD`,
    :data:`INSTALL_METHOD`, :data:`TIMINGS_METHOD` and :data:`MEMORY_METHOD` to vLLM's
    workers. Called by vLLM in every process through the ``vllm.general_plugins`` entry
    point; idempotent. Also registers the trainer side (:mod:`mx.vllm.trainer`, lazily) in
    ``WeightTransferTrainerFactory``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, IDENTITY_METHOD):
        setattr(WorkerBase, IDENTITY_METHOD, _engine_identity)
    if not hasattr(WorkerBase, INSTALL_METHOD):
        setattr(WorkerBase, INSTALL_METHOD, _install)
    if not hasattr(WorkerBase, TIMINGS_METHOD):
        setattr(WorkerBase, TIMINGS_METHOD, _timings)
    if not hasattr(WorkerBase, MEMORY_METHOD):
        setattr(WorkerBase, MEMORY_METHOD, _memory)

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "mx.vllm.trainer", "MxTrainerWeightTransferEngine"
        )
    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND, "mx.vllm._engine", "MxWeightTransferEngine"
    )


_TRAINER_NAMES = ("MxRefitError", "MxTrainerInitInfo", "MxTrainerWeightTransferEngine")


def __getattr__(name: str) -> Any:
    """The trainer side's names, imported (and registered with vLLM) on first use."""
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'mx.vllm' has no attribute {name!r}")


__all__ = [
    "BACKEND",
    "MxRefitError",
    "MxTrainerInitInfo",
    "MxTrainerWeightTransferEngine",
    "IDENTITY_METHOD",
    "INSTALL_METHOD",
    "MEMORY_METHOD",
    "TIMINGS_METHOD",
    "register",
]
