"""Branching: a new run that starts from another run's checkpoint with settings of its own.

Resume (:func:`bigbatch.run.checkpoints.state.resume_run`) continues *the same* run and refuses a checkpoint whose
tokens per step differ. A branch is a different run: it has its own run directory and config record (e.g. another
tokens per step, hence another K, and its own learning rate), and starts where the parent stood: the parent's
model and optimizer state, engine counters (the step number continues), data position, tokens seen and
generators. Its learning-rate schedule is the branch's own (from its config), not the parent's.

What must match the parent is what the state means: the model's shape, the tokenizer, the sequence length and
the data (by fingerprint). Once the branch has saved a checkpoint of its own, running it again resumes that
(the parent is no longer read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bigbatch.errors import CheckpointError
from bigbatch.models.registry import family_of
from bigbatch.parallel.distributed import Say
from bigbatch.run.checkpoints.checkpoint import load_checkpoint
from bigbatch.run.checkpoints.resume import check_family, check_tokenizer, data_changed
from bigbatch.run.checkpoints.state import TrainState


def check_branchable(document: dict[str, Any], state: TrainState, parent: Path) -> None:
    """Refuse a parent checkpoint whose model, tokenizer, sequence length or data differ from the branch's."""
    p = state.parts
    check_family(document, family_of(p.model).name, f"cannot branch from {parent}: it")
    saved_model = document.get("model_config", {})
    diffs = [f"{k} {saved_model.get(k)} -> {v}" for k, v in p.model.config.to_dict().items() if saved_model.get(k) != v]
    if diffs:
        raise CheckpointError(f"cannot branch from {parent}: its model differs from the branch's ({', '.join(diffs)})")
    if document.get("tokenizer") != p.dataset.meta.tokenizer:
        raise CheckpointError(
            f"cannot branch from {parent}: it was trained with the {document.get('tokenizer')} tokenizer, the "
            f"branch's data uses {p.dataset.meta.tokenizer}"
        )
    saved_seq_len = document.get("config", {}).get("batch", {}).get("seq_len")
    if saved_seq_len is not None and saved_seq_len != p.config.batch.seq_len:
        raise CheckpointError(
            f"cannot branch from {parent}: its seq_len is {saved_seq_len}, the branch's {p.config.batch.seq_len}"
        )
    check_tokenizer(
        document.get("fingerprints") or {},
        p.fingerprints,
        p.dataset.meta.tokenizer,
        f"the branch's data {p.dataset.directory}",
    )
    changed = data_changed(document, p.fingerprints, p.config.data.data)
    if changed:
        raise CheckpointError(f"cannot branch from {parent}: the branch's data differs from the parent's ({changed})")


def parent_tokens_per_step(document: dict[str, Any]) -> int:
    """The tokens per step of the parent's last step: its batch-change record's, else its config's."""
    saved = document.get("batch_change") or {}
    last = saved.get("last_tokens") if isinstance(saved, dict) else None
    batch = document.get("config", {}).get("batch", {})
    return int(last or batch.get("token_budget") or batch["total_batch_tokens"])


def branch_run(state: TrainState, parent: Path, say: Say) -> dict[str, Any]:
    """Start ``state``'s (fresh) run from the parent checkpoint ``parent`` (a file or a run directory): every
    stateful part as the parent left it, the learning-rate schedule the branch's own. Returns the checkpoint's
    run record (step, config, ...) without its tensors."""
    document = load_checkpoint(parent, consolidate=False)  # each rank reads its own shards
    check_branchable(document, state, parent)
    # The branch keeps its own schedule; its settings hold at the parent's size, and the batch-change rule takes them
    # to the branch's from its first step.
    state.load_state_dict(document, state.schedule, new_data=False, say=say, skip=("batch_change",))
    follower = state.parts.engine.follower
    parent_tokens = parent_tokens_per_step(document)
    if follower is not None:
        follower.reference_tokens = follower.last_tokens = parent_tokens
    say(
        "branched from %s at step %d (%s tokens): %s tokens per step (the parent's %s)",
        parent,
        state.step,
        f"{state.tokens_seen:,}",
        f"{state.parts.plan.tokens_per_step:,}",
        f"{parent_tokens:,}",
    )
    return {k: v for k, v in document.items() if k not in ("model", "optimizer", "rng", "optimizer_param_groups")}
