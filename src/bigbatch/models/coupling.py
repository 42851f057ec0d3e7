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


class DropoutSite(NamedTuple):
    module: str  # its name in the model (ROOT for the model itself)
    attribute: str  # "p" of an nn.Dropout, else the float attribute that holds the probability
    p: float


def dropout_sites(model: nn.Module) -> list[DropoutSite]:
    """Every dropout probability the modules hold: each ``nn.Dropout``'s ``p``, and each float attribute whose
    name says dropout (``nn.MultiheadAttention.dropout``, transformers' ``attention_dropout``, bigbatch's own
    attention), which some attention implementations read instead of a module."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            found.append(DropoutSite(name or ROOT, "p", float(module.p)))
            continue
        for attribute, value in vars(module).items():
            if "dropout" in attribute and isinstance(value, float):
                found.append(DropoutSite(name or ROOT, attribute, value))
    return found


def set_dropout(model: nn.Module, p: float) -> list[DropoutSite]:
    """Set every one of :func:`dropout_sites` to ``p``; return those that held another probability (as they were)."""
    modules = dict(model.named_modules())
    changed = [site for site in dropout_sites(model) if site.p != p]
    for site in changed:
        setattr(modules["" if site.module == ROOT else site.module], site.attribute, p)
    return changed
