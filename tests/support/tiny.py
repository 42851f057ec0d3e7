"""Tiny deterministic batches for the in-process tests (the fixtures that use them live in tests/conftest.py)."""

from __future__ import annotations

import torch

VOCAB = 61  # not a multiple of 64, so vocabulary padding is exercised


def random_batch(n_seq: int, seq_len: int, vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_seq, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
