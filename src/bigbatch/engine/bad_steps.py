"""Bad steps: what the engine found wrong with a step, which micro-batch it traces to, and the spike detector.

A step is bad when a micro-batch's summed loss or its gradient contribution is not finite (checked for each
micro-batch before the next one adds to the gradient), when the step's gradient norm is not finite, when its loss
or gradient norm is a spike against the recent steps, or when a replayed micro-batch's gradient differs from its
first computation (:mod:`bigbatch.engine.replay`). The engine's step (:mod:`bigbatch.engine.accumulate`) then
acts as ``--bad-step`` says:

* ``skip-micro`` (the default): the suspect micro-batches are dropped and the step is computed again from the same
  generators without them, normalized by the valid tokens that remain: the exact update of the step without those
  tokens. A rank left with none trains a micro-batch of no target instead (its gradient is exactly zero).
* ``skip-step``: no update; parameters, optimizer moments, step counters, schedule and the generators stay as
  they were, so the run goes on as one whose data never held the step's micro-batches.
* ``stop`` and ``rewind``: no update either; the trainer then ends the run, or goes back to the newest committed
  checkpoint and replays without the suspect micro-batches (their :attr:`Suspect.key`).

Everything here is torch-light: plain records, and the detector's window of recent steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

LOSS_NOT_FINITE = "non-finite loss"
GRAD_NOT_FINITE = "non-finite gradient"
REPLAY_MISMATCH = "replay mismatch"
LOSS_SPIKE = "loss spike"
GRAD_SPIKE = "gradient-norm spike"
CAUSES = (LOSS_NOT_FINITE, GRAD_NOT_FINITE, REPLAY_MISMATCH, LOSS_SPIKE, GRAD_SPIKE)
LEFT_OUT = "every micro-batch left out by a rewind"  # a step the exclusions emptied: not a fault of its own

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal sample, in standard deviations
# The least robust standard deviation a spike is measured in, as a share of the window's median. Step losses and
# gradient norms of small batches are heavy-tailed (a MAD-based sd underestimates their tails), so a threshold in
# robust sd alone flags ordinary steps of a long run; with these floors a spike is also a large step relative to
# the median (defaults: a loss 1.4x the median, a gradient norm 4x), which ordinary steps were never measured to
# reach (docs/benchmarks.md#bad-steps).
LOSS_SPREAD_FLOOR = 0.05
GRAD_SPREAD_FLOOR = 0.25


@dataclass(frozen=True)
class BadStepSettings:
    """How the engine watches steps and what it does with a bad one (``--bad-step`` and its companions)."""

    mode: str = "skip-micro"  # stop | skip-step | skip-micro | rewind
    replay_every: int = 0  # re-run one drawn micro-batch every N steps and compare its gradient bitwise; 0: never
    spike_window: int = 100  # applied steps the spike detector compares with
    loss_spike: float = 12.0  # robust z-score above the window's median that makes the step loss a spike; 0: off
    grad_spike: float = 40.0  # the same for the gradient norm; 0: off
    spike_min_steps: int = 20  # steps in the window before a spike can be flagged
    seed: int = 0  # the replay's draw of a micro-batch (never the training generators)


@dataclass(frozen=True)
class Suspect:
    """One micro-batch a bad step traces to."""

    rank: int
    micro: int  # its index among the rank's micro-batches of the step (as first read)
    cause: str
    key: str = ""  # MicroBatch.origin_key: what an exclusion names
    documents: str = ""  # where its tokens are: ``shard 0 @ 1,024, ...``
    verdict: str = ""  # data (a re-run reproduced it) | transient (it did not) | not replayed (why)
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "micro_batch": self.micro,
            "cause": self.cause,
            "documents": self.documents,
            "key": self.key,
            "verdict": self.verdict,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class BadStep:
    """A bad step: what was found, in which micro-batches, and what was done (``action``)."""

    step: int  # the optimizer step it was to be (1-based)
    cause: str
    suspects: tuple[Suspect, ...]
    action: str  # stopped | skipped step | skipped micro-batch | rewind
    loss: float
    grad_norm: float
    detail: str = ""  # e.g. the spike's threshold, or why a micro-batch could not be dropped

    def line(self) -> str:
        """One line: ``bad step 12: non-finite loss on rank 1, micro-batch 3 (documents shard 0 @ 4,096), data;
        skipped micro-batch``."""
        where = "; ".join(
            f"rank {s.rank}, micro-batch {s.micro} (documents {s.documents or 'unknown'}), "
            f"{s.verdict or 'not replayed'}" + (f" [{s.detail}]" if s.detail else "")
            for s in self.suspects
        )
        found = f"{self.cause} on {where}" if where else self.cause
        if not where and self.cause != LEFT_OUT:
            found += " (no micro-batch found)"
        extra = f" ({self.detail})" if self.detail else ""
        return f"bad step {self.step}: {found}{extra}: {self.action}"

    def record(self) -> dict[str, Any]:
        """The fields of its ``kind: bad_step`` line in ``metrics.jsonl``."""
        return {
            "step": self.step,
            "cause": self.cause,
            "action": self.action,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "detail": self.detail,
            "suspects": [s.as_dict() for s in self.suspects],
        }


def describe_origin(origin: tuple[tuple[int, int], ...], limit: int = 4) -> str:
    """``shard 0 @ 1,024, shard 0 @ 2,048 (+6 more)``: where a micro-batch's documents (or windows) start."""
    shown = ", ".join(f"shard {shard} @ {offset:,}" for shard, offset in origin[:limit])
    more = len(origin) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")


