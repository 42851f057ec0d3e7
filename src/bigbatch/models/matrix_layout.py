"""How a weight holds its matrices, as its model says (:meth:`~bigbatch.models.decoder.DecoderLM.matrix_layout`):
one matrix, or several fused (q, k and v in one weight; gate and up), stored (out, in) or (in, out). An optimizer
that works on whole matrices (Muon) asks, so that it treats a fused weight as the separate weights it stands for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
