"""One process: the full-batch pass against the engine's accumulated passes over every split of the batch."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine, resolve_precision
from bigbatch.engine.muon import MuonSettings, build_muon
from bigbatch.engine.optim import constant_schedule
from bigbatch.engine.rng import preserved_rng
from bigbatch.models.routing import router_recorder
from bigbatch.verify.attribution import CallRecorder, ModuleComparison, attribute, compare_calls
from bigbatch.verify.compare import (
    buffer_owner,
    buffers_of,
    compare_buffers,
    compare_params,
    cosine,
    flat,
    gradients,
    rel_diff,
)
from bigbatch.verify.inputs import (
    DEFAULT_TOLERANCE,
    SPLITS,
    OptimizerFactory,
    TensorBatch,
    VerifyLossFn,
    disable_dropout,
    lm_loss,
    scan_cross_sample_modules,
    split_indices,
    tensor_batch_objective,
)
from bigbatch.verify.verdict import LOSS, ROUTER_LOSS, EquivalenceReport, Finding, Mistake, SplitResult


@dataclass
class _Pass:
    """One forward/backward through the engine (the full batch as one part, or a split's micro-batches)."""

    model: nn.Module
    engine: AccumulationEngine
    calls: CallRecorder
    loss_sum: float
    grads: dict[str, torch.Tensor]
    flat: torch.Tensor  # every gradient, flattened, float64


class _Runner:
    """Runs passes on fresh copies of the model, counting each part's valid items once."""

    def __init__(
        self,
        base: nn.Module,
        loss_fn: VerifyLossFn,
        precision: str,
        device: torch.device,
        seed: int,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        router_balance: str = "exact",
    ) -> None:
        self.base, self.loss_fn, self.precision, self.device, self.seed = base, loss_fn, precision, device, seed
        self.make_optimizer = make_optimizer
        self.router_balance = router_balance
        self._counter = copy.deepcopy(base)  # a forward in training mode may update buffers: never count on base
        self._counts: dict[int, tuple[TensorBatch, int]] = {}  # id -> (the part, kept alive so its id stays; count)

    def count(self, part: TensorBatch) -> int:
        if id(part) not in self._counts:
            with torch.no_grad():
                items = int(self.loss_fn(self._counter, *part.to(self.device).tensors)[1])
            self._counts[id(part)] = (part, items)
        return self._counts[id(part)][1]

    def run(self, parts: list[TensorBatch], n_valid: int, router_balance: str | None = None) -> _Pass:
        """Forward and backward over ``parts`` through the engine, gradients in true units (fp16 unscaled); a
        mixture of experts' balancing loss as ``router_balance`` (default: the runner's) says."""
        replica = copy.deepcopy(self.base)
        engine = AccumulationEngine(
            replica,
            self.make_optimizer(replica),
            constant_schedule(1.0),
            grad_clip=0.0,
            precision=self.precision,
            device=self.device,
            objective=tensor_batch_objective(self.loss_fn, self.count, router_balance or self.router_balance),
        )
        lr = float(engine.optimizer.defaults["lr"])  # the optimizer's own (the engine has set the schedule's)
        engine.schedule = constant_schedule(lr)
        engine._set_step_settings(lr)
        torch.manual_seed(self.seed)
        recorder = CallRecorder(replica)
        replica.zero_grad(set_to_none=True)
        loss_sum, _ = engine.accumulate(parts, n_valid=n_valid)
        if engine.scaler.is_enabled():  # fp16: divide the GradScaler's scale out of the gradients
            engine.scaler.unscale_(engine.optimizer)
        recorder.remove()
        grads = gradients(replica)
        return _Pass(replica, engine, recorder, float(loss_sum[0]), grads, flat(list(grads.values())))


def _optimizer_maker(optimizer: str, factory: OptimizerFactory | None) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """The optimizer each pass steps with, made from the pass's copy of the model."""
    if factory is not None:
        return lambda module: factory(module.parameters())
    if optimizer == "muon":
        return lambda module: build_muon(module, MuonSettings(lr=1e-3, weight_decay=0.0), lr=1e-3, weight_decay=0.0)
    if optimizer != "adamw":
        raise ValueError(f"optimizer must be adamw or muon, got {optimizer!r}")
    return lambda module: torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)


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
    unpacked: Sequence[torch.Tensor] | None = None,
    router_balance: str = "exact",
    optimizer: str = "adamw",
) -> EquivalenceReport:
    """Compare the full-batch gradient with the engine's accumulated gradient (see :mod:`bigbatch.verify`).

    ``batch`` is a tensor or a sequence of tensors that all share the first (sample) dimension. It is cut into
    micro-batches by each of ``splits`` (see :data:`SPLITS`; ``equal`` uses ``k`` pieces, as does ``permuted``).
    ``loss_fn`` defaults to :func:`lm_loss` (a model returning logits, batch = (inputs, targets) with -100 for no
    loss). The model is not modified: every pass runs on a copy. ``unpacked``: ``batch`` holds rows packed with
    several documents (inputs, targets, positions) and this is the same documents each in its own padded row; the
    full-batch gradients of the two are compared too (:attr:`EquivalenceReport.packing_rel_diff`; different valid
    counts are one of its :attr:`~EquivalenceReport.packing_problems`). ``router_balance``: a mixture of experts'
    balancing loss mode (:mod:`bigbatch.engine.router_balance`); one that is not exact is named as the coupling.
    ``optimizer``: the update after one step is taken with AdamW (lr 1e-3, no weight decay) or ``muon`` (Muon
    for the hidden matrices, AdamW for the rest, both lr 1e-3, no weight decay); ``optimizer_factory`` (given the
    model's parameters) replaces either.
    """
    started = time.perf_counter()
    tensors, splits = _checked_inputs(batch, k, splits)
    samples = tensors[0].shape[0]
    device = torch.device(device)
    precision = resolve_precision(precision, device)
    tolerance = DEFAULT_TOLERANCE[precision] if tolerance is None else tolerance

    base = copy.deepcopy(model).to(device).train()
    dropout_disabled = disable_dropout(base)
    make_optimizer = _optimizer_maker(optimizer, optimizer_factory)
    runner = _Runner(base, loss_fn or lm_loss, precision, device, seed, make_optimizer, router_balance)
    full_batch = TensorBatch(tensors)
    n_total = runner.count(full_batch)
    if n_total == 0:
        raise ValueError("the batch holds no valid items to average over")

    full = runner.run([full_batch], n_total)
    packing_rel_diff, packing_problems = _packing_comparison(runner, unpacked, full, n_total)
    before = flat([p.detach() for p in base.parameters()])
    full.engine.optimizer.step()
    update_full = flat([p.detach() for p in full.model.parameters()]) - before
    buffers_full = buffers_of(full.model)

    findings = scan_cross_sample_modules(base)
    results, update_rel_diff = _compare_splits(
        runner, tensors, splits, k, seed, n_total, full, before, update_full, buffers_full, tolerance, findings
    )

    return EquivalenceReport(
        packing_rel_diff=packing_rel_diff,
        packing_problems=packing_problems,
        k=len(results[0].sizes),
        samples=samples,
        valid_counts=results[0].valid_counts,
        precision=precision,
        tolerance=tolerance,
        params=results[0].params,
        total_rel_diff=results[0].total_rel_diff,
        total_cosine=results[0].total_cosine,
        max_abs_diff=results[0].max_abs_diff,
        mistakes=_classic_mistakes(runner, tensors, split_indices(samples, k, splits[0], seed), full),
        update_rel_diff=update_rel_diff,
        optimizer="custom" if optimizer_factory is not None else optimizer,
        findings=findings,
        dropout_disabled=dropout_disabled,
        seconds=time.perf_counter() - started,
        splits=results,
        buffers_compared=len(buffers_full),
    )


