"""Bad steps: what the engine found wrong with a step, which micro-batch it traces to, and the spike detector.

A step is bad when a micro-batch's summed loss or its gradient contribution is not finite (measured for each
micro-batch on its way into the gradient), when the step's gradient norm is not finite, when its loss or gradient
norm, or a micro-batch's own loss per token or gradient norm per token, is a spike against the recent steps, or
when a replayed micro-batch's gradient differs from its first computation (:mod:`bigbatch.engine.replay`). Every
micro-batch found so is a suspect, and so is every micro-batch holding a part of a bad document a suspect holds
(:mod:`bigbatch.engine.bad_documents`). The engine's step (:mod:`bigbatch.engine.accumulate`) then acts as
``--bad-step`` says:

* ``skip-micro`` (the default): the suspect micro-batches are dropped and the step is computed again from the same
  generators without them, normalized by the valid tokens that remain: the exact update of the step without those
  tokens. A rank left with none trains a micro-batch of no target instead (its gradient is exactly zero).
* ``skip-step``: no update; parameters, optimizer moments, step counters, schedule and the generators stay as
  they were, so the run goes on as one whose data never held the step's micro-batches.
* ``stop`` and ``rewind``: no update either; the trainer then ends the run, or goes back to the newest committed
  checkpoint and replays without the suspect micro-batches (their :attr:`Suspect.key`) and every part of their bad
  documents (:attr:`Suspect.bad_documents`).

No mode moves fp16's loss scale for a bad step: only GradScaler's own overflow does.

Everything here is torch-light: plain records, and the detector's window of recent steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
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
# robust sd alone flags ordinary steps of a long run; with these floors a spike is also a large value relative to
# the median (at the defaults a loss 1.6x the median, a gradient norm 11x), which ordinary steps and micro-batches
# were never measured to reach (docs/benchmarks.md#bad-steps).
LOSS_SPREAD_FLOOR = 0.05
GRAD_SPREAD_FLOOR = 0.25


@dataclass(frozen=True)
class BadStepSettings:
    """How the engine watches steps and what it does with a bad one (``--bad-step`` and its companions)."""

    mode: str = "skip-micro"  # stop | skip-step | skip-micro | rewind
    replay_every: int = 0  # re-run one drawn micro-batch every N steps and compare its gradient bitwise; 0: never
    spike_window: int = 100  # applied steps the spike detector compares with
    # Robust z-scores above the window's median that make a spike, of the step's loss and of a micro-batch's own
    # loss per token; 0: off. Chosen from benchmarks/bad_steps.py --only detector (docs/benchmarks.md#bad-steps):
    # 4,000 quiet steps reached 3.4 (steps) and 7.6 (micro-batches), and at 12 every probe of garbled text (4x the
    # loss) was caught at every share of a step, by the micro-batches' own values.
    loss_spike: float = 12.0
    grad_spike: float = 40.0  # the same for the gradient norm, and a micro-batch's own gradient norm per token
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
    bad_documents: tuple[str, ...] = ()  # DocumentPart.key of each bad document it holds a part of (followed)
    elsewhere: str = ""  # where those documents' other parts are: this step's other micro-batches, other steps

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "micro_batch": self.micro,
            "cause": self.cause,
            "documents": self.documents,
            "key": self.key,
            "verdict": self.verdict,
            "detail": self.detail,
            "bad_documents": list(self.bad_documents),
            "elsewhere": self.elsewhere,
        }

    def said(self) -> str:
        """``rank 1, micro-batch 3 (documents shard 0 @ 4,096), data [why]``: this suspect in a bad step's line."""
        text = f"rank {self.rank}, micro-batch {self.micro} (documents {self.documents or 'unknown'}), "
        text += self.verdict or "not replayed"
        notes = [note for note in (self.detail, self.elsewhere) if note]
        return text + (f" [{'; '.join(notes)}]" if notes else "")


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
        where = "; ".join(s.said() for s in self.suspects)
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


MicroValues = Sequence[tuple[float, float]]
"""Each micro-batch's own values in a step: its loss per valid target and the norm of the gradient of that mean
(its contribution's norm, the step's normalization and the loss scale taken out); ``nan`` for one without targets."""


@dataclass(frozen=True)
class SpikeLimits:
    """The values above which a step, or one micro-batch by its own values, is a spike (``inf``: that check off)."""

    loss: float
    grad_norm: float
    micro_loss: float
    micro_grad_norm: float
    steps: int  # steps in the window they come from
    micro_batches: int  # micro-batches in it


