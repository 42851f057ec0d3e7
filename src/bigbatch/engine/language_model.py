"""The next-token objective: the cross-entropy per valid target token, and for a mixture of experts the router's
load-balancing loss and z-loss as two more token terms (:mod:`bigbatch.engine.router_balance`), their statistic
of the step (the expert counts) taken in the routing pass before the first backward.

``loss_fn`` (the one-term shortcut the engine takes) replaces the cross-entropy: any ``loss_fn(model, batch)``
returning the *sum* of per-token losses, with ``count_fn(batch)`` the tokens it sums over.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch, count_valid_targets
from bigbatch.engine.objective import Objective, StepPass, StepTotals, Term
from bigbatch.engine.router_balance import RouterBalance
from bigbatch.models.lm_output import computes_loss, logits_loss
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import DistContext

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch)`` returns the *sum* (not the mean) of per-token losses as a 0-d tensor."""

CountFn = Callable[[Any], int]
"""``count_fn(micro_batch)`` returns how many valid targets ``loss_fn`` sums over for that micro-batch."""


def token_loss_sum(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Sum of next-token cross-entropies over valid targets.

    bigbatch's own families compute it in their forward (from the final hidden states, in chunks, with packed
    documents' positions); any other model returning ``(logits, ...)`` or an output with ``.logits`` is scored
    from its whole logits (and cannot take packed rows)."""
    positions = getattr(batch, "positions", None)
    if computes_loss(model):
        if positions is None:
            return model(batch.inputs, targets=batch.targets)
        return model(batch.inputs, targets=batch.targets, positions=positions)
    if positions is not None:
        raise ValueError(
            f"{type(model).__name__} does not take packed rows (positions): its forward has no way to keep the "
            "documents apart; use --pack off"
        )
    output = model(batch.inputs)
    if hasattr(output, "logits"):  # Hugging Face model outputs
        output = output.logits
    logits = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, V)
    return logits_loss(logits, batch.targets)


def token_route(model: nn.Module, batch: MicroBatch) -> object:
    """A forward that routes ``batch``'s tokens through every MoE layer and computes as little else as it can:
    bigbatch's families and ``hf:`` models give only the last position's logits (no loss, no whole head); any other
    model runs :func:`token_loss_sum`."""
    if not computes_loss(model) or not isinstance(batch, MicroBatch):
        return token_loss_sum(model, batch)
    return model(batch.inputs, positions=batch.positions, last_only=True)


def counted_tokens(batch: MicroBatch) -> torch.Tensor:
    """The tokens of a micro-batch a router's balancing loss counts, flattened (B*T,): those with a valid target."""
    return (batch.targets != IGNORE_INDEX).reshape(-1)


class LanguageModelObjective(Objective):
    """``lm``: the summed cross-entropy per valid target of the step; a model that routes tokens adds
    ``router_balance`` (in mode ``router_balance``: ``exact``, ``running``, ``micro`` or ``off``) and ``router_z``,
    token terms weighted by the router's coefficients (the model's, or ``router_aux_coef`` / ``router_z_coef``)."""

    def __init__(
        self,
        loss_fn: LossFn = token_loss_sum,
        count_fn: CountFn = count_valid_targets,
        *,
        router_balance: str = "exact",
        router_aux_coef: float | None = None,
        router_z_coef: float | None = None,
        route_fn: Callable[[nn.Module, Any], object] = token_route,
        counted_fn: Callable[[Any], torch.Tensor] = counted_tokens,
    ) -> None:
        self.loss_fn, self.count_fn = loss_fn, count_fn
        self.router_balance, self.router_aux_coef, self.router_z_coef = router_balance, router_aux_coef, router_z_coef
        self.route_fn, self.counted_fn = route_fn, counted_fn
        self.router: RouterBalance | None = None
        self.terms = (Term("lm", "token"),)

    def bind(self, model: nn.Module, dist: DistContext, device: torch.device) -> None:
        recorder = router_recorder(model)
        if recorder is None:
            self.router = None
            self.terms = (Term("lm", "token"),)
            return
        router = RouterBalance(recorder, self.router_balance, dist, device, self.router_aux_coef, self.router_z_coef)
        self.router = router
        self.terms = (
            Term("lm", "token"),
            Term("router_balance", "token", router.aux_coef, auxiliary=True),
            Term("router_z", "token", router.z_coef, auxiliary=True),
        )

    def units(self, batch: Any) -> dict[str, float]:
        return {"token": float(self.count_fn(batch))}

    def targets(self, batch: Any) -> float:
        return float(self.count_fn(batch))

    def totals_for_tokens(self, n_valid: int) -> StepTotals | None:
        return StepTotals({"token": float(n_valid)}, "token", n_valid)

    def begin_step(self, step: StepPass) -> None:
        router = self.router
        if router is None:
            return

        def route(micro_batch: Any) -> object:
            with step.autocast():
                return self.route_fn(step.model, micro_batch.to(step.device, non_blocking=True))

        router.begin(step.micro_batches, int(step.totals.of("token")), self.counted_fn, route)

    def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        router = self.router
        if router is None:
            return {"lm": self.loss_fn(model, batch)}
        with router.recording() as layers:
            loss_sum = self.loss_fn(model, batch)
        balance, z = router.term_sums(layers, self.counted_fn(batch))
        return {"lm": loss_sum, "router_balance": balance, "router_z": z}

    def kept(self) -> AbstractContextManager[Any]:
        return self.router.totals_kept() if self.router is not None else nullcontext()

    def end_step(self) -> dict[str, Any]:
        return {"router": self.router.finish()} if self.router is not None else {}

    def describe(self) -> list[str]:
        return [f"router | {self.router.describe()}"] if self.router is not None else []
