"""The ``[guard]`` section: how a run watches its steps and what it does with a bad one (see
:mod:`bigbatch.engine.bad_steps`)."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field
from bigbatch.settings.choices import BAD_STEP
from bigbatch.settings.ranges import NON_NEGATIVE, POSITIVE_INT, POSITIVE_INT_OR_OFF, Range

SPIKE_WINDOW = Range(int, 2)


@dataclass
class GuardSection:
    bad_step: str = config_field(
        "skip-micro",
        "what a bad step (a non-finite loss or gradient in a micro-batch, a spike, a replay that differs) does: "
        "skip-micro drops the micro-batch it traces to and computes the step again without it (the exact update "
        "of the remaining tokens); skip-step applies no update; rewind goes back to the newest checkpoint and "
        "replays without that micro-batch; stop ends the run with an error",
        choices=BAD_STEP,
    )
    max_rewinds: int = config_field(
        3, "with --bad-step rewind: rewinds allowed over the run; one more bad step then stops it", range=POSITIVE_INT
    )
    replay_every: int = config_field(
        0,
        "every N steps re-run one drawn micro-batch, on its rank and (several processes) on the next, and compare "
        "its gradient with the first computation bit for bit; a value computed wrongly once is a bad step, a device "
        "that computes wrongly stops the run (one process cannot see a device that repeats the same wrong value); "
        "off (0 in a config file): never",
        range=POSITIVE_INT_OR_OFF,
    )
    spike_window: int = config_field(
        100,
        "recent applied steps the spike detector compares a step's loss and gradient norm, and each micro-batch's "
        "own, with",
        range=SPIKE_WINDOW,
    )
    loss_spike: float = config_field(
        12.0,
        "a step loss, or a micro-batch's own loss per token, above its window's median by more than this many "
        "robust standard deviations (1.4826 x the median absolute deviation, at least 0.05 x the median) is a bad "
        "step (12: no false alarm in 4,000 measured quiet steps, every probed micro-batch of garbled text caught); "
        "0: off",
        range=NON_NEGATIVE,
    )
    grad_spike: float = config_field(
        40.0,
        "the same for the gradient norm before clipping, and a micro-batch's own gradient norm per token (its "
        "robust sd at least 0.25 x the median); 0: off",
        range=NON_NEGATIVE,
    )
