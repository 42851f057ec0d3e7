"""Which of a model's parameters Muon trains, found by role and shape for every family, and how each weight holds
its matrices (a fused q/k/v or gate/up weight is several; transformers' Conv1D stores (in, out))."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from bigbatch.models.routing import is_router_path


@dataclass(frozen=True)
class MatrixLayout:
    """How one weight holds its matrices: ``parts`` matrices fused along ``dim`` (-2: stacked rows, as q, k and v
    in GPT's ``c_attn`` or gate and up in ``gate_up_proj``; -1: side by side, as in transformers' Conv1D ``c_attn``),
    each orthogonalised on its own as if they were separate weights (as nanochat's separate q, k, v are);
    ``transposed``: stored (in, out), as transformers' Conv1D stores its weight."""

    parts: int = 1
    dim: int = -2
    transposed: bool = False

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(..., m, n) -> (..., parts, m', n'): each fused matrix in the last two dimensions."""
        if self.parts == 1:
            return x
        if self.dim == -2:
            return x.unflatten(-2, (self.parts, x.size(-2) // self.parts))
        return x.unflatten(-1, (self.parts, x.size(-1) // self.parts)).movedim(-2, -3)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`."""
        if self.parts == 1:
            return x
        if self.dim == -2:
            return x.flatten(-3, -2)
        return x.movedim(-3, -2).flatten(-2, -1)

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """(out, in) of each of the weight's matrices."""
        m, n = int(shape[-2]), int(shape[-1])
        if self.dim == -2:
            m //= self.parts
        else:
            n //= self.parts
        return (n, m) if self.transposed else (m, n)


def _widths(model: nn.Module) -> set[int]:
    """The MLP widths the model's configs name: a fused gate-and-up weight holds two of one of them."""
    widths = set()
    for config in (getattr(model, "config", None), getattr(getattr(model, "hf_model", None), "config", None)):
        for key in ("ffn_hidden", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                widths.add(value)
    return widths


def matrix_layout(
    module: nn.Module, module_name: str, name: str, param: torch.Tensor, widths: set[int]
) -> MatrixLayout:
    """The layout of ``param`` (``name`` in ``module``): transformers' Conv1D is stored (in, out); ``c_attn`` holds
    q, k and v (three equal parts along the output); ``gate_up_proj`` gate then up (two halves of the output rows,
    when the output is twice an MLP width of the config: not gpt-oss's interleaved (E, in, 2F)). Any other weight
    is one matrix (or an expert stack of them); other fused layouts (Phi-3's ``qkv_proj`` of unequal parts) are
    orthogonalised whole."""
    conv1d = type(module).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight (in, out)
    last = module_name.rsplit(".", 1)[-1]
    rows, cols = int(param.shape[-2]), int(param.shape[-1])
    if last == "c_attn" and name == "weight":
        if conv1d and cols == 3 * rows:
            return MatrixLayout(3, -1, transposed=True)
        if not conv1d and rows == 3 * cols:
            return MatrixLayout(3, -2)
    if "gate_up_proj" in (name, last) and rows % 2 == 0 and rows // 2 in widths:
        return MatrixLayout(2, -2, transposed=conv1d)
    return MatrixLayout(transposed=conv1d)


def muon_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter, MatrixLayout]]:
    """The hidden matrices Muon trains, by role and shape, for every family, with their layouts: trainable
    parameters of two or more dimensions (an MoE's expert stacks (E, m, n) are E matrices) inside the model's
    repeated blocks, each dimension above 1; routers (by name: :func:`is_router_path`) and any embedding table
    left out. Embeddings, position tables, the head and every gain and bias are outside the blocks or
    one-dimensional: AdamW trains them."""
    listed = getattr(model, "blocks", None)
    blocks = listed() if callable(listed) else []
    widths = _widths(model)
    found: list[tuple[str, nn.Parameter, MatrixLayout]] = []
    seen: set[int] = set()
    for index, block in enumerate(blocks):
        for module_name, module in block.named_modules():
            if is_router_path(module_name) or isinstance(module, nn.Embedding):
                continue
            for name, param in module.named_parameters(recurse=False):
                full = f"{index}.{module_name}.{name}" if module_name else f"{index}.{name}"
                if param.requires_grad and param.dim() >= 2 and min(param.shape) > 1 and id(param) not in seen:
                    seen.add(id(param))
                    found.append((full, param, matrix_layout(module, module_name, name, param, widths)))
    return found


def muon_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """:func:`muon_matrices` without the layouts."""
    return [(name, param) for name, param, _ in muon_matrices(model)]
