"""The lines a training run ends with: steps, tokens, throughput and MFU, final and validation loss; where a
documents run's positions went; the measured critical batch against the run's tokens per step."""

from __future__ import annotations

from collections.abc import Callable

from bigbatch.engine.accumulate import StepRecord
from bigbatch.engine.router_balance import RouterMeasurement
from bigbatch.observe.metrics import Throughput, format_noise_scale
from bigbatch.parallel.distributed import Say
from bigbatch.progress import plural
from bigbatch.run.build import RunParts
from bigbatch.run.checkpoints.state import TrainState
from bigbatch.run.loop.tally import LoopTally

Mfu = Callable[[float], float | None]
"""Model FLOPs utilization at a tokens-per-second rate, when the devices' peak is known."""


def critical_batch_line(estimate: float, measurements: int, how: str, tokens_per_step: int) -> str:
    """The end-of-run line on the measured critical batch (the smoothed noise scale ``estimate``, in tokens),
    against the run's tokens per step (``how``: ``used`` or ``ended at``); while the estimate is not positive (or
    NaN), it says there is none yet."""
    used = f"this run {how} {tokens_per_step:,} tokens per step"
    if estimate > 0:
        return f"measured critical batch about {format_noise_scale(estimate)} tokens; {used}"
    return (
        f"critical batch: no estimate yet (the smoothed noise scale is not positive after "
        f"{plural(measurements, 'measurement')}: the gradient noise still drowns the signal; train longer); {used}"
    )


def describe_throughput(throughput: Throughput | None, mfu: Mfu) -> str:
    """`` | tok/s 4,331 (tokens / time of steps 2..120) | mfu 3.1% (at that tok/s)``: MFU from the same ratio
    of totals; nothing when no step applied an update."""
    if throughput is None:
        return ""
    text = f" | {throughput.describe()}"
    value = mfu(throughput.tokens_per_s)
    return text + (f" | mfu {value:.1%} (at that tok/s)" if value is not None else "")


def say_summary(
    parts: RunParts, state: TrainState, seen: LoopTally, mfu: Mfu, say: Say, bad_steps: str | None = None
) -> None:
    """The end-of-run lines, after at least one step (``bad_steps``: what the run did with bad steps)."""
    assert seen.record is not None
    say(
        "done | %s | %s%s | final loss %.4f%s",
        plural(state.step, "step"),
        plural(state.tokens_seen, "token"),
        describe_throughput(seen.throughput, mfu),
        seen.record.loss,
        f" | val loss {seen.val_loss:.4f}" if seen.val_loss is not None else "",
    )
    if seen.positions:
        say(
            "positions | %s trained on: %.1f%% padding, %.1f%% masked prompts, %.1f%% valid targets",
            f"{seen.positions:,}",
            100 * seen.padding / seen.positions,
            100 * seen.prompt / seen.positions,
            100 * (seen.positions - seen.padding - seen.prompt) / seen.positions,
        )
    router = seen.record.measurements.get("router")
    if router is not None:
        say("%s", describe_expert_load(router))
    say_noise_scale(parts, state, seen.record, say)
    if bad_steps:
        say("%s", bad_steps)


def describe_expert_load(router: RouterMeasurement) -> str:
    """``experts | last step: router loss 0.0101 (balance 1.003) | load max/mean 1.21, 1.08 | cv 0.09, 0.05`` (per
    MoE layer)."""
    peaks = ", ".join(f"{x:.2f}" for x in router.load_max_over_mean)
    cvs = ", ".join(f"{x:.2f}" for x in router.load_cv)
    return (
        f"experts | last step: router loss {router.router_loss:.4f} (balance {router.balance_loss:.3f}, "
        f"{router.mode}) | load max/mean by layer {peaks} | cv {cvs}"
    )


def say_noise_scale(parts: RunParts, state: TrainState, last: StepRecord | None, say: Say) -> None:
    """The measured critical batch (the smoothed gradient noise scale) against this run's tokens per step: the
    last step's size when steps have one size or a ramp grows it, else the mean over the run's steps."""
    noise = parts.noise
    if noise is None or noise.estimate is None or not state.step:
        return
    if last is not None and (not parts.k_varies or parts.ramp is not None):
        used, how = last.tokens, "ended at" if parts.ramp is not None else "used"
    else:
        used, how = round(state.tokens_seen / state.step), "used"
    say("%s", critical_batch_line(noise.estimate, noise.scale.measurements, how, used))
