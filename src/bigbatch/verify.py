"""Proof that the accumulated gradient is the full-batch gradient, for any model.

:func:`check_equivalence` takes a model in training mode, one batch of tensors
(split along the first dimension) and a loss function, and compares

* the full-batch gradient: one forward/backward over all samples, loss = sum / N;
* the gradient the engine accumulates over the micro-batches of several
  *splits* of the same batch: equal pieces (``K`` of them), unequal pieces
  (sizes 1, 2, 3, ... and the remainder) and equal pieces of the samples in a
  random order, because a model that mixes neighbouring samples can pass one
  aligned split and fail any other;
* every buffer (running statistics, counters) after the step, both ways;
* the two classic mistakes on the equal split: no normalization (each
  micro-batch's mean loss back-propagated as is: K times too large) and
  ``mean / K`` (wrong whenever micro-batches hold different valid counts);
* the parameter update after one optimizer step taken both ways.

It names what breaks equivalence: modules with cross-sample statistics found by
type (BatchNorm of every kind in training mode, InstanceNorm with running
statistics), the smallest module (leaf or not, the model's own ``forward``
included) whose output on the full batch differs from its outputs on the
micro-batches while its inputs match, buffers that differ, and a loss function
that couples samples. Any of these makes the verdict NOT EQUIVALENT, whatever
the gradient tolerance. Dropout cannot match between one big batch and K small
ones (the masks differ), so it is switched off for the comparison and reported.

The loss function's signature is ``loss_fn(model, *tensors) -> (loss_sum, count)``:
the *sum* of per-item losses (e.g. per-token cross-entropies) and the number of
items it sums over. A loss that returns a mean ``m`` over ``c`` items returns
``(m * c, c)``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from bigbatch.accumulate import AccumulationEngine, resolve_precision, token_loss_sum
from bigbatch.batch import IGNORE_INDEX, MicroBatch
from bigbatch.optim import constant_schedule
from bigbatch.rng import preserved_rng

VerifyLossFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | int"]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
"""Relative L2 tolerance on the gradient by precision. fp32 differs only by summation order; under
autocast the full batch and the micro-batches round activations differently, so the bounds are looser."""

SPLITS = ("equal", "unequal", "permuted")
"""How the batch is cut into micro-batches: ``equal`` (``torch.tensor_split`` into K), ``unequal`` (sizes
1, 2, 3, ... and the remainder), ``permuted`` (the samples in a seeded random order, then K equal pieces)."""

ROOT = "<model>"  # the name findings use for the model's own forward
LOSS = "<loss>"  # ... and for the loss function


@dataclass
class TensorBatch:
    """A tuple of tensors that moves to a device together (the engine's micro-batch for verification)."""

    tensors: tuple[torch.Tensor, ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TensorBatch:
        return TensorBatch(tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss for a model returning logits: (sum over valid targets, count of valid targets)."""

    return token_loss_sum(model, MicroBatch(inputs, targets)), (targets != IGNORE_INDEX).sum()


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
    findings: list[Finding] = field(default_factory=list)
    dropout_disabled: list[str] = field(default_factory=list)
    seconds: float = 0.0
    splits: list[SplitResult] = field(default_factory=list)
    buffers_compared: int = 0

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
        return out

    @property
    def equivalent(self) -> bool:
        if self.splits:
            return not self.reasons
        within = self.total_rel_diff <= self.tolerance and all(p.within_tolerance for p in self.params)
        return within and not self.findings

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (``bigbatch verify --json``)."""
        return {
            "equivalent": self.equivalent, "k": self.k, "valid_counts": self.valid_counts,
            "precision": self.precision, "tolerance": self.tolerance,
            "total_rel_diff": self.total_rel_diff, "total_cosine": self.total_cosine,
            "update_rel_diff": self.update_rel_diff, "seconds": self.seconds,
            "mistakes": {m.name: m.rel_diff for m in self.mistakes},
            "findings": [asdict(f) for f in self.findings], "dropout_disabled": self.dropout_disabled,
            "params": [asdict(p) for p in self.params], "reasons": self.reasons,
            "splits": [
                {**{k: v for k, v in asdict(s).items() if k not in ("params", "buffers")},
                 "buffers": [asdict(b) for b in s.buffers]}
                for s in self.splits
            ],
        }  # fmt: skip

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
        lines.append(
            f"parameter update after one optimizer step: relative difference {self.update_rel_diff:.2e} "
            "(informational: AdamW divides by |g| + eps, so coordinates whose exact gradient is zero move by rounding)"
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


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability in ``model`` to zero; return the module paths that had one.

    Probabilities are zeroed rather than modules put in eval mode, because some
    attention implementations read ``dropout.p`` guarded by their *own* training
    flag (Hugging Face's GPT-2 does). Call this on a copy.
    """
    disabled = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0.0:
                module.p = 0.0
                disabled.append(name or "<root>")
        elif isinstance(getattr(module, "dropout", None), float) and module.dropout > 0.0:
            module.dropout = 0.0  # e.g. nn.MultiheadAttention, bigbatch's attention
            disabled.append(name or "<root>")
    return disabled


def scan_cross_sample_modules(model: nn.Module) -> list[Finding]:
    """Modules whose training-mode behaviour mixes samples or counts forwards, found by type."""
    findings = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            findings.append(
                Finding(
                    name or ROOT, type(module).__name__,
                    "normalizes with statistics of the whole batch in training mode",
                )
            )
        elif (
            isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats and module.training
        ):
            findings.append(
                Finding(
                    name or ROOT, type(module).__name__,
                    "running statistics are updated K times instead of once (gradients are per sample)",
                )
            )
    return findings


def split_indices(samples: int, k: int, name: str, seed: int = 0) -> list[torch.Tensor]:
    """Sample indices of each micro-batch for one of :data:`SPLITS`."""
    order = torch.arange(samples)
    if name == "equal":
        return list(torch.tensor_split(order, k))
    if name == "permuted":
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + 1))
        return list(torch.tensor_split(order, k))
    if name == "unequal":
        pieces, start, size = [], 0, 1
        while start < samples:
            pieces.append(order[start : start + size])
            start += size
            size += 1
        return pieces
    raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")


def _flat(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().double().flatten() for g in grads]) if grads else torch.zeros(1, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = a.norm().item() * b.norm().item()
    return (a @ b).item() / denom if denom > 0 else (1.0 if a.norm().item() == b.norm().item() else 0.0)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a module's arguments or output: tensors, (nested) tuples, lists, dicts, model outputs."""
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, dict):  # also Hugging Face ModelOutput
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    return []


class _CallRecorder:
    """Forward hooks on every module (the root included) that keep the tensors of each call's inputs and output."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self.names = [name for name, _ in model.named_modules()]
        self._handles = [
            module.register_forward_hook(self._hook(name), with_kwargs=True) for name, module in model.named_modules()
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self.calls.setdefault(name, []).append((_tensors_in(args) + _tensors_in(kwargs), _tensors_in(output)))

        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _split_difference(
    full: torch.Tensor, parts: list[torch.Tensor], sizes: list[int], order: torch.Tensor
) -> float | None:
    """Relative difference between ``full`` and the micro-batch tensors joined along the sample dimension,
    or None when the shapes show no sample dimension to join along (a tensor shared by all samples, a scalar).

    The sample dimension is the one where the parts add up to the full tensor with every other dimension equal;
    it may hold several rows per sample (e.g. ``(B*T, V)``). ``order`` maps joined rows back to the full batch's
    samples (the permuted split)."""
    samples = int(order.numel())
    if full.dim() == 0 or any(p.dim() != full.dim() for p in parts):
        return None
    for dim in range(full.dim()):
        others = [d for d in range(full.dim()) if d != dim]
        if any(p.shape[d] != full.shape[d] for p in parts for d in others):
            continue
        rows, leftover = divmod(full.shape[dim], samples)
        if leftover or any(p.shape[dim] != size * rows for p, size in zip(parts, sizes, strict=False)):
            continue
        joined = torch.cat(parts, dim=dim).double()
        reference = full.double().unflatten(dim, (samples, rows)).index_select(dim, order).flatten(dim, dim + 1)
        if not full.is_floating_point():
            return 0.0 if torch.equal(joined, reference) else math.inf
        return _rel(joined.flatten(), reference.flatten())
    return None


@dataclass(frozen=True)
class _ModuleComparison:
    output_diff: float | None  # worst over its calls and output tensors; None: nothing comparable
    input_diff: float | None


def _compare_calls(
    full: _CallRecorder, parts: _CallRecorder, sizes: list[int], order: torch.Tensor
) -> dict[str, _ModuleComparison]:
    """For each module, how its outputs (and inputs) on the micro-batches differ from those on the full batch.

    A module called ``c`` times per forward is called ``c`` times per micro-batch, in the same order: call ``j``
    of micro-batch ``i`` is the ``i * c + j``-th recorded call."""
    n_parts = len(sizes)
    result = {}
    for name in full.names:
        full_calls, part_calls = full.calls.get(name, []), parts.calls.get(name, [])
        c = len(full_calls)
        if c == 0 or len(part_calls) != c * n_parts:
            continue
        worst: list[float | None] = [None, None]  # output, input
        for j in range(c):
            micro = [part_calls[i * c + j] for i in range(n_parts)]
            for side in (1, 0):
                full_tensors = full_calls[j][side]
                if any(len(m[side]) != len(full_tensors) for m in micro):
                    continue
                for t, whole in enumerate(full_tensors):
                    diff = _split_difference(whole, [m[side][t] for m in micro], sizes, order)
                    if diff is not None:
                        slot = 0 if side == 1 else 1
                        worst[slot] = diff if worst[slot] is None else max(worst[slot], diff)  # type: ignore[type-var]
        result[name] = _ModuleComparison(worst[0], worst[1])
    return result


def _is_descendant(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(ancestor + "."))


def _attribute(comparisons: dict[str, _ModuleComparison], tolerance: float, split: str) -> list[Finding]:
    """The smallest modules whose outputs differ across the split while their inputs match: where mixing starts.

    A module whose inputs already differ shows a downstream effect; a module with a descendant that is itself
    an origin is explained by that descendant. The root ("") stands for the model's own forward."""

    def differs(c: _ModuleComparison) -> bool:
        return c.output_diff is not None and c.output_diff > tolerance

    def origin(c: _ModuleComparison) -> bool:
        return differs(c) and (c.input_diff is None or c.input_diff <= tolerance)

    origins = [name for name, c in comparisons.items() if origin(c)]
    findings = []
    for name in origins:
        if any(_is_descendant(other, name) for other in origins):
            continue
        detail = (
            "the model's own forward mixes samples (its output on the full batch differs from its micro-batch "
            "outputs while its submodules' outputs match)"
            if name == ""
            else "its output on the full batch differs from its micro-batch outputs while its inputs match"
        )
        findings.append(Finding(name or ROOT, "empirical", detail, comparisons[name].output_diff, split))
    return findings


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _render(t: torch.Tensor) -> str:
    return f"{t.item():g}" if t.numel() == 1 else f"norm {t.double().norm().item():.4g}"


def _compare_buffers(
    full: dict[str, torch.Tensor], acc: dict[str, torch.Tensor], tolerance: float
) -> list[BufferComparison]:
    """Buffers that differ after the step: integers exactly, floats beyond ``tolerance`` (relative L2)."""
    differing = []
    for name, fb in full.items():
        ab = acc[name]
        if fb.is_floating_point():
            rel = _rel(ab.flatten().double(), fb.flatten().double())
            if rel <= tolerance:
                continue
        else:
            if torch.equal(ab, fb):
                continue
            rel = _rel(ab.flatten().double(), fb.flatten().double())
        differing.append(BufferComparison(name, rel, _render(fb), _render(ab)))
    return differing


def _owner(buffer_name: str) -> str:
    return buffer_name.rpartition(".")[0] or ROOT


def _unscale(engine: AccumulationEngine) -> None:
    """fp16 gradients carry the GradScaler's scale: divide it out so norms and differences are true values."""
    if engine.scaler.is_enabled():
        engine.scaler.unscale_(engine.optimizer)


def _param_comparisons(
    g_full: dict[str, torch.Tensor], g_acc: dict[str, torch.Tensor], tolerance: float
) -> list[ParamComparison]:
    params = []
    for name, gf in g_full.items():
        gf64, ga64 = gf.double().flatten(), g_acc[name].double().flatten()
        params.append(
            ParamComparison(
                name=name, full_norm=gf64.norm().item(), accumulated_norm=ga64.norm().item(),
                max_abs_diff=(ga64 - gf64).abs().max().item() if gf64.numel() else 0.0,
                rel_diff=_rel(ga64, gf64), cosine=_cosine(ga64, gf64), within_tolerance=True,
            )
        )
    total_norm = _flat(list(g_full.values())).norm().item()
    # A parameter passes when its difference is within tolerance of its own gradient norm, or of a floor tied to
    # the whole gradient: coordinates whose true gradient is zero (e.g. attention key biases) hold only rounding.
    floor = tolerance * 1e-3 * total_norm
    return [
        replace(p, within_tolerance=p.rel_diff * p.full_norm <= tolerance * p.full_norm + floor) for p in params
    ]


@preserved_rng()  # it seeds every pass alike: the caller's generators are left as they were
def check_equivalence(
    model: nn.Module,
    batch: torch.Tensor | Sequence[torch.Tensor],
    loss_fn: VerifyLossFn | None = None,
    k: int = 4,
    precision: str = "fp32",
    tolerance: float | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    splits: Sequence[str] = SPLITS,
) -> EquivalenceReport:
    """Compare the full-batch gradient with the engine's accumulated gradient (see the module docstring).

    ``batch`` is a tensor or a sequence of tensors that all share the first
    (sample) dimension. It is cut into micro-batches by each of ``splits``
    (see :data:`SPLITS`; ``equal`` uses ``k`` pieces, as does ``permuted``).
    ``loss_fn`` defaults to :func:`lm_loss` (a model returning logits, batch =
    (inputs, targets) with -100 for no loss). The model is not modified: every
    pass runs on a copy.
    """
    started = time.perf_counter()
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    samples = tensors[0].shape[0]
    if any(t.shape[0] != samples for t in tensors):
        raise ValueError("every tensor of the batch must share its first (sample) dimension")
    if not 1 <= k <= samples:
        raise ValueError(f"k must be between 1 and the number of samples ({samples}), got {k}")
    splits = list(dict.fromkeys(splits))
    if not splits or any(s not in SPLITS for s in splits):
        raise ValueError(f"splits must be one or more of {', '.join(SPLITS)}, got {', '.join(splits) or 'none'}")
    loss_fn = loss_fn or lm_loss
    device = torch.device(device)
    precision = resolve_precision(precision, device)
    tolerance = DEFAULT_TOLERANCE[precision] if tolerance is None else tolerance
    make_optimizer = optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0))

    base = copy.deepcopy(model).to(device)
    base.train()
    dropout_disabled = disable_dropout(base)
    findings = scan_cross_sample_modules(base)
    full = TensorBatch(tensors)

    counter = copy.deepcopy(base)  # a forward in training mode may update buffers: never count on ``base``
    counts: dict[int, tuple[TensorBatch, int]] = {}  # id -> (the part, kept alive so its id stays unique; count)

    def count_of(part: TensorBatch) -> int:
        if id(part) not in counts:
            with torch.no_grad():
                counts[id(part)] = (part, int(loss_fn(counter, *part.to(device).tensors)[1]))
        return counts[id(part)][1]

    n_total = count_of(full)
    if n_total == 0:
        raise ValueError("the batch holds no valid items to average over")

    def fresh() -> tuple[nn.Module, AccumulationEngine]:
        replica = copy.deepcopy(base)
        engine = AccumulationEngine(
            replica, make_optimizer(replica.parameters()), constant_schedule(1.0), grad_clip=0.0,
            precision=precision, device=device,
            loss_fn=lambda m, b: loss_fn(m, *b.tensors)[0], count_fn=count_of,
        )
        # The optimizer's own learning rate applies: the engine's schedule must not override it.
        lr = float(engine.optimizer.param_groups[0]["lr"])
        engine.schedule = constant_schedule(lr)
        engine._set_lr(lr)
        return replica, engine

    def run(parts: list[TensorBatch]) -> tuple[nn.Module, AccumulationEngine, _CallRecorder, float]:
        """Forward and backward over ``parts`` (one part: the full batch), then one optimizer step."""
        replica, engine = fresh()
        torch.manual_seed(seed)
        recorder = _CallRecorder(replica)
        replica.zero_grad(set_to_none=True)
        loss_sum, _ = engine.accumulate(parts, n_valid=n_total)
        _unscale(engine)
        recorder.remove()
        return replica, engine, recorder, float(loss_sum)

    full_model, full_engine, full_calls, full_loss = run([full])
    g_full = _grads(full_model)
    flat_full = _flat(list(g_full.values()))
    total_norm = flat_full.norm().item()
    before = _flat([p.detach() for p in base.parameters()])
    full_engine.optimizer.step()
    update_full = _flat([p.detach() for p in full_model.parameters()]) - before
    buffers_full = _buffers(full_model)

    results: list[SplitResult] = []
    update_rel_diff = 0.0
    loss_blamed = False
    for split in splits:
        indices = split_indices(samples, k, split, seed)
        parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in indices]
        sizes = [int(idx.numel()) for idx in indices]
        try:
            acc_model, acc_engine, acc_calls, acc_loss = run(parts)
        except (RuntimeError, ValueError) as exc:  # e.g. BatchNorm refuses a micro-batch of one sample
            if split == splits[0]:
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            results.append(
                SplitResult(split, sizes, [], [], math.inf, 0.0, math.inf, [], tolerance, message)
            )
            continue
        g_acc = _grads(acc_model)
        flat_acc = _flat(list(g_acc.values()))
        acc_engine.optimizer.step()
        if split == splits[0]:
            update_rel_diff = _rel(_flat([p.detach() for p in acc_model.parameters()]) - before, update_full)
        comparisons = _compare_calls(full_calls, acc_calls, sizes, torch.cat(indices))
        del acc_calls
        result = SplitResult(
            name=split, sizes=sizes, valid_counts=[count_of(p) for p in parts],
            params=_param_comparisons(g_full, g_acc, tolerance),
            total_rel_diff=_rel(flat_acc, flat_full), total_cosine=_cosine(flat_acc, flat_full),
            max_abs_diff=(flat_acc - flat_full).abs().max().item(),
            buffers=_compare_buffers(buffers_full, _buffers(acc_model), tolerance), tolerance=tolerance,
        )
        results.append(result)
        known = {f.module for f in findings}
        findings += [f for f in _attribute(comparisons, tolerance, split) if f.module not in known]
        findings += [
            Finding(_owner(b.name), "buffer", f"buffer {b.name} differs after the step", b.rel_diff, split)
            for b in result.buffers
            if _owner(b.name) not in known and (_owner(b.name), "buffer") not in {(f.module, f.kind) for f in findings}
        ]
        # Every module's output matches, yet the losses or the gradients do not: the loss function couples samples.
        root = comparisons.get("")
        model_matches = root is not None and root.output_diff is not None and root.output_diff <= tolerance
        loss_diff = abs(acc_loss - full_loss) / max(abs(full_loss), 1e-30)
        if model_matches and not loss_blamed and (loss_diff > tolerance or not result.gradient_matches):
            loss_blamed = True
            findings.append(
                Finding(
                    LOSS, "loss",
                    "the loss function couples samples: the model's outputs match across the split but the "
                    f"per-micro-batch loss sums add up to a different total (relative difference {loss_diff:.2e}) "
                    "or give a different gradient",
                    split=split,
                )
            )
    del full_calls

    # The classic mistakes, on the first split's micro-batches.
    first_parts = [
        TensorBatch(tuple(t[idx] for t in tensors)) for idx in split_indices(samples, k, splits[0], seed)
    ]
    mistakes = []
    for name, divide_by_k in (("no normalization (sum of micro-batch means)", False), ("mean / K", True)):
        wrong = copy.deepcopy(base)
        wrong.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        for part in first_parts:
            with full_engine.autocast():
                loss_sum, count = loss_fn(wrong, *part.to(device).tensors)
            mean = loss_sum / max(int(count), 1)
            (mean / len(first_parts) if divide_by_k else mean).backward()
        flat_wrong = _flat(list(_grads(wrong).values()))
        mistakes.append(Mistake(name, _rel(flat_wrong, flat_full), flat_wrong.norm().item() / max(total_norm, 1e-300)))

    primary = results[0]
    return EquivalenceReport(
        k=len(primary.sizes),
        samples=samples,
        valid_counts=primary.valid_counts,
        precision=precision,
        tolerance=tolerance,
        params=primary.params,
        total_rel_diff=primary.total_rel_diff,
        total_cosine=primary.total_cosine,
        max_abs_diff=primary.max_abs_diff,
        mistakes=mistakes,
        update_rel_diff=update_rel_diff,
        findings=findings,
        dropout_disabled=dropout_disabled,
        seconds=time.perf_counter() - started,
        splits=results,
        buffers_compared=len(buffers_full),
    )


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

    @property
    def equivalent(self) -> bool:
        return (
            self.rank_max_abs_diff == 0.0 and self.total_rel_diff <= self.tolerance
            and not self.findings and not self.buffers
        )  # fmt: skip

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
        lines.append(f"verdict: {'EQUIVALENT' if self.equivalent else 'NOT EQUIVALENT'}")
        return "\n".join(lines)


def check_distributed_equivalence(
    model: nn.Module,
    batch: torch.Tensor | Sequence[torch.Tensor],
    dist_ctx: Any,
    loss_fn: VerifyLossFn | None = None,
    k: int = 4,
    device: torch.device | str = "cpu",
    tolerance: float = DEFAULT_TOLERANCE["fp32"],
) -> DistributedReport:
    """Run on every rank of a torchrun job with the same ``model`` and global ``batch``.

    The batch is split into ``world_size x k`` micro-batches; rank ``r`` accumulates
    micro-batches ``r*k .. r*k+k-1`` through the engine under DDP (gradient sync
    only on the last). Then every rank's gradient is compared with rank 0's and
    with the gradient of one process over the whole batch.
    """
    from bigbatch.distributed import DDPGradSync

    started = time.perf_counter()
    device = torch.device(device)
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    loss_fn = loss_fn or lm_loss
    world, rank = dist_ctx.world_size, dist_ctx.rank
    samples = tensors[0].shape[0]
    if samples < world * k:
        raise ValueError(f"need at least world_size x k = {world * k} samples, got {samples}")
    chunks = torch.tensor_split(torch.arange(samples), world * k)
    parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in chunks[rank * k : (rank + 1) * k]]

    base = copy.deepcopy(model).to(device).train()
    disable_dropout(base)
    findings = scan_cross_sample_modules(base)
    counter = copy.deepcopy(base)  # a forward in training mode may update buffers: never count on ``base``
    with torch.no_grad():
        local = {id(p): int(loss_fn(counter, *p.to(device).tensors)[1]) for p in parts}
    del counter
    n_valid = dist_ctx.sum_int(sum(local.values()), device)
    gathered_counts = dist_ctx.all_gather(torch.tensor([sum(local.values())], device=device))

    replica = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(replica, device_ids=[device.index] if device.type == "cuda" else None)
    engine = AccumulationEngine(
        ddp, torch.optim.SGD(replica.parameters(), lr=0.0), constant_schedule(1.0), grad_clip=0.0,
        device=device, loss_fn=lambda m, b: loss_fn(m, *b.tensors)[0], count_fn=lambda b: local[id(b)],
        grad_sync=DDPGradSync(ddp), dist=dist_ctx,
    )
    replica.zero_grad(set_to_none=True)
    engine.accumulate(parts, n_valid=n_valid)
    flat = _flat(list(_grads(replica).values())).to(device)
    everyone = dist_ctx.all_gather(flat)
    rank_diff = max((g - everyone[0]).abs().max().item() for g in everyone)

    reference = copy.deepcopy(base)
    reference.zero_grad(set_to_none=True)
    loss_sum, _ = loss_fn(reference, *(t.to(device) for t in tensors))
    (loss_sum / n_valid).backward()
    flat_full = _flat(list(_grads(reference).values())).to(device)
    reference_buffers = _buffers(reference)
    differing = [b.name for b in _compare_buffers(reference_buffers, _buffers(replica), tolerance)]
    per_rank = dist_ctx.all_gather_object(differing)
    return DistributedReport(
        world_size=world,
        k=k,
        valid_counts=[int(c.item()) for c in gathered_counts],
        rank_max_abs_diff=rank_diff,
        total_rel_diff=_rel(flat, flat_full),
        tolerance=tolerance,
        seconds=time.perf_counter() - started,
        findings=findings,
        buffers=[f"rank {r}: {name}" for r, names in enumerate(per_rank) for name in names],
        buffers_compared=len(reference_buffers),
    )
