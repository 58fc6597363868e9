"""mx behind vLLM's trainer-side weight-transfer API (``WeightTransferTrainerFactory``, backend
``"mx"``): the init info's validation and the engine's refusals without servers, then
``examples/vllm_trainer_api.py --ci`` end to end (an FSDP2 trainer of two gloo ranks, two real
vLLM servers with mx's plugin, vLLM's trainer API only): two committed steps verified against
cold starts, one server's install failing with both servers back on the previous version, and
nothing gathered by ``trainer_init``/``send_weights``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import check_report
import pytest
import torch
from engines import MODEL
from examples_ci import run_example_ci
from llama_fsdp import Llama
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import mx
from mx.vllm.trainer import MxTrainerInitInfo, MxTrainerWeightTransferEngine

REPO = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:9"  # nothing listens: every test here fails before any call


def _info(**kw) -> MxTrainerInitInfo:
    args = {"control_url": URL, "instance_id": "vllm-a", "layout": "fsdp:2", "model": str(MODEL)}
    args.update(kw)
    args.setdefault("rank", 0)
    return MxTrainerInitInfo(**args)


class _Client:
    """A ``VLLMWeightSyncClient`` that records calls (the refusals below must make none)."""

    base_url = "http://127.0.0.1:8"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init_weight_transfer_engine")

    def start_weight_update(self):
        self.calls.append("start_weight_update")

    def update_weights(self, update_info):
        self.calls.append("update_weights")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish_weight_update")


def test_the_factory_dispatches_mx_to_mx_s_engine():
    assert WeightTransferTrainerFactory._registry["mx"]() is MxTrainerWeightTransferEngine
    assert MxTrainerInitInfo.backend == "mx"
    assert MxTrainerWeightTransferEngine.init_info_cls is MxTrainerInitInfo
    info = _info(rank=1, layout="fsdp:2")
    assert not info.is_sender and _info().is_sender
    # The general plugin registers the trainer side too, idempotently.
    import mx.vllm

    mx.vllm.register()
    assert WeightTransferTrainerFactory._registry["mx"]() is MxTrainerWeightTransferEngine
    assert mx.vllm.MxTrainerInitInfo is MxTrainerInitInfo


def test_server_init_info_is_mx_s_with_the_client_url_and_options():
    info = _info(server_options={"prepare": False, "fill_nan": True})
    assert info.server_init_info("http://127.0.0.1:8000") == {
        "control_url": URL,
        "instance_id": "vllm-a",
        "engine_url": "http://127.0.0.1:8000",
        "prepare": False,
        "fill_nan": True,
    }
    own = _info(engine_url="http://10.0.0.2:8000")
    assert own.server_init_info("http://127.0.0.1:8000")["engine_url"] == "http://10.0.0.2:8000"
    assert isinstance(_info(model=mx.Model.from_dir(MODEL)).mx_model(), mx.Model)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"control_url": ""}, "init_info.control_url: must be a non-empty str"),
        ({"control_url": "grpc://x:1"}, "init_info.control_url: must be an http(s) URL"),
        ({"instance_id": ""}, "init_info.instance_id: must be a non-empty str"),
        ({"control_url": "http://"}, "init_info.control_url: names no host: 'http://'"),
        ({"control_url": "http://h:x"}, "init_info.control_url: has a port that is not a number"),
        ({"engine_url": "x:1"}, "init_info.engine_url: the server's http(s) URL or empty"),
        ({"publisher_token_file": "/nonexistent"}, "init_info.publisher_token_file: must be a"),
        ({"orchestrator_token_file": 1}, "init_info.orchestrator_token_file: must be a readable"),
        ({"layout": "tp:2"}, "init_info.layout: must be fsdp:N or replicated:N"),
        ({"layout": "fsdp:0"}, "init_info.layout: must be fsdp:N or replicated:N"),
        ({"layout": "fsdp:\u0663"}, "init_info.layout: must be fsdp:N or replicated:N"),
        ({"layout": "fsdp:2", "rank": 2}, "init_info.rank: 2 is outside layout fsdp:2"),
        ({"rank": -1}, "init_info.rank: got -1"),
        ({"rank": True}, "init_info.rank: got True"),
        ({"model": "/nonexistent"}, "init_info.model: '/nonexistent' has no config.json"),
        ({"model": 3}, "init_info.model: must be a checkpoint directory or an mx.Model"),
        ({"label_prefix": " "}, "init_info.label_prefix: empty"),
        ({"pause_mode": "in_place"}, "init_info.pause_mode: must be one of"),
        ({"stage_timeout": 0}, "init_info.stage_timeout: must be a positive number"),
        ({"call_timeout": "60"}, "init_info.call_timeout: must be a positive number"),
        ({"server_options": {"instance_id": "x"}}, "['instance_id'] are fields of their own"),
        ({"server_options": {"install": "copy"}}, "server_options: mx init_info.install"),
        ({"server_options": {"bogus": 1}}, "server_options: MxInitInfo.__init__() got an"),
        ({"server_options": []}, "init_info.server_options: must be a dict"),
        ({"check_prompt": [1, -1]}, "init_info.check_prompt: must be up to 4096 token ids"),
        ({"check_prompt": "504 3575"}, "init_info.check_prompt: must be up to 4096 token ids"),
        ({"check_tokens": 0}, "init_info.check_tokens: must be an int in 1..1024"),
    ],
)
def test_init_info_refuses_a_bad_field_naming_it(kw, message):
    with pytest.raises(ValueError) as e:
        _info(**kw)
    assert message in str(e.value)
    assert str(e.value).startswith(("mx trainer init_info.", "mx init_info."))


def _trainer_init(info, source, client=None):
    client = client or _Client()
    try:
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    finally:
        assert client.calls == []


class _Streamed(WeightSource):
    def metadata(self) -> list[ParamMeta]:
        return []

    def __iter__(self) -> Iterator:
        raise AssertionError("mx must never iterate a source (a gather for FSDP)")


def _llama(drop: str = "", extra: str = "") -> torch.nn.Module:
    config = json.loads((MODEL / "config.json").read_text())
    with torch.device("meta"):
        net = Llama(config).to(torch.bfloat16)
    if drop:
        parent, _, leaf = drop.rpartition(".")
        delattr(net.get_submodule(parent), leaf)
    if extra:
        net.register_parameter(extra, torch.nn.Parameter(torch.zeros(2, device="meta")))
    return net


def test_trainer_init_refuses_sources_it_cannot_read_in_place():
    with pytest.raises(TypeError, match="a _Streamed yields materialized tensors"):
        _trainer_init(_info(), _Streamed())
    with pytest.raises(ValueError, match=r"pass source=ModuleSource\(module\)"):
        _trainer_init(_info(), None)
    with pytest.raises(TypeError, match="init_info must be an MxTrainerInitInfo, not dict"):
        MxTrainerWeightTransferEngine.trainer_init(
            {"rank": 0},  # type: ignore[arg-type]
            client=_Client(),
            source=ModuleSource(_llama()),
        )


def test_trainer_init_names_the_parameter_it_cannot_publish():
    # Under fsdp:2 every parameter must be an FSDP2 DTensor shard: a plain module is refused.
    with pytest.raises(ValueError) as e:
        _trainer_init(_info(), ModuleSource(_llama()))
    assert "parameter 'model.embed_tokens.weight' (rank 0, layout fsdp:2): a plain tensor" in str(
        e.value
    )
    assert "module.reshard()" in str(e.value)
    # A parameter the model does not have, one of another dtype, one missing.
    with pytest.raises(ValueError, match="parameter 'bonus' .* the model .* has no tensor"):
        _trainer_init(_info(layout="replicated:1"), ModuleSource(_llama(extra="bonus")))
    f32 = _llama().to(torch.float32)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' .*torch.float32 .* BF16"):
        _trainer_init(_info(layout="replicated:1"), ModuleSource(f32))
    with pytest.raises(ValueError, match="no parameter 'model.norm.weight' of the model"):
        _trainer_init(_info(layout="replicated:1"), ModuleSource(_llama(drop="model.norm.weight")))
    # replicated:N must name the trainer's process count (here one, no torch.distributed).
    with pytest.raises(
        ValueError, match="replicated:2 names 2 publishing ranks, the trainer runs 1"
    ):
        _trainer_init(_info(layout="replicated:2"), ModuleSource(_llama()))


def test_token_files_are_read_at_construction(tmp_path):
    empty, short, good = tmp_path / "empty", tmp_path / "short", tmp_path / "good"
    empty.write_text("\n")
    short.write_text("abc\n")
    good.write_text("  " + "t" * 24 + "\r\n")
    for bad in (empty, short):
        with pytest.raises(ValueError, match=r"init_info.publisher_token_file: .* holds no token"):
            _info(publisher_token_file=str(bad))
    assert _info(orchestrator_token_file=str(good)).orchestrator_token_file == str(good)


def test_engines_sharing_a_publication_must_agree_on_its_refit_options():
    """Engines of one process with the same control plane, layout and rank refit their servers
    in one refit: a second engine's refit options may not silently differ from the first's."""
    from mx.vllm.trainer import _same_refit_options

    first = _info()
    _same_refit_options(
        _info(instance_id="vllm-b", engine_url="http://b:1", server_options={"prepare": False}),
        first,
    )
    with pytest.raises(ValueError) as e:
        _same_refit_options(_info(label_prefix="other", check_prompt=[1, 2]), first)
    assert "differs from the first ('vllm-a') in label_prefix 'step' -> 'other', check_prompt" in (
        str(e.value)
    )


def test_labels_continue_after_the_last_version_ready_or_later():
    """A restarted trainer's first label: after the highest <prefix>-<n> READY or later; ones
    still DECLARED or PUBLISHING (the sender ahead of this rank, or left by a dead trainer) are
    published again under their label; other prefixes and non-numbers do not count."""
    from types import SimpleNamespace

    from mx.vllm.trainer import _last_number

    def control(*versions: tuple[str, str]) -> SimpleNamespace:
        summaries = tuple(
            mx.VersionSummary(label, mx.VersionState(st), None) for label, st in versions
        )
        status = mx.FleetStatus(summaries, (), None, None)
        return SimpleNamespace(status=lambda: status)

    assert _last_number(control(), "step") == 0
    got = control(
        ("step-1", "COMMITTED"),
        ("step-2", "READY"),
        ("step-3", "PUBLISHING"),
        ("step-9", "DECLARED"),
        ("steps-7", "COMMITTED"),
        ("step-x", "COMMITTED"),
        ("step-\u0665", "COMMITTED"),
        ("other-5", "COMMITTED"),
    )
    assert _last_number(got, "step") == 2
    assert _last_number(got, "steps") == 7


def test_reports_may_leave_a_cold_start_out_but_never_the_last_step_s():
    def report(*cold: bool | None) -> dict:
        inst = [{"id": "a", "kind": "vllm", "engine_layout": "tp:1", "source": "mx"}]
        steps = [
            {"step": k, "instances": [{**inst[0], "tokens_match_cold_start": c}]}
            for k, c in enumerate(cold, start=1)
        ]
        for s in steps:
            s["instances"][0]["tokens_changed"] = True
        vids = [f"mx:{k:064x}" for k in range(len(cold))]
        versions = [{"version_id": v, "outcome": "COMMITTED"} for v in vids]
        return {"all_checks_hold": True, "versions": versions, "steps": steps}

    assert check_report.common(report(None, True)) == []
    assert check_report.common(report(True, None)) == [
        "step 2: the last step is not checked on a cold start"
    ]
    assert check_report.common(report(False, True)) == ["step 1 a: tokens_match_cold_start false"]


def test_vllm_trainer_api_example_ci(tmp_path):
    """The example at CI's size: its report passes the harness's checker, and the values it
    rests on are the expected ones."""
    r = run_example_ci("vllm_trainer_api", tmp_path)
    assert [v["outcome"] for v in r["versions"]] == ["COMMITTED", "COMMITTED"]
    # Under a control plane that checks tokens, the trainer restarted between the two steps:
    # server A re-initialized after a shutdown, server B re-attached; both kept serving step-1
    # (not the checkpoint on disk), admitted; the restarted trainer's version is step-2.
    assert [v["label"] for v in r["versions"]] == ["step-1", "step-2"]
    first = r["versions"][0]["version_id"]
    for name, inst in r["restart"]["servers"].items():
        assert inst["weight_version"] == first == inst["control_plane_resident"], (name, inst)
        assert inst["admitted"] is True, (name, inst)
    assert r["restart"]["servers"]["vllm-a"]["engine"] == "shut down, initialized again"
    for s in r["steps"]:
        for i in s["instances"]:
            assert i["weight_version"] == s["version_id"] == i["control_plane_resident"]
    # --ci: the last committed step against a cold start, the first by its read-back.
    assert [[i["cold_tokens"] for i in s["instances"]] for s in r["steps"][:-1]] == [[None, None]]
    for i in r["steps"][-1]["instances"]:
        assert i["tokens"] == i["cold_tokens"], (r["steps"][-1]["label"], i)
    rb = r["rollback"]
    assert rb["outcome"] == "ROLLED_BACK", rb
    last = r["versions"][-1]["version_id"]
    assert rb["version_id"] != last
    for inst in rb["servers"].values():
        assert inst["weight_version"] == last == inst["control_plane_resident"]
    tokens = {i["id"]: i["tokens"] for i in r["steps"][-1]["instances"]}
    assert {n: s["tokens"] for n, s in rb["servers"].items()} == tokens
    assert r["gathered_bytes"] == 0 and r["collective_calls_in_send"] == 0
    assert r["training_gathered_bytes"] > 0
    # The control plane's post-update check ran on both servers before each commit.
    for s in r["steps"]:
        assert s["post_update_check"] == {f"{i['id']}-tp0": i["tokens"] for i in s["instances"]}
        assert "CHECK" in s["phase_seconds"], s["phase_seconds"]


_DTENSOR_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor
from fsdp_ranks import one_rank_fsdp_llama
import mx
from mx.vllm.trainer import MxTrainerInitInfo, _local_shards

net, mesh, config = one_rank_fsdp_llama(sys.argv[1])
params = dict(net.named_parameters())
tensors = {n: (str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params.items()}
model = mx.Model.from_config(config, tensors)
out = {}
info = MxTrainerInitInfo("http://127.0.0.1:9", "a", "fsdp:1", model, rank=0)
shards = _local_shards(net, info, model)
out["fsdp1"] = sorted(
    (n, off, t.data_ptr() == params[n].to_local().data_ptr(), t.shape == params[n].shape)
    for n, (t, off) in shards.items()
)
for layout in ("fsdp:2", "replicated:1"):
    try:
        bad = MxTrainerInitInfo("http://127.0.0.1:9", "a", layout, model, rank=0)
        _local_shards(net, bad, model)
    except ValueError as e:
        out[layout] = str(e)
whole = net.model.norm.weight.full_tensor().detach()
net.model.norm.weight = torch.nn.Parameter(distribute_tensor(whole, mesh, [Replicate()]))
try:
    _local_shards(net, info, model)
except ValueError as e:
    out["replicate"] = str(e)
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def test_local_shards_are_the_fsdp2_shards_in_place_and_other_placements_are_refused(tmp_path):
    # Its own process: a one-rank gloo group and FSDP2 on a one-layer llama of SmolLM2's shape.
    p = subprocess.run(
        [sys.executable, "-c", _DTENSOR_SCRIPT, str(MODEL)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    # fsdp:1: every parameter's local shard is the whole tensor at offset 0, its own memory.
    assert len(out["fsdp1"]) == 11, out["fsdp1"]
    for name, offset, same_memory, whole in out["fsdp1"]:
        assert offset == [0] * len(offset) and same_memory and whole, name
    assert out["fsdp:2"] == (
        "parameter 'model.embed_tokens.weight' (rank 0, layout fsdp:2): this process is rank 0 "
        "of a mesh of 1, init_info says rank 0 of 2"
    )
    assert "a DTensor placed" in out["replicated:1"]
    assert out["replicate"].startswith(
        "parameter 'model.norm.weight' (rank 0, layout fsdp:1): a DTensor placed (Replicate(),)"
    ), out["replicate"]
