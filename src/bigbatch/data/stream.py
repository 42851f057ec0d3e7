"""The rank-aware, resumable readers of a token stream (a ``packed`` dataset's split).

:class:`TokenStreamLoader` reads the stream in order, :class:`ShuffledTokenStreamLoader` in a seeded order of
windows that is new each epoch (``--shuffle on``). Both are endless and strided across ranks so that no two ranks
read the same tokens; their saved position is the same on every rank. :func:`bigbatch.data.loader.loader_for` picks
the reader a split needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bigbatch.data.windows import SEQUENTIAL, SHUFFLED, EpochOrders, TokenStreamWindows, check_saved_order, epoch_shift
from bigbatch.engine.batch import MicroBatch
from bigbatch.errors import DataError


class TokenStreamLoader:
    """Reads (B, T) windows from a token stream, strided across ranks.

    Within a shard, global window ``j`` starts at ``j * B * T * world``; rank ``r``
    reads the ``B * T + 1`` tokens that begin ``r * B * T`` after it, so ranks never
    overlap. When the next global window would run past the shard's end, the
    reader moves to the next shard (after the last, back to the first) at the
    rank's start; the short tail of each shard is skipped. Shards shorter than one
    global window are skipped entirely.
    """

    def __init__(
        self,
        shards: list[np.ndarray],
        micro_batch: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.shards = shards
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.window = micro_batch * seq_len  # tokens one rank reads (plus one for the shifted target)
        self.global_window = self.window * world_size
        self.usable = [i for i, shard in enumerate(shards) if len(shard) >= self.global_window + 1]
        if not self.usable:
            longest = max((len(s) for s in shards), default=0)
            raise DataError(
                f"the {name} data is too short: its longest shard has {longest:,} tokens, but one micro-batch "
                f"window on all ranks needs micro_batch x seq_len x world_size + 1 = {micro_batch} x {seq_len} x "
                f"{world_size} + 1 = {self.global_window + 1:,}; use more data or a smaller --micro-batch/--seq-len"
            )
        self._slot = 0  # index into self.usable
        self.offset = 0  # start of the current global window in the current shard
        self.epoch = 0  # completed passes over all shards

    @property
    def shard_index(self) -> int:
        return self.usable[self._slot]

    def reset(self) -> None:
        self._slot, self.offset, self.epoch = 0, 0, 0

    # The step assembler's view (bigbatch.engine.batch.MicroBatchSource): an endless stream of full micro-batches.
    def sequences_left(self) -> int | None:
        return None

    def sequences_per_micro_batch(self) -> int:
        return self.micro_batch * self.world_size

    def sequences_per_epoch(self) -> int | None:
        return None

    def skip_rest_of_epoch(self) -> None:
        self._slot, self.offset = 0, 0
        self.epoch += 1

    def known_valid_targets(self) -> int | None:
        return self.window  # a token stream: every target of the B x T window is valid

    def next_micro_batch(self) -> MicroBatch:
        shard = self.shards[self.shard_index]
        start = self.offset + self.rank * self.window
        chunk = torch.from_numpy(np.asarray(shard[start : start + self.window + 1], dtype=np.int64))
        inputs = chunk[:-1].view(self.micro_batch, self.seq_len)  # (B, T)
        targets = chunk[1:].view(self.micro_batch, self.seq_len)  # (B, T)
        origin = ((self.shard_index, start),)
        epoch = self.epoch
        self._advance(len(shard))
        return MicroBatch(inputs, targets, origin=origin, epoch=epoch)

    def _advance(self, shard_len: int) -> None:
        self.offset += self.global_window
        if self.offset + self.global_window + 1 > shard_len:
            self.offset = 0
            self._slot += 1
            if self._slot == len(self.usable):
                self._slot = 0
                self.epoch += 1

    def __iter__(self) -> TokenStreamLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position of the next window; identical on every rank."""
        return {  # no "order": a state without one was read in order
            "shard": self.shard_index,
            "offset": self.offset,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved_order(state, SEQUENTIAL)
        shard = int(state["shard"])
        offset = int(state["offset"])
        if shard not in self.usable:
            raise DataError(
                f"loader state names shard {shard}, which this dataset does not have; was the data changed?"
            )
        if offset < 0 or offset > len(self.shards[shard]):
            raise DataError(f"loader state offset {offset} lies beyond shard {shard}; was the data changed?")
        self._slot = self.usable.index(shard)
        self.offset = offset
        self.epoch = int(state.get("epoch", 0))
        if offset + self.global_window + 1 > len(self.shards[shard]):
            # Saved under another micro-batch or world size: this shard's tail no longer holds a whole
            # window, so continue where this reader would have gone next.
            self.offset -= self.global_window
            self._advance(len(self.shards[shard]))


class ShuffledTokenStreamLoader(TokenStreamLoader):
    """The token-stream reader with a seeded order of ``T``-token windows that is new each epoch and the same for
    every micro-batch size and number of processes (``--shuffle on``, the default).

    The split's windows are numbered once (:class:`~bigbatch.data.windows.TokenStreamWindows`); epoch ``e`` reads them
    in the permutation drawn from the run's seed and ``e``, every window moved ``epoch_shift(T, seed, e)`` tokens later
    (0 in the first epoch: a repeated epoch reads new windows, not the first epoch's again), and the epochs follow
    one another as one endless stream of rows. Global micro-batch ``j`` is rows ``[j * B * world, (j + 1) * B *
    world)`` of that stream and rank ``r`` reads the ``B`` rows that begin ``r * B`` into it. A global step of ``K``
    micro-batches therefore holds rows ``[s * R, (s + 1) * R)`` with ``R = tokens per step / T``: the windows of step
    ``s`` depend only on the seed, the data, ``T`` and the tokens per step, never on how ``R`` is divided into
    micro-batches and processes. The position is one row counter, the same on every rank, so a resumed run
    continues bitwise (also under another micro-batch size or number of processes).
    """

    def __init__(
        self,
        shards: list[np.ndarray],
        micro_batch: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
        seed: int = 0,
    ) -> None:
        super().__init__(shards, micro_batch, seq_len, rank, world_size, name=name)  # the same checks
        self.windows = TokenStreamWindows(shards, seq_len)
        self.seed = seed
        self.orders = EpochOrders(self.windows.count, seed)
        self.row = 0  # first row of the next global micro-batch in the endless stream of epochs

    @property
    def windows_per_epoch(self) -> int:
        return self.windows.count

    def reset(self) -> None:
        self.row, self.epoch = 0, 0

    def skip_rest_of_epoch(self) -> None:
        self.epoch += 1
        self.row = self.epoch * self.windows.count

    def next_micro_batch(self) -> MicroBatch:
        n = self.windows.count
        rows = self.row + self.rank * self.micro_batch + np.arange(self.micro_batch, dtype=np.int64)
        epochs, positions = rows // n, rows % n
        picked = np.empty(self.micro_batch, dtype=np.int64)
        shifts = np.zeros(self.micro_batch, dtype=np.int64)  # each epoch after the first moves its windows
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            picked[here] = self.orders.at(int(epoch), positions[here])
            shifts[here] = epoch_shift(self.seq_len, self.seed, int(epoch))
        epoch = self.epoch
        self.row += self.micro_batch * self.world_size
        self.epoch = self.row // n
        batch = self.windows.read(picked, shifts=shifts)
        batch.epoch = epoch
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The row counter (identical on every rank) and what it means: the seed and the number of windows."""
        return {
            "order": SHUFFLED,
            "row": self.row,
            "epoch": self.epoch,
            "windows": self.windows.count,
            "seed": self.seed,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved_order(state, SHUFFLED)
        if int(state.get("seq_len", self.seq_len)) != self.seq_len or int(state["windows"]) != self.windows.count:
            raise DataError(
                f"loader state counts {state['windows']} windows of {state.get('seq_len')} tokens, this split has "
                f"{self.windows.count} of {self.seq_len}; was the data changed?"
            )
        self.seed = int(state["seed"])  # the order the run was started with
        self.orders = EpochOrders(self.windows.count, self.seed)
        self.row = int(state["row"])
        self.epoch = self.row // self.windows.count
