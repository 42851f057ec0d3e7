"""Packing documents into rows (``--pack on``): the fill rule, as a pure function of the lengths and the order.

A documents-mode epoch is a sequence of *sequences* (a document, or one window of ``T`` targets of a long one)
in an order (the data's, or the epoch's shuffle). Unpacked, each sequence takes a row of ``T`` positions and the
rest of the row is padding; packed, :func:`pack_rows` fills rows with several whole sequences back to back.

**The fill rule.** ``lengths[s]`` is the number of positions sequence ``s`` occupies: its tokens minus one (the
input positions that have a target), ``0..T``. Sequences of length 0 (one-token documents: no target) are left
out; no sequence is ever cut. The epoch's order (without them) is walked in consecutive groups of ``group``
sequences (:data:`PACK_GROUP`); each group is packed on its own by *best-fit decreasing*:

1. the group's sequences are taken by length, longest first, ties in their order in the epoch;
2. each goes into the open row of the group with the least room that still holds it (ties: the row opened
   first), else it opens a new row.

The rows of a group are then emitted by the position in the epoch's order of their earliest member (so the
long sequences, placed first, do not all land in the group's first rows: a shuffled epoch stays shuffled at the
scale of rows), the groups one after another; within a row the members are in placement order (longest first).
The result depends only on ``lengths``, ``order``, ``T`` and ``group``: every rank computes the same plan, and
a resumed run the same again.

**Cost.** Groups bound the reordering to ``group`` consecutive sequences (a sequence moves at most that far in
the epoch) and the work to ``O(n log(rows per group))`` with small constants; the price is the partly filled last
rows of each group. Measured with ``python benchmarks/pack_fill.py`` (1M sequences in a random order, one CPU
core), the share of the rows' positions that is padding:

=====================================================  =========  ========  ==========  ==========  ==========
lengths                                                unpacked   next-fit  group 1024  group 4096  group 16384
=====================================================  =========  ========  ==========  ==========  ==========
uniform 20..200 targets, ``T = 512``                   78.5%      13.1%     0.48%       0.30%       0.25%
documents, split into windows of ``T = 2048`` (*)      69.9%      20.8%     0.24%       0.06%       0.02%
the same documents split at ``T = 512``                29.6%      17.9%     0.26%       0.08%       0.03%
=====================================================  =========  ========  ==========  ==========  ==========

(*) document lengths log-normal: median 400 tokens, sigma 1 (a long tail).

Packing 1M sequences takes 0.5-0.8 s whatever the group (about 1 s for the 1.28M windows of the last line).
:data:`PACK_GROUP` = 4096 is where larger groups stop paying: they buy hundredths of a percent of padding and move
documents further from their place in the (shuffled) order.
"""

from __future__ import annotations

import bisect

import numpy as np

PACK_GROUP = 4096
"""Sequences packed together (consecutive in the epoch's order); see the module docstring."""


def pack_rows(
    lengths: np.ndarray, order: np.ndarray, seq_len: int, group: int = PACK_GROUP
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of one epoch packed by the fill rule (module docstring), as a CSR layout: ``(row_starts,
    members)``, row ``i`` holding sequences ``members[row_starts[i]:row_starts[i + 1]]`` in that order;
    ``row_starts`` (R + 1,) int64 and ``members`` (n,) int64 are sequence ids (indices into ``lengths``).

    ``order`` lists the epoch's sequences (each at most once); those of length 0 are left out. A length outside
    ``0..seq_len`` is a ``ValueError``."""
    if group < 1:
        raise ValueError(f"group must be at least 1, got {group}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    walked = lengths[order]
    if len(walked) and (int(walked.min()) < 0 or int(walked.max()) > seq_len):
        raise ValueError(f"sequence lengths must lie in 0..{seq_len} (seq_len)")
    keep = walked > 0
    sequences, sizes = order[keep], walked[keep]
    n = len(sequences)
    if n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    where = np.arange(n, dtype=np.int64)  # position in the walked order
    placed = np.lexsort((where, -sizes, where // group))  # by group, then longest first, then order
    row_of, n_rows = _best_fit(sizes[placed].tolist(), seq_len, group)  # row (in opening order) of each placed
    # Rows by the earliest (in the order) of their members: rows never straddle groups, so this keeps groups in turn.
    earliest = np.full(n_rows, n, dtype=np.int64)
    np.minimum.at(earliest, row_of, placed)
    rank = np.empty(n_rows, dtype=np.int64)
    rank[np.argsort(earliest, kind="stable")] = np.arange(n_rows, dtype=np.int64)
    row = rank[row_of]
    emitted = np.argsort(row, kind="stable")  # placement order within each row
    members = sequences[placed[emitted]]
    row_starts = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n_rows), out=row_starts[1:])
    return row_starts, members


def _best_fit(sizes: list[int], seq_len: int, group: int) -> tuple[np.ndarray, int]:
    """Best fit of ``sizes`` (each group's slice already longest first): the row of each, rows numbered in the
    order they are opened, and the number of rows. A group's open rows live in one sorted list of ``room * stride
    + row`` keys, so the row with the least room that holds ``size`` (ties: the first opened) is the first key at
    or after ``size * stride``."""
    stride = len(sizes) + 1  # > any row number
    row_of = np.empty(len(sizes), dtype=np.int64)
    rows = 0
    for begin in range(0, len(sizes), group):
        keys: list[int] = []  # the group's open rows with room left
        for i in range(begin, min(begin + group, len(sizes))):
            size = sizes[i]
            at = bisect.bisect_left(keys, size * stride)
            if at < len(keys):
                key = keys.pop(at)
                room, row = divmod(key, stride)
                room -= size
            else:
                row, room = rows, seq_len - size
                rows += 1
            row_of[i] = row
            if room:
                bisect.insort(keys, room * stride + row)
    return row_of, rows


def padding_share(lengths: np.ndarray, row_starts: np.ndarray, seq_len: int) -> float:
    """Share of the rows' positions that hold no sequence (``lengths`` of the packed sequences summed)."""
    rows = len(row_starts) - 1
    return 1.0 - float(np.sum(lengths)) / (rows * seq_len) if rows else 0.0


def next_fit_rows(sizes: np.ndarray, seq_len: int) -> int:
    """Rows next-fit needs for ``sizes`` in their order, closing a row at the first sequence that does not fit:
    the simple rule best fit is measured against (``benchmarks/pack_fill.py``, the tests)."""
    rows, room = 0, 0
    for size in sizes.tolist():
        if size > room:
            rows, room = rows + 1, seq_len
        room -= size
    return rows
