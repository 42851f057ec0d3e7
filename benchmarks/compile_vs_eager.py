"""torch.compile(model) versus eager for the engine step, on CPU.

    python benchmarks/compile_vs_eager.py

Two copies of the same model (same init); one is wrapped in ``torch.compile``.
Compilation happens in the first steps of the compiled copy, so both get
untimed warm-up steps and the compile warm-up is reported on its own. Then the
two alternate step by step (which goes first swaps every step) on the same
micro-batches, and the script prints median tokens/s of each and the ratio
compiled/eager. If ``torch.compile`` fails here (no C++ compiler, unsupported
platform), the script says so and exits 0.
"""

from __future__ import annotations

import copy
import statistics
import time
import traceback

import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, preset

PRESET, B, T, K = "nano", 4, 128, 2
WARMUP = 2  # untimed steps per copy; the compiled copy compiles forward and backward in the first
STEPS, BUDGET_S = 20, 10.0  # timed steps per copy (at most), and the time allowed for them


def main() -> int:
    torch.manual_seed(0)
    base = GPT(preset(PRESET, vocab_size=256))
    engines: dict[str, AccumulationEngine] = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(base)
        wrapped = torch.compile(model) if name == "compiled" else model
        engines[name] = AccumulationEngine(wrapped, build_adamw(model, 1e-3), constant_schedule(1e-3))

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (K, B, T + 1), generator=gen)
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]

    warmup: dict[str, float] = {}
    for name, engine in engines.items():
        started = time.perf_counter()
        try:
            for _ in range(WARMUP):
                engine.step(batches)
        except Exception as exc:  # inductor raises many kinds (BackendCompilerFailed, CppCompileError, ...)
            if name == "eager":
                raise
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0][:300]
            print(f"torch.compile {torch.__version__} failed on this machine, so nothing was compared: {detail}")
            return 0
        warmup[name] = time.perf_counter() - started

    times: dict[str, list[float]] = {name: [] for name in engines}
    deadline = time.perf_counter() + BUDGET_S
    for step in range(STEPS):
        if step >= 3 and time.perf_counter() > deadline:
            break
        for name in engines if step % 2 == 0 else reversed(list(engines)):
            started = time.perf_counter()
            engines[name].step(batches)
            times[name].append(time.perf_counter() - started)

    tokens_per_step = K * B * T
    rate = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    print(
        f"{PRESET} model, micro_batch {B} x seq_len {T} x K {K} = {tokens_per_step:,} tokens/step, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"  warm-up, not timed below ({WARMUP} steps each): eager {warmup['eager']:.1f} s, "
        f"compiled {warmup['compiled']:.1f} s (includes compilation; faster with a warm inductor cache)"
    )
    print(f"  {len(times['eager'])} timed steps each, interleaved, medians")
    for name in engines:
        print(f"  {name:<9} {statistics.median(times[name]) * 1000:8.1f} ms/step  {rate[name]:10,.0f} tokens/s")
    print(f"ratio: compiled / eager = {rate['compiled'] / rate['eager']:.2f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
