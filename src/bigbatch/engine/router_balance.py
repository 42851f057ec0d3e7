"""A mixture of experts' load-balancing loss over the whole optimizer step, accumulated exactly.

The step's balancing loss is ``E * sum_e f_e * P_e`` per MoE layer (pooled as the model's
:class:`~bigbatch.models.routing.RouterSpec` says), with ``f`` and ``P`` over every token of the step: all K
micro-batches on every rank. Given ``f`` it is ``sum(W * S)`` over the micro-batches' probability sums ``S``, with
weights ``W`` from ``f`` (:meth:`RouterSpec.balance_weights`), so each micro-batch back-propagates its share
``sum(W * S_i)`` beside its cross-entropy and the K backward passes add up to the step's gradient. What differs
between the modes is which ``f`` a micro-batch is weighted by:

* ``exact``: the step's. A routing pass without gradients over the K micro-batches counts the tokens per expert
  and layer; one all-reduce makes the counts global. The generators are replayed (the training pass draws the
  dropout and router noise the routing pass drew), so the counts are those of the training pass itself: the
  step's measurement says how many assignments differ (``replay_mismatch``, 0 when the replay holds).
* ``running``: the counts so far (Megatron-LM's ``global_aux_loss``): micro-batch i is weighted by the counts of
  micro-batches 0..i on every rank (one all-reduce per micro-batch). Cheaper, and not exact: the update depends
  on K.
* ``micro``: each micro-batch's own counts and probabilities, the losses averaged by token share (what
  transformers computes in each forward).
* ``off``: no balancing loss (the loads are still measured).

The router z-loss (``mean over tokens of logsumexp(router logits)^2``) is a per-token mean: normalised by the
step's routed tokens it is exact in every mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.engine.rng import preserved_rng
from bigbatch.models.routing import RoutedTokens, RouterRecorder, RouterSpec, RouterStats
from bigbatch.parallel.distributed import DistContext

ROUTER_BALANCE_MODES = ("exact", "running", "micro", "off")


@dataclass(frozen=True)
class RouterMeasurement:
    """What the router did over one step (all ranks): the balancing loss and z-loss as optimised (without their
    coefficients), the coefficients, and per MoE layer the expert load: the busiest expert's tokens over the mean
    (1 is perfect balance) and the coefficient of variation of the experts' tokens (0 is perfect balance)."""

    mode: str
    balance_loss: float
    z_loss: float
    aux_coef: float
    z_coef: float
    load_max_over_mean: tuple[float, ...]
    load_cv: tuple[float, ...]
    replay_mismatch: float | None = None  # exact: share of the assignments the routing pass counted otherwise

    @property
    def router_loss(self) -> float:
        """What the router adds to the step's loss: ``aux_coef * balance + z_coef * z``."""
        return self.aux_coef * self.balance_loss + self.z_coef * self.z_loss

    def as_dict(self) -> dict[str, float]:
        values = {
            "router_loss": self.router_loss,
            "router_balance_loss": self.balance_loss,
            "router_z_loss": self.z_loss,
            "expert_load_max_over_mean": max(self.load_max_over_mean, default=1.0),
            "expert_load_cv": max(self.load_cv, default=0.0),
        }
        for layer, (peak, cv) in enumerate(zip(self.load_max_over_mean, self.load_cv, strict=True)):
            values[f"expert_load_max_over_mean/{layer}"] = peak
            values[f"expert_load_cv/{layer}"] = cv
        if self.replay_mismatch is not None:
            values["router_replay_mismatch"] = self.replay_mismatch
        return values


