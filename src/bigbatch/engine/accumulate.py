"""The engine: one optimizer step from K micro-batches.

For a step made of micro-batches ``m_1..m_K`` (on every rank) with ``N`` valid
target tokens in total, the engine back-propagates, for each micro-batch,

    loss_sum(m_i) * world_size / N

where ``loss_sum`` is the *sum* of per-token losses. The gradients add up over
the K backward passes and DDP averages them over ``world_size`` ranks, so the
final gradient is that of ``(sum of all per-token losses) / N``: the mean loss of
one giant batch. With full micro-batches this is the classic ``mean / K``; with
padding or masks, ``mean / K`` over-weights short micro-batches and is wrong.
That scale is applied here and nowhere else. The loss is an :class:`~bigbatch.engine.objective.Objective`: a sum
of terms, each normalised the same way by its own units of the whole step (tokens, sequences, pairs, groups), all
counted before the first backward in one all-reduce; the next-token loss with a mixture of experts' router terms
(:mod:`bigbatch.engine.language_model`) is the default one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.bad_steps import BadStep, BadStepSettings
from bigbatch.engine.batch import count_valid_targets
from bigbatch.engine.batch_change import BatchFollower
from bigbatch.engine.hooks import StepHook, StepOutcome
from bigbatch.engine.language_model import (
    CountFn,
    LanguageModelObjective,
    LossFn,
    counted_tokens,
    token_loss_sum,
    token_route,
)
from bigbatch.engine.objective import (
    Objective,
    StepPass,
    StepTotals,
    count_units,
    objective_value,
    summarize,
    term_scales,
)
from bigbatch.engine.router_balance import RouterBalance
from bigbatch.engine.step_guard import MicroWatch, StepGuard
from bigbatch.parallel.distributed import DistContext, GradSync, LocalGradSync
from bigbatch.settings.choices import RESOLVED_PRECISIONS

log = logging.getLogger(__name__)

__all__ = [
    "AccumulationEngine",
    "CountFn",
    "LossFn",
    "StepRecord",
    "autocast_for",
    "counted_tokens",
    "resolve_precision",
    "token_loss_sum",
    "token_route",
]


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` means bf16 on a CUDA device that supports it, else fp32."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if precision not in RESOLVED_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose auto, {', '.join(RESOLVED_PRECISIONS)}")
    return precision


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """Autocast for a resolved precision: none for fp32, bf16 or fp16 on ``device`` otherwise."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did. ``loss`` is the token-weighted mean over the whole global step."""

    step: int  # optimizer steps applied so far, this one included (a skipped step: the number it tried to be)
    loss: float
    grad_norm: float  # global norm before clipping
    lr: float
    tokens: int  # valid target tokens in the global step
    micro_batches: int  # K on this rank
    dt: float  # seconds
    skipped: bool = False  # non-finite gradient: no update was applied
    # What the step hooks measured on this step, by hook name (see engine/hooks.py).
    measurements: Mapping[str, Any] = field(default_factory=dict)
    # Documents: the shares of the step's positions that are padding and masked prompt tokens (the trainer's).
    padding_share: float | None = None
    prompt_share: float | None = None
    bad: BadStep | None = None  # a bad step found by the guard, and what was done (engine/step_guard.py)
    muon_lr: float | None = None  # --optimizer muon: the Muon group's learning rate (lr is AdamW's)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.dt if self.dt > 0 else 0.0

    @property
    def noise(self) -> Any:
        """The gradient noise scale's sample (:class:`~bigbatch.noise.scale.NoiseSample`) on the steps that
        measured it (the ``noise_scale`` hook's measurement), else ``None``."""
        return self.measurements.get("noise_scale")


