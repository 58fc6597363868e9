"""FP8 128x128 block quantization on the inference side (mx.fp8): the quantizer equals vLLM
0.32.0's own helper and an independent reference written here (e4m3 rounding by table lookup,
not torch's cast), and each rank of tp:1, tp:2 and tp-ep:2 gets exactly its slice of the whole
tensors' quantization: e4m3 bytes and f32 scales. A layout that cuts a block is refused naming
the tensor and block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mx
from mx.fp8 import BLOCK, quantize_blocks, quantize_rank

H, HEADS, KV, HEAD_DIM, EXPERTS, MOE_I, VOCAB = 256, 4, 2, 128, 4, 256, 300
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": 384,
    "moe_intermediate_size": MOE_I,
    "num_experts": EXPERTS,
    "vocab_size": VOCAB,
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
}


def _e4m3_table() -> np.ndarray:
    """The values of the non-negative finite float8_e4m3fn codes 0..126 (bias 7, 3 mantissa
    bits, subnormals below 2**-6; 0x7f is NaN), from the format's definition."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


TABLE = _e4m3_table()


def _to_e4m3_codes(y: np.ndarray) -> np.ndarray:
    """Round float32 values (|y| <= 448) to e4m3fn codes, to nearest, ties to the even code."""
    a = np.abs(y.astype(np.float64)).reshape(-1)
    hi = np.clip(np.searchsorted(TABLE, a), 1, len(TABLE) - 1)
    lo = hi - 1
    dlo, dhi = a - TABLE[lo], TABLE[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= TABLE[-1], len(TABLE) - 1, pick)
    sign = np.signbit(y.reshape(-1)).astype(np.uint8) << 7  # -0.0 keeps its sign
    return (pick.astype(np.uint8) | sign).reshape(y.shape)


def _reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes, f32 scales) of a 2-D tensor by the rule vLLM documents, in numpy: per
    128x128 block (the last ones short), amax in f32 clamped at 1e-4, scale = amax / 448,
    q = x * (1 / scale) in f32, rounded to e4m3."""
    a = x.float().numpy()
    m, n = a.shape
    codes = np.zeros((m, n), dtype=np.uint8)
    scales = np.zeros((math.ceil(m / BLOCK), math.ceil(n / BLOCK)), dtype=np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = a[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            amax = np.float32(max(np.abs(blk).max(), np.float32(1e-4)))
            s = np.float32(amax / np.float32(448.0))
            scales[i, j] = s
            q = blk * (np.float32(1.0) / s)
            codes[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = _to_e4m3_codes(q)
    return codes, scales


def _sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1]).float()
    return x.to(torch.bfloat16)


def test_quantize_blocks_equals_vllms_helper_and_an_independent_reference():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    # torch.compile's wrapper around vLLM's function: its own Python, run eagerly.
    vllm_fn = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)
    for shape, seed in (((300, 260), 1), ((256, 384), 2), ((128, 128), 3), ((130, 7), 4)):
        x = _sample(shape, seed)
        if shape == (256, 384):
            x[128:, 128:256] = 0  # an all-zero block: scale 1e-4 / 448
        q, s = quantize_blocks(x)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        vq, vs = vllm_fn(x)
        assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)), shape
        assert torch.equal(s, vs), shape
        codes, scales = _reference(x)
        assert np.array_equal(q.view(torch.uint8).numpy(), codes), shape
        assert np.array_equal(s.numpy(), scales), shape
    # Dequantized, every block is within e4m3's relative precision of the input.
    x = _sample((256, 256), 5).float()
    q, s = quantize_blocks(x)
    back = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.allclose(back, x, rtol=0.0725, atol=float(s.max()) * 2**-9)


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    shapes = {
        "model.embed_tokens.weight": (VOCAB, H),
        "lm_head.weight": (VOCAB, H),
        "model.norm.weight": (H,),
    }
    p = "model.layers.0."
    shapes |= {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
        p + "self_attn.k_proj.weight": (KV * HEAD_DIM, H),
        p + "self_attn.v_proj.weight": (KV * HEAD_DIM, H),
        p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        p + "mlp.gate.weight": (EXPERTS, H),
    }
    for e in range(EXPERTS):
        x = f"{p}mlp.experts.{e}."
        shapes |= {
            x + "gate_proj.weight": (MOE_I, H),
            x + "up_proj.weight": (MOE_I, H),
            x + "down_proj.weight": (H, MOE_I),
        }
    return {n: _sample(s, i) for i, (n, s) in enumerate(sorted(shapes.items()))}


def _rank_params(model: mx.Model, layout: str, rank: int, weights) -> dict[str, torch.Tensor]:
    """A rank's bf16 parameters assembled from the whole tensors (what a pull leaves)."""
    out = {}
    for p in model.rank_layout(layout, rank):
        flat = torch.zeros(math.prod(p.shape), dtype=torch.bfloat16)
        for pc in p.pieces:
            box = tuple(slice(o, o + e) for o, e in zip(pc.box_offset, pc.box_shape, strict=True))
            start = pc.offset // 2
            flat[start : start + math.prod(pc.box_shape)] = weights[pc.tensor][box].reshape(-1)
        out[p.name] = flat.view(p.shape)
    return out


