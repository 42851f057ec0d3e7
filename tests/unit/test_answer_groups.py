"""The loader of answers: whole groups per micro-batch (never split across micro-batches or ranks), answers and
their segments exactly where the objective reads them, packed and unpacked alike, and a resumed run bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.answers import ROLE_CHOSEN, ROLE_DESIRABLE, ROLE_KL, ROLE_REJECTED, ROLE_UNDESIRABLE
from bigbatch.data.shards import DocumentShard
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch, StepPolicy, read_step
from bigbatch.errors import DataError
from bigbatch.parallel.distributed import DistContext

Doc = tuple[list[int], int, int]
"""A document: its tokens, how many of them are prompt (masked), its role."""


def shard(docs: list[Doc]) -> DocumentShard:
    tokens = np.concatenate([np.asarray(t, dtype=np.uint16) for t, _, _ in docs])
    masks = []
    for t, prompt, _ in docs:
        mask = np.ones(len(t), dtype=np.uint8)
        mask[:prompt] = 0
        masks.append(mask)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t, _, _ in docs])]).astype(np.int64)
    roles = np.asarray([role for _, _, role in docs], dtype=np.int8)
    return DocumentShard(tokens, offsets, np.concatenate(masks), roles)


def random_pairs(n: int, seed: int = 0, longest: int = 12) -> list[Doc]:
    """``n`` pairs of random lengths (a prompt of 1..4 tokens, answers of 1..``longest - 4``), tokens unique per
    document so that a document can be told by its tokens."""
    generator = np.random.default_rng(seed)
    docs: list[Doc] = []
    for g in range(n):
        prompt = int(generator.integers(1, 5))
        for role in (ROLE_CHOSEN, ROLE_REJECTED):
            length = prompt + int(generator.integers(1, longest - 3))
            base = 1000 + 40 * (2 * g + role)
            docs.append((list(range(base, base + length)), prompt, role))
    return docs


def epoch(loader: AnswerGroupLoader) -> list[MicroBatch]:
    """One epoch of this rank's micro-batches."""
    batches = [loader.next_micro_batch()]
    while loader.position != 0:
        batches.append(loader.next_micro_batch())
    return batches


def test_a_hand_checked_packed_micro_batch() -> None:
    """Two pairs, B = 2 rows of T = 8: first fit puts group 1's chosen answer in row 1, its rejected one after
    group 0 in row 0. A target at t is the token at t + 1; its segment is the answer whose log-probability it is."""
    docs: list[Doc] = [
        ([10, 11, 12, 13], 2, ROLE_CHOSEN),  # prompt 10 11, answer 12 13
        ([10, 11, 14], 2, ROLE_REJECTED),  # answer 14
        ([20, 21, 22, 23, 24], 1, ROLE_CHOSEN),
        ([20, 25], 1, ROLE_REJECTED),
    ]
    loader = AnswerGroupLoader([shard(docs)], micro_batch=2, seq_len=8, pad_token=0, pack=True)
    batch = loader.next_micro_batch()
    assert batch.answers is not None
    x = IGNORE_INDEX
    assert batch.inputs.tolist() == [[10, 11, 12, 10, 11, 20, 0, 0], [20, 21, 22, 23, 0, 0, 0, 0]]
    assert batch.targets.tolist() == [[x, 12, 13, x, 14, 25, x, x], [21, 22, 23, 24, x, x, x, x]]
    assert batch.answers.segment.tolist() == [[-1, 0, 0, -1, 1, 3, -1, -1], [2, 2, 2, 2, -1, -1, -1, -1]]
    assert batch.positions is not None
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch.answers.group.tolist() == [0, 0, 1, 1]
    assert batch.answers.role.tolist() == [ROLE_CHOSEN, ROLE_REJECTED, ROLE_CHOSEN, ROLE_REJECTED]
    assert batch.padding == 16 - 10
    assert batch.origin == ((0, 0), (0, 4), (0, 7), (0, 12))
    assert [(p.row, p.column, p.length) for p in batch.parts] == [(0, 0, 3), (0, 3, 2), (1, 0, 4), (0, 5, 1)]
    assert loader.epoch == 1  # one micro-batch was the whole epoch


