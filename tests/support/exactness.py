"""Parameter comparison shared by the engine's tests and the multi-process tests."""

from __future__ import annotations

import torch

from bigbatch.model import GPT

TOL = 1e-5


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_parameters_match(model: GPT, reference: GPT) -> None:
    """Every parameter within ``TOL`` relative L2, with one documented exception.

    The key slice of each attention's ``c_attn.bias`` has an exact gradient of
    zero (adding a constant to every score of a query leaves the softmax
    unchanged), so its fp32 gradient is pure rounding noise that AdamW's
    normalization turns into moves of up to ~lr * noise / eps. That slice is held
    to a small absolute bound instead; the query and value slices to ``TOL``.
    """
    c = model.config.n_embd
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        p, p_ref = p.detach(), p_ref.detach()
        if name.endswith("attn.c_attn.bias"):
            q, k, v = p.split(c)
            q_ref, k_ref, v_ref = p_ref.split(c)
            assert rel_diff(q, q_ref) <= TOL and rel_diff(v, v_ref) <= TOL, name
            assert (k - k_ref).abs().max().item() <= 1e-5, name
            continue
        assert rel_diff(p, p_ref) <= TOL, name
