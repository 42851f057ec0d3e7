"""What the verifier reports: per-parameter and per-split comparisons, findings, the verdict and its reasons."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LOSS = "<loss>"  # the name findings use for the loss function
ROUTER_LOSS = "<router loss>"  # a mixture of experts' load-balancing loss, accumulated otherwise than exactly


@dataclass(frozen=True)
class ParamComparison:
    name: str
    full_norm: float
    accumulated_norm: float
    max_abs_diff: float
    rel_diff: float  # ||g_acc - g_full|| / ||g_full||
    cosine: float
    within_tolerance: bool


@dataclass(frozen=True)
class BufferComparison:
    name: str
    rel_diff: float  # ||b_acc - b_full|| / ||b_full|| after the step (inf when only one side is zero)
    full_value: str  # short renderings for the report: a scalar's value, else the norm
    accumulated_value: str


@dataclass(frozen=True)
class Mistake:
    name: str
    rel_diff: float  # against the full-batch gradient
    norm_ratio: float  # ||g_mistake|| / ||g_full||


@dataclass(frozen=True)
class Finding:
    module: str
    kind: str
    detail: str
    output_rel_diff: float | None = None  # full-batch output vs concatenated micro-batch outputs
    split: str | None = None  # the split that exposed it (None: found by type, whatever the split)


@dataclass(frozen=True)
class SplitResult:
    """The accumulated gradient and buffers of one split, against the full batch."""

    name: str
    sizes: list[int]  # samples per micro-batch
    valid_counts: list[int]  # valid items per micro-batch
    params: list[ParamComparison]
    total_rel_diff: float
    total_cosine: float
    max_abs_diff: float
    buffers: list[BufferComparison]  # only those that differ
    tolerance: float
    error: str | None = None  # the model could not run on these micro-batches (e.g. BatchNorm on one sample)

    @property
    def gradient_matches(self) -> bool:
        within = self.total_rel_diff <= self.tolerance and all(p.within_tolerance for p in self.params)
        return self.error is None and within


@dataclass
class EquivalenceReport:
    """The whole comparison. The top-level gradient fields describe the first split (``equal`` by default);
    :attr:`splits` holds every split tried, and :attr:`equivalent` considers them all."""

    k: int
    samples: int
    valid_counts: list[int]  # per micro-batch
    precision: str
    tolerance: float
    params: list[ParamComparison]
    total_rel_diff: float
    total_cosine: float
    max_abs_diff: float
    mistakes: list[Mistake]
    update_rel_diff: float  # ||Δp_acc - Δp_full|| / ||Δp_full|| after one optimizer step
    optimizer: str = "adamw"  # the step's: adamw, muon or custom (a factory's)
    findings: list[Finding] = field(default_factory=list)
    dropout_disabled: list[str] = field(default_factory=list)
    seconds: float = 0.0
    splits: list[SplitResult] = field(default_factory=list)
    buffers_compared: int = 0
    packing_rel_diff: float | None = None  # packed rows vs the same documents one per row, full-batch gradients
    packing_problems: list[str] = field(default_factory=list)  # e.g. the loader's positions, its valid counts

    @property
    def reasons(self) -> list[str]:
        """Why the verdict is NOT EQUIVALENT (empty when equivalent)."""
        out = [
            f"the model fails on the micro-batches of the {s.name} split {s.sizes}: {s.error}"
            if s.error is not None
            else f"the gradient differs under the {s.name} split {s.sizes} (relative L2 difference "
            f"{s.total_rel_diff:.2e} > tolerance {s.tolerance:.0e})"
            if s.total_rel_diff > s.tolerance
            else f"parameters over tolerance under the {s.name} split {s.sizes}: "
            + ", ".join(p.name for p in s.params if not p.within_tolerance)
            for s in self.splits
            if not s.gradient_matches
        ]
        seen_buffers: set[str] = set()
        for s in self.splits:
            for b in s.buffers:
                if b.name not in seen_buffers:
                    seen_buffers.add(b.name)
                    out.append(f"buffer {b.name} differs after the step under the {s.name} split")
        for f in self.findings:
            if f.kind != "buffer":
                out.append(f"{f.module} [{f.kind}] {f.detail}")
        out += self.packing_problems
        if self.packing_rel_diff is not None and not self.packing_rel_diff <= self.tolerance:
            out.append(
                f"packed rows give another gradient than the same documents one per row (relative L2 difference "
                f"{self.packing_rel_diff:.2e} > tolerance {self.tolerance:.0e}): attention or positions cross "
                "document boundaries"
            )
        return out

    @property
    def equivalent(self) -> bool:
        if self.splits:
            return not self.reasons
        within = self.total_rel_diff <= self.tolerance and all(p.within_tolerance for p in self.params)
        packing = self.packing_rel_diff is None or self.packing_rel_diff <= self.tolerance
        return within and packing and not self.findings and not self.packing_problems

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (``bigbatch verify --json``)."""
        return {
            "equivalent": self.equivalent,
            "k": self.k,
            "valid_counts": self.valid_counts,
            "precision": self.precision,
            "tolerance": self.tolerance,
            "total_rel_diff": self.total_rel_diff,
            "total_cosine": self.total_cosine,
            "update_rel_diff": self.update_rel_diff,
            "optimizer": self.optimizer,
            "seconds": self.seconds,
            "packing_rel_diff": self.packing_rel_diff,
            "packing_problems": self.packing_problems,
            "mistakes": {m.name: m.rel_diff for m in self.mistakes},
            "findings": [asdict(f) for f in self.findings],
            "dropout_disabled": self.dropout_disabled,
            "params": [asdict(p) for p in self.params],
            "reasons": self.reasons,
            "splits": [
                {
                    **{k: v for k, v in asdict(s).items() if k not in ("params", "buffers")},
                    "buffers": [asdict(b) for b in s.buffers],
                }
                for s in self.splits
            ],
        }

    def format(self, top: int = 5) -> str:
        lines = [
            f"verify | K {self.k} | {self.samples} samples | valid targets per micro-batch {self.valid_counts} "
            f"| {self.precision} | {self.seconds:.1f}s",
        ]
        if self.dropout_disabled:
            lines.append(
                f"dropout disabled for the comparison (masks cannot match across batch splits): "
                f"{', '.join(self.dropout_disabled)}"
            )
        lines.append(
            f"accumulated vs full batch: relative L2 difference {self.total_rel_diff:.2e}, "
            f"cosine {self.total_cosine:.8f}, max |diff| {self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e})"
        )
        if self.packing_rel_diff is not None:
            lines.append(
                f"packed rows vs the same documents one per row: relative L2 difference {self.packing_rel_diff:.2e} "
                f"(tolerance {self.tolerance:.0e})"
            )
        lines += [f"breaks packing: {problem}" for problem in self.packing_problems]
        worst = sorted(self.params, key=lambda p: p.rel_diff, reverse=True)[:top]
        if worst:
            width = max(len(p.name) for p in worst)
            lines.append(f"  {'parameter':<{width}}  {'|g_full|':>9}  {'|g_acc|':>9}  {'rel diff':>9}  {'cosine':>10}")
            for p in worst:
                lines.append(
                    f"  {p.name:<{width}}  {p.full_norm:9.3e}  {p.accumulated_norm:9.3e}  {p.rel_diff:9.2e}  "
                    f"{p.cosine:10.7f}{'' if p.within_tolerance else '  <-- over tolerance'}"
                )
        shown: set[str] = set()
        for s in self.splits:
            if s.error is not None:
                lines.append(f"split {s.name:<8} sizes {s.sizes}: the model fails: {s.error}")
                continue
            verdict = "ok" if s.gradient_matches and not s.buffers else "DIFFERS"
            lines.append(
                f"split {s.name:<8} sizes {s.sizes}: relative L2 difference {s.total_rel_diff:.2e}, "
                f"buffers differing {len(s.buffers)} of {self.buffers_compared}: {verdict}"
            )
            for b in s.buffers:
                if b.name in shown:
                    continue
                shown.add(b.name)
                lines.append(
                    f"  buffer {b.name}: full batch {b.full_value}, accumulated {b.accumulated_value} "
                    f"(relative difference {b.rel_diff:.2e})"
                )
        why = {
            "muon": "Muon orthogonalised the accumulated gradient once per hidden matrix, AdamW the rest; "
            "informational: AdamW divides by |g| + eps, so coordinates whose exact gradient is zero move by rounding",
            "custom": "informational: the optimizer the factory gave",
        }.get(
            self.optimizer,
            "informational: AdamW divides by |g| + eps, so coordinates whose exact gradient is zero move by rounding",
        )
        lines.append(
            f"parameter update after one {self.optimizer if self.optimizer != 'custom' else 'optimizer'} step: "
            f"relative difference {self.update_rel_diff:.2e} ({why})"
        )
        for m in self.mistakes:
            lines.append(
                f"classic mistake '{m.name}': relative difference {m.rel_diff:.2e}, norm ratio {m.norm_ratio:.3f}"
            )
        for f in self.findings:
            measured = f" (output differs by {f.output_rel_diff:.2e})" if f.output_rel_diff is not None else ""
            exposed = f" [{f.split} split]" if f.split else ""
            lines.append(f"breaks equivalence: {f.module} [{f.kind}] {f.detail}{measured}{exposed}")
        reasons = self.reasons if self.splits else []
        if self.equivalent:
            lines.append("verdict: EQUIVALENT")
        else:
            lines.append("verdict: NOT EQUIVALENT")
            lines.extend(f"  because {reason}" for reason in reasons)
        return "\n".join(lines)


