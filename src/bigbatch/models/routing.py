"""What a mixture of experts' router tells the trainer, whatever the family: one :class:`RoutedTokens` per MoE
layer and forward, gathered by the model's :class:`RouterRecorder`, and the :class:`RouterSpec` that says how the
model defines its load-balancing loss.

The load-balancing loss of a set of tokens is ``E * sum_e f_e * P_e``: ``f_e`` the share of the tokens routed to
expert ``e`` (a constant: top-k has no gradient), ``P_e`` their mean router probability for ``e``. It is linear in
the per-token probabilities once ``f`` is known, so the trainer needs, per layer, the routed counts (no gradient)
and the *sums* of the probabilities (with gradient) of the tokens it counts (:class:`RouterStats`), and weights
the sums by the step's ``f`` (:mod:`bigbatch.engine.router_balance`). The tokens counted are those the step trains
on (a valid target): padding and masked prompts are routed but not balanced, so packing documents into rows or
padding them one per row changes nothing. A layer reports its probabilities and choices for every token on every
forward, recomputation included, so activation checkpointing replays the same operations; only a forward the
trainer records (:meth:`RouterRecorder.recording`) keeps them, and the counting happens outside the blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

SCORINGS = ("softmax", "topk-softmax")
"""How a router's probabilities ``P`` come from its logits: ``softmax`` over every expert (then top-k picks the
experts), or ``topk-softmax``: the top-k logits picked first, their softmax the probabilities (0 elsewhere)."""

POOLINGS = ("layer", "pooled")
"""How a model pools its MoE layers into one balancing loss: ``layer`` (each layer's own ``f`` and ``P``, the
losses averaged over layers: bigbatch's family) or ``pooled`` (every layer's tokens counted together, one ``f`` and
``P``: transformers' ``load_balancing_loss_func`` for Mixtral, Qwen2/3-MoE and OLMoE)."""


ROUTER_NAMES = ("gate", "router")


def is_router_path(path: str) -> bool:
    """Whether the module at ``path`` (dotted, inside a block) is a mixture's router or a part of one: a part of
    the path named ``gate`` or ``router``, or ending in ``_gate`` or ``_router`` (``gate_proj``, an MLP
    projection, is neither). By name, never by width: a projection may be as wide as there are experts."""
    return any(part in ROUTER_NAMES or part.endswith(("_gate", "_router")) for part in path.split("."))


@dataclass(frozen=True)
class RouterSpec:
    """How a model's balancing loss is defined: ``n_expert`` routed experts, ``top_k`` per token, over
    ``n_moe_layer`` layers pooled as ``pooling``; ``per_assignment``: ``f_e`` is the share of the ``top_k x tokens``
    assignments (1 at balance) rather than of the tokens (``top_k`` at balance, transformers'); the coefficients
    the model's config gives (``aux_coef`` for the balancing loss, ``z_coef`` for the router z-loss); ``scoring``
    (:data:`SCORINGS`) how the probabilities come from the logits."""

    n_expert: int
    top_k: int
    n_moe_layer: int
    pooling: str
    per_assignment: bool
    aux_coef: float
    z_coef: float = 0.0
    scoring: str = "softmax"

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"router pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}")

    def balance_weights(self, counts: torch.Tensor, tokens: float | torch.Tensor) -> torch.Tensor:
        """The weights ``W`` (layers, E) such that the balancing loss of a set of ``tokens`` tokens whose routed
        ``counts`` (layers, E) and probability sums ``S`` (layers, E) are known is ``sum(W * S)`` (no coefficient)."""
        layers = counts.shape[0]
        counts = counts.float()
        if self.pooling == "pooled":  # one f over every layer's tokens: sum_l counts / (L T)
            counts = counts.sum(0, keepdim=True).expand(layers, -1)
            tokens = tokens * layers
        share = counts / (tokens * (self.top_k if self.per_assignment else 1))  # f: (layers, E)
        per_layer = self.n_expert * share / tokens  # P = S / T
        return per_layer / layers if self.pooling == "layer" else per_layer


