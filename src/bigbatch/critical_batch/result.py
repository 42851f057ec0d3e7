"""What a critical-batch measurement found: each branch's loss, the critical size, its text summary and its
figure beside the noise scale the parent run logged."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError
from bigbatch.files.atomic import write_atomically
from bigbatch.observe.noise_report import noise_series
from bigbatch.observe.runs import read_metrics


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
    beta2: float = 0.0  # AdamW's beta2 in the branch (the batch-change rule's)


@dataclass(frozen=True)
class CriticalBatchResult:
    run: str
    checkpoint: str
    parent_step: int
    parent_tokens_seen: int
    parent_tokens_per_step: int
    parent_lr: float  # the parent's learning rate at the branch point (its next step's)
    parent_beta2: float
    parent_val_loss: float  # at the branch point, on the same windows
    budget: int
    batch_change_rule: str  # e.g. sqrt-beta2 (see BatchChangeRule.label)
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
            f"{self.parent_tokens_per_step:,} tokens/step, lr {self.parent_lr:.2e}, beta2 {self.parent_beta2:.5g}) | "
            f"budget {self.budget:,} tokens | batch-change rule {self.batch_change_rule} | val loss at the branch "
            f"point {self.parent_val_loss:.4f} "
            f"({self.eval_batches} x {self.micro_batch} x {self.seq_len}, {self.eval_tokens:,} tokens)",
            f"{'tokens/step':>12} {'K':>5} {'steps':>6} {'lr':>9} {'beta2':>8} {'val loss':>9} {'vs smallest':>12}  "
            "within",
        ]
        for b in self.branches:
            change = (b.val_loss - smallest) / abs(smallest) if smallest else 0.0
            lines.append(
                f"{b.tokens_per_step:>12,} {b.accumulation_steps:>5} {b.steps:>6} {b.lr:>9.2e} {b.beta2:>8.5g} "
                f"{b.val_loss:>9.4f} "
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
    try:
        run = read_metrics(run_dir)
    except BigBatchError:
        return []  # no run, no log or no step yet: nothing measured
    usable = noise_series(run).usable()
    return [(p.step, p.tokens, p.smoothed) for p in usable if up_to_step is None or p.step <= up_to_step]


def plot_logged_noise(axis: Any, noise: list[tuple[int, int, float]], alpha: float = 1.0) -> None:
    """The noise scale a run logged (:func:`noise_scale_series`) against tokens seen, on ``axis``."""
    axis.plot(
        [t for _, t, _ in noise],
        [max(v, 1.0) for _, _, v in noise],
        ".-",
        color="C1",
        alpha=alpha,
        label="noise scale (B_simple) logged by the run",
    )


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
    left.set_title(f"branches from step {result.parent_step} (batch-change rule {result.batch_change_rule})")
    left.legend(fontsize=8)
    if noise:
        plot_logged_noise(right, noise)
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
