"""Packed documents (``--pack on``): the fill rule (best-fit decreasing in groups of the epoch's order) and the
documents loader's packed rows, which hold the same tokens, targets and positions as the unpacked sequences, one
epoch of every sequence once, steps independent of the micro-batch and the number of processes, resumable bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.packing import PACK_GROUP, next_fit_rows, pack_rows, padding_share
from bigbatch.data.shards import DocumentShard
from bigbatch.data.validation_windows import ValidationWindows
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.errors import DataError
from bigbatch.run.loop.header import describe_long_documents, describe_positions

T = 16
PAD = 65_000  # no document token has this value: padding is recognisable


# --------------------------------------------------------------------------------------------
# The fill rule
# --------------------------------------------------------------------------------------------


def rows_of(row_starts: np.ndarray, members: np.ndarray) -> list[list[int]]:
    return [members[a:b].tolist() for a, b in zip(row_starts[:-1], row_starts[1:], strict=True)]


def test_best_fit_decreasing_on_a_hand_made_example() -> None:
    lengths = np.array([6, 5, 4, 3, 2])
    # longest first: 6 opens row A (room 4), 5 opens B (room 5), 4 fills A (least room that fits), 3 and 2 go to B
    row_starts, members = pack_rows(lengths, np.arange(5), 10)
    assert rows_of(row_starts, members) == [[0, 2], [1, 3, 4]]
    # the same placement, but the rows come in the order of their earliest member: sequence 4 is first now
    row_starts, members = pack_rows(lengths, np.array([4, 3, 2, 1, 0]), 10)
    assert rows_of(row_starts, members) == [[1, 3, 4], [0, 2]]


def test_ties_in_length_keep_the_order_and_groups_are_packed_apart() -> None:
    lengths = np.array([3, 3, 3, 3])
    assert rows_of(*pack_rows(lengths, np.array([2, 0, 3, 1]), 10)) == [[2, 0, 3], [1]]
    # groups of 2 consecutive sequences of the order: rows never mix them
    assert rows_of(*pack_rows(lengths, np.array([2, 0, 3, 1]), 10, group=2)) == [[2, 0], [3, 1]]


def test_zero_length_sequences_are_left_out_and_too_long_ones_refused() -> None:
    assert rows_of(*pack_rows(np.array([0, 4, 0, 4]), np.arange(4), 8)) == [[1, 3]]
    row_starts, members = pack_rows(np.array([0, 0]), np.arange(2), 8)
    assert row_starts.tolist() == [0] and members.tolist() == []
    with pytest.raises(ValueError, match="seq_len"):
        pack_rows(np.array([3, 9]), np.arange(2), 8)


@pytest.mark.parametrize("group", [1, 7, 64, PACK_GROUP])
def test_every_sequence_exactly_once_whole_and_no_row_over_seq_len(group: int) -> None:
    rng = np.random.default_rng(group)
    seq_len = 32
    lengths = rng.integers(0, seq_len + 1, size=3000)
    order = rng.permutation(len(lengths))
    row_starts, members = pack_rows(lengths, order, seq_len, group)
    assert row_starts[0] == 0 and np.all(np.diff(row_starts) >= 1) and row_starts[-1] == len(members)
    assert sorted(members.tolist()) == np.flatnonzero(lengths > 0).tolist()  # each once, zero-length ones left out
    per_row = np.add.reduceat(lengths[members], row_starts[:-1])
    assert per_row.max() <= seq_len
    # rows stay within their group of the order (the order without zero-length sequences)
    walked = order[lengths[order] > 0]
    where = np.empty(len(lengths), dtype=np.int64)
    where[walked] = np.arange(len(walked))
    for row in rows_of(row_starts, members):
        assert len({int(where[s]) // group for s in row}) == 1
    # rows in the order of their earliest member; within a row the longest first
    earliest = [min(int(where[s]) for s in row) for row in rows_of(row_starts, members)]
    assert earliest == sorted(earliest)
    for row in rows_of(row_starts, members):
        assert lengths[row].tolist() == sorted(lengths[row].tolist(), reverse=True)
    again = pack_rows(lengths.copy(), order.copy(), seq_len, group)  # deterministic
    assert np.array_equal(again[0], row_starts) and np.array_equal(again[1], members)


def test_best_fit_keeps_padding_under_five_percent_where_next_fit_does_not() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 201, size=40_000)
    order = rng.permutation(len(lengths))
    row_starts, _ = pack_rows(lengths, order, 512)
    best = padding_share(lengths, row_starts, 512)
    next_fit = 1.0 - lengths.sum() / (next_fit_rows(lengths[order], 512) * 512)
    assert best < 0.05 < next_fit
    assert best < 0.01  # measured: 0.3% (module docstring)


# --------------------------------------------------------------------------------------------
# The documents loader, packed
# --------------------------------------------------------------------------------------------


def documents(lengths: list[int], masked: bool = False, seed: int = 0) -> list[DocumentShard]:
    """Two shards of documents whose every token is distinct (its global position + 1), with a random mask."""
    rng = np.random.default_rng(seed)
    half = len(lengths) // 2
    shards, base = [], 1
    for part in (lengths[:half], lengths[half:]):
        n = int(sum(part))
        tokens = np.arange(base, base + n, dtype=np.uint16)
        base += n
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        mask = rng.integers(0, 2, size=n).astype(np.uint8) if masked else None
        shards.append(DocumentShard(tokens, offsets, mask))
    assert base < PAD
    return shards


def doc_lengths(seed: int = 0, count: int = 90) -> list[int]:
    """Mostly short documents, some of one token (no target), some longer than a sequence (several windows)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 14, size=count).tolist()
    lengths[3] = lengths[40] = lengths[77] = 1
    lengths[5], lengths[50] = 3 * T + 6, 2 * T + 1  # 4 windows (the last one 5 targets), 2 full windows
    return lengths


