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

from bigbatch.models.head_loss import IGNORE_INDEX, linear_cross_entropy_sum, linear_cross_entropy_tokens


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
    segments: torch.Tensor | None = None,
    per_token: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """From ``hidden`` (B, T, C) and the head ``weight`` (V, C): the logits (B, T, V) when ``targets`` is None
    (only the last position's, (B, 1, V), with ``last_only``), else the 0-d fp32 sum of cross-entropies over the
    targets (B, T) that are not -100, in chunks of rows (``chunked``) or from the whole logits. With ``segments``
    (B, T) int64 (each target's segment 0..S-1, -1 for none): the (S,) fp32 sums per segment instead. With
    ``per_token``: each target's cross-entropy and softmax entropy, (B, T, 2) fp32, 0 where the target is -100
    (:func:`~bigbatch.models.head_loss.linear_cross_entropy_tokens`), of the logits divided by ``temperature`` (the
    distribution a sampler at that temperature draws from)."""
    if per_token and segments is not None:
        raise ValueError("per_token and segments exclude each other: per-token values need no segment sums")
    if targets is None:
        if last_only:
            hidden = hidden[:, -1:]  # (B, 1, C)
        return F.linear(hidden, weight, bias)
    flat_hidden = hidden.reshape(-1, hidden.size(-1))  # (B*T, C)
    flat_targets = targets.reshape(-1)  # (B*T,)
    if segments is not None:
        return segment_losses(flat_hidden, weight, flat_targets, segments.reshape(-1), bias, chunked)
    if per_token:
        if temperature != 1.0:  # logits / T = h (W / T)^T + b / T: the head scaled, its gradient through the division
            weight = weight / temperature
            bias = None if bias is None else bias / temperature
        if chunked:
            values = linear_cross_entropy_tokens(flat_hidden, weight, flat_targets, bias)  # (B*T, 2)
            return values.reshape(*targets.shape, 2)  # (B, T, 2)
        return token_losses_from_logits(F.linear(hidden, weight, bias), targets)  # (B, T, 2)
    if chunked:
        return linear_cross_entropy_sum(flat_hidden, weight, flat_targets, bias)
    return logits_loss(F.linear(flat_hidden, weight, bias), flat_targets)


def segment_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    segments: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunked: bool = True,
) -> torch.Tensor:
    """The (S,) fp32 sums of cross-entropies of each segment's targets: ``hidden`` (N, C), ``targets`` (N,),
    ``segments`` (N,) with -1 for rows in none. Chunked: one chunked loss per segment over its rows alone (every
    row still enters the head once, so the work is one pass's), never holding the logits; else from the whole
    logits. S is ``segments.max() + 1``."""
    count = int(segments.max()) + 1 if segments.numel() else 0
    if count <= 0:  # no answer here: an empty result still on every parameter's graph (DDP expects each one)
        touched = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0.0)
        return hidden.new_zeros(0, dtype=torch.float32) + 0.0 * touched.float()
    if not chunked:
        return segment_logits_losses(F.linear(hidden, weight, bias), targets, segments)
    inside = targets.masked_fill(segments < 0, IGNORE_INDEX)
    sums = [
        linear_cross_entropy_sum(hidden, weight, inside.masked_fill(segments != s, IGNORE_INDEX), bias)
        for s in range(count)
    ]
    return torch.stack(sums)


def segment_logits_losses(logits: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """The (S,) fp32 sums of cross-entropies of each segment's targets from whole ``logits`` (..., V), ``targets``
    and ``segments`` (...), -1 for none (S is ``segments.max() + 1``)."""
    flat_segments = segments.reshape(-1)
    count = int(flat_segments.max()) + 1 if flat_segments.numel() else 0
    if count <= 0:  # no segment: an empty result still on the graph
        return logits.new_zeros(0, dtype=torch.float32) + 0.0 * logits.float().sum()
    inside = targets.reshape(-1).masked_fill(flat_segments < 0, IGNORE_INDEX)
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), inside, ignore_index=IGNORE_INDEX, reduction="none"
    )  # (N,), 0 where ignored
    owner = flat_segments.clamp_min(0)
    return torch.zeros(max(count, 0), dtype=torch.float32, device=logits.device).index_add(0, owner, losses)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The 0-d fp32 sum of cross-entropies of whole ``logits`` (..., V) over the ``targets`` (...) that are not -100:
    bigbatch's one loss definition, wherever the logits are held whole."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def token_losses_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's cross-entropy and the entropy of its softmax from whole ``logits`` (..., V) and ``targets``
    (...): (..., 2) fp32, both 0 (and without gradient) where the target is -100. The per-token counterpart of
    :func:`logits_loss`, for models whose head cannot be taken apart from the trunk."""
    flat_logits = logits.float().reshape(-1, logits.size(-1))  # (N, V)
    flat_targets = targets.reshape(-1)  # (N,)
    log_p = F.log_softmax(flat_logits, dim=-1)  # (N, V)
    losses = F.nll_loss(log_p, flat_targets, ignore_index=IGNORE_INDEX, reduction="none")  # (N,), 0 where ignored
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (N,)
    # masked_fill, not a product with the mask: an ignored row gets exactly 0 and a zero gradient
    entropy = entropy.masked_fill(flat_targets == IGNORE_INDEX, 0.0)
    return torch.stack((losses, entropy), dim=-1).reshape(*targets.shape, 2)  # (..., 2)
