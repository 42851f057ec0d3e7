"""Fault injection for the reliability tests, switched on by one environment variable.

``BIGBATCH_FAULT="ACTION:step=S[,micro=M][,rank=R][,attempt=A][,factor=F]"`` triggers ACTION
during micro-step M (default 0) of optimizer step S (1-based) on rank R
(default: every rank), on restart attempt A of torchrun (default 0, the first;
``any`` for every attempt); several faults are separated by ``;``:

* ``kill``: SIGKILL this process (a crash in the middle of an accumulation window);
* ``sigterm``: send SIGTERM to this process (a polite stop request);
* ``nan``: make this micro-batch's loss NaN once (a transient fault: a re-run computes it finite);
* ``nan-input``: make this micro-batch's input embeddings NaN wherever it is computed again (bad data: a re-run
  reproduces it; the micro-batch is known by where its tokens come from);
* ``spike-input``: scale this micro-batch's summed loss (and so its gradient) by 30 wherever it is computed
  again (data that makes a spike, reproducibly);
* ``grad-scale``: multiply this micro-batch's gradient contribution by ``factor`` (default 1e4) wherever it is
  computed again, its loss left bit for bit as it was (a gradient-only spike: no loss shows it);
* ``inf-grad``: put an Inf in one parameter's gradient contribution of this micro-batch, once;
* ``bitflip``: flip one bit of one element of a parameter's gradient contribution (a device computing a wrong
  value without an error): without ``micro``, in every backward from step S on, re-runs included, at a different
  element each time (a faulty device); with ``micro``, once;
* ``bitflip-same``: as ``bitflip``, at the same element every time: a device that gives the same wrong value
  whenever it computes the same thing (one process cannot see it: its replay reproduces the wrong value);
* ``hang``: sleep for an hour (a dead peer, for collective timeouts); SIGTERM ends it at once, as it ends a
  process stuck inside a collective once its timeout returns control (so torchrun's agent need not wait out its
  grace period before SIGKILL).

Each fault says once, in a warning, where it fired (step, rank, micro-batch and the micro-batch's documents):
what the reliability benchmark checks a bad step's attribution against. Without the variable nothing is wrapped
and nothing changes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.hooks import StepHook

log = logging.getLogger(__name__)

ENV_VAR = "BIGBATCH_FAULT"
ACTIONS = (
    "kill",
    "sigterm",
    "nan",
    "nan-input",
    "spike-input",
    "grad-scale",
    "inf-grad",
    "bitflip",
    "bitflip-same",
    "hang",
)
BIT_FLIPS = ("bitflip", "bitflip-same")
INPUT_FAULTS = ("nan-input", "spike-input", "grad-scale")  # faults of the data: wherever it is computed again
SPIKE_SCALE = 30.0
GRAD_SCALE = 1e4
FLIPPED_BIT = 20  # a high mantissa bit of float32: the value moves by about 1/8 and stays finite


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    micro: int | None = 0  # None: every micro-batch (bitflip without micro)
    rank: int | None = None
    attempt: int | None = 0  # None: every attempt
    factor: float = GRAD_SCALE  # grad-scale: what the gradient is multiplied by


def parse_fault(text: str) -> Fault:
    action, _, spec = text.partition(":")
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}: unknown action {action!r}; choose one of {', '.join(ACTIONS)}")
    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    unknown = set(fields) - {"step", "micro", "rank", "attempt", "factor"}
    if unknown or "step" not in fields:
        raise ValueError(f"{ENV_VAR}: expected step=S[,micro=M][,rank=R][,attempt=A][,factor=F], got {spec!r}")
    return Fault(
        action=action,
        step=int(fields["step"]),
        micro=int(fields["micro"]) if "micro" in fields else (None if action in BIT_FLIPS else 0),
        rank=int(fields["rank"]) if "rank" in fields else None,
        attempt=None if fields.get("attempt") == "any" else int(fields.get("attempt", 0)),
        factor=float(fields.get("factor", GRAD_SCALE)),
    )


def _owner_of_first_trained(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The module holding the first trained parameter, and that parameter's name in it."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                return module, name
    return None


def faults_from_env() -> list[Fault]:
    text = os.environ.get(ENV_VAR, "")
    return [parse_fault(spec.strip()) for spec in text.split(";") if spec.strip()]


class FaultInjection(StepHook):
    """Fires ``fault`` at its step and micro-step on this rank (and restart attempt): a step hook, so evaluation
    passes never count as micro-steps. ``model`` is where the input and gradient faults attach (its first embedding
    and its first trained parameter)."""

    def __init__(self, fault: Fault, rank: int, model: nn.Module | None = None) -> None:
        self.fault = fault
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._step = 0
        self._index = -1
        self._fired = False  # once per process: a step skipped for the NaN it injected is not poisoned again
        self._poisoned: set[str] = set()  # nan-input: the micro-batches whose data is bad
        self._poison_now = False
        self._grad_armed = False
        self._flips = 0
        self._key = ""  # the documents of the micro-batch in the forward now
        self._announced = False
        if model is not None and fault.action == "nan-input":
            embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
            if embedding is not None:
                embedding.register_forward_hook(self._poison_output)
        self._hooked: torch.Tensor | None = None
        self._hook_handle: Any = None
        if model is not None and fault.action in ("inf-grad", *BIT_FLIPS):
            owner = _owner_of_first_trained(model)
            if owner is not None:
                module, name = owner
                module.register_forward_pre_hook(lambda m, args: self._hook_weight(getattr(m, name)))

    def before_step(self, engine: Any, step: int, k: int) -> None:
        self._step = step

    def _due(self, index: int) -> bool:
        fault = self.fault
        return (
            self._step == fault.step
            and fault.micro in (None, index)
            and fault.rank in (None, self.rank)
            and fault.attempt in (None, self.attempt)
        )

    def _announce(self, index: int) -> None:
        if not self._announced:
            self._announced = True
            log.warning(
                "fault %s fired: step %d, rank %d, micro-batch %d, documents %s",
                self.fault.action,
                self._step,
                self.rank,
                index,
                self._key or "unknown",
            )

    def before_forward(self, engine: Any, index: int, micro_batch: Any) -> None:
        action = self.fault.action
        key = self._key = getattr(micro_batch, "origin_key", "")
        if action in INPUT_FAULTS:
            if not self._fired and self._due(index):
                self._fired = True
                self._poisoned.add(key)
                self._announce(index)
            self._poison_now = key in self._poisoned
        elif action == "inf-grad":
            self._grad_armed = not self._fired and self._due(index)
        elif action in BIT_FLIPS:
            persistent = self.fault.micro is None and self._step >= self.fault.step
            self._grad_armed = (
                self.fault.rank in (None, self.rank) and persistent or (not self._fired and self._due(index))
            )
        if self._grad_armed:
            self._announce(index)

    def _hook_weight(self, weight: torch.Tensor) -> None:
        """The gradient hook on the tensor this forward uses: the parameter itself, or under FSDP2 the unsharded
        one it gathered (a hook on the sharded parameter never sees a micro-batch's gradient)."""
        if weight is not self._hooked:
            if self._hook_handle is not None:
                self._hook_handle.remove()
            self._hooked, self._hook_handle = weight, weight.register_hook(self._corrupt_grad)

    def _poison_output(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self._poison_now else None

    def _corrupt_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self._grad_armed:
            return None
        if self.fault.micro is not None:
            self._grad_armed = False
            self._fired = True
        grad = grad.clone()
        flat = grad.view(-1)
        element = 0 if self.fault.action == "bitflip-same" else self._flips % flat.numel()
        self._flips += 1
        if self.fault.action == "inf-grad":
            flat[element] = float("inf")
        else:
            bits = flat[element : element + 1].view(torch.int32)
            bits ^= 1 << FLIPPED_BIT
        return grad

    def after_forward(self, engine: Any, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        fault = self.fault
        poisoned = self._poison_now
        self._poison_now = False  # an evaluation's forward is never poisoned
        if poisoned and fault.action == "spike-input":
            return loss_sum * SPIKE_SCALE
        if poisoned and fault.action == "grad-scale":
            # the same value, bit for bit (x - x is exactly 0), whose gradient is ``factor`` times the loss's
            return loss_sum + (fault.factor - 1.0) * (loss_sum - loss_sum.detach())
        if fault.action not in ("kill", "sigterm", "hang", "nan") or self._fired or not self._due(index):
            return loss_sum
        self._fired = True
        self._announce(index)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.action == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)
        elif fault.action == "nan":
            return loss_sum * float("nan")
        return loss_sum
