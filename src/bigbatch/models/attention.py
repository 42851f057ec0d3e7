"""Causal attention over rows that may hold several documents back to back.

A packed row carries each token's position within its own document (0 at every document's first token). Two
tokens may attend to each other only when they lie in the same document and the key does not come after the
query: a block-diagonal causal mask. Rows without positions (one sequence per row) use the plain causal kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``True`` where query ``i`` may attend to key ``j``, shape (B, 1, T, T), from ``positions`` (B, T).

    A document begins wherever the position is 0, so the segment of a token is the number of zeros up to it.
    Built once per forward and shared by every layer (T x T booleans per row: 256 KiB at T = 512)."""
    T = positions.size(1)
    segments = (positions == 0).cumsum(dim=1)  # (B, T)
    same_document = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return (same_document & causal).unsqueeze(1)  # (B, 1, T, T)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """SDPA over (B, heads, T, head_dim): within documents when ``mask`` (from :func:`document_causal_mask`) is
    given, else plain causal. Every query sees at least itself, so no row of the mask is empty."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
