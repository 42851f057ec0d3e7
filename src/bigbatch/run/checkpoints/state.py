"""The state of a training run: its named stateful parts, saved and restored through one pair of methods.

A checkpoint is the run's record (what the run is: model shape, config, tokenizer, data fingerprints, world
size) plus :meth:`TrainState.state_dict` (where it stands: model and optimizer as whole tensors, engine
counters and GradScaler, learning-rate schedule, loader position, tokens seen, every rank's generators).
:meth:`TrainState.load_state_dict` restores exactly those parts, so save and resume cannot drift apart;
:func:`resume_run` adds the checks that decide whether a checkpoint may continue this run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.optim import CosineSchedule
from bigbatch.engine.rng import capture_rng_state, restore_rng_state, seed_rank_generators
from bigbatch.errors import CheckpointError, DataError
from bigbatch.models.registry import family_of
from bigbatch.observe.metrics import truncate_metrics
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.run.build import RunParts
from bigbatch.run.checkpoints.checkpoint import (
    FORMAT_NAME,
    SHARDED_VERSION,
    checkpoint_path,
    commit_path,
    load_checkpoint,
    prune_checkpoints,
)
from bigbatch.run.checkpoints.resume import (
    check_compatible,
    check_settings,
    check_tokenizer,
    data_changed,
    resumed_schedule,
)
from bigbatch.run.checkpoints.sharded import ShardedWriter, load_sharded
from bigbatch.sizing.ramp import check_ramp_change

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """A named part of the run's state: what it saves, and how it is restored from that."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class _ModelWeights:
    """The model's parameters and buffers keyed by name (no wrapper prefixes): saved as this rank's shards
    (FSDP2) or whole tensors, without copies; restored from a sharded checkpoint at any world size and parallel
    mode, or from whole tensors (a single-file checkpoint)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))

    def load_shards(self, folder: Path, document: dict[str, Any], dist: DistContext) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = get_model_state_dict(self.model)
        load_sharded(folder, {"model": state}, dist)
        set_model_state_dict(self.model, state)


class _OptimizerState:
    """AdamW's moments and step counts keyed by parameter name like the model's (see :class:`_ModelWeights`);
    its param groups (plain numbers) travel in the checkpoint's record."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        state: Any = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:
            # The moments of an optimizer that has not stepped come from a step with zero gradients and lr 0, which
            # counts as a step: the live optimizer forgets it (its first step stays the first) and the saved state
            # holds zero moments at step 0, which AdamW's first step treats as a fresh state.
            self.optimizer.state.clear()
            for entry in state["state"].values():
                if "step" in entry:
                    entry["step"] = torch.zeros_like(entry["step"])
        return state

    def load_state_dict(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))

    def load_shards(self, folder: Path, document: dict[str, Any], dist: DistContext) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = get_optimizer_state_dict(self.model, self.optimizer)  # creates the moments of a fresh optimizer
        load_sharded(folder, {"optimizer": state["state"]}, dist)
        state["param_groups"] = document["optimizer_param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, state)


class _Schedule:
    """The learning-rate schedule the engine follows, saved for the checkpoint's readers; a resumed run settles
    its own (see :func:`resume_run`), so nothing is restored from it here."""

    def __init__(self, schedule: CosineSchedule) -> None:
        self.schedule = schedule

    def state_dict(self) -> Any:
        return self.schedule.state_dict()

    def load_state_dict(self, state: Any) -> None:
        pass


class _Count:
    """A number saved as it is (the valid target tokens trained on, all ranks)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> int:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = int(state or 0)


class _LoaderPosition:
    """The training loader's position; with new data (``--allow-data-change``) a position the data lacks
    restarts at its beginning instead of failing, and ``restarted`` says so."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.new_data = False
        self.restarted = False

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        try:
            self.loader.load_state_dict(state)
        except DataError:
            if not self.new_data:
                raise
            self.restarted = True


class _Generators:
    """Every rank's random generators (gathered: a collective). Resumed on another world size, each rank's
    stream is derived as in a fresh run at the resumed step (dropout masks then differ)."""

    def __init__(self, dist: DistContext, seed: int, engine: AccumulationEngine) -> None:
        self.dist, self.seed, self.engine = dist, seed, engine

    def state_dict(self) -> Any:
        return self.dist.all_gather_object(capture_rng_state())

    def load_state_dict(self, state: Any) -> None:
        rng_states = state or []
        if len(rng_states) == self.dist.world_size:
            restore_rng_state(rng_states[self.dist.rank])
        else:
            seed_rank_generators(self.seed, self.dist.rank, step=self.engine.step_count)


class TrainState:
    """The stateful parts of a built run, registered by name: model, optimizer, engine (its counters, GradScaler
    and step hooks), schedule, loader, tokens seen, batch ramp, generators. A checkpoint holds each under its
    name; they are restored in this order."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self._tokens_seen = _Count()  # valid target tokens trained on, all ranks
        self._loader = _LoaderPosition(parts.train_loader)
        self._parts: dict[str, Stateful] = {}
        self._model = _ModelWeights(parts.model)
        self._optimizer = _OptimizerState(parts.model, parts.optimizer)
        self.register("model", self._model)
        self.register("optimizer", self._optimizer)
        if parts.engine.follower is not None:  # before the engine, which sets the next step's settings from it
            self.register("batch_change", parts.engine.follower)
        self.register("engine", parts.engine)
        self._schedule = _Schedule(parts.engine.schedule)  # type: ignore[arg-type]  # the engine follows it
        self.register("schedule", self._schedule)
        self.register("loader", self._loader)
        self.register("tokens_seen", self._tokens_seen)
        if parts.ramp is not None:
            self.register("ramp", parts.ramp)
        self.register("rng", _Generators(parts.dist, parts.config.run.seed, parts.engine))
        self.writer = ShardedWriter(
            parts.dist,
            asynchronous=parts.config.run.async_checkpoint,
            committed=lambda folder, step: prune_checkpoints(parts.run_dir, parts.config.run.keep_checkpoints),
        )

    @property
    def tokens_seen(self) -> int:
        return self._tokens_seen.value

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self._tokens_seen.value = value

    @property
    def loader(self) -> Any:
        """Whose position is saved and restored: the training loader, or the trainer's read-ahead view of it
        (which reports the position after the micro-batches trained on, not after those read ahead)."""
        return self._loader.loader

    @loader.setter
    def loader(self, loader: Any) -> None:
        self._loader.loader = loader

    @property
    def schedule(self) -> CosineSchedule:
        return self._schedule.schedule

    def register(self, name: str, part: Stateful) -> None:
        """Save and restore ``part`` under ``name`` (after the parts registered before it)."""
        if name in self._parts:
            raise ValueError(f"a state part named {name!r} is already registered")
        self._parts[name] = part

    @property
    def step(self) -> int:
        return self.parts.engine.step_count

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands: each registered part's state under its name (the model's and optimizer's as
        this rank holds them: FSDP2 shards). A collective: every rank calls it (every rank's generators are
        gathered)."""
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(
        self, state: dict[str, Any], schedule: CosineSchedule, new_data: bool, say: Say, skip: tuple[str, ...] = ()
    ) -> None:
        """Restore every part from ``state``; the next step is the one after it. ``schedule`` is the one the
        resumed run follows (see :func:`bigbatch.run.checkpoints.resume.resumed_schedule`), set before the engine
        restores its counters (which set the next step's learning rate); with ``new_data`` a loader position that
        the new data lacks restarts at its beginning instead of failing. A part the checkpoint lacks (an older
        one) is given ``None``; the parts named in ``skip`` keep their own state (a branch's batch-change
        reference)."""
        seesaw = self.parts.seesaw
        if seesaw is not None and schedule is not seesaw:  # Seesaw follows the resumed schedule in tokens
            seesaw.set_schedule(schedule)
            schedule = seesaw  # type: ignore[assignment]
        self._schedule.schedule = self.parts.engine.schedule = schedule
        self._loader.new_data, self._loader.restarted = new_data, False
        shards = Path(state["shards"]) if "shards" in state and "model" not in state else None
        for name, part in self._parts.items():
            if name in skip or (name == "ramp" and not state.get("ramp")):
                continue  # a checkpoint from before the ramp: it starts where the tokens seen put it
            if shards is not None and isinstance(part, _ModelWeights | _OptimizerState):
                part.load_shards(shards, state, self.parts.dist)  # resharded to this world size
            else:
                part.load_state_dict(state.get(name))
        if self._loader.restarted:
            say(
                "the new data has no position matching the checkpoint's: reading it from its start",
                level=logging.WARNING,
            )

    def run_record(self) -> dict[str, Any]:
        """What the run is, for readers of the checkpoint (sample, export, eval, resume)."""
        p = self.parts
        return {
            "model_family": family_of(p.model).name,  # which family model_config builds
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
        """Every rank writes its own shards of the model and optimizer, rank 0 the record and small state (see
        :mod:`bigbatch.run.checkpoints.sharded`); with ``--async-checkpoint`` the writing goes on in the
        background. A failed write (disk full, permissions) leaves the existing checkpoints as they were and
        raises :class:`CheckpointError` on every rank."""
        p = self.parts
        small = {name: part.state_dict() for name, part in self._parts.items() if name not in ("model", "optimizer")}
        optimizer = self._optimizer.state_dict()
        tensors = {"model": self._model.state_dict(), "optimizer": optimizer["state"]}
        record = {
            "format": FORMAT_NAME,
            "version": SHARDED_VERSION,
            **self.run_record(),
            **small,
            "optimizer_param_groups": optimizer["param_groups"],
        }
        path = checkpoint_path(p.run_dir, self.step)
        line = self.writer.save(self.step, path, commit_path(path), tensors, record if p.dist.is_main else None, say)
        if line:
            say("%s", line)
        return path

    def finish_saves(self) -> None:
        """Wait for an asynchronous save in flight (its failure: a :class:`CheckpointError`)."""
        self.writer.wait()

    def close(self) -> None:
        """Wait for a save in flight and stop the writer's thread; a failure is logged, not raised (the run is
        ending anyway, and its earlier checkpoints are intact)."""
        try:
            self.writer.close()
        except CheckpointError as exc:
            log.warning("%s", exc)


def resume_run(state: TrainState, path: Path, say: Say) -> None:
    """Continue the run from the checkpoint at ``path``: refuse one that belongs to another run (settings,
    model, tokenizer, data), settle the learning-rate schedule, then restore every part."""
    p = state.parts
    config = p.config
    document = load_checkpoint(path, consolidate=False)  # each rank reads its own shards below
    check_settings(document, config, p.run_dir)
    ramp_note = check_ramp_change(
        document.get("config", {}), config.batch.batch_ramp, config.run.allow_ramp_change, p.run_dir
    )
    check_compatible(
        document,
        family_of(p.model).name,
        p.model.config.to_dict(),
        p.dataset.meta.tokenizer,
        config.batch,
        config.run.allow_batch_change,
    )
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
    if state.step >= p.last_step:
        return  # complete: the trainer says so, and nothing resumes (nor changes in the run directory)
    if p.dist.is_main:
        truncate_metrics(p.run_dir, state.step)
    saved_world = int(document.get("world_size", 1))
    saved_tokens = int(document.get("config", {}).get("batch", {}).get("total_batch_tokens", 0))
    say(
        "resumed from %s at step %d (%s tokens)%s%s",
        path,
        state.step,
        f"{state.tokens_seen:,}",
        "" if saved_world == p.dist.world_size else f" | world size {saved_world} -> {p.dist.world_size}",
        ""
        if not saved_tokens or saved_tokens == config.batch.total_batch_tokens
        else f" | --allow-batch-change: total_batch_tokens {saved_tokens:,} -> {config.batch.total_batch_tokens:,}",
    )
    if changed:
        say("--allow-data-change: the run continues on changed data (%s)", changed, level=logging.WARNING)
    if schedule_note:
        say("%s", schedule_note, level=logging.WARNING)
    if ramp_note:
        k = p.ramp.k(state.tokens_seen) if p.ramp else p.plan.accumulation_steps
        say("%s (K %d at %s tokens seen)", ramp_note, k, f"{state.tokens_seen:,}", level=logging.WARNING)
