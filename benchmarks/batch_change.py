"""Changing the tokens per step during a run: Seesaw, the batch-change rule, the critical batch and the ramps that
follow it, on CPU (pico, tiny Shakespeare or its generated stand-in, one thread by default).

    python benchmarks/batch_change.py                 # all three, 5 paired seeds (2 for the ramps), about 8.5 minutes
    python benchmarks/batch_change.py --only seesaw   # seesaw | change | critical
    python benchmarks/batch_change.py --quick         # fewer seeds and steps: a smoke check (under 3 minutes)

Every comparison trains its arms at the same seed (same initial weights, same window order), so the differences
are paired; each table gives the per-seed numbers, then the mean, the standard deviation over seeds and the range.

* seesaw: ``--schedule seesaw`` against the plain warmup + cosine schedule (min_lr_ratio 0.1, 5 warmup steps) at
  the same ``max_steps`` (600 steps of 1,024 tokens, 8 x 64 micro-batches, lr 2e-3: its doublings to 8,192 stay
  near the critical batch that "critical" measures): both train the same tokens, Seesaw in fewer optimizer steps
  (the batch doubles, up to 8x, wherever cosine would halve the learning rate, which moves by 1/sqrt(2) instead
  with the rule sqrt, as published, or stays with linear: both arms are run). Each arm's validation loss is evaluated once, at the end, on the whole
  validation split. Goal: Seesaw's validation loss within the seed-to-seed spread of cosine's (|mean paired
  difference| <= the standard deviation of cosine's loss over seeds), in <= 0.7x the optimizer steps.
* change: a 4x batch change in the middle of a run. 100 steps at 1,024 tokens per step (the run's reference
  size), then the run is resumed in its own directory with ``total_batch_tokens`` 4,096 and
  ``allow_batch_change`` for 100 more steps (the cosine decay spans all 200: ``decay_steps`` 200). Arms:
  ``--batch-change-rule sqrt`` (betas auto: beta2 ** 4 as well, and the learning rate x 2) against ``none`` (the
  optimizer's settings kept). Reported: the mean training loss of the first 5 and 20 steps after the change
  (``metrics.jsonl``), and the validation loss at the end (whole split). Goal: sqrt no worse than none, right after
  the change and at the end. Both arms' first halves are the same computation: the script checks that their
  losses at the change agree bitwise.
* critical: one run of 240 steps of 4,096 tokens (4 x 64 micro-batches, K 16; noise scale every 5 steps) with a
  checkpoint every 15 steps, of which those at steps 15, 30, 60, 120 and 240 are kept (about evenly spaced in log
  tokens: the critical batch moves most early); :func:`~bigbatch.critical_batch.measure.measure_over_run` branches
  each at 512 .. 8,192 tokens per step for 64Ki tokens each and prints the critical batch against tokens seen with
  the noise scale the run logged beside it. Then new runs from scratch, at the first 2 seeds: the fixed batch
  (4,096 tokens per step, 240 steps), and ``--batch-ramp auto`` and ``--batch-ramp from:RUN`` (that measured curve)
  twice each: at the same 240 steps (bigbatch's ramp keeps the run's steps and schedule, so it trains fewer tokens)
  and at the fixed batch's tokens (``max_steps`` raised until the ramp trains as many, to 10% over, its cosine
  decay spanning its own steps: exact for from:RUN, whose sizes follow from the tokens seen; for auto, whose sizes
  depend on the run, up to 3 tries from twice the fixed batch's steps, then resumed at the minimum learning rate
  if still short). About 48 validations per run on the same 64 micro-batches. Reported: the tokens each needs to reach the fixed batch's
  final validation loss (the first evaluation at or below it; "not reached" if none is), and the ratio to the
  fixed batch's (below 1: fewer tokens for the same loss; each ramp takes more optimizer steps for them).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from bench_config import bench_corpus, cpu_run_config

from bigbatch.critical_batch.measure import measure_over_run
from bigbatch.observe.metrics import read_records
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer, TrainResult
from bigbatch.sizing.plan import BatchPlan
from bigbatch.sizing.ramp import BatchRamp, RampSpec

MODEL = "pico"
SEQ_LEN = 64
WARMUP = 5
CRITICAL_MB, CRITICAL_TOTAL = 4, 4096
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
"""Student's t, 97.5th percentile, by degrees of freedom (the 95% interval of a mean of paired differences)."""


