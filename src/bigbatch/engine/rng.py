"""Random-number generators: their state as tensors and plain values (``weights_only``-safe) and back,
each rank's training streams, and a guard that keeps probes from touching them.

Model construction is seeded from the run's seed alone (every rank builds the same parameters: FSDP2 does
not broadcast them); the training generators are then seeded per rank from ``(seed, rank)`` by
:func:`seed_rank_generators`, so that ranks draw independent dropout masks for their different samples, as
one giant batch draws them per sample. Anything that probes or measures runs under :func:`preserved_rng`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) every CUDA device's generator state."""
    version, py_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),  # 625 words
        "python_gauss": gauss,
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),  # 624 words
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python_state = tuple(int(x) for x in state["python_state"].tolist())
    random.setstate((state["python_version"], python_state, state["python_gauss"]))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- per-rank training streams -------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSeeds:
    """The seeds of one rank's training generators, derived from ``(seed, rank, step)``."""

    python: int  # 128 bits
    numpy: tuple[int, int]  # two 32-bit words (NumPy's legacy ``seed`` takes an array of uint32)
    torch: int  # 64 bits: the CPU generator and every CUDA device


def derive_rank_seeds(seed: int, rank: int, step: int = 0) -> RankSeeds:
    """Well-mixed, independent seeds for ``rank``'s generators.

    The run's ``seed`` is the entropy of a NumPy :class:`~numpy.random.SeedSequence` (its sign and magnitude,
    so any integer maps to a distinct entropy) and ``(rank, step)`` its spawn key: ``(seed, rank)`` and
    ``(seed + 1, rank - 1)`` are unrelated streams, unlike ``seed + rank``. The world size is not an input, so
    rank 0 of a multi-rank run draws the same stream as a single process with the same seed. ``step`` is 0 for
    a fresh run; a resume onto another world size passes the step it resumes at.
    """
    if rank < 0 or step < 0:
        raise ValueError(f"rank and step must be non-negative, got rank={rank}, step={step}")
    entropy = [int(seed < 0), abs(int(seed))]
    words = np.random.SeedSequence(entropy, spawn_key=(int(rank), int(step))).generate_state(8, dtype=np.uint32)
    w = [int(x) for x in words]
    return RankSeeds(
        python=w[0] | w[1] << 32 | w[2] << 64 | w[3] << 96,
        numpy=(w[4], w[5]),
        torch=w[6] | w[7] << 32,
    )


def seed_rank_generators(seed: int, rank: int, step: int = 0) -> RankSeeds:
    """Seed Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA device's from
    :func:`derive_rank_seeds`; returns the seeds used."""
    seeds = derive_rank_seeds(seed, rank, step)
    random.seed(seeds.python)
    np.random.seed(np.array(seeds.numpy, dtype=np.uint32))
    torch.manual_seed(seeds.torch)  # also seeds every CUDA device (lazily if CUDA is not initialised yet)
    return seeds


# ---- probes leave the generators alone -----------------------------------------------------------------


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a probe, estimate or measurement without touching the training generators.

    On exit (normal or by an exception, out-of-memory included) Python's ``random``, NumPy's global
    generator, torch's CPU generator and every CUDA device's generator are restored to the state they had on
    entry, whatever the block seeded or drew. Usable as ``with preserved_rng():`` or as the decorator
    ``@preserved_rng()``. Where CUDA is available it is initialised on entry, so that seeds queued lazily
    before initialisation are applied and captured rather than replaced by a seed the block queues.
    """
    if torch.cuda.is_available():
        torch.cuda.init()
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