def test_unpacked_a_document_per_row_and_an_odd_micro_batch_pads_its_last_row() -> None:
    docs = random_pairs(3)
    loader = AnswerGroupLoader([shard(docs)], micro_batch=3, seq_len=16, pack=False)
    batches = epoch(loader)
    assert len(batches) == 3  # one pair per micro-batch of 3 rows
    for batch in batches:
        assert batch.positions is None
        assert batch.answers is not None and batch.answers.group.tolist() == [0, 0]
        assert (batch.targets[2] == IGNORE_INDEX).all() and batch.answers.segment[2].eq(-1).all()
    with pytest.raises(DataError, match="--micro-batch 1 with --pack off .* use --micro-batch 2 or more"):
        AnswerGroupLoader([shard(docs)], micro_batch=1, seq_len=16, pack=False)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_groups_are_never_split_and_ranks_read_disjoint_groups_in_one_global_order(pack: bool, shuffle: bool) -> None:
    docs = random_pairs(23, seed=1)
    shards = [shard(docs[:20]), shard(docs[20:])]  # groups across shards too

    def read(world: int) -> list[list[MicroBatch]]:
        loaders = [AnswerGroupLoader(shards, 3, 16, r, world, pack=pack, shuffle=shuffle, seed=5) for r in range(world)]
        return [epoch(loader) for loader in loaders]

    one = read(1)[0]
    two = read(2)
    assert len(two[0]) == len(two[1])  # every rank reads as many micro-batches
    interleaved = [b for pair in zip(*two, strict=True) for b in pair]
    units = [b.origin for b in interleaved if b.origin]
    assert units == [b.origin for b in one]  # the same micro-batches in the same order, dealt to the ranks
    seen: list[tuple[int, int]] = []
    for batch in interleaved:
        assert batch.answers is not None
        groups = batch.answers.group.tolist()
        assert all(groups.count(g) == 2 for g in set(groups))  # both answers of each of its groups
        for first, second in zip(batch.origin[::2], batch.origin[1::2], strict=True):
            assert batch.answers.role.tolist()[0::2] == [ROLE_CHOSEN] * len(groups[0::2])
            document = shards[first[0]].offsets.tolist().index(first[1])
            assert (second[0], second[1]) == (first[0], int(shards[first[0]].offsets[document + 1]))
        seen.extend(batch.origin)
    assert sorted(seen) == sorted({(s, int(o)) for s, sh in enumerate(shards) for o in sh.offsets[:-1]})


def answer_spans(batches: list[MicroBatch]) -> list[tuple[tuple[int, int], list[int], list[int], list[int]]]:
    """Each answer read: its document, its inputs, its targets and its segment marks (True where trained)."""
    spans = []
    for batch in batches:
        assert batch.answers is not None
        for answer, (origin, part) in enumerate(zip(batch.origin, batch.parts, strict=True)):
            cut = slice(part.column, part.column + part.length)
            segment = batch.answers.segment[part.row, cut]
            assert set(segment.tolist()) <= {answer, -1}
            targets = batch.targets[part.row, cut]
            assert torch.equal(segment == answer, targets != IGNORE_INDEX)
            spans.append((origin, batch.inputs[part.row, cut].tolist(), targets.tolist(), (segment >= 0).tolist()))
    return sorted(spans)


def test_packed_and_unpacked_hold_the_same_answers() -> None:
    shards = [shard(random_pairs(17, seed=2))]
    packed = answer_spans(epoch(AnswerGroupLoader(shards, 4, 16, pack=True)))
    unpacked = answer_spans(epoch(AnswerGroupLoader(shards, 4, 16, pack=False)))
    assert packed == unpacked
    assert len(packed) == 34