@dataclass(frozen=True)
class Sizes:
    """The steps and sizes of the three measurements (the default run's, or --quick's)."""

    seesaw_steps: int = 600
    seesaw_tokens: int = 1024  # per step at the start: the doublings (to 8x) stay near the measured critical batch
    change_steps: int = 200  # the change is at half of them
    critical_steps: int = 240
    critical_save_every: int = 15
    critical_points: tuple[int, ...] = (15, 30, 60, 120, 240)  # the checkpoints branched (the others removed)
    critical_eval_every: int = 5
    critical_sizes: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    critical_budget: int = 65_536
    critical_seeds: int = 2  # at most this many of --seeds for the three runs of the ramps
    after: tuple[int, ...] = (5, 20)  # steps after the change whose training loss is averaged


QUICK = Sizes(
    seesaw_steps=200,
    change_steps=80,
    critical_steps=80,
    critical_save_every=10,
    critical_points=(10, 20, 40, 80),
    critical_eval_every=4,
    critical_sizes=(512, 2048, 8192),
    critical_budget=16_384,
    critical_seeds=1,
    after=(5, 20),
)


@dataclass
class Bench:
    corpus: Path
    work: Path
    seeds: list[int]
    sizes: Sizes
    summary: list[str] = field(default_factory=list)

    def config(
        self, out: Path, micro_batch: int, total: int, steps: int, seed: int, eval_every: int, eval_batches: int = 0
    ) -> TrainConfig:
        """pico at seq_len 64 on the corpus, ``steps`` steps of ``total`` tokens, seed ``seed``; evaluation every
        ``eval_every`` steps and at the end (``eval_batches`` 0: 131,072 tokens' worth, the whole split of tiny
        Shakespeare); warmup :data:`WARMUP` steps; no noise scale (the critical measurement turns it on)."""
        config = cpu_run_config(self.corpus, out, micro_batch, SEQ_LEN, total // (micro_batch * SEQ_LEN), steps)
        config.model.preset = MODEL
        config.data.cache_dir = str(self.work / "cache")
        config.run.seed = seed
        config.run.eval_every, config.run.eval_batches = eval_every, eval_batches
        config.run.noise_scale_every = 0
        config.optim.warmup_steps = WARMUP
        config.optim.min_lr_ratio = 0.1
        return config


# ---- reading runs ------------------------------------------------------------------------------------------


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir) if r.get("kind") == kind]


def tokens_at_steps(run_dir: Path) -> dict[int, int]:
    """Tokens seen after each step (applied steps only)."""
    seen, at = 0, {}
    for r in records(run_dir, "step"):
        if not r.get("skipped"):
            seen += int(r["tokens"])
        at[int(r["step"])] = seen
    return at


def step_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in records(run_dir, "step") if not r.get("skipped")}


def evals(run_dir: Path) -> list[tuple[int, int, float]]:
    """(step, tokens seen, validation loss) of each evaluation."""
    at = tokens_at_steps(run_dir)
    return [(int(r["step"]), at[int(r["step"])], float(r["val_loss"])) for r in records(run_dir, "eval")]