class AccumulationEngine:
    """Runs optimizer steps made of K micro-batches, exactly as one big batch would.

    Per :meth:`step`: gradients are zeroed once; the objective's units are counted over the step (all ranks) and
    its statistics pass runs; each micro-batch runs forward (under autocast) and backward with the exact scales
    above, gradient sync off for all but the last; then the global gradient norm is clipped (after unscaling for
    fp16), the optimizer steps once, and the learning rate for the next step is set from ``schedule``.
    Measurements and fault injection attach through ``hooks`` (:mod:`bigbatch.engine.hooks`), called in order.

    ``objective`` (:class:`~bigbatch.engine.objective.Objective`) is what is optimised; by default the next-token
    loss, with a mixture of experts' router terms (:class:`~bigbatch.engine.language_model.LanguageModelObjective`).
    ``loss_fn`` (with ``count_fn``) is the one-term shortcut: the sum of a micro-batch's per-token losses and the
    tokens it sums over, for any micro-batch type with ``.to(device, non_blocking=...)``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Callable[[int], float],
        *,
        grad_clip: float = 1.0,
        precision: str = "fp32",
        device: torch.device | str = "cpu",
        objective: Objective | None = None,
        loss_fn: LossFn | None = None,
        count_fn: CountFn | None = None,
        grad_sync: GradSync | None = None,
        dist: DistContext | None = None,
        hooks: Sequence[StepHook] = (),
        follower: BatchFollower | None = None,
        bad_steps: BadStepSettings | None = None,
        parallel: str = "none",
    ) -> None:
        self.model = model
        # Fixed for the engine's life (the optimizer holds these same objects): walking the module tree for them
        # and setting every module's training flag again each step was host work the step did not need.
        self._params = list(model.parameters())
        self._modules = list(model.modules())
        self.optimizer = optimizer
        self.schedule = schedule
        self.grad_clip = grad_clip
        self.device = torch.device(device)
        self.precision = resolve_precision(precision, self.device)
        if objective is not None and (loss_fn is not None or count_fn is not None):
            raise ValueError("give the engine an objective or a loss_fn (its one-term shortcut), not both")
        if objective is None:
            objective = LanguageModelObjective(loss_fn or token_loss_sum, count_fn or count_valid_targets)
        self.grad_sync = grad_sync or LocalGradSync()
        self.dist = dist or DistContext()
        objective.bind(model, self.dist, self.device)
        self.objective = objective
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.step_count = 0  # optimizer steps applied
        self.skipped_steps = 0  # steps dropped for a non-finite gradient
        names = [hook.name for hook in hooks if hook.name]
        if len(names) != len(set(names)):
            raise ValueError(f"step hooks need distinct names, got {names}")
        self.hooks = list(hooks)
        self.follower = follower
        # None: a non-finite gradient skips the step, nothing is traced (the engine used on its own)
        self.guard = StepGuard(bad_steps, parallel) if bad_steps is not None else None
        self._base_weight_decays = [float(group.get("weight_decay", 0.0)) for group in optimizer.param_groups]
        self._said_empty: set[str] = set()  # terms whose empty steps have been reported (once each)
        self._set_step_settings(self.schedule(self.step_count))

    # ---- the language-model objective's parts, where tests and tools reach them -------------------------------

    @property
    def loss_fn(self) -> LossFn:
        """The next-token objective's summed loss (settable: fault-injection tests wrap it)."""
        return self._lm_objective().loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn: LossFn) -> None:
        self._lm_objective().loss_fn = loss_fn

    @property
    def router(self) -> RouterBalance | None:
        """A mixture of experts' router terms (``None`` for a model that does not route tokens)."""
        objective = self.objective
        return objective.router if isinstance(objective, LanguageModelObjective) else None

    def _lm_objective(self) -> LanguageModelObjective:
        if not isinstance(self.objective, LanguageModelObjective):
            raise AttributeError(f"the engine's objective is {type(self.objective).__name__}, not a next-token loss")
        return self.objective

    def primary_units(self, micro_batch: Any) -> int:
        """What ``micro_batch`` holds of the objective's first term's unit (its valid targets for ``lm``)."""
        return int(round(self.objective.units(micro_batch).get(self.objective.primary.unit, 0.0)))

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast_for(self.precision, self.device)

    def _set_step_settings(self, lr: float) -> float:
        """The schedule's ``lr`` for the next step; with a :class:`BatchFollower`, the settings it gives at the
        size of the last step (its tokens per step, or the reference before any): the learning rate set."""
        follower = self.follower
        if follower is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # a Muon group's rate is a multiple of --lr
            return lr
        tokens = follower.last_tokens or follower.reference_tokens
        settings = follower.settings(lr, tokens)
        decay_factor = follower.weight_decay_factor(tokens)
        for group, weight_decay in zip(self.optimizer.param_groups, self._base_weight_decays, strict=True):
            group["lr"] = settings.lr * group.get("lr_scale", 1.0)
            group["weight_decay"] = weight_decay * decay_factor
            if group.get("muon"):
                if settings.momentum is not None:
                    group["momentum"] = settings.momentum
            else:
                group["betas"] = (settings.beta1, settings.beta2)
        return settings.lr

    def step_totals(self, micro_batches: Sequence[Any], n_valid: int | StepTotals | None = None) -> StepTotals:
        """Each unit of the objective over all micro-batches on all ranks, known before the first backward: one
        all-reduce, none when the caller's ``n_valid`` (valid targets of the step) says it all."""
        if isinstance(n_valid, StepTotals):
            return n_valid
        if n_valid is not None:
            known = self.objective.totals_for_tokens(n_valid)
            if known is not None:
                return known
        return count_units(self.objective, micro_batches, self.dist, self.device)

    def global_valid_targets(self, micro_batches: Sequence[Any]) -> int:
        """The step's count of the objective's first unit (valid targets for ``lm``) on all ranks."""
        return self.step_totals(micro_batches).primary_count

    def accumulate(
        self,
        micro_batches: Sequence[Any],
        n_valid: int | StepTotals | None = None,
        watch: MicroWatch | None = None,
    ) -> tuple[torch.Tensor, StepTotals]:
        """Forward and backward over the micro-batches, adding into ``.grad``.

        Returns this rank's sums of the step (a detached float64 vector on the device: each term's sum, then the
        objective's statistics, :meth:`Objective.local_statistics`) and the step's totals of every unit. A caller
        that already knows the valid targets (packed data: every target is valid) passes them (or the totals) and
        saves the all-reduce. Gradients are not zeroed here; with fp16 they carry the GradScaler's scale.
        ``watch`` (the guarded step's) sees each micro-batch on its way.
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        totals = self.step_totals(micro_batches, n_valid)
        if totals.empty:
            if self.objective.primary.unit == "token":
                raise ValueError("the step holds no valid target tokens (every target is -100)")
            raise ValueError(f"the step holds no unit of any term of the objective ({totals.as_dict()})")
        scales = self._scales(totals)  # the one place the loss is scaled
        terms = self.objective.terms
        sums = torch.zeros(len(terms), dtype=torch.float64, device=self.device)
        last = len(micro_batches) - 1
        self.objective.begin_step(StepPass(self.model, micro_batches, totals, self.dist, self.device, self.autocast))
        for i, micro_batch in enumerate(micro_batches):
            if watch is not None:
                watch.before(i, micro_batch)
            micro_batch = micro_batch.to(self.device, non_blocking=True)
            sync = nullcontext() if i == last else self.grad_sync.no_sync()
            captured = watch.capture(i, i == last, self._params) if watch is not None else nullcontext()
            with sync, captured:  # covers forward and backward: DDP decides at forward time
                term_sums, value = self._forward(self.model, micro_batch, i, scales)
                if watch is not None:
                    watch.loss(term_sums[0])
                value.backward()
            sums += term_sums.double()
            if watch is not None:
                watch.after_backward(i, i == last, self._params)
            for hook in self.hooks:
                hook.after_backward(self, i, micro_batch)
        statistics = self.objective.local_statistics()
        if statistics:
            sums = torch.cat([sums, torch.tensor(statistics, dtype=torch.float64, device=self.device)])
        return sums, totals

    def _scales(self, totals: StepTotals) -> list[float]:
        """Each term's factor (:func:`~bigbatch.engine.objective.term_scales`); a term the step holds no unit of is
        said once, not divided by zero."""
        for term in self.objective.terms:
            if term.unit != "none" and totals.of(term.unit) == 0 and term.name not in self._said_empty:
                self._said_empty.add(term.name)
                log.warning(
                    "step %d holds no %s on any rank: the %s term adds nothing to it (said once)",
                    self.step_count + 1,
                    term.unit,
                    term.name,
                )
        return term_scales(self.objective, totals, self.dist.world_size)

    def _forward(
        self, model: nn.Module, micro_batch: Any, index: int, scales: Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``index``'s term sums (a detached fp32 vector, the primary's after the hooks) and what it
        back-propagates: ``sum_t S_t x scale_t``, times the fp16 loss scale."""
        for hook in self.hooks:
            hook.before_forward(self, index, micro_batch)
        terms = self.objective.terms
        with self.autocast():
            sums = self.objective.sums(model, micro_batch, index)
        primary = terms[0].name
        for hook in self.hooks:
            sums[primary] = hook.after_forward(self, index, sums[primary])
        value = objective_value(sums, terms, scales)
        detached = torch.stack([sums[term.name].detach().float().reshape(()) for term in terms])
        return detached, self.scaler.scale(value)

    def rerun_objective(self, model: nn.Module, micro_batch: Any, index: int, totals: StepTotals) -> torch.Tensor:
        """Micro-batch ``index``'s objective computed again (a replay), as its accumulation pass computed it, through
        ``model``; what the step has measured is left as it was."""
        with self.objective.kept():
            return self._forward(model, micro_batch, index, term_scales(self.objective, totals, self.dist.world_size))[
                1
            ]

    def plain_objective(self, model: nn.Module, micro_batch: Any, index: int, totals: StepTotals) -> torch.Tensor:
        """Micro-batch ``index``'s objective without autocast, the loss scale or the hooks (a float64 reference
        on the host); what the step has measured is left as it was."""
        with self.objective.kept():
            sums = self.objective.sums(model, micro_batch, index)
        return objective_value(sums, self.objective.terms, term_scales(self.objective, totals, self.dist.world_size))

    def rerun_loss_sum(self, model: nn.Module, micro_batch: Any, index: int) -> torch.Tensor:
        """Micro-batch ``index``'s primary term's sum computed again without a graph, as its accumulation pass
        computed it (hooks included); what the step has measured is left as it was."""
        ones = [1.0] * len(self.objective.terms)
        with self.objective.kept(), torch.no_grad():
            return self._forward(model, micro_batch, index, ones)[0][0]

    def measure(self, micro_batches: Sequence[Any]) -> tuple[float, StepTotals, dict[str, float]]:
        """The objective of ``micro_batches`` (on all ranks) as one step of them would compute it, without gradients
        or an update, in eval mode (a validation): the loss, the totals, and each term's mean and the objective's
        statistics by name (``term/dpo``, ``rewards/accuracy``). The loss is ``nan`` when they hold no unit."""
        totals = self.step_totals(micro_batches)
        terms = self.objective.terms
        sums = torch.zeros(len(terms), dtype=torch.float64, device=self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.objective.kept():
                self.objective.begin_step(
                    StepPass(self.model, micro_batches, totals, self.dist, self.device, self.autocast)
                )
                for i, micro_batch in enumerate(micro_batches):
                    with self.autocast():
                        held = self.objective.sums(self.model, micro_batch.to(self.device, non_blocking=True), i)
                    sums += torch.stack([held[t.name].detach().double().reshape(()) for t in terms])
                statistics = self.objective.local_statistics()
        finally:
            self.model.train(was_training)
        local = torch.cat([sums, torch.tensor(statistics, dtype=torch.float64, device=self.device)])
        reduced = self.dist.all_reduce_sum(local).tolist()
        if totals.empty:
            return math.nan, totals, {}
        loss, measurement = summarize(self.objective, reduced, totals)
        return loss, totals, measurement.as_dict()

    def step(
        self, micro_batches: Sequence[Any], n_valid: int | None = None, tokens_per_step: int | None = None
    ) -> StepRecord:
        """One optimizer step; ``n_valid`` as in :meth:`accumulate`. ``tokens_per_step``: the step's planned size,
        which a :class:`BatchFollower` sets the learning rate, betas and weight decay for."""
        started = time.perf_counter()
        if not all(module.training for module in self._modules):  # e.g. after an evaluation
            self.model.train()
        if self.follower is not None and tokens_per_step:
            self.follower.last_tokens = tokens_per_step
        lr = self._set_step_settings(self.schedule(self.step_count))
        muon_lr = next((float(g["lr"]) for g in self.optimizer.param_groups if g.get("muon")), None)
        for hook in self.hooks:
            hook.before_step(self, self.step_count + 1, len(micro_batches))
        bad = None
        overflow = True  # without the guard every non-finite gradient is a skip of GradScaler's kind
        if self.guard is None:
            self._zero_grad()
            local, totals = self.accumulate(micro_batches, n_valid)
            grad_norm = self._clip()
            skipped = not math.isfinite(grad_norm)
            reduced = self.dist.all_reduce_sum(local).tolist()
        else:
            guarded = self.guard.run(self, list(micro_batches), n_valid)
            totals, grad_norm, bad, overflow = guarded.totals, guarded.grad_norm, guarded.bad, guarded.overflow
            skipped = not guarded.apply
            reduced = guarded.sums
        if not skipped:
            self._apply()
        elif overflow:
            self._skip()
        else:  # a bad step: no update, and the loss scale as the step found it
            self.skipped_steps += 1
            self.restart_step()
        n_valid = totals.targets
        attempted = self.step_count + int(skipped)  # a skipped step's number is the one it tried to be
        outcome = StepOutcome(step=attempted, grad_norm=grad_norm, n_valid=n_valid, skipped=skipped)
        measurements = {hook.name: m for hook in self.hooks if (m := hook.after_step(self, outcome)) is not None}
        loss = math.nan  # nothing of the step ran (every micro-batch left out)
        if not totals.empty and reduced:
            loss, measurement = summarize(self.objective, reduced, totals)
            measurements.update(self.objective.end_step())
            if self._reports_terms() or len(reduced) > len(self.objective.terms):  # terms, or statistics too
                measurements["objective"] = measurement
        return StepRecord(
            step=attempted,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=n_valid,
            micro_batches=len(micro_batches),
            dt=time.perf_counter() - started,
            skipped=skipped,
            measurements=measurements,
            bad=bad,
            muon_lr=muon_lr,
        )

    def _reports_terms(self) -> bool:
        """Whether a step's record lists its terms: when the objective has more than one that is not auxiliary
        (the router's terms have their own measurement)."""
        return sum(not term.auxiliary for term in self.objective.terms) > 1

    def _clip(self) -> float:
        """Unscales (fp16), clips the global gradient norm and returns it before clipping (inf or nan: skip)."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def _apply(self) -> None:
        """The optimizer step, and the learning rate of the next one."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step_count += 1
        self._set_step_settings(self.schedule(self.step_count))

    def _skip(self) -> None:
        """A non-finite gradient: no update; fp16 lowers its loss scale."""
        self.skipped_steps += 1
        self._zero_grad()
        if self.scaler.is_enabled():
            self.scaler.update()

    def restart_step(self) -> None:
        """The step's gradients gone, to compute it again (a bad micro-batch left out) or to skip it as bad. fp16:
        GradScaler allows one ``unscale_`` per ``update()``, and ``update()`` would move the loss scale (down after an
        overflow, up after enough clean steps), which a step that is computed again or skipped as bad must not do:
        a fresh GradScaler holding this one's state (scale, growth count) is this one as the step found it."""
        self._zero_grad()
        if self.scaler.is_enabled():
            fresh = torch.amp.GradScaler(self.device.type, enabled=True)
            fresh.load_state_dict(self.scaler.state_dict())
            self.scaler = fresh

    def _zero_grad(self) -> None:
        """``model.zero_grad(set_to_none=True)`` over the parameters listed once."""
        for param in self._params:
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            **{hook.name: hook.state_dict() for hook in self.hooks if hook.name},
            **({"guard": self.guard.state_dict()} if self.guard is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        for hook in self.hooks:
            if hook.name and state.get(hook.name):
                hook.load_state_dict(state[hook.name])
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        self._set_step_settings(self.schedule(self.step_count))
