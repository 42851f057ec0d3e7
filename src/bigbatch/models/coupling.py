"""Modules that couple the samples of a batch in training mode, found by type: their micro-batches cannot add
up to the big batch (the verifier also finds unknown ones empirically, see :mod:`bigbatch.verify`)."""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

ROOT = "<model>"  # the name of the model itself among its modules (its own forward)


class CoupledModule(NamedTuple):
    module: str  # its name in the model (ROOT for the model itself)
    kind: str  # its class
    detail: str  # how it couples samples


def cross_sample_modules(model: nn.Module) -> list[CoupledModule]:
    """Modules whose training-mode behaviour mixes samples or counts forwards."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            detail = "normalizes with statistics of the whole batch in training mode"
            found.append(CoupledModule(name or ROOT, type(module).__name__, detail))
        elif (
            isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats and module.training
        ):
            detail = "running statistics are updated K times instead of once (gradients are per sample)"
            found.append(CoupledModule(name or ROOT, type(module).__name__, detail))
    return found
