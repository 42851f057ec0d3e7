"""Worker for the multi-process tests: ``torchrun --nproc-per-node 2 tests/support/dist_worker.py MODE OUT``.

Trains a tiny GPT for 3 steps on globally seeded data, each rank taking its
K of the step's ``world x K`` micro-batches, and writes (rank 0) the final
parameters, the logged losses and gradient norms, and the number of DDP
gradient-reduction rounds with deferred sync and with sync forced every
micro-step.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, GPTConfig, fsdp_units
from bigbatch.parallel.distributed import distributed_session, wrap_model

K, B, T, VOCAB, STEPS = 3, 2, 16, 61, 3


def global_step_batches(step: int, world: int, ragged: bool) -> list[MicroBatch]:
    """The ``world x K`` micro-batches of one global step, identical on every rank and in the reference."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (world * K * B, T + 1), generator=gen)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ragged:
        lengths = torch.randint(1, T + 1, (world * K * B,), generator=gen)
        y[torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)] = -100
        y[: K * B, 2:] = -100  # rank 0's share is nearly empty: the split is very uneven
    return [MicroBatch(a, b) for a, b in zip(x.chunk(world * K), y.chunk(world * K), strict=True)]


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB))


def train(parallel: str, ragged: bool, dist_ctx, device, sync_every: bool = False) -> tuple[GPT, list, int]:
    model = make_model()
    wrapped, grad_sync = wrap_model(
        model, parallel, dist_ctx, device, sync_every_micro_step=sync_every, units=fsdp_units(model)
    )
    rounds = [0]
    if parallel == "ddp":

        def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
            rounds[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, counting_hook)
    engine = AccumulationEngine(
        wrapped,
        build_adamw(model, 1e-3),
        constant_schedule(1e-3),
        grad_clip=1.0,
        grad_sync=grad_sync,
        dist=dist_ctx,
    )
    records = []
    for step in range(STEPS):
        batches = global_step_batches(step, dist_ctx.world_size, ragged)
        mine = batches[dist_ctx.rank * K : (dist_ctx.rank + 1) * K]
        records.append(engine.step(mine))
    return model, records, rounds[0]


def main() -> None:
    parallel, out = sys.argv[1], sys.argv[2]
    with distributed_session("cpu") as (dist_ctx, device):
        run(parallel, out, dist_ctx, device)


def run(parallel: str, out: str, dist_ctx, device) -> None:  # type: ignore[no-untyped-def]
    result: dict[str, object] = {"world": dist_ctx.world_size}
    for ragged in (False, True):
        model, records, rounds = train(parallel, ragged, dist_ctx, device)
        if parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = copy.deepcopy(model.state_dict())
        result[f"ragged={ragged}"] = {
            "state": state,
            "losses": [r.loss for r in records],
            "norms": [r.grad_norm for r in records],
            "tokens": [r.tokens for r in records],
            "rounds": rounds,
        }
    if parallel == "ddp":
        result["rounds_every_micro_step"] = train(parallel, False, dist_ctx, device, sync_every=True)[2]
    if dist_ctx.is_main:
        torch.save(result, out)


if __name__ == "__main__":
    main()
