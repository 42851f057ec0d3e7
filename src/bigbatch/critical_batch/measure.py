"""The critical batch size, measured directly: short runs branched from one checkpoint at several tokens per step.

After McCandlish et al. (2018) the gradient noise scale *estimates* the critical batch; Merrill et al. ("Critical
Batch Size Revisited", 2025) measure it: branch from a checkpoint at several batch sizes, train each branch for
the same number of tokens, and take the largest batch whose loss stays within a tolerance of the smallest
batch's. This module does that on bigbatch's own training path:

* **Branches.** Each tokens-per-step N is a run of its own in ``RUN/critical-batch/step_SSSSSSS-RULE/tps_N/``
  (a normal run directory: config, metrics, checkpoints), started from RUN's latest checkpoint by
  :mod:`bigbatch.run.checkpoints.branch` (model, optimizer, step, data position, tokens seen, generators) with the
  parent's micro-batch and ``K = N / (micro_batch x seq_len)``: every step is exact at its size. It trains
  ``budget / N`` steps, so every branch sees ``budget`` tokens, all from the same data position.
* **Optimizer** (:mod:`bigbatch.engine.batch_change`): constant over the branch, the parent's settings at the
  branch point (its next step's learning rate, betas and weight decay, at its own size) moved by the batch-change
  rule for ``r = N / N_parent``: ``sqrt`` (default: ``lr x sqrt(r)`` and ``beta2 ** r``), ``linear`` or ``none``.
  At the parent's own size every rule gives the parent's settings, so that branch *is* the parent continued with
  a constant learning rate (bitwise the parent's own continuation when its schedule is constant from there).
* **Comparison.** Every branch's final checkpoint and the parent's are evaluated on the same validation windows
  (``eval_batches`` micro-batches of ``micro_batch x seq_len`` from the start of the split). The critical
  batch is the largest N such that N and every smaller size tried reach a loss at most ``(1 + tolerance)``
  times the smallest size's (:func:`critical_batch_size`).
* **Resumable.** A branch that reached its last step is reused; one with checkpoints continues from its newest;
  one without starts from the parent again. A Ctrl-C stops at a step boundary with a checkpoint (as ``train``
  does); the result files are written atomically, last.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bigbatch.artifacts.evaluate import EvalFlags, evaluate_checkpoint
from bigbatch.critical_batch.over_run import CriticalBatchOverRun, checkpoints_every, point_of, write_over_run
from bigbatch.critical_batch.result import BranchResult, CriticalBatchResult, noise_scale_series, plot_result
from bigbatch.critical_batch.rules import DEFAULT_LOSS_TOLERANCE, check_budget, critical_batch_size, plan_sizes
from bigbatch.engine.batch_change import BatchChangeRule, OptimSettings
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.files.atomic import write_json_atomically
from bigbatch.files.json_text import from_json
from bigbatch.files.outputs import RUN_MARKER, mark_own_dir, require_own_dir
from bigbatch.parallel.distributed import resolve_device
from bigbatch.run.checkpoints.branch import parent_tokens_per_step
from bigbatch.run.checkpoints.checkpoint import (
    checkpoint_at,
    checkpoint_path,
    checkpoint_step,
    commit_path,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from bigbatch.run.checkpoints.resume import saved_schedule
from bigbatch.run.configuration.config_sources import config_from_dict
from bigbatch.run.loop.run_dir_lock import hold_directory
from bigbatch.run.loop.trainer import Trainer
from bigbatch.sizing.plan import BatchPlan

log = logging.getLogger(__name__)

OUT_DIR = "critical-batch"
RESULT_FILE = "result.json"
PLOT_FILE = "critical-batch.png"
BRANCH_FILE = "branch.json"
CRITICAL_BATCH_FLAGS = EvalFlags(batches="--eval-batches", split=None)
"""Its evaluations read the run's own validation split: there is no --split to advise."""