@dataclass
class DistributedReport:
    world_size: int
    k: int
    valid_counts: list[int]  # per rank
    rank_max_abs_diff: float  # largest |g_rank - g_rank0| after the sync step
    total_rel_diff: float  # ||g_ddp - g_full|| / ||g_full|| against one process on the whole batch
    tolerance: float
    seconds: float
    findings: list[Finding] = field(default_factory=list)  # batch-coupled modules found by type
    buffers: list[str] = field(default_factory=list)  # "rank R: name" for buffers that differ from the full batch's
    buffers_compared: int = 0
    packing_problems: list[str] = field(default_factory=list)  # what the training loader's packed rows got wrong

    @property
    def equivalent(self) -> bool:
        return (
            self.rank_max_abs_diff == 0.0
            and self.total_rel_diff <= self.tolerance
            and not self.findings
            and not self.buffers
            and not self.packing_problems
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as ``--json`` writes it."""
        return {**asdict(self), "equivalent": self.equivalent}

    def format(self) -> str:
        lines = [
            f"verify | DDP | world {self.world_size} x K {self.k} | valid targets per rank {self.valid_counts} "
            f"| {self.seconds:.1f}s",
            f"gradients after the sync step: identical on every rank (max |g_r - g_0| = {self.rank_max_abs_diff:.1e})"
            if self.rank_max_abs_diff == 0.0
            else f"gradients after the sync step DIFFER across ranks: max |g_r - g_0| = {self.rank_max_abs_diff:.2e}",
            f"DDP accumulated vs single-process full batch: relative L2 difference {self.total_rel_diff:.2e} "
            f"(tolerance {self.tolerance:.0e})",
            f"buffers after the step vs the full batch's: {len(self.buffers)} differ of {self.buffers_compared} "
            "compared on each rank" + (": " + ", ".join(self.buffers) if self.buffers else ""),
        ]
        lines += [f"breaks equivalence: {f.module} [{f.kind}] {f.detail}" for f in self.findings]
        lines += [f"breaks packing: {problem}" for problem in self.packing_problems]
        lines.append(f"verdict: {'EQUIVALENT' if self.equivalent else 'NOT EQUIVALENT'}")
        return "\n".join(lines)
