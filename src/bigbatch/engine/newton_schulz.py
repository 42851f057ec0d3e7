"""Newton-Schulz orthogonalisation: an approximately orthogonal matrix with a matrix's singular vectors (the polar
factor ``U V^T`` of ``U S V^T``) from a few iterations of an odd matrix polynomial, its coefficients, the scale
Muon puts on the result and its cost in FLOPs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)
"""Jordan's quintic: steep at zero, so five iterations move every singular value above about 1e-2 of the matrix's
Frobenius norm (by which it is first divided) into roughly 0.68-1.2 (never to exactly 1: it trades the limit for
speed)."""

POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
"""Amsel et al., 2025 ("The Polar Express", arXiv 2505.16932): a different minimax-optimal quintic per iteration
for singular values in [1e-3, 1] after the division by the Frobenius norm; five leave those in about 0.86-1.14."""

CONVERGENT = (15 / 8, -10 / 8, 3 / 8)
"""The classical quintic Newton-Schulz step: 1 is a fixed point with zero first and second derivatives, so from
the band above each iteration roughly cubes the distance to 1. ``polar-express`` runs it after its five."""

COEFFICIENTS = ("quintic", "polar-express")
SCALES = ("rms", "spectral")
NORM_EPS = 1e-7  # keeps a zero gradient's update zero


def iteration_coefficients(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations ``X <- a X + b (X X^T) X + c (X X^T)^2 X``."""
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one iteration, got {steps}")
    if name == "quintic":
        return [QUINTIC] * steps
    if name == "polar-express":
        return list(POLAR_EXPRESS[:steps]) + [CONVERGENT] * max(0, steps - len(POLAR_EXPRESS))
    raise ValueError(f"unknown Newton-Schulz coefficients {name!r}; choose one of {', '.join(COEFFICIENTS)}")


def orthogonalise(matrix: torch.Tensor, steps: int = 5, coefficients: str = "quintic") -> torch.Tensor:
    """An approximately orthogonal matrix with ``matrix``'s singular vectors: ``matrix`` (..., m, n), each trailing
    (m, n) matrix on its own (an MoE's expert stack (E, m, n) gives E of them). Computed in fp32 (float64 stays
    float64), normalised by the Frobenius norm first (which bounds the spectral norm), on the wide orientation so
    the Gram matrix is the smaller one; the result has ``matrix``'s dtype."""
    x = matrix if matrix.dtype == torch.float64 else matrix.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for a, b, c in iteration_coefficients(coefficients, steps):
        gram = x @ x.mT  # (..., min, min)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


def update_scale(shape: Sequence[int], scale: str) -> float:
    """The factor on an orthogonalised update of a matrix of ``shape`` (..., m, n). ``rms``: 0.2 sqrt(max(m, n)),
    which gives the update the RMS of a typical AdamW update (Liu et al., 2025, "Muon is scalable"), so AdamW's
    learning rate and weight decay carry over. ``spectral``: sqrt(max(1, m / n)) (Jordan's; its learning rate is
    about 0.02)."""
    m, n = int(shape[-2]), int(shape[-1])
    if scale == "rms":
        return 0.2 * math.sqrt(max(m, n))
    if scale == "spectral":
        return math.sqrt(max(1.0, m / n))
    raise ValueError(f"unknown Muon update scale {scale!r}; choose one of {', '.join(SCALES)}")


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """The multiply-add FLOPs (2 per multiply-add) of ``steps`` iterations on a matrix of ``shape`` (..., m, n),
    with ``s = min(m, n)``, ``l = max(m, n)``: the Gram matrix (s x l x s), its square (s^3) and the product with
    ``X`` (s x s x l), each iteration."""
    *batch, m, n = (int(d) for d in shape)
    small, large = min(m, n), max(m, n)
    return math.prod(batch) * steps * 2 * (2 * small * small * large + small**3)
