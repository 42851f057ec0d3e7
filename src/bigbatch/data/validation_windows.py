"""The windows an evaluation scores: the whole split when it is small, else a fixed sample spread uniformly over
it; the same windows at every evaluation of a run.

The split's windows are numbered once (packed: ``T + 1``-token windows at multiples of ``T``, see
:class:`~bigbatch.data.windows.TokenStreamWindows`; documents: the sequences of an epoch, a long document's windows
included; answers: whole micro-batches of groups, each a window one process reads alone, as many as hold the rows
asked for). ``eval_batches`` auto (stored as 0) asks for :data:`AUTO_EVAL_TOKENS` tokens, i.e. that many divided
by ``T`` windows, whatever the micro-batch and the number of processes, so runs that divide their batch
differently score the same windows; a number ``N`` asks for ``N`` micro-batches per process, i.e.
``N x B x world`` windows. A split with no more windows than asked for is read whole; otherwise the windows
taken are the middles of that many equal parts of the split. The sample is dealt out as global micro-batches of
``B x world`` windows (rank ``r`` takes the ``B`` that begin ``r * B`` into each); the last may be short, its
missing rows padding that counts for nothing, and every process reads the same number of micro-batches.
"""

from __future__ import annotations

import math

import numpy as np

from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.dataset import Dataset
from bigbatch.data.documents import DocumentLoader
from bigbatch.data.loader import loader_for
from bigbatch.data.windows import TokenStreamWindows, spread_sample
from bigbatch.engine.batch import MicroBatch
from bigbatch.errors import DataError
from bigbatch.progress import plural

AUTO_EVAL_TOKENS = 131_072
"""Validation tokens an evaluation reads by default (``eval_batches`` auto): a split of at most this many tokens
(tiny Shakespeare's 10% at any ``seq_len``) is read whole."""


def wanted_windows(eval_batches: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Windows an evaluation asks for: ``eval_batches`` micro-batches on every process, or with 0 (auto)
    :data:`AUTO_EVAL_TOKENS` tokens' worth."""
    if eval_batches:
        return eval_batches * micro_batch * world_size
    return max(1, AUTO_EVAL_TOKENS // seq_len)


class ValidationWindows:
    """This process's micro-batches of a fixed sample of a split's windows; read with :meth:`next_micro_batch`
    until ``epoch`` turns 1 (a loader's view, for :func:`~bigbatch.run.loop.validation_loss.score_windows`);
    :meth:`reset` rewinds."""

    def __init__(
        self,
        source: TokenStreamWindows | DocumentLoader | AnswerGroupLoader,
        wanted: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.source = source
        if isinstance(source, TokenStreamWindows):
            self.available = source.count
        elif isinstance(source, AnswerGroupLoader):
            self.available = source.n_units  # a window is a whole micro-batch of groups (micro_batch is 1)
        else:
            self.available = source.n_sequences
        self.indices = spread_sample(self.available, wanted)
        self.whole = len(self.indices) == self.available
        self.micro_batch = micro_batch
        self.seq_len = source.seq_len
        self.rank = rank
        self.world_size = world_size
        self.micro_batches = max(1, math.ceil(len(self.indices) / (micro_batch * world_size)))  # per process
        self._next = 0
        self.epoch = 0

    @property
    def windows(self) -> int:
        return len(self.indices)

    def describe(self) -> str:
        """E.g. ``1,742 windows of 64 tokens (the whole split)`` or ``2,048 of its 7,812 windows of 64 tokens,
        spread uniformly``."""
        if isinstance(self.source, TokenStreamWindows):
            kind = "window"
        elif isinstance(self.source, AnswerGroupLoader):
            held = "pairs" if self.source.answers == "pairs" else "KTO rows"
            shape = f"of {self.source.micro_batch} x {self.seq_len} holding whole {held}"
            if self.whole:
                return f"{plural(self.windows, 'micro-batch', 'micro-batches')} {shape} (the whole split)"
            available = plural(self.available, "micro-batch", "micro-batches")
            return f"{self.windows:,} of its {available} {shape}, spread uniformly"
        else:
            kind = "packed row" if self.source.pack else "sequence"
        if self.whole:
            return f"{plural(self.windows, kind)} of {self.seq_len} tokens (the whole split)"
        return f"{self.windows:,} of its {plural(self.available, kind)} of {self.seq_len} tokens, spread uniformly"

    def reset(self) -> None:
        self._next, self.epoch = 0, 0

    def next_micro_batch(self) -> MicroBatch:
        B = self.micro_batch
        first = (self._next * self.world_size + self.rank) * B
        picked = np.full(B, -1, dtype=np.int64)  # -1: a row of padding
        chosen = self.indices[first : first + B]
        picked[: len(chosen)] = chosen
        self._next += 1
        if self._next == self.micro_batches:
            self._next, self.epoch = 0, self.epoch + 1
        return self.source.read(picked)


def validation_windows(
    dataset: Dataset,
    split: str,
    micro_batch: int,
    seq_len: int,
    eval_batches: int,
    rank: int = 0,
    world_size: int = 1,
    long_documents: str = "split",
    name: str = "validation",
    whole: bool = False,
    pack: bool = False,
) -> ValidationWindows:
    """The sample of ``split`` an evaluation reads on this process (``eval_batches``: see the module); ``whole``:
    every window of the split. Documents with ``pack``: the windows are the rows the split's documents pack into
    (in document order)."""
    wanted = 2**62 if whole else wanted_windows(eval_batches, micro_batch, seq_len, world_size)
    if dataset.meta.mode == "documents" and dataset.meta.answers:  # whole micro-batches: as many as hold the rows
        answers = loader_for(dataset, split, micro_batch, seq_len, name=name, pack=pack)
        assert isinstance(answers, AnswerGroupLoader)
        return ValidationWindows(answers, math.ceil(wanted / micro_batch), 1, rank, world_size)
    if dataset.meta.mode == "documents":
        loader = loader_for(dataset, split, micro_batch, seq_len, name=name, long_documents=long_documents, pack=pack)
        assert isinstance(loader, DocumentLoader)
        return ValidationWindows(loader, wanted, micro_batch, rank, world_size)
    windows = TokenStreamWindows(dataset.shard_arrays(split), seq_len)
    if windows.count == 0:
        longest = max((len(s) for s in windows.shards), default=0)
        raise DataError(
            f"the {name} data is too short: its longest shard has {longest:,} tokens, one window needs "
            f"seq_len + 1 = {seq_len + 1:,}; use more data or a smaller --seq-len"
        )
    return ValidationWindows(windows, wanted, micro_batch, rank, world_size)
