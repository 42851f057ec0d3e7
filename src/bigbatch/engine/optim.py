"""AdamW with weight decay by parameter dimension, and a warmup + cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float, leave_out: Collection[int] = ()) -> list[dict[str, object]]:
    """Decay matrices and embeddings (dim >= 2); never biases or LayerNorm gains (dim < 2). ``leave_out``: ids of
    parameters another optimizer trains (Muon's matrices)."""
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in leave_out]  # tied ones appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_adamw_supported(model: nn.Module) -> bool:
    """Whether torch's fused AdamW takes these parameters: all on CUDA or all on the CPU, floating point."""
    params = list(model.parameters())
    devices = {p.device.type for p in params}
    return (
        bool(params) and len(devices) == 1 and devices <= {"cuda", "cpu"} and all(p.is_floating_point() for p in params)
    )


def build_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; the fused kernel (one pass per parameter instead of a dozen small ops)
    when every parameter lives on CUDA or every one on the CPU, as a floating-point tensor."""
    if fused is None:
        fused = fused_adamw_supported(model)
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused or None)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """One line: the optimizer and its settings as built (a Muon optimizer describes its two halves)."""
    describe = getattr(optimizer, "describe", None)
    if callable(describe):
        return str(describe())
    groups = optimizer.param_groups
    beta1, beta2 = groups[0].get("betas", (0.0, 0.0))
    decay = max(float(g.get("weight_decay", 0.0)) for g in groups)
    return (
        f"{type(optimizer).__name__} lr {groups[0]['lr']:g}, betas ({beta1:g}, {beta2:g}), eps "
        f"{groups[0].get('eps', 0.0):g}, weight decay {decay:g} on matrices and embeddings"
    )


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warmup to ``max_lr`` over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``.

    A pure function of the optimizer step (0-based), so it needs no state of its
    own: resuming at step ``s`` gives the same learning rate as never stopping.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    def __post_init__(self) -> None:
        if self.max_lr <= 0 or self.min_lr < 0 or self.min_lr > self.max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr and max_lr > 0, got {self.min_lr}, {self.max_lr}")
        if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
            raise ValueError(f"need 0 <= warmup_steps <= decay_steps, got {self.warmup_steps}, {self.decay_steps}")

    def state_dict(self) -> dict[str, float | int]:
        """The schedule's parameters (it has no other state: a pure function of the step)."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, float | int]) -> CosineSchedule:
        return cls(
            max_lr=float(state["max_lr"]),
            min_lr=float(state["min_lr"]),
            warmup_steps=int(state["warmup_steps"]),
            decay_steps=int(state["decay_steps"]),
        )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def constant_schedule(lr: float) -> CosineSchedule:
    """A schedule that always returns ``lr``."""
    return CosineSchedule(max_lr=lr, min_lr=lr, warmup_steps=0, decay_steps=0)
