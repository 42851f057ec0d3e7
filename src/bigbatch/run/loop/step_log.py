"""Where each training step's record goes: the metrics sinks (``metrics.jsonl`` and the optional loggers, rank 0
only) and the step's log line, with the model FLOPs utilization when the devices' peak is known."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bigbatch.data.documents import DocumentLoader
from bigbatch.engine.accumulate import StepRecord
from bigbatch.engine.batch_change import BatchChange
from bigbatch.engine.replay import ReplayCheck
from bigbatch.observe.metrics import MetricsFanout, MetricsSink, format_noise_scale, format_step, mfu, open_metrics
from bigbatch.parallel.distributed import Say
from bigbatch.run.build import RunParts


class StepLog:
    """The loop's record of its steps. :meth:`open` (rank 0) opens the sinks; until then, and on the other ranks,
    only the log lines are said (and ``say`` is quiet off rank 0)."""

    def __init__(self, parts: RunParts, say: Say) -> None:
        self.parts, self.say = parts, say
        self.metrics: MetricsSink | None = None

    def open(self, step: int) -> None:
        """Open the sinks at the step the session starts from; a documents run first records where one epoch's
        positions go, as the header says."""
        parts, run = self.parts, self.parts.config.run
        metrics = open_metrics(parts.run_dir, run.tensorboard, run.wandb, parts.config.to_dict())
        self.metrics = metrics
        documents = parts.train_loader
        if isinstance(documents, DocumentLoader):
            padding, prompt = documents.position_shares()
            metrics.write_documents(
                step,
                packed=documents.pack,
                rows=documents.n_sequences,
                seq_len=documents.seq_len,
                padding_share=padding,
                prompt_share=prompt,
            )

    def restarted(self, step: int, attempt: int, resumed: bool) -> None:
        """Say and record once that torchrun's agent restarted the workers (``attempt`` > 0) and where from."""
        if attempt < 1:
            return
        run = self.parts.config.run
        where = f"resumed at step {step}" if resumed else "started over (no checkpoint was committed)"
        self.say(
            "restart %d%s by torchrun's elastic agent after a worker failed: %s",
            attempt,
            f" of at most {run.max_restarts}" if run.max_restarts else "",
            where,
            level=logging.WARNING,
        )
        if isinstance(self.metrics, MetricsFanout):
            self.metrics.write_restart(step, attempt=attempt, resumed=resumed, world_size=self.parts.dist.world_size)

    def batch_change(self, change: BatchChange) -> None:
        """A change of the tokens per step: its line and its ``kind: batch_change`` record."""
        self.say("%s", change.line())
        if isinstance(self.metrics, MetricsFanout):
            self.metrics.write_batch_change(**change.record())

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization of all devices, when their peak is known (GPU table or --peak-flops)."""
        parts = self.parts
        if not parts.peak_flops:
            return None
        flops_per_token = parts.model.flops_per_token(parts.config.batch.seq_len)
        return mfu(flops_per_token, tokens_per_s, parts.peak_flops, parts.dist.world_size)

    def write_step(self, record: StepRecord) -> float | None:
        """The step's record to the sinks; its MFU (for the log line)."""
        step_mfu = self.mfu(record.tokens_per_s)
        if self.metrics:
            self.metrics.write_step(record, mfu=step_mfu)
        guard = self.parts.engine.guard
        if guard is not None:  # every rank takes them (rank 0 writes them)
            self.write_replays(record.step, guard.take_checks())
        return step_mfu

    def write_replays(self, step: int, checks: Sequence[ReplayCheck]) -> None:
        """A step's replays, one ``kind: replay`` record (each rank's drawn micro-batch, the ranks that re-ran it,
        whether it matched): a long run's checks can be audited, not only counted."""
        if checks and isinstance(self.metrics, MetricsFanout):
            self.metrics.write_event("replay", step, replays=[check.as_dict() for check in checks])

    def say_skipped(self, record: StepRecord) -> None:
        """A step with a non-finite gradient (no update was applied): always said, as a warning."""
        self.say(format_step(record, show_k=True), level=logging.WARNING)

    def say_step(self, record: StepRecord, step_mfu: float | None, at_eval: bool, last: bool, stopping: int) -> None:
        """The step's line, every ``--log-every`` steps, at the last step and when a stop was requested; the noise
        scale's estimate with it at an evaluation and at the end."""
        parts, run = self.parts, self.parts.config.run
        if record.step % run.log_every == 0 or last or stopping:
            noise = parts.noise.estimate if parts.noise and (at_eval or last) else None
            line = format_step(record, show_k=parts.k_varies, mfu_value=step_mfu, noise_scale=noise)
            self.say("%s%s", line, " | stopping: saving a checkpoint" if stopping and not last else "")


def grow_auto_ramp(parts: RunParts, next_step: int, say: Say) -> None:
    """Grow an auto ramp from the noise meter's estimate (rank 0 decides, the others are told); ``next_step`` is
    the first step at the new size. Nothing without an auto ramp and a meter."""
    ramp, noise, dist = parts.ramp, parts.noise, parts.dist
    if ramp is None or not ramp.spec.auto or noise is None:
        return
    grown = ramp.grow(noise.estimate) if dist.is_main else None
    grown = dist.broadcast_object(grown)
    if grown is None:
        return
    if not dist.is_main:
        ramp.auto_tokens = grown.k_after * ramp.unit
    say(
        "batch ramp auto: K %d -> %d (%s -> %s tokens/step) from step %d; measured noise scale %s tokens",
        grown.k_before,
        grown.k_after,
        f"{grown.k_before * ramp.unit:,}",
        f"{grown.k_after * ramp.unit:,}",
        next_step,
        format_noise_scale(noise.estimate or 0.0),
    )