def loader(shards: list[DocumentShard], B: int = 3, rank: int = 0, world: int = 1, **kwargs) -> DocumentLoader:  # noqa: ANN003
    kwargs.setdefault("pack", True)
    return DocumentLoader(shards, B, T, rank, world, pad_token=PAD, **kwargs)


def reference(shards: list[DocumentShard], **kwargs) -> dict[int, tuple[int, list[int], list[int]]]:  # noqa: ANN003
    """Each sequence with a target as the unpacked loader reads it, by its first input token: (id, inputs,
    targets)."""
    plain = loader(shards, B=1, pack=False, **kwargs)
    out = {}
    for s in range(plain.sequence_count):
        row = plain.read([s])
        n = T - row.padding
        assert row.positions is None
        if n:
            out[int(row.inputs[0, 0])] = (s, row.inputs[0, :n].tolist(), row.targets[0, :n].tolist())
    return out


def positions(batch: MicroBatch) -> torch.Tensor:
    assert batch.positions is not None  # packed rows always carry positions
    return batch.positions


def segments(batch: MicroBatch) -> list[list[tuple[int, int]]]:
    """Each row's segments as (start, length), checking the padding segment: only at the end, inputs PAD,
    targets -100, its positions from 0."""
    out = []
    for inputs, targets, counted in zip(batch.inputs, batch.targets, positions(batch), strict=True):
        starts = torch.nonzero(counted == 0).flatten().tolist() + [T]
        row = []
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            assert counted[a:b].tolist() == list(range(b - a))
            if int(inputs[a]) == PAD:
                assert b == T and (inputs[a:] == PAD).all() and (targets[a:] == IGNORE_INDEX).all()
            else:
                assert not (inputs[a:b] == PAD).any()
                row.append((a, b - a))
        out.append(row)
    return out


def packed_sequences(batch: MicroBatch, ref: dict) -> list[list[int]]:  # noqa: ANN001
    """The sequence ids in each row, checking that each document's inputs and targets are the unpacked ones."""
    out = []
    for r, row in enumerate(segments(batch)):
        ids = []
        for a, n in row:
            s, inputs, targets = ref[int(batch.inputs[r, a])]
            assert batch.inputs[r, a : a + n].tolist() == inputs
            assert batch.targets[r, a : a + n].tolist() == targets
            ids.append(s)
        out.append(ids)
    padding = sum(T - sum(n for _, n in row) for row in segments(batch))
    assert batch.padding == padding
    return out


def epoch_rows(source: DocumentLoader, ref: dict) -> list[list[int]]:  # noqa: ANN001
    start, rows = source.epoch, []
    while source.epoch == start:
        rows += packed_sequences(source.next_micro_batch(), ref)
    return rows


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_packed_rows_hold_the_unpacked_sequences_each_once_per_epoch(shuffle: bool, masked: bool) -> None:
    shards = documents(doc_lengths(), masked=masked)
    ref = reference(shards)
    packed = loader(shards, shuffle=shuffle, seed=5)
    plain = loader(shards, pack=False)
    rows = packed.n_sequences
    assert packed.sequence_count == plain.n_sequences == 90 + 3 + 1  # long documents: 3 and 1 more windows
    read = [r for r in epoch_rows(packed, ref) if r]
    assert len(read) == rows and packed.epoch == 1 and packed.position == 0
    seen = sorted(s for row in read for s in row)
    assert seen == sorted(s for s, _, _ in ref.values())  # every sequence with a target, once: pack-off's set
    assert len(seen) == plain.n_sequences - 3  # the three 1-token documents are left out
    assert rows < plain.n_sequences / 2  # packing saves rows


