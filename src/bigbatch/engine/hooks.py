"""Step hooks: what attaches to the engine's step without being part of it.

The engine's step is zero, K x (forward, backward), clip, optimizer step. A measurement that reads gradients
on their way (the gradient noise scale), or a fault injected for the reliability tests, attaches at four
points of that loop through a :class:`StepHook`, in the order the engine was given the hooks:

* :meth:`StepHook.before_step`: before the gradients are zeroed, with the step's number and its K;
* :meth:`StepHook.before_forward`: each micro-batch (on the device), before its forward (and before a replay's);
* :meth:`StepHook.after_forward`: each micro-batch's summed loss, before its backward (a hook may return a
  different loss to back-propagate: fault injection poisons one);
* :meth:`StepHook.after_backward`: each micro-batch, after its backward (its gradient has been added);
* :meth:`StepHook.after_step`: once the step is applied or skipped; what it returns (not ``None``) is attached
  to the step's record under the hook's ``name``, and the fields of its ``as_dict()`` go into the step's line
  of ``metrics.jsonl`` (and so TensorBoard and W&B).

A hook with a non-empty ``name`` and state saves it through ``state_dict`` / ``load_state_dict``; the engine
keeps it in its own state under that name, so a resumed run continues the hook where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bigbatch.engine.accumulate import AccumulationEngine


@dataclass(frozen=True)
class StepOutcome:
    """What a step did, for :meth:`StepHook.after_step`."""

    step: int  # the step's number, 1-based (the engine's step count once applied)
    grad_norm: float  # global norm before clipping
    n_valid: int  # valid target tokens in the global step
    skipped: bool  # non-finite gradient: nothing was applied


class StepHook:
    """No-op base: a hook overrides the points it needs (see the module docstring)."""

    name: str = ""  # the key of its measurement in a StepRecord and of its state in the engine's state

    def before_step(self, engine: AccumulationEngine, step: int, k: int) -> None:
        """Before step number ``step`` (1-based) of ``k`` micro-batches on this rank."""

    def before_forward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        """Before the forward of micro-batch ``index`` (0-based), the first time and in any re-run of it."""

    def after_forward(self, engine: AccumulationEngine, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """The summed loss of micro-batch ``index`` (0-based), before its backward; returns the loss to use."""
        return loss_sum

    def after_backward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        """After the backward of micro-batch ``index`` (on the device)."""

    def after_step(self, engine: AccumulationEngine, outcome: StepOutcome) -> Any:
        """After the optimizer step (or its skip); a value other than ``None`` goes into the step's record (its
        ``as_dict()`` fields into ``metrics.jsonl``)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
