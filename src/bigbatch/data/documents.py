"""The rank-aware, resumable reader of a ``documents`` dataset's split: each document is its own sequence
(padded, its prompt tokens masked), one per row or packed several to a row (``--pack``).

Unlike a token stream, a split of documents has epochs: :class:`DocumentLoader` numbers the epoch's
sequences (or packed rows) and deals them out as global micro-batches, the last one short. Padding and masked
targets are ``-100``, so the engine's exact normalization counts only what is trained on.
:func:`bigbatch.data.loader.loader_for` picks the reader a split needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bigbatch.data.packing import PACK_GROUP, pack_rows
from bigbatch.data.shards import DocumentShard
from bigbatch.data.windows import SEQUENTIAL, SHUFFLED, EpochOrders, check_saved_order, epoch_order
from bigbatch.engine.batch import IGNORE_INDEX, DocumentPart, MicroBatch
from bigbatch.errors import DataError
from bigbatch.settings.choices import LONG_DOCUMENTS

LONG_DOCUMENT_POLICIES = LONG_DOCUMENTS.values
"""What a documents-mode sequence does with a document longer than ``seq_len + 1`` tokens: ``split`` it into
windows of ``seq_len`` targets (every target trained on once; only a document's last window is padded), or
``truncate`` it to its first ``seq_len + 1`` tokens (the rest is never trained on)."""


def check_long_documents(policy: str) -> None:
    LONG_DOCUMENTS.check(policy)


def trained_targets(shards: list[DocumentShard], seq_len: int | None = None) -> int:
    """Target tokens trained on in one epoch of document ``shards``: every token after a document's first
    (``seq_len`` None: the ``split`` policy), or only those among its first ``seq_len + 1`` tokens (``truncate``).
    Masked (prompt) tokens do not count."""
    total = 0
    for shard in shards:
        starts = np.asarray(shard.offsets[:-1], dtype=np.int64)
        ends = np.asarray(shard.offsets[1:], dtype=np.int64)
        stops = ends if seq_len is None else np.minimum(ends, starts + seq_len + 1)
        if shard.mask is None:
            total += int(np.sum(stops - starts - 1))
            continue
        mask = np.asarray(shard.mask)
        if seq_len is None:  # every masked-in token but the first of each document (it is never a target)
            total += int(np.count_nonzero(mask)) - int(np.count_nonzero(mask[starts]))
            continue
        keep = stops - starts > 1  # documents with at least one target
        bounds = np.stack([starts[keep] + 1, stops[keep]], axis=1).reshape(-1)  # non-decreasing
        prefix = _prefix_sums(mask, bounds)
        total += int(np.sum(prefix[1::2] - prefix[::2]))
    return total


def _prefix_sums(values: np.ndarray, positions: np.ndarray, chunk: int = 1 << 22) -> np.ndarray:
    """``values[:p].sum()`` for each of the non-decreasing ``positions`` (0..len), reading ``values`` (a memory
    map, perhaps larger than RAM) in chunks: memory stays flat."""
    out = np.empty(len(positions), dtype=np.int64)
    running, done = 0, 0
    for start in range(0, len(values), chunk):
        sums = np.cumsum(np.asarray(values[start : start + chunk]), dtype=np.int64)  # sums[i] = block[: i + 1]
        upto = int(np.searchsorted(positions, start + len(sums), side="left"))  # positions inside this chunk
        inside = positions[done:upto] - start
        out[done:upto] = running + np.where(inside > 0, sums[np.maximum(inside - 1, 0)], 0)
        done = upto
        running += int(sums[-1])
    out[done:] = running  # positions at the very end
    return out


class DocumentLoader:
    """One document per sequence, padded to ``T``; a document longer than ``T + 1`` tokens is split into
    windows of ``T`` targets (``long_documents="split"``, each window padded only at its end and overlapping
    the next by the one token that is both a target and the next input) or cut to ``T + 1`` tokens
    (``"truncate"``).

    Targets are ``-100`` on padding and on masked (prompt) tokens, so the
    engine's exact normalization counts only what is trained on. The sequences (windows) of an epoch are
    numbered in document order; global micro-batch ``j`` covers sequences ``[j * B * world, (j + 1) * B * world)``
    and rank ``r`` takes the ``B`` that begin ``r * B`` into it. The last window of an epoch may hold fewer
    sequences: the missing rows are all padding. With ``shuffle``, position ``i`` of epoch ``e`` reads sequence
    ``order_e[i]`` of a permutation drawn from ``seed`` and ``e`` (every sequence once per epoch, a long
    document's windows apart from one another; the epochs and their last windows stay as they are).

    **Packed** (``pack``, ``--pack on``): what the loader numbers is a *row* instead of a sequence. Epoch ``e``'s
    order of sequences (the shuffled one, or document order) is packed into rows by
    :func:`~bigbatch.data.packing.pack_rows` (whole sequences back to back, best fit within groups of
    :data:`~bigbatch.data.packing.PACK_GROUP`; one-token documents, which have no target, are left out); global
    micro-batch ``j`` covers rows ``[j * B * world, (j + 1) * B * world)`` of that epoch's rows and rank ``r`` takes
    its ``B`` of them. A step's documents thus depend only on the seed, the data, ``T`` and the rows per step,
    never on ``B`` or the number of processes. A row holds its sequences' input tokens back to back, their targets
    as unpacked (masked tokens ``-100``; no target crosses a document boundary), ``positions`` counting from 0 in
    each, then padding (``pad_token`` inputs, ``-100`` targets, positions ``0..p-1``). ``n_sequences``,
    ``sequences_left()`` and ``sequences_per_epoch()`` then count rows of the current epoch (with ``shuffle`` the
    count may change from epoch to epoch); the plan of the current epoch is computed when first needed, the same
    on every rank and after a resume; :meth:`read` reads rows of that plan. ``sequence_count`` is the number of
    sequences in both modes, and :meth:`read_sequences` reads them one per row in both.

    ``valid_targets`` is the number of targets one epoch trains on (all ranks); ``dropped_targets`` those the
    policy never trains on (0 under ``split``). Every micro-batch counts its ``padding``: positions without a
    document token (masked prompt tokens are not padding).
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
        long_documents: str = "split",
        shuffle: bool = False,
        seed: int = 0,
        pack: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        check_long_documents(long_documents)
        self.shards = shards
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.pad_token = pad_token
        self.long_documents = long_documents
        self.global_window = micro_batch * world_size  # sequences (packed: rows) per global micro-batch
        # Flat index of every document: (shard, start, end).
        empty = np.zeros(0, dtype=np.int64)
        self._shard_of = np.concatenate([empty] + [np.full(len(s.offsets) - 1, i) for i, s in enumerate(shards)])
        self._start = np.concatenate([empty] + [np.asarray(s.offsets[:-1]) for s in shards]).astype(np.int64)
        self._end = np.concatenate([empty] + [np.asarray(s.offsets[1:]) for s in shards]).astype(np.int64)
        self.n_docs = len(self._start)
        if self.n_docs == 0:
            raise DataError(f"the {name} data holds no documents; use more data or a different --val-fraction")
        lengths = self._end - self._start
        if long_documents == "split":  # windows of T targets: ceil((length - 1) / T), at least one
            windows = np.maximum(1, -(-(lengths - 1) // seq_len))
        else:
            windows = np.ones(self.n_docs, dtype=np.int64)
        self._first_window = np.concatenate([[0], np.cumsum(windows)]).astype(np.int64)  # (n_docs + 1,)
        self.sequence_count = int(self._first_window[-1])
        # Positions with a target, all sequences together: every token but a document's first (split), or of its
        # first T + 1 (truncate).
        self._document_positions = int(np.sum(np.minimum(lengths - 1, seq_len * windows)))
        self.long_document_count = int(np.sum(lengths > seq_len + 1))
        all_targets = trained_targets(shards)
        self.valid_targets = all_targets if long_documents == "split" else trained_targets(shards, seq_len)
        self.dropped_targets = all_targets - self.valid_targets
        self.position = 0  # first sequence (packed: row) of the next global micro-batch, within the epoch
        self.epoch = 0
        self.shuffle = shuffle
        self.seed = seed
        self._orders = EpochOrders(self.sequence_count, seed)
        self.pack = pack
        # --pack auto resumes a loader state without "pack" (read one document per row) unpacked, as it started
        self.pack_auto = False
        self.pack_group = PACK_GROUP
        self._sequence_lengths: np.ndarray | None = None  # positions each sequence occupies, when packing
        self._plans: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}  # the last two plans computed

    @property
    def n_sequences(self) -> int:
        """What one epoch numbers: sequences, or (packed) the rows of the current epoch."""
        if self.pack:
            return self._rows_in(self.epoch, self.seed, self.pack_group)
        return self.sequence_count

    def docs_left(self) -> int:
        """Sequences (packed: rows) not yet read in this epoch (all ranks together)."""
        return self.n_sequences - self.position

    def reset(self) -> None:
        self.position, self.epoch = 0, 0

    # The step assembler's view (bigbatch.engine.batch.MicroBatchSource): a finite epoch of padded sequences (or rows).
    def sequences_left(self) -> int | None:
        return self.docs_left()

    def sequences_per_micro_batch(self) -> int:
        return self.global_window

    def sequences_per_epoch(self) -> int | None:
        return self.n_sequences

    def known_valid_targets(self) -> int | None:
        return None  # padding and masks: counted per micro-batch

    def skip_rest_of_epoch(self) -> None:
        if self.position:
            self.position = 0
            self.epoch += 1

    def next_micro_batch(self) -> MicroBatch:
        count = self.n_sequences
        first = self.position + self.rank * self.micro_batch
        positions = np.arange(first, min(first + self.micro_batch, count), dtype=np.int64)
        if self.pack:
            batch = self.read(positions)
        else:
            if self.shuffle and len(positions):
                positions = self._orders.at(self.epoch, positions)
            batch = self.read(positions)  # the epoch's last window: missing rows stay padding
        self.position += min(self.global_window, count - self.position)
        if self.position >= count:
            self.position = 0
            self.epoch += 1
        return batch

    def read(self, units: np.ndarray | list[int]) -> MicroBatch:
        """A micro-batch of ``B`` rows whose row ``b`` is what this loader numbers at ``units[b]``: a sequence, or
        (packed) a row of the current epoch's plan; rows past ``len(units)``, and negative entries, are padding."""
        return self._read_rows(units) if self.pack else self.read_sequences(units)

    def read_sequences(self, sequences: np.ndarray | list[int]) -> MicroBatch:
        """A micro-batch of ``B`` rows whose row ``b`` is sequence ``sequences[b]`` of the epoch's numbering, one per
        row (unpacked, in either mode); rows past ``len(sequences)``, and negative entries, are padding."""
        B, T = self.micro_batch, self.seq_len
        inputs = torch.full((B, T), self.pad_token, dtype=torch.int64)
        targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.int64)
        filled = 0
        origin: list[tuple[int, int]] = []
        parts: list[DocumentPart] = []
        for row, sequence in enumerate(np.asarray(sequences, dtype=np.int64).tolist()):
            if sequence < 0:
                continue
            doc = int(np.searchsorted(self._first_window, sequence, side="right")) - 1
            shard = self.shards[self._shard_of[doc]]
            window = sequence - int(self._first_window[doc])
            start = int(self._start[doc]) + window * T
            stop = min(int(self._end[doc]), start + T + 1)
            origin.append((int(self._shard_of[doc]), start))
            tokens = torch.from_numpy(np.asarray(shard.tokens[start:stop], dtype=np.int64))
            n = len(tokens) - 1  # positions with a target
            if n <= 0:
                continue
            windows = int(self._first_window[doc + 1] - self._first_window[doc])
            parts.append(DocumentPart(int(self._shard_of[doc]), int(self._start[doc]), window, windows, row, 0, n))
            filled += n
            inputs[row, :n] = tokens[:-1]
            row_targets = tokens[1:].clone()
            if shard.mask is not None:
                trained = torch.from_numpy(np.asarray(shard.mask[start + 1 : stop], dtype=np.bool_))
                row_targets[~trained] = IGNORE_INDEX
            targets[row, :n] = row_targets
        return MicroBatch(
            inputs, targets, padding=B * T - filled, origin=tuple(origin), epoch=self.epoch, parts=tuple(parts)
        )

    def _read_rows(self, rows: np.ndarray | list[int]) -> MicroBatch:
        """A micro-batch of ``B`` packed rows whose row ``b`` is row ``rows[b]`` of the current epoch's plan; rows
        past ``len(rows)``, and negative entries, are padding (positions ``0..T-1``)."""
        B, T = self.micro_batch, self.seq_len
        row_starts, members = self._plan(self.epoch, self.seed, self.pack_group)
        rows = np.asarray(rows, dtype=np.int64)
        slots = np.flatnonzero(rows >= 0)  # the batch rows that hold a plan's row
        rows = rows[slots]
        counts = row_starts[rows + 1] - row_starts[rows]
        picked = members[np.repeat(row_starts[rows] - _exclusive_cumsum(counts), counts) + np.arange(counts.sum())]
        row_of = np.repeat(slots, counts)  # each picked sequence's row in the batch
        doc, start, n = self._geometry(picked)
        fill = np.zeros(B, dtype=np.int64)  # document positions of each row
        np.add.at(fill, row_of, n)
        before = _exclusive_cumsum(n)  # positions of the picked sequences before each, all rows together
        column = before - np.repeat(_exclusive_cumsum(fill[slots]), counts)  # where each starts in its row
        # One entry per document position: which sequence, how far into it.
        total = int(n.sum())
        owner = np.repeat(np.arange(len(picked), dtype=np.int64), n)
        within = np.arange(total, dtype=np.int64) - np.repeat(before, n)
        source = start[owner] + within  # the input token; its target is the next one
        out_row, out_col = row_of[owner], column[owner] + within
        inputs = np.full((B, T), self.pad_token, dtype=np.int64)
        targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        positions = np.arange(T, dtype=np.int64)[None, :] - fill[:, None]  # the padding's own count from 0 ...
        positions[out_row, out_col] = within  # ... and each document's from its first token
        shard_of = self._shard_of[doc][owner]
        for index in np.unique(shard_of).tolist():  # one gather per shard
            here = np.flatnonzero(shard_of == index)
            shard, at = self.shards[index], source[here]
            inputs[out_row[here], out_col[here]] = np.asarray(shard.tokens[at], dtype=np.int64)
            following = np.asarray(shard.tokens[at + 1], dtype=np.int64)
            if shard.mask is not None:
                following[~np.asarray(shard.mask[at + 1], dtype=np.bool_)] = IGNORE_INDEX
            targets[out_row[here], out_col[here]] = following
        origin = tuple(zip(self._shard_of[doc].tolist(), start.tolist(), strict=True))
        return MicroBatch(
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            torch.from_numpy(positions),
            B * T - total,
            origin=origin,
            epoch=self.epoch,
            parts=self._parts(picked, doc, row_of, column, n),
        )

    def _parts(
        self, picked: np.ndarray, doc: np.ndarray, row_of: np.ndarray, column: np.ndarray, n: np.ndarray
    ) -> tuple[DocumentPart, ...]:
        """Where each packed sequence (a window of its document) sits: what following a bad document needs."""
        first = self._first_window[doc]
        columns = zip(
            self._shard_of[doc].tolist(),
            self._start[doc].tolist(),
            (picked - first).tolist(),
            (self._first_window[doc + 1] - first).tolist(),
            row_of.tolist(),
            column.tolist(),
            n.tolist(),
            strict=True,
        )
        return tuple(DocumentPart(*fields) for fields in columns)

    def _geometry(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each sequence's document, first token and positions (tokens with a target)."""
        T = self.seq_len
        doc = np.searchsorted(self._first_window, sequences, side="right") - 1
        start = self._start[doc] + (sequences - self._first_window[doc]) * T
        return doc, start, np.minimum(self._end[doc], start + T + 1) - start - 1

    def sequence_lengths(self) -> np.ndarray:
        """Positions each sequence occupies (its tokens minus one, ``0..T``), in the numbering; computed once."""
        if self._sequence_lengths is None:
            T = self.seq_len
            lengths = np.full(self.sequence_count, T, dtype=np.int64)  # a long document's full windows
            last = self._first_window[1:] - 1  # each document's last (or only) sequence
            lengths[last] = np.minimum(self._end - self._start - 1 - (last - self._first_window[:-1]) * T, T)
            self._sequence_lengths = lengths
        return self._sequence_lengths

    def _plan(self, epoch: int, seed: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s packed rows (``pack_rows``' CSR layout); the last two plans computed are kept."""
        key = (epoch if self.shuffle else 0, seed if self.shuffle else 0, group)
        plan = self._plans.get(key)
        if plan is None:
            n = self.sequence_count
            order = epoch_order(n, seed, epoch) if self.shuffle else np.arange(n, dtype=np.int64)
            plan = pack_rows(self.sequence_lengths(), order, self.seq_len, group)
            self._plans = dict(list(self._plans.items())[-1:])  # the previous plan stays (a rewind to it)
            self._plans[key] = plan
        return plan

    def _rows_in(self, epoch: int, seed: int, group: int) -> int:
        return len(self._plan(epoch, seed, group)[0]) - 1

    def position_shares(self, packed: bool | None = None) -> tuple[float, float]:
        """The shares of one epoch's positions (rows x ``T``) that are padding and that are masked (prompt)
        positions (a document token whose target is not trained on), packed by the current epoch's plan or one
        sequence per row (``packed``; ``None``: as this loader reads). The rows of padding that fill an epoch's
        last micro-batch are not counted (they depend on the micro-batch size)."""
        packed = self.pack if packed is None else packed
        rows = self._rows_in(self.epoch, self.seed, self.pack_group) if packed else self.sequence_count
        total = rows * self.seq_len
        if total == 0:
            return 0.0, 0.0
        padding = total - self._document_positions
        masked = self._document_positions - self.valid_targets
        return padding / total, masked / total

    def __iter__(self) -> DocumentLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    def state_dict(self) -> dict[str, Any]:
        state = {
            "kind": "documents",
            "order": SHUFFLED if self.shuffle else SEQUENTIAL,
            "seed": self.seed,
            "position": self.position,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "long_documents": self.long_documents,
            "pack": self.pack,
        }
        if self.pack:
            state["pack_group"] = self.pack_group  # the rows were packed in groups of this many sequences
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved_order(state, SHUFFLED if self.shuffle else SEQUENTIAL)
        saved_pack = bool(state.get("pack", False))  # a state without it was read one document per row
        if "pack" not in state and self.pack and self.pack_auto:
            self.pack = False  # --pack auto resuming a run from before packing: it goes on as it started
        if saved_pack != self.pack:
            saved, now = ("packed", "one per row") if saved_pack else ("one per row", "packed")
            raise DataError(
                f"the checkpoint read documents {saved}, this run reads them {now}; resume with --pack "
                f"{'on' if saved_pack else 'off'}"
            )
        saved_policy = str(state.get("long_documents", "truncate"))  # a state without it truncated
        if saved_policy != self.long_documents and self.long_document_count:
            raise DataError(
                f"the checkpoint read documents with long_documents = {saved_policy}, this run uses "
                f"{self.long_documents}; resume with --long-documents {saved_policy}"
            )
        position = int(state["position"])
        epoch = int(state.get("epoch", 0))
        seed = int(state.get("seed", self.seed)) if self.shuffle else self.seed  # the order the run started with
        group = int(state.get("pack_group", self.pack_group))
        if self.pack:
            count = self._rows_in(epoch, seed, group)
            unit = f"rows of epoch {epoch} of"
        else:
            count, unit = self.sequence_count, "sequences of"
        if not 0 <= position < max(count, 1):
            raise DataError(
                f"loader state position {position} lies outside the {count} {unit} this split; was the data changed?"
            )
        self.position = position
        self.epoch = epoch
        self.pack_group = group
        if self.shuffle:
            self.seed = seed
            self._orders = EpochOrders(self.sequence_count, self.seed)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """``[0, v0, v0 + v1, ...]`` without the total: where each item starts when laid end to end."""
    out = np.zeros(len(values), dtype=np.int64)
    if len(values) > 1:
        np.cumsum(values[:-1], out=out[1:])
    return out
