"""What measuring the gradient noise scale costs: step time with it on versus off, side by side, on CPU.

    python benchmarks/noise_scale_overhead.py [--every N] [--device cpu|cuda]
    python benchmarks/noise_scale_overhead.py --nproc 2 [--parallel ddp|fsdp] [--k 1] [--sync-every-micro-step]

Two engines drive two identical nano models on the same micro-batches (K = 4), one measuring the noise scale
every N steps (the default of ``--noise-scale-every``), the other not. They run in rounds of N steps each (so every
round holds exactly one measured step), alternately, the order swapping every round; the first round is warm-up.
The script prints the median over rounds of (time with it on) / (time with it off) against the goal (at most 2%
more), and, as a check that machine drift does not hide, the extra time of a measured step over the median
unmeasured step of the same engine (of the other engine with ``--every 1``), spread over N steps.

With ``--nproc N`` it starts N processes (torchrun's agent, gloo on CPU) and wraps both models for ``--parallel``
(K = ``--k`` per rank, 1 by default: the small gradient is then read before the reduction, by DDP's communication
hook or FSDP2's reduce-scatter; the hook also runs on the unmeasured steps); rank 0 prints.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, fsdp_units, preset
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.probe import small_grad_probe
from bigbatch.noise.scale import NoiseScale
from bigbatch.parallel.distributed import DistContext, distributed_session, launched_by_torchrun, wrap_model

PRESET, B, T, K = "nano", 8, 128, 4
ROUNDS, BUDGET_S = 9, 90.0
GOAL = 1.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun's agent, gloo on CPU)")
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help="with --nproc > 1")
    parser.add_argument("--k", type=int, default=None, help=f"micro-batches per rank (default {K}; 1 with --nproc)")
    parser.add_argument("--sync-every-micro-step", action="store_true")
    args = parser.parse_args()
    if args.nproc > 1 and not launched_by_torchrun():
        from torch.distributed.run import main as torchrun

        forwarded = ["--every", str(args.every), "--device", args.device, "--parallel", args.parallel]
        forwarded += ["--k", str(args.k)] if args.k is not None else []
        forwarded += ["--sync-every-micro-step"] if args.sync_every_micro_step else []
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", __file__, *forwarded])
        return
    with distributed_session(args.device) as (dist_ctx, device):
        measure(args, dist_ctx, device)


def measure(args: argparse.Namespace, dist_ctx: DistContext, device: torch.device) -> None:
    k = args.k if args.k is not None else (1 if dist_ctx.is_distributed else K)
    parallel = args.parallel if dist_ctx.is_distributed else "none"
    torch.manual_seed(0)
    config = preset(PRESET, vocab_size=256)
    base = GPT(config).to(device)
    engines = {}
    for name, noise in (("off", None), ("on", NoiseScale(every=args.every))):
        model = copy.deepcopy(base)
        wrapped, grad_sync = wrap_model(
            model, parallel, dist_ctx, device, args.sync_every_micro_step, units=fsdp_units(model)
        )
        probe = None if noise is None else small_grad_probe(wrapped, parallel, args.sync_every_micro_step, k == 1)
        engines[name] = AccumulationEngine(
            wrapped,
            build_adamw(model, 3e-4),
            constant_schedule(3e-4),
            device=device,
            grad_sync=grad_sync,
            dist=dist_ctx,
            hooks=noise_meter_hooks(noise, wrapped, probe),
        )
    generator = torch.Generator().manual_seed(1 + dist_ctx.rank)
    tokens = torch.randint(0, config.vocab_size, (k * B, T + 1), generator=generator)
    batches = [MicroBatch(x, y) for x, y in zip(tokens[:, :-1].chunk(k), tokens[:, 1:].chunk(k), strict=True)]
    batches = [mb.to(device) for mb in batches]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    totals: dict[str, list[float]] = {"on": [], "off": []}
    measured_dt: list[float] = []
    plain_dt: list[float] = []  # the measuring engine's unmeasured steps
    off_dt: list[float] = []
    started = time.perf_counter()
    for round_ in range(ROUNDS + 1):
        order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
        for name in order:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.every):
                record = engines[name].step(batches)
                sync()
                if round_ and name == "on":
                    (measured_dt if record.noise is not None else plain_dt).append(record.dt)
                elif round_:
                    off_dt.append(record.dt)
            if round_:
                totals[name].append(time.perf_counter() - t0)
        # every rank stops after the same round (rank 0's clock decides)
        over = round_ >= 3 and time.perf_counter() - started > BUDGET_S
        if dist_ctx.max_int(int(over), device):
            break
    if not dist_ctx.is_main:
        return
    ratios = [on / off for on, off in zip(totals["on"], totals["off"], strict=True)]
    ratio = statistics.median(ratios)
    step_s = statistics.median(plain_dt or off_dt)  # with --every 1 every step measures: compare with off
    extra = (statistics.median(measured_dt) - step_s) / (args.every * step_s) if measured_dt else 0.0
    on = engines["on"].noise_scale
    where = f"{device}" + (f" x {dist_ctx.world_size} processes, {parallel}" if dist_ctx.is_distributed else "")
    where += ", sync every micro-step" if args.sync_every_micro_step else ""
    print(f"noise scale every {args.every} steps | {PRESET} x{B}x{T} K {k} on {where} | {len(ratios)} rounds")
    print(f"step time, measuring on / off: median ratio {ratio:.4f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(
        f"a measured step's extra time over a plain one ({step_s * 1000:.0f} ms), spread over {args.every} steps: "
        f"{extra:+.2%}"
    )
    print(f"estimate after {on.measurements if on else 0} measurements: {on.estimate if on else None}")
    print(f"goal: ratio <= {GOAL:.2f}: {'met' if ratio <= GOAL else 'NOT met'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
