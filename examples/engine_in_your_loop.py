"""bigbatch's engine inside your own training loop.

One optimizer step of 4 x 8 = 32 sequences while only 8 are ever in memory at
once, on random tokens so that it runs anywhere in seconds:

    python examples/engine_in_your_loop.py
"""

from __future__ import annotations

import torch

from bigbatch import GPT, AccumulationEngine, CosineSchedule, MicroBatch, build_adamw, preset


def main(steps: int = 5, k: int = 4, micro_batch: int = 8, seq_len: int = 64) -> list[float]:
    torch.manual_seed(0)
    model = GPT(preset("pico", vocab_size=256))
    optimizer = build_adamw(model, lr=1e-3, weight_decay=0.1)
    schedule = CosineSchedule(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=steps)
    engine = AccumulationEngine(model, optimizer, schedule, grad_clip=1.0)

    losses = []
    for _ in range(steps):
        micro_batches = []
        for _ in range(k):  # your data pipeline goes here
            tokens = torch.randint(0, 256, (micro_batch, seq_len + 1))
            micro_batches.append(MicroBatch(inputs=tokens[:, :-1], targets=tokens[:, 1:]))
        record = engine.step(micro_batches)  # zero, K x (forward, backward), clip, step, schedule
        print(f"step {record.step} | loss {record.loss:.3f} | norm {record.grad_norm:.2f} | lr {record.lr:.1e}")
        losses.append(record.loss)
    return losses


if __name__ == "__main__":
    main()
