"""What a language model's forward returns: the logits, or the summed next-token loss computed from the final
hidden states without holding the logits of every position.

Every family (GPT, Llama, a Hugging Face model whose head can be taken apart from its trunk) ends its forward here,
so the loss is computed inside the model's own forward: DDP and FSDP2 see one module call whose parameters (the
head's too) are gathered for it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.models.head_loss import IGNORE_INDEX, linear_cross_entropy_sum


def computes_loss(model: nn.Module) -> bool:
    """Whether ``model`` (perhaps inside DDP, ``torch.compile`` or the compile fallback) is one of bigbatch's
    families, whose ``forward(idx, targets, positions, last_only)`` ends in :func:`logits_or_loss`."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if getattr(type(model), "computes_loss", False):
            return True
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None) or getattr(model, "eager", None)
        if not isinstance(inner, nn.Module):
            return False
        model = inner
    return False


def logits_or_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    chunked: bool = True,
    last_only: bool = False,
) -> torch.Tensor:
    """From ``hidden`` (B, T, C) and the head ``weight`` (V, C): the logits (B, T, V) when ``targets`` is None
    (only the last position's, (B, 1, V), with ``last_only``), else the 0-d fp32 sum of cross-entropies over the
    targets (B, T) that are not -100, in chunks of rows (``chunked``) or from the whole logits."""
    if targets is None:
        if last_only:
            hidden = hidden[:, -1:]  # (B, 1, C)
        return F.linear(hidden, weight, bias)
    flat_hidden = hidden.reshape(-1, hidden.size(-1))  # (B*T, C)
    flat_targets = targets.reshape(-1)  # (B*T,)
    if chunked:
        return linear_cross_entropy_sum(flat_hidden, weight, flat_targets, bias)
    return logits_loss(F.linear(flat_hidden, weight, bias), flat_targets)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The 0-d fp32 sum of cross-entropies of whole ``logits`` (..., V) over the ``targets`` (...) that are not -100:
    bigbatch's one loss definition, wherever the logits are held whole."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
