"""Distributed concerns behind a small interface, on PyTorch's own engine.

The engine asks two things of the world it runs in: switch gradient
synchronization off for a micro-step (:class:`GradSync`), and sum a tensor over
all ranks (:class:`DistContext`). A single process uses the same code path with
no-ops, so the arithmetic is identical with one rank or many.

Processes are started by ``torchrun`` (or ``bigbatch train --nproc N``, which
runs torchrun's elastic agent); the backend follows the device: NCCL on CUDA,
gloo on CPU. Wrapping is DDP or FSDP2 (``fully_shard`` per transformer block and
the root).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.nn as nn

from bigbatch.errors import ConfigError
from bigbatch.settings.choices import PARALLEL

Say = Callable[..., None]
"""``say(message, *args, level=logging.INFO)``: a log line from rank 0 (the others stay quiet)."""


class GradSync(Protocol):
    """Controls cross-rank gradient reduction for one micro-step.

    The engine wraps the forward *and* backward of micro-steps 0..K-2 in
    ``no_sync()`` and runs the last one outside it, so gradients are reduced
    exactly once per optimizer step.
    """

    def no_sync(self) -> AbstractContextManager[None]: ...


class LocalGradSync:
    """Nothing is deferred: a single process, or sync forced on every micro-step."""

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()


class DDPGradSync:
    """DDP: ``no_sync()`` around forward and backward skips the all-reduce of that micro-step."""

    def __init__(self, ddp_model: nn.parallel.DistributedDataParallel) -> None:
        self.ddp_model = ddp_model

    def no_sync(self) -> AbstractContextManager[None]:
        return self.ddp_model.no_sync()


class FSDPGradSync:
    """FSDP2: gradients stay unsharded and unreduced until the last micro-step (more memory, one reduce-scatter)."""

    def __init__(self, fsdp_model: nn.Module) -> None:
        self.fsdp_model = fsdp_model

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.fsdp_model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.fsdp_model.set_requires_gradient_sync(True)  # type: ignore[operator]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. The default is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (identity for one process)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_int(self, value: int, device: torch.device) -> int:
        """An integer summed over ranks (one small all-reduce; none for one process)."""
        if self.world_size == 1:
            return value
        return int(self.all_reduce_sum(torch.tensor([value], dtype=torch.int64, device=device)).item())

    def sum_ints(self, values: list[int], device: torch.device) -> list[int]:
        """Several integers, each summed over ranks, in one small all-reduce (none for one process)."""
        if self.world_size == 1:
            return list(values)
        summed = self.all_reduce_sum(torch.tensor(values, dtype=torch.int64, device=device))
        return [int(v) for v in summed.tolist()]

    def max_int(self, value: int, device: torch.device) -> int:
        """The largest of every rank's ``value`` (e.g. a stop signal any rank received); itself for one process."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        flags = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags.item())

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order (``[tensor]`` for one process)."""
        if self.world_size == 1:
            return [tensor]
        import torch.distributed as dist

        gathered = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (identity for one process)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` for one process)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_attempt() -> int:
    """How many times torchrun's elastic agent has restarted this job's workers (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this process's GPU when CUDA is available (``cuda:LOCAL_RANK`` under torchrun), else the CPU."""
    if name == "auto":
        name = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and torch.cuda.is_available():
        name = f"cuda:{local_rank}"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} was requested but CUDA is not available here; use --device cpu")
    return device


@contextmanager
def distributed_session(device_name: str, timeout_s: float = 600.0) -> Iterator[tuple[DistContext, torch.device]]:
    """Join the process group when started by torchrun (else a single process); leave it on exit."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        yield DistContext(), resolve_device(device_name)
        return
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(device_name, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun, key this attempt's rendezvous by the restart count, so that a restarted round can
        # never read a peer address left in the agent's store by the round before it.
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"bigbatch/attempt_{attempt}", base)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    try:
        yield DistContext(rank=rank, world_size=world, local_rank=local_rank), device
        # Free DDP/FSDP objects (they sit in reference cycles) while the process group is alive: gloo work
        # objects that outlive it are destroyed during interpreter shutdown and can abort the process.
        gc.collect()
        dist.barrier()  # leave together
    finally:
        dist.destroy_process_group()


def resolve_parallel(mode: str, world_size: int) -> str:
    PARALLEL.check(mode)
    if mode == "auto":
        return "ddp" if world_size > 1 else "none"
    if mode != "none" and world_size == 1:
        return "none"  # nothing to shard or reduce
    if mode == "none" and world_size > 1:
        raise ConfigError("parallel = none with several processes would train unsynchronized replicas; use ddp or fsdp")
    return mode


def wrap_model(
    model: nn.Module,
    parallel: str,
    dist_ctx: DistContext,
    device: torch.device,
    sync_every_micro_step: bool = False,
    precision: str = "fp32",
    units: Sequence[nn.Module] = (),
) -> tuple[nn.Module, GradSync]:
    """Wrap ``model`` for ``parallel`` (none, ddp, fsdp) and return it with its :class:`GradSync`.

    Under FSDP2 each of ``units`` is sharded on its own, then the root (the model decides its units: see
    :func:`bigbatch.models.fsdp_units`)."""
    if parallel == "none":
        return model, LocalGradSync()
    if parallel == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, LocalGradSync() if sync_every_micro_step else DDPGradSync(ddp)
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist_ctx.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if precision == "bf16" and device.type == "cuda":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model, LocalGradSync() if sync_every_micro_step else FSDPGradSync(model)
    raise ConfigError(f"unknown parallel mode {parallel!r}")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP and ``torch.compile`` wrappers."""
    inner = getattr(model, "_orig_mod", model)
    inner = getattr(inner, "module", inner) if isinstance(inner, nn.parallel.DistributedDataParallel) else inner
    return getattr(inner, "_orig_mod", inner)


def reshard(model: nn.Module) -> None:
    """Free parameters that FSDP2 left gathered: it keeps the root's after a forward without backward (an
    evaluation), and the next training step's gradients would then be wrong. No-op for other wrappings."""
    for module in model.modules():
        reshard_module = getattr(module, "reshard", None)
        if callable(reshard_module):
            reshard_module()