@contextmanager
def quiet() -> Iterator[None]:
    """bigbatch's warnings off for a while (the ones a step of the benchmark causes on purpose)."""
    logger = logging.getLogger("bigbatch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def train(config: TrainConfig) -> tuple[TrainResult, float]:
    started = time.perf_counter()
    result = Trainer(config).train()
    return result, time.perf_counter() - started


# ---- statistics --------------------------------------------------------------------------------------------


def spread(values: list[float], spec: str = ".4f") -> str:
    """``mean (sd x, min..max)`` over seeds."""
    if len(values) == 1:
        return f"{values[0]:{spec}} (1 seed)"
    return (
        f"{statistics.fmean(values):{spec}} (sd {statistics.stdev(values):{spec}}, "
        f"{min(values):{spec}}..{max(values):{spec}})"
    )


def paired(diffs: list[float]) -> str:
    """The mean paired difference, its sd and 95% interval (Student's t) over seeds."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return f"{mean:+.4f} (1 seed: no interval)"
    sd = statistics.stdev(diffs)
    half = T_975.get(len(diffs) - 1, 1.96) * sd / math.sqrt(len(diffs))
    return f"{mean:+.4f} (sd {sd:.4f}, 95% interval {mean - half:+.4f} to {mean + half:+.4f})"


# ---- seesaw ------------------------------------------------------------------------------------------------


SEESAW_ARMS = (("cosine", "auto"), ("seesaw", "sqrt"), ("seesaw", "linear"))
"""(schedule, batch-change rule): cosine, Seesaw as published (the learning rate x 1/sqrt(2) per doubling), and
Seesaw with the linear rule (the learning rate kept across a doubling)."""


def bench_seesaw(b: Bench) -> None:
    steps, total, mb = b.sizes.seesaw_steps, b.sizes.seesaw_tokens, 8
    print(
        f"seesaw | {MODEL}, {steps} steps of {total:,} tokens ({mb} x {SEQ_LEN} x K {total // (mb * SEQ_LEN)}), lr 2e-3, "
        f"warmup {WARMUP}, min_lr_ratio 0.1; --schedule seesaw (max batch auto: 8x) with the rule sqrt and with linear "
        "vs cosine, same seed; val loss at the end (whole split)"
    )
    print(
        f"  {'seed':>4} {'cosine val':>11} {'sqrt val':>9} {'diff':>8} {'linear val':>11} {'diff':>8} {'steps':>12} "
        f"{'ratio':>6} {'tokens':>10}"
    )
    vals: dict[str, list[float]] = {rule: [] for _, rule in SEESAW_ARMS}
    ratios = []
    for seed in b.seeds:
        arms = {}
        for schedule, rule in SEESAW_ARMS:
            config = b.config(b.work / f"seesaw_{schedule}_{rule}_{seed}", mb, total, steps, seed, eval_every=steps)
            config.optim.schedule, config.optim.batch_change_rule = schedule, rule
            arms[rule], _ = train(config)
        cos, see, lin = arms["auto"], arms["sqrt"], arms["linear"]
        if None in (cos.val_loss, see.val_loss, lin.val_loss):
            raise SystemExit(f"seesaw seed {seed}: no validation loss")
        for rule, result in arms.items():
            vals[rule].append(float(result.val_loss))  # type: ignore[arg-type]
        same_tokens = "" if cos.tokens_seen == see.tokens_seen == lin.tokens_seen else " TOKENS DIFFER"
        ratios.append(see.steps / cos.steps)
        print(
            f"  {seed:>4} {vals['auto'][-1]:>11.4f} {vals['sqrt'][-1]:>9.4f} {vals['sqrt'][-1] - vals['auto'][-1]:>+8.4f} "
            f"{vals['linear'][-1]:>11.4f} {vals['linear'][-1] - vals['auto'][-1]:>+8.4f} "
            f"{f'{cos.steps} -> {see.steps}':>12} {ratios[-1]:>5.3f}x {cos.tokens_seen:>10,}{same_tokens}"
        )
    print(f"  cosine val loss:        {spread(vals['auto'])}")
    seed_sd = statistics.stdev(vals["auto"]) if len(vals["auto"]) > 1 else float("nan")
    verdicts = []
    for rule in ("sqrt", "linear"):
        diffs = [s - c for c, s in zip(vals["auto"], vals[rule], strict=True)]
        print(f"  seesaw {rule:<6} val loss:  {spread(vals[rule])}")
        print(f"  seesaw {rule:<6} - cosine: {paired(diffs)}")
        within = "n/a (1 seed)" if math.isnan(seed_sd) else ("yes" if abs(statistics.fmean(diffs)) <= seed_sd else "NO")
        verdicts.append(f"{rule} {statistics.fmean(diffs):+.4f} (within: {within})")
    print(f"  optimizer steps, seesaw / cosine: {spread(ratios, '.3f')}")
    b.summary.append(
        f"seesaw: val loss vs cosine {', '.join(verdicts)} against the seed-to-seed sd {seed_sd:.4f}; "
        f"{statistics.fmean(ratios):.3f}x the optimizer steps (goal <= 0.7x: {'yes' if max(ratios) <= 0.7 else 'NO'})"
    )


# ---- a 4x batch change in the middle of a run --------------------------------------------------------------


@dataclass
class ChangeRuns:
    """Two arms of a 4x batch change at every seed: the mean training loss of each window of steps after the
    change, the final validation loss, each arm's ``batch_change`` record, and the seeds whose first halves (the
    same computation in both arms) did not end bitwise alike."""

    arms: tuple[str, str]  # (the reference arm, the one compared with it)
    windows: tuple[int, ...]
    losses: dict[str, dict[int, list[float]]]
    vals: dict[str, list[float]]
    changes: dict[str, dict[str, Any]]
    mismatched: list[int]

    def diffs(self, window: int | None = None) -> list[float]:
        """Second arm minus first, per seed: the training loss over ``window`` steps after the change, or (None)
        the final validation loss."""
        first, second = self.arms
        a, c = (
            (self.vals[first], self.vals[second])
            if window is None
            else (
                self.losses[first][window],
                self.losses[second][window],
            )
        )
        return [y - x for x, y in zip(a, c, strict=True)]

    def report(self) -> None:
        """Each arm's change line, each window's and the final loss with the paired difference, and whether the
        first halves agreed."""
        first, second = self.arms
        for arm, c in self.changes.items():
            momentum = (
                f" | Muon momentum {c['momentum_before']:.4g} -> {c['momentum_after']:.4g}"
                if "momentum_before" in c
                else ""
            )
            print(
                f"  {arm}: step {c['step']} {c['tokens_per_step_before']:,} -> {c['tokens_per_step_after']:,} "
                f"tokens/step | lr {c['lr_before']:.3e} -> {c['lr_after']:.3e} | beta2 {c['beta2_before']:.4g} -> "
                f"{c['beta2_after']:.4g}" + momentum
            )
        for n in self.windows:
            print(f"  train loss, steps +1..+{n} after the change: {first} {spread(self.losses[first][n])}")
            print(f"  {'':>40}  {second} {spread(self.losses[second][n])}")
            print(f"  {'':>40}  {second} - {first} {paired(self.diffs(n))}")
        print(f"  final val loss: {first} {spread(self.vals[first])}")
        print(f"                  {second} {spread(self.vals[second])}")
        print(f"                  {second} - {first} {paired(self.diffs())}")
        print(
            "  first halves (the same computation in both arms): "
            + (
                "loss at the change bitwise equal for every seed"
                if not self.mismatched
                else f"DIFFER for seeds {self.mismatched}"
            )
        )


def run_change(b: Bench, name: str, arms: dict[str, Callable[[TrainConfig], None]]) -> ChangeRuns:
    """Each of the two ``arms`` (its settings applied to both halves of the run) at each seed: half the steps at
    1,024 tokens per step, then the run resumed in its own directory at 4,096 (``allow_batch_change``) for the
    other half, the cosine over all of them; a row per seed as it goes."""
    steps, mb, before = b.sizes.change_steps, 8, 1024
    after, half = 4 * before, steps // 2
    windows = b.sizes.after
    first, second = names = tuple(arms)
    head = " ".join(f"{f'+1..+{n} {first}':>13} {f'+1..+{n} {second}':>15}" for n in windows)
    print(f"  {'seed':>4} {head} {f'val {first}':>9} {f'val {second}':>10} {'diff':>8}")
    losses: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in windows} for arm in arms}
    vals: dict[str, list[float]] = {arm: [] for arm in arms}
    changes, mismatched = {}, []
    for seed in b.seeds:
        at_change = {}
        for arm, settings in arms.items():
            out = b.work / f"{name}_{arm}_{seed}"
            result = None
            for total, n_steps in ((before, half), (after, steps)):
                config = b.config(out, mb, total, n_steps, seed, eval_every=half)
                config.optim.decay_steps = steps
                settings(config)
                if total == after:
                    config.run.allow_batch_change = True
                    result, _ = train(config)
                else:
                    with quiet():  # "changes nothing in this run": this session's tokens per step do not change
                        train(config)
            if result is None or result.val_loss is None:
                raise SystemExit(f"{name} seed {seed} {arm}: no validation loss")
            vals[arm].append(result.val_loss)
            loss = step_losses(out)
            at_change[arm] = loss[half]
            for n in windows:
                losses[arm][n].append(statistics.fmean(loss[s] for s in range(half + 1, half + n + 1)))
            found = records(out, "batch_change")
            if len(found) != 1 or found[0]["step"] != half + 1:
                raise SystemExit(f"{name} seed {seed} {arm}: expected one batch change at step {half + 1}: {found}")
            changes[arm] = found[0]
        if at_change[first] != at_change[second]:
            mismatched.append(seed)
        cells = " ".join(f"{losses[first][n][-1]:>13.4f} {losses[second][n][-1]:>15.4f}" for n in windows)
        print(
            f"  {seed:>4} {cells} {vals[first][-1]:>9.4f} {vals[second][-1]:>10.4f} "
            f"{vals[second][-1] - vals[first][-1]:>+8.4f}"
        )
    return ChangeRuns(names, windows, losses, vals, changes, mismatched)  # type: ignore[arg-type]


def bench_change(b: Bench) -> None:
    steps, before = b.sizes.change_steps, 1024
    half = steps // 2
    print(
        f"change | {MODEL}, {half} steps of {before:,} tokens, then resumed at {4 * before:,} (x4, "
        f"--allow-batch-change) for {half} more; cosine over all {steps} (lr 2e-3, warmup {WARMUP}); rule sqrt (lr "
        f"x2, beta2 0.95 -> {0.95**4:.4f}) vs none, same seed"
    )

    def rule(name: str) -> Callable[[TrainConfig], None]:
        def apply(config: TrainConfig) -> None:
            config.optim.batch_change_rule = name

        return apply

    runs = run_change(b, "change", {"none": rule("none"), "sqrt": rule("sqrt")})
    runs.report()
    first = b.sizes.after[0]
    early, final = statistics.fmean(runs.diffs(first)), statistics.fmean(runs.diffs())
    b.summary.append(
        f"change x4: sqrt - none, train loss over the {first} steps after the change {early:+.4f}, final val loss "
        f"{final:+.4f} (sqrt {statistics.fmean(runs.vals['sqrt']):.4f}, none {statistics.fmean(runs.vals['none']):.4f}; "
        f"goal, sqrt no worse: {'yes' if early <= 0 and final <= 0 else 'NO'})"
    )


def prune_to(run_dir: Path, keep: tuple[int, ...]) -> None:
    """Remove the run's checkpoints at steps other than ``keep`` (the points to branch)."""
    for path in ckpt.list_checkpoints(run_dir):
        if ckpt.checkpoint_step(path) not in keep:
            ckpt.remove_checkpoint(path)


