"""What the loop does with a bad step the engine found (see :mod:`bigbatch.engine.bad_steps`): says it in one
line and records it (``kind: bad_step`` in ``metrics.jsonl``), ends the run for ``--bad-step stop``, and for
``rewind`` goes back to the newest committed checkpoint and replays without the suspect micro-batches.

The micro-batches a rewind leaves out are named by where their tokens come from (and a bad document, followed to
every micro-batch holding a part of it, by its shard and first token), kept with the number of rewinds in
``RUN/bad-steps.json`` (written before the rewind), so a run that stops or crashes after a rewind still leaves them
out when it resumes.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bigbatch.engine.accumulate import StepRecord
from bigbatch.engine.bad_steps import BadStep
from bigbatch.engine.batch import DOCUMENT_PREFIX
from bigbatch.engine.replay import DeviceSuspect
from bigbatch.errors import TrainingError
from bigbatch.files.atomic import write_text_atomically
from bigbatch.observe.metrics import MetricsFanout
from bigbatch.parallel.distributed import Say
from bigbatch.progress import plural
from bigbatch.run.build import RunParts
from bigbatch.run.checkpoints.checkpoint import latest_valid_checkpoint
from bigbatch.run.checkpoints.state import TrainState, resume_run
from bigbatch.run.loop.step_log import StepLog
from bigbatch.run.loop.stopping import SaveSchedule

EXCLUSIONS_FILE = "bad-steps.json"


def read_exclusions(run_dir: Path) -> tuple[list[str], int]:
    """The micro-batches a rewind left out, and the rewinds so far (none for a run without the file)."""
    path = run_dir / EXCLUSIONS_FILE
    if not path.is_file():
        return [], 0
    try:
        saved = json.loads(path.read_text())
        return [str(key) for key in saved.get("excluded", [])], int(saved.get("rewinds", 0))
    except (OSError, ValueError, AttributeError) as exc:
        raise TrainingError(
            f"{path} cannot be read ({exc}); restore it or delete it to replay every micro-batch"
        ) from exc


def left_out(keys: list[str]) -> str:
    """``2 micro-batches and every part of 1 document``: what exclusion ``keys`` leave out."""
    documents = sum(key.startswith(DOCUMENT_PREFIX) for key in keys)
    said = plural(len(keys) - documents, "micro-batch", "micro-batches")
    return said + (f" and every part of {plural(documents, 'document')}" if documents else "")


@dataclass
class BadStepHandling:
    """The loop's side of bad steps over a session (see the module docstring)."""

    parts: RunParts
    say: Say
    excluded: list[str] = field(default_factory=list)
    rewinds: int = 0
    actions: Counter[str] = field(default_factory=Counter)  # this session's bad steps by what was done

    def __post_init__(self) -> None:
        self.excluded, self.rewinds = read_exclusions(self.parts.run_dir)
        guard = self.parts.engine.guard
        if guard is not None:
            guard.excluded = set(self.excluded)
        if self.excluded:
            self.say(
                "bad steps: %s left out of the data, as a rewind decided (%s)",
                left_out(self.excluded),
                self.parts.run_dir / EXCLUSIONS_FILE,
            )

    def start(self, state: TrainState, saves: SaveSchedule) -> None:
        """``rewind`` needs a committed checkpoint to go back to: a fresh run saves its step 0 first."""
        if self.parts.config.guard.bad_step == "rewind" and latest_valid_checkpoint(self.parts.run_dir) is None:
            saves.save(state, state.step, self.say)

    def handle(self, record: StepRecord, step_log: StepLog, state: TrainState, saves: SaveSchedule) -> bool:
        """Say and record a bad step; end the run for ``stop``; rewind for ``rewind`` (then ``True``: the loop goes
        on from the checkpoint's step)."""
        bad = record.bad
        if bad is None:
            return False
        self.actions[bad.action] += 1
        self.say("%s", bad.line(), level=logging.WARNING)
        metrics = step_log.metrics
        if isinstance(metrics, MetricsFanout):
            metrics.write_event("bad_step", **bad.record())
        if bad.action == "stopped":
            raise TrainingError(
                f"{bad.line()} (--bad-step stop); the run's newest checkpoint is as it was: resume with --bad-step "
                "skip-micro or rewind to go past it"
            )
        if bad.action != "rewind":
            return False
        self._rewind(bad, state)
        saves.saved_step = state.step
        if isinstance(metrics, MetricsFanout):  # the resume rewrote metrics.jsonl without the steps replayed
            metrics.reopen_jsonl()
            metrics.write_event("rewind", state.step, from_step=bad.step, rewinds=self.rewinds, excluded=self.excluded)
        return True

    @contextmanager
    def device_faults(self, step_log: StepLog) -> Iterator[None]:
        """Around a step: a replay that found a faulty device leaves the step's ``kind: replay`` record and its
        ``kind: bad_step`` one (kept through a resume) before the run stops with its line."""
        try:
            yield
        except DeviceSuspect as fault:
            self.actions[fault.bad.action] += 1
            step_log.write_replays(fault.bad.step, fault.checks)
            if isinstance(step_log.metrics, MetricsFanout):
                step_log.metrics.write_event("bad_step", **fault.bad.record())
            raise

    def _rewind(self, bad: BadStep, state: TrainState) -> None:
        guard = self.parts.config.guard
        if self.rewinds >= guard.max_rewinds:
            raise TrainingError(
                f"{bad.line()}: this run has rewound {plural(self.rewinds, 'time')} already (--max-rewinds "
                f"{guard.max_rewinds}); raise --max-rewinds, or resume with --bad-step skip-micro"
            )
        # the micro-batches, and the bad documents they hold parts of: a rewind leaves out every part of those,
        # in the steps it replays and in those after
        keys = sorted({s.key for s in bad.suspects if s.key} | {d for s in bad.suspects for d in s.bad_documents})
        checkpoint = latest_valid_checkpoint(self.parts.run_dir)
        if not keys or checkpoint is None:
            why = "no micro-batch to leave out" if not keys else "no committed checkpoint to go back to"
            raise TrainingError(f"{bad.line()}: cannot rewind: {why}; resume with --bad-step skip-micro or skip-step")
        self.excluded += [key for key in keys if key not in self.excluded]
        self.rewinds += 1
        dist = self.parts.dist
        if dist.is_main:
            payload = {"excluded": self.excluded, "rewinds": self.rewinds}
            write_text_atomically(self.parts.run_dir / EXCLUSIONS_FILE, json.dumps(payload, indent=1) + "\n")
        dist.barrier()
        resume_run(state, checkpoint, self.say)
        engine_guard = self.parts.engine.guard
        assert engine_guard is not None
        engine_guard.excluded = set(self.excluded)
        self.say(
            "rewind %d of at most %d: back to step %d (%s), replaying without %s",
            self.rewinds,
            guard.max_rewinds,
            state.step,
            checkpoint,
            left_out(keys),
            level=logging.WARNING,
        )

    def summary(self) -> str | None:
        """``bad steps | 2 this session: 1 skipped micro-batch, 1 rewind | replays 40 | 3 micro-batches left out``."""
        guard = self.parts.engine.guard
        if guard is None or not (self.actions or guard.replays or self.excluded):
            return None
        found = sum(self.actions.values())
        parts = [
            f"{found} this session" + (": " + ", ".join(f"{a} {n}" for a, n in self.actions.items()) if found else "")
        ]
        if guard.replays:
            parts.append(f"{plural(guard.replays, 'micro-batch', 'micro-batches')} replayed")
        if guard.dropped:
            parts.append(f"{plural(guard.dropped, 'micro-batch', 'micro-batches')} left out")
        return "bad steps | " + " | ".join(parts)
