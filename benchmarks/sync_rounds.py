"""Deferred gradient sync versus sync on every micro-step, 2 gloo processes on CPU.

    python benchmarks/sync_rounds.py            # launches torchrun itself

Both modes run side by side in the same processes, alternating step by step,
on the same model and data; the script prints time per optimizer step and DDP
reduction rounds (counted with a communication hook) for each, and their ratio.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

K, B, T, STEPS, WARMUP = 8, 4, 128, 6, 1


def worker() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.batch import MicroBatch
    from bigbatch.engine.optim import build_adamw, constant_schedule
    from bigbatch.models import GPT, preset
    from bigbatch.parallel.distributed import distributed_session, wrap_model

    with distributed_session("cpu") as (dist, device):
        engines, rounds = {}, {}
        for mode in ("deferred", "every micro-step"):
            torch.manual_seed(0)
            model = GPT(preset("nano", vocab_size=256))
            wrapped, sync = wrap_model(model, "ddp", dist, device, sync_every_micro_step=mode != "deferred")
            # A round = one micro-step whose backward all-reduced at least one bucket.
            rounds[mode] = {"micro_step": 0, "reduced": set(), "calls": 0}
            counter = rounds[mode]
            model.register_forward_pre_hook(lambda *_, c=counter: c.update(micro_step=c["micro_step"] + 1))

            def hook(state, bucket, c=counter):  # type: ignore[no-untyped-def]
                c["calls"] += 1
                c["reduced"].add(c["micro_step"])
                return default_hooks.allreduce_hook(state, bucket)

            wrapped.register_comm_hook(None, hook)
            engines[mode] = AccumulationEngine(
                wrapped, build_adamw(model, 1e-3), constant_schedule(1e-3), grad_sync=sync, dist=dist
            )
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        gen = torch.Generator().manual_seed(dist.rank)
        for step in range(WARMUP + STEPS):
            tokens = torch.randint(0, 256, (K, B, T + 1), generator=gen)
            batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
            for mode, engine in engines.items():
                dist.barrier()
                started = time.perf_counter()
                engine.step(batches)
                dist.barrier()
                if step >= WARMUP:
                    times[mode].append(time.perf_counter() - started)
        if dist.is_main:
            per_step = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}  # median
            print(f"2 gloo processes, nano model, micro_batch {B} x seq_len {T}, K {K}, {STEPS} steps each")
            per_round = {}
            for mode in engines:
                steps = WARMUP + STEPS
                per_round[mode] = len(rounds[mode]["reduced"]) / steps
                calls = rounds[mode]["calls"] / steps
                print(
                    f"  sync {mode:<17} {per_step[mode] * 1000:8.1f} ms/step   {per_round[mode]:4.1f} reduction "
                    f"rounds/step ({calls:.0f} bucket all-reduces)"
                )
            ratio = per_step["every micro-step"] / per_step["deferred"]
            print(
                f"ratio: sync every micro-step / deferred = {ratio:.2f}x time, "
                f"{per_round['every micro-step'] / per_round['deferred']:.0f}x reduction rounds"
            )


def main() -> int:
    if "RANK" in os.environ:
        worker()
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
