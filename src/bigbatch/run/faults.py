"""Fault injection for the reliability tests, switched on by one environment variable.

``BIGBATCH_FAULT="ACTION:step=S[,micro=M][,rank=R][,attempt=A]"`` triggers ACTION
during micro-step M (default 0) of optimizer step S (1-based) on rank R
(default: every rank), on restart attempt A of torchrun (default 0, the first;
``any`` for every attempt):

* ``kill``: SIGKILL this process (a crash in the middle of an accumulation window);
* ``sigterm``: send SIGTERM to this process (a polite stop request);
* ``nan``: make this micro-batch's loss NaN (a non-finite gradient on one rank);
* ``hang``: sleep for an hour (a dead peer, for collective timeouts).

Without the variable nothing is wrapped and nothing changes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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


def with_fault(
    loss_fn: Callable[[Any, Any], torch.Tensor], fault: Fault, rank: int, current_step: Callable[[], int]
) -> Callable[[Any, Any], torch.Tensor]:
    """Wrap ``loss_fn`` so that ``fault`` fires at its step and micro-step on this rank."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    calls = {"step": -1, "micro": 0}

    def faulty(model: Any, batch: Any) -> torch.Tensor:
        loss = loss_fn(model, batch)
        if not model.training:
            return loss  # evaluation passes do not count as micro-steps
        step = current_step()
        calls["micro"] = calls["micro"] + 1 if calls["step"] == step else 0
        calls["step"] = step
        hit = (
            step == fault.step
            and calls["micro"] == fault.micro
            and fault.rank in (None, rank)
            and fault.attempt in (None, attempt)
        )
        if hit:
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif fault.action == "hang":
                time.sleep(3600)
            elif fault.action == "nan":
                loss = loss * float("nan")
        return loss

    return faulty