def steps_for_tokens(ramp: BatchRamp, tokens: int) -> int:
    """Steps a ramp (a fixed or from:RUN one: K a function of the tokens seen) takes to see ``tokens``."""
    seen, steps = 0, 0
    while seen < tokens:
        seen += ramp.k(seen) * ramp.unit
        steps += 1
    return steps


@dataclass(frozen=True)
class Arm:
    """One run of the ramps' comparison, read back from its run directory."""

    name: str
    match: str  # steps or tokens
    steps: int
    tokens: int
    final_val: float
    evals: list[tuple[int, int, float]]
    sizes: list[int]
    note: str = ""

    def reached(self, target: float) -> tuple[int, int] | None:
        """(step, tokens seen) of the first evaluation at or below ``target``."""
        return next(((step, seen) for step, seen, loss in self.evals if loss <= target), None)


def ramp_run(b: Bench, out: Path, ramp: str, steps: int, seed: int, eval_every: int) -> TrainConfig:
    config = b.config(out, CRITICAL_MB, CRITICAL_TOTAL, steps, seed, eval_every=eval_every, eval_batches=64)
    config.run.noise_scale_every = 5
    config.batch.batch_ramp = ramp
    return config


def read_arm(name: str, match: str, out: Path, result: TrainResult, note: str = "") -> Arm:
    return Arm(
        name,
        match,
        result.steps,
        result.tokens_seen,
        result.val_loss if result.val_loss is not None else float("nan"),
        evals(out),
        sorted({int(r["tokens"]) for r in records(out, "step")}),
        note,
    )


