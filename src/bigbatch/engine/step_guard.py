"""The guarded step: each micro-batch measured on its way into the gradient, a bad step traced to its micro-batches
and handled as ``--bad-step`` says (see :mod:`bigbatch.engine.bad_steps` for the causes and the modes).

Per step, on every rank: the engine's accumulation runs with a :class:`MicroWatch` (each micro-batch's valid
targets, where its tokens come from, the generators before its forward, its summed loss and the norm of its gradient
contribution, taken by hooks on the parameters before ``.grad`` adds it and before any reduction across ranks); a
drawn micro-batch is replayed when due; then one all-reduce carries the loss and every micro-batch's values on every
rank, so every rank makes the same decision. Every micro-batch whose loss or contribution is not finite is named. A
non-finite gradient that no micro-batch shows (an overflow of the sum) is searched for by re-running this rank's
micro-batches alone. A spike is traced by each micro-batch's own values (its loss per token, the norm of its
gradient per token): those over the spike limits or, when the step's values spiked and no micro-batch's did, the
highest of the value that spiked. A bad document is followed to every micro-batch of the step that holds a part of it
(:mod:`bigbatch.engine.bad_documents`). Each suspect is re-run on its rank to tell data (reproduced) from a transient
fault. Under ``skip-micro`` the step is computed again from the same generators without the suspects, and what
remains is judged by its micro-batches' own values, never by the step's (a step over fewer tokens has a larger
gradient norm). Computing a step again, or skipping it as bad, leaves fp16's loss scale as the step found it
(:meth:`~bigbatch.engine.accumulate.AccumulationEngine.restart_step`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.engine.bad_documents import BadDocument, alone, describe_parts, spread_documents
from bigbatch.engine.bad_steps import (
    CAUSES,
    GRAD_NOT_FINITE,
    GRAD_SPIKE,
    LEFT_OUT,
    LOSS_NOT_FINITE,
    LOSS_SPIKE,
    REPLAY_MISMATCH,
    BadStep,
    BadStepSettings,
    SpikeDetector,
    Suspect,
    describe_origin,
)
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.objective import StepTotals
from bigbatch.engine.replay import (
    ContributionCapture,
    DrawnMicroBatch,
    ReplayCheck,
    break_ties,
    contribution,
    device_fault,
    digest,
    host_reference,
    replay_alone,
    replay_ring,
)
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
FIELDS = 5  # what the all-reduce carries of each micro-batch: present, cause, summed loss, valid targets, norm
SAME_NORM = 1e-3  # a re-run's contribution norm this close (relative) to the first reproduces it (CUDA's sums vary)


class MicroWatch:
    """What one accumulation pass learns of each micro-batch (read once, after the pass)."""

    def __init__(
        self,
        check_grads: bool,
        world_size: int,
        drawn: int | None,
        sharded: list[torch.nn.Module] | None = None,
        count: Callable[[Any], int] | None = None,
    ) -> None:
        self.check_grads, self.world_size, self.drawn_index = check_grads, world_size, drawn
        self.count = count  # what a micro-batch holds of the objective's primary unit (None: its valid targets)
        self.sharded = sharded  # FSDP2, the model's modules: a rank never holds a micro-batch's gradient in .grad
        self.counts: list[int] = []
        self.batches: list[Any] = []  # on the host, as read
        self.rngs: list[dict[str, Any]] = []
        self.loss_sums: list[torch.Tensor] = []
        self.norms: list[list[torch.Tensor]] = []  # per micro-batch, the norm of each parameter's contribution
        self.drawn: DrawnMicroBatch | None = None
        self._capture: ContributionCapture | None = None
        self._measure: _ContributionNorm | None = None  # its hooks, on for the whole pass

    def before(self, index: int, batch: Any) -> None:
        """Before micro-batch ``index`` moves to the device."""
        if self.count is not None:
            self.counts.append(self.count(batch))
        else:
            targets = getattr(batch, "targets", None)
            self.counts.append(int((targets != IGNORE_INDEX).sum()) if targets is not None else 0)
        self.batches.append(batch)
        self.rngs.append(capture_rng_state())
        self.norms.append([])
        if index == self.drawn_index:
            self.drawn = DrawnMicroBatch(index, batch, self.rngs[-1])

    def capture(self, index: int, last: bool, params: list[torch.nn.Parameter]) -> AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: the norm of its gradient contribution on its way in (under
        DDP before the reduction its last backward starts, under FSDP2 on the gathered parameters its forward uses),
        and the drawn one's contribution itself, for the replay."""
        if self._measure is None:
            self._measure = _ContributionNorm(params, self.sharded)
        measure = self._measure.measuring(self.norms[index])
        if index == self.drawn_index:
            self._capture = ContributionCapture(params)
            return _together(self._capture, measure)
        return measure

    def loss(self, loss_sum: torch.Tensor) -> None:
        self.loss_sums.append(loss_sum.detach().float())

    def after_backward(self, index: int, last: bool, params: list[torch.nn.Parameter]) -> None:
        """The drawn micro-batch's contribution, digested for the replay; after the last one, the hooks off."""
        if self.drawn is not None and index == self.drawn_index and self._capture is not None:
            self.drawn.first = digest(self._capture.grads)
            self._capture = None
        if last:
            self.close()

    def close(self) -> None:
        """The measuring hooks off (the pass is over, or it failed)."""
        if self._measure is not None:
            self._measure.close()
            self._measure = None

    def norm(self, index: int) -> torch.Tensor:
        """The norm of micro-batch ``index``'s gradient contribution (with fp16's loss scale in it)."""
        norms = self.norms[index]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=self.loss_sums[index].device)
        return torch.linalg.vector_norm(torch.stack(norms))

    def values(self) -> torch.Tensor:
        """``(n, FIELDS)`` float64 on the device, no sync: for each micro-batch 1 (present), its cause (0: none, else
        1 + its index in ``CAUSES``), summed loss, valid targets and contribution norm. A contribution that is not
        finite is a cause only where gradients are checked (fp16's overflow is GradScaler's)."""
        loss = torch.stack(self.loss_sums).double()
        norms = torch.stack([self.norm(i) for i in range(len(self.norms))]).double().to(loss.device)
        none = torch.zeros_like(loss)
        code = torch.where(loss.isfinite(), none, none + 1 + CAUSES.index(LOSS_NOT_FINITE))
        if self.check_grads:
            code = torch.where((code == 0) & ~norms.isfinite(), none + 1 + CAUSES.index(GRAD_NOT_FINITE), code)
        counts = torch.tensor(self.counts, dtype=torch.float64, device=loss.device)
        return torch.stack([none + 1, code, loss, counts, norms], dim=1)


