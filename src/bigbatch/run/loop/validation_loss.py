"""A model's loss on a split's validation windows: the one number the trainer's evaluations log and ``bigbatch
eval`` prints.

Both score the same windows (:mod:`bigbatch.data.validation_windows`) through this one function, so ``bigbatch eval``
with a run's own data and batch settings reproduces the run's logged validation loss. The loss is the
token-weighted mean over valid targets (targets of ``-100`` count for nothing), summed over ranks before it is
divided, so it does not depend on how the windows are split into micro-batches or processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.data.validation_windows import ValidationWindows
from bigbatch.engine.accumulate import LossFn, autocast_for, token_loss_sum
from bigbatch.engine.batch import count_valid_targets
from bigbatch.parallel.distributed import DistContext, reshard


@dataclass(frozen=True)
class ValidationResult:
    """What one pass over the validation windows scored, all ranks together."""

    loss_sum: float  # summed per-token loss, nats
    tokens: int  # valid targets scored
    micro_batches: int  # micro-batches this process read
    objective_loss: float | None = None  # a preference objective's own loss on the split (then ``loss``)
    values: dict[str, float] | None = None  # its terms' means and statistics (rewards, accuracy)

    @property
    def loss(self) -> float:
        """Mean loss per valid target, nats; under a preference objective, the objective's loss."""
        if self.objective_loss is not None:
            return self.objective_loss
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709


def summed_loss(
    model: nn.Module,
    loader: Any,
    device: torch.device,
    precision: str = "fp32",
    loss_fn: LossFn = token_loss_sum,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, int]:
    """Forward-only ``(loss sum, valid targets)`` as a float64 tensor of 2 over the loader's micro-batches up
    to the end of its split (its ``epoch`` turns 1: a validation view holds its fixed sample); and the
    micro-batches read.
    ``should_stop``, asked before each micro-batch, ends the pass early (a stop signal arrived).
    The caller (:func:`score_windows`) puts ``model`` in eval mode and sums over ranks."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    read = 0
    with torch.no_grad():
        while True:
            if should_stop is not None and should_stop():
                break
            batch = loader.next_micro_batch()
            with autocast_for(precision, device):
                loss_sum = loss_fn(model, batch.to(device))
            totals[0] += loss_sum.double()
            totals[1] += count_valid_targets(batch)
            read += 1
            if loader.epoch:  # the whole split was read
                break
    return totals, read


def score_windows(
    model: nn.Module,
    windows: ValidationWindows,
    device: torch.device,
    precision: str,
    dist: DistContext | None = None,
    loss_fn: LossFn = token_loss_sum,
    should_stop: Callable[[], bool] | None = None,
) -> ValidationResult | None:
    """``model``'s loss on every one of ``windows`` (rewound first), in eval mode, under the resolved
    ``precision``, summed over the ranks of ``dist`` (``None``: this process alone). ``None`` when the windows
    hold no valid target (no number is made up) or ``should_stop``, asked before each micro-batch, ended the pass
    early. The model is left in the mode it came in, and parameters FSDP2 gathered for the forward passes are
    freed again (the next training step needs them sharded)."""
    windows.reset()
    stopped = False

    def stop_now() -> bool:
        nonlocal stopped  # remembered: a pass cut short has no loss, even if it had read every window
        stopped = stopped or bool(should_stop is not None and should_stop())
        return stopped

    was_training = model.training
    model.eval()
    totals, read = summed_loss(
        model, windows, device, precision, loss_fn, should_stop=stop_now if should_stop is not None else None
    )  # (loss sum, valid targets) on this rank: every micro-batch of the sample
    model.train(was_training)
    reshard(model)
    if dist is not None:
        dist.all_reduce_sum(totals)
    if stopped or totals[1] == 0:
        return None
    return ValidationResult(float(totals[0]), int(totals[1].item()), read)
