"""Which of a model's parameters Muon trains, found by role and shape for every family, each with its layout as the
model gives it (:meth:`~bigbatch.models.decoder.DecoderLM.matrix_layout`: a fused q/k/v or gate/up weight is
several matrices)."""

from __future__ import annotations

import torch.nn as nn

from bigbatch.models.matrix_layout import MatrixLayout
from bigbatch.models.routing import is_router_path


def muon_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter, MatrixLayout]]:
    """The hidden matrices Muon trains, by role and shape, for every family, with their layouts: trainable
    parameters of two or more dimensions (an MoE's expert stacks (E, m, n) are E matrices) inside the model's
    repeated blocks, each dimension above 1; routers (by name: :func:`is_router_path`) and any embedding table
    left out. Embeddings, position tables, the head and every gain and bias are outside the blocks or
    one-dimensional: AdamW trains them."""
    listed = getattr(model, "blocks", None)
    blocks = listed() if callable(listed) else []
    layout_of = getattr(model, "matrix_layout", None)  # the model says how its weights hold their matrices
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
                    layout = layout_of(module_name, module, name, param) if callable(layout_of) else MatrixLayout()
                    found.append((full, param, layout))
    return found


def muon_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """:func:`muon_matrices` without the layouts."""
    return [(name, param) for name, param, _ in muon_matrices(model)]