def _compare_splits(
    runner: _Runner,
    tensors: tuple[torch.Tensor, ...],
    splits: list[str],
    k: int,
    seed: int,
    n_total: int,
    full: _Pass,
    before: torch.Tensor,
    update_full: torch.Tensor,
    buffers_full: dict[str, torch.Tensor],
    tolerance: float,
    findings: list[Finding],
) -> tuple[list[SplitResult], float]:
    """Accumulate each split's micro-batches and compare them with the full batch (``findings`` gains what each
    split breaks); (the splits' results, the first split's optimizer-update difference)."""
    results: list[SplitResult] = []
    samples = tensors[0].shape[0]
    update_rel_diff = 0.0
    for split in splits:
        indices = split_indices(samples, k, split, seed)
        parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in indices]
        sizes = [int(idx.numel()) for idx in indices]
        try:
            acc = runner.run(parts, n_total)
        except (RuntimeError, ValueError) as exc:  # e.g. BatchNorm refuses a micro-batch of one sample
            if split == splits[0]:
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            results.append(SplitResult(split, sizes, [], [], math.inf, 0.0, math.inf, [], tolerance, message))
            continue
        acc.engine.optimizer.step()
        if split == splits[0]:
            update_rel_diff = rel_diff(flat([p.detach() for p in acc.model.parameters()]) - before, update_full)
        result = _split_result(split, sizes, [runner.count(p) for p in parts], full, acc, buffers_full, tolerance)
        results.append(result)
        if not result.gradient_matches and _inexact_router(runner):
            findings += _router_findings(runner, parts, n_total, full, result, findings)
            continue
        comparisons = compare_calls(full.calls, acc.calls, sizes, torch.cat(indices))
        findings += _split_findings(result, comparisons, findings, full.loss_sum, acc.loss_sum, tolerance)
    return results, update_rel_diff


