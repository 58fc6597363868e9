"""Stand-in for the package ``sgl_kernel`` (sglang-kernel 0.4.10) on a machine without a GPU.

Why it exists: SGLang 0.5.23 imports names from ``sgl_kernel`` when its modules load, with its
CPU engine too (``SGLANG_USE_CPU_ENGINE=1``; for example ``sglang/kernels/ops/kvcache/
cache_move.py`` does ``from sgl_kernel import copy_all_layer_kv_cache_cpu``). The real package's
``__init__`` first loads its compiled ops library, and that fails without the NVIDIA driver
("ImportError: libcuda.so.1: cannot open shared object file: No such file or directory", raised
as "[sgl_kernel] CRITICAL: Could not load any common_ops library!"). PyPI has no CPU build of
sglang-kernel, and an empty ``sgl_kernel`` does not do either ("cannot import name
'copy_all_layer_kv_cache_cpu' from 'sgl_kernel'").

What it does: placed first on ``PYTHONPATH`` (``python/stand-ins``; examples/engines.py's
``SglangServer`` does that) it is imported instead of the real package, which stays installed
in the venv (scripts/setup-sglang.sh). It points its ``__path__`` at the real package's
directory, so every submodule (``sgl_kernel.elementwise``, ...) is the real one; makes the real
``load_utils._load_architecture_specific_ops`` return an empty module instead of loading the
library; and runs the real ``__init__.py`` as this module. Nothing else changes: the ops that
live in the CUDA library are absent, and SGLang's CPU engine does not call them for the models
run here (it uses plain PyTorch ops; SmolLM2 gives the same greedy tokens as vLLM). Some model
modules read an op at import (``sglang/srt/models/qwen3_5.py``: ``torch.ops.sgl_kernel.
fused_sigmoid_mul_cpu``; Dynamo's SGLang worker imports it through its video routing), so
``torch.ops.sgl_kernel`` answers those few ops (``_READ_AT_IMPORT``) with a function that raises
``NotImplementedError`` naming the op when called, instead of an ``AttributeError`` at import.
"""

import os
import sys
import types

import torch


def _real_dir() -> str:
    here = os.path.dirname(os.path.realpath(__file__))
    for entry in sys.path:
        d = os.path.realpath(os.path.join(entry or os.getcwd(), "sgl_kernel"))
        if d != here and os.path.isfile(os.path.join(d, "__init__.py")):
            return d
    raise ImportError("stand-in sgl_kernel: no real sgl_kernel (sglang-kernel) on sys.path")


__path__ = [_real_dir()]
__file__ = os.path.join(__path__[0], "__init__.py")

from sgl_kernel import load_utils  # noqa: E402 - the real submodule, through __path__

load_utils._load_architecture_specific_ops = lambda: types.ModuleType("common_ops")
with open(__file__) as _f:
    exec(compile(_f.read(), __file__, "exec"))


# Ops that SGLang's CPU model modules read when they are imported (not called for the models run
# here): sglang/srt/models/qwen3_5.py, which Dynamo's SGLang worker imports through its video
# routing. Only these answer: ``hasattr(torch.ops.sgl_kernel, op)`` stays false for every other op
# (sglang/srt/utils/patch_torch.py registers fake kernels only for ops that exist).
_READ_AT_IMPORT = frozenset(
    {
        "fused_sigmoid_mul_cpu",
        "fused_qk_gemma_rmsnorm_cpu",
        "fused_qk_gemma_rmsnorm_with_gate_cpu",
        "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    }
)


class _AbsentOps(torch._ops._OpNamespace):
    """``torch.ops.sgl_kernel``: the ops of ``_READ_AT_IMPORT`` raise when called."""

    def __getattr__(self, op_name: str):
        if op_name not in _READ_AT_IMPORT:
            return super().__getattr__(op_name)

        def absent(*_args, **_kwargs):
            raise NotImplementedError(
                f"torch.ops.sgl_kernel.{op_name}: sglang-kernel's compiled library is not loaded "
                "on this machine (python/stand-ins/sgl_kernel)"
            )

        return absent


torch.ops.sgl_kernel = _AbsentOps("sgl_kernel")
