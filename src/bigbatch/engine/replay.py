"""Replay: one micro-batch's gradient contribution computed again and compared bit for bit.

With exact accumulation a step's gradient is the sum of its micro-batches' contributions, each a deterministic
function of the parameters, the micro-batch, the loss scale and the generators' state. So one drawn micro-batch's
contribution can be captured as it is computed (tensor hooks on the parameters see it before it is added to
``.grad`` and before any cross-rank reduction), computed again from the same inputs (on a peer rank with several
processes, and on its own rank when that differs or there is one process), and compared through a SHA-256 digest
of their bytes: a wrong value that raised no error (a bit flipped by a device) shows as a different digest. The
comparison is bitwise, so it holds only where kernels are deterministic (CPU; CUDA with deterministic algorithms,
which the run turns on with ``--replay-every``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.bad_steps import REPLAY_MISMATCH, Suspect
from bigbatch.engine.rng import capture_rng_state, restore_rng_state


def digest(tensors: Sequence[torch.Tensor | None]) -> str:
    """SHA-256 of the tensors' bytes, in order (a missing gradient counts as a marker of its own)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            hasher.update(b"none")
            continue
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
        hasher.update(str(tuple(tensor.shape)).encode())
        hasher.update(data.tobytes())
    return hasher.hexdigest()


class ContributionCapture:
    """While armed, each parameter's incoming gradient (one micro-batch's contribution, before ``.grad`` adds it
    and before DDP reduces it) is kept, in parameter order."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._handles: list[Any] = []

    def __enter__(self) -> ContributionCapture:
        for index, param in enumerate(self.params):
            self._handles.append(param.register_hook(self._keeper(index)))
        return self

    def _keeper(self, index: int) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            self.grads[index] = grad.detach().clone()

        return keep

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class DrawnMicroBatch:
    """What the first pass keeps of the drawn micro-batch: itself (on the host), the generators before its
    forward, and its contribution's digest."""

    index: int
    batch: Any
    rng: dict[str, Any]
    first: str = ""


Objective = Callable[[nn.Module, Any], torch.Tensor]
"""``objective(module, micro_batch_on_device)``: the scaled loss the first pass back-propagated for it."""


def recompute(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    drawn: DrawnMicroBatch,
    objective: Objective,
    device: torch.device,
) -> str:
    """The digest of the drawn micro-batch's contribution computed again through ``module`` (the local module: no
    cross-rank reduction), from the generators it first ran with; the generators are left as they were."""
    trained = [p for p in params if p.requires_grad]
    after = capture_rng_state()
    try:
        restore_rng_state(drawn.rng)
        with ContributionCapture(trained) as capture:  # the hooks on the parameters (a fault's too) fire as before
            loss = objective(module, drawn.batch.to(device))
            torch.autograd.grad(loss, trained, allow_unused=True)
    finally:
        restore_rng_state(after)
    return digest(capture.grads)


def compare(drawn: list[tuple[int, str, str, str]], world_size: int) -> list[Suspect]:
    """Each rank's ``(micro-batch, first digest, own re-run's digest, the next rank's re-run's digest)`` (one
    process: the own re-run twice) into suspects. A rank whose re-run differs from its first run computed wrongly
    once (transient). A rank consistent with itself whose peer computed its micro-batch differently is a suspect
    only when the peer is consistent too (then one of the two repeats a fault, and which cannot be told); a peer
    that is itself inconsistent explains the difference."""
    consistent = [first == again for _, first, again, _ in drawn]
    suspects = []
    for rank, (micro, first, again, peer) in enumerate(drawn):
        peer_rank = (rank + 1) % world_size
        if not consistent[rank]:
            detail = f"rank {rank}'s first run differs from its re-run"
            if world_size > 1:
                detail += f" ({'equal' if again == peer else 'and from'} rank {peer_rank}'s)"
            suspects.append(Suspect(rank=rank, micro=micro, cause=REPLAY_MISMATCH, verdict="transient", detail=detail))
        elif first != peer and consistent[peer_rank]:
            detail = f"rank {peer_rank} computes it differently, each rank consistent with itself (a repeating fault)"
            suspects.append(
                Suspect(rank=rank, micro=micro, cause=REPLAY_MISMATCH, verdict="reproduced on its rank", detail=detail)
            )
    return suspects
