#!/usr/bin/env python3
"""Checks a converted SmolLM2 checkpoint by greedy decoding with a small numpy f32 llama forward pass.

Prompt: token ids 504, 3575, 282, 4649, 314 ("The capital of France is" in the GGUF vocabulary).
A correct conversion continues with 7042, 30 (" Paris."). That alone is a weak test: a checkpoint
whose q/k rows are left in llama.cpp's order still says " Paris." here (it drifts later). So with
--gguf the source GGUF is also run the way llama.cpp runs it (its own q/k row order, adjacent-pair
RoPE, same BF16 rounding) and every step's logits must match the HF checkpoint run with HF's
rotate-half RoPE: a correct un-permutation makes the two the same function (measured max |diff|
~4e-7), a wrong one differs by ~6 in the logits at the first step.
Exit status 0 when all checks pass, 1 otherwise.

Usage: check_smollm2.py MODEL_DIR [--gguf SOURCE.gguf] [--steps N] [--tol T]
Reads MODEL_DIR/config.json and MODEL_DIR/model.safetensors (BF16 or F32) by hand with numpy.
Implements HF LlamaForCausalLM: RMSNorm, RoPE, GQA attention with a causal mask, SiLU-gated MLP,
tied or separate lm_head. --gguf needs the gguf package.
"""

import json
import os
import struct
import sys
import time

import numpy as np

PROMPT = [504, 3575, 282, 4649, 314]
EXPECTED = [7042, 30]


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = raw[base + start : base + end]
        shape = info["shape"]
        if info["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        else:
            raise ValueError(f"{name}: dtype {info['dtype']} not handled")
        out[name] = a.reshape(shape)
    return out


def rms_norm(x, w, eps):
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def rope(x, pos, theta, adjacent=False):
    """Rotary embedding of x [heads, seq, head_dim] at positions pos.

    adjacent=False: HF's rotate-half convention, pair i is (x[i], x[i + hd/2]).
    adjacent=True: llama.cpp's convention for llama GGUFs, pair i is (x[2i], x[2i+1]).
    Pair i turns by pos * theta^(-2i/hd) in both.
    """
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.outer(pos, inv)  # [seq, hd/2]
    cos = np.cos(ang).astype(np.float32)
    sin = np.sin(ang).astype(np.float32)
    if adjacent:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if adjacent:
        return np.stack([r1, r2], axis=-1).reshape(x.shape)
    return np.concatenate([r1, r2], axis=-1)


def forward(w, cfg, ids, adjacent=False):
    """Returns logits of the last position for the token sequence ids."""
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    eps = cfg["rms_norm_eps"]
    theta = cfg["rope_theta"]
    seq = len(ids)
    pos = np.arange(seq, dtype=np.float64)
    x = w["model.embed_tokens.weight"][ids]  # [seq, h]
    mask = np.triu(np.full((seq, seq), -np.inf, dtype=np.float32), k=1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(seq, nh, hd).transpose(1, 0, 2)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(seq, nkv, hd).transpose(1, 0, 2)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(seq, nkv, hd).transpose(1, 0, 2)
        q = rope(q, pos, theta, adjacent)
        k = rope(k, pos, theta, adjacent)
        rep = nh // nkv
        k = np.repeat(k, rep, axis=0)
        v = np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        o = (pr @ v).transpose(1, 0, 2).reshape(seq, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x[-1], w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return head @ x


def bf16_round(a):
    """f32 -> nearest bfloat16 (ties to even), returned as f32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).reshape(a.shape)


GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def load_gguf_as_is(path):
    """GGUF tensors dequantized and rounded to BF16, q/k rows left in llama.cpp's order."""
    import gguf
    from gguf.quants import dequantize

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape([int(d) for d in reversed(list(t.shape))])
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{int(layer)}.{GGUF_NAMES[rest]}"
        else:
            name = GGUF_NAMES[t.name]
        out[name] = bf16_round(a)
    return out


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument(
        "--gguf",
        help="the source GGUF: also run it as llama.cpp would (its own q/k row order, "
        "adjacent-pair RoPE) and require the same logits at every step",
    )
    ap.add_argument("--steps", type=int, default=len(EXPECTED), help="greedy tokens to decode")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |logit difference| allowed")
    args = ap.parse_args()
    d = args.model_dir
    steps = max(args.steps, len(EXPECTED))
    t0 = time.time()
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    w = load_safetensors(os.path.join(d, "model.safetensors"))
    ref = load_gguf_as_is(args.gguf) if args.gguf else None
    ids = list(PROMPT)
    got = []
    worst = 0.0
    for step in range(steps):
        logits = forward(w, cfg, ids)
        nxt = int(np.argmax(logits))
        if ref is not None:
            rl = forward(ref, cfg, ids, adjacent=True)
            diff = float(np.max(np.abs(rl - logits)))
            worst = max(worst, diff)
            if diff > args.tol or int(np.argmax(rl)) != nxt:
                print(
                    f"check_smollm2: FAILED: step {step}: HF checkpoint and GGUF disagree "
                    f"(max |logit diff| {diff:.4g}, argmax {nxt} vs {int(np.argmax(rl))})",
                    file=sys.stderr,
                )
                sys.exit(1)
        got.append(nxt)
        ids.append(nxt)
    vocab_path = os.path.join(d, "gguf_vocab.json")
    text = ""
    if os.path.exists(vocab_path):
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        text = "".join(vocab[t] for t in got).replace("\u0120", " ").replace("\u010a", "\n")
    dt = time.time() - t0
    if got[: len(EXPECTED)] != EXPECTED:
        print(
            f"check_smollm2: FAILED: greedy tokens {got} {text!r}, expected {EXPECTED} first "
            f"({dt:.1f}s)",
            file=sys.stderr,
        )
        sys.exit(1)
    also = f"; same logits as the GGUF run as llama.cpp does (max diff {worst:.3g})" if ref else ""
    print(f"check_smollm2: ok: greedy tokens {got} {text!r}{also} ({dt:.1f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
