"""Parameter comparison shared by the engine's tests and the multi-process tests."""

from __future__ import annotations

import torch

from bigbatch.model import GPT

TOL = 1e-5
CONDITIONING_SLACK = 10.0  # as in fuzz_reference.py: bigbatch may be this many times as far as plain fp32


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_parameters_match(model: GPT, reference: GPT, exact: torch.nn.Module | None = None) -> None:
    """Every parameter within ``TOL`` relative L2, with one documented exception.

    The key slice of each attention's ``c_attn.bias`` has an exact gradient of
    zero (adding a constant to every score of a query leaves the softmax
    unchanged), so its fp32 gradient is pure rounding noise that AdamW's
    normalization turns into moves of up to ~lr * noise / eps. That slice is held
    to a small absolute bound instead; the query and value slices to ``TOL``.

    ``exact``: the same reference computed in float64. Some settings amplify
    rounding so much that fp32 itself lands beyond ``TOL`` from exact (biases
    that start at zero and have moved a few learning rates; see "Conditioning"
    in fuzz_reference.py); there ``TOL`` would hold for one machine's rounding
    only. With ``exact``, each tensor's bar is ``max(TOL, CONDITIONING_SLACK x
    how far the fp32 reference lands from exact)``, the fuzzer's rule.
    """
    c = model.config.n_embd
    exact_parameters = list(exact.parameters()) if exact is not None else [None] * len(list(reference.parameters()))

    def bar(p_ref: torch.Tensor, p_exact: torch.Tensor | None) -> float:
        if p_exact is None:
            return TOL
        return max(TOL, CONDITIONING_SLACK * rel_diff(p_ref.double(), p_exact.detach().double()))

    for (name, p), p_ref, p_exact in zip(model.named_parameters(), reference.parameters(), exact_parameters, strict=True):
        p, p_ref = p.detach(), p_ref.detach()
        if name.endswith("attn.c_attn.bias"):
            q, k, v = p.split(c)
            q_ref, k_ref, v_ref = p_ref.split(c)
            q_exact, _, v_exact = p_exact.split(c) if p_exact is not None else (None, None, None)
            assert rel_diff(q, q_ref) <= bar(q_ref, q_exact) and rel_diff(v, v_ref) <= bar(v_ref, v_exact), name
            assert (k - k_ref).abs().max().item() <= 1e-5, name
            continue
        assert rel_diff(p, p_ref) <= bar(p_ref, p_exact), name
