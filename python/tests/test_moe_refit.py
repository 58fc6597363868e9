"""``examples/moe_refit.py --ci`` end to end: a random Qwen3-MoE (8 experts, top-2) into a real
vLLM, an FSDP2 trainer whose steps alternate its own publication and a Megatron-Core cut
(tp=2, pp=2, ep=2), 3 refits checked against cold starts and a rollback; FP8: a bf16 version
quantized per rank into 128x128 blocks, byte-equal to vLLM's own quantizer. A pytest module,
so the suite's two workers run it beside another module."""

from __future__ import annotations

from examples_ci import run_example_ci


def test_moe_refit_example(tmp_path):
    r = run_example_ci("moe_refit", tmp_path)
    assert [v["outcome"] for v in r["versions"]] == ["COMMITTED"] * 3
    assert r["rollback_verified"] is True
    assert r["fp8"]["bytes_equal_reference"] is True, r["fp8"]["mismatches"]
