"""mx with NVIDIA Dynamo (ai-dynamo 1.6.1): its vLLM worker (``dynamo.vllm``) with mx as the
weight-transfer backend of the vLLM inside it, refit through the worker's system routes
(``/engine/<route>``) and found through the frontend's RL listener (``/v1/rl/workers``).

Start each worker with mx's backend (``--weight-transfer-config '{"backend": "mx"}'``, and
``--enable-rl`` so the listener lists it), then :func:`attach` them to the control plane once::

    import mx.dynamo
    attached, left_out = mx.dynamo.attach(
        "http://frontend:8001",            # DYN_RL_PORT: GET /v1/rl/workers
        control_url="http://control:7700",
        frontend_url="http://frontend:8000",  # --http-port: where the post-update check runs
    )

Each vLLM rank inside each worker then registers with the control plane as worker
``<instance>-tp<rank>`` of instance ``dynamo-<instance_id as 16 hex digits>`` and stages
versions while the worker generates; a refit pauses the worker (``pause_generation``), installs
with ``update_weights_from_distributed`` (``engine_rpc: "mx_install"``: every rank installs its
staged bytes in one vLLM ``collective_rpc``, no checkpoint written, nothing over HTTP), reads
``get_weight_version`` back, resumes, and checks generation through the frontend pinned to the
worker (``nvext.backend_instance_id``).

Dynamo's SGLang worker (``dynamo.sglang``, started with ``--custom-weight-loader
mx.sglang.load`` and the weight-update session's routes configured: ``--engine-route
begin_weight_update:tm --engine-route end_weight_update:tm``) is not listed by the listener:
:func:`attach_sglang` attaches it by its system URL, and its ranks run mx's SGLang loader
(:mod:`mx.sglang`; engine api ``dynamo_sglang``).

:mod:`mx.dynamo.vllm_worker` runs Dynamo's vLLM worker on the project's vLLM (0.32.0).
Importing this package imports neither Dynamo nor vLLM.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from typing import Any

from .._http import call as _http

REQUIRED_ROUTES = (
    "get_weight_version",
    "init_weights_update_group",
    "pause_generation",
    "resume_generation",
    "update_weights_from_distributed",
)
"""The worker routes mx needs: the four a refit calls and the one :func:`attach` calls."""


@dataclass(frozen=True)
class Worker:
    """One worker as ``GET /v1/rl/workers`` lists it.

    Attributes:
        instance_id: Dynamo's instance id (a u64; the frontend routes to the worker by it).
        system_url: the worker's system server (``DYN_SYSTEM_PORT``), where its routes are.
        model: the served model name.
        routes: the routes the worker lists.
        world_size: its vLLM's number of ranks (1 when not reported).
    """

    instance_id: int
    system_url: str
    model: str
    routes: tuple[str, ...]
    world_size: int

    @property
    def mx_instance(self) -> str:
        """The instance name its ranks register under: ``dynamo-<instance_id, 16 hex>``."""
        return f"dynamo-{self.instance_id:016x}"


def discover(
    listener_url: str, timeout: float = 30.0
) -> tuple[list[Worker], list[tuple[Any, str]]]:
    """``GET {listener_url}/v1/rl/workers``: ``(workers mx can refit, [(listing entry,
    reason), ...] left out)``. A worker is left out when the listener reports an error for it,
    lacks one of :data:`REQUIRED_ROUTES` or a ``system_url`` (workers started without
    ``--enable-rl`` are not listed at all).

    Raises:
        RuntimeError: the listener answered something other than protocol 1's listing.
    """
    status, body = _http("GET", listener_url.rstrip("/") + "/v1/rl/workers", timeout=timeout)
    if status != 200 or not isinstance(body, dict) or body.get("protocol_version") != 1:
        raise RuntimeError(f"{listener_url}/v1/rl/workers: HTTP {status}: {body}")
    workers, left_out = [], []
    for w in body.get("workers") or []:
        routes = tuple(w.get("routes") or ())
        missing = [r for r in REQUIRED_ROUTES if r not in routes]
        if w.get("error"):
            left_out.append((w, f"the listener reports an error: {w['error']}"))
        elif missing:
            left_out.append((w, f"it does not expose route(s) {', '.join(missing)}"))
        elif not w.get("system_url") or not isinstance(w.get("instance_id"), int):
            left_out.append((w, "it has no system_url or no numeric instance_id"))
        else:
            workers.append(
                Worker(
                    instance_id=w["instance_id"],
                    system_url=w["system_url"].rstrip("/"),
                    model=str(w.get("model") or ""),
                    routes=routes,
                    world_size=int(w.get("world_size") or 1),
                )
            )
    return workers, left_out


def init_worker(
    worker: Worker,
    control_url: str,
    frontend_url: str,
    *,
    served_model: str | None = None,
    timeout: float = 120.0,
    **options: Any,
) -> None:
    """Initializes mx's weight-transfer backend in every rank of ``worker``:
    ``init_weights_update_group`` with ``{"engine_rpc": "init_weight_transfer_engine",
    "init_info": {...}}`` (:class:`mx.vllm._engine.MxInitInfo` with ``engine_api="dynamo"``;
    ``options`` are its other fields, e.g. ``retain``). Each rank checks its layout, registers
    with the control plane and follows it. Dynamo kills a worker whose init takes over
    ``DYN_RL_INIT_WEIGHTS_TIMEOUT_S`` (30 s by default): raise it for large models.

    Raises:
        RuntimeError: the route answered other than ``{"status": "ok"}`` (the message is the
            backend's, e.g. a layout disagreement naming the parameter).
    """
    info = {
        "control_url": control_url,
        "instance_id": worker.mx_instance,
        "engine_url": worker.system_url,
        "engine_api": "dynamo",
        "frontend_url": frontend_url.rstrip("/"),
        "served_model": served_model or worker.model,
        "backend_instance_id": worker.instance_id,
        **options,
    }
    body = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
    url = f"{worker.system_url}/engine/init_weights_update_group"
    status, answer = _http("POST", url, body, timeout)
    if status != 200 or not isinstance(answer, dict) or answer.get("status") != "ok":
        raise RuntimeError(f"{url}: HTTP {status}: {answer}")


def attach(
    listener_url: str,
    control_url: str,
    frontend_url: str,
    **options: Any,
) -> tuple[list[Worker], list[tuple[Any, str]]]:
    """Discovers the frontend's workers (:func:`discover`) and initializes mx in each
    (:func:`init_worker`, with ``options``): ``(attached, left out with the reason)``.

    Raises:
        RuntimeError: as :func:`discover` and :func:`init_worker` (the workers before the one
            that failed are attached).
    """
    workers, left_out = discover(listener_url)
    for w in workers:
        init_worker(w, control_url, frontend_url, **options)
    return workers, left_out


_WORKER_ID_LABEL = re.compile(r'dynamo_endpoint="generate"[^}]*?worker_id="([0-9a-f]{1,16})"')


def sglang_instance_id(system_url: str, timeout: float = 30.0) -> int:
    """The Dynamo instance id of the SGLang worker whose system server is at ``system_url``
    (``DYN_SYSTEM_PORT``): Dynamo's SGLang worker is not listed by the RL listener, and its
    system server names the id only as the ``worker_id`` label (16 hex digits) of its
    ``generate`` endpoint's series in ``GET /metrics``; the frontend routes to it by that id
    (``nvext.backend_instance_id``; its ``GET /health`` lists the same instance).

    Raises:
        RuntimeError: ``/metrics`` did not answer, or names no ``generate`` worker id.
    """
    url = system_url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the worker's URL
        text = r.read().decode("utf-8", "replace")
    ids = set(_WORKER_ID_LABEL.findall(text))
    if len(ids) != 1:
        raise RuntimeError(f"{url}: expected one worker_id of the generate endpoint, found {ids}")
    return int(ids.pop(), 16)


def attach_sglang(
    system_url: str,
    control_url: str,
    instance: str,
    *,
    model_dir: str,
    tp_size: int = 1,
    frontend_url: str | None = None,
    served_model: str | None = None,
    retain: bool = True,
    timeout: float = 120.0,
) -> list[str]:
    """Starts mx in every rank of a Dynamo SGLang worker (``python -m dynamo.sglang ...
    --custom-weight-loader mx.sglang.load --engine-route begin_weight_update:tm --engine-route
    end_weight_update:tm``: SGLang 0.5.23 updates weights only inside a weight-update session,
    whose routes the worker serves only when configured; its system server at ``system_url``)
    serving the
    checkpoint ``model_dir`` with ``tp_size`` tensor-parallel ranks (the deployment's values:
    the worker reports neither): one session whose ``/engine/control/update_weights_from_tensor``
    hands each rank's loader the init info, so it loads its slice of ``model_dir`` as the
    resident version ``disk:<model_dir>``, registers as ``<instance>-tp<rank>`` with engine api
    ``dynamo_sglang`` and follows the control plane (see :mod:`mx.sglang`). With
    ``frontend_url`` and ``served_model`` the post-update generation of a refit goes through the
    frontend pinned to this worker (:func:`sglang_instance_id`). Returns the worker ids once
    connected.

    Raises:
        RuntimeError: the route refused (naming its answer), the worker's instance id could not
            be read, or a rank did not connect within ``timeout`` seconds.
    """
    from .. import sglang

    base = system_url.rstrip("/")
    init: dict[str, Any] = {
        "control_url": control_url,
        "instance": instance,
        "engine_url": base,
        "engine_api": "dynamo_sglang",
        "model_dir": str(model_dir),
        "retain": bool(retain),
    }
    if frontend_url is not None:
        if not served_model:
            raise ValueError("attach_sglang: frontend_url needs served_model")
        init["frontend"] = [frontend_url.rstrip("/"), served_model, sglang_instance_id(base)]
    session = (f"{base}/engine/begin_weight_update", f"{base}/engine/end_weight_update")
    update = f"{base}/engine/control/update_weights_from_tensor"
    sglang.start_ranks(update, session, init, tp_size, timeout)
    return sglang.wait_connected(control_url, instance, tp_size, base, timeout)


__all__ = [
    "REQUIRED_ROUTES",
    "Worker",
    "attach",
    "attach_sglang",
    "discover",
    "init_worker",
    "sglang_instance_id",
]
