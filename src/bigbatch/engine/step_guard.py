"""The guarded step: each micro-batch checked on its way into the gradient, a bad step traced to its micro-batch
and handled as ``--bad-step`` says (see :mod:`bigbatch.engine.bad_steps` for the causes and the modes).

Per step, on every rank: the engine's accumulation runs with a :class:`MicroWatch` (each micro-batch's valid
targets, where its tokens come from, the generators before its forward, whether its summed loss is finite and,
where this rank holds its gradient alone, whether the gradient stayed finite after it); a drawn micro-batch is
replayed when due; then one all-reduce carries the loss and every rank's first bad micro-batch, so every rank makes
the same decision. A non-finite gradient that no check caught (the last micro-batch's gradient is reduced across
ranks inside its backward) is searched for by re-running this rank's micro-batches alone. A spike is traced to the
micro-batch of the highest loss per token. Each suspect is re-run on its rank to tell data (reproduced) from a
transient fault. Under ``skip-micro`` the step is computed again from the same generators without the suspects.
"""

from __future__ import annotations

import logging
import math
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.engine.bad_steps import (
    CAUSES,
    GRAD_NOT_FINITE,
    LEFT_OUT,
    LOSS_NOT_FINITE,
    BadStep,
    BadStepSettings,
    SpikeDetector,
    Suspect,
    describe_origin,
)
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.replay import ContributionCapture, DrawnMicroBatch, compare, digest, recompute
from bigbatch.engine.rng import capture_rng_state, restore_rng_state
from bigbatch.parallel.distributed import unwrap

if TYPE_CHECKING:
    from bigbatch.engine.accumulate import AccumulationEngine

log = logging.getLogger(__name__)

ACTIONS = {
    "stop": "stopped",
    "skip-step": "skipped step",
    "skip-micro": "skipped micro-batch",
    "rewind": "rewind",
}


class MicroWatch:
    """What one accumulation pass learns of each micro-batch (read once, after the pass)."""

    def __init__(
        self, check_grads: bool, world_size: int, drawn: int | None, sharded: list[torch.nn.Module] | None = None
    ) -> None:
        self.check_grads, self.world_size, self.drawn_index = check_grads, world_size, drawn
        self.sharded = sharded  # FSDP2, the model's modules: a rank never holds a micro-batch's gradient in .grad
        self.counts: list[int] = []
        self.batches: list[Any] = []  # on the host, as read
        self.rngs: list[dict[str, Any]] = []
        self.loss_sums: list[torch.Tensor] = []
        self.grad_ok: list[tuple[int, torch.Tensor]] = []
        self.drawn: DrawnMicroBatch | None = None
        self._capture: ContributionCapture | None = None

    def before(self, index: int, batch: Any) -> None:
        """Before micro-batch ``index`` moves to the device."""
        targets = getattr(batch, "targets", None)
        self.counts.append(int((targets != IGNORE_INDEX).sum()) if targets is not None else 0)
        self.batches.append(batch)
        self.rngs.append(capture_rng_state())
        if index == self.drawn_index:
            self.drawn = DrawnMicroBatch(index, batch, self.rngs[-1])

    def capture(self, index: int, last: bool, params: list[torch.nn.Parameter]) -> AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: the drawn one's contribution as computed; under DDP the last
        one's checked on its way in (its backward reduces the gradient across ranks), under FSDP2 every one's (on
        the gathered parameters its forward uses)."""
        if index == self.drawn_index:
            self._capture = ContributionCapture(params)
            return self._capture
        if self.check_grads and self.sharded is not None:
            return _FiniteCheck(params, index, self.grad_ok, self.sharded)
        if last and self.world_size > 1 and self.check_grads:
            return _FiniteCheck(params, index, self.grad_ok)
        return nullcontext()

    def loss(self, loss_sum: torch.Tensor) -> None:
        self.loss_sums.append(loss_sum.detach().float())

    def after_backward(self, index: int, last: bool, params: list[torch.nn.Parameter]) -> None:
        """Whether the gradient is still finite, where this rank holds it alone (not the last micro-batch's,
        which DDP reduced inside its backward, unless there is one process; FSDP2 shows none before the end)."""
        if self.drawn is not None and index == self.drawn_index and self._capture is not None:
            contribution = self._capture.grads
            self.drawn.first = digest(contribution)
            self._capture = None
            present = [g for g in contribution if g is not None]
            if self.check_grads and present:  # the contribution itself, before any reduction
                self.grad_ok.append((index, torch.stack(torch._foreach_norm(present, math.inf)).isfinite().all()))
        if not self.check_grads or (last and self.world_size > 1) or index == self.drawn_index:
            return
        held: list[torch.Tensor] = [grad for p in params if (grad := p.grad) is not None]
        if held:
            norms = torch._foreach_norm(held, math.inf)
            self.grad_ok.append((index, torch.stack(norms).isfinite().all()))

    def first_bad(self) -> tuple[int, str] | None:
        """The first micro-batch whose loss, or the gradient after it, is not finite."""
        loss_ok = torch.stack(self.loss_sums).isfinite().tolist() if self.loss_sums else []
        grad_ok = {index: bool(ok) for index, ok in self.grad_ok}
        for index, ok in enumerate(loss_ok):
            if not ok:
                return index, LOSS_NOT_FINITE
            if not grad_ok.get(index, True):
                return index, GRAD_NOT_FINITE
        return None

    def mean_losses(self) -> list[float]:
        """Each micro-batch's loss per valid target (``-inf`` for one without a target)."""
        sums = torch.stack(self.loss_sums).tolist() if self.loss_sums else []
        return [s / n if n else -math.inf for s, n in zip(sums, self.counts, strict=True)]


