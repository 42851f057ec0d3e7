"""The engine: one optimizer step from K micro-batches.

For a step made of micro-batches ``m_1..m_K`` (on every rank) with ``N`` valid
target tokens in total, the engine back-propagates, for each micro-batch,

    loss_sum(m_i) * world_size / N

where ``loss_sum`` is the *sum* of per-token losses. The gradients add up over
the K backward passes and DDP averages them over ``world_size`` ranks, so the
final gradient is that of ``(sum of all per-token losses) / N``: the mean loss of
one giant batch. With full micro-batches this is the classic ``mean / K``; with
padding or masks, ``mean / K`` over-weights short micro-batches and is wrong.
That scale is applied here and nowhere else. A mixture of experts' load-balancing loss, a statistic of the
whole step, is added to each micro-batch's as that micro-batch's share of the step's
(:mod:`bigbatch.engine.router_balance`), scaled by the world size the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.bad_steps import BadStep, BadStepSettings
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch, count_valid_targets, global_valid_targets
from bigbatch.engine.batch_change import BatchFollower
from bigbatch.engine.hooks import StepHook, StepOutcome
from bigbatch.engine.router_balance import RouterBalance
from bigbatch.engine.step_guard import MicroWatch, StepGuard
from bigbatch.models.lm_output import computes_loss, logits_loss
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import DistContext, GradSync, LocalGradSync
from bigbatch.settings.choices import RESOLVED_PRECISIONS

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

    Per :meth:`step`: gradients are zeroed once; each micro-batch runs forward
    (under autocast) and backward with the exact scale above, gradient sync off
    for all but the last; then the global gradient norm is clipped (after
    unscaling for fp16), the optimizer steps once, and the learning rate for the
    next step is set from ``schedule``. Measurements and fault injection attach
    through ``hooks`` (:mod:`bigbatch.engine.hooks`), called in order.

    Micro-batches are :class:`~bigbatch.engine.batch.MicroBatch` by default; any
    object with ``.to(device, non_blocking=...)`` works with a matching
    ``loss_fn`` and ``count_fn`` (and, for a mixture of experts, ``route_fn`` and ``counted_fn``).

    A model that routes tokens to experts (it has a :class:`~bigbatch.models.routing.RouterRecorder`) adds its
    load-balancing loss and z-loss over the whole step (:mod:`bigbatch.engine.router_balance`): ``router_balance``
    is the mode (``exact`` by default), ``router_aux_coef`` and ``router_z_coef`` replace the model's coefficients.
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
        loss_fn: LossFn = token_loss_sum,
        count_fn: CountFn = count_valid_targets,
        grad_sync: GradSync | None = None,
        dist: DistContext | None = None,
        hooks: Sequence[StepHook] = (),
        router_balance: str = "exact",
        router_aux_coef: float | None = None,
        router_z_coef: float | None = None,
        route_fn: Callable[[nn.Module, Any], object] = token_route,
        counted_fn: Callable[[Any], torch.Tensor] = counted_tokens,
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
        self.loss_fn = loss_fn
        self.count_fn = count_fn
        self.grad_sync = grad_sync or LocalGradSync()
        self.dist = dist or DistContext()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.step_count = 0  # optimizer steps applied
        self.skipped_steps = 0  # steps dropped for a non-finite gradient
        names = [hook.name for hook in hooks if hook.name]
        if len(names) != len(set(names)):
            raise ValueError(f"step hooks need distinct names, got {names}")
        self.hooks = list(hooks)
        recorder = router_recorder(model)
        self.router: RouterBalance | None = None
        if recorder is not None:
            self.router = RouterBalance(
                recorder, router_balance, self.dist, self.device, router_aux_coef, router_z_coef
            )
        self.route_fn, self.counted_fn = route_fn, counted_fn
        self.follower = follower
        # None: a non-finite gradient skips the step, nothing is traced (the engine used on its own)
        self.guard = StepGuard(bad_steps, parallel) if bad_steps is not None else None
        self._base_weight_decays = [float(group.get("weight_decay", 0.0)) for group in optimizer.param_groups]
        self._set_step_settings(self.schedule(self.step_count))

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast_for(self.precision, self.device)

    def _set_step_settings(self, lr: float) -> float:
        """The schedule's ``lr`` for the next step; with a :class:`BatchFollower`, the settings it gives at the
        size of the last step (its tokens per step, or the reference before any): the learning rate set."""
        follower = self.follower
        if follower is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return lr
        tokens = follower.last_tokens or follower.reference_tokens
        settings = follower.settings(lr, tokens)
        base_decay = follower.base.weight_decay
        decay_factor = settings.weight_decay / base_decay if base_decay > 0 else 1.0
        for group, weight_decay in zip(self.optimizer.param_groups, self._base_weight_decays, strict=True):
            group["lr"] = settings.lr
            group["betas"] = (settings.beta1, settings.beta2)
            group["weight_decay"] = weight_decay * decay_factor
        return settings.lr

    def global_valid_targets(self, micro_batches: Sequence[Any]) -> int:
        """Valid targets over all micro-batches on all ranks, known before the first backward (for callers that
        do not bring ``n_valid``, e.g. a :class:`~bigbatch.engine.batch.StepBatch`'s)."""
        return global_valid_targets(micro_batches, self.dist, self.device, self.count_fn)

    def accumulate(
        self, micro_batches: Sequence[Any], n_valid: int | None = None, watch: MicroWatch | None = None
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward over the micro-batches, adding into ``.grad``.

        Returns the summed loss of this rank (a detached fp32 tensor on the
        device) and the global valid-target count ``N``. A caller that already
        knows ``N`` (packed data: every target is valid) passes it and saves the
        all-reduce. Gradients are not zeroed here; with fp16 they carry the
        GradScaler's scale. ``watch`` (the guarded step's) sees each micro-batch on its way.
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        if n_valid is None:
            n_valid = self.global_valid_targets(micro_batches)
        if n_valid == 0:
            raise ValueError("the step holds no valid target tokens (every target is -100)")
        scale = self.dist.world_size / n_valid  # the one place the loss is scaled
        loss_total = torch.zeros((), dtype=torch.float32, device=self.device)
        last = len(micro_batches) - 1
        if self.router is not None:
            self._begin_routing(micro_batches, n_valid)
        for i, micro_batch in enumerate(micro_batches):
            if watch is not None:
                watch.before(i, micro_batch)
            micro_batch = micro_batch.to(self.device, non_blocking=True)
            sync = nullcontext() if i == last else self.grad_sync.no_sync()
            captured = watch.capture(i, i == last, self._params) if watch is not None else nullcontext()
            with sync, captured:  # covers forward and backward: DDP decides at forward time
                loss_sum, objective = self._forward(self.model, micro_batch, i, scale)
                if watch is not None:
                    watch.loss(loss_sum)
                objective.backward()
            loss_total += loss_sum.detach().float()
            if watch is not None:
                watch.after_backward(i, i == last, self._params)
            for hook in self.hooks:
                hook.after_backward(self, i, micro_batch)
        return loss_total, n_valid

    def _forward(
        self, model: nn.Module, micro_batch: Any, index: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``index``'s summed loss and the objective it back-propagates: ``loss_sum x scale``, plus its
        share of the step's router loss, times the fp16 loss scale."""
        for hook in self.hooks:
            hook.before_forward(self, index, micro_batch)
        router_term = None
        with self.autocast():
            if self.router is None:
                loss_sum = self.loss_fn(model, micro_batch)
            else:
                with self.router.recording() as layers:
                    loss_sum = self.loss_fn(model, micro_batch)
                router_term = self.router.term(layers, self.counted_fn(micro_batch))
        for hook in self.hooks:
            loss_sum = hook.after_forward(self, index, loss_sum)
        objective = loss_sum * scale
        if router_term is not None:  # already a share of the step's: DDP's average is undone as for the loss
            objective = objective + router_term * self.dist.world_size
        return loss_sum, self.scaler.scale(objective)

    def objective(self, model: nn.Module, micro_batch: Any, index: int, n_valid: int) -> torch.Tensor:
        """Micro-batch ``index``'s objective computed again (a replay), as its accumulation pass computed it, through
        ``model``; the step's router totals are left as they were."""
        kept = self.router.totals_kept() if self.router is not None else nullcontext()
        with kept:
            return self._forward(model, micro_batch, index, self.dist.world_size / n_valid)[1]

    def loss_sum(self, model: nn.Module, micro_batch: Any, index: int) -> torch.Tensor:
        """Micro-batch ``index``'s summed loss computed again without a graph, as its accumulation pass computed it
        (hooks included); the step's router totals are left as they were."""
        kept = self.router.totals_kept() if self.router is not None else nullcontext()
        with kept, torch.no_grad():
            return self._forward(model, micro_batch, index, 1.0)[0]

    def _begin_routing(self, micro_batches: Sequence[Any], n_valid: int) -> None:
        assert self.router is not None

        def route(micro_batch: Any) -> object:
            with self.autocast():
                return self.route_fn(self.model, micro_batch.to(self.device, non_blocking=True))

        self.router.begin(micro_batches, n_valid, self.counted_fn, route)

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
        for hook in self.hooks:
            hook.before_step(self, self.step_count + 1, len(micro_batches))
        bad = None
        overflow = True  # without the guard every non-finite gradient is a skip of GradScaler's kind
        if self.guard is None:
            self._zero_grad()
            loss_total, n_valid = self.accumulate(micro_batches, n_valid)
            grad_norm = self._clip()
            skipped = not math.isfinite(grad_norm)
            loss = float(self.dist.all_reduce_sum(loss_total).item()) / n_valid
        else:
            guarded = self.guard.run(self, list(micro_batches), n_valid)
            n_valid, grad_norm, bad, overflow = guarded.n_valid, guarded.grad_norm, guarded.bad, guarded.overflow
            skipped = not guarded.apply
            loss = guarded.loss_sum / guarded.n_valid if guarded.n_valid else math.nan  # 0: nothing of it ran
        if not skipped:
            self._apply()
        elif overflow:
            self._skip()
        else:  # a bad step: no update, and the loss scale as the step found it
            self.skipped_steps += 1
            self.restart_step()
        attempted = self.step_count + int(skipped)  # a skipped step's number is the one it tried to be
        outcome = StepOutcome(step=attempted, grad_norm=grad_norm, n_valid=n_valid, skipped=skipped)
        measurements = {hook.name: m for hook in self.hooks if (m := hook.after_step(self, outcome)) is not None}
        if self.router is not None and n_valid:
            measurements["router"] = self.router.finish()
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
        )

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
