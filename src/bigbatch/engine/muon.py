"""Muon for a model's hidden matrices, AdamW for the rest, in one optimizer stepped once per optimizer step.

Muon (Jordan et al., 2024) keeps a momentum of each matrix's gradient and moves the matrix by an approximately
orthogonal version of it: the polar factor ``U V^T`` of ``U S V^T``, from a few Newton-Schulz iterations of an odd
matrix polynomial. The orthogonalisation is not linear in the gradient, so it must see the step's one gradient:
here it runs inside :meth:`MuonAdamW.step`, which the engine calls once after the last backward, the one gradient
sync and the clip; the momentum is built from that gradient. Nothing runs per micro-batch or in a backward hook.

Across processes each matrix has one *owner* rank (owners balanced by size,
:mod:`bigbatch.parallel.matrix_owners`). Under DDP every rank holds the whole reduced gradient, so each
orthogonalises only the matrices it owns and one all-reduce of the updates (zeros where a rank is not the owner:
adding zero is exact) gives every rank all of them. Under FSDP2 a matrix is sharded by rows: its owner gathers the
rows, orthogonalises the whole matrix and scatters the update's rows back. Either way the update equals one
process's on the same gradient.

The momentum lives in the optimizer state like AdamW's moments, created at construction (zeros), so every rank
has the same keys from step 0 and a distributed checkpoint saves and reshards it like any other state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_update

from bigbatch.engine.muon_matrices import muon_matrices, muon_parameters
from bigbatch.engine.newton_schulz import (
    COEFFICIENTS,
    SCALES,
    iteration_coefficients,
    newton_schulz_flops,
    orthogonalise,
    update_scale,
)
from bigbatch.engine.optim import fused_adamw_supported, param_groups
from bigbatch.errors import ConfigError
from bigbatch.models.lora import has_lora
from bigbatch.models.matrix_layout import MatrixLayout
from bigbatch.parallel.matrix_owners import MatrixOwners, local_part

__all__ = [  # the optimizer here; Newton-Schulz and the choice of matrices from their own modules
    "COEFFICIENTS",
    "LORA_REFUSAL",
    "SCALES",
    "MatrixLayout",
    "MuonAdamW",
    "MuonSettings",
    "build_muon",
    "iteration_coefficients",
    "muon_matrices",
    "muon_parameters",
    "newton_schulz_flops",
    "orthogonalise",
    "update_scale",
]

LORA_REFUSAL = (
    "--optimizer muon does not train LoRA adapters: it orthogonalises a weight's whole update, and orthogonal "
    "updates of the two low-rank factors do not make an orthogonal update of their product (nor one of known size); "
    "train adapters with --optimizer adamw, or Muon without --lora-rank"
)


@dataclass(frozen=True)
class MuonSettings:
    """Muon's own settings (the AdamW group keeps ``--lr``, the betas, epsilon and ``--weight-decay``)."""

    lr: float  # the Muon group's peak learning rate (the schedule scales it as it scales --lr)
    momentum: float = 0.95
    weight_decay: float = 0.1
    ns_steps: int = 5
    coefficients: str = "quintic"
    scale: str = "rms"

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--muon-momentum must be in [0, 1), got {self.momentum:g}")
        if self.ns_steps < 1:
            raise ConfigError(f"--muon-ns-steps must be at least 1 (Newton-Schulz iterations), got {self.ns_steps}")
        if self.coefficients not in COEFFICIENTS:
            choices = ", ".join(COEFFICIENTS)
            raise ConfigError(f"--muon-coefficients must be one of {choices}, got {self.coefficients!r}")
        if self.scale not in SCALES:
            raise ConfigError(f"--muon-scale must be one of {', '.join(SCALES)}, got {self.scale!r}")

    def describe(self) -> str:
        """E.g. ``Muon lr 2e-3, momentum 0.95 (Nesterov), weight decay 0.1, 5 quintic Newton-Schulz iterations,
        update RMS matched to AdamW's (0.2 sqrt(max(m, n)))``."""
        scale = "update x sqrt(max(1, m/n))"
        if self.scale == "rms":
            scale = "update RMS matched to AdamW's (0.2 sqrt(max(m, n)))"
        momentum = f"momentum {self.momentum:g} (Nesterov)" if self.momentum else "no momentum"
        return (
            f"Muon lr {self.lr:g}, {momentum}, weight decay {self.weight_decay:g}, "
            f"{self.ns_steps} {self.coefficients} Newton-Schulz iterations, {scale}"
        )


