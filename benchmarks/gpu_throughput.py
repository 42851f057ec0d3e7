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
``bigbatch.metrics``: A100 312, H100 and H200 989 TFLOP/s; other GPUs: unknown).
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from bigbatch.accumulate import AccumulationEngine
from bigbatch.batch import MicroBatch
from bigbatch.metrics import device_peak_flops, mfu
from bigbatch.model import GPT, preset
from bigbatch.optim import build_adamw, constant_schedule

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
    print(f"GPT-2 124M, seq_len {T}, K {K}, random tokens | bf16 autocast, torch.compile, flash SDPA, fused AdamW | "
          f"{WARMUP} warm-up + {STEPS} timed steps per size")
    print(f"  {'micro_batch':>11} {'tokens/step':>12} {'compile s':>10} {'ms/step':>9} {'tokens/s':>11} "
          f"{'MFU':>7} {'peak mem GiB':>13}")
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
        print(f"  {micro_batch:>11} {K * micro_batch * T:>12,} {result['compile_s']:>10.1f} {result['step_ms']:>9.1f} "
              f"{result['tokens_per_s']:>11,.0f} {mfu_text} {result['peak_gib']:>13.1f}")
    if results:
        flops = next(iter(results.values()))["flops_per_token"]
        best = max(results, key=lambda b: results[b]["tokens_per_s"])
        rate = results[best]["tokens_per_s"]
        best_mfu = f", MFU {mfu(flops, rate, peak):.1%}" if peak else ""
        print(f"flops/token {flops:.3e} | best: micro_batch {best}, {rate:,.0f} tokens/s{best_mfu}")
    return 1 if failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