def _inexact_router(runner: _Runner) -> bool:
    return runner.router_balance != "exact" and router_recorder(runner.base) is not None


def _router_findings(
    runner: _Runner,
    parts: list[TensorBatch],
    n_total: int,
    full: _Pass,
    result: SplitResult,
    known: list[Finding],
) -> list[Finding]:
    """A split whose gradient differs under a router balance that is not exact: the same split with ``exact``
    says whether the balancing loss is what couples the micro-batches, and by how much."""
    if any(f.module == ROUTER_LOSS for f in known):
        return []
    exact = rel_diff(runner.run(parts, n_total, router_balance="exact").flat, full.flat)
    mode = runner.router_balance
    how = {
        "running": "weights each micro-batch by the expert counts of the micro-batches so far",
        "micro": "balances each micro-batch on its own",
    }.get(mode, f"accumulates it as {mode}")
    return [
        Finding(
            ROUTER_LOSS,
            "router",
            f"the load-balancing loss couples the micro-batches: --router-balance {mode} {how}, not by the step's "
            f"counts (gradient distance {result.total_rel_diff:.2e}; with exact {exact:.2e})",
            split=result.name,
        )
    ]


def _checked_inputs(
    batch: torch.Tensor | Sequence[torch.Tensor], k: int, splits: Sequence[str]
) -> tuple[tuple[torch.Tensor, ...], list[str]]:
    """The batch's tensors and the splits without repeats, or a ValueError saying what does not fit."""
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    samples = tensors[0].shape[0]
    if any(t.shape[0] != samples for t in tensors):
        raise ValueError("every tensor of the batch must share its first (sample) dimension")
    if not 1 <= k <= samples:
        raise ValueError(f"k must be between 1 and the number of samples ({samples}), got {k}")
    unique = list(dict.fromkeys(splits))
    if not unique or any(s not in SPLITS for s in unique):
        raise ValueError(f"splits must be one or more of {', '.join(SPLITS)}, got {', '.join(unique) or 'none'}")
    return tensors, unique


