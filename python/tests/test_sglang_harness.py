"""The SGLang harness against a real SGLang 0.5.23 server (examples/engines.py's
``SglangServer``: ``python -m sglang.launch_server`` from ``.mx/venv-sglang`` on CPU, with the
``sgl_kernel`` stand-in), while this test runs in ``.mx/venv``: greedy tokens = COLD_TOKENS, the
initial weight version, a pause/continue round, and the weight-update session's answers equal to
the ones the Rust client's tests are built on
(``crates/engine-clients/adapters/tests/fixtures/sglang-0.5.23.json``). One server for the module
(start-up 45-75 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engines import COLD_TOKENS, MODEL, PROMPT, SglangServer

FIXTURES = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "crates/engine-clients/adapters/tests/fixtures/sglang-0.5.23.json"
    ).read_text()
)


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    engine = SglangServer(tmp_path_factory.mktemp("sglang"))
    yield engine
    engine.stop()


def _call(engine: SglangServer, name: str):
    """Replays the fixture ``name``'s request: ``(status, body)``."""
    method, route = FIXTURES[name]["route"].split(" ", 1)
    return engine.call(method, route, FIXTURES[name].get("request"))


def _fixture(name: str):
    return FIXTURES[name]["status"], FIXTURES[name]["body"]


def test_greedy_tokens_are_the_cold_tokens(sglang):
    assert sglang.generate(PROMPT) == COLD_TOKENS
    status, body = _call(sglang, "generate_ok")
    want_status, want = _fixture("generate_ok")
    assert status == want_status and body["output_ids"] == want["output_ids"] == COLD_TOKENS
    assert sorted(body["meta_info"]) == sorted(want["meta_info"])


def test_model_info_starts_at_the_default_version(sglang):
    info = sglang.model_info()
    assert info["weight_version"] == "default"
    # The fixture's, but for the model directory (the checkout's path on this machine).
    paths = dict.fromkeys(("model_path", "served_model_name", "tokenizer_path"), str(MODEL))
    assert info == {**_fixture("model_info")[1], **paths}


def test_pause_retract_then_continue_and_generate(sglang):
    assert _call(sglang, "pause_retract") == _fixture("pause_retract")
    assert _call(sglang, "continue_ok") == _fixture("continue_ok")
    assert sglang.generate(PROMPT) == COLD_TOKENS


def test_weight_update_session_answers_as_the_fixtures_say(sglang):
    for name in (
        "begin_ok",
        "begin_already_open",
        "end_ok",
        "end_no_session",
        "tensor_outside_session",
    ):
        assert _call(sglang, name) == _fixture(name), name
    assert sglang.generate(PROMPT) == COLD_TOKENS