def expert_load(counts: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per layer of ``counts`` (layers, E): (max over mean, coefficient of variation) of the experts' tokens."""
    counts = counts.double()
    mean = counts.mean(1).clamp_min(1e-12)
    peak = (counts.max(1).values / mean).tolist()
    cv = (counts.std(1, unbiased=False) / mean).tolist()
    return tuple(float(x) for x in peak), tuple(float(x) for x in cv)


def _stack(stats: Sequence[RouterStats], what: str) -> torch.Tensor:
    return torch.stack([getattr(layer, what) for layer in stats])  # (layers, E)


class RouterBalance:
    """The step's router losses for an engine whose model routes tokens (see the module docstring). Per step:
    :meth:`begin` (the routing pass, for ``exact``), then for each micro-batch its forward inside
    :meth:`recording` and :meth:`term` (what it back-propagates besides its cross-entropy), then :meth:`finish`."""

    def __init__(
        self,
        recorder: RouterRecorder,
        mode: str,
        dist: DistContext,
        device: torch.device,
        aux_coef: float | None = None,
        z_coef: float | None = None,
    ) -> None:
        if mode not in ROUTER_BALANCE_MODES:
            raise ValueError(f"router balance must be one of {', '.join(ROUTER_BALANCE_MODES)}, got {mode!r}")
        self.recorder, self.mode, self.dist, self.device = recorder, mode, dist, device
        spec = recorder.spec
        self.spec: RouterSpec = spec
        self.aux_coef = spec.aux_coef if aux_coef is None else aux_coef
        self.z_coef = spec.z_coef if z_coef is None else z_coef
        self._reset()

    def _reset(self) -> None:
        self._tokens = 0.0  # the step's counted tokens (valid targets), all ranks
        self._step_counts: torch.Tensor | None = None  # exact: the routing pass's counts (layers, E), all ranks
        self._running_counts: torch.Tensor | None = None  # running: counts so far, all ranks
        self._running_tokens: float | torch.Tensor = 0.0
        self._trained_counts: torch.Tensor | None = None  # this rank's training-pass counts (layers, E)
        self._balance = torch.zeros((), dtype=torch.float32, device=self.device)
        self._z = torch.zeros((), dtype=torch.float32, device=self.device)

    def describe(self) -> str:
        """The header's words: ``top-2 of 4 experts | balance exact (over the whole step, from a routing pass) x 0.01,
        per layer, averaged | z-loss off``."""
        how = {
            "exact": "over the whole step, from a routing pass",
            "running": "counts so far: depends on K",
            "micro": "per micro-batch: depends on K",
            "off": "none",
        }[self.mode]
        balance = f"balance {self.mode} ({how})"
        if self.mode != "off":
            pooling = "every layer's tokens pooled" if self.spec.pooling == "pooled" else "per layer, averaged"
            balance += f" x {self.aux_coef:g}, {pooling}"
        z_loss = f"z-loss x {self.z_coef:g}" if self.z_coef else "z-loss off"
        top = f"top-{self.spec.top_k} of {self.spec.n_expert} experts"
        return f"{top} | {balance} | {z_loss}"

    def recording(self) -> AbstractContextManager[list[RoutedTokens]]:
        return self.recorder.recording()

    def begin(
        self,
        micro_batches: Sequence[Any],
        n_valid: int,
        counted: Callable[[Any], torch.Tensor],
        route: Callable[[Any], object],
    ) -> None:
        """Start a step of ``n_valid`` counted tokens on every rank (the valid targets): for ``exact``, the routing
        pass (``route`` runs one micro-batch's forward without gradients, under the engine's autocast, with the
        generators replayed; ``counted`` marks a micro-batch's counted tokens, flattened)."""
        self._reset()
        self._tokens = float(n_valid)
        if self.mode != "exact":
            return
        counts: torch.Tensor | None = None
        with torch.no_grad(), preserved_rng():  # the training pass draws what this pass drew
            for micro_batch in micro_batches:
                with self.recorder.recording() as layers:
                    route(micro_batch)
                weight = counted(micro_batch).to(self.device).float()  # (N,): once for every layer
                stats = [layer.stats(weight) for layer in layers]
                layer_counts = _stack(stats, "counts")
                counts = layer_counts if counts is None else counts + layer_counts
        assert counts is not None
        self._step_counts = self.dist.all_reduce_sum(counts)

    @contextmanager
    def totals_kept(self) -> Iterator[None]:
        """A re-run of a micro-batch (a replay) adds nothing to the step's measured totals."""
        kept = (self._trained_counts, self._balance, self._z)
        try:
            yield
        finally:
            self._trained_counts, self._balance, self._z = kept

    def term_sums(self, routed: Sequence[RoutedTokens], counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's balancing and z-loss terms as sums over the step's counted tokens (0-d fp32, with
        gradient), from its layers' ``routed`` tokens of which ``counted`` (N,) are counted: the objective's token
        terms, which the engine divides by the step's tokens (and multiplies by their coefficients)."""
        if not routed:
            raise RuntimeError("the model routes tokens but reported no MoE layer for this micro-batch")
        weight = counted.float()  # (N,): once for every layer
        layers = [layer.stats(weight) for layer in routed]
        counts = _stack(layers, "counts")  # (layers, E)
        sums = _stack(layers, "prob_sums")  # (layers, E), with gradient
        self._trained_counts = counts if self._trained_counts is None else self._trained_counts + counts
        weights = self._weights(counts, layers[0].tokens.clamp_min(1.0))
        balance = (weights * sums).sum()  # this micro-batch's share of the step's balancing loss
        z_sum = torch.stack([layer.z_sum for layer in layers]).sum() / len(layers)
        self._balance += balance.detach()
        self._z += z_sum.detach() / self._tokens
        return balance * self._tokens, z_sum

    def _weights(self, counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if self.mode == "off":
            return torch.zeros_like(counts)
        if self.mode == "exact":
            assert self._step_counts is not None
            return spec.balance_weights(self._step_counts, self._tokens)
        if self.mode == "micro":  # this micro-batch's own loss, weighted by its share of the step's tokens
            return spec.balance_weights(counts, tokens) * (tokens / self._tokens)
        summed = self.dist.all_reduce_sum(torch.cat([counts.flatten(), tokens.view(1)]))
        this_step = summed[:-1].view_as(counts)
        self._running_counts = this_step if self._running_counts is None else self._running_counts + this_step
        self._running_tokens = self._running_tokens + summed[-1]
        # f from the counts so far; P over the step's tokens, so that one micro-batch (K = 1) is exact.
        so_far = torch.as_tensor(self._running_tokens).clamp_min(1.0)  # micro-batches so far may hold no valid target
        return spec.balance_weights(self._running_counts, so_far) * (so_far / self._tokens)

    def finish(self) -> RouterMeasurement:
        """The step's measurement (one all-reduce: the losses and the training pass's counts)."""
        assert self._trained_counts is not None, "finish() before any micro-batch"
        local = torch.cat([self._balance.view(1), self._z.view(1), self._trained_counts.flatten()])
        summed = self.dist.all_reduce_sum(local)
        counts = summed[2:].view_as(self._trained_counts)
        mismatch = None
        if self._step_counts is not None:
            mismatch = float((counts - self._step_counts).abs().sum() / self._step_counts.sum().clamp_min(1.0))
        peak, cv = expert_load(counts)
        return RouterMeasurement(
            mode=self.mode,
            balance_loss=float(summed[0]),
            z_loss=float(summed[1]),
            aux_coef=self.aux_coef,
            z_coef=self.z_coef,
            load_max_over_mean=peak,
            load_cv=cv,
            replay_mismatch=mismatch,
        )
