"""Worker: ``torchrun --nproc-per-node N tests/support/noise_dist_worker.py OUT SPEC...``, SPEC ``parallel:k[:every]``
(parallel: ddp, fsdp, or fsdp-bf16: FSDP2 with bf16 parameters and fp32 reductions).

For each SPEC the tiny GPT of ``dist_worker`` trains STEPS AdamW steps twice, with the gradient noise scale measured
on every step and not measured at all, on globally seeded ragged micro-batches (each rank its own K of them, the
ranks' valid tokens uneven). Rank 0 writes, per SPEC, both final parameters and the losses, every measured step's
noise sample, and the reference small norm of step 1: the mean over ranks of the squared norm of the gradient of
the mean loss of each rank's first micro-batch, computed on a plain copy of the initial model.
"""

from __future__ import annotations

import sys

import torch
from dist_worker import VOCAB, make_model

from bigbatch.engine.accumulate import AccumulationEngine, token_loss_sum
from bigbatch.engine.batch import MicroBatch, count_valid_targets
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import fsdp_units
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.probe import small_grad_probe
from bigbatch.noise.scale import NoiseScale
from bigbatch.parallel.distributed import (
    DistContext,
    FSDPGradSync,
    GradSync,
    LocalGradSync,
    distributed_session,
    wrap_model,
)

B, T, STEPS = 2, 16, 3


def my_micro_batches(step: int, k: int, dist_ctx: DistContext) -> list[MicroBatch]:
    """This rank's K micro-batches of the step: every rank draws the whole step and keeps its share."""
    n = dist_ctx.world_size * k * B
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (n, T + 1), generator=gen)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    y[torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)] = -100
    batches = [MicroBatch(a, b) for a, b in zip(x.chunk(n // B), y.chunk(n // B), strict=True)]
    return batches[dist_ctx.rank * k : (dist_ctx.rank + 1) * k]


def full_state(model: torch.nn.Module, parallel: str) -> dict[str, torch.Tensor]:
    if parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def wrap_bf16_fsdp(model: torch.nn.Module, dist_ctx: DistContext, every: bool) -> tuple[torch.nn.Module, GradSync]:
    """FSDP2 with bf16 parameters and fp32 reductions, as ``wrap_model`` does on CUDA: here on CPU, so that the
    unsharded gradients held under no-sync are FSDP2's ``unsharded_accumulated_grad`` (in the reduce dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist_ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, LocalGradSync() if every else FSDPGradSync(model)


def train(parallel: str, k: int, every: bool, measure: bool, dist_ctx: DistContext, device: torch.device) -> dict:
    model = make_model()
    if parallel == "fsdp-bf16":
        wrapped, grad_sync = wrap_bf16_fsdp(model, dist_ctx, every)
    else:
        wrapped, grad_sync = wrap_model(
            model, parallel, dist_ctx, device, sync_every_micro_step=every, units=fsdp_units(model)
        )
    noise = NoiseScale(every=1) if measure else None
    kind = parallel.split("-")[0]
    probe = small_grad_probe(wrapped, kind, every, first_reduced_possible=k == 1) if measure else None
    engine = AccumulationEngine(
        wrapped,
        build_adamw(model, 1e-2),
        constant_schedule(1e-2),
        grad_clip=1.0,
        grad_sync=grad_sync,
        dist=dist_ctx,
        hooks=noise_meter_hooks(noise, wrapped, probe),
    )
    records = [engine.step(my_micro_batches(step, k, dist_ctx)) for step in range(STEPS)]
    return {
        "state": full_state(model, parallel.split("-")[0]),
        "losses": [r.loss for r in records],
        "norms": [r.grad_norm for r in records],
        "noise": [None if r.noise is None else r.noise.as_dict() for r in records],
    }


def reference_small(k: int, dist_ctx: DistContext) -> dict[str, float]:
    """Step 1's ``|G_small|^2`` (mean over ranks) and ``B_small`` (harmonic mean), from a plain initial model."""
    first = my_micro_batches(0, k, dist_ctx)[0]
    model = make_model()
    n = count_valid_targets(first)
    (token_loss_sum(model, first) / n).backward()
    sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    pair = dist_ctx.all_reduce_sum(torch.tensor([sq, 1.0 / n], dtype=torch.float64)) / dist_ctx.world_size
    return {"small_sq": float(pair[0]), "b_small": 1.0 / float(pair[1])}


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    results: dict[str, object] = {}
    with distributed_session("cpu") as (dist_ctx, device):
        for spec in specs:
            parallel, k_text, *rest = spec.split(":")
            k, every = int(k_text), rest == ["every"]
            results[spec] = {
                "on": train(parallel, k, every, True, dist_ctx, device),
                "off": train(parallel, k, every, False, dist_ctx, device),
                "reference": reference_small(k, dist_ctx),
                "world": dist_ctx.world_size,
            }
        if dist_ctx.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    main()
