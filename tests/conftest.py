"""Shared fixtures: tiny deterministic models and batches on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from bigbatch.model import GPT, GPTConfig

VOCAB = 61  # not a multiple of 64, so vocabulary padding is exercised


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB)


@pytest.fixture
def tiny_model(tiny_config: GPTConfig) -> GPT:
    return GPT(tiny_config)


def random_batch(n_seq: int, seq_len: int, vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_seq, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
