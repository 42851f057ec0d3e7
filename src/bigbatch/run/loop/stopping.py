"""When the training loop saves a checkpoint (every ``--save-every`` steps and at the last) and how it stops early:
a stop request (SIGTERM, Ctrl-C) at a step boundary, agreed by every rank and saved first; a second Ctrl-C, which
aborts without saving; a run whose gradients stay non-finite."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bigbatch.engine.accumulate import StepRecord
from bigbatch.errors import TrainingError
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.parallel.signals import StopRequest
from bigbatch.progress import plural
from bigbatch.run.checkpoints.state import TrainState
from bigbatch.run.loop.tally import LoopTally


@dataclass
class SaveSchedule:
    every: int  # --save-every: 0 saves only at the last step (and on a stop)
    saved_step: int = 0  # the newest checkpoint's step; 0: none yet

    def due(self, step: int, last: bool) -> bool:
        return last or bool(self.every and step % self.every == 0)

    def save(self, state: TrainState, step: int, say: Say) -> None:
        """Save the run's state (a collective: every rank calls it) as the checkpoint of ``step``."""
        state.save(say)
        self.saved_step = step


def check_diverging(seen: LoopTally, record: StepRecord, max_consecutive_skips: int) -> None:
    """Count a skipped step (a non-finite gradient, or a bad step); too many in a row stop the run with an error."""
    seen.consecutive_skips += 1
    if seen.consecutive_skips < max_consecutive_skips:
        return
    skips = plural(seen.consecutive_skips, "consecutive step")
    if record.bad is not None:
        raise TrainingError(
            f"{skips} were skipped as bad steps (the last: {record.bad.cause}); the run is diverging or its data is "
            "bad throughout: see the bad_step records in metrics.jsonl, lower --lr, or check the data"
        )
    raise TrainingError(
        f"{skips} had a non-finite gradient (loss {record.loss}); the run is diverging: lower --lr, check the "
        "data, or use bf16 rather than fp16"
    )


@dataclass
class StopHandling:
    """A stop request's course: announced at once (:meth:`announce`, the signal handler), carried out at the next
    step boundary (:meth:`check`), or cut short by a second Ctrl-C (:meth:`say_aborted`)."""

    dist: DistContext
    device: torch.device
    state: TrainState
    saves: SaveSchedule
    run_dir: Path
    say: Say
    clear_progress: Callable[[], None]  # the progress bar's line, before writing to the console
    step_pending: bool = True  # the step the loop is on is not applied yet: a stop request waits for it

    def check(self, seen: LoopTally, stop: StopRequest, saved: bool) -> None:
        """Stop at this step boundary if any rank received SIGTERM/SIGINT (all ranks agree), after a save."""
        seen.stopped_by = self.dist.max_int(stop.signum, self.device)
        if not seen.stopped_by:
            self.step_pending = True  # the next step is under way from here
            return
        if not saved:
            self.saves.save(self.state, self.state.step, self.say)
        self.say(
            "stopped by %s after step %d; checkpoint saved in %s; run the same command to resume",
            signal.Signals(seen.stopped_by).name,
            self.state.step,
            self.run_dir,
            level=logging.WARNING,
        )

    def announce(self, signum: int) -> None:
        """At once, from the signal handler (rank 0, on the console): what the first Ctrl-C/SIGTERM will do."""
        if not self.dist.is_main:
            return
        step = self.state.step + (1 if self.step_pending else 0)
        saved_step = self.saves.saved_step
        if saved_step:
            kept = f"the newest checkpoint is step {saved_step}"
        else:
            kept = (
                f"no checkpoint yet: the {plural(step, 'step')} so far would be lost" if step else "nothing trained yet"
            )
        self.clear_progress()
        sys.stderr.write(
            f"bigbatch: {signal.Signals(signum).name}: stopping after step {step} and saving a checkpoint; press "
            f"Ctrl-C again to abort without saving ({kept})\n"
        )
        sys.stderr.flush()

    def say_aborted(self) -> None:
        """After a second Ctrl-C: what was kept."""
        if self.saves.saved_step:
            self.say(
                "aborted without saving during step %d: the run continues from its newest checkpoint, step %d in %s; "
                "run the same command to resume",
                self.state.step + 1,
                self.saves.saved_step,
                self.run_dir,
                level=logging.WARNING,
            )
        else:
            self.say(
                "aborted without saving during step %d: no checkpoint was saved, the run starts over next time "
                "(--save-every N keeps one every N steps)",
                self.state.step + 1,
                level=logging.WARNING,
            )
