"""Models for the verifier tests, loadable with ``bigbatch verify --factory verify_factories:NAME``."""

from __future__ import annotations

import torch
import torch.nn as nn

from bigbatch.model import GPT, GPTConfig

VOCAB = 50


class BatchNormLM(nn.Module):
    """A tiny language model with a BatchNorm1d over the features: breaks accumulation equivalence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, C)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(h))  # (B, T, V)


class BatchCenter(nn.Module):
    """Subtracts the batch mean: mixes samples, but is no known normalization type."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


class CenteredLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.center = BatchCenter()
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.center(self.emb(idx))))


def batchnorm_lm() -> nn.Module:
    torch.manual_seed(0)
    return BatchNormLM()


def pico_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=VOCAB))


def regression_case() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A non-language model with its own batch and a mean-returning loss converted to (sum, count)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 1))
    x, y = torch.randn(10, 6), torch.randn(10, 1)

    def loss_fn(m: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        mean = nn.functional.mse_loss(m(inputs), targets)
        return mean * inputs.shape[0], inputs.shape[0]

    return model, (x, y), loss_fn


def not_a_model() -> str:
    return "nope"
