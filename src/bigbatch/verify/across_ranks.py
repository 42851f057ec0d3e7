"""The verifier across ranks: DDP's gradient after its one sync step against one process on the whole batch."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.optim import constant_schedule
from bigbatch.parallel.distributed import DDPGradSync
from bigbatch.verify.compare import buffers_of, compare_buffers, flat, gradients, rel_diff
from bigbatch.verify.inputs import (
    DEFAULT_TOLERANCE,
    TensorBatch,
    VerifyLossFn,
    disable_dropout,
    lm_loss,
    scan_cross_sample_modules,
    tensor_batch_objective,
)
from bigbatch.verify.verdict import DistributedReport


def check_distributed_equivalence(
    model: nn.Module,
    batch: torch.Tensor | Sequence[torch.Tensor],
    dist_ctx: Any,
    loss_fn: VerifyLossFn | None = None,
    k: int = 4,
    device: torch.device | str = "cpu",
    tolerance: float = DEFAULT_TOLERANCE["fp32"],
    router_balance: str = "exact",
) -> DistributedReport:
    """Run on every rank of a torchrun job with the same ``model`` and global ``batch``.

    The batch is split into ``world_size x k`` micro-batches; rank ``r`` accumulates
    micro-batches ``r*k .. r*k+k-1`` through the engine under DDP (gradient sync
    only on the last). Then every rank's gradient is compared with rank 0's and
    with the gradient of one process over the whole batch.
    """
    started = time.perf_counter()
    device = torch.device(device)
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    loss_fn = loss_fn or lm_loss
    world, rank = dist_ctx.world_size, dist_ctx.rank
    samples = tensors[0].shape[0]
    if samples < world * k:
        raise ValueError(f"need at least world_size x k = {world * k} samples, got {samples}")
    chunks = torch.tensor_split(torch.arange(samples), world * k)
    parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in chunks[rank * k : (rank + 1) * k]]

    base = copy.deepcopy(model).to(device).train()
    disable_dropout(base)
    findings = scan_cross_sample_modules(base)
    counter = copy.deepcopy(base)  # a forward in training mode may update buffers: never count on ``base``
    with torch.no_grad():
        local = {id(p): int(loss_fn(counter, *p.to(device).tensors)[1]) for p in parts}
    del counter
    n_valid = dist_ctx.sum_int(sum(local.values()), device)
    gathered_counts = dist_ctx.all_gather(torch.tensor([sum(local.values())], device=device))

    replica = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(replica, device_ids=[device.index] if device.type == "cuda" else None)
    engine = AccumulationEngine(
        ddp,
        torch.optim.SGD(replica.parameters(), lr=0.0),
        constant_schedule(1.0),
        grad_clip=0.0,
        device=device,
        objective=tensor_batch_objective(loss_fn, lambda b: local[id(b)], router_balance),
        grad_sync=DDPGradSync(ddp),
        dist=dist_ctx,
    )
    replica.zero_grad(set_to_none=True)
    engine.accumulate(parts, n_valid=n_valid)
    flat_ddp = flat(list(gradients(replica).values())).to(device)
    everyone = dist_ctx.all_gather(flat_ddp)
    rank_diff = max((g - everyone[0]).abs().max().item() for g in everyone)

    reference = _whole_batch_pass(base, tensors, loss_fn, n_valid, device)
    flat_full = flat(list(gradients(reference).values())).to(device)
    reference_buffers = buffers_of(reference)
    differing = [b.name for b in compare_buffers(reference_buffers, buffers_of(replica), tolerance)]
    per_rank = dist_ctx.all_gather_object(differing)
    return DistributedReport(
        world_size=world,
        k=k,
        valid_counts=[int(c.item()) for c in gathered_counts],
        rank_max_abs_diff=rank_diff,
        total_rel_diff=rel_diff(flat_ddp, flat_full),
        tolerance=tolerance,
        seconds=time.perf_counter() - started,
        findings=findings,
        buffers=[f"rank {r}: {name}" for r, names in enumerate(per_rank) for name in names],
        buffers_compared=len(reference_buffers),
    )


def _whole_batch_pass(
    base: nn.Module, tensors: tuple[torch.Tensor, ...], loss_fn: VerifyLossFn, n_valid: int, device: torch.device
) -> nn.Module:
    """A copy of ``base`` after one process's forward and backward over the whole batch as one part, through the
    engine (so a router's balancing loss is the batch's own)."""
    reference = copy.deepcopy(base)
    engine = AccumulationEngine(
        reference,
        torch.optim.SGD(reference.parameters(), lr=0.0),
        constant_schedule(1.0),
        grad_clip=0.0,
        device=device,
        objective=tensor_batch_objective(loss_fn, lambda b: n_valid),
    )
    reference.zero_grad(set_to_none=True)
    engine.accumulate([TensorBatch(tuple(t.to(device) for t in tensors))], n_valid=n_valid)
    return reference