@contextmanager
def _together(first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


class _ContributionNorm:
    """The norm of every parameter's incoming gradient (one micro-batch's contribution), into the list of the
    micro-batch being measured (:meth:`measuring`); the hooks go on with the first and stay for the whole
    accumulation pass (:meth:`close`), not on and off per micro-batch.

    A tensor hook on a parameter sees its gradient before ``.grad`` adds it and before DDP reduces it: one
    reduction pass over the gradient per micro-batch, as the finiteness check it replaced was. With ``modules``
    (FSDP2) the hooks go on the parameters each module's forward uses, the gathered ones: a hook on a sharded
    parameter never sees a micro-batch's gradient (a parameter one forward uses twice is then measured in parts)."""

    def __init__(self, params: list[torch.nn.Parameter], modules: list[torch.nn.Module] | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.modules = modules
        self.into: list[torch.Tensor] | None = None
        self._handles: list[Any] = []
        self._hooked: set[int] = set()

    @contextmanager
    def measuring(self, into: list[torch.Tensor]) -> Iterator[None]:
        """Around one micro-batch's forward and backward: its contribution's norms go to ``into``."""
        if not self._handles:
            self._open()
        self.into = into
        try:
            yield
        finally:
            self.into = None

    def _measure(self, grad: torch.Tensor) -> None:
        if self.into is not None:
            self.into.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def _hook_used(self, module: torch.nn.Module, args: Any) -> None:
        for tensor in module._parameters.values():
            if tensor is not None and tensor.requires_grad and id(tensor) not in self._hooked:
                self._hooked.add(id(tensor))  # once, though activation checkpointing runs the forward again
                self._handles.append(tensor.register_hook(self._measure))

    def _open(self) -> None:
        if self.modules is None:
            self._handles = [param.register_hook(self._measure) for param in self.params]
        else:
            self._handles = [m.register_forward_pre_hook(self._hook_used) for m in self.modules]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()


@dataclass(frozen=True)
class MicroStat:
    """One micro-batch's values as the all-reduce brought them to every rank."""

    rank: int
    index: int  # among its rank's micro-batches of this try
    cause: str  # a non-finite loss or contribution, else ""
    loss_sum: float
    count: int  # valid targets
    norm: float  # its gradient contribution's norm (fp16: with the loss scale in it)

    def own(self, n_valid: int, world_size: int, loss_scale: float) -> tuple[float, float]:
        """Its loss per valid target and the norm of the gradient of that mean: the contribution's norm without the
        step's normalization (``world_size / n_valid``) and the loss scale, per target. Neither depends on the
        other micro-batches of the step (``nan`` for one without targets)."""
        if self.count == 0:
            return math.nan, math.nan
        return self.loss_sum / self.count, self.norm / loss_scale * n_valid / (world_size * self.count)


@dataclass
class Computed:
    """One computation of the step (the first, or one without the micro-batches dropped so far)."""

    watch: MicroWatch
    sums: list[float]  # the step's term sums and statistics, all ranks (AccumulationEngine.accumulate's)
    totals: StepTotals
    grad_norm: float
    replayed: list[Suspect]
    stats: list[MicroStat]  # every rank's micro-batches
    own: list[tuple[float, float]]  # each one's own values (MicroStat.own)

    @property
    def n_valid(self) -> int:
        """The step's count of the primary term's unit (valid targets for a next-token loss)."""
        return self.totals.primary_count

    @property
    def loss(self) -> float:
        """The primary term's mean over the step: what spikes are judged on."""
        return self.sums[0] / self.n_valid if self.n_valid else math.nan


@dataclass(frozen=True)
class GuardedStep:
    """What the guarded step computed: the global term sums (and statistics) and each unit's count, the gradient
    norm before clipping, whether to apply the update, and the bad step (if any) with what was done. ``overflow``:
    fp16's loss scale overflowed (GradScaler's own skip, which lowers the scale), not a bad step."""

    sums: list[float]
    totals: StepTotals
    grad_norm: float
    apply: bool
    bad: BadStep | None = None
    overflow: bool = False


def filler(batch: MicroBatch) -> MicroBatch:
    """A micro-batch with no target and no token of ``batch``: a rank left without micro-batches trains it, and its
    gradient is exactly zero (DDP and FSDP2 need every rank's backward)."""
    positions = None if batch.positions is None else torch.zeros_like(batch.positions)
    answers = None if batch.answers is None else batch.answers.none()  # an objective over answers: none of them
    return MicroBatch(
        torch.zeros_like(batch.inputs),
        torch.full_like(batch.targets, IGNORE_INDEX),
        positions,
        batch.inputs.numel(),
        answers=answers,
    )


def _excluded(batch: Any, keys: set[str]) -> bool:
    """Whether a rewind's exclusions name ``batch`` (its key, or a document it holds a part of)."""
    check = getattr(batch, "excluded_by", None)
    return bool(check(keys)) if check is not None else getattr(batch, "origin_key", None) in keys


def _alone(engine: AccumulationEngine, count: int) -> StepTotals:
    """Totals that normalise a part of a micro-batch by its own ``count`` of the primary unit (its values alone)."""
    return StepTotals({unit: float(count) for unit in engine.objective.unit_names()}, engine.objective.primary.unit)


def _loss_scale(engine: AccumulationEngine) -> float:
    return float(engine.scaler.get_scale()) if engine.scaler.is_enabled() else 1.0


class StepGuard:
    """The engine's watch over its steps (see the module docstring); ``excluded`` holds the
    :attr:`~bigbatch.engine.batch.MicroBatch.origin_key` of micro-batches to leave out wherever they are read, and
    the :attr:`~bigbatch.engine.batch.DocumentPart.key` of documents whose every part is left out (a rewind's), and
    the counters what was done."""

    def __init__(self, settings: BadStepSettings, parallel: str = "none") -> None:
        self.settings = settings
        self.parallel = parallel
        self.spikes = SpikeDetector(
            settings.spike_window, settings.loss_spike, settings.grad_spike, settings.spike_min_steps
        )
        self.excluded: set[str] = set()
        self.replays = 0  # micro-batches replayed by --replay-every
        self.dropped = 0  # micro-batches left out (skip-micro and exclusions)
        self.checks: list[ReplayCheck] = []  # the replays of the step last run (kind: replay records)
        self.last_matched = 0  # the last step whose replays all matched, this session

    # ---- the step ------------------------------------------------------------------------------------------

    def run(
        self, engine: AccumulationEngine, micro_batches: list[Any], n_valid: int | StepTotals | None
    ) -> GuardedStep:
        step = engine.step_count + 1
        batches = list(micro_batches)
        index_of = list(range(len(batches)))  # each micro-batch's index in the step as read
        if self.excluded:
            left_out = {i for i, b in enumerate(batches) if _excluded(b, self.excluded)}
            self.dropped += engine.dist.sum_int(len(left_out), engine.device)
            index_of, batches = self._without(batches, index_of, left_out)
            n_valid = engine.step_totals(batches)  # every rank recounts (the exclusions are everywhere)
            if n_valid.empty:  # nothing of the step is left: it is skipped before it runs, as if never read
                bad = BadStep(step, LEFT_OUT, (), ACTIONS["skip-step"], math.nan, math.nan)
                return GuardedStep([], n_valid, math.nan, apply=False, bad=bad)
        start_rng = capture_rng_state()
        drawn = self._draw(engine, step, len(batches))
        found: list[BadStep] = []
        for attempt in range(len(micro_batches) + 1):  # each try drops at least one
            if attempt:  # the step again, drawing what it drew, without the dropped micro-batches
                restore_rng_state(start_rng)
                engine.restart_step()
                for hook in engine.hooks:
                    hook.before_step(engine, step, len(batches))
            else:
                engine._zero_grad()
            done = self._compute(engine, batches, n_valid, drawn, len(micro_batches))
            suspects, detail, overflow = self._find(engine, done, step, first=attempt == 0)
            if overflow:  # fp16: the loss scale overflowed; GradScaler lowers it
                merged = self._merge(found)
                return GuardedStep(done.sums, done.totals, done.grad_norm, apply=False, bad=merged, overflow=True)
            if not suspects:
                self.spikes.observe(done.loss, done.grad_norm, done.own)
                return GuardedStep(done.sums, done.totals, done.grad_norm, apply=True, bad=self._merge(found))
            bad, dropped, remaining = self._decide(engine, done, step, suspects, detail, index_of)
            if bad.action != ACTIONS["skip-micro"]:
                restore_rng_state(start_rng)  # a skipped step leaves the generators as it found them too
                return GuardedStep(done.sums, done.totals, done.grad_norm, apply=False, bad=self._merge(found, bad))
            found.append(bad)
            self.dropped += len(bad.suspects)  # every rank knows them all
            index_of, batches = self._without(batches, index_of, dropped)
            n_valid, drawn = remaining, None
        bad = replace(found[-1], action=ACTIONS["skip-step"], detail="bad micro-batches on every try")
        restore_rng_state(start_rng)
        return GuardedStep(done.sums, done.totals, done.grad_norm, apply=False, bad=self._merge(found[:-1], bad))

    def _compute(
        self,
        engine: AccumulationEngine,
        batches: list[Any],
        n_valid: int | StepTotals | None,
        drawn: int | None,
        k: int,
    ) -> Computed:
        """Accumulate, replay the drawn micro-batch, unscale and clip, and bring every rank's values together."""
        sharded = list(engine.model.modules()) if self.parallel == "fsdp" else None
        watch = MicroWatch(
            engine.scaler.is_enabled() is False, engine.dist.world_size, drawn, sharded, engine.primary_units
        )
        try:
            local, totals = engine.accumulate(batches, n_valid, watch)
        finally:
            watch.close()
        replayed = self._replay(engine, watch, totals) if watch.drawn is not None else []
        grad_norm = engine._clip()
        sums, stats = self._gather(engine, watch, local, k)
        scale, world = _loss_scale(engine), engine.dist.world_size
        own = [stat.own(totals.primary_count, world, scale) for stat in stats]
        return Computed(watch, sums, totals, grad_norm, replayed, stats, own)

    def _find(
        self, engine: AccumulationEngine, done: Computed, step: int, first: bool
    ) -> tuple[list[Suspect], str, bool]:
        """The micro-batches this try finds bad (every one, on every rank), the spike's detail, and whether it is
        fp16's overflow instead of a bad step."""
        suspects = [Suspect(rank=s.rank, micro=s.index, cause=s.cause) for s in done.stats if s.cause]
        detail = ""
        if not suspects and not math.isfinite(done.grad_norm):
            if engine.scaler.is_enabled():
                return [], "", True
            suspects = self._search(engine, done.watch, done.totals)
        elif not suspects and not done.replayed:
            suspects, detail = self._spiked(done, step, first)
        return suspects + done.replayed, detail, False

    def _spiked(self, done: Computed, step: int, first: bool) -> tuple[list[Suspect], str]:
        """On the step as read: whether its values, or a micro-batch's own, spiked (the detector counts it); on
        every try: the micro-batches whose own values are over the limits. When the step spiked and no micro-batch
        did, the micro-batch of the highest own value of the kind that spiked."""
        cause = ""
        detail = ""
        if first:
            spike = self.spikes.check(done.loss, done.grad_norm, done.own)
            if spike is None:
                if self.spikes.restarted:
                    log.warning("step %d: %s", step, self.spikes.restarted)
                    self.spikes.restarted = ""
                return [], ""
            cause, detail = spike
        over = self.spikes.over_micro(done.own)
        suspects = [
            Suspect(rank=done.stats[i].rank, micro=done.stats[i].index, cause=why, detail=said) for i, why, said in over
        ]
        if cause and not suspects:
            value = 0 if cause == LOSS_SPIKE else 1
            scores = [own[value] if math.isfinite(own[value]) else -math.inf for own in done.own]
            best = max(range(len(scores)), key=scores.__getitem__)
            what = "loss per token" if cause == LOSS_SPIKE else "own gradient norm"
            stat = done.stats[best]
            suspects = [Suspect(stat.rank, stat.index, cause, detail=f"the step's highest {what}, {scores[best]:.4g}")]
        return suspects, detail

    def _decide(
        self,
        engine: AccumulationEngine,
        done: Computed,
        step: int,
        suspects: list[Suspect],
        detail: str,
        index_of: list[int],
    ) -> tuple[BadStep, set[int], StepTotals | None]:
        """The bad step's record (its suspects described, their bad documents followed) with what ``--bad-step``
        does; for ``skip-micro`` also this rank's micro-batches to drop (indices in this try) and the valid targets
        left without them on every rank."""
        suspects = self._describe(engine, done.watch, suspects, index_of, done.totals)
        cause = suspects[0].cause if suspects else GRAD_NOT_FINITE
        mode = self.settings.mode
        if mode == "skip-micro" and not suspects:
            mode, detail = "skip-step", "no micro-batch to drop: the whole step is skipped"
        bad = BadStep(step, cause, tuple(suspects), ACTIONS[mode], done.loss, done.grad_norm, detail)
        if mode != "skip-micro":
            return bad, set(), None
        rank = engine.dist.rank
        dropped = {index_of.index(s.micro) for s in suspects if s.rank == rank and s.micro in index_of}
        kept = [i for i in range(len(done.watch.counts)) if i not in dropped]
        remaining = engine.step_totals([done.watch.batches[i] for i in kept])  # every term's units, every rank
        if remaining.empty:  # nothing left to train on: the step is skipped
            bad = replace(bad, action=ACTIONS["skip-step"], detail="no valid target left without them")
        return bad, dropped, remaining

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
    def _merge(found: list[BadStep], last: BadStep | None = None) -> BadStep | None:
        """One record for a step's tries: every suspect of every try, with the cause and values of the step as
        read, and what was done in the end (``last``'s action, or the micro-batches skipped)."""
        tries = found + ([last] if last is not None else [])
        if not tries:
            return None
        first = tries[0]
        details = "; ".join(dict.fromkeys(bad.detail for bad in tries if bad.detail))
        suspects = tuple(s for bad in tries for s in bad.suspects)
        return replace(
            tries[-1], cause=first.cause, loss=first.loss, grad_norm=first.grad_norm, detail=details, suspects=suspects
        )

    # ---- what the ranks found --------------------------------------------------------------------------------

    def _gather(
        self, engine: AccumulationEngine, watch: MicroWatch, local: torch.Tensor, k: int
    ) -> tuple[list[float], list[MicroStat]]:
        """One all-reduce: the step's sums (``local``: this rank's, :meth:`AccumulationEngine.accumulate`'s) and each
        micro-batch's values on every rank (:meth:`MicroWatch.values`; ``k``: the micro-batches a rank read, the
        most any holds)."""
        dist = engine.dist
        head = local.numel()
        slots = torch.zeros(head + dist.world_size * k * FIELDS, dtype=torch.float64, device=engine.device)
        slots[:head] = local.double()
        mine = watch.values().reshape(-1)
        start = head + dist.rank * k * FIELDS
        slots[start : start + mine.numel()] = mine
        values = dist.all_reduce_sum(slots).tolist()
        stats = []
        for rank in range(dist.world_size):
            for index in range(k):
                at = head + (rank * k + index) * FIELDS
                present, code, loss_sum, count, norm = values[at : at + FIELDS]
                if present:
                    cause = CAUSES[int(code) - 1] if code else ""
                    stats.append(MicroStat(rank, index, cause, loss_sum, int(count), norm))
        return values[:head], stats

    def _search(self, engine: AccumulationEngine, watch: MicroWatch, n_valid: StepTotals) -> list[Suspect]:
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

    def _describe(
        self,
        engine: AccumulationEngine,
        watch: MicroWatch,
        suspects: list[Suspect],
        index_of: list[int],
        n_valid: StepTotals,
    ) -> list[Suspect]:
        """Each suspect with its documents, its exclusion key and its verdict (re-run on its rank), and the
        micro-batches that hold parts of its bad documents, known to every rank; micro-batches numbered as the
        step read them."""
        rank = engine.dist.rank
        mine: list[tuple[int, Suspect]] = []
        for suspect in suspects:
            if suspect.rank != rank:
                continue
            batch = watch.batches[suspect.micro]
            verdict = suspect.verdict or self._verdict(engine, watch, suspect, n_valid)
            described = replace(
                suspect,
                micro=index_of[suspect.micro],
                key=getattr(batch, "origin_key", ""),
                documents=describe_origin(getattr(batch, "origin", ())),
                verdict=verdict,
            )
            mine.append((suspect.micro, described))
        taken = {(s.rank, index_of[s.micro] if s.rank == rank else s.micro) for s in suspects}
        followed = self._follow(engine, watch, mine, index_of, taken)
        return [s for ranks in engine.dist.all_gather_object(followed) for s in ranks]

    def _verdict(self, engine: AccumulationEngine, watch: MicroWatch, suspect: Suspect, n_valid: StepTotals) -> str:
        """``data`` when re-running the suspect (same inputs, same generators) reproduces what was found,
        ``transient`` when it does not."""
        if self.parallel == "fsdp":
            return "not replayed (FSDP2: a re-run needs every rank)"
        if suspect.cause in (LOSS_NOT_FINITE, GRAD_NOT_FINITE):
            return "transient" if self._finite_again(engine, watch, suspect.micro, n_valid) else "data"
        if suspect.cause == GRAD_SPIKE:
            again = self._norm_again(engine, watch, suspect.micro, n_valid)
            first = float(watch.norm(suspect.micro))
            return "data" if math.isclose(again, first, rel_tol=SAME_NORM) else "transient"
        loss = self._loss_again(engine, watch, suspect.micro)
        return "data" if loss == watch.loss_sums[suspect.micro].item() else "transient"

    # ---- bad documents ---------------------------------------------------------------------------------------

    def _follow(
        self,
        engine: AccumulationEngine,
        watch: MicroWatch,
        mine: list[tuple[int, Suspect]],
        index_of: list[int],
        taken: set[tuple[int, int]],
    ) -> list[Suspect]:
        """This rank's suspects, each naming its bad documents and where their parts are, and this rank's other
        micro-batches that hold parts of any rank's bad documents (see :mod:`bigbatch.engine.bad_documents`).
        One gather: every rank's bad documents and the parts of long documents each micro-batch holds."""
        rank = engine.dist.rank
        bad: list[BadDocument] = []
        for local, suspect in mine:
            if suspect.verdict == "data" and suspect.cause != REPLAY_MISMATCH:
                bad += self._bad_documents(engine, watch, local, suspect)
        held = [
            (key, rank, index_of[local], part.window)
            for local, batch in enumerate(watch.batches)
            for key, parts in spread_documents(batch).items()
            for part in parts
        ]
        gathered = engine.dist.all_gather_object((bad, held))
        documents: dict[str, BadDocument] = {}
        for found, _ in gathered:
            for document in found:
                documents.setdefault(document.key, document)  # the first micro-batch it was found bad in names it
        places = [place for _, ranks_held in gathered for place in ranks_held if place[0] in documents]
        described = []
        for _, suspect in mine:
            own = [d for d in documents.values() if (d.rank, d.micro) == (rank, suspect.micro)]
            if own:
                elsewhere = "; ".join(describe_parts(d, [p[1:] for p in places if p[0] == d.key]) for d in own)
                suspect = replace(suspect, bad_documents=tuple(d.key for d in own), elsewhere=elsewhere)
            described.append(suspect)
        for local, batch in enumerate(watch.batches):
            keys = sorted({p.key for p in getattr(batch, "parts", ()) if p.key in documents})
            if keys and (rank, index_of[local]) not in taken:
                d = documents[keys[0]]
                described.append(
                    Suspect(
                        rank=rank,
                        micro=index_of[local],
                        cause=d.cause,
                        key=getattr(batch, "origin_key", ""),
                        documents=describe_origin(getattr(batch, "origin", ())),
                        verdict="data",
                        detail=f"holds part of document shard {d.shard} @ {d.start:,}, bad in rank {d.rank}, "
                        f"micro-batch {d.micro}",
                        bad_documents=tuple(keys),
                    )
                )
        return described

    def _bad_documents(
        self, engine: AccumulationEngine, watch: MicroWatch, local: int, suspect: Suspect
    ) -> list[BadDocument]:
        """The documents of a suspect read as more windows than it holds whose part here, measured alone, is bad
        the way the suspect was: a non-finite loss or gradient, a loss per token or gradient norm over the limits."""
        batch = watch.batches[local]
        if not isinstance(batch, MicroBatch):
            return []
        limits = self.spikes.limits()
        found = []
        for key, parts in spread_documents(batch).items():
            masked, count = alone(batch, parts)
            if count == 0:
                continue
            if suspect.cause in (LOSS_NOT_FINITE, LOSS_SPIKE):
                loss = self._loss_again(engine, watch, local, masked) / count
                limit = limits.micro_loss if limits is not None else math.inf
                is_bad = not math.isfinite(loss) if suspect.cause == LOSS_NOT_FINITE else loss > limit
            else:
                norm = self._norm_again(engine, watch, local, _alone(engine, count), masked)
                norm /= engine.dist.world_size * _loss_scale(engine)
                limit = limits.micro_grad_norm if limits is not None else math.inf
                is_bad = not math.isfinite(norm) if suspect.cause == GRAD_NOT_FINITE else norm > limit
            if is_bad:
                first = parts[0]
                seq_len = batch.inputs.shape[-1]
                found.append(
                    BadDocument(
                        key,
                        first.shard,
                        first.start,
                        first.windows,
                        seq_len,
                        suspect.rank,
                        suspect.micro,
                        suspect.cause,
                    )
                )
        return found

    # ---- re-runs ---------------------------------------------------------------------------------------------

    def _finite_again(self, engine: AccumulationEngine, watch: MicroWatch, index: int, n_valid: StepTotals) -> bool:
        """Whether micro-batch ``index``'s loss and contribution are finite when computed again on this rank."""
        module = unwrap(engine.model)
        trained = [p for p in engine._params if p.requires_grad]
        after = capture_rng_state()
        try:
            restore_rng_state(watch.rngs[index])
            objective = engine.rerun_objective(module, watch.batches[index].to(engine.device), index, n_valid)
            if not torch.isfinite(objective.detach()).all():
                return False
            grads = torch.autograd.grad(objective, trained, allow_unused=True)
        finally:
            restore_rng_state(after)
        present = [g for g in grads if g is not None]
        return not present or bool(torch.stack(torch._foreach_norm(present, math.inf)).isfinite().all())

    def _loss_again(self, engine: AccumulationEngine, watch: MicroWatch, index: int, batch: Any = None) -> float:
        """Micro-batch ``index``'s summed loss (or ``batch``'s, a part of it) computed again on this rank."""
        module = unwrap(engine.model)
        after = capture_rng_state()
        try:
            restore_rng_state(watch.rngs[index])
            again = watch.batches[index] if batch is None else batch
            return float(engine.rerun_loss_sum(module, again.to(engine.device), index).float().item())
        finally:
            restore_rng_state(after)

    def _norm_again(
        self, engine: AccumulationEngine, watch: MicroWatch, index: int, n_valid: StepTotals, batch: Any = None
    ) -> float:
        """The norm of micro-batch ``index``'s contribution (or of ``batch``'s, a part of it, normalized by
        ``n_valid``) computed again on this rank."""
        module = unwrap(engine.model)
        trained = [p for p in engine._params if p.requires_grad]
        after = capture_rng_state()
        try:
            restore_rng_state(watch.rngs[index])
            again = watch.batches[index] if batch is None else batch
            objective = engine.rerun_objective(module, again.to(engine.device), index, n_valid)
            grads = torch.autograd.grad(objective, trained, allow_unused=True)
        finally:
            restore_rng_state(after)
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def _draw(self, engine: AccumulationEngine, step: int, k: int) -> int | None:
        """The micro-batch this step replays (``--replay-every``), from the run's seed and the step alone; the
        step's replay records start empty."""
        self.checks = []
        every = self.settings.replay_every
        if not every or step % every:
            return None
        return random.Random(f"{self.settings.seed}:{step}:{engine.dist.rank}").randrange(k)

    def _replay(self, engine: AccumulationEngine, watch: MicroWatch, n_valid: StepTotals) -> list[Suspect]:
        """The drawn micro-batch computed again and its digest compared with the first run's (what that can tell:
        :mod:`bigbatch.engine.replay`). One process: on this rank, and a third time when the two differ. Several:
        each rank re-runs the previous rank's (sent with its generators' state), one extra micro-batch per rank; only
        when a digest differs does every rank re-run its own too, and a tie between two ranks each consistent with
        itself goes to a float64 recomputation on the host. A transient fault is a suspect (a bad step); a faulty
        device raises :class:`~bigbatch.engine.replay.DeviceSuspect` on every rank alike."""
        drawn = watch.drawn
        assert drawn is not None
        self.replays += 1
        step, dist, module = engine.step_count + 1, engine.dist, unwrap(engine.model)

        def mine(micro: DrawnMicroBatch) -> list[torch.Tensor | None]:
            def objective(m: torch.nn.Module, batch: Any) -> torch.Tensor:
                return engine.rerun_objective(m, batch, micro.index, n_valid)

            return contribution(module, engine._params, micro, objective, engine.device)

        def rerun(micro: DrawnMicroBatch) -> str:
            return digest(mine(micro))

        if dist.world_size == 1:
            judgement, self.checks = replay_alone(drawn, rerun)
            shared = [drawn]
        else:
            judgement, self.checks, shared = replay_ring(dist, drawn, rerun)
            if judgement.disputes:
                loss_scale = float(engine.scaler.get_scale()) if engine.scaler.is_enabled() else 1.0

                def host(micro: DrawnMicroBatch) -> list[torch.Tensor | None] | None:
                    def plain(m: torch.nn.Module, batch: Any) -> torch.Tensor:
                        return engine.plain_objective(m, batch, micro.index, n_valid)

                    return host_reference(module, engine._params, micro, plain, loss_scale)

                break_ties(dist, judgement, shared, mine, host)
        if judgement.faulty or judgement.disputes:
            raise device_fault(step, judgement, shared, self.checks, self.last_matched)
        if all(check.matched for check in self.checks):
            self.last_matched = step
        return judgement.transient

    def take_checks(self) -> list[ReplayCheck]:
        """The replays of the step last run (each rank's drawn micro-batch: who re-ran it, whether it matched),
        once: the loop's ``kind: replay`` record."""
        checks, self.checks = self.checks, []
        return checks

    def state_dict(self) -> dict[str, Any]:
        return {"spikes": self.spikes.state_dict(), "replays": self.replays, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.replays = int(state.get("replays", 0))
        self.dropped = int(state.get("dropped", 0))
