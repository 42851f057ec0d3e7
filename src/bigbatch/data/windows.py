"""Windows of a token stream numbered once, whatever the micro-batch and world size; a seeded order of
them per epoch; and a fixed sample of them spread uniformly over a split.

A ``packed`` dataset's split is cut into windows of ``T + 1`` tokens at multiples of ``T`` in each shard (window
``i`` of a shard holds tokens ``[i * T, i * T + T + 1)``: ``T`` inputs and their ``T`` shifted targets, overlapping
the next window by the one token that is both a target and the next input); a shard's tail shorter than a window is
not read. An epoch may move every window by the same few tokens (:func:`epoch_shift`; a shard's last window stays if
moving it would run past the shard's end). The numbering depends only on the shards and ``T``, so an order or a
sample of windows chosen from it is the same for every micro-batch size and number of processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.errors import ConfigError

ORDER_SEED_TAG = 0x5F5E  # keeps the data order's stream apart from any other use of the run's seed
SHUFFLED = "shuffle"
SEQUENTIAL = "sequential"


def saved_order(state: dict[str, Any]) -> str:
    """How a loader state read its data: ``shuffle`` or ``sequential`` (a state without the key was saved before
    bigbatch shuffled, in order)."""
    return str(state.get("order", SEQUENTIAL))


def check_saved_order(state: dict[str, Any], order: str) -> None:
    """Refuse to continue a run in another window order than the one it was saved in (a mixed run would be
    neither)."""
    saved = saved_order(state)
    if saved == order:
        return
    before = "read its training windows in order (--shuffle off, or a bigbatch from before --shuffle)"
    if saved == SHUFFLED:
        before = "read its training windows in a shuffled order (--shuffle on)"
    flag = "on" if saved == SHUFFLED else "off"
    raise ConfigError(
        f"the checkpoint {before}, this run asks for --shuffle {'on' if order == SHUFFLED else 'off'}; resume with "
        f"--shuffle {flag}, or start a new run with --out"
    )


class TokenStreamWindows:
    """The ``T + 1``-token windows of token-stream ``shards``, numbered shard by shard."""

    def __init__(self, shards: list[np.ndarray], seq_len: int) -> None:
        self.shards = shards
        self.seq_len = seq_len
        counts = np.array([max(0, (len(s) - 1) // seq_len) for s in shards], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (n_shards + 1,)
        self.count = int(self.first[-1])

    def read(self, indices: np.ndarray | list[int], pad_token: int = 0, shifts: np.ndarray | None = None) -> MicroBatch:
        """One micro-batch whose row ``b`` is window ``indices[b]``; a negative index is a row of padding (input
        ``pad_token``, target ``-100``: it counts for nothing). ``shifts[b]`` (in ``[0, T)``) moves row ``b``'s
        window that many tokens later in its shard, unless that would run past the shard's end (its last window)."""
        T = self.seq_len
        index = np.asarray(indices, dtype=np.int64)
        moved = np.zeros(len(index), dtype=np.int64) if shifts is None else np.asarray(shifts, dtype=np.int64)
        inputs = torch.full((len(index), T), pad_token, dtype=torch.int64)
        targets = torch.full((len(index), T), IGNORE_INDEX, dtype=torch.int64)
        shard_of = np.searchsorted(self.first, index, side="right") - 1
        real = index >= 0
        origin: dict[int, tuple[int, int]] = {}
        for shard in np.unique(shard_of[real]).tolist():  # one gather per shard, not a slice per row
            rows = np.flatnonzero(real & (shard_of == shard))
            data = self.shards[shard]
            starts = (index[rows] - int(self.first[shard])) * T
            starts += np.where(starts + moved[rows] + T + 1 <= len(data), moved[rows], 0)
            origin.update(zip(rows.tolist(), ((shard, start) for start in starts.tolist()), strict=True))
            chunk = torch.from_numpy(np.asarray(data[starts[:, None] + np.arange(T + 1)], dtype=np.int64))  # (n, T+1)
            inputs[rows] = chunk[:, :-1]
            targets[rows] = chunk[:, 1:]
        return MicroBatch(inputs, targets, origin=tuple(origin[row] for row in sorted(origin)))


def epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(count)`` drawn from ``seed`` and ``epoch`` alone (the same on every rank)."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, ORDER_SEED_TAG])))
    order = generator.permutation(count)
    return order.astype(np.uint32 if count < 2**32 else np.int64)


def epoch_shift(seq_len: int, seed: int, epoch: int) -> int:
    """How far epoch ``epoch`` moves every window, in ``[0, seq_len)``: 0 in the first epoch, then drawn from
    ``seed`` and ``epoch`` alone in ``[1, seq_len)``. A later epoch then reads other windows (other contexts for
    every token) than the first rather than repeating them, as sampling windows at random offsets would, without
    giving up reading every window once per epoch."""
    if epoch == 0 or seq_len < 2:
        return 0
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, ORDER_SEED_TAG, 1])))
    return int(generator.integers(1, seq_len))


class EpochOrders:
    """``epoch_order`` for the epochs in use, the last two kept (a micro-batch may straddle an epoch's end)."""

    def __init__(self, count: int, seed: int) -> None:
        self.count = count
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The items at ``positions`` (within ``epoch``) of that epoch's order."""
        order = self._cache.get(epoch)
        if order is None:
            order = epoch_order(self.count, self.seed, epoch)
            self._cache = {e: o for e, o in self._cache.items() if e == epoch - 1}
            self._cache[epoch] = order
        return order[positions].astype(np.int64)


def spread_sample(count: int, wanted: int) -> np.ndarray:
    """Indices of ``wanted`` items spread uniformly over ``range(count)`` (the middle of each of ``wanted`` equal
    parts); every item when ``count <= wanted``."""
    if count <= wanted:
        return np.arange(count, dtype=np.int64)
    return ((np.arange(wanted, dtype=np.int64) * 2 + 1) * count // (2 * wanted)).astype(np.int64)