def find_parent(run_dir: Path, step: int | None = None) -> Path:
    """RUN's newest complete checkpoint (or the one at ``step``), or a one-line error saying what is missing."""
    if not run_dir.exists():
        raise CheckpointError(f"no such run: {run_dir} does not exist; give the directory of a bigbatch run")
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a run directory; give the directory of a bigbatch run")
    if step is not None:
        path = checkpoint_at(run_dir, step)
        problem = verify_checkpoint(path) if path is not None else "there is none"
        if path is None or problem:
            have = ", ".join(str(checkpoint_step(p)) for p in list_checkpoints(run_dir)) or "none"
            raise CheckpointError(
                f"--step {step}: no complete checkpoint of {run_dir} at that step ({problem}); "
                f"its checkpoints are at steps: {have}"
            )
        return path
    found = latest_valid_checkpoint(run_dir)
    if found is None:
        why = "none is complete and valid" if list_checkpoints(run_dir) else "it has no checkpoint"
        raise CheckpointError(
            f"{run_dir} cannot be branched: {why} (expected checkpoints/step_* with its .commit marker); "
            "train it first, or give the run's own directory"
        )
    return found


class Interrupted(Exception):
    """A signal stopped a branch at a step boundary (its checkpoint is saved): run the same command to go on."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@dataclass(frozen=True)
class _Parent:
    """What the branches need from RUN's checkpoint."""

    checkpoint: Path
    document: dict[str, Any]  # its run record (config, step, ...) without the tensors
    step: int
    tokens_seen: int
    tokens_per_step: int  # of its last step
    settings: OptimSettings  # its next step's learning rate, betas and weight decay
    micro_batch: int
    seq_len: int
    sha256: str


def _read_parent(run_dir: Path, step: int | None = None) -> _Parent:
    path = find_parent(run_dir, step)
    document = load_checkpoint(path, consolidate=False)  # the record: the branches read the tensors
    config = document.get("config") or {}
    batch = config.get("batch") or {}
    if int(batch.get("token_budget") or 0):
        raise ConfigError(
            f"{run_dir} was trained with --token-budget (K varies per step): critical-batch compares fixed tokens "
            "per step; branch a run trained with --total-batch-tokens"
        )
    objective = str((config.get("objective") or {}).get("name", "lm") or "lm")
    if objective != "lm":
        raise ConfigError(
            f"{run_dir} was trained with --objective {objective}: critical-batch compares next-token losses at "
            "tokens per step, and a preference step is sized by its pairs; branch a run of --objective lm"
        )
    step = int(document["engine"]["step_count"])
    loader = document.get("loader") or {}
    micro_batch = int(batch.get("micro_batch") or 0) or int(loader.get("micro_batch") or 0)
    return _Parent(
        checkpoint=path,
        document={k: v for k, v in document.items() if k not in ("model", "optimizer", "rng")},
        step=step,
        tokens_seen=int(document.get("tokens_seen", 0)),
        tokens_per_step=parent_tokens_per_step(document),
        settings=parent_settings(document, step),
        micro_batch=micro_batch,
        seq_len=int(batch["seq_len"]),
        sha256=str(json.loads(commit_path(path).read_text())["sha256"]),
    )


def parent_settings(document: dict[str, Any], step: int) -> OptimSettings:
    """The learning rate, betas and weight decay of the parent's next step at its own size: its optimizer's (the
    engine sets them after each step; the weight decay of the group that decays), else its schedule's and config's
    (a checkpoint without param groups)."""
    groups = document.get("optimizer_param_groups") or (document.get("optimizer") or {}).get("param_groups") or []
    optim = (document.get("config") or {}).get("optim") or {}
    adamw = [group for group in groups if not group.get("muon")]
    if adamw and all(key in adamw[0] for key in ("lr", "betas")):
        beta1, beta2 = (float(beta) for beta in adamw[0]["betas"])
        decay = max(float(group.get("weight_decay", 0.0)) for group in adamw)
        settings = OptimSettings(float(adamw[0]["lr"]), beta1, beta2, decay)
        muon = next((group for group in groups if group.get("muon")), None)  # --optimizer muon: its own group
        if muon is None:
            return settings
        return replace(
            settings,
            momentum=float(muon["momentum"]),
            muon_lr=float(muon["lr"]),
            muon_weight_decay=float(muon["weight_decay"]),
        )
    return OptimSettings(  # a checkpoint without param groups (from before Muon: AdamW's alone)
        saved_schedule(document)(step),
        float(optim.get("beta1", 0.9)),
        float(optim.get("beta2", 0.95)),
        float(optim.get("weight_decay", 0.1)),
    )


