"""Worker for the multi-process Muon tests (``tests/integration/test_muon_distributed.py``).

``torchrun --nproc-per-node 2 tests/support/muon_dist_worker.py train OUT``
    Trains dist_worker's tiny GPT with Muon (AdamW for the rest) for 3 steps under DDP, then under FSDP2, on
    globally seeded data, each rank taking its K of the step's ``world x K`` micro-batches. Rank 0 writes, per
    mode, the final whole parameters, the logged losses and gradient norms and every rank's Newton-Schulz runs
    in each step.

``torchrun --nproc-per-node 3 tests/support/muon_dist_worker.py shards OUT``
    ``MatrixOwners.compute_once`` on DTensors sharded by rows (``Shard(0)``) where a rank holds no rows (an
    owner among them), beside a plain replicated tensor. Rank 0 writes every rank's pieces of the results, the
    same rows of ``orthogonalise`` of the whole matrix computed here, and each rank's Newton-Schulz runs.

``[torchrun ...] tests/support/muon_dist_worker.py probe OUT train ARGS...``
    ``bigbatch train ARGS`` (the command line's own code, in this process) with a look at the optimizer after
    the run is built (resumed) and before its first step: rank 0 writes the momentum buffers gathered whole,
    each rank's own pieces' dtypes and shapes and where the run resumed from. Without torchrun: one process
    (a test may also use :func:`probing` around ``main()`` in its own process).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

MUON_LR, ADAMW_LR = 3e-3, 1e-3


def muon_optimizer(model: torch.nn.Module, world_size: int = 1, rank: int = 0) -> Any:
    from bigbatch.engine.muon import MuonSettings, build_muon

    return build_muon(model, MuonSettings(lr=MUON_LR), lr=ADAMW_LR, world_size=world_size, rank=rank)


# ---- train: DDP and FSDP2 against one process ---------------------------------------------------------------


def train(parallel: str, dist_ctx: Any, device: torch.device) -> dict[str, Any]:
    import dist_worker

    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.optim import constant_schedule
    from bigbatch.models import fsdp_units
    from bigbatch.parallel.distributed import wrap_model

    model = dist_worker.make_model()
    wrapped, grad_sync = wrap_model(model, parallel, dist_ctx, device, units=fsdp_units(model))
    # after wrapping: FSDP2 has replaced the parameters with sharded ones
    optimizer = muon_optimizer(model, dist_ctx.world_size, dist_ctx.rank)
    engine = AccumulationEngine(
        wrapped, optimizer, constant_schedule(ADAMW_LR), grad_clip=1.0, grad_sync=grad_sync, dist=dist_ctx
    )
    records, runs = [], []
    k = dist_worker.K
    for step in range(dist_worker.STEPS):
        batches = dist_worker.global_step_batches(step, dist_ctx.world_size, ragged=False)
        before = optimizer.orthogonalisations
        records.append(engine.step(batches[dist_ctx.rank * k : (dist_ctx.rank + 1) * k]))
        runs.append(dist_ctx.all_gather_object(optimizer.orthogonalisations - before))  # [rank] this step
    whole = {  # full_tensor() is a collective: every rank gathers, rank 0 keeps it
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {
        "state": whole,
        "losses": [r.loss for r in records],
        "norms": [r.grad_norm for r in records],
        "tokens": [r.tokens for r in records],
        "ns_runs": runs,
        "sharded": [name for name, p in model.named_parameters() if hasattr(p, "placements")],
    }


def run_train(out: str) -> None:
    from bigbatch.parallel.distributed import distributed_session

    with distributed_session("cpu") as (dist_ctx, device):
        result: dict[str, Any] = {"world": dist_ctx.world_size}
        for parallel in ("ddp", "fsdp"):
            result[parallel] = train(parallel, dist_ctx, device)
        if dist_ctx.is_main:
            torch.save(result, out)


# ---- shards: owner assembly where a rank holds no rows ------------------------------------------------------

SHARD_SHAPES = [(7, 4), (2, 5), (4, 3), (2, 4, 3)]
"""On 3 ranks torch.chunk gives the rows [3, 3, 1], [1, 1, 0], [2, 2, 0] and (two experts) [1, 1, 0]."""
REPLICATED_SHAPE = (5, 3)


def shard_problem() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The whole matrices (parameters, and the inputs to orthogonalise), the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(shape, generator=gen) for shape in SHARD_SHAPES]
    inputs = [torch.randn(shape, generator=gen) for shape in SHARD_SHAPES]
    return params, inputs, torch.randn(REPLICATED_SHAPE, generator=gen), torch.randn(REPLICATED_SHAPE, generator=gen)


def run_shards(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from bigbatch.engine.newton_schulz import orthogonalise
    from bigbatch.parallel.distributed import distributed_session
    from bigbatch.parallel.matrix_owners import MatrixOwners

    with distributed_session("cpu") as (dist_ctx, _device):
        world, rank = dist_ctx.world_size, dist_ctx.rank
        mesh = init_device_mesh("cpu", (world,))
        params, inputs, plain_param, plain_input = shard_problem()
        sharded = [distribute_tensor(p, mesh, [Shard(0)]) for p in params]
        locals_ = [distribute_tensor(x, mesh, [Shard(0)]).to_local() for x in inputs]
        runs = [0]

        def compute(index: int, matrix: torch.Tensor) -> torch.Tensor:
            runs[0] += 1
            return orthogonalise(matrix)

        owners = MatrixOwners([*sharded, plain_param], world, rank)
        got = owners.compute_once(range(len(sharded) + 1), [*locals_, plain_input], compute)
        expected = [orthogonalise(x).chunk(world)[rank] if rank < len(x.chunk(world)) else None for x in inputs]
        mine = {
            "rank": rank,
            "rows": [tuple(x.shape) for x in locals_],
            "got": [g.clone() for g in got],
            "expected": [
                e.clone() if e is not None else orthogonalise(x)[:0].clone()
                for e, x in zip(expected, inputs, strict=True)
            ]
            + [orthogonalise(plain_input)],
            "runs": runs[0],
            "owners": owners.owners,
        }
        everyone = dist_ctx.all_gather_object(mine)
        if dist_ctx.is_main:
            torch.save({"world": world, "ranks": everyone, "inputs": [*inputs, plain_input]}, out)


# ---- probe: a CLI run's optimizer state once resumed --------------------------------------------------------


@contextmanager
def probing(out: str) -> Iterator[None]:
    """While inside: a Trainer's ``train()`` first writes (rank 0) its optimizer's momentum, gathered whole, each
    rank's pieces' dtypes and shapes, the step it starts from and the checkpoint it resumed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from bigbatch.run.loop import trainer as trainer_module

    original = trainer_module.Trainer.train

    def probed(self: Any) -> Any:
        optimizer, model = self.parts.optimizer, self.parts.model
        whole: Any = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )  # a collective under FSDP2: every rank takes part, rank 0 holds the result
        pieces = []
        for group in optimizer.param_groups:
            if group.get("muon"):
                for p in group["params"]:
                    buffer = optimizer.state[p]["momentum_buffer"]
                    local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
                    pieces.append((str(buffer.dtype), str(local.dtype), tuple(local.shape), tuple(buffer.shape)))
        everyone = self.dist.all_gather_object(pieces)
        if self.dist.is_main:
            momentum = {
                name: entry["momentum_buffer"].clone()
                for name, entry in whole["state"].items()
                if "momentum_buffer" in entry
            }
            torch.save(
                {
                    "momentum": momentum,
                    "pieces": everyone,
                    "world": self.dist.world_size,
                    "step": self.engine.step_count,
                    "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                },
                out,
            )
        return original(self)

    trainer_module.Trainer.train = probed
    try:
        yield
    finally:
        trainer_module.Trainer.train = original


def run_probe(out: str, argv: list[str]) -> int:
    from bigbatch.cli import main

    with probing(out):
        return main(argv)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "train":
        run_train(out)
    elif mode == "shards":
        run_shards(out)
    elif mode == "probe":
        raise SystemExit(run_probe(out, sys.argv[3:]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
