"""What the verifier works on: the batch and its splits, the default loss, dropout switched off, and the
module types known to couple samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.language_model import LanguageModelObjective, token_loss_sum
from bigbatch.models.coupling import cross_sample_modules, set_dropout
from bigbatch.verify.verdict import Finding

VerifyLossFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | int"]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
"""Relative L2 tolerance on the gradient by precision. fp32 differs only by summation order; under
autocast the full batch and the micro-batches round activations differently, so the bounds are looser."""

SPLITS = ("equal", "unequal", "permuted")
"""How the batch is cut into micro-batches: ``equal`` (``torch.tensor_split`` into K), ``unequal`` (sizes
1, 2, 3, ... and the remainder), ``permuted`` (the samples in a seeded random order, then K equal pieces)."""


@dataclass
class TensorBatch:
    """A tuple of tensors that moves to a device together (the engine's micro-batch for verification)."""

    tensors: tuple[torch.Tensor, ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TensorBatch:
        return TensorBatch(tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors))


def tensor_batch_objective(
    loss_fn: VerifyLossFn, count_fn: Callable[[Any], int], router_balance: str = "exact"
) -> LanguageModelObjective:
    """The next-token objective for :class:`TensorBatch` micro-batches (inputs, targets, ...): ``loss_fn``'s sum
    counted by ``count_fn``, with its routing pass and counted tokens for a mixture of experts."""
    return LanguageModelObjective(
        lambda m, b: loss_fn(m, *b.tensors)[0],
        count_fn,
        router_balance=router_balance,
        route_fn=lambda m, b: loss_fn(m, *b.tensors)[0],
        counted_fn=lambda b: (b.tensors[1] != IGNORE_INDEX).reshape(-1),
    )


def lm_loss(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss: (sum over valid targets, count of valid targets); ``positions`` for packed rows."""
    return token_loss_sum(model, MicroBatch(inputs, targets, positions)), (targets != IGNORE_INDEX).sum()


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability in ``model`` to zero; return the module paths that had one.

    Probabilities are zeroed rather than modules put in eval mode, because some
    attention implementations read ``dropout.p`` guarded by their *own* training
    flag (Hugging Face's GPT-2 does), or a float attribute of their own
    (``attention_dropout`` in transformers' Llama). Call this on a copy.
    """
    return list(dict.fromkeys(site.module for site in set_dropout(model, 0.0)))


def scan_cross_sample_modules(model: nn.Module) -> list[Finding]:
    """Modules whose training-mode behaviour mixes samples or counts forwards, found by type."""
    return [Finding(found.module, found.kind, found.detail) for found in cross_sample_modules(model)]


def split_indices(samples: int, k: int, name: str, seed: int = 0) -> list[torch.Tensor]:
    """Sample indices of each micro-batch for one of :data:`SPLITS`."""
    order = torch.arange(samples)
    if name == "equal":
        return list(torch.tensor_split(order, k))
    if name == "permuted":
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + 1))
        return list(torch.tensor_split(order, k))
    if name == "unequal":
        pieces, start, size = [], 0, 1
        while start < samples:
            pieces.append(order[start : start + size])
            start += size
            size += 1
        return pieces
    raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")