def branch_config(
    parent: _Parent,
    branch_dir: Path,
    plan: BatchPlan,
    rule: BatchChangeRule,
    steps: int,
    eval_batches: int,
    device: str,
) -> Any:
    """The branch's own config: the parent's, with this size's tokens per step (the micro-batch chosen for all
    branches), the parent's settings at the branch point held constant (the batch-change ``rule`` moves them to
    this size from the first step), ``steps`` more steps, and its own directory; no sample, no external loggers,
    one process."""
    config = config_from_dict(parent.document.get("config") or {})
    trained_on = str(parent.document.get("dataset") or "")
    if trained_on and Path(trained_on).is_dir():  # the prepared tokens the parent read (found from any directory)
        config.data.data = trained_on
    config.batch.total_batch_tokens, config.batch.micro_batch = plan.tokens_per_step, plan.micro_batch
    config.batch.batch_ramp = ""  # every branch trains at its own fixed size, whatever the parent's ramp
    optim, settings = config.optim, parent.settings
    if settings.muon_lr is not None:  # Muon's rate, weight decay and momentum as the parent's last step had them
        optim.muon_lr, optim.muon_weight_decay = settings.muon_lr, settings.muon_weight_decay or 0.0
        optim.muon_momentum = settings.momentum if settings.momentum is not None else optim.muon_momentum
        optim.batch_change_momentum = rule.momentum
    optim.lr, optim.min_lr_ratio, optim.warmup_steps, optim.decay_steps = settings.lr, 1.0, 0, 0  # constant lr
    optim.beta1, optim.beta2, optim.weight_decay = settings.beta1, settings.beta2, settings.weight_decay
    optim.batch_change_rule, optim.batch_change_betas = rule.rule, rule.betas
    optim.batch_change_weight_decay, optim.schedule = rule.weight_decay, "cosine"
    config.batch.max_batch_tokens = 0
    run = config.run
    run.max_steps, run.out, run.device, run.eval_batches = parent.step + steps, str(branch_dir), device, eval_batches
    run.resume, run.overwrite, run.nproc, run.parallel = "auto", False, 1, "auto"
    run.tensorboard, run.wandb, run.sample_tokens = False, "", 0
    run.extend_schedule = run.allow_data_change = run.allow_ramp_change = run.allow_batch_change = False
    run.name = ""  # labelled by its own directory (tps_N), not by the parent's name
    return config


