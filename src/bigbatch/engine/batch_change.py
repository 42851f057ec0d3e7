"""When the tokens per step change, the optimizer follows: one rule for the learning rate, AdamW's betas and the
weight decay, as pure arithmetic (torch-free: the command line and the critical-batch branches use it too).

A run's hyperparameters are given for its *reference* tokens per step ``B0`` (``total_batch_tokens`` of the run as
it started). A step of ``B`` tokens (a ramp's, a Seesaw doubling's, a branch's, a resume's new size) has
``r = B / B0`` and trains with::

    lr     = schedule(step) x f(r)      f = 1 (none), sqrt(r) (sqrt), r (linear)
    beta2  = beta2 ** r                 the moving average's half-life stays the same number of tokens
    beta1  = beta1 ** r                 (only with --batch-change-betas both)
    mu     = mu ** r                    Muon's momentum (--optimizer muon; unless --batch-change-momentum keep)
    wd     = wd x r / f(r)              (only with --batch-change-weight-decay timescale: B / (lr x wd) stays)

An EMA with factor ``beta`` per step forgets half of what it holds in ``ln(1/2) / ln(beta)`` steps; a step ``r``
times as large holds ``r`` times the tokens, so ``beta ** r`` keeps the half-life in tokens (Marek et al., 2025).
AdamW's decoupled weight decay shrinks the weights by ``lr x wd`` per step, a timescale of ``B / (lr x wd)``
tokens (Bergsma et al., 2025, "Power Lines"), which the timescale rule keeps. Each is a pure function of the step's
size, so a resumed run sets the same values as one that never stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bigbatch.errors import ConfigError

RULES = ("none", "sqrt", "linear")
BETAS = ("none", "beta2", "both")
MOMENTUM = ("keep", "tokens")
WEIGHT_DECAY = ("keep", "timescale")
AUTO = "auto"


@dataclass(frozen=True)
class OptimSettings:
    """The hyperparameters one step trains with."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    momentum: float | None = None  # Muon's momentum (None: the run has no Muon group)
    muon_lr: float | None = None  # Muon's learning rate (moved by the rule as lr is)
    muon_weight_decay: float | None = None  # Muon's weight decay (moved by the rule as weight_decay is)

    def describe(self) -> str:
        muon = "" if self.momentum is None else f", Muon momentum {self.momentum:.5g}"
        if self.muon_lr is not None:
            muon += f", Muon lr {self.muon_lr:.3e}, Muon weight decay {self.muon_weight_decay or 0.0:.4g}"
        return (
            f"lr {self.lr:.3e}, beta1 {self.beta1:.4g}, beta2 {self.beta2:.5g}, weight decay {self.weight_decay:.4g}"
            + muon
        )


