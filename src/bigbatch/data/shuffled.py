"""Packed training windows in a seeded order that is new each epoch and the same for every micro-batch size and
number of processes (``--shuffle on``, the default).

The split's windows are numbered once (:class:`~bigbatch.data.windows.PackedWindows`); epoch ``e`` reads them in
the permutation drawn from the run's seed and ``e``, and the epochs follow one another as one endless stream of
rows. Global micro-batch ``j`` is rows ``[j * B * world, (j + 1) * B * world)`` of that stream and rank ``r``
reads the ``B`` rows that begin ``r * B`` into it. A global step of ``K`` micro-batches therefore holds rows
``[s * R, (s + 1) * R)`` with ``R = tokens per step / T``: the windows of step ``s`` depend only on the seed, the
data, ``T`` and the tokens per step, never on how ``R`` is divided into micro-batches and processes. The
position is one row counter, the same on every rank, so a resumed run continues bitwise (also under another
micro-batch size or number of processes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bigbatch.batch import MicroBatch
from bigbatch.data.loader import PackedLoader
from bigbatch.data.windows import SHUFFLED, EpochOrders, PackedWindows, check_saved_order
from bigbatch.errors import DataError


class ShuffledPackedLoader(PackedLoader):
    """The packed reader with a seeded per-epoch order of ``T``-token windows (see the module's description)."""

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
        self.windows = PackedWindows(shards, seq_len)
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
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            picked[here] = self.orders.at(int(epoch), positions[here])
        self.row += self.micro_batch * self.world_size
        self.epoch = self.row // n
        return self.windows.read(picked)

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
