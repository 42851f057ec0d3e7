"""The rank-aware, resumable reader of packed token streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bigbatch.data.shards import DocumentShard
from bigbatch.errors import DataError
from bigbatch.model import IGNORE_INDEX


@dataclass
class MicroBatch:
    """One micro-batch: ``targets`` are ``inputs`` shifted by one token; ``-100`` marks no loss."""

    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        return MicroBatch(
            self.inputs.to(device, non_blocking=non_blocking), self.targets.to(device, non_blocking=non_blocking)
        )

    def pin_memory(self) -> MicroBatch:
        return MicroBatch(self.inputs.pin_memory(), self.targets.pin_memory())


class PackedLoader:
    """Reads (B, T) windows from a packed token stream, strided across ranks.

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

    def next_micro_batch(self) -> MicroBatch:
        shard = self.shards[self.shard_index]
        start = self.offset + self.rank * self.window
        chunk = torch.from_numpy(np.asarray(shard[start : start + self.window + 1], dtype=np.int64))
        inputs = chunk[:-1].view(self.micro_batch, self.seq_len)  # (B, T)
        targets = chunk[1:].view(self.micro_batch, self.seq_len)  # (B, T)
        self._advance(len(shard))
        return MicroBatch(inputs, targets)

    def _advance(self, shard_len: int) -> None:
        self.offset += self.global_window
        if self.offset + self.global_window + 1 > shard_len:
            self.offset = 0
            self._slot += 1
            if self._slot == len(self.usable):
                self._slot = 0
                self.epoch += 1

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position of the next window; identical on every rank."""
        return {
            "shard": self.shard_index,
            "offset": self.offset,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shard = int(state["shard"])
        offset = int(state["offset"])
        if shard not in self.usable:
            raise DataError(f"loader state names shard {shard}, which this dataset does not have; was the data changed?")
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


def loader_for(
    dataset: Any, split: str, micro_batch: int, seq_len: int, rank: int = 0, world_size: int = 1, name: str = ""
) -> PackedLoader | DocumentLoader:
    """The reader a dataset's split needs: one document per sequence for a ``documents`` dataset (padded
    with its end-of-text token), else the packed stream."""
    name = name or split
    if dataset.meta.mode == "documents":
        pad = dataset.meta.eot_token or 0
        shards = dataset.document_shards(split)
        return DocumentLoader(shards, micro_batch, seq_len, rank, world_size, pad_token=pad, name=name)
    return PackedLoader(dataset.shard_arrays(split), micro_batch, seq_len, rank, world_size, name=name)


class DocumentLoader:
    """One document per sequence: cut to ``T + 1`` tokens, padded to ``T``.

    Targets are ``-100`` on padding and on masked (prompt) tokens, so the
    engine's exact normalization counts only what is trained on. Global
    micro-batch ``j`` of an epoch covers documents ``[j * B * world, (j + 1) * B * world)``;
    rank ``r`` takes the ``B`` documents that begin ``r * B`` into it. The last
    window of an epoch may hold fewer documents: the missing rows are all padding.
    """

    def __init__(
        self,
        shards: list[DocumentShard],
        micro_batch: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        pad_token: int = 0,
        name: str = "train",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.shards = shards
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.pad_token = pad_token
        self.global_window = micro_batch * world_size  # documents per global micro-batch
        # Flat index of every document: (shard, start, end).
        empty = np.zeros(0, dtype=np.int64)
        self._shard_of = np.concatenate([empty] + [np.full(len(s.offsets) - 1, i) for i, s in enumerate(shards)])
        self._start = np.concatenate([empty] + [np.asarray(s.offsets[:-1]) for s in shards])
        self._end = np.concatenate([empty] + [np.asarray(s.offsets[1:]) for s in shards])
        self.n_docs = len(self._start)
        if self.n_docs == 0:
            raise DataError(f"the {name} data holds no documents; use more data or a different --val-fraction")
        self.position = 0  # first document of the next global micro-batch, within the epoch
        self.epoch = 0

    def docs_left(self) -> int:
        """Documents not yet read in this epoch (all ranks together)."""
        return self.n_docs - self.position

    def reset(self) -> None:
        self.position, self.epoch = 0, 0

    def skip_rest_of_epoch(self) -> None:
        if self.position:
            self.position = 0
            self.epoch += 1

    def next_micro_batch(self) -> MicroBatch:
        B, T = self.micro_batch, self.seq_len
        inputs = torch.full((B, T), self.pad_token, dtype=torch.int64)
        targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.int64)
        first = self.position + self.rank * B
        for row in range(B):
            doc = first + row
            if doc >= self.n_docs:
                break  # the epoch's last window: remaining rows stay padding
            shard = self.shards[self._shard_of[doc]]
            start = int(self._start[doc])
            stop = min(int(self._end[doc]), start + T + 1)
            tokens = torch.from_numpy(np.asarray(shard.tokens[start:stop], dtype=np.int64))
            n = len(tokens) - 1  # positions with a target
            if n <= 0:
                continue
            inputs[row, :n] = tokens[:-1]
            row_targets = tokens[1:].clone()
            if shard.mask is not None:
                trained = torch.from_numpy(np.asarray(shard.mask[start + 1 : stop], dtype=np.bool_))
                row_targets[~trained] = IGNORE_INDEX
            targets[row, :n] = row_targets
        self.position += min(self.global_window, self.docs_left())
        if self.position >= self.n_docs:
            self.position = 0
            self.epoch += 1
        return MicroBatch(inputs, targets)

    def __iter__(self) -> DocumentLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "documents",
            "position": self.position,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = int(state["position"])
        if not 0 <= position < self.n_docs:
            raise DataError(
                f"loader state position {position} lies outside the {self.n_docs} documents; was the data changed?"
            )
        self.position = position
        self.epoch = int(state.get("epoch", 0))
