"""The small gradient of the noise scale: this rank's own gradient of one micro-batch, before any reduction.

The engine needs ``|g_0|^2``, the squared norm of this rank's gradient of its first micro-batch of the step alone,
in the units it back-propagates (the loss sum x ``world_size / N``, x the fp16 loss scale; the engine converts).
Where that gradient can be read depends on the wrapping and on whether the sync of micro-batch 0 is deferred:

* one process, or DDP / FSDP2 with K >= 2 per rank (sync deferred): it is all there after the first backward, in
  ``.grad`` (one process, DDP) or in the unsharded gradients FSDP2 keeps while the sync is off;
* DDP with K = 1 per rank, or sync on every micro-step: it only exists in DDP's buckets before the all-reduce. A
  communication hook adds up the buckets' squared norms on the measured step, then reduces exactly as DDP's
  built-in reduction does (same scaling, same all-reduce), so the trajectory stays bitwise the same;
* FSDP2 with K = 1 per rank, or sync on every micro-step: it only exists in the reduce-scatter input of each
  FSDP unit. A custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) adds up the inputs' squared norms
  on the measured step and then runs FSDP's own reduce-scatter call unchanged.

The large gradient needs nothing here: the engine's pre-clip norm is the global one (under FSDP2 the norm of the
sharded gradients, reduced over ranks).

No ``from __future__ import annotations`` in this module: DDP checks a communication hook's annotations as objects.
"""

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from bigbatch.noise.scale import grad_sq_norm

log = logging.getLogger(__name__)


class SmallGradProbe(Protocol):
    """Reads ``|g_0|^2`` for the engine on the steps that measure the noise scale."""

    def can_measure(self, k: int) -> bool:
        """Whether a step of ``k`` micro-batches on this rank can give its first micro-batch's own gradient."""
        ...

    def arm(self, k: int) -> None:
        """Called before the first micro-batch of a measured step of ``k`` micro-batches."""
        ...

    def take(self) -> torch.Tensor:
        """After the first micro-batch's backward: its raw squared gradient norm (float64, 0-d); disarms."""
        ...


class GradReadProbe:
    """``.grad`` after the first backward, which holds that micro-batch's gradient alone when a second one
    follows with its sync deferred (or there is nothing to sync)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def can_measure(self, k: int) -> bool:
        return k >= 2

    def arm(self, k: int) -> None:
        pass

    def take(self) -> torch.Tensor:
        return grad_sq_norm(self.model.parameters())


class PreReduceMeter:
    """Adds up the squared norms of the tensors a reduction is handed, while armed (one measured backward)."""

    def __init__(self) -> None:
        self.armed = False
        self._parts: list[torch.Tensor] = []

    def arm(self) -> None:
        self.armed = True
        self._parts = []

    def add(self, tensor: torch.Tensor, scale: float = 1.0) -> None:
        """Adds ``|scale * tensor|^2`` when armed."""
        if self.armed:
            self._parts.append((torch.linalg.vector_norm(tensor).double() * scale).square())

    def take(self) -> torch.Tensor:
        """The sum of the squared norms seen since :meth:`arm` (0 when none were); disarms."""
        self.armed = False
        parts, self._parts = self._parts, []
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(parts).sum()


class DDPMeasuringHook:
    """State of :func:`measuring_allreduce_hook`: the meter and the group DDP reduces over."""

    def __init__(self, meter: PreReduceMeter, group: dist.ProcessGroup) -> None:
        self.meter = meter
        self.group = group


def measuring_allreduce_hook(state: DDPMeasuringHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce, after adding the local bucket's squared norm to the meter when armed.

    DDP without a hook multiplies each gradient by ``1 / world_size`` as it copies it into the bucket, then sums
    over ranks; this does the same multiplication on the bucket (not ``div_``, as ``default_hooks.allreduce_hook``
    does: ``x / 3`` and ``x * (1 / 3)`` round differently), so the reduced gradients are bitwise DDP's own. (That
    is DDP's path for gradients copied into buckets, as ``wrap_model`` leaves them: with ``gradient_as_bucket_view``
    DDP divides the bucket in place instead.)"""
    tensor = bucket.buffer()
    state.meter.add(tensor)
    tensor.mul_(1.0 / state.group.size())
    work = dist.all_reduce(tensor, group=state.group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def _first_reduced(k: int, sync_every_micro_step: bool) -> bool:
    """Whether the first micro-batch's backward itself reduces over ranks (K = 1, or sync on every micro-step)."""
    return k == 1 or sync_every_micro_step


class DDPProbe:
    """DDP: ``.grad`` after the first backward while its sync is deferred; the local buckets as the communication
    hook hands them to the all-reduce when the first backward reduces (``hooked``: the hook is registered)."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, sync_every_micro_step: bool, hooked: bool) -> None:
        self._read = GradReadProbe(ddp)
        self._meter = PreReduceMeter()
        self.sync_every_micro_step = sync_every_micro_step
        self.hooked = hooked
        self._from_meter = False
        if hooked:
            ddp.register_comm_hook(DDPMeasuringHook(self._meter, ddp.process_group), measuring_allreduce_hook)

    def can_measure(self, k: int) -> bool:
        return self.hooked if _first_reduced(k, self.sync_every_micro_step) else k >= 2

    def arm(self, k: int) -> None:
        self._from_meter = _first_reduced(k, self.sync_every_micro_step)
        if self._from_meter:
            self._meter.arm()

    def take(self) -> torch.Tensor:
        return self._meter.take() if self._from_meter else self._read.take()


def _fsdp_modules(model: nn.Module) -> Iterator[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return (module for module in model.modules() if isinstance(module, FSDPModule))


def fsdp_unsharded_grads_readable(model: nn.Module) -> bool:
    """Whether this torch's FSDP2 keeps the internals :func:`fsdp_unsharded_grads` reads."""
    for module in _fsdp_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if not isinstance(groups, list):
            return False
        for group in groups:
            if not all(hasattr(p, "unsharded_accumulated_grad") for p in getattr(group, "fsdp_params", [None])):
                return False
    return True


def fsdp_unsharded_grads(model: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 holds for ``model``'s units while gradient sync is off (this rank's own,
    not reduced). FSDP2 has no public accessor for them: this reads its parameter groups (torch 2.13)."""
    grads: list[torch.Tensor] = []
    for module in _fsdp_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.unsharded_accumulated_grad  # set when gradients are reduced in another dtype
                if grad is None:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    grad = None if unsharded is None else unsharded.grad
                if grad is not None:
                    grads.append(grad)
    return grads


def _measuring_reduce_scatter(meter: PreReduceMeter) -> object:
    """FSDP2's default reduce-scatter, adding the input's squared norm to ``meter`` first when armed.

    The input is this rank's unsharded gradients of one unit, zero-padded per rank, in the reduce dtype; FSDP2 has
    already divided it by a pre-divide factor where the dtype risks overflow (fp16, and fp64), so the norm is
    multiplied back by the factor FSDP2 computes for the same reduction (bigbatch sets no divide factor of its own)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultReduceScatter,
        _get_gradient_divide_factors,
    )

    class MeasuringReduceScatter(DefaultReduceScatter):
        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> dist.Work:
            if meter.armed:
                pre_factor = _get_gradient_divide_factors(group, None, input_tensor.dtype, input_tensor.device.type)[0]
                meter.add(input_tensor, scale=float(pre_factor or 1.0))
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return MeasuringReduceScatter()


