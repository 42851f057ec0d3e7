"""The critical batch size, measured directly: short runs branched from one checkpoint at several tokens per step.

After McCandlish et al. (2018) the gradient noise scale *estimates* the critical batch; Merrill et al. ("Critical
Batch Size Revisited", 2025) measure it: branch from a checkpoint at several batch sizes, train each branch for
the same number of tokens, and take the largest batch whose loss stays within a tolerance of the smallest
batch's. This module does that on bigbatch's own training path:

* **Branches.** Each tokens-per-step N is a run of its own in ``RUN/critical-batch/step_SSSSSSS-lr_RULE/tps_N/``
  (a normal run directory: config, metrics, checkpoints), started from RUN's latest checkpoint by
  :mod:`bigbatch.run.branch` (model, optimizer, step, data position, tokens seen, generators) with the parent's
  micro-batch and ``K = N / (micro_batch x seq_len)``: every step is exact at its size. It trains
  ``budget / N`` steps, so every branch sees ``budget`` tokens, all from the same data position.
* **Learning rate** (:func:`branch_lr`): constant over the branch, the parent's learning rate at the branch
  point scaled by the ratio of tokens per step ``r = N / N_parent``: ``sqrt`` (default: ``lr x sqrt(r)``, the
  square-root rule for Adam), ``linear`` (``lr x r``) or ``constant`` (``lr``). At the parent's own size every
  rule gives the parent's learning rate, so that branch *is* the parent continued with a constant learning
  rate (bitwise the parent's own continuation when its schedule is constant from there, e.g. after its decay).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError, CheckpointError, ConfigError, PlanError
from bigbatch.files.atomic import write_atomically, write_text_atomically
from bigbatch.run.lock import hold_directory
from bigbatch.sizing.plan import BatchPlan, parse_count, plan_batch

log = logging.getLogger(__name__)

LR_RULES = ("sqrt", "linear", "constant")
"""How a branch's learning rate follows its tokens per step (see :func:`branch_lr`)."""
DEFAULT_LR_RULE = "sqrt"
DEFAULT_TOLERANCE = 0.01
"""A branch is "as good" when its loss is at most 1% above the smallest size's."""
OUT_DIR = "critical-batch"
RESULT_FILE = "result.json"
PLOT_FILE = "critical-batch.png"
BRANCH_FILE = "branch.json"


def parse_sizes(text: str) -> list[int]:
    """``64K,128K,256K`` -> ``[64000, 128000, 256000]`` (``Ki`` for powers of two): ascending, duplicates
    dropped, at least two sizes."""
    items = [item for item in text.split(",") if item.strip()]
    try:
        sizes = sorted({parse_count(item) for item in items})
    except PlanError as exc:
        raise ConfigError(f"--tokens-per-step: {exc}") from None
    if len(sizes) < 2:
        raise ConfigError(
            f"--tokens-per-step {text!r}: give at least two different sizes, comma-separated (e.g. 16Ki,32Ki,64Ki)"
        )
    return sizes