def test_packed_micro_batch_counts_padding_and_masked_targets_stay_masked() -> None:
    shards = documents(doc_lengths(), masked=True)
    packed = loader(shards, B=4)
    total_padding, trained = 0, 0
    while packed.epoch == 0:
        batch = packed.next_micro_batch()
        assert batch.positions is not None and batch.positions.dtype == torch.int64
        assert batch.padding == int((batch.inputs == PAD).sum())  # no document token is PAD
        total_padding += batch.padding
        trained += int((batch.targets != IGNORE_INDEX).sum())
    assert trained == packed.valid_targets
    rows = packed.n_sequences
    last_rows = -rows % 4  # the epoch's last micro-batch is short: whole rows of padding
    assert total_padding == (rows + last_rows) * T - sum(packed.sequence_lengths().tolist())
    padding, masked = packed.position_shares()
    assert padding == pytest.approx(1 - sum(packed.sequence_lengths().tolist()) / (rows * T))
    assert masked == pytest.approx((sum(packed.sequence_lengths().tolist()) - packed.valid_targets) / (rows * T))
    unpacked_padding, unpacked_masked = packed.position_shares(packed=False)
    plain = loader(shards, pack=False)
    assert plain.position_shares() == (unpacked_padding, unpacked_masked)
    assert unpacked_padding == pytest.approx(1 - sum(plain.sequence_lengths().tolist()) / (plain.n_sequences * T))
    assert padding < unpacked_padding and masked > unpacked_masked  # the same masked positions, fewer rows


def test_unpacked_rows_count_padding_and_have_no_positions() -> None:
    shards = documents([1, 5, T + 1, 3 * T + 6])
    plain = loader(shards, B=3, pack=False)
    batch = plain.next_micro_batch()  # sequences 0 (1 token), 1 (4 targets), 2 (T targets)
    assert batch.positions is None and batch.padding == 3 * T - (0 + 4 + T)
    assert plain.read([-1, 3]).padding == 3 * T - T  # a full window; a padding row; a missing row


def test_last_micro_batch_rows_are_padding_with_positions_from_zero() -> None:
    shards = documents([5, 6, 7, 8, 3, 4])  # 27 targets: 2 rows
    packed = loader(shards, B=4)
    assert packed.n_sequences == 2  # fewer rows than the micro-batch
    batch = packed.next_micro_batch()
    assert packed.epoch == 1
    for row in range(packed.n_sequences, 4):
        assert positions(batch)[row].tolist() == list(range(T))
        assert (batch.inputs[row] == PAD).all() and (batch.targets[row] == IGNORE_INDEX).all()


def test_windows_of_long_documents_fill_rows_of_their_own() -> None:
    shards = documents([3 * T + 6, 4, 2 * T + 1, 5, 1, 1])
    ref = reference(shards)
    read = epoch_rows(loader(shards, B=2), ref)
    full = [s for s, inputs, _ in ref.values() if len(inputs) == T]
    assert len(full) == 3 + 2
    for row in read:
        if set(row) & set(full):
            assert len(row) == 1
    # the long document's last window (5 targets) and the short documents share a row
    assert sorted(len(r) for r in read if r) == [1, 1, 1, 1, 1, 3]


def test_one_token_documents_give_no_rows() -> None:
    shards = documents([1, 1, 5, 1])
    packed = loader(shards, B=1)
    assert packed.n_sequences == 1
    batch = packed.next_micro_batch()
    assert batch.inputs[0, :4].tolist() == [3, 4, 5, 6] and positions(batch)[0].tolist()[:5] == [0, 1, 2, 3, 0]
    assert packed.epoch == 1