@dataclass
class SpikeDetector:
    """The step loss and gradient norm of the recent applied steps; a value above the window's median by more than
    ``threshold`` robust standard deviations (1.4826 x the median absolute deviation, at least a set share of the
    median) is a spike. Its window is part of the engine's state, so it judges the first step after a resume as it
    would have without one.

    A spike is a step unlike its neighbours. When ``patience`` steps in a row are flagged, each on other data, it is
    the run that has changed (a new level of loss or gradient norm), not one batch: the next flagged value is taken
    as it is and the window starts again (:attr:`restarted` says why, once)."""

    window: int = 100
    loss_threshold: float = 12.0
    grad_threshold: float = 40.0
    min_steps: int = 20
    patience: int = 3
    losses: deque[float] = field(default_factory=deque)
    grad_norms: deque[float] = field(default_factory=deque)
    flagged_in_a_row: int = 0
    restarted: str = ""

    def check(self, loss: float, grad_norm: float) -> tuple[str, str] | None:
        """``(cause, detail)`` when this step's loss or gradient norm is a spike, else ``None``."""
        spike = self._over(loss, grad_norm)
        if spike is None:
            self.flagged_in_a_row = 0
            return None
        self.flagged_in_a_row += 1
        if self.flagged_in_a_row <= self.patience:
            return spike
        self.restarted = (
            f"{spike[0]} for {self.flagged_in_a_row} steps in a row ({spike[1]}): taken as the run's new level, "
            "not a spike; the spike window starts again"
        )
        self.losses.clear()
        self.grad_norms.clear()
        self.flagged_in_a_row = 0
        return None

    def _over(self, loss: float, grad_norm: float) -> tuple[str, str] | None:
        if len(self.losses) < self.min_steps:
            return None
        for cause, value, history, threshold, floor in (
            (LOSS_SPIKE, loss, self.losses, self.loss_threshold, LOSS_SPREAD_FLOOR),
            (GRAD_SPIKE, grad_norm, self.grad_norms, self.grad_threshold, GRAD_SPREAD_FLOOR),
        ):
            if threshold <= 0:
                continue
            limit = spike_limit(list(history), threshold, floor)
            if value > limit:
                return cause, f"{value:.4g} above {limit:.4g}: median + {threshold:g} robust sd of {len(history)} steps"
        return None

    def observe(self, loss: float, grad_norm: float) -> None:
        """An applied step's values join the window."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return
        for history, value in ((self.losses, loss), (self.grad_norms, grad_norm)):
            history.append(value)
            while len(history) > self.window:
                history.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "in_a_row": self.flagged_in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(float(x) for x in state.get("losses", []))
        self.grad_norms = deque(float(x) for x in state.get("grad_norms", []))
        self.flagged_in_a_row = int(state.get("in_a_row", 0))
        for history in (self.losses, self.grad_norms):
            while len(history) > self.window:
                history.popleft()


def spike_limit(history: list[float], threshold: float, floor: float) -> float:
    """``median + threshold x sd`` of ``history``, where the robust sd is ``1.4826 x MAD`` but at least ``floor``
    of the median, so a quiet window does not make every ordinary wiggle a spike."""
    ordered = sorted(history)
    median = _median(ordered)
    mad = _median(sorted(abs(x - median) for x in ordered))
    spread = max(MAD_TO_SIGMA * mad, floor * abs(median), 1e-12)
    return median + threshold * spread


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    middle = n // 2
    return ordered[middle] if n % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])
