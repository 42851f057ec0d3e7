"""Proof that the accumulated gradient is the full-batch gradient, for any model.

:func:`check_equivalence` takes a model in training mode, one batch of tensors
(split along the first dimension) and a loss function, and compares

* the full-batch gradient: one forward/backward over all samples, loss = sum / N;
* the gradient the engine accumulates over K micro-batches;
* the two classic mistakes on the same batch: no normalization (each
  micro-batch's mean loss back-propagated as is: K times too large) and
  ``mean / K`` (wrong whenever micro-batches hold different valid counts);
* the parameter update after one optimizer step taken both ways.

It also names what breaks equivalence: modules with cross-sample statistics
(BatchNorm of every kind) found by type, and any module whose output on the
full batch differs from its outputs on the micro-batches (found by hooks).
Dropout cannot match between one big batch and K small ones (the masks differ),
so it is switched off for the comparison and reported.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from bigbatch.accumulate import AccumulationEngine, resolve_precision, token_loss_sum
from bigbatch.model import IGNORE_INDEX
from bigbatch.optim import constant_schedule

VerifyLossFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | int"]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
"""Relative L2 tolerance on the gradient by precision. fp32 differs only by summation order; under
autocast the full batch and the micro-batches round activations differently, so the bounds are looser."""


@dataclass
class TensorBatch:
    """A tuple of tensors that moves to a device together (the engine's micro-batch for verification)."""

    tensors: tuple[torch.Tensor, ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TensorBatch:
        return TensorBatch(tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss for a model returning logits: (sum over valid targets, count of valid targets)."""
    from bigbatch.data.loader import MicroBatch

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


@dataclass
class EquivalenceReport:
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

    @property
    def equivalent(self) -> bool:
        return self.total_rel_diff <= self.tolerance and all(p.within_tolerance for p in self.params)

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
        lines.append(
            f"parameter update after one optimizer step: relative difference {self.update_rel_diff:.2e} "
            "(informational: AdamW divides by |g| + eps, so coordinates whose exact gradient is zero move by rounding)"
        )
        for m in self.mistakes:
            lines.append(f"classic mistake '{m.name}': relative difference {m.rel_diff:.2e}, norm ratio {m.norm_ratio:.3f}")
        for f in self.findings:
            measured = f" (output differs by {f.output_rel_diff:.2e})" if f.output_rel_diff is not None else ""
            lines.append(f"breaks equivalence: {f.module} [{f.kind}] {f.detail}{measured}")
        verdict = "EQUIVALENT" if self.equivalent else "NOT EQUIVALENT"
        lines.append(f"verdict: {verdict}")
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
    """Modules whose training-mode behaviour mixes samples, found by type."""
    findings = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            findings.append(
                Finding(name, type(module).__name__, "normalizes with statistics of the whole batch in training mode")
            )
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            findings.append(
                Finding(
                    name, type(module).__name__,
                    "running statistics are updated K times instead of once (gradients are per sample)",
                )
            )
    return findings


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


class _OutputRecorder:
    """Forward hooks on leaf modules that keep their (input, output) per call, for cross-sample attribution."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        self._handles = []
        for name, module in model.named_modules():
            if name and not any(True for _ in module.children()):
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            first_in = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if isinstance(output, torch.Tensor):
                self.calls.setdefault(name, []).append(
                    (first_in.detach().float() if first_in is not None and first_in.is_floating_point() else None,
                     output.detach().float())
                )

        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _attribute(full: _OutputRecorder, parts: _OutputRecorder, tolerance: float) -> list[Finding]:
    """Leaf modules whose inputs match across the split but whose outputs do not: the origin of a mismatch."""
    findings = []
    for name, full_calls in full.calls.items():
        part_calls = parts.calls.get(name, [])
        if len(full_calls) != 1 or not part_calls:
            continue  # modules called several times per forward are not attributed
        full_in, full_out = full_calls[0]
        if any(out.dim() == 0 for _, out in part_calls) or full_out.dim() == 0:
            continue
        try:
            joined_out = torch.cat([out for _, out in part_calls])
        except RuntimeError:
            continue
        if joined_out.shape != full_out.shape:
            continue
        out_diff = _rel(joined_out.flatten().double(), full_out.flatten().double())
        if out_diff <= tolerance:
            continue
        if full_in is not None and all(i is not None for i, _ in part_calls):
            joined_in = torch.cat([i for i, _ in part_calls])  # type: ignore[misc]
            if joined_in.shape == full_in.shape and _rel(joined_in.flatten().double(), full_in.flatten().double()) > tolerance:
                continue  # the input already differed: a downstream effect, not the origin
        findings.append(Finding(name, "empirical", "its output on the full batch differs from its micro-batch outputs", out_diff))
    return findings


def _unscale(engine: AccumulationEngine) -> None:
    """fp16 gradients carry the GradScaler's scale: divide it out so norms and differences are true values."""
    if engine.scaler.is_enabled():
        engine.scaler.unscale_(engine.optimizer)


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
) -> EquivalenceReport:
    """Compare the full-batch gradient with the engine's K-micro-batch gradient (see the module docstring).

    ``batch`` is a tensor or a sequence of tensors that all share the first
    (sample) dimension; it is split into ``k`` micro-batches with
    ``torch.tensor_split``. ``loss_fn`` defaults to :func:`lm_loss` (a model
    returning logits, batch = (inputs, targets) with -100 for no loss). The
    model is not modified: every pass runs on a copy.
    """
    started = time.perf_counter()
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    samples = tensors[0].shape[0]
    if any(t.shape[0] != samples for t in tensors):
        raise ValueError("every tensor of the batch must share its first (sample) dimension")
    if not 1 <= k <= samples:
        raise ValueError(f"k must be between 1 and the number of samples ({samples}), got {k}")
    loss_fn = loss_fn or lm_loss
    device = torch.device(device)
    precision = resolve_precision(precision, device)
    tolerance = DEFAULT_TOLERANCE[precision] if tolerance is None else tolerance
    make_optimizer = optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0))

    base = copy.deepcopy(model).to(device)
    base.train()
    dropout_disabled = disable_dropout(base)
    findings = scan_cross_sample_modules(base)
    parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in torch.tensor_split(torch.arange(samples), k)]
    full = TensorBatch(tensors)

    counter = copy.deepcopy(base)
    with torch.no_grad():
        counts = {id(p): int(loss_fn(counter, *p.to(device).tensors)[1]) for p in parts}
    del counter
    n_total = sum(counts.values())
    if n_total == 0:
        raise ValueError("the batch holds no valid items to average over")

    def fresh() -> tuple[nn.Module, AccumulationEngine]:
        replica = copy.deepcopy(base)
        engine = AccumulationEngine(
            replica, make_optimizer(replica.parameters()), constant_schedule(1.0), grad_clip=0.0,
            precision=precision, device=device,
            loss_fn=lambda m, b: loss_fn(m, *b.tensors)[0],
            count_fn=lambda b: counts[id(b)],
        )
        # The optimizer's own learning rate applies: the engine's schedule must not override it.
        engine.schedule = lambda _step, lrs=[g["lr"] for g in engine.optimizer.param_groups]: lrs[0]
        engine._set_lr(engine.schedule(0))
        return replica, engine

    # Full batch: one forward/backward, loss = sum / N.
    full_model, full_engine = fresh()
    torch.manual_seed(seed)
    full_recorder = _OutputRecorder(full_model)
    full_model.zero_grad(set_to_none=True)
    counts[id(full)] = n_total
    full_engine.accumulate([full])
    _unscale(full_engine)
    full_recorder.remove()
    g_full = _grads(full_model)

    # Accumulated: the engine over K micro-batches.
    acc_model, acc_engine = fresh()
    torch.manual_seed(seed)
    acc_recorder = _OutputRecorder(acc_model)
    acc_model.zero_grad(set_to_none=True)
    acc_engine.accumulate(parts)
    _unscale(acc_engine)
    acc_recorder.remove()
    g_acc = _grads(acc_model)

    params = []
    for name, gf in g_full.items():
        ga = g_acc[name]
        gf64, ga64 = gf.double().flatten(), ga.double().flatten()
        rel = _rel(ga64, gf64)
        params.append(
            ParamComparison(
                name=name, full_norm=gf64.norm().item(), accumulated_norm=ga64.norm().item(),
                max_abs_diff=(ga64 - gf64).abs().max().item() if gf64.numel() else 0.0,
                rel_diff=rel, cosine=_cosine(ga64, gf64), within_tolerance=True,
            )
        )
    flat_full, flat_acc = _flat(list(g_full.values())), _flat(list(g_acc.values()))
    total_norm = flat_full.norm().item()
    # A parameter passes when its difference is within tolerance of its own gradient norm, or of a floor tied to
    # the whole gradient: coordinates whose true gradient is zero (e.g. attention key biases) hold only rounding.
    floor = tolerance * 1e-3 * total_norm
    params = [
        ParamComparison(**{**p.__dict__, "within_tolerance": p.rel_diff * p.full_norm <= tolerance * p.full_norm + floor})
        for p in params
    ]

    # The classic mistakes, on the same micro-batches.
    mistakes = []
    for name, divide_by_k in (("no normalization (sum of micro-batch means)", False), ("mean / K", True)):
        wrong = copy.deepcopy(base)
        wrong.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        for part in parts:
            with acc_engine.autocast():
                loss_sum, count = loss_fn(wrong, *part.to(device).tensors)
            mean = loss_sum / max(int(count), 1)
            (mean / k if divide_by_k else mean).backward()
        flat_wrong = _flat(list(_grads(wrong).values()))
        mistakes.append(Mistake(name, _rel(flat_wrong, flat_full), flat_wrong.norm().item() / max(total_norm, 1e-300)))

    # One optimizer step both ways: compare the updates.
    before = _flat([p.detach() for p in base.parameters()])
    full_engine.optimizer.step()
    acc_engine.optimizer.step()
    update_full = _flat([p.detach() for p in full_model.parameters()]) - before
    update_acc = _flat([p.detach() for p in acc_model.parameters()]) - before

    findings += [f for f in _attribute(full_recorder, acc_recorder, tolerance) if f.module not in {x.module for x in findings}]
    return EquivalenceReport(
        k=k,
        samples=samples,
        valid_counts=[counts[id(p)] for p in parts],
        precision=precision,
        tolerance=tolerance,
        params=params,
        total_rel_diff=_rel(flat_acc, flat_full),
        total_cosine=_cosine(flat_acc, flat_full),
        max_abs_diff=(flat_acc - flat_full).abs().max().item(),
        mistakes=mistakes,
        update_rel_diff=_rel(update_acc, update_full),
        findings=findings,
        dropout_disabled=dropout_disabled,
        seconds=time.perf_counter() - started,
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

    @property
    def equivalent(self) -> bool:
        return self.rank_max_abs_diff == 0.0 and self.total_rel_diff <= self.tolerance

    def format(self) -> str:
        verdict = "EQUIVALENT" if self.equivalent else "NOT EQUIVALENT"
        return "\n".join(
            [
                f"verify | DDP | world {self.world_size} x K {self.k} | valid targets per rank {self.valid_counts} "
                f"| {self.seconds:.1f}s",
                f"gradients after the sync step: identical on every rank (max |g_r - g_0| = {self.rank_max_abs_diff:.1e})"
                if self.rank_max_abs_diff == 0.0
                else f"gradients after the sync step DIFFER across ranks: max |g_r - g_0| = {self.rank_max_abs_diff:.2e}",
                f"DDP accumulated vs single-process full batch: relative L2 difference {self.total_rel_diff:.2e} "
                f"(tolerance {self.tolerance:.0e})",
                f"verdict: {verdict}",
            ]
        )


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
    import torch.distributed as torch_dist

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
    with torch.no_grad():
        local = {id(p): int(loss_fn(base, *p.to(device).tensors)[1]) for p in parts}
    n_valid = dist_ctx.sum_int(sum(local.values()), device)
    counts = torch.tensor([sum(local.values())], device=device)
    gathered_counts = [torch.zeros_like(counts) for _ in range(world)]
    torch_dist.all_gather(gathered_counts, counts)

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
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    torch_dist.all_gather(everyone, flat)
    rank_diff = max((g - everyone[0]).abs().max().item() for g in everyone)

    reference = copy.deepcopy(base)
    reference.zero_grad(set_to_none=True)
    loss_sum, _ = loss_fn(reference, *(t.to(device) for t in tensors))
    (loss_sum / n_valid).backward()
    flat_full = _flat(list(_grads(reference).values())).to(device)
    return DistributedReport(
        world_size=world,
        k=k,
        valid_counts=[int(c.item()) for c in gathered_counts],
        rank_max_abs_diff=rank_diff,
        total_rel_diff=_rel(flat, flat_full),
        tolerance=tolerance,
        seconds=time.perf_counter() - started,
    )
