"""GPT-2 124M training throughput on one CUDA GPU: tokens/s, MFU and peak memory per micro-batch size.

    bash benchmarks/gpu.sh                   # sets up the venv, then runs this
    python benchmarks/gpu_throughput.py      # on CPU: says CUDA is not available and exits 0

``preset("gpt2")`` at T=1024 through the AccumulationEngine with bf16 autocast,
``torch.compile``, flash attention (SDPA restricted to the flash backend) and
fused AdamW (``build_adamw`` picks it for CUDA parameters), K=2 micro-batches
of random tokens per step, for micro-batch sizes 8, 16 and 32; a size that runs
out of memory is reported and skipped. Each size gets a fresh model and a fresh
compilation (static shapes); compilation and warm-up steps are not timed.
MFU = flops_per_token x tokens/s / the GPU's dense bf16 peak (the table in
``bigbatch.observe.metrics``: A100 312, H100 and H200 989 TFLOP/s; other GPUs: unknown).

Then, at the best micro-batch, side by side (alternating blocks of steps, same data): the engine, the engine
under DDP with NCCL in one process (a process group of world size 1: the wrapping and bucketed all-reduce a
multi-GPU run pays), and the plain loop of ``benchmarks/reference_gpt.py`` (the same GPT-2 shape at the same
vocabulary, the same bf16 autocast, compile, flash attention and fused AdamW), with each one's MFU and the
ratios engine / plain loop. Goal: MFU >= 50% on an H200, engine >= 1.02x the plain loop.

Last, ``--optimizer muon``'s step on GPT-2 124M against fused AdamW's (the same random gradients, medians of 10
after 3 warm-ups): Newton-Schulz for its 72 hidden matrices (fp32 with TF32, as the Trainer runs it), to set
beside a step's compute time above.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_gpt import ReferenceGPT, make_adamw  # noqa: E402

from bigbatch.engine.accumulate import AccumulationEngine  # noqa: E402
from bigbatch.engine.batch import MicroBatch  # noqa: E402
from bigbatch.engine.muon import MuonSettings, build_muon  # noqa: E402
from bigbatch.engine.optim import build_adamw, constant_schedule  # noqa: E402
from bigbatch.models import GPT, preset  # noqa: E402
from bigbatch.observe.metrics import device_peak_flops, mfu  # noqa: E402
from bigbatch.parallel.distributed import DistContext, wrap_model  # noqa: E402

T, K = 1024, 2
MICRO_BATCHES = (8, 16, 32)
WARMUP, STEPS = 3, 10  # untimed steps (the first compiles), timed steps


def measure(micro_batch: int, device: torch.device) -> dict[str, float]:
    """Compile, warm up and time ``STEPS`` optimizer steps at one micro-batch size."""
    torch._dynamo.reset()  # a fresh, static-shape compilation for this size
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = GPT(preset("gpt2")).to(device)
    optimizer = build_adamw(model, lr=6e-4)  # fused: every parameter is on CUDA
    assert optimizer.defaults.get("fused"), "build_adamw did not pick fused AdamW on CUDA"
    compiled = torch.compile(model, dynamic=False)
    engine = AccumulationEngine(compiled, optimizer, constant_schedule(6e-4), precision="bf16", device=device)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (K, micro_batch, T + 1), device=device)
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    n_valid = K * micro_batch * T

    started = time.perf_counter()
    engine.step(batches, n_valid)  # compiles forward and backward
    torch.cuda.synchronize(device)
    compile_s = time.perf_counter() - started
    for _ in range(WARMUP - 1):
        engine.step(batches, n_valid)
    torch.cuda.synchronize(device)

    started = time.perf_counter()
    for _ in range(STEPS):
        record = engine.step(batches, n_valid)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    return {
        "compile_s": compile_s,
        "step_ms": elapsed / STEPS * 1000,
        "tokens_per_s": STEPS * n_valid / elapsed,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "loss": record.loss,
        "flops_per_token": float(model.flops_per_token(T)),
    }


SIDE_BY_SIDE_ROUNDS, BLOCK = 5, 5  # alternating blocks of BLOCK timed steps each


def engine_stepper(micro_batch: int, device: torch.device, ddp: bool) -> tuple[Callable[[], None], float]:
    """One engine step (compiled, bf16, fused AdamW; optionally DDP over a one-process NCCL group) and its
    flops per token."""
    torch.manual_seed(0)
    model = GPT(preset("gpt2")).to(device)
    train_model: torch.nn.Module = model
    grad_sync = None
    dist = DistContext()
    if ddp:
        train_model, grad_sync = wrap_model(model, "ddp", dist, device)
    optimizer = build_adamw(model, lr=6e-4)
    compiled = torch.compile(train_model, dynamic=False)
    engine = AccumulationEngine(
        compiled, optimizer, constant_schedule(6e-4), precision="bf16", device=device, grad_sync=grad_sync
    )
    tokens = torch.randint(0, model.config.vocab_size, (K, micro_batch, T + 1), device=device)
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    n_valid = K * micro_batch * T

    def step() -> None:
        engine.step(batches, n_valid)

    return step, float(model.flops_per_token(T))


def plain_stepper(micro_batch: int, device: torch.device) -> Callable[[], None]:
    """The reference's plain loop, as nanoGPT-style scripts run it on a GPU: compiled, bf16 autocast, fused
    AdamW, loss / K, clip, step (the same gradient as the engine's: every target is valid)."""
    cfg = preset("gpt2")
    torch.manual_seed(0)
    model = ReferenceGPT(cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size).to(device)
    optimizer = make_adamw(model, 6e-4, fused=True)
    compiled = torch.compile(model, dynamic=False)
    tokens = torch.randint(0, cfg.vocab_size, (K, micro_batch, T + 1), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for t in tokens:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, _ = compiled(t[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), t[:, 1:].reshape(-1))
            (loss / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def side_by_side(micro_batch: int, device: torch.device, peak: float | None) -> None:
    """Engine, engine under one-process NCCL DDP, and the plain loop, alternating blocks of steps."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        engine, flops = engine_stepper(micro_batch, device, ddp=False)
        ddp_engine, _ = engine_stepper(micro_batch, device, ddp=True)
        runs = {"engine": engine, "engine, DDP/NCCL x1": ddp_engine, "plain loop": plain_stepper(micro_batch, device)}
        for run in runs.values():  # compile and warm up, untimed
            for _ in range(WARMUP):
                run()
        torch.cuda.synchronize(device)
        seconds: dict[str, list[float]] = {name: [] for name in runs}  # of each block of BLOCK steps
        n_tokens = K * micro_batch * T
        for r in range(SIDE_BY_SIDE_ROUNDS):
            names = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in names:
                started = time.perf_counter()
                for _ in range(BLOCK):
                    runs[name]()
                torch.cuda.synchronize(device)
                seconds[name].append(time.perf_counter() - started)
    finally:
        dist.destroy_process_group()
    print(
        f"side by side at micro_batch {micro_batch} (K {K}, {SIDE_BY_SIDE_ROUNDS} alternating blocks of {BLOCK} "
        "steps; tokens/s: a block's tokens / the median block's time):"
    )
    medians = {name: BLOCK * n_tokens / statistics.median(values) for name, values in seconds.items()}
    for name, rate in medians.items():
        mfu_text = f" | MFU {mfu(flops, rate, peak):.1%}" if peak else ""
        print(f"  {name:<20} {rate:>11,.0f} tokens/s{mfu_text}")
    plain = medians["plain loop"]
    print(
        f"ratio: engine / plain loop = {medians['engine'] / plain:.3f}; "
        f"engine DDP x1 / plain loop = {medians['engine, DDP/NCCL x1'] / plain:.3f} (goal >= 1.02)"
    )


def optimizer_steps(device: torch.device) -> None:
    """Fused AdamW's step and Muon's (with its AdamW half) on GPT-2 124M's parameters, random gradients."""
    torch.manual_seed(0)
    model = GPT(preset("gpt2")).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    times = {}
    for name, optimizer in (
        ("AdamW (fused)", build_adamw(model, lr=6e-4)),
        ("Muon + AdamW", build_muon(model, MuonSettings(lr=6e-4), lr=6e-4)),
    ):
        samples = []
        for i in range(13):
            torch.cuda.synchronize()
            started = time.perf_counter()
            optimizer.step()
            torch.cuda.synchronize()
            if i >= 3:
                samples.append(time.perf_counter() - started)
        times[name] = statistics.median(samples)
    line = " | ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in times.items())
    print(f"optimizer step, GPT-2 124M: {line} | Muon / AdamW {times['Muon + AdamW'] / times['AdamW (fused)']:.1f}x")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_throughput: CUDA is not available on this machine; skipped (run benchmarks/gpu.sh on a CUDA GPU)")
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the Trainer does on CUDA
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device)
    peak = device_peak_flops(name)
    peak_text = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "unknown (no MFU)"
    print(f"{name} | torch {torch.__version__} (CUDA {torch.version.cuda}) | peak {peak_text}")
    print(
        f"GPT-2 124M, seq_len {T}, K {K}, random tokens | bf16 autocast, torch.compile, flash SDPA, fused AdamW | "
        f"{WARMUP} warm-up + {STEPS} timed steps per size"
    )
    print(
        f"  {'micro_batch':>11} {'tokens/step':>12} {'compile s':>10} {'ms/step':>9} {'tokens/s':>11} "
        f"{'MFU':>7} {'peak mem GiB':>13}"
    )
    failures = 0
    results: dict[int, dict[str, float]] = {}
    for micro_batch in MICRO_BATCHES:
        # Free what the previous size left (after an OOM, its traceback held the model until now).
        gc.collect()
        torch.cuda.empty_cache()
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # only flash; anything else raises
                result = measure(micro_batch, device)
        except torch.cuda.OutOfMemoryError:
            print(f"  {micro_batch:>11} out of memory: skipped")
            continue
        except Exception as exc:  # e.g. no flash kernel for this GPU/dtype, a compile error
            failures += 1
            print(f"  {micro_batch:>11} failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
            continue
        results[micro_batch] = result
        mfu_text = f"{mfu(result['flops_per_token'], result['tokens_per_s'], peak):7.1%}" if peak else "    n/a"
        print(
            f"  {micro_batch:>11} {K * micro_batch * T:>12,} {result['compile_s']:>10.1f} {result['step_ms']:>9.1f} "
            f"{result['tokens_per_s']:>11,.0f} {mfu_text} {result['peak_gib']:>13.1f}"
        )
    if results:
        flops = next(iter(results.values()))["flops_per_token"]
        best = max(results, key=lambda b: results[b]["tokens_per_s"])
        rate = results[best]["tokens_per_s"]
        best_mfu = f", MFU {mfu(flops, rate, peak):.1%}" if peak else ""
        print(f"flops/token {flops:.3e} | best: micro_batch {best}, {rate:,.0f} tokens/s{best_mfu}")
        gc.collect()
        torch.cuda.empty_cache()
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                side_by_side(best, device, peak)
        except Exception as exc:
            failures += 1
            print(f"side by side failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
    gc.collect()
    torch.cuda.empty_cache()
    try:
        optimizer_steps(device)
    except Exception as exc:
        failures += 1
        print(f"optimizer steps failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
    return 1 if failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