class FSDPProbe:
    """FSDP2: the unsharded gradients after the first backward while its sync is deferred; the reduce-scatter
    inputs of every unit when the first backward reduces.

    Both are this rank's own gradients of the first micro-batch, in the units the engine back-propagates."""

    def __init__(self, model: nn.Module, sync_every_micro_step: bool) -> None:
        self.model = model
        self.sync_every_micro_step = sync_every_micro_step
        self._meter = PreReduceMeter()
        self._from_meter = False
        comm = _measuring_reduce_scatter(self._meter)
        for module in _fsdp_modules(model):
            module.set_custom_reduce_scatter(comm)  # type: ignore[operator]
        self.unsharded_readable = fsdp_unsharded_grads_readable(model)
        if not self.unsharded_readable:
            log.warning(
                "this torch's FSDP2 does not expose its unsharded gradients as bigbatch expects: the noise scale is "
                "measured only on steps whose first micro-batch syncs (K = 1 per rank, --sync-every-micro-step)"
            )

    def can_measure(self, k: int) -> bool:
        return _first_reduced(k, self.sync_every_micro_step) or self.unsharded_readable

    def arm(self, k: int) -> None:
        self._from_meter = _first_reduced(k, self.sync_every_micro_step)
        if self._from_meter:
            self._meter.arm()

    def take(self) -> torch.Tensor:
        if self._from_meter:
            return self._meter.take()
        grads = fsdp_unsharded_grads(self.model)
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0).double().square()


def small_grad_probe(
    model: nn.Module, parallel: str, sync_every_micro_step: bool, first_reduced_possible: bool
) -> SmallGradProbe:
    """The probe for a model wrapped for ``parallel`` (``wrap_model``'s result, before ``torch.compile``).

    Under DDP the communication hook is registered only when some step may reduce its first micro-batch
    (``first_reduced_possible``: K = 1 per rank, or sync on every micro-step); other runs keep DDP's built-in
    reduction untouched."""
    if parallel == "ddp":
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        return DDPProbe(model, sync_every_micro_step, hooked=first_reduced_possible or sync_every_micro_step)
    if parallel == "fsdp":
        return FSDPProbe(model, sync_every_micro_step)
    return GradReadProbe(model)
