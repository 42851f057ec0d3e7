"""Replay's digest and its verdicts: which rank a differing re-run points at."""

from __future__ import annotations

import torch

from bigbatch.engine.bad_steps import REPLAY_MISMATCH
from bigbatch.engine.replay import compare, digest


def test_the_digest_sees_one_flipped_bit_and_the_shape() -> None:
    grads = [torch.linspace(-1, 1, 12), torch.ones(3, 4)]
    flipped = [g.clone() for g in grads]
    flipped[1].view(-1)[5:6].view(torch.int32).bitwise_xor_(1 << 3)  # a low mantissa bit: a tiny change in value
    assert digest(grads) == digest([g.clone() for g in grads])
    assert digest(grads) != digest(flipped)
    assert digest([torch.ones(12)]) != digest([torch.ones(3, 4)])
    assert digest([None]) != digest([torch.zeros(0)])


def test_consistent_ranks_raise_nothing() -> None:
    assert compare([(2, "a", "a", "a")], 1) == []
    assert compare([(0, "a", "a", "a"), (3, "b", "b", "b")], 2) == []


def test_a_rank_that_differs_from_its_own_re_run_is_named_transient() -> None:
    (suspect,) = compare([(1, "bad", "good", "good")], 1)
    assert (suspect.rank, suspect.micro, suspect.cause, suspect.verdict) == (0, 1, REPLAY_MISMATCH, "transient")
    # rank 1's first run is wrong: its re-run and rank 0's re-run of it agree with each other
    (suspect,) = compare([(0, "a", "a", "a"), (2, "bad", "b", "b")], 2)
    assert (suspect.rank, suspect.micro, suspect.verdict) == (1, 2, "transient")


def test_a_faulty_peer_explains_the_difference_it_made() -> None:
    """Rank 1 computes wrongly every time (its own re-run differs too, at another element): rank 1 is named, rank 0
    (whose micro-batch rank 1 computed differently) is not."""
    rows = [(0, "a", "a", "a-by-1"), (1, "b-1", "b-2", "b")]
    assert [(s.rank, s.verdict) for s in compare(rows, 2)] == [(1, "transient")]


def test_two_ranks_each_consistent_that_disagree_are_both_named() -> None:
    """A fault each rank repeats the same way cannot be told from the other rank's: both are suspects."""
    rows = [(0, "a", "a", "a'"), (1, "b", "b", "b'")]
    assert [(s.rank, s.verdict) for s in compare(rows, 2)] == [
        (0, "reproduced on its rank"),
        (1, "reproduced on its rank"),
    ]
