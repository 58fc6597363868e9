"""``python -m mx.dynamo.vllm_worker ARGS`` runs Dynamo 1.6.1's vLLM worker
(``python -m dynamo.vllm ARGS``) on vLLM 0.32.

Dynamo 1.6.1 pins vLLM 0.31.0, and its module ``dynamo.vllm.embedding_worker_processes``
(imported by ``dynamo.vllm.main`` whatever the model) does
``from vllm.v1.engine.utils import get_engine_zmq_addresses``, a function vLLM 0.32 renamed
``get_engine_zmq_bind_addresses`` (with other arguments): on 0.32 the worker fails at import.
Only Dynamo's embedding path with ``--embedding-worker-processes`` above 1 calls it, so this
module adds a stand-in that raises :class:`NotImplementedError` naming the reason, then runs
``dynamo.vllm`` as ``__main__`` with the same arguments. On vLLM 0.31, which has the function,
it adds nothing: the worker runs exactly as ``python -m dynamo.vllm``.

mx takes part through vLLM itself: ``--weight-transfer-config '{"backend":"mx"}'`` selects mx's
weight-transfer backend, which the package ``mx`` registers in every vLLM process through vLLM's
``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import runpy
import sys


def _shim_vllm() -> None:
    import vllm.v1.engine.utils as utils

    if hasattr(utils, "get_engine_zmq_addresses"):
        return

    def get_engine_zmq_addresses(*args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            "mx.dynamo.vllm_worker: Dynamo 1.6.1's embedding worker processes "
            "(--embedding-worker-processes > 1) call vllm.v1.engine.utils."
            "get_engine_zmq_addresses, which vLLM 0.32 renamed get_engine_zmq_bind_addresses; "
            "run with one embedding worker process, or on vLLM 0.31"
        )

    utils.get_engine_zmq_addresses = get_engine_zmq_addresses


def main() -> None:
    _shim_vllm()
    sys.argv[0] = "dynamo.vllm"
    runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