def test_each_rank_gets_exactly_its_slice_of_the_whole_tensors_quantization(weights):
    model = mx.Model.from_config(CONFIG, weights)
    # The reference: every whole 2-D tensor quantized once, independently of mx.
    ref = {n: _reference(t) for n, t in weights.items() if t.dim() == 2}
    for layout, ranks in (("tp:1", 1), ("tp:2", 2), ("tp-ep:2", 2)):
        tensors = set()
        for rank in range(ranks):
            params = _rank_params(model, layout, rank, weights)
            out = quantize_rank(model, layout, rank, params)
            f8 = {p.name: p for p in mx.fp8.fp8_layout(model, layout, rank)}
            assert set(f8) == {n for n in params if n.endswith(("_proj.weight", "_weight"))}
            for p in model.rank_layout(layout, rank):
                if p.name not in f8:
                    assert out[p.name] is params[p.name]  # not quantized: untouched
                    continue
                w = out[p.name].view(torch.uint8).reshape(-1)
                s = out[f8[p.name].scale_name].reshape(-1)
                assert tuple(out[f8[p.name].scale_name].shape) == f8[p.name].scale_shape
                for pc, sp in zip(p.pieces, f8[p.name].pieces, strict=True):
                    codes, scales = ref[pc.tensor]
                    assert len(pc.box_shape) == 2, pc.tensor  # per-expert tensors here
                    (r0, c0), (nr, nc) = pc.box_offset, pc.box_shape
                    want_q = codes[r0 : r0 + nr, c0 : c0 + nc]
                    start = pc.offset // 2
                    got_q = w[start : start + want_q.size].numpy().reshape(want_q.shape)
                    assert np.array_equal(got_q, want_q), f"{layout} rank {rank} {pc.tensor}"
                    g0, gb = sp.grid_offset, sp.grid_box
                    want_s = scales[g0[0] : g0[0] + gb[0], g0[1] : g0[1] + gb[1]]
                    got_s = s[sp.offset // 4 : sp.offset // 4 + want_s.size].numpy()
                    assert np.array_equal(got_s.reshape(want_s.shape), want_s), pc.tensor
                    tensors.add(pc.tensor)
        # Every linear tensor of the model reached some rank quantized.
        assert tensors == {n for n in ref if "proj" in n}, layout


def test_a_layout_that_cuts_a_block_is_refused_naming_the_tensor_and_block(weights):
    model = mx.Model.from_config(CONFIG, weights)
    with pytest.raises(mx.MxError, match=r"experts\.0\.gate_proj\.weight.*block row 0"):
        mx.fp8.fp8_layout(model, "tp:4", 1)
    params = _rank_params(model, "tp:4", 1, weights)
    with pytest.raises(mx.MxError, match="block"):
        quantize_rank(model, "tp:4", 1, params)
