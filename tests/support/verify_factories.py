"""Models for the verifier tests, loadable with ``bigbatch verify --factory verify_factories:NAME``."""

from __future__ import annotations

import torch
import torch.nn as nn

from bigbatch.models import GPT, GPTConfig

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


class InstanceNormLM(nn.Module):
    """Per-sample normalization (exact gradients) whose running statistics are updated once per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = nn.InstanceNorm1d(16, track_running_stats=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(idx).transpose(1, 2)).transpose(1, 2)  # (B, T, C), normalized over T per sample
        return self.head(h)


class PairMixer(nn.Module):
    """Averages each pair of adjacent samples (0 with 1, 2 with 3, ...): invisible to a split aligned on pairs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(0, (x.shape[0] // 2, 2)) if x.shape[0] % 2 == 0 else None
        if pairs is None:  # an odd micro-batch: the last sample has no partner in it
            head = x[:-1].unflatten(0, (x.shape[0] // 2, 2))
            mixed = (head + head.mean(dim=1, keepdim=True)).flatten(0, 1)
            return torch.cat([mixed, 2 * x[-1:]])
        return (pairs + pairs.mean(dim=1, keepdim=True)).flatten(0, 1)


class PairMixLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mix = PairMixer()
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class NeighbourBlock(nn.Module):
    """A block whose learnable children are per-sample, but whose own forward adds the previous sample's features."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(x))
        return x + h + 0.5 * torch.roll(h, shifts=1, dims=0)  # mixes sample i with sample i-1 of the same batch


class NeighbourLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.block = NeighbourBlock(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(idx)))


class RootMixLM(nn.Module):
    """In-batch mixing written in the root's own forward: every submodule is per-sample."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h - 0.5 * h.mean(dim=0, keepdim=True))


class ScaledBranchBatchNormLM(nn.Module):
    """A BatchNorm on a side branch scaled by 1e-4: its gradient effect hides under a loose (bf16) tolerance."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, C)
        side = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h + 1e-4 * side)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(idx).mean(dim=1))  # (B, C): one embedding per sequence


def instance_norm_lm() -> nn.Module:
    torch.manual_seed(0)
    return InstanceNormLM()


def pair_mix_lm() -> nn.Module:
    torch.manual_seed(0)
    return PairMixLM()


def neighbour_lm() -> nn.Module:
    torch.manual_seed(0)
    return NeighbourLM()


def root_mix_lm() -> nn.Module:
    torch.manual_seed(0)
    return RootMixLM()


def scaled_branch_batchnorm_lm() -> nn.Module:
    torch.manual_seed(0)
    return ScaledBranchBatchNormLM()


def contrastive_case() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A per-sample encoder trained with an in-batch contrastive loss: every other sample is a negative."""
    torch.manual_seed(0)
    model = Encoder()
    anchors = torch.randint(0, VOCAB, (8, 12))
    positives = torch.randint(0, VOCAB, (8, 12))

    def loss_fn(m: nn.Module, a: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        za, zp = m(a), m(p)  # (B, C) each
        logits = za @ zp.T  # (B, B): the diagonal holds the positives
        targets = torch.arange(a.shape[0])
        return nn.functional.cross_entropy(logits, targets, reduction="sum"), a.shape[0]

    return model, (anchors, positives), loss_fn


class BatchMeanTracker(nn.Module):
    """Keeps an exponential moving average of the batch mean in a buffer; passes its input through unchanged.

    No known batch-coupled type and no effect on the gradient: only the buffer shows that K forwards are not one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.reshape(-1, x.shape[-1]).mean(dim=0))
        return x


class TrackedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.tracker = BatchMeanTracker(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.tracker(self.emb(idx)))


def tracked_lm() -> nn.Module:
    torch.manual_seed(0)
    return TrackedLM()
