"""Shared fixtures: tiny deterministic models and batches on CPU in fp32."""

from __future__ import annotations

import pytest
import torch
from tiny import VOCAB

from bigbatch.model import GPT, GPTConfig


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB)


@pytest.fixture
def tiny_model(tiny_config: GPTConfig) -> GPT:
    return GPT(tiny_config)
