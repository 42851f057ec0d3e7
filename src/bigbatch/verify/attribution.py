"""Where mixing starts: every module's inputs and outputs recorded on the full batch and on the micro-batches,
joined along the sample dimension and compared; the smallest module whose output differs while its inputs
match is named (the model's own forward when that is the root)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.models.coupling import ROOT
from bigbatch.verify.compare import rel_diff
from bigbatch.verify.verdict import Finding


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a module's arguments or output: tensors, (nested) tuples, lists, dicts, model outputs."""
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, dict):  # also Hugging Face ModelOutput
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


class CallRecorder:
    """Forward hooks on every module (the root included) that keep the tensors of each call's inputs and output."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self.names = [name for name, _ in model.named_modules()]
        self._handles = [
            module.register_forward_hook(self._hook(name), with_kwargs=True) for name, module in model.named_modules()
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self.calls.setdefault(name, []).append((tensors_in(args) + tensors_in(kwargs), tensors_in(output)))

        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def split_difference(
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
        return rel_diff(joined.flatten(), reference.flatten())
    return None


@dataclass(frozen=True)
class ModuleComparison:
    output_diff: float | None  # worst over its calls and output tensors; None: nothing comparable
    input_diff: float | None


def compare_calls(
    full: CallRecorder, parts: CallRecorder, sizes: list[int], order: torch.Tensor
) -> dict[str, ModuleComparison]:
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
                    diff = split_difference(whole, [m[side][t] for m in micro], sizes, order)
                    if diff is not None:
                        slot = 0 if side == 1 else 1
                        worst[slot] = diff if worst[slot] is None else max(worst[slot], diff)  # type: ignore[type-var]
        result[name] = ModuleComparison(worst[0], worst[1])
    return result


def is_descendant(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(ancestor + "."))


def attribute(comparisons: dict[str, ModuleComparison], tolerance: float, split: str) -> list[Finding]:
    """The smallest modules whose outputs differ across the split while their inputs match: where mixing starts.

    A module whose inputs already differ shows a downstream effect; a module with a descendant that is itself
    an origin is explained by that descendant. The root ("") stands for the model's own forward."""

    def differs(c: ModuleComparison) -> bool:
        return c.output_diff is not None and c.output_diff > tolerance

    def origin(c: ModuleComparison) -> bool:
        return differs(c) and (c.input_diff is None or c.input_diff <= tolerance)

    origins = [name for name, c in comparisons.items() if origin(c)]
    findings = []
    for name in origins:
        if any(is_descendant(other, name) for other in origins):
            continue
        detail = (
            "the model's own forward mixes samples (its output on the full batch differs from its micro-batch "
            "outputs while its submodules' outputs match)"
            if name == ""
            else "its output on the full batch differs from its micro-batch outputs while its inputs match"
        )
        findings.append(Finding(name or ROOT, "empirical", detail, comparisons[name].output_diff, split))
    return findings
