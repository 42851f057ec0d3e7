"""A problem whose gradient noise scale is known in closed form, run through the real engine.

Linear least squares, per-sample loss ``(w.x - y)^2 / 2`` with ``x ~ N(0, I_d)`` and ``y = w*.x + eps``,
``eps ~ N(0, sigma^2)``. With ``delta = w - w*`` the per-sample gradient is ``g = x (x.delta - eps)``, so

    G = E[g] = E[x x^T] delta = delta
    E|g|^2 = E[|x|^2 (x.delta)^2] + sigma^2 E|x|^2 = (d + 2)|delta|^2 + d sigma^2

(``E[x_j^2 (x.delta)^2] = |delta|^2 + 2 delta_j^2`` by Isserlis, summed over j; the cross term vanishes as
``eps`` is independent of ``x`` with mean 0), hence ``tr(Sigma) = E|g|^2 - |G|^2 = (d + 1)|delta|^2 + d sigma^2``
and ``B_simple = tr(Sigma) / |G|^2``, in samples (each sample is one "token" for the engine).

``python tests/support/noise_problem.py STEPS OUT SPEC...`` under torchrun runs the multi-process check for each
SPEC ``parallel:K[:every]`` (``ddp:1``, ``fsdp:4``, ``ddp:2:every``: sync on every micro-step) and writes rank 0's
estimates, by SPEC.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.probe import SmallGradProbe
from bigbatch.noise.scale import NoiseScale
from bigbatch.parallel.distributed import DistContext, GradSync

DIM, SIGMA, DELTA_SQ = 64, 0.5, 1.0
MICRO = 64  # samples per micro-batch


@dataclass(frozen=True)
class Samples:
    x: torch.Tensor  # (n, d)
    y: torch.Tensor  # (n,)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Samples:
        return Samples(self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking))


def truth(dim: int = DIM, sigma: float = SIGMA, delta_sq: float = DELTA_SQ) -> dict[str, float]:
    trace = (dim + 1) * delta_sq + dim * sigma**2
    return {"g_sq": delta_sq, "trace": trace, "noise_scale": trace / delta_sq}


def w_star(dim: int = DIM) -> torch.Tensor:
    return torch.ones(dim, dtype=torch.float64) / dim**0.5


def make_model(dim: int = DIM, delta_sq: float = DELTA_SQ) -> nn.Linear:
    """``w = w* + delta`` with ``|delta|^2 = delta_sq``, in float64 so the norms are exact enough."""
    model = nn.Linear(dim, 1, bias=False).double()
    delta = torch.zeros(dim, dtype=torch.float64)
    delta[0] = delta_sq**0.5
    with torch.no_grad():
        model.weight.copy_((w_star(dim) + delta).unsqueeze(0))
    return model


def set_delta(model: nn.Module, delta_sq: float, dim: int = DIM) -> None:
    """Move ``model`` (from :func:`make_model`) to ``w = w* + delta`` with ``|delta|^2 = delta_sq``: a step change
    of the true ``|G|^2`` and noise scale between two optimizer steps."""
    delta = torch.zeros(dim, dtype=torch.float64)
    delta[0] = delta_sq**0.5
    with torch.no_grad():
        model.weight.copy_((w_star(dim) + delta).unsqueeze(0))  # type: ignore[operator]


def draw(n: int, generator: torch.Generator, dim: int = DIM, sigma: float = SIGMA) -> Samples:
    x = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    y = x @ w_star(dim) + sigma * torch.randn(n, generator=generator, dtype=torch.float64)
    return Samples(x, y)


def loss_sum(model: nn.Module, batch: Samples) -> torch.Tensor:
    return 0.5 * (model(batch.x).squeeze(-1) - batch.y).pow(2).sum()


def count(batch: Samples) -> int:
    return int(batch.y.numel())


def run_engine(
    k: int,
    steps: int,
    seed: int,
    model: nn.Module | None = None,
    dist: DistContext | None = None,
    grad_sync: GradSync | None = None,
    decay: float = 0.995,
    small_grad: SmallGradProbe | None = None,
) -> NoiseScale:
    """``steps`` optimizer steps at learning rate 0 (the truth stays fixed), every step measured."""
    model = model if model is not None else make_model()
    noise = NoiseScale(every=1, decay=decay)
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=loss_sum,
        count_fn=count,
        grad_sync=grad_sync,
        dist=dist,
        hooks=noise_meter_hooks(noise, model, small_grad),
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.step([draw(MICRO, generator) for _ in range(k)])
    return noise


def main() -> None:
    from bigbatch.noise.probe import small_grad_probe
    from bigbatch.parallel.distributed import distributed_session, wrap_model

    steps, out, specs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    results = {}
    with distributed_session("cpu") as (dist_ctx, device):
        for spec in specs:
            parallel, k_text, *rest = spec.split(":")
            k, every = int(k_text), rest == ["every"]
            model = make_model()
            wrapped, grad_sync = wrap_model(model, parallel, dist_ctx, device, sync_every_micro_step=every)
            probe = small_grad_probe(wrapped, parallel, every, first_reduced_possible=k == 1)
            noise = run_engine(
                k, steps, seed=1000 + dist_ctx.rank, model=wrapped, dist=dist_ctx, grad_sync=grad_sync, small_grad=probe
            )
            assert noise.last is not None
            results[spec] = {
                "g_sq": noise.last.g_sq,
                "trace": noise.last.trace,
                "b_small": noise.last.b_small,
                "b_big": noise.last.b_big,
                "noise_scale": noise.last.noise_scale,
            }
    if dist_ctx.is_main:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
