"""mx behind verl 0.9.1's checkpoint engine (``CheckpointEngineRegistry`` backend ``"mx"``,
:mod:`mx.verl`): registration through verl's own registry and ``import_external_libs``, the
``engine_kwargs.mx`` validation, ``build_topology``, the actor side's refusals (each naming the
parameter) on a real FSDP2 module, then ``examples/verl_engine.py --ci`` end to end (two gloo
FSDP2 actor ranks, a real ``CheckpointEngineWorker`` and verl's installer into a real vLLM):
two syncs whose 272 tensors vLLM loaded equal the trainer's, a pull that does not verify and
leaves vLLM on the previous bytes, and nothing gathered.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engines import MODEL
from examples_ci import run_example_ci
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from mx.verl import ENGINE_KWARGS, MxCheckpointEngine
from mx.verl._engine import MxReceiveError

REPO = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:9"  # nothing listens: every test here fails before any call


def _kwargs(**kw) -> dict:
    out = {"control_url": URL, "model": str(MODEL), "layout": "fsdp:2"}
    out.update(kw)
    return {k: v for k, v in out.items() if v is not None}


def test_verl_imports_the_backend_module_and_builds_mx_s_engine_by_name():
    import_external_libs("mx.verl")  # what verl does with custom_backend_module
    assert CheckpointEngineRegistry.get("mx") is MxCheckpointEngine
    assert issubclass(MxCheckpointEngine, CheckpointEngine)
    assert MxCheckpointEngine.wire_format == "named_tensors"
    # The actor side, as engine_workers.py builds it; the rollout side, as
    # CheckpointEngineWorker builds it (no is_master).
    actor = CheckpointEngineRegistry.new("mx", is_master=True, bucket_size=64 << 20, **_kwargs())
    rollout = CheckpointEngineRegistry.new("mx", bucket_size=64 << 20, **_kwargs())
    assert (actor.role, actor.is_master, actor.bucket_size) == ("actor", True, 64 << 20)
    assert (rollout.role, rollout.is_master) == ("rollout", False)
    assert actor.config.worker_prefix == "verl-rollout" and actor.config.world_size == 2
    assert [t.name for t in actor.model.tensors][:1] == ["model.embed_tokens.weight"]
    # YAML may give numbers as strings.
    e = CheckpointEngineRegistry.new("mx", bucket_size=1, **_kwargs(stage_timeout="30"))
    assert e.config.stage_timeout == 30.0
    assert set(ENGINE_KWARGS) >= {"control_url", "model", "layout"}


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"bogus": 1}, "engine_kwargs.mx.bogus: unknown key"),
        ({"control_url": None}, "engine_kwargs.mx.control_url: required"),
        ({"control_url": "127.0.0.1:9"}, "engine_kwargs.mx.control_url: must be an http(s) URL"),
        ({"control_url": "http://"}, "engine_kwargs.mx.control_url: names no host"),
        ({"model": "/nonexistent"}, "engine_kwargs.mx.model: '/nonexistent' has no config.json"),
        ({"model": None}, "engine_kwargs.mx.model: required"),
        ({"layout": "tp:2"}, "engine_kwargs.mx.layout: must be fsdp:N or replicated:N"),
        ({"layout": "fsdp:0"}, "engine_kwargs.mx.layout: must be fsdp:N"),
        ({"layout": "fsdp:\u0663"}, "engine_kwargs.mx.layout: must be fsdp:N"),
        ({"layout": None}, "engine_kwargs.mx.layout: required"),
        ({"label_prefix": ""}, "engine_kwargs.mx.label_prefix: must be a non-empty name"),
        ({"worker_prefix": "a b"}, "engine_kwargs.mx.worker_prefix: must be a non-empty name"),
        ({"publish_timeout": -1}, "engine_kwargs.mx.publish_timeout: must be a positive number"),
        ({"stage_timeout": "soon"}, "engine_kwargs.mx.stage_timeout: must be a positive number"),
        ({"stage_timeout": True}, "engine_kwargs.mx.stage_timeout: must be a positive number"),
    ],
)
def test_engine_kwargs_are_checked_naming_the_key(kw, needle):
    with pytest.raises(ValueError) as e:
        MxCheckpointEngine(bucket_size=1 << 20, **_kwargs(**kw))
    assert str(e.value).startswith("checkpoint_engine." + needle.split(": ")[0]), str(e.value)
    assert needle in str(e.value)


def test_bucket_size_and_is_master_are_checked():
    with pytest.raises(ValueError, match=r"bucket_size .* must be a positive int, got 0"):
        MxCheckpointEngine(bucket_size=0, **_kwargs())
    with pytest.raises(ValueError, match="is_master must be a bool, got 'yes'"):
        MxCheckpointEngine(bucket_size=1, is_master="yes", **_kwargs())


def _meta(role, rank=None, master=False, layout="fsdp:2", sync=None):
    return {"role": role, "rank": rank, "is_master": master, "layout": layout, "sync": sync}


def test_build_topology_maps_actor_ranks_to_slots_and_rollout_ranks_to_pullers():
    meta = [_meta("actor", 0, True, sync="ab.1"), _meta("actor", 1)] + [_meta("rollout")] * 3
    a, r = MxCheckpointEngine.build_topology(2, 3, meta)
    assert a["rank"] == [0, 1] and a["sync"] == ["ab.1"] * 2 and a["role"] == ["actor"] * 2
    assert r["rank"] == [0, 1, 2] and r["world_size"] == [3] * 3 and r["sync"] == ["ab.1"] * 3
    assert all(len(v) == 2 for v in a.values()) and all(len(v) == 3 for v in r.values())
    assert r["peers"][0] == meta[:2] and a["peers"][1] == meta[2:]
    bad = [
        (meta[:4], "4 metadata for 2 + 3 workers"),
        ([meta[1], meta[0]] + meta[2:], "actor 0's metadata"),
        ([meta[0], _meta("actor", 1, True, sync="x")] + meta[2:], "2 master actors"),
        (meta[:2] + [_meta("actor", 2)] + meta[3:], "rollout 0's metadata"),
    ]
    for m, needle in bad:
        with pytest.raises(ValueError, match=re.escape(needle)):
            MxCheckpointEngine.build_topology(2, 3, m)
    one = [_meta("actor", 0, True, "fsdp:1", "s"), _meta("actor", 1, layout="fsdp:1")]
    with pytest.raises(ValueError, match=r"layouts \['fsdp:1'\] for 2 actor ranks"):
        MxCheckpointEngine.build_topology(2, 1, one + [_meta("rollout", layout="fsdp:1")])


def test_calls_out_of_order_or_on_the_wrong_side_are_refused():
    import asyncio

    actor = MxCheckpointEngine(bucket_size=1, is_master=True, **_kwargs())
    rollout = MxCheckpointEngine(bucket_size=1 << 30, **_kwargs())
    with pytest.raises(RuntimeError, match=r"no sync \(call prepare, build_topology"):
        asyncio.run(actor.send_weights(iter(()), global_steps=1))
    with pytest.raises(RuntimeError, match="receive_weights runs on the rollout side"):
        actor.receive_weights(1)
    with pytest.raises(RuntimeError, match="send_weights runs on the actor side"):
        asyncio.run(rollout.send_weights(iter(())))
    with pytest.raises(ValueError, match="assigned actor rank 0, this is rollout"):
        rollout.init_process_group(role="actor", rank=0, world_size=2, sync="s", peers=[])
    rollout.sync = "s"
    assert rollout._label(7) == "verl-g7-ss" and rollout._label(None) == "verl-ss"


def test_a_tensor_larger_than_a_bucket_is_refused_where_verl_s_path_cannot_take_it(monkeypatch):
    import verl.utils.device

    e = MxCheckpointEngine(bucket_size=32 << 20, **_kwargs())
    e.sync = "s"
    monkeypatch.setattr(verl.utils.device, "is_support_ipc", lambda: True)
    e._check_buckets()  # CUDA IPC: verl sends a larger tensor unbucketed
    monkeypatch.setattr(verl.utils.device, "is_support_ipc", lambda: False)
    with pytest.raises(ValueError) as err:
        e.receive_weights(1)  # refused before any pull (no puller exists here)
    assert str(err.value) == (
        "checkpoint_engine.update_weights_bucket_megabytes: tensor 'model.embed_tokens.weight' "
        "is 56623104 bytes, more than a bucket (33554432); verl's shared-memory path (no CUDA "
        "IPC here) cannot take it: set it to at least 54"
    )


def test_receive_errors_carry_the_label_and_code():
    err = MxReceiveError("verl-g3-s1", "DataLoss", "verification failed: tensor x")
    assert (err.label, err.code) == ("verl-g3-s1", "DataLoss")
    assert str(err) == "mx pull of verl-g3-s1 failed (DataLoss): verification failed: tensor x"


_DTENSOR_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
import verl_cpu  # verl's platform: cpu (get_device_id() is "cpu")
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.engine.fsdp.utils import unfuse_moe_params
from fsdp_ranks import one_rank_fsdp_llama
from verl_engine import _fsdp_engine
import mx
from mx.verl import MxCheckpointEngine, suspended_full_tensor

model_dir = sys.argv[1]
net, mesh, config = one_rank_fsdp_llama(model_dir)
params = dict(net.named_parameters())
tensors = {n: (str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params.items()}
engine = MxCheckpointEngine(
    bucket_size=1 << 20, is_master=True, control_url="http://127.0.0.1:9", model=model_dir,
    layout="fsdp:1")
engine.model = mx.Model.from_config(config, tensors)
engine.rank = 0
fsdp = _fsdp_engine(net)  # the fields of verl's FSDPEngine its method reads
full_before = DTensor.full_tensor
out = {}
gen, _ = FSDPEngine.get_per_tensor_param(fsdp)  # verl's own lazy generator
shards, calls = engine._shards(gen)
out["good"] = {
    "calls": calls,
    "n": len(shards),
    "in_place": all(
        t.data_ptr() == params[n].to_local().data_ptr() for n, (t, _) in shards.items()),
    "offsets": sorted({tuple(o) == (0,) * len(o) for _, (t, o) in shards.items()}),
}
out["restored"] = DTensor.full_tensor is full_before and "to" not in DTensor.__dict__

def refusal(gen):
    try:
        engine._shards(gen)
    except ValueError as e:
        return str(e)
    return None

items = list(params.items())
norm = "model.norm.weight"
out["plain"] = refusal((n, p.to_local() if n == norm else p) for n, p in items)
out["copy"] = refusal(
    (n, (p.to(torch.bfloat16, copy=True) if n == norm else p).full_tensor()) for n, p in items)
rep = distribute_tensor(params[norm].full_tensor().detach(), mesh, [Replicate()])
out["replicate"] = refusal((n, rep if n == norm else p) for n, p in items)
out["unknown"] = refusal([("model.extra.weight", params[norm])])
out["missing"] = refusal(items[1:])
out["dtype"] = refusal((n, p.float() if n == norm else p) for n, p in items)
out["twice"] = refusal(items + items[-1:])
packed = {"model.layers.0.mlp.experts.gate_up_proj": distribute_tensor(
    torch.zeros(4, 8, 16, dtype=torch.bfloat16), mesh, [Shard(0)])}
moe = unfuse_moe_params(
    ((name, param.to("cpu").full_tensor()) for name, param in packed.items()), "qwen3_moe")
out["packed"] = refusal(moe)
out["expert"] = refusal([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(2, 2))])
out["restored_after_refusals"] = DTensor.full_tensor is full_before and "to" not in DTensor.__dict__
with suspended_full_tensor() as s:
    same = params[norm].full_tensor() is params[norm]
out["suspended_returns_self"] = same and s.calls == 1
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def test_the_actor_side_reads_verls_generator_in_place_and_refuses_naming_the_parameter():
    # Its own process: a one-rank gloo group, FSDP2 on a one-layer llama of SmolLM2's shape,
    # verl's FSDPEngine.get_per_tensor_param over it.
    p = subprocess.run(
        [sys.executable, "-c", _DTENSOR_SCRIPT, str(MODEL)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    # Every parameter: its own FSDP2 local memory, no gather (full_tensor answered itself).
    assert out["good"] == {"calls": 11, "n": 11, "in_place": True, "offsets": [True]}, out
    assert out["restored"] and out["restored_after_refusals"] and out["suspended_returns_self"]
    where = "parameter 'model.norm.weight' (actor rank 0, layout fsdp:1)"
    assert out["plain"] == (
        f"{where}: a plain tensor, not an FSDP2 DTensor shard (verl's generator gathered it, "
        "or FSDP2 left the module unsharded)"
    )
    assert out["copy"].startswith(f"{where}: verl's .to(device) copied it"), out["copy"]
    assert out["replicate"].startswith(f"{where}: placements (Replicate(),)"), out["replicate"]
    assert out["unknown"].startswith("parameter 'model.extra.weight' (actor rank 0, layout")
    assert "has no tensor of that name" in out["unknown"]
    assert out["missing"] == (
        "verl's generator left out 'model.embed_tokens.weight' of the model (1 missing)"
    )
    assert out["dtype"] == f"{where}: torch.float32 [576], the model's is BF16 [576]"
    assert out["twice"] == f"{where}: yielded twice"
    assert out["packed"].startswith(
        "parameter 'model.layers.0.mlp.experts.gate_up_proj' [4, 8, 16]: packed MoE experts"
    ), out["packed"]
    assert "per-expert tensor verl's unfuse_moe_params split" in out["expert"]


def test_verl_engine_example_ci(tmp_path):
    """The example at CI's size: its report passes the harness's checker, and the values it
    rests on are the expected ones."""
    r = run_example_ci("verl_engine", tmp_path)
    assert [v["outcome"] for v in r["versions"]] == ["COMMITTED", "COMMITTED"]
    assert [v["global_steps"] for v in r["versions"]] == [1, 2]
    for s in r["syncs"]:
        assert s["tensors_verified"] == s["tensors"] == 272, s
        assert s["resident_verified"] > 0
        assert s["vllm_calls"] == [{"method": "update_weights_from_ipc", "status": 200}]
        for m in s["actor_metrics"]:
            assert m["mx/tensors"] == 272 and m["mx/suspended_full_tensor_calls"] == 272, m
        assert s["rollout_metrics"]["mx/wire_bytes"] == 269030016  # SmolLM2-135M in bf16
    rb = r["rollback"]
    assert (rb["error"], rb["code"]) == ("MxReceiveError", "DataLoss"), rb
    assert "model.norm.weight" in rb["reason"] and rb["vllm_calls_after_failure"] == []
    assert rb["tokens"] == r["syncs"][-1]["tokens"]
    assert rb["version_id"] not in [v["version_id"] for v in r["versions"]]
    assert r["gathered_bytes"] == 0 and r["collective_calls_in_sync"] == 0
    assert r["training_gathered_bytes"] > 0
    assert r["all_checks_hold"] is True
