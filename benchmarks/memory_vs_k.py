"""Peak memory against K at a fixed micro-batch, and one micro-batch of 32 against 32 micro-batches of 1.

    python benchmarks/memory_vs_k.py

Measured with bigbatch.sizing.memory.measure (CPU: a fresh process per configuration,
peak resident memory per phase; CUDA: allocator peaks). Goals: the peak of a
whole step is flat in K (within 2%), and accumulation turns the memory of a
32-sequence step into that of a 1-sequence step.
"""

from __future__ import annotations

import torch

from bigbatch.models import preset
from bigbatch.sizing.memory import MiB, measure

B, T = 4, 128


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset("nano", vocab_size=256)
    print(f"nano, seq_len {T}, {device}")
    peaks = {}
    for k in (2, 4, 8, 16):
        m = measure(config, B, T, k=k, device=device)
        peaks[k] = m.fixed + m.step_peak_k
        print(f"  micro_batch {B} x K {k:>2}: step peak {peaks[k] / MiB:7.1f} MiB")
    spread = (max(peaks.values()) - min(peaks.values())) / min(peaks.values())
    print(
        f"ratio: largest / smallest peak over K = {1 + spread:.3f} (goal: flat within 2%: {'met' if spread <= 0.02 else 'NOT met'})"
    )
    small = measure(config, 1, T, k=32, device=device)
    big = measure(config, 32, T, k=2, device=device)
    small_peak = small.fixed + small.step_peak_k
    big_peak = big.fixed + max(big.backward_peak, big.optimizer_peak)  # K = 1: one forward and backward
    print(f"  micro_batch  1 x K 32: step peak {small_peak / MiB:7.1f} MiB")
    print(f"  micro_batch 32 x K  1: step peak {big_peak / MiB:7.1f} MiB")
    print(f"ratio: 32 x 1 / 1 x 32 = {big_peak / small_peak:.1f}x the memory for the same 4,096-token step")


if __name__ == "__main__":
    main()
