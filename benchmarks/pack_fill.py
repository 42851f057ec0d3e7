"""The fill rule of ``--pack on`` (best fit decreasing in groups) against next-fit and against no packing: the share
of padding and the time to pack, for groups of 256 to 65,536 sequences.

    python benchmarks/pack_fill.py

1M sequences in a random order on one core: uniform lengths of 20..200 targets at ``T = 512``, and log-normal
documents (median 400 tokens, sigma 1) split into windows of ``T = 2048`` and of ``T = 512``. The table in
``src/bigbatch/data/packing.py``'s docstring comes from it.
"""

from __future__ import annotations

import time

import numpy as np

from bigbatch.data.packing import next_fit_rows, pack_rows, padding_share

N = 1_000_000
GROUPS = (256, 1024, 4096, 16384, 65536)


def cases(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, int]]:
    """Sequence lengths (positions) and ``T`` of each measured case."""
    out = {"uniform 20..200, T=512": (rng.integers(20, 201, size=N), 512)}
    for median, T in ((400, 2048), (400, 512)):
        docs = np.maximum(2, rng.lognormal(mean=np.log(median), sigma=1.0, size=N).astype(np.int64))  # tokens
        windows = np.maximum(1, -(-(docs - 1) // T))
        last = (docs - 1) - (windows - 1) * T
        lengths = np.concatenate([np.full(int(np.sum(windows - 1)), T), last])  # every full window, each last one
        rng.shuffle(lengths)
        out[f"log-normal documents (median {median} tokens, sigma 1), split at T={T}"] = (lengths, T)
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    for name, (lengths, seq_len) in cases(rng).items():
        order = rng.permutation(len(lengths))
        unpacked = 1.0 - float(lengths.sum()) / (len(lengths) * seq_len)
        next_fit = 1.0 - float(lengths.sum()) / (next_fit_rows(lengths[order], seq_len) * seq_len)
        print(f"{name}: unpacked padding {unpacked:.2%}, next-fit {next_fit:.2%}")
        for group in GROUPS:
            start = time.perf_counter()
            row_starts, _ = pack_rows(lengths, order, seq_len, group)
            took = time.perf_counter() - start
            share = padding_share(lengths, row_starts, seq_len)
            print(f"  group {group:>6}: padding {share:.3%}, {len(row_starts) - 1:,} rows, {took:.2f} s")


if __name__ == "__main__":
    main()
