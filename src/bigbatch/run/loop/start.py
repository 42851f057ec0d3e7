"""Where a training session starts: the run's own newest checkpoint, a branch's parent, or step 0; the loader that
reads ahead of the steps; and the line for a run that is already complete."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from bigbatch.data.prefetch import PrefetchLoader
from bigbatch.parallel.distributed import Say
from bigbatch.run.build import RunParts
from bigbatch.run.checkpoints.branch import branch_run
from bigbatch.run.checkpoints.state import TrainState, resume_run
from bigbatch.run.loop.step_sizes import check_batch_change_rule
from bigbatch.run.loop.stopping import SaveSchedule


@dataclass
class StartPoint:
    """The restored state and its loader; ``resumed_from`` (the checkpoint resumed, or None), ``change_cause``
    (what a change of the tokens per step at the session's first step comes from: start, resume or branch),
    ``completed`` (the run has reached its last step) and the save schedule from the newest checkpoint's step."""

    state: TrainState
    loader: PrefetchLoader
    resumed_from: Path | None
    change_cause: str
    completed: bool
    saves: SaveSchedule


def prefetch_depth(parts: RunParts) -> int:
    """Micro-batches to read ahead: one step's (K, Seesaw's largest; with a token budget, as many as a step of full
    micro-batches needs, plus one); none for learning from rewards."""
    if hasattr(parts.train_loader, "micro_batches_next_step"):
        return 0  # a step's completions are sampled with the model: never in a thread beside the training
    budget = parts.policy.token_budget
    if budget:
        per_micro_batch = parts.plan.micro_batch * parts.plan.seq_len * parts.dist.world_size
        return -(-budget // per_micro_batch) + 1
    if parts.seesaw is not None:  # its largest steps
        return max(phase.k for phase in parts.seesaw.phases)
    return max(1, parts.policy.k)


def start_point(parts: RunParts, branch_from: Path | None, prefetch: bool, say: Say) -> StartPoint:
    """The state to start from. The next step's micro-batches are read (and pinned for CUDA) by a background thread
    while this one computes; checkpoints save the position after the micro-batches trained on (``prefetch``
    off: read in the loop)."""
    config = parts.config
    state = TrainState(parts)
    loader = PrefetchLoader(parts.train_loader, prefetch_depth(parts) if prefetch else 0, parts.device.type == "cuda")
    state.loader = loader
    resumed_from = parts.resume_from
    cause = "start"
    if resumed_from is not None:
        resume_run(state, resumed_from, say)
        cause = "resume"
    elif branch_from is not None:  # a fresh branch: start where the parent's checkpoint stood
        branch_run(state, branch_from, say)
        cause = "branch"
    elif config.run.allow_ramp_change:
        say(
            "--allow-ramp-change has no effect: there is no run to resume in %s (the default run directory "
            "depends on the ramp: give --out the directory of the run to change)",
            parts.run_dir,
            level=logging.WARNING,
        )
    check_batch_change_rule(parts, branch_from is not None, say)
    completed = resumed_from is not None and state.step >= parts.last_step
    saves = SaveSchedule(config.run.save_every, state.step if resumed_from is not None else 0)
    return StartPoint(state, loader, resumed_from, cause, completed, saves)


def say_complete(parts: RunParts, step: int, say: Say) -> None:
    """The line of a session that finds its run complete (it exits 0: a requeueing scheduler needs that)."""
    run = parts.config.run
    last = f"max_steps {run.max_steps}"
    if parts.seesaw is not None:
        last = f"its last: the tokens of max_steps {run.max_steps} in larger steps, --schedule seesaw"
    say(
        "the run in %s is complete: it reached step %d (%s); nothing to do (raise --max-steps, with "
        "--extend-schedule to stretch the learning-rate decay, to train on)",
        parts.run_dir,
        step,
        last,
    )