@dataclass(frozen=True)
class RouterStats:
    """One MoE layer's routing of the counted tokens of one forward: ``counts`` (E,) fp32, the tokens routed to
    each expert (every top-k slot counts; no gradient); ``prob_sums`` (E,) fp32, the sum over tokens of the
    router's probabilities (with gradient); ``z_sum`` 0-d fp32, the sum over tokens of
    ``logsumexp(router logits)^2`` (with gradient); ``tokens`` 0-d fp32, the tokens counted (a tensor: reading it
    would wait for the device)."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    z_sum: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class RoutedTokens:
    """What one MoE layer's router decided for every token of a forward: ``probs`` (N, E) fp32, the softmax of its
    logits (with gradient); ``experts`` (N, k), each token's top-k; ``log_normalisers`` (N,) fp32, the logsumexp of
    its logits (with gradient, for the z-loss)."""

    probs: torch.Tensor
    experts: torch.Tensor
    log_normalisers: torch.Tensor

    def stats(self, counted: torch.Tensor | None) -> RouterStats:
        """The :class:`RouterStats` of the tokens ``counted`` (N,) marks, 1.0 or 0.0 (all when None). Computed where
        the trainer reads the routing, outside any checkpointed block, so the mask is no part of a recomputation."""
        n_expert = self.probs.shape[-1]
        weight = torch.ones(self.probs.shape[0], device=self.probs.device) if counted is None else counted.float()
        with torch.no_grad():
            slots = weight.repeat_interleave(self.experts.shape[-1])  # (N * k,)
            counts = torch.zeros(n_expert, dtype=torch.float32, device=self.probs.device)
            counts.scatter_add_(0, self.experts.reshape(-1), slots)
        prob_sums = (self.probs * weight[:, None]).sum(0)
        z_sum = (self.log_normalisers.square() * weight).sum()
        return RouterStats(counts, prob_sums, z_sum, weight.sum())


def route_tokens(logits: torch.Tensor, top_k: int, scoring: str = "softmax") -> RoutedTokens:
    """From a layer's router ``logits`` (N, E), scored as ``scoring`` says (:data:`SCORINGS`): each token's top-k
    experts (ties go to the lower expert, as ``torch.topk`` breaks them) and probabilities."""
    logits32 = logits.float()
    if scoring == "topk-softmax":
        top, experts = torch.topk(logits32, top_k, dim=-1)  # (N, k) each
        probs = torch.zeros_like(logits32).scatter(-1, experts, torch.softmax(top, dim=-1))  # (N, E)
    else:
        probs = torch.softmax(logits32, dim=-1)  # (N, E)
        experts = torch.topk(probs, top_k, dim=-1).indices  # (N, k)
    return RoutedTokens(probs, experts, torch.logsumexp(logits32, dim=-1))


class RouterRecorder:
    """Collects the :class:`RoutedTokens` of the MoE layers, in order, during a forward the trainer records; a
    forward outside :meth:`recording` (evaluation, sampling, a checkpointed block's recomputation in backward)
    keeps nothing."""

    def __init__(self, spec: RouterSpec) -> None:
        self.spec = spec
        self._layers: list[RoutedTokens] | None = None

    @contextmanager
    def recording(self) -> Iterator[list[RoutedTokens]]:
        """Keep the routing of the forwards inside; the list fills as the layers run (one per MoE layer and
        forward)."""
        previous, self._layers = self._layers, []
        try:
            yield self._layers
        finally:
            self._layers = previous

    def add(self, routed: RoutedTokens) -> None:
        if self._layers is not None:
            self._layers.append(routed)


def router_recorder(model: nn.Module) -> RouterRecorder | None:
    """The recorder of ``model`` (perhaps inside DDP, ``torch.compile`` or the compile fallback) when it routes
    tokens to experts, else ``None``."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        recorder = getattr(model, "router_recorder", None)
        if isinstance(recorder, RouterRecorder):
            return recorder
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None) or getattr(model, "eager", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None
