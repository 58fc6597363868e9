"""``examples/rl_loop.py --ci --engines vllm,dynamo,sglang`` end to end: an FSDP2 trainer, one
step refit by mx on a vLLM server, a Dynamo vLLM worker and an SGLang server at once, each
checked against a cold start of its own kind on the step's weights, then a step whose refit
must roll back on all three (the vLLM server's logits perturbed). A pytest module, so the
suite's two workers run it beside another module."""

from __future__ import annotations

from examples_ci import run_example_ci


def test_rl_loop_mixed_fleet_example(tmp_path):
    r = run_example_ci("rl_loop", tmp_path, args=("--ci", "--engines", "vllm,dynamo,sglang"))
    (step,) = r["steps"]
    assert sorted(i["kind"] for i in step["instances"]) == ["dynamo", "sglang", "vllm"]
    for inst in step["instances"]:
        assert inst["tokens_match_cold_start"] is True, inst
    assert [v["outcome"] for v in r["versions"]] == ["COMMITTED"]
    assert r["rollback"]["ran"] and r["rollback"]["verified"], r["rollback"]
