"""Peak memory of DPO with LoRA: the reference as the base model with adapters off, against a second model copy.

    python benchmarks/preference_memory.py

Each variant runs in its own process (peak resident memory is per process): a GPT of about 30M parameters (6
layers, 512 wide, vocabulary 8192) with LoRA rank 8 on every block's linear maps, 3 DPO steps of K 4 micro-batches
of 4 packed rows x 128 tokens. ``adapters-off`` takes the reference log-probabilities from the trained model with
its adapters switched off (bigbatch's default under --lora-rank); ``second-copy`` from a frozen copy of the model
(what --reference DIR, or a trainer without the switch, holds). Printed: each process's peak resident set, the
model's own size, and the difference. On a GPU the same script reports torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import copy
import json
import random
import resource
import subprocess
import sys

import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy
from bigbatch.models import GPT, GPTConfig
from bigbatch.models.lora import LoraSettings, add_lora
from bigbatch.verify.answer_batches import answer_micro_batch, random_pairs

SEQ = 128


def child(variant: str) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = GPTConfig(n_layer=6, n_head=8, n_embd=512, block_size=SEQ, vocab_size=8192, dropout=0.0)
    model = GPT(config)
    second = copy.deepcopy(model) if variant == "second-copy" else None
    add_lora(model, LoraSettings(rank=8), random_init=True)
    model.to(device)
    reference = ReferencePolicy(second.to(device)) if second is not None else ReferencePolicy()
    objective = PreferenceObjective(PreferenceSettings("dpo"), reference)
    engine = AccumulationEngine(
        model, build_adamw(model, 1e-4), constant_schedule(1e-4), device=device, objective=objective
    )
    groups = random_pairs(64, config.vocab_size, seed=1, prompt_max=40, answer_max=24)
    rng = random.Random(0)
    for _ in range(3):
        rng.shuffle(groups)
        batches = [answer_micro_batch(groups[i * 16 : (i + 1) * 16], SEQ, packed=True, rows=4) for i in range(4)]
        engine.step(batches)
    params = sum(p.numel() * p.element_size() for p in GPT.parameters(model))
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    print(json.dumps({"variant": variant, "peak_bytes": peak, "model_bytes": params, "device": device.type}))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    results = {}
    for variant in ("adapters-off", "second-copy"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant], check=True, capture_output=True, text=True
        ).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    mib = 1 << 20
    off, copy_ = results["adapters-off"], results["second-copy"]
    where = "peak resident set" if off["device"] == "cpu" else "peak CUDA memory allocated"
    print(f"DPO with LoRA rank 8, GPT of {off['model_bytes'] / mib:.0f} MiB of weights, {where}:")
    print(f"  adapters-off reference : {off['peak_bytes'] / mib:8.0f} MiB")
    print(f"  second-copy reference  : {copy_['peak_bytes'] / mib:8.0f} MiB")
    print(
        f"  saved by adapters-off  : {(copy_['peak_bytes'] - off['peak_bytes']) / mib:8.0f} MiB "
        f"({copy_['peak_bytes'] / off['peak_bytes']:.2f}x the peak with a second copy)"
    )


if __name__ == "__main__":
    main()