# ---- the optimizer --------------------------------------------------------------------------------------------


FUSED_PARTS = {3: "q, k, v", 2: "gate, up"}
"""What a fused weight's parts are, by their number (the families fuse only these two kinds)."""

CONFIGURED_KEYS = ("muon", "lr_scale", "ns_steps", "coefficients", "scale", "eps")
"""Param-group keys that are the run's settings rather than its state: a loaded checkpoint does not replace them
(the learning rate, betas, momentum and weight decay are set by the engine before every step anyway)."""


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the param groups marked ``muon: True``, AdamW for the others, as one optimizer (one ``step``, one
    state for checkpoints, one GradScaler). A Muon group's keys: ``lr``, ``momentum``, ``weight_decay``,
    ``ns_steps``, ``coefficients``, ``scale``; an AdamW group's: ``lr``, ``betas``, ``eps``, ``weight_decay``.
    Both decay decoupled from the gradient (``p <- p (1 - lr wd)``). ``layouts``: how a Muon weight holds its
    matrices (default: one); ``world_size`` and ``rank``: the processes the matrices' owners are spread over (one
    process unless given: the optimizer never looks for a process group itself)."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        *,
        muon: MuonSettings,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        layouts: dict[int, MatrixLayout] | None = None,
        world_size: int = 1,
        rank: int = 0,
        fused: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": 0.0,
            "muon": False,
            "momentum": muon.momentum,
            "ns_steps": muon.ns_steps,
            "coefficients": muon.coefficients,
            "scale": muon.scale,
        }
        super().__init__(list(groups), defaults)
        self.settings, self.peak_lr, self.fused = muon, lr, fused
        self.matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        given = layouts or {}
        self.layouts = [given.get(id(p), MatrixLayout()) for p in self.matrices]
        self._index = {id(p): i for i, p in enumerate(self.matrices)}
        self.owners = MatrixOwners(self.matrices, world_size, rank)
        self.orthogonalisations = 0  # Newton-Schulz runs on this process (a test counts them per step)
        for group in self.param_groups:  # every state now: the same keys on every rank from step 0
            for param in group["params"]:
                if group["muon"]:
                    buffer = torch.zeros_like(param, memory_format=torch.preserve_format)
                    self.state[param] = {"momentum_buffer": buffer}
                else:
                    step_device = param.device if fused else torch.device("cpu")  # as torch's AdamW keeps it
                    self.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32, device=step_device),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved state (momentum, moments, steps, learning rates), the configured keys
        (:data:`CONFIGURED_KEYS`) kept as this optimizer was built."""
        configured = [{k: g[k] for k in CONFIGURED_KEYS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, keys in zip(self.param_groups, configured, strict=True):
            group.update(keys)

    def describe(self) -> str:
        """The header's line: what each half trains and with what."""
        adamw = [g for g in self.param_groups if not g["muon"]]
        rest = [p for g in adamw for p in g["params"]]
        decay = max((float(g["weight_decay"]) for g in adamw), default=0.0)
        beta1, beta2 = self.defaults["betas"]
        fused = [layout.parts for layout in self.layouts if layout.parts > 1]
        kinds = "; ".join(sorted({FUSED_PARTS.get(parts, f"{parts} parts") for parts in fused}))
        split = f", {len(fused)} of them fused weights orthogonalised per part ({kinds})" if fused else ""
        world = self.owners.world_size
        shared = f", each orthogonalised by one of {world} ranks (owners balanced by size)" if world > 1 else ""
        muon_size = sum(p.numel() for p in self.matrices) / 1e6
        return (
            f"{self.settings.describe()}: {len(self.matrices)} hidden matrices ({muon_size:,.2f}M parameters)"
            f"{split}{shared} | AdamW lr {self.peak_lr:g}, betas ({beta1:g}, {beta2:g}), eps "
            f"{self.defaults['eps']:g}, weight decay {decay:g} (not on gains and biases): {len(rest)} other tensors "
            f"(embeddings, head, routers, gains, biases; {sum(p.numel() for p in rest) / 1e6:,.2f}M)"
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _orthogonalised(self, index: int, whole: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Newton-Schulz of matrix ``index``'s whole update, each of its fused matrices on its own."""
        self.orthogonalisations += 1
        layout = self.layouts[index]
        steps, coefficients = int(group["ns_steps"]), str(group["coefficients"])
        return layout.join(orthogonalise(layout.split(whole), steps, coefficients))

    def _nesterov(self, param: torch.Tensor, momentum: float) -> torch.Tensor:
        """The momentum updated with this step's gradient (this rank's part), and the update's direction."""
        grad = local_part(param.grad)  # type: ignore[arg-type]
        buffer = local_part(self.state[param]["momentum_buffer"])
        buffer.lerp_(grad, 1 - momentum)  # an average of past gradients, its weights summing to one
        return grad.lerp(buffer, momentum)  # Nesterov: the gradient pulled toward where the momentum goes

    def _apply(self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        lr, decay = float(group["lr"]), float(group["weight_decay"])
        weights = local_part(param)
        if decay:
            weights.mul_(1 - lr * decay)
        out, into = self.layouts[self._index[id(param)]].matrix_shape(param.shape)
        weights.add_(update.to(weights.dtype), alpha=-lr * update_scale((out, into), str(group["scale"])))

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum = float(group["momentum"])
        if self.owners.world_size == 1:  # one matrix at a time: one update in memory, not all of them
            for param in params:
                index = self._index[id(param)]
                self._apply(param, self._orthogonalised(index, self._nesterov(param, momentum), group), group)
            return
        indices = [self._index[id(p)] for p in params]  # the same on every rank: gradients are synced
        inputs = [self._nesterov(p, momentum) for p in params]
        updates = self.owners.compute_once(indices, inputs, lambda i, x: self._orthogonalised(i, x, group))
        for param, update in zip(params, updates, strict=True):
            self._apply(param, update, group)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw_update(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=self.fused or None,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def build_muon(
    model: nn.Module,
    settings: MuonSettings,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    world_size: int = 1,
    rank: int = 0,
) -> MuonAdamW:
    """:class:`MuonAdamW` over ``model``: Muon for :func:`muon_matrices` (its learning rate ``settings.lr``, held as
    a multiple ``lr_scale`` of ``lr`` so the schedule and batch changes move both alike), AdamW for the rest with
    weight decay on the tensors of two or more dimensions (embeddings, the head), none on gains and biases; fused
    AdamW where :func:`~bigbatch.engine.optim.fused_adamw_supported`. ``world_size``, ``rank``: the processes
    that share the orthogonalisations (each matrix's owner computes it once)."""
    if has_lora(model):
        raise ConfigError(LORA_REFUSAL)
    found = muon_matrices(model)
    if not found:
        raise ConfigError(
            "--optimizer muon found no hidden matrix in the model's blocks to orthogonalise (it trains 2-D "
            "projections inside the repeated blocks); use --optimizer adamw"
        )
    matrices = [param for _, param, _ in found]
    groups: list[dict[str, Any]] = [
        {
            "params": matrices,
            "muon": True,
            "lr": settings.lr,
            "lr_scale": settings.lr / lr,
            "weight_decay": settings.weight_decay,
            "momentum": settings.momentum,
            "ns_steps": settings.ns_steps,
            "coefficients": settings.coefficients,
            "scale": settings.scale,
        },
        *param_groups(model, weight_decay, leave_out={id(p) for p in matrices}),  # AdamW's, as build_adamw's
    ]
    return MuonAdamW(
        [g for g in groups if g["params"]],
        muon=settings,
        lr=lr,
        betas=betas,
        eps=eps,
        layouts={id(param): layout for _, param, layout in found},
        world_size=world_size,
        rank=rank,
        fused=fused_adamw_supported(model),
    )
