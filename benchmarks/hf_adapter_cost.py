"""What ``--model hf:DIR`` costs: the native llama-nano against transformers' LlamaForCausalLM of the same weights
behind bigbatch's adapter, training tokens/s side by side, on CPU.

    python benchmarks/hf_adapter_cost.py

The native model is written out as a Hugging Face Llama directory (config.json + model.safetensors) and read back
through ``hf:DIR``; the two start from the same weights (their logits are compared first). Each is trained by its
own engine (AdamW, clipping) on the same micro-batches: one optimizer step of K micro-batches of B x T byte tokens
per round, rounds interleaved (which model goes first alternates every round) after an untimed warm-up round. The
script prints the median tokens/s of each and the ratio hf / native.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from bench_config import interleaved_step_rates

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import Llama, llama_preset
from bigbatch.models.hf.model import build_hf_model, read_hf_config
from bigbatch.models.llama.hf import save_hf_llama

B, T, K = 8, 128, 4
ROUNDS, MIN_ROUNDS, BUDGET_S = 12, 3, 90.0  # fewer rounds when a busy machine makes them slow


def main() -> None:
    torch.manual_seed(0)
    native = Llama(llama_preset("llama-nano", vocab_size=256))
    with tempfile.TemporaryDirectory() as directory:
        save_hf_llama(native, Path(directory))
        adapter = build_hf_model(read_hf_config(directory), weights=True)
    models = {"native": native, "hf": adapter}
    tokens = torch.randint(0, 256, (K, B, T + 1), generator=torch.Generator().manual_seed(1))
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    with torch.no_grad():
        gap = (native(batches[0].inputs) - adapter(batches[0].inputs)).abs().max().item()
    engines = {
        name: AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), grad_clip=1.0)
        for name, model in models.items()
    }

    median, rounds = interleaved_step_rates(engines, batches, ROUNDS, MIN_ROUNDS, BUDGET_S)
    print(
        f"llama-nano, micro_batch {B} x seq_len {T} x K {K} = {K * B * T:,} tokens/step, byte vocabulary, CPU fp32, "
        f"{rounds} interleaved rounds (after 1 warm-up), medians; same weights (largest logit difference "
        f"{gap:.1e})"
    )
    print(f"  native Llama          {median['native']:>9,.0f} tok/s")
    print(f"  hf: LlamaForCausalLM  {median['hf']:>9,.0f} tok/s")
    print(f"hf / native tokens/s: {median['hf'] / median['native']:.2f}")


if __name__ == "__main__":
    main()
