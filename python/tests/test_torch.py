"""The venv's torch (the version the vLLM CPU build of the next issue needs), and tensors as
version declarations."""

from __future__ import annotations

import numpy as np
import torch


def test_torch_is_2_13_0_and_runs_on_cpu():
    assert torch.__version__.startswith("2.13.0"), torch.__version__
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert float((x @ x.T).sum()) == 83.0  # [[5, 14], [14, 50]]
    assert torch.ones(4, dtype=torch.bfloat16).sum().item() == 4.0


def test_declare_from_torch_tensors_and_numpy_arrays(control):
    tensors = {
        "model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
        "model.norm.weight": np.zeros(8, dtype=np.float32),
        "lm_head.weight": ("F16", (16, 8)),
    }
    control.declare("step-1", tensors, trainer_layout="fsdp:2")
    info = control.version("step-1")
    got = {t.name: (t.dtype, t.shape) for t in info.tensors}
    assert got == {
        "model.embed_tokens.weight": ("BF16", (16, 8)),
        "model.norm.weight": ("F32", (8,)),
        "lm_head.weight": ("F16", (16, 8)),
    }
    assert info.trainer_layout == "fsdp:2"
    assert info.missing_slots == (0, 1)
