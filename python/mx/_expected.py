"""The outputs a trainer expects of a version: greedy tokens of probe prompts from its own
forward pass, with the margins the post-update check tolerates near-ties by."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._types import ExpectedOutputs, Probe


def expected_outputs(
    forward: Callable[[Any], Any],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    tie_margin: float = 0.0,
    stop_tokens: Sequence[int] = (),
) -> ExpectedOutputs:
    """Greedy decoding of each prompt with the trainer's own model: the outputs to publish
    with the version (:meth:`mx.Control.publish_expected_outputs`).

    Args:
        forward: the model's forward pass: a ``torch.long`` tensor of token ids, shape
            ``[1, T]``, to logits of shape ``[1, T, vocab]`` (or an object with ``.logits``,
            as Hugging Face models return). It is called under ``torch.no_grad()`` once per
            generated token, without a KV cache (probes are short). On an FSDP model every
            rank must call this together (the forward is collective); publish from one rank.
        prompts: the probe prompts, token ids (1 to 16 prompts).
        max_new_tokens: tokens to decode per prompt (the engines decode as many).
        tie_margin: nats; 0: mx's default (0.25). See :class:`mx.ExpectedOutputs`.
        stop_tokens: token ids after which decoding stops (an end-of-sequence token the
            engines also stop at); empty: always ``max_new_tokens`` tokens.

    Returns:
        :class:`mx.ExpectedOutputs`: per probe the greedy tokens, the margin
        ``log p(top1) - log p(top2)`` at each position (computed in float32 from the logits)
        and the log-probability of the chosen token.
    """
    import torch

    if not 1 <= len(prompts) <= 16:
        raise ValueError(f"{len(prompts)} prompts: give 1 to 16")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens}: give at least 1")
    stops = set(int(t) for t in stop_tokens)
    probes = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            tokens: list[int] = []
            margins: list[float] = []
            logprobs: list[float] = []
            for _ in range(max_new_tokens):
                out = forward(torch.tensor([ids + tokens], dtype=torch.long))
                logits = getattr(out, "logits", out)
                last = logits[0, -1].float()
                lp = torch.log_softmax(last, dim=-1)
                top = torch.topk(lp, 2)
                token = int(top.indices[0])
                tokens.append(token)
                margins.append(float(top.values[0] - top.values[1]))
                logprobs.append(float(top.values[0]))
                if token in stops:
                    break
            probes.append(Probe(tuple(ids), tuple(tokens), tuple(margins), tuple(logprobs)))
    return ExpectedOutputs(tuple(probes), max_new_tokens, tie_margin)
