"""A reference Muon, written from its public description, and the plainest training loop with it (imported by
muon_vs_reference.py; not a benchmark).

    from reference_muon import ReferenceMuon, train_reference_muon   # with benchmarks/ on sys.path

Independent of bigbatch (it imports nothing from it). Muon as Keller Jordan described it (2024, "Muon: An
optimizer for hidden layers in neural networks", and the ``muon`` package's ``Muon``): per 2-D hidden matrix,

    buf <- lerp(buf, g, 1 - momentum)                 # momentum, EMA form
    u   <- lerp(g, buf, momentum)                     # Nesterov
    u   <- NewtonSchulz5(u)                           # quintic (3.4445, -4.7750, 2.0315), 5 steps, fp32,
                                                      # Frobenius-normalised, on the wide orientation
    W   <- W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) u # decoupled weight decay; the update's RMS matched to
                                                      # AdamW's (Moonlight's convention, bigbatch's default)

AdamW (torch's, its default kernel) for everything else: embeddings (weight decay), the tied head, LayerNorm
gains and every bias (no decay). The split is by position, not by shape: the 2-D parameters inside the
transformer's blocks (``transformer.h.*``) get Muon, as bigbatch does. The fused ``attn.c_attn`` weight (q, k and v
stacked, 3C x C) is three matrices, each orthogonalised and scaled on its own, as nanochat's separate ``c_q``,
``c_k`` and ``c_v`` would be. The loop is :func:`reference_gpt.train_reference`'s
(learning rate of both groups from the same warmup + cosine schedule, zero grads, ``(loss / accum).backward()``
per micro-batch, clip, step) with this optimizer pair in place of the single AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
from reference_gpt import ReferenceResult, train_reference


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan's quintic Newton-Schulz iteration toward the orthogonal polar factor of ``G`` (in fp32 here; he
    runs it in bfloat16 on GPUs)."""
    assert G.ndim == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)  # spectral norm at most 1
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X.to(G.dtype)


class ReferenceMuon(torch.optim.Optimizer):
    """Muon for 2-D matrices: EMA momentum with Nesterov, Newton-Schulz, 0.2 sqrt(max(m, n)) scale, decoupled
    weight decay."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        stacked: dict[int, int] | None = None,
    ) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        self.stacked = stacked or {}  # id(param) -> how many matrices its rows stack (c_attn: q, k, v)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])
                pieces = update.chunk(self.stacked.get(id(p), 1), dim=0)
                update = torch.cat(
                    [
                        zeropower_via_newtonschulz5(piece, group["ns_steps"])
                        * (0.2 * math.sqrt(max(piece.size(0), piece.size(1))))
                        for piece in pieces
                    ]
                )
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's: 2-D inside the blocks; AdamW's with decay: the other 2-D ones; AdamW's without: 1-D)."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and name.startswith("transformer.h."):
            muon.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return muon, decay, no_decay


def make_optimizers(
    model: nn.Module,
    lr: float,
    muon_lr: float,
    weight_decay: float = 0.1,
    muon_weight_decay: float = 0.1,
    momentum: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> tuple[ReferenceMuon, torch.optim.AdamW]:
    muon, decay, no_decay = split_parameters(model)
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        eps=eps,
    )
    stacked = {id(p): 3 for name, p in model.named_parameters() if name.endswith("attn.c_attn.weight")}
    return ReferenceMuon(muon, muon_lr, momentum, muon_weight_decay, stacked=stacked), adamw


def train_reference_muon(
    model: nn.Module,
    tokens: np.ndarray,
    *,
    steps: int,
    micro_batch: int,
    seq_len: int,
    accum: int = 1,
    order: str = "random",
    seed: int = 1337,
    lr: float = 2e-3,
    muon_lr: float | None = None,
    momentum: float = 0.95,
    min_lr_ratio: float = 0.1,
    warmup_steps: int = 20,
    decay_steps: int = 0,
    weight_decay: float = 0.1,
    muon_weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    grad_clip: float = 1.0,
    val_windows: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    eval_every: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> ReferenceResult:
    """:func:`reference_gpt.train_reference` with Muon on the blocks' matrices (``muon_lr``, default ``lr``) and
    AdamW on the rest; both learning rates follow the same schedule."""
    muon_lr = lr if muon_lr is None else muon_lr
    muon, adamw = make_optimizers(model, lr, muon_lr, weight_decay, muon_weight_decay, momentum, betas, eps)
    return train_reference(
        model,  # type: ignore[arg-type]
        tokens,
        steps=steps,
        micro_batch=micro_batch,
        seq_len=seq_len,
        accum=accum,
        order=order,
        seed=seed,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        grad_clip=grad_clip,
        val_windows=val_windows,
        eval_every=eval_every,
        on_step=on_step,
        optimizers=[(muon, muon_lr / lr), (adamw, 1.0)],
    )
