"""Distributed concerns behind a small interface.

The engine asks two things of the world it runs in: switch gradient
synchronization off for a micro-step (:class:`GradSync`), and sum a tensor over
all ranks (:class:`DistContext`). A single process uses the same code path with
no-ops, so the arithmetic is identical with one rank or many.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch


class GradSync(Protocol):
    """Controls cross-rank gradient reduction for one micro-step.

    The engine wraps the forward *and* backward of micro-steps 0..K-2 in
    ``no_sync()`` and runs the last one outside it, so gradients are reduced
    exactly once per optimizer step.
    """

    def no_sync(self) -> AbstractContextManager[None]: ...


class LocalGradSync:
    """Single process: there is nothing to synchronize."""

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. The default is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (identity for one process)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
