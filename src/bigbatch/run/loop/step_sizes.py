"""The size of each step and what the optimizer does when it changes: K from the batch ramp, Seesaw or the plan,
the step's planned tokens (which the batch-change rule scales the optimizer's settings to), the line and record of
each change, and a rule asked for on a run whose size never changes."""

from __future__ import annotations

import logging

from bigbatch.parallel.distributed import Say
from bigbatch.run.build import RunParts
from bigbatch.run.loop.step_log import StepLog


def next_k(parts: RunParts, step: int, tokens_seen: int) -> int:
    """K of the step after ``step`` steps and ``tokens_seen`` tokens: the ramp's, Seesaw's, the micro-batches the
    next step's completions fill (learning from rewards), else the plan's."""
    own_k = getattr(parts.train_loader, "micro_batches_next_step", None)
    if own_k is not None:
        return int(own_k())
    if parts.ramp is not None:
        return parts.ramp.k(tokens_seen)
    if parts.seesaw is not None:
        return parts.seesaw.k(step)
    return parts.policy.k


def planned_tokens(parts: RunParts, step: int, tokens_seen: int) -> int:
    """That step's planned size in tokens: a token budget's, or K micro-batches on every rank (Seesaw's shortened
    last step counts at its size's: it is a partial step of that size, not another size)."""
    if parts.policy.token_budget:
        return parts.policy.token_budget
    if hasattr(parts.train_loader, "micro_batches_next_step"):  # sized by its completions: the plan's, unchanging
        return parts.plan.tokens_per_step
    k = parts.seesaw.size_k(step) if parts.seesaw is not None else next_k(parts, step, tokens_seen)
    return k * parts.plan.tokens_per_k


def follow_batch_change(
    parts: RunParts, step: int, tokens_seen: int, tokens_per_step: int, cause: str, step_log: StepLog
) -> None:
    """Say and record a change of the tokens per step before the step that makes it (the engine applies the
    batch-change rule's settings to that step)."""
    engine = parts.engine
    if engine.follower is None:
        return
    lr = engine.schedule(engine.step_count)
    change = engine.follower.change(step + 1, tokens_seen, lr, tokens_per_step, cause)
    if change is not None:
        step_log.batch_change(change)


def check_batch_change_rule(parts: RunParts, branched: bool, say: Say) -> None:
    """A batch-change setting asked for by name on a run whose tokens per step never change: say that it changes
    nothing (rather than let the user believe it did)."""
    opt, follower = parts.config.optim, parts.engine.follower
    given = [
        f"--{flag} {value}"
        for flag, value, default in (
            ("batch-change-rule", opt.batch_change_rule, "auto"),
            ("batch-change-betas", opt.batch_change_betas, "auto"),
            ("batch-change-weight-decay", opt.batch_change_weight_decay, "keep"),
            ("batch-change-momentum", opt.batch_change_momentum, "auto"),
        )
        if value != default
    ]
    if not given or follower is None or parts.ramp is not None or parts.seesaw is not None:
        return
    planned = parts.planned_tokens_per_step
    if branched or follower.reference_tokens != planned or (follower.last_tokens or planned) != planned:
        return
    say(
        "%s changes nothing in this run: its tokens per step (%s) never change; a batch change comes from "
        "--batch-ramp, --schedule seesaw, a critical-batch branch or a resume with --allow-batch-change",
        " and ".join(given),
        f"{planned:,}",
        level=logging.WARNING,
    )


def seesaw_stop_note(parts: RunParts) -> str | None:
    """Where Seesaw's doublings stop short of the schedule's halvings (its cap), or ``None``."""
    return parts.seesaw.stop_note(parts.plan.tokens_per_k) if parts.seesaw is not None else None
