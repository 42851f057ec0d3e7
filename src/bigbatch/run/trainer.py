"""The training loop: step, log, evaluate, save, stop.

:func:`~bigbatch.run.build.build_run` builds the parts, :class:`~bigbatch.run.state.TrainState` saves and
restores them; this module only runs them, one optimizer step at a time.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.prefetch import PrefetchLoader
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.engine.accumulate import AccumulationEngine, StepRecord
from bigbatch.engine.batch import EmptyStepGuard, StepBatch, read_step
from bigbatch.errors import BigBatchError, TrainingError
from bigbatch.models import LanguageModel, ModelConfig
from bigbatch.models.sampling import sample_text
from bigbatch.observe.metrics import (
    MetricsSink,
    Throughput,
    format_noise_scale,
    format_step,
    mfu,
    open_metrics,
)
from bigbatch.parallel.distributed import DistContext, resolve_device, unwrap
from bigbatch.parallel.signals import StopRequest
from bigbatch.progress import ProgressBar, plural
from bigbatch.run.branch import branch_run
from bigbatch.run.build import RunParts, build_run
from bigbatch.run.config import TrainConfig
from bigbatch.run.files import copy_run_tokenizer, start_run_dir
from bigbatch.run.header import header_lines
from bigbatch.run.state import TrainState, resume_run
from bigbatch.run.validation_loss import ValidationResult, score_windows
from bigbatch.sizing.plan import BatchPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int
    tokens_seen: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float  # valid target tokens / seconds of the session's steps after its first (see _LoopTally)
    sample: str | None
    stopped_by: int = 0  # the signal that stopped the run early, or 0


@dataclass
class _LoopTally:
    """What the loop has seen so far."""

    record: StepRecord | None = None
    val_loss: float | None = None
    first: StepRecord | None = None  # the session's first applied step: it includes warm-up (and compilation)
    timed: Throughput | None = None  # the session's applied steps after the first: their tokens and seconds
    consecutive_skips: int = 0
    empty_steps: EmptyStepGuard = field(default_factory=EmptyStepGuard)
    stopped_by: int = 0
    positions: int = 0  # documents: positions of the steps trained (all ranks), and of them padding, masked prompts
    padding: int = 0
    prompt: int = 0

    def applied(self, record: StepRecord) -> None:
        """Count an applied step's tokens and time toward the throughput, unless it is the session's first."""
        if self.first is None:
            self.first = record
        elif self.timed is None:
            self.timed = Throughput(record.tokens, record.dt, record.step, record.step)
        else:
            t = self.timed
            self.timed = Throughput(t.tokens + record.tokens, t.seconds + record.dt, t.first_step, record.step)

    @property
    def throughput(self) -> Throughput | None:
        """Total tokens over total time of the session's steps after its first (a ratio of totals, not a mean of
        the steps' rates); a session of one step: that step's, said to include warm-up; none before a step."""
        if self.timed is not None:
            return self.timed
        first = self.first
        return None if first is None else Throughput(first.tokens, first.dt, first.step, first.step, warm_up=True)


def critical_batch_line(estimate: float, measurements: int, how: str, tokens_per_step: int) -> str:
    """The end-of-run line on the measured critical batch (the smoothed noise scale ``estimate``, in tokens),
    against the run's tokens per step (``how``: ``used`` or ``ended at``); while the estimate is not positive (or
    NaN), it says there is none yet."""
    used = f"this run {how} {tokens_per_step:,} tokens per step"
    if estimate > 0:
        return f"measured critical batch about {format_noise_scale(estimate)} tokens; {used}"
    return (
        f"critical batch: no estimate yet (the smoothed noise scale is not positive after "
        f"{plural(measurements, 'measurement')}: the gradient noise still drowns the signal; train longer); {used}"
    )


def prefetch_depth(parts: RunParts) -> int:
    """Micro-batches to read ahead: one step's (K; with a token budget, as many as a step of full micro-batches
    needs, plus one)."""
    budget = parts.policy.token_budget
    if budget:
        per_micro_batch = parts.plan.micro_batch * parts.plan.seq_len * parts.dist.world_size
        return -(-budget // per_micro_batch) + 1
    return max(1, parts.policy.k)


class Trainer:
    """Builds every part from a :class:`TrainConfig`; :meth:`train` runs it to ``max_steps``.

    ``branch_from`` (a checkpoint of another run) starts a fresh run where that checkpoint stood, with this
    config's own tokens per step and schedule (see :mod:`bigbatch.run.branch`); a run that has checkpoints of its own
    resumes them instead.

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
        config = self.config
        self.state = TrainState(self.parts)
        # The next step's micro-batches are read (and pinned for CUDA) by a background thread while this one
        # computes; checkpoints save the position after the micro-batches trained on (``prefetch=False``:
        # read in the loop).
        self.loader = PrefetchLoader(
            self.parts.train_loader, prefetch_depth(self.parts) if prefetch else 0, self.parts.device.type == "cuda"
        )
        self.state.loader = self.loader
        self.resumed_from = self.parts.resume_from
        if self.resumed_from is not None:
            resume_run(self.state, self.resumed_from, self._say)
        elif branch_from is not None:  # a fresh branch: start where the parent's checkpoint stood
            branch_run(self.state, branch_from, self._say)
        elif config.run.allow_ramp_change:
            self._say(
                "--allow-ramp-change has no effect: there is no run to resume in %s (the default run directory "
                "depends on the ramp: give --out the directory of the run to change)",
                self.run_dir,
                level=logging.WARNING,
            )
        self.completed = self.resumed_from is not None and self.state.step >= config.run.max_steps
        self._saved_step = self.state.step if self.resumed_from is not None else 0  # the newest checkpoint's step
        self._in_step = False  # inside an engine step: what a stop request waits for

    def close(self) -> None:
        """Give the run directory up (:meth:`train` does when it ends): another process may train in it now."""
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
        """This rank's micro-batches for the next step and the step's global valid-target count (K from the
        batch ramp, when there is one, at the tokens seen so far)."""
        policy = self.parts.policy
        if self.parts.ramp is not None:
            policy = replace(policy, k=self.parts.ramp.k(self.state.tokens_seen))
        return read_step(self.loader, policy, self.dist, self.parts.device)

    def train(self) -> TrainResult:
        """Train to ``max_steps`` (or a stop signal), then give the run directory up."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> TrainResult:
        run = self.config.run
        if self.completed:
            self._say(
                "the run in %s is complete: it reached step %d (max_steps %d); nothing to do (raise --max-steps, "
                "with --extend-schedule to stretch the learning-rate decay, to train on)",
                self.run_dir,
                self.state.step,
                run.max_steps,
            )
            return self._result(_LoopTally(), sample=None)  # a requeueing scheduler needs exit 0
        if self.dist.is_main:
            start_run_dir(self.parts, fresh=self.resumed_from is None, say=self._say)
        for line in header_lines(self.parts):
            self._say("%s", line)
        metrics = None
        if self.dist.is_main:
            metrics = open_metrics(self.run_dir, run.tensorboard, run.wandb, self.config.to_dict())
            documents = self.parts.train_loader
            if isinstance(documents, DocumentLoader):  # where one epoch's positions go, as the header says
                padding, prompt = documents.position_shares()
                metrics.write_documents(
                    self.state.step,
                    packed=documents.pack,
                    rows=documents.n_sequences,
                    seq_len=documents.seq_len,
                    padding_share=padding,
                    prompt_share=prompt,
                )
        self.progress = ProgressBar(run.max_steps, enabled=None if self.dist.is_main else False, stream=sys.stderr)
        self.progress.update(self.state.step)
        seen = _LoopTally()
        try:
            with StopRequest(self._announce_stop) as stop:
                while self.state.step < run.max_steps and not seen.stopped_by:
                    self._train_one_step(seen, stop, metrics)
        except KeyboardInterrupt:
            self._say_aborted()
            raise
        finally:
            self.loader.close()  # stop reading ahead
            self.progress.close()
            self.progress = None
            if metrics:
                metrics.close()
        if seen.stopped_by:
            return self._result(seen, sample=None)
        return self._finish(seen)

    def _train_one_step(self, seen: _LoopTally, stop: StopRequest, metrics: MetricsSink | None) -> None:
        """One optimizer step (or one skipped), then its log line, evaluation, checkpoint and stop check."""
        run = self.config.run
        step = self.next_step()
        if step.n_valid == 0:
            self._say("skipping a step whose micro-batches hold no valid targets", level=logging.WARNING)
            seen.empty_steps.skipped(self.loader)
            self._check_stop(seen, stop, saved=False)
            return
        seen.empty_steps.reset()
        self._in_step = True
        record = self.engine.step(step.micro_batches, step.n_valid)  # pinned for CUDA by the loader
        if step.positions:  # documents: where the step's positions went
            record = replace(record, padding_share=step.padding_share, prompt_share=step.prompt_share)
            seen.positions += step.positions
            seen.padding += step.padding
            seen.prompt += step.positions - step.padding - step.n_valid
        seen.record = record
        self._in_step = False
        step_mfu = self._mfu(record.tokens_per_s)
        if metrics:
            metrics.write_step(record, mfu=step_mfu)
        if record.skipped:  # a non-finite gradient: no update was applied
            self._say(format_step(record, show_k=True), level=logging.WARNING)
            seen.consecutive_skips += 1
            if seen.consecutive_skips >= run.max_consecutive_skips:
                raise TrainingError(
                    f"{plural(seen.consecutive_skips, 'consecutive step')} had a non-finite gradient (loss "
                    f"{record.loss}); the run is diverging: lower --lr, check the data, or use bf16 rather than fp16"
                )
            self._check_stop(seen, stop, saved=False)
            return
        seen.consecutive_skips = 0
        self.state.tokens_seen += record.tokens
        seen.applied(record)
        last = record.step == run.max_steps
        at_eval = self.parts.val_loader is not None and (record.step % run.eval_every == 0 or last)
        if record.step % run.log_every == 0 or last or stop.signum:
            noise = self.parts.noise.estimate if self.parts.noise and (at_eval or last) else None
            line = format_step(record, show_k=self.parts.k_varies, mfu_value=step_mfu, noise_scale=noise)
            self._say("%s%s", line, " | stopping: saving a checkpoint" if stop.signum and not last else "")
        if at_eval:
            self._evaluate(seen, stop, metrics)
        if record.noise is not None:
            self._grow_auto_ramp()
        saved = last or bool(run.save_every and record.step % run.save_every == 0)
        if saved:
            self.state.save(self._say)
            self._saved_step = record.step
        assert self.progress is not None
        self.progress.update(record.step, record.tokens_per_s, extra="stopping after this step" if stop.signum else "")
        self._check_stop(seen, stop, saved)

    def _grow_auto_ramp(self) -> None:
        """``--batch-ramp auto``, after a step that measured the noise scale: rank 0 decides, every rank follows."""
        ramp, noise = self.parts.ramp, self.parts.noise
        if ramp is None or not ramp.spec.auto or noise is None:
            return
        grown = ramp.grow(noise.estimate) if self.dist.is_main else None
        grown = self.dist.broadcast_object(grown)
        if grown is None:
            return
        if not self.dist.is_main:
            ramp.auto_tokens = grown.k_after * ramp.unit
        self._say(
            "batch ramp auto: K %d -> %d (%s -> %s tokens/step) from step %d; measured noise scale %s tokens",
            grown.k_before,
            grown.k_after,
            f"{grown.k_before * ramp.unit:,}",
            f"{grown.k_after * ramp.unit:,}",
            self.state.step + 1,
            format_noise_scale(noise.estimate or 0.0),
        )

    def _evaluate(self, seen: _LoopTally, stop: StopRequest, metrics: MetricsSink | None) -> None:
        started, step = time.perf_counter(), self.state.step
        result = self.evaluate_windows(stop)
        if result is not None:
            seen.val_loss = result.loss
            if metrics:
                metrics.write_eval(step, result.loss, val_tokens=result.tokens)
            self._say(
                "eval step %d | val loss %.4f | %s | %.1fs",
                step,
                result.loss,
                plural(result.tokens, "token"),
                time.perf_counter() - started,
            )
        elif not stop.signum:
            self._say(
                "eval step %d | no val loss: the validation windows hold no valid targets; raise --eval-batches",
                step,
                level=logging.WARNING,
            )

    def evaluate(self, stop: StopRequest | None = None) -> float | None:
        """Mean validation loss (see :func:`bigbatch.run.validation_loss.score_windows`); a stop signal on any
        rank cuts the pass short, and then there is no number."""
        result = self.evaluate_windows(stop)
        return None if result is None else result.loss

    def evaluate_windows(self, stop: StopRequest | None = None) -> ValidationResult | None:
        """The validation loss and the tokens it scored (see :meth:`evaluate`)."""
        agreed = (lambda: bool(self.dist.max_int(stop.signum, self.parts.device))) if stop is not None else None
        parts = self.parts
        assert parts.val_loader is not None
        engine = parts.engine
        return score_windows(
            parts.train_model, parts.val_loader, parts.device, engine.precision, parts.dist, engine.loss_fn, agreed
        )

    def _check_stop(self, seen: _LoopTally, stop: StopRequest, saved: bool) -> None:
        """Stop at this step boundary if any rank received SIGTERM/SIGINT (all ranks agree), after a save."""
        seen.stopped_by = self.dist.max_int(stop.signum, self.parts.device)
        if not seen.stopped_by:
            return
        if not saved:
            self.state.save(self._say)
            self._saved_step = self.state.step
        self._say(
            "stopped by %s after step %d; checkpoint saved in %s; run the same command to resume",
            signal.Signals(seen.stopped_by).name,
            self.state.step,
            self.run_dir,
            level=logging.WARNING,
        )

    def _announce_stop(self, signum: int) -> None:
        """At once, from the signal handler (rank 0, on the console): what the first Ctrl-C/SIGTERM will do."""
        if not self.dist.is_main:
            return
        step = self.state.step + (1 if self._in_step else 0)
        if self._saved_step:
            kept = f"the newest checkpoint is step {self._saved_step}"
        else:
            kept = (
                f"no checkpoint yet: the {plural(step, 'step')} so far would be lost" if step else "nothing trained yet"
            )
        if self.progress is not None:
            self.progress.clear()
        sys.stderr.write(
            f"bigbatch: {signal.Signals(signum).name}: stopping after step {step} and saving a checkpoint; press "
            f"Ctrl-C again to abort without saving ({kept})\n"
        )
        sys.stderr.flush()

    def _say_aborted(self) -> None:
        """After a second Ctrl-C: what was kept."""
        if self._saved_step:
            self._say(
                "aborted without saving during step %d: the run continues from its newest checkpoint, step %d in %s; "
                "run the same command to resume",
                self.state.step + 1,
                self._saved_step,
                self.run_dir,
                level=logging.WARNING,
            )
        else:
            self._say(
                "aborted without saving during step %d: no checkpoint was saved, the run starts over next time "
                "(--save-every N keeps one every N steps)",
                self.state.step + 1,
                level=logging.WARNING,
            )

    def _finish(self, seen: _LoopTally) -> TrainResult:
        """The end-of-run sample and summary line."""
        run = self.config.run
        sample = None
        if run.sample_tokens:
            try:
                sample = self.sample(run.sample_tokens, run.sample_prompt)
                self._say("sample:\n%s", sample)
                if self.dist.is_main and self.parts.dataset.meta.tokenizer == "gpt2":
                    copy_run_tokenizer(self.parts, self._say)  # the sample has loaded the GPT-2 encoding
            except BigBatchError as exc:  # e.g. the GPT-2 encoding cannot be downloaded: the run itself is done
                self._say("no sample: %s", exc, level=logging.WARNING)
        assert seen.record is not None
        self._say(
            "done | %s | %s%s | final loss %.4f%s",
            plural(self.state.step, "step"),
            plural(self.state.tokens_seen, "token"),
            self._describe_throughput(seen.throughput),
            seen.record.loss,
            f" | val loss {seen.val_loss:.4f}" if seen.val_loss is not None else "",
        )
        if seen.positions:
            self._say(
                "positions | %s trained on: %.1f%% padding, %.1f%% masked prompts, %.1f%% valid targets",
                f"{seen.positions:,}",
                100 * seen.padding / seen.positions,
                100 * seen.prompt / seen.positions,
                100 * (seen.positions - seen.padding - seen.prompt) / seen.positions,
            )
        self._say_noise_scale(seen.record)
        return self._result(seen, sample)

    def _describe_throughput(self, throughput: Throughput | None) -> str:
        """`` | tok/s 4,331 (tokens / time of steps 2..120) | mfu 3.1% (at that tok/s)``: MFU from the same ratio
        of totals; nothing when no step applied an update."""
        if throughput is None:
            return ""
        text = f" | {throughput.describe()}"
        value = self._mfu(throughput.tokens_per_s)
        return text + (f" | mfu {value:.1%} (at that tok/s)" if value is not None else "")

    def _say_noise_scale(self, last: StepRecord | None) -> None:
        """The measured critical batch (the smoothed gradient noise scale) against this run's tokens per step: the
        last step's size when steps have one size or a ramp grows it, else the mean over the run's steps."""
        noise = self.parts.noise
        if noise is None or noise.estimate is None or not self.state.step:
            return
        if last is not None and (not self.parts.k_varies or self.parts.ramp is not None):
            used, how = last.tokens, "ended at" if self.parts.ramp is not None else "used"
        else:
            used, how = round(self.state.tokens_seen / self.state.step), "used"
        self._say("%s", critical_batch_line(noise.estimate, noise.scale.measurements, how, used))

    def _result(self, seen: _LoopTally, sample: str | None) -> TrainResult:
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

    def sample(self, max_new_tokens: int, prompt: str) -> str:
        """Every rank generates the same text (FSDP needs all ranks in each forward); rank 0 reports it."""
        p = self.parts
        model = p.model if p.parallel == "fsdp" else unwrap(p.model)
        tokenizer = get_tokenizer(p.dataset.meta.tokenizer, p.dataset.directory)
        return sample_text(model, tokenizer, prompt, max_new_tokens, self.config.run.seed, p.device)  # type: ignore[arg-type]

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization of all devices, when their peak is known (GPU table or --peak-flops)."""
        if not self.parts.peak_flops:
            return None
        flops_per_token = self.parts.model.flops_per_token(self.config.batch.seq_len)
        return mfu(flops_per_token, tokens_per_s, self.parts.peak_flops, self.dist.world_size)

    def _say(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Log on rank 0 only (above the progress bar, which the next update redraws)."""
        if self.dist.is_main:
            if self.progress is not None:
                self.progress.clear()
            log.log(level, message, *args)