def branch_lr(rule: str, parent_lr: float, parent_tokens_per_step: int, tokens_per_step: int) -> float:
    """The branch's constant learning rate: the parent's at the branch point, scaled by ``N / N_parent``
    as ``rule`` says (``sqrt``, ``linear`` or ``constant``)."""
    ratio = tokens_per_step / parent_tokens_per_step
    if rule == "sqrt":
        return parent_lr * math.sqrt(ratio)
    if rule == "linear":
        return parent_lr * ratio
    if rule == "constant":
        return parent_lr
    raise ConfigError(f"--lr-rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


def check_budget(budget: int, sizes: list[int]) -> None:
    """The budget must hold at least one step of the largest size and a whole number of steps of every size
    (so that every branch stops after exactly ``budget`` tokens)."""
    largest = max(sizes)
    if budget < largest:
        raise ConfigError(
            f"--budget {budget:,} tokens is smaller than one step of the largest size ({largest:,} tokens); "
            f"use --budget {largest:,} or more (a few steps of the largest size give a clearer answer)"
        )
    unit = math.lcm(*sizes)
    if budget % unit:
        lower, upper = budget // unit * unit, (budget // unit + 1) * unit
        nearest = " or ".join(f"{b:,}" for b in (lower, upper) if b >= largest)
        raise ConfigError(
            f"--budget {budget:,} is not a whole number of steps at every size (each of "
            f"{', '.join(f'{s:,}' for s in sizes)} must divide it, so every branch stops after the same tokens); "
            f"nearest budgets that do: {nearest}"
        )


def plan_sizes(sizes: list[int], micro_batch: int, seq_len: int) -> list[BatchPlan]:
    """Each size as whole micro-batches of ``micro_batch x seq_len`` in one process; one that is not says which
    sizes near it are."""
    plans = []
    for size in sizes:
        try:
            plans.append(plan_batch(size, micro_batch, seq_len, world_size=1))
        except PlanError as exc:
            raise PlanError(f"--tokens-per-step {size:,}: {exc}{_binary_hint(size, micro_batch, seq_len)}") from None
    return plans


def _binary_hint(size: int, micro_batch: int, seq_len: int) -> str:
    """For ``64K`` (64,000) where ``64Ki`` (65,536) would do: say that K means 1,000."""
    for unit, decimal, binary in (("M", 10**6, 2**20), ("K", 10**3, 2**10)):
        if size % decimal == 0 and (size // decimal * binary) % (micro_batch * seq_len) == 0:
            exact = size // decimal * binary
            return f" (K and M mean 1,000 and 1,000,000: for {exact:,} write {size // decimal}{unit}i)"
    return ""


def critical_batch_size(sizes: list[int], losses: list[float], tolerance: float) -> tuple[int, list[bool]]:
    """The largest size whose loss, and that of every smaller size, is at most ``(1 + tolerance)`` times the
    smallest size's; and, per size, whether its own loss is within that limit. ``sizes`` ascend."""
    limit = losses[0] + tolerance * abs(losses[0])
    within = [loss <= limit for loss in losses]
    critical = sizes[0]
    for size, ok in zip(sizes, within, strict=True):
        if not ok:
            break
        critical = size
    return critical, within


@dataclass(frozen=True)
class BranchResult:
    tokens_per_step: int
    accumulation_steps: int  # K
    steps: int  # optimizer steps in the branch
    lr: float
    val_loss: float
    within_tolerance: bool
    run_dir: str
    reused: bool  # finished before this call: nothing trained


@dataclass(frozen=True)
class CriticalBatchResult:
    run: str
    checkpoint: str
    parent_step: int
    parent_tokens_seen: int
    parent_tokens_per_step: int
    parent_lr: float  # the parent's learning rate at the branch point (its next step's)
    parent_val_loss: float  # at the branch point, on the same windows
    budget: int
    lr_rule: str
    tolerance: float
    micro_batch: int
    seq_len: int
    eval_batches: int
    eval_tokens: int  # valid targets scored per evaluation
    critical_tokens_per_step: int
    noise_scale: float | None  # the parent's latest logged estimate at or before the branch point
    noise_scale_step: int | None
    branches: list[BranchResult] = field(default_factory=list)

    @property
    def bound(self) -> str:
        """``at least`` when every size is within the tolerance (the answer lies at or above the largest tried),
        ``at most`` when only the smallest is, else ``between`` (the next size tried is out)."""
        if all(b.within_tolerance for b in self.branches):
            return "at least"
        return "at most" if self.critical_tokens_per_step == self.branches[0].tokens_per_step else "between"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bound": self.bound}

    def format(self) -> str:
        smallest = self.branches[0].val_loss
        lines = [
            f"critical-batch | {self.run} at step {self.parent_step} ({self.parent_tokens_seen:,} tokens, "
            f"{self.parent_tokens_per_step:,} tokens/step, lr {self.parent_lr:.2e}) | budget {self.budget:,} tokens "
            f"| lr rule {self.lr_rule} | val loss at the branch point {self.parent_val_loss:.4f} "
            f"({self.eval_batches} x {self.micro_batch} x {self.seq_len}, {self.eval_tokens:,} tokens)",
            f"{'tokens/step':>12} {'K':>5} {'steps':>6} {'lr':>9} {'val loss':>9} {'vs smallest':>12}  within",
        ]
        for b in self.branches:
            change = (b.val_loss - smallest) / abs(smallest) if smallest else 0.0
            lines.append(
                f"{b.tokens_per_step:>12,} {b.accumulation_steps:>5} {b.steps:>6} {b.lr:>9.2e} {b.val_loss:>9.4f} "
                f"{change:>+11.2%}  {'yes' if b.within_tolerance else 'no'}{' (reused)' if b.reused else ''}"
            )
        rule = (
            f"the largest size whose loss after {self.budget:,} tokens, and every smaller size's, is within "
            f"{self.tolerance:.1%} of the smallest's"
        )
        if self.bound == "at least":
            lines.append(
                f"critical batch: at least {self.critical_tokens_per_step:,} tokens per step ({rule}: every "
                "size tried is; try larger sizes, or a larger budget)"
            )
        elif self.bound == "at most":
            lines.append(
                f"critical batch: {self.critical_tokens_per_step:,} tokens per step or less ({rule}: the "
                "next size already is not; try smaller sizes)"
            )
        else:
            lines.append(f"critical batch: {self.critical_tokens_per_step:,} tokens per step ({rule})")
        if self.noise_scale is not None:
            lines.append(
                f"noise scale logged by the run at step {self.noise_scale_step}: {self.noise_scale:,.0f} tokens"
            )
        else:
            lines.append("noise scale: the run's metrics.jsonl holds no estimate at or before the branch point")
        return "\n".join(lines)


def noise_scale_series(run_dir: Path, up_to_step: int | None = None) -> list[tuple[int, int, float]]:
    """``(step, tokens seen after it, smoothed noise scale)`` of each measured step of the run's ``metrics.jsonl``
    whose estimate is usable (a positive number), in order: the series ``bigbatch report`` plots and ``plan
    --from-run`` sizes from (a skipped step applied no update and counts no tokens)."""
    from bigbatch.observe.noise_report import noise_series
    from bigbatch.observe.report import read_metrics

    try:
        run = read_metrics(run_dir)
    except BigBatchError:
        return []  # no run, no log or no step yet: nothing measured
    usable = noise_series(run).usable()
    return [(p.step, p.tokens, p.smoothed) for p in usable if up_to_step is None or p.step <= up_to_step]


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as JSON, written the way checkpoints are (temporary file, fsync, rename): never half a file."""
    write_text_atomically(path, json.dumps(payload, indent=2) + "\n")


def find_parent(run_dir: Path, step: int | None = None) -> Path:
    """RUN's newest complete checkpoint (or the one at ``step``), or a one-line error saying what is missing."""
    from bigbatch.run.checkpoint import checkpoint_path, latest_valid_checkpoint, list_checkpoints, verify_checkpoint

    if not run_dir.exists():
        raise CheckpointError(f"no such run: {run_dir} does not exist; give the directory of a bigbatch run")
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a run directory; give the directory of a bigbatch run")
    if step is not None:
        path = checkpoint_path(run_dir, step)
        problem = verify_checkpoint(path) if path.is_file() else "there is none"
        if problem:
            have = ", ".join(p.stem.split("_")[1].lstrip("0") or "0" for p in list_checkpoints(run_dir)) or "none"
            raise CheckpointError(
                f"--step {step}: no complete checkpoint of {run_dir} at that step ({problem}); "
                f"its checkpoints are at steps: {have}"
            )
        return path
    found = latest_valid_checkpoint(run_dir)
    if found is None:
        why = "none is complete and valid" if list_checkpoints(run_dir) else "it has no checkpoint"
        raise CheckpointError(
            f"{run_dir} cannot be branched: {why} (expected checkpoints/step_*.pt with its .commit marker); "
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
    tokens_per_step: int
    lr: float  # the learning rate of its next step
    micro_batch: int
    seq_len: int
    sha256: str


def _read_parent(run_dir: Path, step: int | None = None) -> _Parent:
    from bigbatch.run.checkpoint import commit_path, load_checkpoint
    from bigbatch.run.resume import saved_schedule

    path = find_parent(run_dir, step)
    document = load_checkpoint(path)
    config = document.get("config") or {}
    batch = config.get("batch") or {}
    if int(batch.get("token_budget") or 0):
        raise ConfigError(
            f"{run_dir} was trained with --token-budget (K varies per step): critical-batch compares fixed tokens "
            "per step; branch a run trained with --total-batch-tokens"
        )
    step = int(document["engine"]["step_count"])
    loader = document.get("loader") or {}
    micro_batch = int(batch.get("micro_batch") or 0) or int(loader.get("micro_batch") or 0)
    return _Parent(
        checkpoint=path,
        document={k: v for k, v in document.items() if k not in ("model", "optimizer", "rng")},
        step=step,
        tokens_seen=int(document.get("tokens_seen", 0)),
        tokens_per_step=int(batch["total_batch_tokens"]),
        lr=saved_schedule(document)(step),
        micro_batch=micro_batch,
        seq_len=int(batch["seq_len"]),
        sha256=str(json.loads(commit_path(path).read_text())["sha256"]),
    )


def branch_config(
    parent: _Parent, branch_dir: Path, plan: BatchPlan, lr: float, steps: int, eval_batches: int, device: str
) -> Any:
    """The branch's own config: the parent's, with this size's tokens per step (the micro-batch chosen for all
    branches), a constant learning rate ``lr``, ``steps`` more steps, and its own directory; no sample, no
    external loggers, one process."""
    from bigbatch.run.config import config_from_dict

    config = config_from_dict(parent.document.get("config") or {})
    trained_on = str(parent.document.get("dataset") or "")
    if trained_on and Path(trained_on).is_dir():  # the prepared tokens the parent read (found from any directory)
        config.data.data = trained_on
    config.batch.total_batch_tokens, config.batch.micro_batch = plan.tokens_per_step, plan.micro_batch
    config.batch.batch_ramp = ""  # every branch trains at its own fixed size, whatever the parent's ramp
    optim = config.optim
    optim.lr, optim.min_lr_ratio, optim.warmup_steps, optim.decay_steps = lr, 1.0, 0, 0  # constant lr
    run = config.run
    run.max_steps, run.out, run.device, run.eval_batches = parent.step + steps, str(branch_dir), device, eval_batches
    run.resume, run.overwrite, run.nproc, run.parallel = "auto", False, 1, "auto"
    run.tensorboard, run.wandb, run.sample_tokens = False, "", 0
    run.extend_schedule = run.allow_data_change = run.allow_ramp_change = False
    return config


def _check_branch_record(branch_dir: Path, record: dict[str, Any]) -> None:
    """Write ``branch.json`` in a new branch directory; in an existing one, refuse another parent or size."""
    from bigbatch.files.outputs import RUN_MARKER, mark_own_dir, require_own_dir

    require_own_dir(branch_dir, "branch directory", "a new RUN", RUN_MARKER)
    path = branch_dir / BRANCH_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = {}
        keys = ("parent_sha256", "tokens_per_step", "lr_rule", "lr")
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
    from bigbatch.run.checkpoint import latest_valid_checkpoint

    latest = latest_valid_checkpoint(branch_dir) if branch_dir.is_dir() else None
    return None if latest is None else int(latest.stem.split("_")[1])


def _train_branch(config: Any, parent: _Parent, target: int) -> bool:
    """Train the branch up to step ``target`` (continuing its own checkpoints, or from the parent); ``True`` when
    it had already got there."""
    from bigbatch.run.trainer import Trainer

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
    tolerance: float = DEFAULT_TOLERANCE,
    lr_rule: str = DEFAULT_LR_RULE,
    micro_batch: int | None = None,
    eval_batches: int | None = None,
    device: str = "auto",
    plot: bool = True,
    step: int | None = None,
) -> CriticalBatchResult:
    """Branch RUN's latest checkpoint (or the one at ``step``) at each size in ``sizes`` (tokens per step), train
    each for ``budget`` tokens, evaluate all on the same validation windows and find the critical batch; write
    ``result.json`` (and the plot) in ``RUN/critical-batch/step_SSSSSSS-lr_RULE/``. Every check runs before any
    training."""
    from bigbatch.artifacts.evaluate import evaluate_checkpoint
    from bigbatch.parallel.distributed import resolve_device

    if lr_rule not in LR_RULES:
        raise ConfigError(f"--lr-rule must be one of {', '.join(LR_RULES)}, got {lr_rule!r}")
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
        )
        return result.loss, result.tokens

    parent_loss, eval_tokens = evaluate(parent.checkpoint)  # also: the data has a validation split, before training
    base = run_dir / OUT_DIR / f"step_{parent.step:07d}-lr_{lr_rule}"
    base.mkdir(parents=True, exist_ok=True)
    with hold_directory(base, "critical-batch directory", wait=False, say=_say):  # one measurement writes it
        return _measure(
            run_dir,
            base,
            parent,
            (parent_loss, eval_tokens),
            plans,
            budget,
            tolerance,
            lr_rule,
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
    lr_rule: str,
    eval_batches: int,
    device: str,
    plot: bool,
    evaluate: Callable[[Path], tuple[float, int]],
) -> CriticalBatchResult:
    """Train and score every branch of :func:`measure_critical_batch` in ``base`` (held), write the result."""
    from bigbatch.run.checkpoint import checkpoint_path

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
    trained: list[tuple[BatchPlan, int, float, float, bool, Path]] = []
    for plan in plans:
        size, steps = plan.tokens_per_step, budget // plan.tokens_per_step
        lr = branch_lr(lr_rule, parent.lr, parent.tokens_per_step, size)
        branch_dir = base / f"tps_{size}"
        record = {
            "parent_run": str(run_dir.resolve()),
            "parent_checkpoint": parent.checkpoint.name,
            "parent_step": parent.step,
            "parent_sha256": parent.sha256,
            "parent_tokens_per_step": parent.tokens_per_step,
            "parent_lr": parent.lr,
            "tokens_per_step": size,
            "lr_rule": lr_rule,
            "lr": lr,
        }
        _check_branch_record(branch_dir, record)
        config = branch_config(parent, branch_dir, plan, lr, steps, eval_batches, device)
        target = parent.step + steps
        log.info(
            "branch %s tokens per step (K %d, lr %.2e): steps %d..%d",
            f"{size:,}",
            plan.accumulation_steps,
            lr,
            parent.step + 1,
            target,
        )
        reused = _train_branch(config, parent, target)
        loss, _ = evaluate(checkpoint_path(branch_dir, target))
        trained.append((plan, steps, lr, loss, reused, branch_dir))
    critical, within = critical_batch_size(sizes, [t[3] for t in trained], tolerance)
    noise = noise_scale_series(run_dir, up_to_step=parent.step)
    result = CriticalBatchResult(
        run=str(run_dir),
        checkpoint=str(parent.checkpoint),
        parent_step=parent.step,
        parent_tokens_seen=parent.tokens_seen,
        parent_tokens_per_step=parent.tokens_per_step,
        parent_lr=parent.lr,
        parent_val_loss=parent_loss,
        budget=budget,
        lr_rule=lr_rule,
        tolerance=tolerance,
        micro_batch=mb,
        seq_len=seq_len,
        eval_batches=eval_batches,
        eval_tokens=eval_tokens,
        critical_tokens_per_step=critical,
        noise_scale=noise[-1][2] if noise else None,
        noise_scale_step=noise[-1][0] if noise else None,
        branches=[
            BranchResult(plan.tokens_per_step, plan.accumulation_steps, steps, lr, loss, ok, str(branch_dir), reused)
            for (plan, steps, lr, loss, reused, branch_dir), ok in zip(trained, within, strict=True)
        ],
    )
    if plot:
        plot_result(result, noise_scale_series(run_dir), base / PLOT_FILE)
    write_json_atomically(base / RESULT_FILE, result.to_dict())
    return result


def plot_result(result: CriticalBatchResult, noise: list[tuple[int, int, float]], path: Path) -> Path:
    """Two panels: the branches' loss after the budget against tokens per step (tolerance band, critical batch,
    the noise scale at the branch point, the parent's own size), and the parent's logged noise scale against
    tokens seen with the direct measurement at the branch point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [b.tokens_per_step for b in result.branches]
    losses = [b.val_loss for b in result.branches]
    limit = losses[0] + result.tolerance * abs(losses[0])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(sizes, losses, "o-", color="C0", label=f"val loss after {result.budget:,} tokens")
    for b in result.branches:
        if not b.within_tolerance:
            left.plot([b.tokens_per_step], [b.val_loss], "x", color="C3", markersize=10)
    left.axhline(limit, color="grey", ls="--", lw=1, label=f"smallest's loss + {result.tolerance:.1%}")
    bound = {"at least": ">= ", "at most": "<= "}.get(result.bound, "")
    left.axvline(
        result.critical_tokens_per_step,
        color="C2",
        lw=2,
        label=f"critical batch {bound}{result.critical_tokens_per_step:,}",
    )
    if result.noise_scale is not None and result.noise_scale > 0:
        left.axvline(
            result.noise_scale,
            color="C1",
            ls=":",
            lw=2,
            label=f"noise scale {result.noise_scale:,.0f} (step {result.noise_scale_step})",
        )
    left.axvline(
        result.parent_tokens_per_step,
        color="black",
        ls="-.",
        lw=1,
        label=f"the run's {result.parent_tokens_per_step:,}",
    )
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens per step")
    left.set_ylabel("validation loss")
    left.set_title(f"branches from step {result.parent_step} (lr rule {result.lr_rule})")
    left.legend(fontsize=8)
    if noise:
        right.plot(
            [t for _, t, _ in noise],
            [max(v, 1.0) for _, _, v in noise],
            ".-",
            color="C1",
            label="noise scale (B_simple) logged by the run",
        )
        right.set_yscale("log")
    else:
        right.text(
            0.5, 0.5, "no noise scale in the run's metrics.jsonl", ha="center", va="center", transform=right.transAxes
        )
    marker = {"at least": "^", "at most": "v"}.get(result.bound, "*")  # a bound points the way the answer lies
    right.plot(
        [result.parent_tokens_seen],
        [result.critical_tokens_per_step],
        marker,
        color="C2",
        markersize=14,
        label=f"critical batch by branching: {bound}{result.critical_tokens_per_step:,}",
    )
    right.axhline(result.parent_tokens_per_step, color="black", ls="-.", lw=1, label="the run's tokens per step")
    right.set_xlabel("tokens seen by the run")
    right.set_ylabel("tokens")
    right.set_title("noise scale vs direct measurement")
    right.legend(fontsize=8)
    fig.tight_layout()
    try:
        write_atomically(path, lambda handle: fig.savefig(handle, format="png", dpi=110))  # never half a plot
    finally:
        plt.close(fig)
    return path
