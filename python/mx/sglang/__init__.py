"""mx with SGLang's own server (``python -m sglang.launch_server``, sglang 0.5.23): mx's loader
in each tensor-parallel rank, plugged in through SGLang's custom weight loader option.

Start the server with mx's loader allowed::

    python -m sglang.launch_server --model-path DIR ... --custom-weight-loader mx.sglang.load

(the package ``mx`` importable by the server's Python), then attach it to the control plane
once::

    import mx.sglang
    workers = mx.sglang.attach("http://sglang:30000", control_url="http://control:7700",
                               instance="sglang-a")

Each rank then registers with the control plane as worker ``<instance>-tp<rank>`` (engine api
``"sglang"``) and stages versions over NIXL while SGLang generates. A refit pauses the server
(``/pause_generation``; mx's ``keep`` is SGLang's ``retract``), runs one weight-update session
(``/begin_weight_update``, ``/update_weights_from_tensor`` with ``load_format:
"mx.sglang.load"`` whose one tensor is *named* after the version to install, no weight bytes
over HTTP: each rank's loader installs what its own puller staged, ``/end_weight_update``),
flushes the cache (``/flush_cache``), reads the version back (``/model_info``, and each rank's
own report: see below), continues (``/continue_generation``) and checks generation
(``/generate``).

SGLang answers every custom load with success, and an exception in a loader kills the server.
So :func:`load` never raises: when an install fails it restores the version the rank held
(from the host copy mx keeps), then reports to the control plane what the rank holds and why
the install failed (``Puller.report_resident``) before it returns; the control plane takes the
rank's report as the read-back and rolls the refit back.

Importing this package imports neither SGLang nor torch.
"""

from __future__ import annotations

import base64
import json
import pickle
import time
from typing import Any

from .._http import call as _http

LOADER = "mx.sglang.load"
"""What the server lists in ``--custom-weight-loader`` and the refit names as ``load_format``."""

INIT_PREFIX = "mx-init:"
"""The name of the tensor of :func:`attach`'s session starts with it, followed by the JSON of
the rank's init info."""


def load(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (``module.function`` in ``--custom-weight-loader``),
    called in each tensor-parallel rank's scheduler process with the rank's ``[(name,
    tensor)]`` of ``/update_weights_from_tensor``. mx sends one entry per request: its name is
    ``mx-init:<json>`` (:func:`attach`: start this rank's puller) or a version id to install
    (the refit's); its tensor is empty. Never raises (see the module docs)."""
    from ._rank import handle

    handle(model, named_tensors)


def init_marker(info: dict[str, Any]) -> str:
    """One rank's element of ``serialized_named_tensors`` for :func:`attach`'s session: base64
    of the pickle of ``[("mx-init:" + JSON of info, empty uint8 tensor)]``, which SGLang's
    allowlisting unpickler reads."""
    import torch

    name = INIT_PREFIX + json.dumps(info, sort_keys=True)
    raw = pickle.dumps([(name, torch.empty(0, dtype=torch.uint8))], protocol=2)
    return base64.b64encode(raw).decode()


def attach(
    server_url: str,
    control_url: str,
    instance: str,
    *,
    retain: bool = True,
    timeout: float = 120.0,
) -> list[str]:
    """Starts mx in every rank of the SGLang server at ``server_url`` (started with
    ``--custom-weight-loader mx.sglang.load``): one weight-update session whose tensor names
    the init info (control plane, instance, the server's URL and model directory), so each
    rank's loader loads its slice of the server's checkpoint as the resident version
    ``disk:<model dir>``, registers as ``<instance>-tp<rank>`` and follows the control plane.
    The weights SGLang serves are not touched. ``retain``: keep the previous version in host
    memory after an install (rollbacks without a pull). Returns the worker ids once every one
    is connected to the control plane.

    Raises:
        RuntimeError: SGLang refused a route (naming it and its answer), or a rank did not
            connect within ``timeout`` seconds (its error is in SGLang's log: the loader never
            raises into SGLang).
    """
    base = server_url.rstrip("/")
    status, info = _http("GET", f"{base}/model_info", None, timeout)
    if status != 200 or not isinstance(info, dict) or "model_path" not in info:
        raise RuntimeError(f"{base}/model_info: HTTP {status}: {info!r}")
    status, server = _http("GET", f"{base}/server_info", None, timeout)
    if status != 200 or not isinstance(server, dict):
        raise RuntimeError(f"{base}/server_info: HTTP {status}: {server!r}")
    tp = int(server.get("tp_size", 1))
    init = {
        "control_url": control_url,
        "instance": instance,
        "engine_url": base,
        "model_dir": info["model_path"],
        "retain": bool(retain),
    }
    start_ranks(
        f"{base}/update_weights_from_tensor",
        (f"{base}/begin_weight_update", f"{base}/end_weight_update"),
        init,
        tp,
        timeout,
    )
    return wait_connected(control_url, instance, tp, base, timeout)


def _post_success(url: str, body: dict[str, Any], timeout: float) -> None:
    status, answer = _http("POST", url, body, timeout)
    if status != 200 or not (isinstance(answer, dict) and answer.get("success")):
        raise RuntimeError(f"{url}: HTTP {status}: {answer!r}")


def start_ranks(
    update_url: str,
    session: tuple[str, str],
    init: dict[str, Any],
    tp_size: int,
    timeout: float = 120.0,
) -> None:
    """Posts ``init`` (see :func:`init_marker`) to every rank's loader through the
    ``update_weights_from_tensor`` route at ``update_url``, inside one weight-update session
    (``session``: the URLs of ``begin_weight_update`` and ``end_weight_update``; SGLang 0.5.23
    updates only inside one). The weights SGLang serves are not touched.

    Raises:
        RuntimeError: a route did not answer HTTP 200 with ``success: true`` (naming it).
    """
    body = {
        "serialized_named_tensors": [init_marker(init)] * tp_size,
        "load_format": LOADER,
        "flush_cache": False,
    }
    begin, end = session
    _post_success(begin, {"selector": "all"}, timeout)
    try:
        _post_success(update_url, body, timeout)
    finally:
        _post_success(end, {}, timeout)


def wait_connected(
    control_url: str, instance: str, tp_size: int, server: str, timeout: float
) -> list[str]:
    """The worker ids ``<instance>-tp<rank>`` once all ``tp_size`` are connected to the
    control plane.

    Raises:
        RuntimeError: some did not connect within ``timeout`` seconds.
    """
    from .._control import Control

    ids = [f"{instance}-tp{r}" for r in range(tp_size)]
    control = Control(control_url)
    deadline = time.monotonic() + timeout
    while True:
        workers = {w.worker_id: w for w in control.status().workers}
        if all(i in workers and workers[i].connected for i in ids):
            return ids
        if time.monotonic() > deadline:
            missing = [i for i in ids if not (i in workers and workers[i].connected)]
            raise RuntimeError(
                f"{server}: ranks {missing} did not connect to {control_url} within {timeout} s "
                "(mx's loader logs why in SGLang's log, as 'mx.sglang')"
            )
        time.sleep(0.2)


__all__ = [
    "INIT_PREFIX",
    "LOADER",
    "attach",
    "init_marker",
    "load",
    "start_ranks",
    "wait_connected",
]