def test_the_run_header_words_a_count_of_one_in_the_singular() -> None:
    """One document of 5 tokens (4 targets): one row, one sequence, of one document, not "1 rows"."""
    packed, plain = loader(documents([5]), B=1), loader(documents([5]), B=1, pack=False)
    assert describe_positions(packed).startswith("packed into 1 row of 16 (--pack on): 75.0% padding, ")
    assert describe_positions(plain).startswith("1 sequence, one per row of 16 (--pack off): 75.0% padding, ")
    assert describe_long_documents(packed) == (
        "split into seq_len windows (1 sequence; 0 of 1 document longer than seq_len+1=17) | "
        "0 of 4 target tokens dropped"
    )
    one_target = loader(documents([2]), B=1)
    assert describe_long_documents(one_target).endswith("| 0 of 1 target token dropped")
    truncated = loader(documents([40]), B=1, long_documents="truncate")
    assert describe_long_documents(truncated).startswith(
        "truncate to seq_len+1 tokens (1 of 1 document longer than seq_len+1=17) | 23 of 39 target tokens dropped "
    )


def global_steps(B: int, world: int, micro_batches: int, **kwargs) -> list[tuple[torch.Tensor, ...]]:  # noqa: ANN003
    """Each global micro-batch's rows, all ranks' in rank order: (inputs, targets, positions, padding)."""
    shards = documents(doc_lengths(seed=1, count=200), masked=True, seed=1)
    ranks = [loader(shards, B=B, rank=r, world=world, **kwargs) for r in range(world)]
    out: list[tuple[torch.Tensor, ...]] = []
    for _ in range(micro_batches):
        batches = [source.next_micro_batch() for source in ranks]
        out.append(
            (
                torch.cat([b.inputs for b in batches]),
                torch.cat([b.targets for b in batches]),
                torch.cat([positions(b) for b in batches]),
                torch.tensor(sum(b.padding for b in batches)),
            )
        )
    assert len({source.epoch for source in ranks}) == 1
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_rows_do_not_depend_on_micro_batch_or_world_size(shuffle: bool) -> None:
    reference_steps = global_steps(4, 1, 40, shuffle=shuffle, seed=3)  # several epochs
    for B, world in ((1, 4), (2, 2)):
        steps = global_steps(B, world, 40, shuffle=shuffle, seed=3)
        for ours, theirs in zip(steps, reference_steps, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_shuffle_packs_a_new_complete_epoch_each_time() -> None:
    shards = documents(doc_lengths(count=200), seed=2)
    ref = reference(shards)
    packed = loader(shards, shuffle=True, seed=11)
    ordered = epoch_rows(loader(shards), ref)
    first, second = epoch_rows(packed, ref), epoch_rows(packed, ref)
    assert first != second and first != ordered
    every = sorted(s for s, _, _ in ref.values())
    for rows in (first, second, ordered):
        assert sorted(s for row in rows for s in row) == every
    again = loader(shards, shuffle=True, seed=11)
    assert epoch_rows(again, ref) == first  # deterministic


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("rank", "world", "consumed"), [(0, 1, 3), (1, 2, 5), (0, 2, 17)])
def test_resume_mid_epoch_continues_bitwise(shuffle: bool, rank: int, world: int, consumed: int) -> None:
    shards = documents(doc_lengths(seed=4, count=120), masked=True, seed=4)

    def make() -> DocumentLoader:
        return loader(shards, B=2, rank=rank, world=world, shuffle=shuffle, seed=9)

    running = make()
    for _ in range(consumed):
        running.next_micro_batch()
    state = running.state_dict()
    assert state["pack"] is True and state["pack_group"] == PACK_GROUP
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.n_sequences == running.n_sequences and resumed.sequences_left() == running.sequences_left()
    for _ in range(30):  # across epoch ends
        a, b = running.next_micro_batch(), resumed.next_micro_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert a.positions is not None and b.positions is not None
        assert torch.equal(a.positions, b.positions) and a.padding == b.padding
        assert running.epoch == resumed.epoch


def test_pack_mismatch_on_resume_is_refused_naming_the_flag() -> None:
    shards = documents(doc_lengths())
    packed, plain = loader(shards), loader(shards, pack=False)
    packed.next_micro_batch()
    plain.next_micro_batch()
    with pytest.raises(DataError, match="resume with --pack on"):
        loader(shards, pack=False).load_state_dict(packed.state_dict())
    with pytest.raises(DataError, match="resume with --pack off"):
        loader(shards).load_state_dict(plain.state_dict())
    old = plain.state_dict()
    del old["pack"]  # saved before --pack: one document per row
    again = loader(shards, pack=False)
    again.load_state_dict(old)
    assert again.position == plain.position
    with pytest.raises(DataError, match="--pack off"):
        loader(shards).load_state_dict(old)
    auto = loader(shards)  # --pack auto: a run from before packing goes on as it started, one document per row
    auto.pack_auto = True
    auto.load_state_dict(old)
    assert not auto.pack and auto.position == plain.position
    assert torch.equal(auto.next_micro_batch().inputs, plain.next_micro_batch().inputs)


