"""The exchange of a prepared set in place (``Prepared.exchange(in_place=True)``, issue 33's GPU
path: CUDA graphs hold the live tensors' addresses), on plain torch modules: the live tensors
keep their ``data_ptr`` and take the prepared values, the shadows take the old ones, a tensor
two modules share is exchanged once, a second exchange restores every byte, a failure halfway
leaves every byte as it was, and a processed form that is not tensors of the live shapes is
refused naming the attribute. (vLLM's own processing on a GPU, and a CUDA graph replayed over
the exchanged tensors, wait for a device: the CPU build of vLLM packs GEMM weights into
handles, which this exchange refuses; see test_vllm_contract.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from mx.vllm._prepared import Prepared


class Tiny(torch.nn.Module):
    """An embedding, a head tied to it, a linear layer with a bias and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(self.embed(ids)) * self.scale)


def _prepared(live: Tiny, seed: int) -> tuple[Prepared, Tiny]:
    shadow = copy.deepcopy(live)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in shadow.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    pairs = [
        (name, m, s, frozenset({"_parameters", "_buffers"}))
        for (name, m), s in zip(live.named_modules(), shadow.modules(), strict=True)
    ]
    return Prepared(shadow, pairs), shadow


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()}


def _ptrs(m: torch.nn.Module) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in m.state_dict(keep_vars=True).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


IDS = torch.tensor([[1, 5, 9, 3]])


def test_in_place_exchange_keeps_addresses_and_rolls_back_bit_exact():
    torch.manual_seed(0)
    live = Tiny()
    p, shadow = _prepared(live, seed=1)
    # The embedding's weight (the head's too: one tensor), the linear weight and bias, the
    # buffer.
    assert p.plan_in_place() == 4
    ptrs, old, new = _ptrs(live), _state(live), _state(shadow)
    old_out, new_out = live(IDS).detach(), shadow(IDS).detach()
    assert not torch.equal(old_out, new_out)

    p.exchange(in_place=True)
    assert _ptrs(live) == ptrs
    assert _same(_state(live), new) and _same(_state(shadow), old)
    assert live.head.weight is live.embed.weight
    assert torch.equal(live(IDS), new_out)

    p.exchange(in_place=True)
    assert _ptrs(live) == ptrs
    assert _same(_state(live), old) and _same(_state(shadow), new)
    assert torch.equal(live(IDS), old_out)


def test_in_place_exchange_failing_halfway_changes_nothing():
    torch.manual_seed(0)
    live = Tiny()
    p, shadow = _prepared(live, seed=2)
    p.plan_in_place()
    old, new = _state(live), _state(shadow)
    with pytest.raises(RuntimeError, match="install_after:2"):
        p.exchange(failpoint=("install_after", 2), in_place=True)
    assert _same(_state(live), old) and _same(_state(shadow), new)


def test_a_processed_form_that_is_not_the_live_tensors_is_refused_by_name():
    live = Tiny()
    p, shadow = _prepared(live, seed=3)
    before = _state(live)
    with pytest.raises(RuntimeError, match="plan_in_place"):
        p.exchange(in_place=True)

    # A packed kernel handle set by processing (as vLLM's CPU layers hold in cpu_linear).
    shadow.lin.__dict__["cpu_linear"] = lambda x: x
    keys = frozenset({"_parameters", "_buffers", "cpu_linear"})
    pairs = [(n, m, s, keys if n == "lin" else k) for n, m, s, k in p._pairs]
    with pytest.raises(ValueError, match=r"lin\.cpu_linear cannot be exchanged in place"):
        Prepared(shadow, pairs).plan_in_place()

    # A repacked weight of another shape.
    shadow2 = copy.deepcopy(live)
    shadow2.lin.weight = torch.nn.Parameter(torch.zeros(4, 16))
    pairs = [
        (n, m, s, frozenset({"_parameters"}))
        for (n, m), s in zip(live.named_modules(), shadow2.modules(), strict=True)
    ]
    with pytest.raises(ValueError, match=r"lin\._parameters\['weight'\] cannot be exchanged"):
        Prepared(shadow2, pairs).plan_in_place()
    # Nothing changed by the refusals.
    assert _same(_state(live), before)


def test_the_object_exchange_swaps_tensors_without_copying():
    live = Tiny()
    p, shadow = _prepared(live, seed=4)
    w_live, w_shadow = live.lin.weight, shadow.lin.weight
    p.exchange()
    assert live.lin.weight is w_shadow and shadow.lin.weight is w_live
    p.exchange()
    assert live.lin.weight is w_live and shadow.lin.weight is w_shadow
