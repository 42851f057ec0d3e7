"""Fault injection for the reliability tests, switched on by one environment variable.

``BIGBATCH_FAULT="ACTION:step=S[,micro=M][,rank=R][,attempt=A]"`` triggers ACTION
during micro-step M (default 0) of optimizer step S (1-based) on rank R
(default: every rank), on restart attempt A of torchrun (default 0, the first;
``any`` for every attempt):

* ``kill``: SIGKILL this process (a crash in the middle of an accumulation window);
* ``sigterm``: send SIGTERM to this process (a polite stop request);
* ``nan``: make this micro-batch's loss NaN (a non-finite gradient on one rank);
* ``hang``: sleep for an hour (a dead peer, for collective timeouts); SIGTERM ends it at once, as it ends a
  process stuck inside a collective once its timeout returns control (so torchrun's agent need not wait out its
  grace period before SIGKILL).

Without the variable nothing is wrapped and nothing changes.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.engine.hooks import StepHook

ENV_VAR = "BIGBATCH_FAULT"
ACTIONS = ("kill", "sigterm", "nan", "hang")


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    micro: int = 0
    rank: int | None = None
    attempt: int | None = 0  # None: every attempt


def parse_fault(text: str) -> Fault:
    action, _, spec = text.partition(":")
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}: unknown action {action!r}; choose one of {', '.join(ACTIONS)}")
    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    unknown = set(fields) - {"step", "micro", "rank", "attempt"}
    if unknown or "step" not in fields:
        raise ValueError(f"{ENV_VAR}: expected step=S[,micro=M][,rank=R][,attempt=A], got {spec!r}")
    return Fault(
        action=action,
        step=int(fields["step"]),
        micro=int(fields.get("micro", 0)),
        rank=int(fields["rank"]) if "rank" in fields else None,
        attempt=None if fields.get("attempt") == "any" else int(fields.get("attempt", 0)),
    )


def fault_from_env() -> Fault | None:
    text = os.environ.get(ENV_VAR)
    return parse_fault(text) if text else None


class FaultInjection(StepHook):
    """Fires ``fault`` once, at its step and micro-step on this rank (and restart attempt): a step hook, so
    evaluation passes never count as micro-steps."""

    def __init__(self, fault: Fault, rank: int) -> None:
        self.fault = fault
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._step = 0
        self._fired = False  # once per process: a step skipped for the NaN it injected is not poisoned again

    def before_step(self, engine: Any, step: int, k: int) -> None:
        self._step = step

    def after_forward(self, engine: Any, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        fault = self.fault
        hit = (
            not self._fired
            and self._step == fault.step
            and index == fault.micro
            and fault.rank in (None, self.rank)
            and fault.attempt in (None, self.attempt)
        )
        if not hit:
            return loss_sum
        self._fired = True
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