def _packing_comparison(
    runner: _Runner, unpacked: Sequence[torch.Tensor] | None, full: _Pass, n_total: int
) -> tuple[float | None, list[str]]:
    """The packed rows' full-batch gradient against the same documents each in its own row: (relative
    difference, or ``None`` when not compared; problems)."""
    if unpacked is None:
        return None, []
    one_per_row = TensorBatch(tuple(unpacked))
    n_unpacked = runner.count(one_per_row)
    if n_unpacked != n_total:  # the packed rows lost or gained targets: their gradient cannot be the documents'
        return None, [f"the packed rows hold {n_total:,} valid targets, the same documents one per row {n_unpacked:,}"]
    return rel_diff(runner.run([one_per_row], n_total).flat, full.flat), []


def _split_result(
    split: str,
    sizes: list[int],
    valid_counts: list[int],
    full: _Pass,
    acc: _Pass,
    buffers_full: dict[str, torch.Tensor],
    tolerance: float,
) -> SplitResult:
    """One split's accumulated gradient and buffers against the full batch's."""
    return SplitResult(
        name=split,
        sizes=sizes,
        valid_counts=valid_counts,
        params=compare_params(full.grads, acc.grads, tolerance),
        total_rel_diff=rel_diff(acc.flat, full.flat),
        total_cosine=cosine(acc.flat, full.flat),
        max_abs_diff=(acc.flat - full.flat).abs().max().item(),
        buffers=compare_buffers(buffers_full, buffers_of(acc.model), tolerance),
        tolerance=tolerance,
    )


def _split_findings(
    result: SplitResult,
    comparisons: dict[str, ModuleComparison],
    known: list[Finding],
    full_loss: float,
    split_loss: float,
    tolerance: float,
) -> list[Finding]:
    """What a split exposed that the findings so far do not name: the module where mixing starts, the owner
    of a differing buffer, or the loss function (every module's output matches, yet losses or gradients do not)."""
    named = {f.module for f in known}
    found = [f for f in attribute(comparisons, tolerance, result.name) if f.module not in named]
    for b in result.buffers:
        owner = buffer_owner(b.name)
        if owner not in named and all((f.module, f.kind) != (owner, "buffer") for f in found):
            found.append(Finding(owner, "buffer", f"buffer {b.name} differs after the step", b.rel_diff, result.name))
    root = comparisons.get("")
    model_matches = root is not None and root.output_diff is not None and root.output_diff <= tolerance
    loss_diff = abs(split_loss - full_loss) / max(abs(full_loss), 1e-30)
    if model_matches and LOSS not in named and (loss_diff > tolerance or not result.gradient_matches):
        found.append(
            Finding(
                LOSS,
                "loss",
                "the loss function couples samples: the model's outputs match across the split but the "
                f"per-micro-batch loss sums add up to a different total (relative difference {loss_diff:.2e}) "
                "or give a different gradient",
                split=result.name,
            )
        )
    return found


def _classic_mistakes(
    runner: _Runner, tensors: tuple[torch.Tensor, ...], indices: list[torch.Tensor], full: _Pass
) -> list[Mistake]:
    """The two classic mistakes on one split's micro-batches: each micro-batch's mean back-propagated as is
    (K times too large), and ``mean / K`` (wrong whenever micro-batches hold different valid counts)."""
    parts = [TensorBatch(tuple(t[idx] for t in tensors)) for idx in indices]
    total_norm = full.flat.norm().item()
    mistakes = []
    for name, divide_by_k in (("no normalization (sum of micro-batch means)", False), ("mean / K", True)):
        wrong = copy.deepcopy(runner.base)
        wrong.zero_grad(set_to_none=True)
        torch.manual_seed(runner.seed)
        for part in parts:
            with full.engine.autocast():
                loss_sum, count = runner.loss_fn(wrong, *part.to(runner.device).tensors)
            mean = loss_sum / max(int(count), 1)
            (mean / len(parts) if divide_by_k else mean).backward()
        flat_wrong = flat(list(gradients(wrong).values()))
        ratio = flat_wrong.norm().item() / max(total_norm, 1e-300)
        mistakes.append(Mistake(name, rel_diff(flat_wrong, full.flat), ratio))
    return mistakes
