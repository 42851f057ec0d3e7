"""The state of a training run: its named stateful parts, saved and restored through one pair of methods.

A checkpoint is the run's record (what the run is: model shape, config, tokenizer, data fingerprints, world
size) plus :meth:`TrainState.state_dict` (where it stands: model and optimizer as whole tensors, engine
counters and GradScaler, learning-rate schedule, loader position, tokens seen, every rank's generators).
:meth:`TrainState.load_state_dict` restores exactly those parts, so save and resume cannot drift apart;
:func:`resume_run` adds the checks that decide whether a checkpoint may continue this run.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from bigbatch.engine.optim import CosineSchedule
from bigbatch.engine.rng import capture_rng_state, restore_rng_state, seed_rank_generators
from bigbatch.errors import CheckpointError, DataError
from bigbatch.models import family_of
from bigbatch.observe.metrics import truncate_metrics
from bigbatch.run.build import RunParts, Say
from bigbatch.run.checkpoint import checkpoint_path, load_checkpoint, prune_checkpoints, save_checkpoint
from bigbatch.run.resume import check_compatible, check_settings, check_tokenizer, data_changed, resumed_schedule
from bigbatch.sizing.ramp import check_ramp_change


class TrainState:
    """The stateful parts of a built run (model, optimizer, engine, schedule, loader, counters, generators)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.tokens_seen = 0  # valid target tokens trained on, all ranks
        # Whose position is saved and restored: the training loader, or the trainer's read-ahead view of it
        # (which reports the position after the micro-batches trained on, not after those read ahead).
        self.loader: Any = parts.train_loader
        self.schedule: CosineSchedule = parts.engine.schedule  # type: ignore[assignment]  # the engine follows it

    @property
    def step(self) -> int:
        return self.parts.engine.step_count

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands. A collective: every rank calls it (FSDP shards and every rank's generators
        are gathered); model and optimizer state are whole tensors keyed by parameter name, on the CPU, so
        that any world size and parallel mode can resume from them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        p = self.parts
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(p.model, p.optimizer, options=options)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "engine": p.engine.state_dict(),
            "schedule": self.schedule.state_dict(),
            "loader": self.loader.state_dict(),
            "tokens_seen": self.tokens_seen,
            **({"ramp": p.ramp.state_dict()} if p.ramp is not None else {}),
            "rng": p.dist.all_gather_object(capture_rng_state()),  # every rank's generators
        }

    def load_state_dict(self, state: dict[str, Any], schedule: CosineSchedule, new_data: bool, say: Say) -> None:
        """Restore every part from ``state``; the next step is the one after it. ``schedule`` is the one the
        resumed run follows (see :func:`bigbatch.run.resume.resumed_schedule`); with ``new_data`` a loader position
        that the new data lacks restarts at its beginning instead of failing."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        p = self.parts
        set_state_dict(
            p.model,
            p.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        self.schedule = p.engine.schedule = schedule
        p.engine.load_state_dict(state["engine"])  # also sets the learning rate of the next step
        try:
            self.loader.load_state_dict(state["loader"])
        except DataError:
            if not new_data:
                raise
            say(
                "the new data has no position matching the checkpoint's: reading it from its start",
                level=logging.WARNING,
            )
        self.tokens_seen = int(state.get("tokens_seen", 0))
        if p.ramp is not None and state.get("ramp"):
            p.ramp.load_state_dict(state["ramp"])
        rng_states = state.get("rng", [])
        if len(rng_states) == p.dist.world_size:
            restore_rng_state(rng_states[p.dist.rank])
        else:  # another world size: each rank's stream derived as in a fresh run, at this step (masks then differ)
            seed_rank_generators(p.config.run.seed, p.dist.rank, step=self.step)

    def run_record(self) -> dict[str, Any]:
        """What the run is, for readers of the checkpoint (sample, export, eval, resume)."""
        p = self.parts
        return {
            "model_family": family_of(p.model),  # gpt or llama: which class model_config builds
            "model_config": p.model.config.to_dict(),
            "config": p.config.to_dict(),
            "tokenizer": p.dataset.meta.tokenizer,
            "fingerprints": dict(p.fingerprints),
            **({"tokenizer_json": p.bpe_json} if p.bpe_json else {}),
            "dataset": str(Path(p.dataset.directory).resolve()),  # absolute: eval and sample find it from anywhere
            "step": self.step,
            "world_size": p.dist.world_size,
            "parallel": p.parallel,
        }

    def save(self, say: Say) -> Path:
        """Rank 0 writes one checkpoint that any world size can read (every rank takes part in gathering).

        A failed write (disk full, permissions) leaves the existing checkpoints as they were and raises
        :class:`CheckpointError` on every rank."""
        p = self.parts
        payload = {**self.run_record(), **self.state_dict()}
        path = checkpoint_path(p.run_dir, self.step)
        error = ""
        if p.dist.is_main:
            started = time.perf_counter()
            try:
                save_checkpoint(payload, path)
            except OSError as exc:
                error = f"could not save checkpoint {path}: {exc.strerror or exc}; earlier checkpoints are intact"
            else:
                seconds = time.perf_counter() - started
                say("saved checkpoint %s (%.1f MB, %.2fs)", path, path.stat().st_size / 1e6, seconds)
                prune_checkpoints(p.run_dir, p.config.run.keep_checkpoints)
        error = p.dist.broadcast_object(error)
        if error:
            raise CheckpointError(error)
        return path


def resume_run(state: TrainState, path: Path, say: Say) -> None:
    """Continue the run from the checkpoint at ``path``: refuse one that belongs to another run (settings,
    model, tokenizer, data), settle the learning-rate schedule, then restore every part."""
    p = state.parts
    config = p.config
    document = load_checkpoint(path)
    check_settings(document, config, p.run_dir)
    ramp_note = check_ramp_change(
        document.get("config", {}), config.batch.batch_ramp, config.run.allow_ramp_change, p.run_dir
    )
    check_compatible(document, family_of(p.model), p.model.config.to_dict(), p.dataset.meta.tokenizer, config.batch)
    check_tokenizer(
        document.get("fingerprints") or {},
        p.fingerprints,
        p.dataset.meta.tokenizer,
        f"this run's data {p.dataset.directory}",
    )
    changed = data_changed(document, p.fingerprints, config.data.data)
    if changed and not config.run.allow_data_change:
        raise CheckpointError(
            f"the data of the run in {p.run_dir} changed: {changed}; add --allow-data-change to continue "
            "on the new data, or restore the run's data"
        )
    schedule, schedule_note = resumed_schedule(document, config, int(document["engine"]["step_count"]))
    state.load_state_dict(document, schedule, new_data=bool(changed), say=say)
    if p.dist.is_main:
        truncate_metrics(p.run_dir, state.step)
    saved_world = int(document.get("world_size", 1))
    say(
        "resumed from %s at step %d (%s tokens)%s",
        path,
        state.step,
        f"{state.tokens_seen:,}",
        "" if saved_world == p.dist.world_size else f" | world size {saved_world} -> {p.dist.world_size}",
    )
    if changed:
        say("--allow-data-change: the run continues on changed data (%s)", changed, level=logging.WARNING)
    if schedule_note:
        say("%s", schedule_note, level=logging.WARNING)
    if ramp_note:
        k = p.ramp.k(state.tokens_seen) if p.ramp else p.plan.accumulation_steps
        say("%s (K %d at %s tokens seen)", ramp_note, k, f"{state.tokens_seen:,}", level=logging.WARNING)
