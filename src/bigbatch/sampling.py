"""Text generation from a trained model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bigbatch.model import GPT


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; greedy when ``temperature`` is 0."""
    was_training = model.training
    model.eval()
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]  # (B, <= block_size)
        logits, _ = model(context)
        logits = logits[:, -1, :].float()  # (B, vocab)
        if temperature <= 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, next_token], dim=1)
    model.train(was_training)
    return idx
