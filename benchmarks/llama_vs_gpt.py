"""llama-nano against nano (GPT-2): training tokens/s side by side, on CPU.

    python benchmarks/llama_vs_gpt.py

The two presets have about the same budget (4 layers, 128 wide, block 256; the Llama with 2 key/value heads
for 4 query heads and a SwiGLU MLP of 352). Each is trained by its own engine (AdamW, clipping) on the same
micro-batches: one optimizer step of K micro-batches of B x T byte tokens per round, rounds interleaved (which
model goes first alternates every round) after an untimed warm-up round. The script prints the median
tokens/s of each, the ratio llama / gpt, and their parameters and FLOPs per token for context.
"""

from __future__ import annotations

import torch
from bench_config import interleaved_step_rates

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import build_model, model_preset

PRESETS = {"gpt": "nano", "llama": "llama-nano"}
B, T, K = 8, 128, 4
ROUNDS, MIN_ROUNDS, BUDGET_S = 12, 3, 60.0  # fewer rounds when a busy machine makes them slow


def main() -> None:
    torch.manual_seed(0)
    engines: dict[str, AccumulationEngine] = {}
    flops: dict[str, int] = {}
    params: dict[str, int] = {}
    for family, name in PRESETS.items():
        model = build_model(model_preset(name, vocab_size=256))
        engines[family] = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), grad_clip=1.0)
        flops[family], params[family] = model.flops_per_token(T), model.num_params(non_embedding=False)
    tokens = torch.randint(0, 256, (K, B, T + 1), generator=torch.Generator().manual_seed(1))
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]

    median, rounds = interleaved_step_rates(engines, batches, ROUNDS, MIN_ROUNDS, BUDGET_S)
    print(
        f"micro_batch {B} x seq_len {T} x K {K} = {K * B * T:,} tokens/step, byte vocabulary, CPU fp32, "
        f"{rounds} interleaved rounds (after 1 warm-up), medians"
    )
    for family, name in PRESETS.items():
        print(
            f"  {name:<11} {median[family]:>9,.0f} tok/s | {params[family] / 1e6:.2f}M parameters | "
            f"{flops[family] / 1e6:.2f} MFLOP/token"
        )
    print(
        f"llama-nano / nano tokens/s: {median['llama'] / median['gpt']:.2f} "
        f"(FLOPs per token ratio {flops['llama'] / flops['gpt']:.2f})"
    )


if __name__ == "__main__":
    main()
