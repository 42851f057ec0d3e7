"""The training loop: step, log, evaluate, save, stop.

:func:`~bigbatch.run.build.build_run` builds the parts, :class:`~bigbatch.run.checkpoints.state.TrainState` saves
and restores them; this module only runs them, one optimizer step at a time. Beside the steps, the loop hands each
record to :mod:`.step_log` (which also grows an auto ramp), evaluates and samples through :mod:`.evaluation`,
saves and stops as :mod:`.stopping` says and ends with :mod:`.summary`'s lines; :mod:`.tally` keeps what it has seen.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.prefetch import PrefetchLoader
from bigbatch.engine.accumulate import AccumulationEngine, StepRecord
from bigbatch.engine.batch import StepBatch, read_step
from bigbatch.models import LanguageModel, ModelConfig
from bigbatch.parallel.distributed import DistContext, resolve_device, restart_attempt
from bigbatch.parallel.signals import StopRequest
from bigbatch.progress import ProgressBar
from bigbatch.run.build import RunParts, build_run
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.bad_step_handling import BadStepHandling
from bigbatch.run.loop.evaluation import end_of_run_sample, evaluate_during_training, evaluate_windows, sample_run
from bigbatch.run.loop.header import header_lines
from bigbatch.run.loop.run_dir_files import start_run_dir
from bigbatch.run.loop.start import say_complete, start_point
from bigbatch.run.loop.step_log import StepLog, grow_auto_ramp
from bigbatch.run.loop.step_sizes import follow_batch_change, next_k, planned_tokens, seesaw_stop_note
from bigbatch.run.loop.stopping import StopHandling, check_diverging
from bigbatch.run.loop.summary import say_summary
from bigbatch.run.loop.tally import LoopTally, trained_part
from bigbatch.run.loop.validation_loss import ValidationResult
from bigbatch.sizing.plan import BatchPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int
    tokens_seen: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float  # valid target tokens / seconds of the session's steps after its first (see LoopTally)
    sample: str | None
    stopped_by: int = 0  # the signal that stopped the run early, or 0


class Trainer:
    """Builds every part from a :class:`TrainConfig`; :meth:`train` runs it to ``max_steps``.

    ``branch_from`` (a checkpoint of another run) starts a fresh run where that checkpoint stood, with this
    config's own tokens per step and schedule (see :mod:`bigbatch.run.checkpoints.branch`); a run that has
    checkpoints of its own resumes them instead.

    Under torchrun, pass the :class:`DistContext` and device of
    :func:`~bigbatch.parallel.distributed.distributed_session`: every rank builds the same parts, reads its own stride
    of the data and makes the same decisions; only rank 0 prints and writes files.
    """

    def __init__(
        self,
        config: TrainConfig,
        dist: DistContext | None = None,
        device: torch.device | None = None,
        branch_from: Path | None = None,
        prefetch: bool = True,
    ) -> None:
        self.progress: ProgressBar | None = None  # the terminal's progress bar while train() runs (rank 0, TTY)
        self.config, self.dist = config, dist or DistContext()
        device = device or resolve_device(config.run.device, self.dist.local_rank)
        self.parts: RunParts = build_run(config, self.dist, device, self._say)  # holds the run directory
        self.config = self.parts.config  # with seq_len resolved
        self.run_dir = self.parts.run_dir
        try:
            self._restore(branch_from, prefetch)
        except BaseException:
            self.close()
            raise

    def _restore(self, branch_from: Path | None, prefetch: bool) -> None:
        """The state to start from: the run's own checkpoint, a branch's parent, or a fresh start."""
        start = start_point(self.parts, branch_from, prefetch, self._say)
        self.state, self.loader, self.saves = start.state, start.loader, start.saves
        self.resumed_from, self.change_cause, self.completed = start.resumed_from, start.change_cause, start.completed

    def close(self) -> None:
        """Finish a checkpoint in flight, then give the run directory up (:meth:`train` does when it ends):
        another process may train in it now."""
        state = getattr(self, "state", None)  # none when building the run failed
        if state is not None:
            state.close()
        if self.parts.run_lock is not None:
            self.parts.run_lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> AccumulationEngine:
        return self.parts.engine

    @property
    def model(self) -> LanguageModel:
        return self.parts.model

    @property
    def model_config(self) -> ModelConfig:
        return self.parts.model.config

    @property
    def plan(self) -> BatchPlan:
        return self.parts.plan

    @property
    def train_loader(self) -> PrefetchLoader:
        """The training loader as the loop reads it: its ``epoch`` and ``state_dict()`` are those after the
        micro-batches taken so far (the wrapped loader itself is ``.loader``)."""
        return self.loader

    def next_step(self) -> StepBatch:
        """This rank's micro-batches for the next step and the step's global valid-target count (K from the batch
        ramp at the tokens seen so far, from Seesaw at this step, or the plan's)."""
        policy = replace(self.parts.policy, k=next_k(self.parts, self.state.step, self.state.tokens_seen))
        return read_step(self.loader, policy, self.dist, self.parts.device)

    def train(self) -> TrainResult:
        """Train to ``max_steps`` (or a stop signal), then give the run directory up."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> TrainResult:
        if self.completed:
            say_complete(self.parts, self.state.step, self._say)
            return self._result(LoopTally(), sample=None)  # a requeueing scheduler needs exit 0
        if self.dist.is_main:
            start_run_dir(self.parts, fresh=self.resumed_from is None, say=self._say)
        for line in header_lines(self.parts):
            self._say("%s", line)
        note = seesaw_stop_note(self.parts)
        if note:
            self._say("%s", note, level=logging.WARNING)
        step_log = StepLog(self.parts, self._say)  # this session's (holding no reference to self past it)
        self.bad_steps = BadStepHandling(self.parts, self._say)
        if self.dist.is_main:
            step_log.open(self.state.step)
            step_log.restarted(self.state.step, restart_attempt(), resumed=self.resumed_from is not None)
        self.bad_steps.start(self.state, self.saves)
        stops = StopHandling(self.dist, self.parts.device, self.state, self.saves, self.run_dir, self._say, self._clear)
        self.progress = ProgressBar(
            self.parts.last_step, enabled=None if self.dist.is_main else False, stream=sys.stderr
        )
        self.progress.update(self.state.step)
        seen = LoopTally()
        try:
            with StopRequest(stops.announce) as stop:
                while self.state.step < self.parts.last_step and not seen.stopped_by:
                    self._train_one_step(seen, stop, stops, step_log)
        except KeyboardInterrupt:
            stops.say_aborted()
            raise
        finally:
            self.loader.close()  # stop reading ahead
            self.progress.close()
            self.progress = None
            step_log.close()
        self.state.finish_saves()  # the last checkpoint is committed before the run says it is done
        if seen.stopped_by:
            return self._result(seen, sample=None)
        sample = end_of_run_sample(self.parts, self.sample, self._say)
        say_summary(self.parts, self.state, seen, step_log.mfu, self._say, self.bad_steps.summary())
        return self._result(seen, sample)

    def _train_one_step(self, seen: LoopTally, stop: StopRequest, stops: StopHandling, step_log: StepLog) -> None:
        """One optimizer step (or one skipped), then its log line, evaluation, checkpoint and stop check."""
        run = self.config.run
        tokens_per_step = planned_tokens(self.parts, self.state.step, self.state.tokens_seen)
        step = self.next_step()
        if step.n_valid == 0:
            self._say("skipping a step whose micro-batches hold no valid targets", level=logging.WARNING)
            seen.empty_steps.skipped(self.loader)
            stops.check(seen, stop, saved=False)
            return
        seen.empty_steps.reset()
        follow_batch_change(
            self.parts, self.state.step, self.state.tokens_seen, tokens_per_step, self.change_cause, step_log
        )
        self.change_cause = self.parts.batch_change_cause
        with self.bad_steps.device_faults(step_log):  # a faulty device found by a replay: recorded, then the run stops
            record = self._run_step(step, seen, stops, tokens_per_step)
        step_mfu = step_log.write_step(record)
        if self.bad_steps.handle(record, step_log, self.state, self.saves):
            seen.rewound(self.state.step)  # the positions of the steps undone are no longer trained
            stops.step_pending = True  # the loop goes on with the step after the checkpoint
            return  # rewound: the loop goes on from the checkpoint's step
        if record.skipped:  # a non-finite gradient: no update was applied
            step_log.say_skipped(record)
            check_diverging(seen, record, run.max_consecutive_skips)
            stops.check(seen, stop, saved=False)
            return
        seen.consecutive_skips = 0
        self.state.tokens_seen += record.tokens
        seen.applied(record)
        last = record.step == self.parts.last_step
        at_eval = self.parts.val_loader is not None and (record.step % run.eval_every == 0 or last)
        step_log.say_step(record, step_mfu, at_eval, last, stop.signum)
        if at_eval:
            result = evaluate_during_training(self.parts, self.state.step, stop, step_log.metrics, self._say)
            if result is not None:
                seen.val_loss = result.loss
        if record.noise is not None:
            grow_auto_ramp(self.parts, self.state.step + 1, self._say)
        saved = self.saves.due(record.step, last)
        if saved:
            self.saves.save(self.state, record.step, self._say)
            seen.saved(record.step)
        assert self.progress is not None
        self.progress.update(record.step, record.tokens_per_s, extra="stopping after this step" if stop.signum else "")
        stops.check(seen, stop, saved)

    def _run_step(self, step: StepBatch, seen: LoopTally, stops: StopHandling, tokens_per_step: int) -> StepRecord:
        """The engine's step on the step's micro-batches (pinned for CUDA by the loader); a documents step's
        record carries where its positions went."""
        record = self.engine.step(step.micro_batches, step.n_valid, tokens_per_step)
        stops.step_pending = False  # applied (or skipped): a stop request now comes after this step
        if step.positions:
            if not record.skipped:  # what was trained: without the micro-batches dropped or left out
                guard = self.engine.guard
                step = trained_part(step, record, guard.excluded if guard else set(), self.dist, self.parts.device)
                seen.count_positions(step)
            record = replace(record, padding_share=step.padding_share, prompt_share=step.prompt_share)
        seen.record = record
        return record

    def evaluate(self, stop: StopRequest | None = None) -> float | None:
        """Mean validation loss (see :func:`bigbatch.run.loop.validation_loss.score_windows`); a stop signal on any
        rank cuts the pass short, and then there is no number."""
        result = self.evaluate_windows(stop)
        return None if result is None else result.loss

    def evaluate_windows(self, stop: StopRequest | None = None) -> ValidationResult | None:
        """The validation loss and the tokens it scored (see :meth:`evaluate`)."""
        return evaluate_windows(self.parts, stop)

    def sample(self, max_new_tokens: int, prompt: str) -> str:
        """Every rank generates the same text (FSDP needs all ranks in each forward); rank 0 reports it."""
        return sample_run(self.parts, max_new_tokens, prompt)

    def _result(self, seen: LoopTally, sample: str | None) -> TrainResult:
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.state.step,
            tokens_seen=self.state.tokens_seen,
            final_loss=seen.record.loss if seen.record else float("nan"),
            val_loss=seen.val_loss,
            tokens_per_s=seen.throughput.tokens_per_s if seen.throughput else 0.0,
            sample=sample,
            stopped_by=seen.stopped_by,
        )

    def _clear(self) -> None:
        """The progress bar's line, before anything else writes to the console."""
        if self.progress is not None:
            self.progress.clear()

    def _say(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Log on rank 0 only (above the progress bar, which the next update redraws)."""
        if self.dist.is_main:
            self._clear()
            log.log(level, message, *args)
