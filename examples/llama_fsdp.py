"""A small FSDP2 llama trainer on CPU, for the examples: the model in torch with HF parameter
names (so its local shards are named as the checkpoint's tensors), loaded from an HF safetensors
checkpoint, sharded with ``torch.distributed.fsdp.fully_shard`` over gloo, trained with AdamW on
a fixed token batch.

Precision: parameters and optimizer state stay bf16 (the checkpoint's dtype), and AdamW updates
the parameters in place, so each rank's local shard (``DTensor.to_local()``, a contiguous block
of dim-0 rows) keeps its address across steps and is what mx publishes. Forward and backward run
in fp32 (FSDP2's ``MixedPrecisionPolicy``: all-gathered parameters are cast up, gradients reduced
in fp32 and cast back to bf16). A trainer with fp32 master weights would publish the bf16 copy it
casts into instead.

Supports the llama family as SmolLM2 uses it: GQA, RoPE, RMSNorm, SwiGLU, tied or untied
embeddings; no attention or MLP biases.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# safetensors dtype name -> (torch dtype, bytes per element)
DTYPES = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
}


def read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``model_dir`` (no safetensors package: an
    8-byte little-endian header length, a JSON header, then row-major bytes)."""
    out = {}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {model_dir}")
    for fname in files:
        with open(os.path.join(model_dir, fname), "rb", buffering=0) as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in DTYPES:
                    raise ValueError(f"{fname}: {name}: dtype {meta['dtype']} not supported here")
                dtype, size = DTYPES[meta["dtype"]]
                begin, end = meta["data_offsets"]
                if end - begin != math.prod(meta["shape"]) * size:
                    raise ValueError(f"{fname}: {name}: data_offsets disagree with its shape")
                t = torch.empty(meta["shape"], dtype=dtype)
                buf = t.view(torch.uint8).reshape(-1).numpy()
                f.seek(base + begin)
                if f.readinto(buf) != buf.nbytes:
                    raise OSError(f"{fname}: {name}: short read")
                out[name] = t
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, self.heads, self.kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv"]
        self.hd = cfg["head_dim"]
        self.q_proj = nn.Linear(h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv  # GQA: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.hd))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF llama's rotary embedding (``rotate_half`` convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, h: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["eps"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["eps"])


class Llama(nn.Module):
    """``model.*`` and (untied) ``lm_head.weight``: the HF checkpoint's names."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        cfg = dict(config)
        cfg["kv"] = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg["eps"] = cfg.get("rms_norm_eps", 1e-6)
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # transformers 5 writes rope_parameters {rope_type, rope_theta}; older ones rope_theta.
        rope = self.cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", self.cfg.get("rope_theta", 10000.0)))
        hd = self.cfg["head_dim"]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(x, head)


def fsdp_trainer(
    model_dir: str, rank: int, world: int, init_method: str, lr: float
) -> tuple[Llama, torch.optim.Optimizer]:
    """Joins the gloo group, loads the checkpoint into a bf16 ``Llama`` and shards it with FSDP2
    (one unit: the whole model); returns the model and an AdamW over its sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        model = Llama(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    state = read_safetensors(model_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint vs model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del state
    mesh = init_device_mesh("cpu", (world,))
    # Compute in fp32 (CPU matmuls in bf16 are ~50x slower here); the sharded parameters, which
    # mx publishes, stay bf16.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return model, opt


def local_shards(model: Llama, world: int) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Each parameter's local FSDP2 shard (``to_local()``: contiguous dim-0 rows) with the
    offset of its box in the global tensor (FSDP2 chunks dim 0 as ``torch.chunk`` does)."""
    rank = dist.get_rank()
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        rows = p.shape[0]
        chunk = -(-rows // world)  # ceil
        row0 = min(rank * chunk, rows)
        if local.shape[0] != max(0, min(chunk, rows - row0)):
            raise ValueError(f"{name}: local shard {tuple(local.shape)} is not rows {row0}..")
        out[name] = (local, [row0] + [0] * (p.dim() - 1))
    return out


def train_step(model: Llama, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One AdamW step of next-token cross entropy on this rank's ``batch`` (token ids,
    [B, T]); gradients are averaged over the ranks by FSDP2. Returns the global mean loss."""
    opt.zero_grad(set_to_none=False)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    value = loss.detach().reshape(1).float()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()
