"""The bigbatch side of the differential fuzzer: train a :class:`~fuzz_settings.Setting` through the real
``bigbatch train`` path (flags -> config -> :class:`~bigbatch.run.loop.trainer.Trainer`) and record what happened.

In-process for one rank (:func:`run_bigbatch`), or under torchrun for two, many settings in one job
(amortising torchrun's start-up)::

    torchrun --nproc-per-node 2 tests/support/fuzz_worker.py SETTINGS.json OUT_DIR

Rank 0 writes ``OUT_DIR/seed_<seed>.pt`` per setting (or ``seed_<seed>.error`` with the traceback) as
soon as it is done. Recorded per setting: the model's family and shape, the initial and final full model
state, and per call of the trainer's ``next_step`` every rank's micro-batches, the valid-target count the
trainer derived, the loader's epoch before and after, and the engine's :class:`StepRecord` when a step was taken.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from fuzz_settings import Setting

SABOTAGES = (
    "",
    "mean_over_k",
    "schedule_off_by_one",
    "no_clip",
    "drop_last_micro_batch",
    "other_long_documents",
    "shuffle_off",
    "shuffle_no_shift",
    "shuffle_first_order",
    "pack_without_positions",
)
"""Planted bugs, to prove that the fuzzer catches them (tests only)."""


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors on every rank's behalf (gathered under FSDP2; a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value.detach().clone() for name, value in state.items()}


def run_bigbatch(
    setting: Setting, workdir: Path, dist: Any = None, device: Any = None, sabotage: str = ""
) -> dict | None:
    """Train ``setting`` with bigbatch; the record on rank 0 (``None`` on other ranks)."""
    from bigbatch.cli import build_parser
    from bigbatch.engine.accumulate import token_loss_sum
    from bigbatch.engine.batch import MicroBatch, StepBatch, count_valid_targets
    from bigbatch.models import family_of
    from bigbatch.parallel.distributed import DistContext
    from bigbatch.run.checkpoints.checkpoint import load_checkpoint, resolve_checkpoint
    from bigbatch.run.configuration.config_sources import config_from_args
    from bigbatch.run.loop.trainer import Trainer

    assert sabotage in SABOTAGES, sabotage
    dist = dist or DistContext()
    device = device or torch.device("cpu")
    workdir.mkdir(parents=True, exist_ok=True)
    data = setting.write_data(workdir) if dist.is_main else setting.data_path(workdir)
    dist.barrier()
    flags = setting.train_flags(data, workdir / "cache", workdir / "run")
    if sabotage == "other_long_documents":  # bigbatch reads long documents by the policy the setting did not draw
        at = flags.index("--long-documents") + 1
        flags[at] = {"split": "truncate", "truncate": "split"}[flags[at]]
    if sabotage == "shuffle_off":  # bigbatch reads the data in its order where the setting shuffles
        flags[flags.index("--shuffle") + 1] = "off"
    args = build_parser().parse_args(["train", *flags])
    trainer = Trainer(config_from_args(args), dist, device)
    initial = full_state(trainer.model)

    calls: list[dict[str, Any]] = []
    loader = trainer.train_loader  # the closures below outlive ``del trainer``
    next_step = trainer.next_step
    engine_step = trainer.engine.step

    def recording_next_step() -> StepBatch:
        epoch = loader.epoch
        step = next_step()
        batches, n_valid = step.micro_batches, step.n_valid
        if sabotage == "drop_last_micro_batch" and len(batches) > 1:  # a step assembled wrongly, counted right
            batches = batches[:-1]
            n_valid = dist.sum_int(sum(count_valid_targets(mb) for mb in batches), device)
        calls.append(
            {
                "batches": [(mb.inputs.clone(), mb.targets.clone()) for mb in batches],
                "n_valid": n_valid,
                "epoch_before": epoch,
                "epoch_after": loader.epoch,
                "record": None,
            }
        )
        return StepBatch(batches, n_valid, step.positions, step.padding)

    def recording_step(micro_batches: list, *args: Any) -> Any:
        record = engine_step(micro_batches, *args)
        calls[-1]["record"] = {
            "step": record.step,
            "loss": record.loss,
            "grad_norm": record.grad_norm,
            "lr": record.lr,
            "tokens": record.tokens,
            "micro_batches": record.micro_batches,
            "skipped": record.skipped,
        }
        return record

    if sabotage == "shuffle_no_shift":  # later epochs read the first epoch's windows (in their own order)
        read = loader.windows.read  # type: ignore[union-attr]
        loader.windows.read = lambda index, pad_token=0, shifts=None: read(index, pad_token)  # type: ignore[union-attr]
    elif sabotage == "shuffle_first_order":  # every epoch in the first epoch's order
        orders = getattr(loader, "orders", None) or loader._orders  # type: ignore[union-attr]
        at = orders.at
        orders.at = lambda epoch, positions: at(0, positions)
    trainer.next_step = recording_next_step  # type: ignore[method-assign]
    trainer.engine.step = recording_step  # type: ignore[method-assign]
    if sabotage == "mean_over_k":  # the classic mistake: every micro-batch's mean weighs 1/K

        def mean_over_k(model: torch.nn.Module, mb: Any) -> torch.Tensor:  # the engine then scales by 1/N
            mean = token_loss_sum(model, mb) / max(1, count_valid_targets(mb))
            return mean * calls[-1]["n_valid"] / len(calls[-1]["batches"])

        trainer.engine.loss_fn = mean_over_k
    elif sabotage == "schedule_off_by_one":
        schedule = trainer.engine.schedule
        trainer.engine.schedule = lambda step: schedule(step + 1)
    elif sabotage == "no_clip":
        trainer.engine.grad_clip = 0.0
    elif sabotage == "pack_without_positions":  # packed rows trained as one sequence each: documents see each other
        trainer.engine.loss_fn = lambda model, mb: token_loss_sum(model, MicroBatch(mb.inputs, mb.targets))

    result = trainer.train()
    final = full_state(trainer.model)
    checkpoint = load_checkpoint(resolve_checkpoint(result.run_dir))["model"] if dist.is_main else None
    gathered = dist.all_gather_object(calls)
    model_config = trainer.model_config.to_dict()
    model_family = family_of(trainer.model).name
    del trainer
    gc.collect()  # DDP/FSDP objects sit in reference cycles: free them while the process group lives
    if not dist.is_main:
        return None
    steps = []
    for per_rank in zip(*gathered, strict=True):  # the same calls on every rank, in order
        first = per_rank[0]
        steps.append(
            {
                "ranks": [call["batches"] for call in per_rank],
                "n_valid": [call["n_valid"] for call in per_rank],
                "epoch_before": first["epoch_before"],
                "epoch_after": first["epoch_after"],
                "records": [call["record"] for call in per_rank],
            }
        )
    assert all(len(g) == len(gathered[0]) for g in gathered), "ranks assembled different numbers of steps"
    return {
        "setting": setting.to_json(),
        "model_family": model_family,
        "model_config": model_config,
        "initial": initial,
        "final": final,
        "checkpoint": checkpoint,
        "steps": steps,
        "steps_done": result.steps,
        "world": dist.world_size,
    }


def main() -> None:
    from bigbatch.parallel.distributed import distributed_session

    settings_file, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    settings = [Setting.from_json(s) for s in json.loads(settings_file.read_text())]
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    with distributed_session("cpu", timeout_s=120) as (dist, device):
        for setting in settings:
            try:
                record = run_bigbatch(setting, out_dir / f"work_{setting.seed}", dist, device)
            except Exception:  # recorded; the next setting still runs
                if dist.is_main:
                    (out_dir / f"seed_{setting.seed}.error").write_text(traceback.format_exc())
                continue
            if dist.is_main:
                torch.save(record, out_dir / f"seed_{setting.seed}.pt")


if __name__ == "__main__":
    main()
