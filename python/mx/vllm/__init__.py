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

Importing this module does not import vLLM; :func:`register` and the engine do.
"""

from __future__ import annotations

BACKEND = "mx"
"""The name the backend registers under (``--weight-transfer-config '{"backend": "mx"}'``)."""


IDENTITY_METHOD = "mx_engine_identity"
"""The worker method :func:`register` adds to vLLM's workers: the control plane calls it through
vLLM's ``POST /collective_rpc`` (dev mode) to learn which mx worker each rank follows as, before
any call that changes the engine."""


def _engine_identity(worker: object) -> dict[str, str] | None:
    """A vLLM worker's mx identity (``{"worker_id", "instance", "incarnation_digest"}``), or
    ``None`` when its weight-transfer backend is not mx's or not initialized."""
    engine = getattr(worker, "weight_transfer_engine", None)
    identity = getattr(engine, "engine_identity", None)
    return identity() if callable(identity) else None


def register() -> None:
    """Registers the ``"mx"`` weight-transfer backend with vLLM's factory (lazily: the engine
    module is imported only when a server selects it) and adds :data:`IDENTITY_METHOD` to vLLM's
    workers. Called by vLLM in every process through the ``vllm.general_plugins`` entry point;
    idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, IDENTITY_METHOD):
        setattr(WorkerBase, IDENTITY_METHOD, _engine_identity)

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND, "mx.vllm._engine", "MxWeightTransferEngine"
    )


__all__ = ["BACKEND", "IDENTITY_METHOD", "register"]