@dataclass(frozen=True)
class BatchChangeRule:
    """How the optimizer follows a change of the tokens per step by a factor ``r`` (see the module's doc)."""

    rule: str = "sqrt"  # the learning rate: none, sqrt or linear
    betas: str = "beta2"  # which betas keep their half-life in tokens: none, beta2 or both
    weight_decay: str = "keep"  # keep, or timescale (B / (lr x wd) fixed)
    momentum: str = ""  # Muon's: tokens (half-life in tokens kept) or keep; "": keep with rule none, else tokens

    def __post_init__(self) -> None:
        if not self.momentum:  # as resolve's auto: a rule that changes nothing leaves the momentum too
            object.__setattr__(self, "momentum", "keep" if self.rule == "none" else "tokens")
        for name, value, allowed in (
            ("--batch-change-rule", self.rule, RULES),
            ("--batch-change-betas", self.betas, BETAS),
            ("--batch-change-weight-decay", self.weight_decay, WEIGHT_DECAY),
            ("--batch-change-momentum", self.momentum, MOMENTUM),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")

    @classmethod
    def resolve(cls, rule: str, betas: str = AUTO, weight_decay: str = "keep", momentum: str = AUTO) -> BatchChangeRule:
        """The rule the settings ask for: ``auto`` is ``sqrt``; betas ``auto`` is ``beta2``, or ``none`` with the
        rule ``none`` (which then changes nothing, as bigbatch did before the rule); momentum ``auto`` is
        ``tokens``, or ``keep`` with the rule ``none``."""
        rule = "sqrt" if rule == AUTO else rule
        if betas == AUTO:
            betas = "none" if rule == "none" else "beta2"
        return cls(rule, betas, weight_decay, "" if momentum == AUTO else momentum)  # "": the default's choice

    @property
    def changes_anything(self) -> bool:
        return self.rule != "none" or self.betas != "none" or self.weight_decay != "keep" or self.momentum != "keep"

    def lr_factor(self, ratio: float) -> float:
        if self.rule == "sqrt":
            return math.sqrt(ratio)
        if self.rule == "linear":
            return ratio
        return 1.0

    def weight_decay_factor(self, ratio: float) -> float:
        """What every weight decay is multiplied by at ``ratio`` times the reference tokens per step: ``r / f(r)``
        with ``timescale`` (``B / (lr x wd)`` kept), else 1."""
        return ratio / self.lr_factor(ratio) if self.weight_decay == "timescale" else 1.0

    def follow(self, base: OptimSettings, ratio: float) -> OptimSettings:
        """``base`` (the settings at the reference size) at ``ratio`` times the reference tokens per step."""
        if not (ratio > 0 and math.isfinite(ratio)):
            raise ValueError(f"a batch change needs a positive finite ratio, got {ratio}")
        factor = self.lr_factor(ratio)
        beta2 = base.beta2**ratio if self.betas in ("beta2", "both") else base.beta2
        beta1 = base.beta1**ratio if self.betas == "both" else base.beta1
        weight_decay = base.weight_decay * self.weight_decay_factor(ratio)
        momentum = base.momentum
        if momentum is not None and self.momentum == "tokens":
            momentum = momentum**ratio
        muon_lr = None if base.muon_lr is None else base.muon_lr * factor
        muon_decay = base.muon_weight_decay
        if muon_decay is not None:
            muon_decay *= self.weight_decay_factor(ratio)
        return OptimSettings(base.lr * factor, beta1, beta2, weight_decay, momentum, muon_lr, muon_decay)

    def describe(self, muon: bool = False) -> str:
        """E.g. ``sqrt: lr x sqrt(B/B0), beta2 ** (B/B0)`` (``muon``: the run has a Muon group, whose momentum
        the rule may move too)."""
        parts = {"none": "lr kept", "sqrt": "lr x sqrt(B/B0)", "linear": "lr x B/B0"}[self.rule]
        if self.betas == "beta2":
            parts += ", beta2 ** (B/B0)"
        elif self.betas == "both":
            parts += ", beta1 and beta2 ** (B/B0)"
        if self.weight_decay == "timescale":
            parts += ", weight decay keeping B/(lr x wd)"
        if muon and self.momentum == "tokens":
            parts += ", Muon momentum ** (B/B0)"
        return f"{self.rule}: {parts}"

    def label(self) -> str:
        """A short name for directories: ``sqrt-beta2``, ``none``, ``linear-both-timescale``."""
        words = [self.rule] + ([self.betas] if self.betas != "none" else [])
        words += ["timescale"] if self.weight_decay == "timescale" else []
        if self.momentum != ("keep" if self.rule == "none" else "tokens"):  # not what auto gives: named
            words.append(f"momentum-{self.momentum}")
        return "-".join(words)


@dataclass(frozen=True)
class BatchChange:
    """A change of the tokens per step between two steps, and what the optimizer does about it."""

    step: int  # the first step at the new size
    tokens_seen: int  # before that step
    tokens_before: int
    tokens_after: int
    before: OptimSettings
    after: OptimSettings
    cause: str  # ramp, seesaw, resume, ...

    def line(self) -> str:
        """E.g. ``batch change at step 3 (batch ramp, 4,096 tokens seen): 2,048 -> 2,560 tokens/step (x1.25) | lr
        1.000e-03 -> 1.118e-03 | beta1 0.9 | beta2 0.98726 -> 0.9841 | weight decay 0.1`` (one value: unchanged)."""
        ratio = self.tokens_after / self.tokens_before
        b, a = self.before, self.after
        return (
            f"batch change at step {self.step:,} ({self.cause}, {self.tokens_seen:,} tokens seen): "
            f"{self.tokens_before:,} -> {self.tokens_after:,} tokens/step (x{ratio:.3g}) | "
            + " | ".join(
                f"{name} {_moved(getattr(b, key), getattr(a, key), spec)}"
                for name, key, spec in (
                    ("lr", "lr", ".3e"),
                    ("beta1", "beta1", ".5g"),
                    ("beta2", "beta2", ".5g"),
                    ("weight decay", "weight_decay", ".4g"),
                    ("Muon lr", "muon_lr", ".3e"),
                    ("Muon momentum", "momentum", ".5g"),
                    ("Muon weight decay", "muon_weight_decay", ".4g"),
                )
                if getattr(b, key) is not None
            )
        )

    def record(self) -> dict[str, Any]:
        """The ``kind: batch_change`` record of ``metrics.jsonl``."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "cause": self.cause,
            "tokens_per_step_before": self.tokens_before,
            "tokens_per_step_after": self.tokens_after,
            **{f"{name}_before": value for name, value in vars(self.before).items() if value is not None},
            **{f"{name}_after": value for name, value in vars(self.after).items() if value is not None},
        }


def _moved(before: float, after: float, spec: str) -> str:
    return f"{before:{spec}}" if before == after else f"{before:{spec}} -> {after:{spec}}"


class BatchFollower:
    """The optimizer's settings at any tokens per step of one run: the configured ones (``base``, the learning
    rate left to the schedule) hold at ``reference_tokens``; :meth:`settings` scales them by the rule.

    Its state is the reference (a resume with a new ``--total-batch-tokens`` keeps the run's first one, so the rule
    scales from where the hyperparameters were chosen) and the size of the last step trained (so that a change
    is seen across a restart)."""

    def __init__(self, rule: BatchChangeRule, base: OptimSettings, reference_tokens: int, requested: str = "") -> None:
        self.rule, self.base = rule, base
        self.reference_tokens = reference_tokens
        self.last_tokens: int | None = None  # tokens per step of the last step trained (None: none yet)
        self.requested = requested  # the rule as asked (auto, none, sqrt, linear)

    def settings(self, lr: float, tokens_per_step: int) -> OptimSettings:
        """The settings of a step of ``tokens_per_step`` whose schedule gives ``lr`` (at the reference size)."""
        muon_lr = None if self.base.muon_lr is None else self.base.muon_lr * lr / self.base.lr  # the same schedule
        b = self.base
        base = OptimSettings(lr, b.beta1, b.beta2, b.weight_decay, b.momentum, muon_lr, b.muon_weight_decay)
        if tokens_per_step == self.reference_tokens:
            return base
        return self.rule.follow(base, tokens_per_step / self.reference_tokens)

    def weight_decay_factor(self, tokens_per_step: int) -> float:
        """What every param group's configured weight decay is multiplied by at this size (AdamW's and Muon's
        alike, whichever is zero)."""
        return self.rule.weight_decay_factor(tokens_per_step / self.reference_tokens)

    def change(self, step: int, tokens_seen: int, lr: float, tokens_per_step: int, cause: str) -> BatchChange | None:
        """The change a step of ``tokens_per_step`` makes after the last one trained, or ``None``; a fresh run's first
        step is compared with the reference."""
        before = self.reference_tokens if self.last_tokens is None else self.last_tokens
        if tokens_per_step == before:
            return None
        return BatchChange(
            step,
            tokens_seen,
            before,
            tokens_per_step,
            self.settings(lr, before),
            self.settings(lr, tokens_per_step),
            cause,
        )

    def state_dict(self) -> dict[str, Any]:
        """The reference and the last size (the rule itself is the run's settings, saved in its config)."""
        return {"reference_tokens": self.reference_tokens, "last_tokens": self.last_tokens}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The run's reference and last size. A checkpoint from before the rule trained every size with the same
        settings: unless a rule was asked for by name, it goes on doing so."""
        if not state:
            if self.requested == AUTO:
                self.rule = BatchChangeRule("none", "none", "keep", "keep")
            return
        self.reference_tokens = int(state.get("reference_tokens") or self.reference_tokens)
        last = state.get("last_tokens")
        self.last_tokens = int(last) if last else None