def _check_branch_record(branch_dir: Path, record: dict[str, Any]) -> None:
    """Write ``branch.json`` in a new branch directory; in an existing one, refuse another parent or size."""
    require_own_dir(branch_dir, "branch directory", "a new RUN", RUN_MARKER)
    path = branch_dir / BRANCH_FILE
    if path.is_file():
        try:
            saved = from_json(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = {}
        keys = ("parent_sha256", "tokens_per_step", "batch_change_rule", "lr", "beta2", "momentum")
        diffs = [f"{k} {saved.get(k)!r} -> {record[k]!r}" for k in keys if saved.get(k) != record[k]]
        if diffs:
            raise CheckpointError(
                f"{branch_dir} holds a branch of another checkpoint or setting ({'; '.join(diffs)}); move it away to "
                "branch again"
            )
        return
    mark_own_dir(branch_dir, RUN_MARKER, "run")
    write_json_atomically(path, record)


def _latest_step(branch_dir: Path) -> int | None:
    latest = latest_valid_checkpoint(branch_dir) if branch_dir.is_dir() else None
    return None if latest is None else int(latest.stem.split("_")[1])


def _train_branch(config: Any, parent: _Parent, target: int) -> bool:
    """Train the branch up to step ``target`` (continuing its own checkpoints, or from the parent); ``True`` when
    it had already got there."""
    branch_dir = Path(config.run.out)
    done = _latest_step(branch_dir)
    if done is not None and done > target:
        raise ConfigError(
            f"the branch in {branch_dir} has trained past this budget (step {done:,}; the budget ends at step "
            f"{target:,}): use a budget of at least {(done - parent.step) * config.batch.total_batch_tokens:,} tokens, "
            "or move the branch away"
        )
    if done == target:
        return True
    result = Trainer(config, branch_from=parent.checkpoint).train()
    if result.stopped_by:
        raise Interrupted(result.stopped_by)
    return False


def measure_critical_batch(
    run_dir: Path,
    sizes: list[int],
    budget: int,
    tolerance: float = DEFAULT_LOSS_TOLERANCE,
    rule: BatchChangeRule | None = None,
    micro_batch: int | None = None,
    eval_batches: int | None = None,
    device: str = "auto",
    plot: bool = True,
    step: int | None = None,
) -> CriticalBatchResult:
    """Branch RUN's latest checkpoint (or the one at ``step``) at each size in ``sizes`` (tokens per step), train
    each for ``budget`` tokens, evaluate all on the same validation windows and find the critical batch; write
    ``result.json`` (and the plot) in ``RUN/critical-batch/step_SSSSSSS-RULE/``. ``rule``: how each branch's
    optimizer follows its size (default: sqrt with beta2's half-life in tokens). Every check runs before any
    training."""
    rule = rule or BatchChangeRule.resolve("auto")
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ConfigError(f"--tolerance must be a fraction >= 0 (e.g. 0.01 for 1%), got {tolerance}")
    sizes = sorted(set(sizes))
    parent = _read_parent(run_dir, step)
    plans = plan_sizes(sizes, micro_batch or parent.micro_batch, parent.seq_len)
    check_budget(budget, sizes)
    run_config = (parent.document.get("config") or {}).get("run") or {}
    eval_batches = eval_batches or int(run_config.get("eval_batches", 8))
    precision = str(run_config.get("precision", "auto"))
    eval_device = resolve_device(device)
    mb, seq_len = plans[0].micro_batch, parent.seq_len

    def evaluate(checkpoint: Path) -> tuple[float, int]:
        result = evaluate_checkpoint(
            checkpoint,
            split="val",
            batches=eval_batches,
            micro_batch=mb,
            seq_len=seq_len,
            device=eval_device,
            precision=precision,
            flags=CRITICAL_BATCH_FLAGS,
        )
        return result.loss, result.tokens

    parent_loss, eval_tokens = evaluate(parent.checkpoint)  # also: the data has a validation split, before training
    base = run_dir / OUT_DIR / f"step_{parent.step:07d}-{rule.label()}"
    base.mkdir(parents=True, exist_ok=True)
    # One measurement writes it; critical-batch has no --wait-for-lock: another one is refused.
    with hold_directory(base, "critical-batch directory", wait=False, say=_say, wait_flag=None):
        return _measure(
            run_dir,
            base,
            parent,
            (parent_loss, eval_tokens),
            plans,
            budget,
            tolerance,
            rule,
            eval_batches,
            device,
            plot,
            evaluate,
        )


def _say(message: str, *args: Any, level: int = logging.INFO) -> None:
    log.log(level, message, *args)


def _measure(
    run_dir: Path,
    base: Path,
    parent: _Parent,
    parent_scored: tuple[float, int],
    plans: list[BatchPlan],
    budget: int,
    tolerance: float,
    rule: BatchChangeRule,
    eval_batches: int,
    device: str,
    plot: bool,
    evaluate: Callable[[Path], tuple[float, int]],
) -> CriticalBatchResult:
    """Train and score every branch of :func:`measure_critical_batch` in ``base`` (held), write the result."""
    sizes = [plan.tokens_per_step for plan in plans]
    (parent_loss, eval_tokens), mb, seq_len = parent_scored, plans[0].micro_batch, parent.seq_len
    log.info(
        "critical-batch: branching %s at step %d (%s tokens) at %s tokens per step, %s tokens each, in %s",
        run_dir,
        parent.step,
        f"{parent.tokens_seen:,}",
        ", ".join(f"{s:,}" for s in sizes),
        f"{budget:,}",
        base,
    )
    trained = [
        _train_and_score_branch(run_dir, base, parent, plan, budget, rule, eval_batches, device, evaluate)
        for plan in plans
    ]
    critical, within = critical_batch_size(sizes, [t[3] for t in trained], tolerance)
    noise = noise_scale_series(run_dir, up_to_step=parent.step)
    result = CriticalBatchResult(
        run=str(run_dir),
        checkpoint=str(parent.checkpoint),
        parent_step=parent.step,
        parent_tokens_seen=parent.tokens_seen,
        parent_tokens_per_step=parent.tokens_per_step,
        parent_lr=parent.settings.lr,
        parent_beta2=parent.settings.beta2,
        parent_val_loss=parent_loss,
        budget=budget,
        batch_change_rule=rule.label(),
        tolerance=tolerance,
        micro_batch=mb,
        seq_len=seq_len,
        eval_batches=eval_batches,
        eval_tokens=eval_tokens,
        critical_tokens_per_step=critical,
        noise_scale=noise[-1][2] if noise else None,
        noise_scale_step=noise[-1][0] if noise else None,
        branches=[
            BranchResult(
                plan.tokens_per_step,
                plan.accumulation_steps,
                steps,
                settings.lr,
                loss,
                ok,
                str(branch_dir),
                reused,
                beta2=settings.beta2,
            )
            for (plan, steps, settings, loss, reused, branch_dir), ok in zip(trained, within, strict=True)
        ],
    )
    if plot:
        plot_result(result, noise_scale_series(run_dir), base / PLOT_FILE)
    write_json_atomically(base / RESULT_FILE, result.to_dict())
    return result


_Trained = tuple[BatchPlan, int, OptimSettings, float, bool, Path]
"""A branch trained and scored: its plan, steps, optimizer settings, validation loss, whether it was reused, its
directory."""


def _train_and_score_branch(
    run_dir: Path,
    base: Path,
    parent: _Parent,
    plan: BatchPlan,
    budget: int,
    rule: BatchChangeRule,
    eval_batches: int,
    device: str,
    evaluate: Callable[[Path], tuple[float, int]],
) -> _Trained:
    """One branch of :func:`_measure`: ``budget`` tokens at ``plan``'s tokens per step from the parent (or its
    finished checkpoint, reused), then its validation loss."""
    size, steps = plan.tokens_per_step, budget // plan.tokens_per_step
    settings = rule.follow(parent.settings, size / parent.tokens_per_step)
    branch_dir = base / f"tps_{size}"
    record = {
        "parent_run": str(run_dir.resolve()),
        "parent_checkpoint": parent.checkpoint.name,
        "parent_step": parent.step,
        "parent_sha256": parent.sha256,
        "parent_tokens_per_step": parent.tokens_per_step,
        "parent_lr": parent.settings.lr,
        "tokens_per_step": size,
        "batch_change_rule": rule.label(),
        "lr": settings.lr,
        "beta2": settings.beta2,
        "momentum": settings.momentum,  # Muon's (None: the parent trains with AdamW alone)
    }
    _check_branch_record(branch_dir, record)
    config = branch_config(parent, branch_dir, plan, rule, steps, eval_batches, device)
    target = parent.step + steps
    log.info(
        "branch %s tokens per step (K %d, lr %.2e, beta2 %.5g): steps %d..%d",
        f"{size:,}",
        plan.accumulation_steps,
        settings.lr,
        settings.beta2,
        parent.step + 1,
        target,
    )
    reused = _train_branch(config, parent, target)
    loss, _ = evaluate(checkpoint_at(branch_dir, target) or checkpoint_path(branch_dir, target))
    return plan, steps, settings, loss, reused, branch_dir


def measure_over_run(
    run_dir: Path,
    every: int,
    sizes: list[int],
    budget: int,
    tolerance: float = DEFAULT_LOSS_TOLERANCE,
    rule: BatchChangeRule | None = None,
    micro_batch: int | None = None,
    eval_batches: int | None = None,
    device: str = "auto",
    plot: bool = True,
) -> tuple[CriticalBatchOverRun, Path]:
    """``--every N``: :func:`measure_critical_batch` at each of RUN's checkpoints at a multiple of ``every`` steps,
    then the critical batch against tokens seen (``over-run-RULE.json`` and its plot in ``RUN/critical-batch/``)."""
    rule = rule or BatchChangeRule.resolve("auto")
    if not run_dir.is_dir():
        find_parent(run_dir)  # its one-line error
    steps = checkpoints_every([checkpoint_step(p) for p in list_checkpoints(run_dir)], every, run_dir)
    points = []
    for step in steps:
        result = measure_critical_batch(
            run_dir, sizes, budget, tolerance, rule, micro_batch, eval_batches, device, plot=False, step=step
        )
        log.info("critical-batch at step %d: %s", step, result.format().splitlines()[-2])
        points.append(point_of(result, run_dir))
    over_run = CriticalBatchOverRun(str(run_dir), rule.label(), sorted(set(sizes)), budget, tolerance, points)
    return over_run, write_over_run(over_run, run_dir, plot)
