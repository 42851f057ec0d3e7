"""How a transformers model's weights hold their matrices (:class:`~bigbatch.models.matrix_layout.MatrixLayout`),
read from the layer types and names transformers uses: its Conv1D (GPT-2) stores (in, out), ``c_attn`` fuses q, k
and v, ``gate_up_proj`` gate and up."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from bigbatch.models.matrix_layout import MatrixLayout

WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
"""config.json keys of MLP widths: a fused gate-and-up weight holds two of one of them."""


def mlp_widths(config: Any) -> set[int]:
    """The MLP widths ``config`` (a transformers config) names."""
    widths = set()
    for key in WIDTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            widths.add(value)
    return widths


def hf_matrix_layout(
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