def token_matched(b: Bench, name: str, ramp: str, guess: int, tokens: int, seed: int, evals_per_run: int) -> Arm:
    """A ramp run whose ``max_steps`` is raised until it trains ``tokens`` (to 10% over): its cosine decay spans
    its own steps. From ``guess`` steps; a run that overshoots is trained again with the steps at which it had
    seen ``tokens``, one that falls short with more steps at its last size (an auto ramp's sizes depend on its
    schedule, so this is tried 3 times at most); one still short is resumed past the end of its decay (the minimum
    learning rate) until it has seen them."""
    n_steps = guess
    for attempt in range(3):
        out = b.work / f"ramp_{name.replace(':', '_')}_tokens_{seed}_{attempt}"
        every = max(1, n_steps // evals_per_run)
        result, _ = train(ramp_run(b, out, ramp, n_steps, seed, every))
        if tokens <= result.tokens_seen <= 1.1 * tokens or attempt == 2:
            break
        at = tokens_at_steps(out)
        if result.tokens_seen > tokens:
            n_steps = min(step for step, seen in at.items() if seen >= tokens)
        else:
            n_steps += -(-(tokens - result.tokens_seen) // records(out, "step")[-1]["tokens"])
    decay_end, note = n_steps, ""
    for _ in range(10):  # steps of the largest size, so that an auto ramp growing meanwhile does not overshoot
        if result.tokens_seen >= tokens:
            break
        n_steps += -(-(tokens - result.tokens_seen) // CRITICAL_TOTAL)
        with quiet():  # past the end of its decay: said, on purpose
            result, _ = train(ramp_run(b, out, ramp, n_steps, seed, every))
    if n_steps > decay_end:
        note = f"steps {decay_end + 1}..{n_steps} at the minimum lr (topped up to the tokens)"
    if attempt:
        note = "; ".join(filter(None, [f"{attempt + 1} tries for the tokens", note]))
    return read_arm(name, "tokens", out, result, note)


def bench_critical(b: Bench) -> None:
    s = b.sizes
    steps, mb, total = s.critical_steps, CRITICAL_MB, CRITICAL_TOTAL
    evals_per_run = steps // s.critical_eval_every
    seed0 = b.seeds[0]
    parent = b.work / "critical_run"
    config = ramp_run(b, parent, "", steps, seed0, s.critical_eval_every)
    config.run.save_every, config.run.keep_checkpoints = s.critical_save_every, 0
    _, seconds = train(config)
    prune_to(parent, s.critical_points)
    print(
        f"critical | {MODEL}, {steps} steps of {total:,} tokens ({mb} x {SEQ_LEN} x K {total // (mb * SEQ_LEN)}), "
        f"seed {seed0}, noise scale every 5 steps, checkpoints at steps {', '.join(map(str, s.critical_points))} "
        f"({seconds:.0f} s)"
    )
    started = time.perf_counter()
    over_run, _ = measure_over_run(
        parent, s.critical_save_every, list(s.critical_sizes), s.critical_budget, device="cpu", plot=False
    )
    print(f"  measure_over_run: {len(over_run.points)} checkpoints branched in {time.perf_counter() - started:.0f} s")
    print("  " + over_run.format().replace("\n", "\n  "))
    plan = BatchPlan(mb, SEQ_LEN, total // (mb * SEQ_LEN))
    follow = BatchRamp(RampSpec(source=str(parent)), plan)
    print(f"  --batch-ramp from:RUN follows: {follow.describe()}")
    seeds = b.seeds[: s.critical_seeds]
    print(
        f"  ramps | per seed ({', '.join(map(str, seeds))}): the fixed batch, and --batch-ramp auto and from:RUN at "
        f"the same {steps} steps (the same schedule by step: fewer tokens) and at the fixed batch's tokens "
        f"(max_steps raised until they train as many, the cosine decay over their own steps); about "
        f"{evals_per_run} evaluations per run (64 micro-batches, the same windows); target: the fixed batch's final "
        "val loss"
    )
    print(
        f"  {'seed':>4} {'arm':>9} {'matched':>7} {'steps':>6} {'tokens':>10} {'final val':>10} {'target':>8} "
        f"{'tokens to target':>17} {'vs fixed':>9}  sizes (tokens/step)"
    )
    ratios: dict[tuple[str, str], list[float | None]] = {}
    for seed in seeds:
        out = b.work / f"ramp_fixed_{seed}"
        result, _ = train(ramp_run(b, out, "", steps, seed, s.critical_eval_every))
        fixed = read_arm("fixed", "-", out, result)
        if seed == seed0:
            same = fixed.final_val == evals(parent)[-1][2]
            fixed = replace(fixed, note="" if same else "DIFFERS from the measured run at the same seed")
        target, reached = fixed.final_val, fixed.reached(fixed.final_val)
        assert reached is not None
        arms = [fixed]
        for name, ramp in (("auto", "auto"), ("from:RUN", f"from:{parent}")):
            out = b.work / f"ramp_{name.replace(':', '_')}_steps_{seed}"
            result, _ = train(ramp_run(b, out, ramp, steps, seed, s.critical_eval_every))
            arms.append(read_arm(name, "steps", out, result))
        # the same tokens: from:RUN's steps follow from its curve (exact); auto's are searched for from twice the
        # fixed batch's steps (its sizes depend on its own schedule)
        for name, ramp, guess in (
            ("auto", "auto", 2 * steps),
            ("from:RUN", f"from:{parent}", steps_for_tokens(follow, fixed.tokens)),
        ):
            arms.append(token_matched(b, name, ramp, guess, fixed.tokens, seed, evals_per_run))
        for arm in arms:
            got = arm.reached(target)
            ratio = got[1] / reached[1] if got else None
            ratios.setdefault((arm.name, arm.match), []).append(ratio)
            shown = ", ".join(f"{t:,}" for t in arm.sizes[:5]) + (
                f", ... {arm.sizes[-1]:,}" if len(arm.sizes) > 5 else ""
            )
            print(
                f"  {seed:>4} {arm.name:>9} {arm.match:>7} {arm.steps:>6} {arm.tokens:>10,} {arm.final_val:>10.4f} "
                f"{target:>8.4f} {f'{got[1]:,} (step {got[0]})' if got else 'not reached':>17} "
                f"{f'{ratio:.3f}x' if ratio is not None else '-':>9}  {shown}{f' | {arm.note}' if arm.note else ''}"
            )
    parts = []
    for (name, match), values in ratios.items():
        if name == "fixed":
            continue
        got = [r for r in values if r is not None]
        text = f"{statistics.fmean(got):.3f}x" if got else "not reached"
        if got and len(got) < len(values):
            text += f" ({len(values) - len(got)} of {len(values)} seeds not reached)"
        parts.append(f"{name} at the same {match} {text}")
    points = "; ".join(
        f"{p.tokens_seen:,} tokens: {'<= ' if p.bound == 'at most' else '>= ' if p.bound == 'at least' else ''}"
        f"{p.critical_tokens_per_step:,}" + (f" (noise scale {p.noise_scale:,.0f})" if p.noise_scale else "")
        for p in over_run.points
    )
    b.summary.append(f"critical batch over the run: {points}")
    b.summary.append(
        f"ramps, tokens to reach the fixed batch's final val loss vs the fixed batch's: {'; '.join(parts)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["seesaw", "change", "critical"])
    parser.add_argument("--seeds", type=int, help="paired seeds (default 5; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="fewer seeds and steps: a smoke check")
    parser.add_argument("--corpus", help="raw text to train on (default: tiny Shakespeare, else its stand-in)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each row as it is measured
    torch.set_num_threads(args.threads)
    logging.getLogger("bigbatch").setLevel(logging.WARNING)
    sizes = QUICK if args.quick else Sizes()
    n_seeds = args.seeds or (2 if args.quick else 5)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bigbatch-batch-change-") as tmp:
        work = Path(tmp)
        corpus, line, _ = bench_corpus(args.corpus, work)
        print(f"{line} | {args.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        bench = Bench(corpus, work, list(range(n_seeds)), sizes)
        for part, run in (("seesaw", bench_seesaw), ("change", bench_change), ("critical", bench_critical)):
            if args.only not in (None, part):
                continue
            part_started = time.perf_counter()
            run(bench)
            print(f"  ({part}: {time.perf_counter() - part_started:.0f} s)", flush=True)
    print("summary")
    for line in bench.summary:
        print(f"  {line}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