def test_resume_refuses_a_row_position_outside_the_epoch() -> None:
    shards = documents(doc_lengths())
    packed = loader(shards)
    state = packed.state_dict()
    state["position"] = packed.n_sequences
    with pytest.raises(DataError, match="rows of epoch 0"):
        loader(shards).load_state_dict(state)


def test_skip_rest_of_epoch_moves_to_the_next_epochs_plan() -> None:
    shards = documents(doc_lengths(count=200), seed=3)
    ref = reference(shards)
    packed, other = loader(shards, shuffle=True, seed=1), loader(shards, shuffle=True, seed=1)
    packed.next_micro_batch()
    packed.skip_rest_of_epoch()
    assert packed.epoch == 1 and packed.position == 0
    epoch_rows(other, ref)
    assert epoch_rows(packed, ref) == epoch_rows(other, ref)


def test_truncate_packs_the_first_window_only() -> None:
    shards = documents([3 * T + 6, 4, 2 * T + 1, 5])
    packed = loader(shards, B=4, long_documents="truncate")
    assert packed.sequence_count == 4 and packed.sequence_lengths().tolist() == [T, 3, T, 4]
    batch = packed.next_micro_batch()
    assert packed.n_sequences == 3 and batch.padding == 4 * T - (2 * T + 7)
    assert packed.dropped_targets == (3 * T + 5 - T) + (2 * T - T)


def test_read_of_a_packed_loader_reads_rows_of_the_plan_and_validation_covers_every_sequence() -> None:
    shards = documents(doc_lengths(), masked=True)
    ref = reference(shards)
    one = loader(shards, B=1)
    rows = []
    while one.epoch == 0:
        rows.append(one.next_micro_batch())
    assert len(rows) == one.n_sequences
    batch = loader(shards, B=3).read([2, -1, 0])
    for slot, row in ((0, rows[2]), (2, rows[0])):
        assert torch.equal(batch.inputs[slot], row.inputs[0]) and torch.equal(batch.targets[slot], row.targets[0])
        assert batch.positions is not None and row.positions is not None
        assert torch.equal(batch.positions[slot], row.positions[0])
    assert batch.positions is not None and batch.positions[1].tolist() == list(range(T))
    assert batch.padding == rows[2].padding + T + rows[0].padding
    # sequences one per row, as unpacked, also from a packed loader
    plain = loader(shards, B=2, pack=False).read([7, 5])
    unpacked = loader(shards, B=2).read_sequences([7, 5])
    assert torch.equal(unpacked.inputs, plain.inputs) and torch.equal(unpacked.targets, plain.targets)
    # the validation sample of a packed split: rows of the plan, every sequence once over the whole split
    for world in (1, 2):
        seen = []
        for rank in range(world):
            windows = ValidationWindows(loader(shards, B=2), 2**62, 2, rank, world)
            while windows.epoch == 0:
                seen += [s for row in packed_sequences(windows.next_micro_batch(), ref) for s in row]
        assert sorted(seen) == sorted(s for s, _, _ in ref.values())


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_document_part_says_where_its_tokens_are_and_which_window_it_is(pack: bool, shuffle: bool) -> None:
    """What following a bad document needs (``MicroBatch.parts``): over an epoch, one row and one packed row alike,
    each part's positions hold its document's window as the shard has it, and every window of every document with a
    target is read once."""
    shards = documents(doc_lengths())
    docs = loader(shards, B=3, pack=pack, shuffle=shuffle, seed=5)
    seen: dict[tuple[int, int], list[int]] = {}
    while True:
        batch = docs.next_micro_batch()
        for part in batch.parts:
            start = part.start + part.window * T
            tokens = shards[part.shard].tokens[start : start + part.length + 1].tolist()
            columns = slice(part.column, part.column + part.length)
            assert batch.inputs[part.row, columns].tolist() == tokens[:-1]
            assert batch.targets[part.row, columns].tolist() == tokens[1:]
            assert part.key == f"doc:{part.shard}@{part.start}"
            seen.setdefault((part.shard, part.start), []).append(part.window)
            offsets = np.asarray(shards[part.shard].offsets)
            end = int(offsets[np.searchsorted(offsets, part.start, side="right")])
            assert part.windows == -(-(end - part.start - 1) // T)
        if docs.epoch == 1:
            break
    lengths = [n for n in doc_lengths() if n > 1]
    assert sorted(len(w) for w in seen.values()) == sorted(-(-(n - 1) // T) for n in lengths)
    assert all(sorted(windows) == list(range(len(windows))) for windows in seen.values())
