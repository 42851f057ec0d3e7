"""Sharded checkpoints (torch.distributed.checkpoint) against the full gather they replace, on CPU.

    python benchmarks/sharded_checkpoints.py               # all four
    python benchmarks/sharded_checkpoints.py --only memory  # memory | async | resume | restart

* Memory and save time: GPT-2 124M (vocab 50,304) with AdamW moments under FSDP2 on 4 gloo processes; rank 0's
  peak resident memory during one save (VmHWM, reset just before it) and the save's time, sharded (every rank
  its own shards) against the full gather earlier bigbatch did (whole model and optimizer onto rank 0's CPU, one
  file). Goal: sharded peak <= 0.35 x the full gather's.
* Stall of a save: one process, the gpt2 shape on the byte tokenizer (86M parameters), 13 steps of 1 x 64
  tokens, checkpoints at steps 4, 8 and 12 written synchronously or with --async-checkpoint, against the same
  run saving only at the end; interleaved rounds, medians: (run time - no-save run time) / 3 saves. Training
  uses ``--threads`` cores (default 1, leaving the rest to the background writer as a GPU run would).
* Resume across world sizes: pico on the generated corpus, 6 steps of 256 tokens; a run of W processes (FSDP2)
  rewound to step 4 and resumed on W' processes, for every pair of 1, 2 and 4: the relative L2 of the final
  parameters against the uninterrupted run of W (goal <= 1e-5; bitwise expected when W = W').
* Elastic restart: ``--nproc 2 --max-restarts 2``, one rank SIGKILLed at a random micro-step of a random step:
  the final parameters against the uninterrupted run, bitwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_config import cpu_run_config, generated_corpus

from bigbatch.run.checkpoints import checkpoint as ckpt

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ---- memory and save time (a torchrun worker) ---------------------------------------------------------


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    return _status_mib("VmHWM")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _measured(save: Any) -> tuple[float, float]:
    gc.collect()
    _reset_peak()
    started = time.perf_counter()
    save()
    return _peak_rss_mib(), time.perf_counter() - started


def memory_worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from bigbatch.engine.optim import build_adamw
    from bigbatch.models import build_model, model_preset
    from bigbatch.models.decoder import fsdp_units
    from bigbatch.parallel.distributed import DistContext, wrap_model
    from bigbatch.run.checkpoints.sharded import ShardedWriter

    dist.init_process_group("gloo")
    ctx = DistContext(dist.get_rank(), dist.get_world_size(), dist.get_rank())
    model = build_model(model_preset("gpt2", vocab_size=50_304))
    parameters = sum(p.numel() for p in model.parameters())
    model, _ = wrap_model(model, "fsdp", ctx, torch.device("cpu"), units=fsdp_units(model))
    optimizer = build_adamw(model, lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist, as after a training step
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    before = _status_mib("VmRSS")

    def sharded() -> None:
        osd = get_optimizer_state_dict(model, optimizer)
        tensors = {"model": get_model_state_dict(model), "optimizer": osd["state"]}
        folder = out / "sharded" / "step_0000001"
        record = {"param_groups": osd["param_groups"]} if ctx.is_main else None
        ShardedWriter(ctx).save(1, folder, ckpt.commit_path(folder), tensors, record, lambda *a, **k: None)

    def full_gather() -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        payload = {
            "model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        }
        if ctx.is_main:
            ckpt.save_checkpoint(payload, ckpt.single_file_path(out / "full", 1))
        dist.barrier()

    results = {"parameters": parameters, "rss_before_mib": before}
    results["sharded_peak_mib"], results["sharded_s"] = _measured(sharded)
    dist.barrier()
    results["full_peak_mib"], results["full_s"] = _measured(full_gather)
    if ctx.is_main:
        (out / "memory.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def bench_memory(work: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__]
    done = subprocess.run([*command, "--memory-worker", str(work)], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    r = json.loads((work / "memory.json").read_text())
    print(
        f"memory | GPT-2 {r['parameters'] / 1e6:.0f}M + AdamW, FSDP2 on 4 processes | rank 0 before the save "
        f"{r['rss_before_mib']:,.0f} MiB"
    )
    print(f"  full gather: peak {r['full_peak_mib']:,.0f} MiB, save {r['full_s']:.1f} s")
    print(f"  sharded:     peak {r['sharded_peak_mib']:,.0f} MiB, save {r['sharded_s']:.1f} s")
    print(
        f"  sharded / full gather: peak {r['sharded_peak_mib'] / r['full_peak_mib']:.2f} x (goal <= 0.35), "
        f"save time {r['sharded_s'] / r['full_s']:.2f} x"
    )


# ---- the stall of a save ------------------------------------------------------------------------------


def _timed_run(corpus: Path, out: Path, saves: str) -> float:
    from bigbatch.run.loop.trainer import Trainer

    config = cpu_run_config(corpus, out, micro_batch=1, seq_len=64, k=1, steps=13)
    config.model.preset = "gpt2"
    config.run.noise_scale_every = 0
    config.optim.warmup_steps = 2  # shorter than the run: no warning in the figures
    config.run.save_every = 0 if saves == "end only" else 4
    config.run.async_checkpoint = saves == "async"
    config.run.keep_checkpoints = 1
    started = time.perf_counter()
    Trainer(config).train()
    seconds = time.perf_counter() - started
    shutil.rmtree(out)
    return seconds


def bench_async(work: Path, threads: int, rounds: int = 3) -> None:
    import logging

    logging.getLogger("bigbatch").setLevel(logging.WARNING)
    torch.set_num_threads(threads)
    corpus, _ = generated_corpus(work, 200_000)
    kinds = ("end only", "sync", "async")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    _timed_run(corpus, work / "warm", "end only")  # the data cache and first-run costs
    for _ in range(rounds):
        for kind in kinds:
            times[kind].append(_timed_run(corpus, work / "run", kind))
    base = statistics.median(times["end only"])
    print(
        f"stall | gpt2 shape, byte vocab, 13 steps of 1 x 64 tokens, 1 process on {threads} of "
        f"{os.cpu_count()} cores, {rounds} interleaved rounds"
    )
    for kind in kinds:
        median = statistics.median(times[kind])
        extra = "" if kind == "end only" else f" | stall per save {(median - base) / 3:.2f} s"
        print(f"  {kind:8s} run {median:.1f} s (spread {min(times[kind]):.1f}..{max(times[kind]):.1f}){extra}")


# ---- resume across world sizes, and an elastic restart -------------------------------------------------


def _train(corpus: Path, out: Path, world: int, *extra: str, fault: str | None = None) -> str:
    args = ["train", "--data", str(corpus), "--model", "pico", "--micro-batch", "2", "--seq-len", "32"]
    args += ["--total-batch-tokens", "256", "--max-steps", "6", "--save-every", "2", "--eval-every", "0"]
    args += ["--sample-tokens", "0", "--cache-dir", str(out.parent / "cache"), "--out", str(out)]
    args += ["--nproc", str(world), "--parallel", "fsdp", "--collective-timeout", "60", *extra]
    env = {**ENV, **({"BIGBATCH_FAULT": fault} if fault else {})}
    done = subprocess.run([sys.executable, "-m", "bigbatch", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return done.stdout


def _compared(ours: Path, reference: Path) -> tuple[float, bool]:
    """The relative L2 distance of two runs' final parameters, and whether they are bitwise equal (each
    checkpoint read, and consolidated, once)."""
    a, b = ckpt.load_checkpoint(ours)["model"], ckpt.load_checkpoint(reference)["model"]
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    distance = (num / sum(float((b[k].double() ** 2).sum()) for k in b)) ** 0.5
    return distance, a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def bench_resume(work: Path) -> dict[int, Path]:
    corpus, _ = generated_corpus(work, 60_000)
    whole = {world: work / f"whole_{world}" for world in (1, 2, 4)}
    for world, out in whole.items():
        _train(corpus, out, world)
    print("resume | pico, 6 steps of 256 tokens; W processes rewound to step 4, resumed on W'")
    for source, reference in whole.items():
        for target in (1, 2, 4):
            run = work / f"resume_{source}_{target}"
            shutil.copytree(reference, run)
            ckpt.remove_checkpoint(ckpt.checkpoint_path(run, 6))
            _train(corpus, run, target)
            distance, same = _compared(run, reference)
            print(f"  {source} -> {target}: relative L2 {distance:.1e}{' (bitwise)' if same else ''}")
    return whole


def bench_restart(work: Path, whole_2: Path | None) -> None:
    corpus, _ = generated_corpus(work, 60_000)
    if whole_2 is None:
        whole_2 = work / "whole_2"
        _train(corpus, whole_2, 2)
    draws = random.Random(int(time.time()))
    step, micro, rank = draws.randint(3, 6), draws.randint(0, 1), draws.randint(0, 1)
    out = work / "restarted"
    said = _train(corpus, out, 2, "--max-restarts", "2", fault=f"kill:step={step},micro={micro},rank={rank}")
    restarted = "restart 1 of at most 2" in said
    _, bitwise = _compared(out, whole_2)
    print(
        f"restart | --nproc 2 --max-restarts 2, rank {rank} SIGKILLed at step {step} micro-step {micro}: "
        f"{'restarted' if restarted else 'NOT restarted'}, final parameters {'bitwise equal' if bitwise else 'DIFFER'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["memory", "async", "resume", "restart"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the stall's training threads (default 1: the other cores are left to the writer, as a GPU run leaves "
        "the host's cores)",
    )
    parser.add_argument("--memory-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker is not None:
        return memory_worker(args.memory_worker)
    with tempfile.TemporaryDirectory(prefix="bigbatch-sharded-") as tmp:
        work = Path(tmp)
        whole = None
        for part in ("memory", "async", "resume", "restart"):
            if args.only not in (None, part):
                continue
            folder = work / part
            folder.mkdir()
            if part == "memory":
                bench_memory(folder)
            elif part == "async":
                bench_async(folder, args.threads)
            elif part == "resume":
                whole = bench_resume(folder)
            else:
                bench_restart(folder, whole[2] if whole else None)


if __name__ == "__main__":
    main()
