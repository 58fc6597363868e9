"""A small FSDP2 Qwen3-MoE trainer on CPU, for the examples: the model in torch with the HF
checkpoint's parameter names (so its local shards are named as the checkpoint's tensors, one
tensor per expert), loaded from an HF safetensors checkpoint, sharded with
``torch.distributed.fsdp.fully_shard`` over gloo, trained with AdamW on a fixed token batch.
The counterpart of ``llama_fsdp.py`` for a mixture of experts; it reuses that module's pieces
(``read_safetensors``, ``RMSNorm``, the SwiGLU ``MLP``, the forward, ``local_shards``,
``train_step``).

The model (``Qwen3Moe``) is transformers' ``Qwen3MoeForCausalLM`` in plain torch: causal GQA
attention with RoPE (default rope, ``rope_theta``) and per-head RMSNorm of q and k (``q_norm``,
``k_norm``, over the head dim, before RoPE), RMSNorm, and a sparse MoE block in every layer
(``decoder_sparse_step`` 1, no ``mlp_only_layers``, else those layers are a dense SwiGLU of
``intermediate_size``): router logits (``mlp.gate.weight``, [E, H]), softmax in fp32, top-k,
renormalized when ``norm_topk_prob``, the weighted sum of the chosen SwiGLU experts
(``down(silu(gate x) * up x)``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``).
``check_against_transformers`` compares its logits with transformers' (max abs difference
~1e-5 in fp32 on the toy checkpoint; the greedy tokens agree).

Every expert runs on every token (its routing weight is zero off the top k): a toy's choice,
E/k times the compute of a real MoE, but every parameter gets a gradient on every rank at every
step, as FSDP2's reduce-scatter of the whole model needs (with token dispatch, an expert no
token of one rank chose would have no gradient there).

Precision as in ``llama_fsdp``: parameters and AdamW state bf16 (the checkpoint's dtype),
updated in place (each rank's local shard keeps its address), forward and backward in fp32.

The learning rate of ``__main__``: 1e-2. The toy checkpoint's weights are N(0, 0.5) in bf16,
whose rounding step is 2**-8 ~ 0.004 for |w| in [0.5, 1): AdamW's early steps (about lr each)
of 1e-3 leave those weights (a third of them) unchanged; the loss falls, but the 8 greedy tokens
of the fixed prompt stayed the same at steps 1 and 2 (at 3e-3, at step 2). At 1e-2 they change
at every step (seen: loss 19.05, 11.69, 6.72).

Run it (from the repository root; ~1 minute on 2 cores)::

    .mx/venv/bin/python examples/moe_fsdp.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama_fsdp import MLP, Llama, RMSNorm, _rope, local_shards, read_safetensors, train_step
from torch import nn

LR = 1e-2  # AdamW on the bf16 parameters; see the module docstring
STEPS = 3
BATCH = (2, 33)  # per trainer rank: two sequences of 33 token ids (32 next-token targets)
PROMPT = [5, 17, 99, 300, 7]
GREEDY = 8  # tokens generated from PROMPT after each step

__all__ = [
    "Qwen3Moe",
    "check_against_transformers",
    "fsdp_trainer",
    "greedy",
    "load_model",
    "local_shards",
    "make_checkpoint",
    "train_step",
]


def make_checkpoint(
    out_dir: str,
    *,
    hidden: int = 128,
    layers: int = 2,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1024,
    seed: int = 0,
) -> None:
    """A toy Qwen3-MoE checkpoint (bf16 safetensors and config.json) in ``out_dir``, written by
    transformers' ``save_pretrained``. Every parameter of two or more dims is drawn from
    N(0, 0.5) (transformers' init, std 0.02, would make the greedy tokens near-uniform noise),
    the norms are ones.

    transformers 5.x holds the experts of a layer stacked (``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and saves them per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``), the checkpoints' layout; a version that
    saves them stacked gets its file rewritten per expert here. config.json names the expert
    count ``num_local_experts`` (``num_experts`` is an alias of the config class)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,  # dense MLP size: unused, every layer is MoE
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    _per_expert_files(out_dir)


def _per_expert_files(model_dir: str) -> None:
    """Rewrites stacked expert tensors of the safetensors files in ``model_dir`` (if any) as one
    tensor per expert, gate and up split from ``gate_up_proj`` (gate first)."""
    from safetensors.torch import load_file, save_file

    for fname in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        path = os.path.join(model_dir, fname)
        state = load_file(path)
        stacked = [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        if not stacked:
            continue
        for name in stacked:
            t = state.pop(name)
            prefix = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2, dim=0)
                    state[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    state[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    state[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        save_file(state, path, metadata={"format": "pt"})
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            raise ValueError(f"{model_dir}: stacked experts in a sharded checkpoint")


class Attention(nn.Module):
    """GQA attention with Qwen3's RMSNorm of each q and k head (over the head dim) before
    RoPE."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, self.heads, self.kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv"]
        self.hd = cfg["head_dim"]
        self.q_proj = nn.Linear(h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg["eps"])
        self.k_norm = RMSNorm(self.hd, cfg["eps"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv  # GQA: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class SparseMoe(nn.Module):
    """``mlp.gate`` (the router, [E, H]) and ``mlp.experts.{e}`` (SwiGLU experts)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, self.top_k, self.norm_topk = cfg["hidden_size"], cfg["top_k"], cfg["norm_topk_prob"]
        self.gate = nn.Linear(h, cfg["experts"], bias=False)
        self.experts = nn.ModuleList(
            MLP(h, cfg["moe_intermediate_size"]) for _ in range(cfg["experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        # Dense routing weights [..., E]: zero off the top k (see the module docstring).
        weights = torch.zeros_like(probs).scatter(-1, idx, top).to(x.dtype)
        out = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [..., E, H]
        return (weights.unsqueeze(-1) * out).sum(dim=-2)


class Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.input_layernorm = RMSNorm(h, cfg["eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg["eps"])
        sparse = (
            index not in cfg.get("mlp_only_layers", [])
            and cfg["experts"] > 0
            and (index + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        self.mlp = SparseMoe(cfg) if sparse else MLP(h, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["eps"])


class Qwen3Moe(Llama):
    """``model.*`` and (untied) ``lm_head.weight``: the HF checkpoint's names. The forward
    (ids [B, T] -> logits [B, T, V]) is ``Llama``'s: embedding, the layers with RoPE tables,
    the final norm, the head."""

    def __init__(self, config: dict[str, Any]) -> None:
        nn.Module.__init__(self)  # Llama's __init__ would build llama layers
        cfg = dict(config)
        cfg["kv"] = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg["eps"] = cfg.get("rms_norm_eps", 1e-6)
        # transformers 5.x writes the expert count as num_local_experts, older ones num_experts.
        cfg["experts"] = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        cfg["top_k"] = cfg.get("num_experts_per_tok", 0)
        cfg["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", False))
        # transformers 5.x writes rope_parameters {rope_type, rope_theta}, older ones rope_theta.
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError(f"rope {rope or cfg.get('rope_scaling')}: only default rope here")
        cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if cfg.get("attention_bias") or cfg.get("use_sliding_window"):
            raise ValueError("attention biases and sliding windows are not supported here")
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)


def load_model(model_dir: str, dtype: torch.dtype = torch.bfloat16) -> Qwen3Moe:
    """A ``Qwen3Moe`` holding the checkpoint of ``model_dir`` (every tensor, nothing else), in
    ``dtype``."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        model = Qwen3Moe(config)
    model = model.to_empty(device="cpu").to(dtype)
    state = read_safetensors(model_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint vs model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def check_against_transformers(model_dir: str) -> float:
    """The max abs difference of ``Qwen3Moe``'s logits and transformers'
    ``Qwen3MoeForCausalLM``'s, both fp32 from the checkpoint, on a fixed random batch; raises if
    their greedy (argmax) tokens differ."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    ours = load_model(model_dir, torch.float32).eval()
    ref = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, ours.cfg["vocab_size"], (2, 24), generator=g)
    with torch.no_grad():
        a = ours(ids)
        b = ref(input_ids=ids).logits.float()
    if not torch.equal(a.argmax(-1), b.argmax(-1)):
        raise AssertionError("greedy tokens differ from transformers'")
    return float((a - b).abs().max())


def fsdp_trainer(
    model_dir: str, rank: int, world: int, init_method: str, lr: float
) -> tuple[Qwen3Moe, torch.optim.Optimizer]:
    """Joins the gloo group, loads the checkpoint into a bf16 ``Qwen3Moe`` and shards it with
    FSDP2 (one unit: the whole model); returns the model and an AdamW over its sharded
    parameters. ``llama_fsdp.local_shards`` and ``llama_fsdp.train_step`` (re-exported here)
    take the result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    model = load_model(model_dir, torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    # Compute in fp32 (CPU bf16 matmuls are slow); the sharded parameters stay bf16.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return model, opt


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (full forwards, no cache). On an FSDP2 model this is
    a collective: every rank calls it with the same prompt."""
    ids = torch.tensor([prompt], dtype=torch.long)
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, nxt), dim=1)
    return ids[0, len(prompt) :].tolist()


def _rank_main(rank: int, world: int, model_dir: str, init_method: str, out: Any) -> None:
    torch.set_num_threads(1)
    model, opt = fsdp_trainer(model_dir, rank, world, init_method, LR)
    shards = local_shards(model, world)
    ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
    g = torch.Generator().manual_seed(20261202 + rank)
    batch = torch.randint(0, model.cfg["vocab_size"], BATCH, generator=g)
    rows = [{"step": 0, "loss": None, "greedy": greedy(model, PROMPT, GREEDY)}]
    for step in range(1, STEPS + 1):
        loss = train_step(model, opt, batch)
        moved = [n for n, (t, _) in shards.items() if t.data_ptr() != ptrs[n]]
        if moved:
            raise AssertionError(f"parameters re-allocated by step {step}: {moved[:5]}")
        rows.append({"step": step, "loss": loss, "greedy": greedy(model, PROMPT, GREEDY)})
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as tmp
    from procs import free_port

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="moe-fsdp-") as model_dir:
        make_checkpoint(model_dir)
        diff = check_against_transformers(model_dir)
        print(f"logits vs transformers (fp32): max abs diff {diff:.3g}", flush=True)
        if diff > 1e-3:
            print("FAIL: the model disagrees with transformers", flush=True)
            return 1
        ctx = tmp.get_context("spawn")
        out = ctx.SimpleQueue()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        tmp.spawn(_rank_main, args=(2, model_dir, init_method, out), nprocs=2, join=True)
        rows = out.get()
    for r in rows:
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        print(f"step {r['step']}: loss {loss}  greedy {r['greedy']}", flush=True)
    same = [
        rows[k]["step"] for k in range(1, len(rows)) if rows[k]["greedy"] == rows[k - 1]["greedy"]
    ]
    if same:
        print(f"FAIL: the greedy tokens did not change at steps {same} (lr {LR})", flush=True)
        return 1
    print(f"OK: lr {LR}: the greedy tokens changed at every step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