def test_the_empty_micro_batch_of_a_rank_past_the_end_holds_no_answer() -> None:
    shards = [shard(random_pairs(3))]
    last = [epoch(AnswerGroupLoader(shards, 2, 16, rank, 2))[-1] for rank in range(2)]
    assert last[0].answers is not None and last[0].answers.count == 2
    assert last[1].answers is not None and last[1].answers.count == 0
    assert (last[1].targets == IGNORE_INDEX).all() and last[1].padding == 2 * 16 and last[1].origin == ()


def test_a_resumed_loader_continues_bitwise() -> None:
    shards = [shard(random_pairs(19, seed=3))]
    running = AnswerGroupLoader(shards, 3, 16, rank=1, world_size=2, shuffle=True, seed=7, pack=True)
    for _ in range(3):
        running.next_micro_batch()
    state = running.state_dict()
    expected = [running.next_micro_batch() for _ in range(8)]  # across the epoch's end
    resumed = AnswerGroupLoader(shards, 3, 16, rank=1, world_size=2, shuffle=True, seed=7, pack=True)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_micro_batch() for _ in range(8)), strict=True):
        assert want.answers is not None and got.answers is not None
        assert want.positions is not None and got.positions is not None
        for a, b in [
            (want.inputs, got.inputs),
            (want.targets, got.targets),
            (want.positions, got.positions),
            (want.answers.segment, got.answers.segment),
            (want.answers.group, got.answers.group),
            (want.answers.role, got.answers.role),
        ]:
            assert torch.equal(a, b)
        assert (want.origin, want.epoch, want.parts) == (got.origin, got.epoch, got.parts)
    assert expected[-1].epoch > expected[0].epoch
    other = AnswerGroupLoader(shards, 4, 16, rank=1, world_size=2, shuffle=True, seed=7, pack=True)
    with pytest.raises(DataError, match="resume with --micro-batch 3 --seq-len 16"):
        other.load_state_dict(state)


def test_steps_of_k_micro_batches_and_a_partial_last_window() -> None:
    """The step assembler counts rows: 7 pairs, 1 pair per micro-batch of 2 rows, K = 3: steps of 3, 3, 1."""
    loader = AnswerGroupLoader([shard(random_pairs(7))], 2, 16)
    policy, dist, device = StepPolicy(k=3), DistContext(), torch.device("cpu")
    ks = [read_step(loader, policy, dist, device).k for _ in range(3)]
    assert ks == [3, 3, 1] and loader.epoch == 1


def kto_docs() -> list[Doc]:
    return [
        ([1, 2, 3, 4], 2, ROLE_DESIRABLE),
        ([1, 2, 7, 8, 9, 10, 11, 12], 2, ROLE_KL),  # 7 positions: longer than a row of T = 4
        ([5, 6, 7], 2, ROLE_UNDESIRABLE),
        ([5, 6, 3, 4], 2, ROLE_KL),
    ]


def test_a_kl_document_longer_than_a_row_is_cut_to_it_and_others_are_refused() -> None:
    loader = AnswerGroupLoader([shard(kto_docs())], 2, 4, pack=False, answers="kto")
    assert loader.cut_kl_documents == 1
    batch = loader.next_micro_batch()
    assert batch.answers is not None
    assert batch.answers.role.tolist() == [ROLE_DESIRABLE, ROLE_KL]
    assert batch.inputs[1].tolist() == [1, 2, 7, 8] and batch.targets[1].tolist() == [IGNORE_INDEX, 7, 8, 9]
    assert loader.valid_targets == 2 + 3 + 1 + 2
    long_answer = [([1, 2, 3, 4, 5, 6, 7], 2, ROLE_DESIRABLE), ([1, 2, 3], 2, ROLE_KL)]
    with pytest.raises(DataError, match=r"1 group of the train split has a document longer than seq_len\+1=5"):
        AnswerGroupLoader([shard(long_answer)], 2, 4, answers="kto")
    with pytest.raises(DataError, match="has role 2, where a pairs group holds chosen"):
        AnswerGroupLoader([shard(kto_docs())], 2, 4)
