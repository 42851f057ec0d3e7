"""Whole training steps with the chunked loss against the whole-logits loss, side by side, on CPU.

    python benchmarks/chunked_loss_step.py [--model nano] [--seq-len 256] [--micro-batch 8] [--k 2]

Two engines (AdamW, clipping) train the same model shape at GPT-2's vocabulary (50,257) on the same
micro-batches, one with ``chunked_loss`` on (the default), one with it off (``--no-chunked-loss``): one optimizer
step of K micro-batches per round, rounds interleaved after a warm-up, the order flipping every round. It prints
the median tokens/s of each and the ratio chunked / whole (above 1: the chunked loss is faster). The memory side is
``bigbatch memory --vocab-size 50257`` with and without ``--no-chunked-loss``.
"""

from __future__ import annotations

import argparse

import torch
from bench_config import interleaved_step_rates

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import build_model, model_preset

VOCAB = 50257


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    B, T, K = args.micro_batch, args.seq_len, args.k
    engines: dict[str, AccumulationEngine] = {}
    for name, chunked in (("chunked", True), ("whole logits", False)):
        torch.manual_seed(0)
        model = build_model(model_preset(args.model, vocab_size=VOCAB))
        model.chunked_loss = chunked
        engines[name] = AccumulationEngine(model, build_adamw(model, 1e-4), constant_schedule(1e-4), grad_clip=1.0)
    tokens = torch.randint(0, VOCAB, (K, B, T + 1), generator=torch.Generator().manual_seed(1))
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    median, rounds = interleaved_step_rates(engines, batches, args.rounds, 2, args.budget_s)
    print(
        f"{args.model} at vocabulary {VOCAB:,}: micro_batch {B} x seq_len {T} x K {K}, CPU fp32, "
        f"{torch.get_num_threads()} threads, {rounds} interleaved rounds (after 1 warm-up), medians"
    )
    for name, rate in median.items():
        print(f"  {name:<13} {rate:>9,.0f} tok/s")
    print(f"chunked / whole logits tokens/s: {median['chunked'] / median['whole logits']:.3f}")


if __name__ == "__main__":
    main()
