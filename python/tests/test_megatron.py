"""A Megatron-Core trainer's ranks as mx sources: a tiny Qwen3-MoE cut into
``megatron:tp=2,pp=2,ep=2`` by the examples' own slicing code (examples/megatron_cut.py, written
from Megatron-Core's rules independently of mx-layout), published from each rank's own tensors
under Megatron-Core's names (``Publisher.set_params``), pulled into vLLM's ``tp:2`` and
``tp-ep:2`` layouts and compared byte for byte with the full tensors; then an in-place step of
the Megatron tensors published again. Bad parameter sets are refused naming the parameter."""

from __future__ import annotations

import megatron_cut
import pytest
import torch
from procs import publish_all

import mx

H, HEADS, KV, HEAD_DIM, VOCAB, LAYERS, EXPERTS, MOE_I = 32, 4, 2, 8, 300, 2, 4, 16
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": 64,
    "moe_intermediate_size": MOE_I,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "vocab_size": VOCAB,
    "num_hidden_layers": LAYERS,
    "tie_word_embeddings": False,
}
TP, PP, EP = 2, 2, 2
LAYOUT = f"megatron:tp={TP},pp={PP},ep={EP}"


def _shapes() -> dict[str, tuple[int, ...]]:
    s = {
        "model.embed_tokens.weight": (VOCAB, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (VOCAB, H),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s[p + "self_attn.q_proj.weight"] = (HEADS * HEAD_DIM, H)
        s[p + "self_attn.k_proj.weight"] = (KV * HEAD_DIM, H)
        s[p + "self_attn.v_proj.weight"] = (KV * HEAD_DIM, H)
        s[p + "self_attn.q_norm.weight"] = (HEAD_DIM,)
        s[p + "self_attn.k_norm.weight"] = (HEAD_DIM,)
        s[p + "self_attn.o_proj.weight"] = (H, HEADS * HEAD_DIM)
        s[p + "mlp.gate.weight"] = (EXPERTS, H)
        for e in range(EXPERTS):
            x = f"{p}mlp.experts.{e}."
            s[x + "gate_proj.weight"] = (MOE_I, H)
            s[x + "up_proj.weight"] = (MOE_I, H)
            s[x + "down_proj.weight"] = (H, MOE_I)
    return s


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in _shapes().items()}


@pytest.fixture
def model(weights) -> mx.Model:
    return mx.Model.from_config(CONFIG, weights)


def _mismatches(puller: mx.Puller, params, ref: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for p in puller.params():
        flat = params[p.rank][p.name].view(torch.uint8).reshape(-1)
        for pc in p.pieces:
            box = tuple(slice(o, o + e) for o, e in zip(pc.box_offset, pc.box_shape, strict=True))
            want = ref[pc.tensor][box].contiguous().view(torch.uint8).reshape(-1)
            if not torch.equal(flat[pc.offset : pc.offset + want.numel()], want):
                bad.append(f"rank {p.rank} {p.name} <- {pc.tensor}{list(pc.box_offset)}")
    return bad


def test_megatron_ranks_publish_in_place_into_vllm_tp_and_ep_layouts(control, model, weights):
    ranks = megatron_cut.cut(weights, CONFIG, TP, PP, EP)
    assert len(ranks) == TP * PP * EP
    # mx-layout's Megatron rank = the example's cut: same names and shapes, slot by slot.
    for slot, own in enumerate(ranks):
        layout = {p.name: p.shape for p in model.rank_layout(LAYOUT, slot)}
        assert layout == {n: tuple(t.shape) for n, t in own.items()}, f"slot {slot}"
    pubs = []
    engines = []
    try:
        for slot, own in enumerate(ranks):
            pub = mx.Publisher(control.url, model=model, layout=LAYOUT, slot=slot)
            pub.set_params(own)
            pubs.append(pub)
        for layout in ("tp:2", "tp-ep:2"):
            puller = mx.Puller(
                control.url, model=model, layout=layout, ranks=[0, 1], worker_id=f"w-{layout}"
            )
            params = {
                r: {
                    p.name: torch.full(p.shape, float("nan"), dtype=torch.bfloat16)
                    for p in puller.params(r)
                }
                for r in (0, 1)
            }
            for r, ps in params.items():
                puller.register(r, ps)
            engines.append((puller, params))
        control.declare("m1", weights, trainer_layout=LAYOUT)
        v1 = publish_all(pubs, "m1", 60.0)
        for puller, params in engines:
            assert puller.stage("m1").version_id == v1
            assert puller.apply().kind == "staged"
            assert _mismatches(puller, params, weights) == []
        # Experts under tp-ep:2: whole, rank 1 holding global experts 2 and 3.
        ep_puller, ep_params = engines[1]
        w13 = ep_params[1]["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        gate3 = weights["model.layers.1.mlp.experts.3.gate_proj.weight"]
        assert torch.equal(w13[1, :MOE_I], gate3)

        # An in-place step of every Megatron tensor, published again from the same memory.
        for p in pubs:
            p.release("m1", timeout=30)
        with torch.no_grad():
            for own in ranks:
                for t in own.values():
                    t.mul_(0.5).add_(0.25)
        full2 = megatron_cut.uncut(ranks, CONFIG, TP, PP, EP)
        control.declare("m2", weights, trainer_layout=LAYOUT)
        v2 = publish_all(pubs, "m2", 60.0)
        assert v2 != v1
        for puller, params in engines:
            assert puller.stage("m2").version_id == v2
            puller.apply()
            assert _mismatches(puller, params, full2) == []
    finally:
        for puller, _ in engines:
            puller.close()
        for p in pubs:
            p.close()


def test_set_params_refuses_a_wrong_parameter_set_naming_it(control_plane, model, weights):
    ranks = megatron_cut.cut(weights, CONFIG, TP, PP, EP)
    with mx.Publisher(control_plane.url, model=model, layout=LAYOUT, slot=5) as pub:
        own = dict(ranks[5])
        name = "decoder.layers.0.self_attention.linear_qkv.weight"
        with pytest.raises(mx.MxError, match="linear_qkv.weight"):
            pub.set_params({k: v for k, v in own.items() if k != name})
        with pytest.raises(mx.MxError, match="embedding.word_embeddings.weight"):
            # Slot 5 is on the last stage: no embedding there.
            pub.set_params({**own, "embedding.word_embeddings.weight": ranks[0][name]})
        with pytest.raises(mx.MxError, match=r"linear_qkv.weight.*\[16, 32\]"):
            pub.set_params({**own, name: own[name][:16].clone()})
        with pytest.raises(mx.MxError, match="not contiguous"):
            pub.set_params({**own, name: own[name].t().contiguous().t()})
    with pytest.raises(mx.MxError, match="not divisible by ep=3"):
        model.rank_layout("megatron:tp=1,pp=1,ep=3", 0)
    with pytest.raises(mx.MxError, match="dp"):
        model.rank_layout("megatron:dp=2", 0)
