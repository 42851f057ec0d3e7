"""Numbers the verifier compares: flattened gradients, relative differences, cosines, buffers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from bigbatch.models.coupling import ROOT
from bigbatch.verify.verdict import BufferComparison, ParamComparison


def flat(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().double().flatten() for g in grads]) if grads else torch.zeros(1, dtype=torch.float64)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = a.norm().item() * b.norm().item()
    return (a @ b).item() / denom if denom > 0 else (1.0 if a.norm().item() == b.norm().item() else 0.0)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def render(t: torch.Tensor) -> str:
    return f"{t.item():g}" if t.numel() == 1 else f"norm {t.double().norm().item():.4g}"


def compare_buffers(
    full: dict[str, torch.Tensor], acc: dict[str, torch.Tensor], tolerance: float
) -> list[BufferComparison]:
    """Buffers that differ after the step: integers exactly, floats beyond ``tolerance`` (relative L2)."""
    differing = []
    for name, fb in full.items():
        ab = acc[name]
        if fb.is_floating_point():
            rel = rel_diff(ab.flatten().double(), fb.flatten().double())
            if rel <= tolerance:
                continue
        else:
            if torch.equal(ab, fb):
                continue
            rel = rel_diff(ab.flatten().double(), fb.flatten().double())
        differing.append(BufferComparison(name, rel, render(fb), render(ab)))
    return differing


def buffer_owner(buffer_name: str) -> str:
    return buffer_name.rpartition(".")[0] or ROOT


def compare_params(
    g_full: dict[str, torch.Tensor], g_acc: dict[str, torch.Tensor], tolerance: float
) -> list[ParamComparison]:
    params = []
    for name, gf in g_full.items():
        gf64, ga64 = gf.double().flatten(), g_acc[name].double().flatten()
        params.append(
            ParamComparison(
                name=name,
                full_norm=gf64.norm().item(),
                accumulated_norm=ga64.norm().item(),
                max_abs_diff=(ga64 - gf64).abs().max().item() if gf64.numel() else 0.0,
                rel_diff=rel_diff(ga64, gf64),
                cosine=cosine(ga64, gf64),
                within_tolerance=True,
            )
        )
    total_norm = flat(list(g_full.values())).norm().item()
    # A parameter passes when its difference is within tolerance of its own gradient norm, or of a floor tied to
    # the whole gradient: coordinates whose true gradient is zero (e.g. attention key biases) hold only rounding.
    floor = tolerance * 1e-3 * total_norm
    return [replace(p, within_tolerance=p.rel_diff * p.full_norm <= tolerance * p.full_norm + floor) for p in params]