@dataclass
class SpikeDetector:
    """The step loss and gradient norm of the recent applied steps, and each applied micro-batch's own loss per
    token and gradient norm; a value above its window's median by more than ``threshold`` robust standard deviations
    (1.4826 x the median absolute deviation, at least a set share of the median) is a spike. A micro-batch is judged
    by its own values, which do not depend on the other micro-batches of its step: one bad micro-batch among many
    shows there even where it moves the step's values little, and leaving one out cannot make the rest look worse
    (a step over fewer tokens has a larger gradient norm; its micro-batches' own norms do not change). The windows
    are part of the engine's state, so the first step after a resume is judged as it would have been without one.

    A spike is a step unlike its neighbours. When ``patience`` steps in a row are flagged, each on other data, it is
    the run that has changed (a new level of loss or gradient norm), not one batch: the next flagged value is taken
    as it is and the windows start again (:attr:`restarted` says why, once)."""

    window: int = 100
    loss_threshold: float = 12.0
    grad_threshold: float = 40.0
    min_steps: int = 20
    patience: int = 3
    losses: deque[float] = field(default_factory=deque)
    grad_norms: deque[float] = field(default_factory=deque)
    micro_losses: deque[list[float]] = field(default_factory=deque)  # per applied step, its micro-batches'
    micro_norms: deque[list[float]] = field(default_factory=deque)
    flagged_in_a_row: int = 0
    restarted: str = ""
    _limits: SpikeLimits | None = field(default=None, repr=False)  # of the windows as they are now

    def check(self, loss: float, grad_norm: float, micro: MicroValues = ()) -> tuple[str, str] | None:
        """``(cause, detail)`` when this step's loss or gradient norm, or a micro-batch's own, is a spike, else
        ``None`` (call it once a step). Only the step's own values count towards a new level: a run that has moved
        moves every micro-batch, not one of them."""
        spike = self._over(loss, grad_norm)
        if spike is None:
            self.flagged_in_a_row = 0
            over = self.over_micro(micro)
            return (over[0][1], f"micro-batch {over[0][0]}: {over[0][2]}") if over else None
        self.flagged_in_a_row += 1
        if self.flagged_in_a_row <= self.patience:
            return spike
        self.restarted = (
            f"{spike[0]} for {self.flagged_in_a_row} steps in a row ({spike[1]}): taken as the run's new level, "
            "not a spike; the spike window starts again"
        )
        self._clear()
        self.flagged_in_a_row = 0
        return None

    def limits(self) -> SpikeLimits | None:
        """The limits of the windows as they are (computed once between two observed steps); ``None`` before the
        window holds ``min_steps`` steps."""
        if len(self.losses) < self.min_steps:
            return None
        if self._limits is None:
            enough = len(self.micro_losses) >= self.min_steps  # a window of micro-batches fills after a resume
            micro_losses = [x for values in self.micro_losses for x in values] if enough else []
            micro_norms = [x for values in self.micro_norms for x in values] if enough else []
            self._limits = SpikeLimits(
                loss=_limit(list(self.losses), self.loss_threshold, LOSS_SPREAD_FLOOR),
                grad_norm=_limit(list(self.grad_norms), self.grad_threshold, GRAD_SPREAD_FLOOR),
                micro_loss=_limit(micro_losses, self.loss_threshold, LOSS_SPREAD_FLOOR),
                micro_grad_norm=_limit(micro_norms, self.grad_threshold, GRAD_SPREAD_FLOOR),
                steps=len(self.losses),
                micro_batches=len(micro_losses),
            )
        return self._limits

    def over_micro(self, micro: MicroValues) -> list[tuple[int, str, str]]:
        """``(index, cause, detail)`` of each micro-batch whose own loss per token or gradient norm is a spike."""
        limits = self.limits()
        if limits is None:
            return []
        found = []
        for index, (loss, norm) in enumerate(micro):
            for cause, value, limit, threshold, what in (
                (LOSS_SPIKE, loss, limits.micro_loss, self.loss_threshold, "loss per token"),
                (GRAD_SPIKE, norm, limits.micro_grad_norm, self.grad_threshold, "own gradient norm"),
            ):
                if math.isfinite(value) and value > limit:  # not finite: a bad step of its own kind, or fp16's overflow
                    detail = (
                        f"its {what} {value:.4g} above {limit:.4g}: median + {threshold:g} robust sd of "
                        f"{limits.micro_batches} micro-batches"
                    )
                    found.append((index, cause, detail))
                    break
        return found

    def _over(self, loss: float, grad_norm: float) -> tuple[str, str] | None:
        limits = self.limits()
        if limits is None:
            return None
        for cause, value, limit, threshold in (
            (LOSS_SPIKE, loss, limits.loss, self.loss_threshold),
            (GRAD_SPIKE, grad_norm, limits.grad_norm, self.grad_threshold),
        ):
            if value > limit:
                return cause, f"{value:.4g} above {limit:.4g}: median + {threshold:g} robust sd of {limits.steps} steps"
        return None

    def observe(self, loss: float, grad_norm: float, micro: MicroValues = ()) -> None:
        """An applied step's values, and its applied micro-batches' own, join the windows."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return
        self._limits = None
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.micro_losses.append([x for x, _ in micro if math.isfinite(x)])
        self.micro_norms.append([g for _, g in micro if math.isfinite(g)])
        self._trim()

    def _trim(self) -> None:
        for history in (self.losses, self.grad_norms, self.micro_losses, self.micro_norms):
            while len(history) > self.window:
                history.popleft()

    def _clear(self) -> None:
        for history in (self.losses, self.grad_norms, self.micro_losses, self.micro_norms):
            history.clear()
        self._limits = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "micro_losses": list(self.micro_losses),
            "micro_norms": list(self.micro_norms),
            "in_a_row": self.flagged_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's windows (one written before micro-batches were judged has none of theirs: they fill
        from the next step, and judge nothing until they hold ``min_steps`` steps)."""
        self.losses = deque(float(x) for x in state.get("losses", []))
        self.grad_norms = deque(float(x) for x in state.get("grad_norms", []))
        self.micro_losses = deque([float(x) for x in values] for values in state.get("micro_losses", []))
        self.micro_norms = deque([float(x) for x in values] for values in state.get("micro_norms", []))
        self.flagged_in_a_row = int(state.get("in_a_row", 0))
        self._limits = None
        self._trim()


def _limit(history: list[float], threshold: float, floor: float) -> float:
    """:func:`spike_limit`, or ``inf`` where the check is off (threshold 0) or there is nothing to judge by."""
    return spike_limit(history, threshold, floor) if threshold > 0 and history else math.inf


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
