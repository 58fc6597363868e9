"""verl's vLLM worker extension on a CPU vLLM, for ``examples/verl_engine.py``: vLLM is started
with ``--worker-extension-cls verl_vllm_ext.CpuColocateWorkerExtension``, a subclass of verl
0.9.1's ``vLLMColocateWorkerExtension`` whose ``update_weights_from_ipc`` (verl's installer:
``BucketedWeightReceiver`` over ZMQ + shared memory, then ``model.load_weights`` per bucket)
runs unchanged, with two CPU adaptations and one probe:

- vLLM's CPU backend repacks every Linear weight after loading and leaves the parameter empty,
  so a plain ``load_weights`` has nowhere to write: the update runs inside vLLM's layerwise
  reload (``initialize_layerwise_reload`` before, ``finalize_layerwise_reload`` in place of
  verl's closing ``process_weights_after_loading``), as vLLM's own ``reload_weights`` does; the
  tied ``lm_head`` is processed again (mx's vLLM backend does the same).
- The platform is :mod:`verl_cpu` (no CUDA IPC: verl's shared-memory path).
- Probe (the checker's, not part of any transfer): every tensor the installer hands
  ``load_weights`` is hashed (sha256 of its bytes) as it goes in, and :meth:`mx_verl_readback`
  returns those digests, the number of updates, and the sha256 of the parameters vLLM keeps
  in their own memory on CPU (embeddings, norms) read back from the model.
"""

from __future__ import annotations

from typing import Any

import verl_cpu  # noqa: F401  (the platform, before verl asks for one)
from fsdp_ranks import sha256
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class CpuColocateWorkerExtension(vLLMColocateWorkerExtension):
    """verl's worker extension, its installer run inside vLLM's layerwise reload."""

    def update_weights_from_ipc(
        self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import utils as loader_utils
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from mx.vllm._engine import _refresh_tied_heads

        def finalize(model: Any, model_config: Any, device: Any) -> None:
            finalize_layerwise_reload(model, model_config)
            _refresh_tied_heads(model)

        self._mx_loading: dict[str, str] = {}
        config = self.model_runner.vllm_config
        before = loader_utils.process_weights_after_loading
        with set_current_vllm_config(config):
            initialize_layerwise_reload(self.model_runner.model)
            loader_utils.process_weights_after_loading = finalize
            try:
                super().update_weights_from_ipc(
                    peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
                )
            finally:
                loader_utils.process_weights_after_loading = before
        self._mx_loaded = self._mx_loading
        self._mx_updates = getattr(self, "_mx_updates", 0) + 1

    def _update_weights(self, weights: list, peft_config: Any, base_sync_done: bool) -> Any:
        for name, t in weights:
            self._mx_loading[name] = sha256(t)
        return super()._update_weights(weights, peft_config, base_sync_done)

    def mx_verl_readback(self) -> dict[str, Any]:
        """The probe: digests of the tensors the last update loaded, the number of updates,
        and the digests of the parameters that keep their memory (numel > 0)."""
        resident = {
            n: sha256(p.data)
            for n, p in self.model_runner.model.named_parameters()
            if p.numel() > 0 and ("norm" in n or "embed_tokens" in n)
        }
        return {
            "loaded": getattr(self, "_mx_loaded", {}),
            "updates": getattr(self, "_mx_updates", 0),
            "resident": resident,
        }