class _FiniteCheck:
    """While entered, whether every parameter's incoming gradient is finite (one flag for the micro-batch).

    With ``modules`` (FSDP2) the hooks go on the parameters each module's forward uses, the gathered ones: a hook
    on a sharded parameter never sees a micro-batch's gradient."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        index: int,
        into: list[tuple[int, torch.Tensor]],
        modules: list[torch.nn.Module] | None = None,
    ) -> None:
        self.params, self.index, self.into = [p for p in params if p.requires_grad], index, into
        self.modules = modules
        self.flags: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._hooked: set[int] = set()

    def _check(self, grad: torch.Tensor) -> None:
        self.flags.append(torch.isfinite(grad).all())

    def _hook_used(self, module: torch.nn.Module, args: Any) -> None:
        for tensor in module._parameters.values():
            if tensor is not None and tensor.requires_grad and id(tensor) not in self._hooked:
                self._hooked.add(id(tensor))  # once, though activation checkpointing runs the forward again
                self._handles.append(tensor.register_hook(self._check))

    def __enter__(self) -> _FiniteCheck:
        if self.modules is None:
            self._handles = [param.register_hook(self._check) for param in self.params]
        else:
            self._handles = [m.register_forward_pre_hook(self._hook_used) for m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        if self.flags:
            self.into.append((self.index, torch.stack(self.flags).all()))


@dataclass(frozen=True)
class GuardedStep:
    """What the guarded step computed: the global loss sum and valid targets, the gradient norm before clipping,
    whether to apply the update, and the bad step (if any) with what was done."""

    loss_sum: float
    n_valid: int
    grad_norm: float
    apply: bool
    bad: BadStep | None = None


def filler(batch: MicroBatch) -> MicroBatch:
    """A micro-batch with no target and no token of ``batch``: a rank left without micro-batches trains it, and its
    gradient is exactly zero (DDP and FSDP2 need every rank's backward)."""
    positions = None if batch.positions is None else torch.zeros_like(batch.positions)
    return MicroBatch(
        torch.zeros_like(batch.inputs), torch.full_like(batch.targets, IGNORE_INDEX), positions, batch.inputs.numel()
    )


class StepGuard:
    """The engine's watch over its steps (see the module docstring); ``excluded`` holds the
    :attr:`~bigbatch.engine.batch.MicroBatch.origin_key` of micro-batches to leave out wherever they are read (a
    rewind's), and the counters what was done."""

    def __init__(self, settings: BadStepSettings, parallel: str = "none") -> None:
        self.settings = settings
        self.parallel = parallel
        self.spikes = SpikeDetector(
            settings.spike_window, settings.loss_spike, settings.grad_spike, settings.spike_min_steps
        )
        self.excluded: set[str] = set()
        self.replays = 0  # micro-batches replayed by --replay-every
        self.dropped = 0  # micro-batches left out (skip-micro and exclusions)

    # ---- the step ------------------------------------------------------------------------------------------

    def run(self, engine: AccumulationEngine, micro_batches: list[Any], n_valid: int | None) -> GuardedStep:
        step = engine.step_count + 1
        batches = list(micro_batches)
        index_of = list(range(len(batches)))  # each micro-batch's index in the step as read
        if self.excluded:
            left_out = {i for i, b in enumerate(batches) if getattr(b, "origin_key", None) in self.excluded}
            self.dropped += engine.dist.sum_int(len(left_out), engine.device)
            index_of, batches = self._without(batches, index_of, left_out)
            n_valid = engine.global_valid_targets(batches)  # every rank recounts (the exclusions are everywhere)
            if n_valid == 0:  # nothing of the step is left: it is skipped before it runs, as if never read
                bad = BadStep(step, LEFT_OUT, (), ACTIONS["skip-step"], math.nan, math.nan)
                return GuardedStep(math.nan, 0, math.nan, apply=False, bad=bad)
        start_rng = capture_rng_state()
        drawn = self._draw(engine, step, len(batches))
        sharded = list(engine.model.modules()) if self.parallel == "fsdp" else None
        found: list[BadStep] = []
        for _ in range(len(micro_batches) + 1):  # each try drops at least one
            watch = MicroWatch(engine.scaler.is_enabled() is False, engine.dist.world_size, drawn, sharded)
            engine._zero_grad()
            loss_total, n_valid = engine.accumulate(batches, n_valid, watch)
            counted = n_valid
            replayed = self._replay(engine, watch, n_valid) if watch.drawn is not None else []
            grad_norm = engine._clip()
            loss_sum, suspects = self._gather(engine, watch, loss_total)
            loss = loss_sum / n_valid
            detail = ""
            if not suspects and not math.isfinite(grad_norm):
                if engine.scaler.is_enabled():  # fp16: the loss scale overflowed; GradScaler lowers it
                    return GuardedStep(loss_sum, n_valid, grad_norm, apply=False, bad=found[-1] if found else None)
                suspects = self._search(engine, watch, n_valid)
            if not suspects and math.isfinite(grad_norm) and not replayed and not found:
                # only the step as read: without a dropped micro-batch its norm is over fewer tokens, larger
                spike = self.spikes.check(loss, grad_norm)
                if spike is not None:
                    suspects, detail = self._spike_suspect(engine, watch, spike[0]), spike[1]
                elif self.spikes.restarted:
                    log.warning("step %d: %s", step, self.spikes.restarted)
                    self.spikes.restarted = ""
            suspects += replayed
            if not suspects and math.isfinite(grad_norm):
                self.spikes.observe(loss, grad_norm)
                return GuardedStep(loss_sum, n_valid, grad_norm, apply=True, bad=found[-1] if found else None)
            suspects = self._describe(engine, watch, suspects, index_of, n_valid)
            cause = suspects[0].cause if suspects else GRAD_NOT_FINITE
            mode = self.settings.mode
            if mode == "skip-micro" and not suspects:
                mode, detail = "skip-step", "no micro-batch to drop: the whole step is skipped"
            bad = BadStep(step, cause, tuple(suspects), ACTIONS[mode], loss, grad_norm, detail)
            if mode != "skip-micro":
                restore_rng_state(start_rng)  # a skipped step leaves the generators as it found them too
                return GuardedStep(loss_sum, n_valid, grad_norm, apply=False, bad=self._merge(found, bad))
            mine = {index_of.index(s.micro) for s in suspects if s.rank == engine.dist.rank and s.micro in index_of}
            kept = [i for i in range(len(batches)) if i not in mine]
            remaining = engine.dist.sum_int(sum(watch.counts[i] for i in kept), engine.device)
            if remaining == 0:  # nothing left to train on: the step is skipped
                bad = replace(bad, action=ACTIONS["skip-step"], detail="no valid target left without them")
                restore_rng_state(start_rng)
                return GuardedStep(loss_sum, n_valid, grad_norm, apply=False, bad=self._merge(found, bad))
            found.append(bad)
            self.dropped += len(suspects)  # every rank knows them all
            index_of, batches = self._without(batches, index_of, mine)
            n_valid, drawn = remaining, None
            restore_rng_state(start_rng)  # the step again, drawing what it drew without the dropped micro-batches
            for hook in engine.hooks:
                hook.before_step(engine, step, len(batches))
        bad = replace(found[-1], action=ACTIONS["skip-step"], detail="bad micro-batches on every try")
        restore_rng_state(start_rng)
        return GuardedStep(loss_sum, counted, grad_norm, apply=False, bad=self._merge(found, bad))

    def _without(self, batches: list[Any], index_of: list[int], dropped: set[int]) -> tuple[list[int], list[Any]]:
        """The micro-batches (and their indices as read) without those at ``dropped``: gone, or under FSDP2, where
        every rank must run as many forwards as the others (each gathers the parameters), each replaced by one
        without targets (its gradient is exactly zero). A rank left with none trains one such."""
        if self.parallel == "fsdp":
            return (
                [-1 if i in dropped else at for i, at in enumerate(index_of)],
                [filler(b) if i in dropped else b for i, b in enumerate(batches)],
            )
        kept = [i for i in range(len(batches)) if i not in dropped]
        if not kept:
            return [-1], [filler(batches[0])]
        return [index_of[i] for i in kept], [batches[i] for i in kept]

    @staticmethod
    def _merge(found: list[BadStep], last: BadStep) -> BadStep:
        """One record for a step's tries: every suspect dropped before the last try's."""
        earlier = tuple(s for bad in found for s in bad.suspects)
        return replace(last, suspects=earlier + last.suspects) if earlier else last

    # ---- what the ranks found --------------------------------------------------------------------------------

    def _gather(
        self, engine: AccumulationEngine, watch: MicroWatch, loss_total: torch.Tensor
    ) -> tuple[float, list[Suspect]]:
        """One all-reduce: the step's loss sum and every rank's first bad micro-batch (its index + 1, its cause)."""
        dist = engine.dist
        slots = torch.zeros(1 + 2 * dist.world_size, dtype=torch.float64, device=engine.device)
        slots[0] = loss_total.double()
        first = watch.first_bad()
        if first is not None:
            slots[1 + 2 * dist.rank] = first[0] + 1
            slots[2 + 2 * dist.rank] = CAUSES.index(first[1])
        values = dist.all_reduce_sum(slots).tolist()
        suspects = [
            Suspect(rank=rank, micro=int(values[1 + 2 * rank]) - 1, cause=CAUSES[int(values[2 + 2 * rank])])
            for rank in range(dist.world_size)
            if values[1 + 2 * rank] > 0
        ]
        return values[0], suspects

    def _search(self, engine: AccumulationEngine, watch: MicroWatch, n_valid: int) -> list[Suspect]:
        """A non-finite gradient no check caught: each rank re-runs its own micro-batches alone (the local module,
        no reduction) until one gives a non-finite contribution; FSDP2 cannot (a re-run needs every rank)."""
        found = -1
        if self.parallel != "fsdp":
            for index in range(len(watch.batches)):
                if not self._finite_again(engine, watch, index, n_valid):
                    found = index
                    break
        values = engine.dist.all_gather_object(found)
        return [Suspect(rank=r, micro=m, cause=GRAD_NOT_FINITE) for r, m in enumerate(values) if m >= 0]

    def _spike_suspect(self, engine: AccumulationEngine, watch: MicroWatch, cause: str) -> list[Suspect]:
        """The micro-batch of the highest loss per valid target on any rank."""
        means = engine.dist.all_gather_object(watch.mean_losses())
        rank, micro = max(
            ((r, i) for r, ms in enumerate(means) for i in range(len(ms))), key=lambda ri: means[ri[0]][ri[1]]
        )
        return [Suspect(rank=rank, micro=micro, cause=cause)]

    def _describe(
        self, engine: AccumulationEngine, watch: MicroWatch, suspects: list[Suspect], index_of: list[int], n_valid: int
    ) -> list[Suspect]:
        """Each suspect with its documents, its exclusion key and its verdict (re-run on its rank), known to every
        rank; its micro-batch numbered as the step read it."""
        rank = engine.dist.rank
        mine = []
        for suspect in suspects:
            if suspect.rank != rank:
                continue
            batch = watch.batches[suspect.micro]
            verdict = suspect.verdict or self._verdict(engine, watch, suspect, n_valid)
            mine.append(
                replace(
                    suspect,
                    micro=index_of[suspect.micro],
                    key=getattr(batch, "origin_key", ""),
                    documents=describe_origin(getattr(batch, "origin", ())),
                    verdict=verdict,
                )
            )
        return [s for ranks in engine.dist.all_gather_object(mine) for s in ranks]

    def _verdict(self, engine: AccumulationEngine, watch: MicroWatch, suspect: Suspect, n_valid: int) -> str:
        """``data`` when re-running the suspect (same inputs, same generators) reproduces what was found,
        ``transient`` when it does not."""
        if self.parallel == "fsdp":
            return "not replayed (FSDP2: a re-run needs every rank)"
        if suspect.cause in (LOSS_NOT_FINITE, GRAD_NOT_FINITE):
            return "transient" if self._finite_again(engine, watch, suspect.micro, n_valid) else "data"
        loss = self._loss_again(engine, watch, suspect.micro)
        return "data" if loss == watch.loss_sums[suspect.micro].item() else "transient"

    # ---- re-runs ---------------------------------------------------------------------------------------------

    def _finite_again(self, engine: AccumulationEngine, watch: MicroWatch, index: int, n_valid: int) -> bool:
        """Whether micro-batch ``index``'s loss and contribution are finite when computed again on this rank."""
        module = unwrap(engine.model)
        trained = [p for p in engine._params if p.requires_grad]
        after = capture_rng_state()
        try:
            restore_rng_state(watch.rngs[index])
            objective = engine.objective(module, watch.batches[index].to(engine.device), index, n_valid)
            if not torch.isfinite(objective.detach()).all():
                return False
            grads = torch.autograd.grad(objective, trained, allow_unused=True)
        finally:
            restore_rng_state(after)
        present = [g for g in grads if g is not None]
        return not present or bool(torch.stack(torch._foreach_norm(present, math.inf)).isfinite().all())

    def _loss_again(self, engine: AccumulationEngine, watch: MicroWatch, index: int) -> float:
        module = unwrap(engine.model)
        after = capture_rng_state()
        try:
            restore_rng_state(watch.rngs[index])
            return float(engine.loss_sum(module, watch.batches[index].to(engine.device), index).float().item())
        finally:
            restore_rng_state(after)

    def _draw(self, engine: AccumulationEngine, step: int, k: int) -> int | None:
        """The micro-batch this step replays (``--replay-every``), from the run's seed and the step alone."""
        every = self.settings.replay_every
        if not every or step % every:
            return None
        return random.Random(f"{self.settings.seed}:{step}:{engine.dist.rank}").randrange(k)

    def _replay(self, engine: AccumulationEngine, watch: MicroWatch, n_valid: int) -> list[Suspect]:
        """The drawn micro-batch computed again and its digest compared with the first run's. One process: on this
        rank. Several: each rank re-runs the previous rank's (which sends the micro-batch and its generators'
        state), one extra micro-batch per rank; only when a digest differs does every rank re-run its own too, to
        tell the rank that computed wrongly (see :func:`compare`)."""
        drawn = watch.drawn
        assert drawn is not None
        self.replays += 1
        module = unwrap(engine.model)

        def rerun(micro: DrawnMicroBatch) -> str:
            def objective(m: torch.nn.Module, batch: Any) -> torch.Tensor:
                return engine.objective(m, batch, micro.index, n_valid)

            return recompute(module, engine._params, micro, objective, engine.device)

        dist = engine.dist
        if dist.world_size == 1:
            again = rerun(drawn)
            return compare([(drawn.index, drawn.first, again, again)], 1)
        world, rank = dist.world_size, dist.rank
        others = dist.all_gather_object((drawn.index, drawn.batch, drawn.rng))
        previous = DrawnMicroBatch(*others[(rank - 1) % world])
        firsts = dist.all_gather_object((drawn.index, drawn.first, rerun(previous)))
        by_next = [firsts[(r + 1) % world][2] for r in range(world)]  # rank r's micro-batch as rank r + 1 computed it
        if all(first == peer for (_, first, _), peer in zip(firsts, by_next, strict=True)):
            return []
        agains = dist.all_gather_object(rerun(drawn))
        rows = [(micro, first, agains[r], by_next[r]) for r, (micro, first, _) in enumerate(firsts)]
        return compare(rows, world)

    def state_dict(self) -> dict[str, Any]:
        return {"spikes": self.spikes.state_dict(), "replays": self.replays, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.replays = int(state.get("replays", 0))
        self.dropped = int(state.get("dropped", 0))
