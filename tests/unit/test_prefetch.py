"""The read-ahead loader: same micro-batches in the same order, and the position after those taken."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.prefetch import PrefetchLoader
from bigbatch.data.shards import DocumentShard
from bigbatch.data.stream import TokenStreamLoader
from bigbatch.engine.batch import StepPolicy, read_step
from bigbatch.parallel.distributed import DistContext


def packed(n_tokens: int = 200, B: int = 2, T: int = 8) -> TokenStreamLoader:
    rng = np.random.default_rng(0)
    return TokenStreamLoader([rng.integers(0, 50, n_tokens), rng.integers(0, 50, n_tokens // 2)], B, T)


def documents(B: int = 2, T: int = 6) -> DocumentLoader:
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 15, 23)
    tokens = rng.integers(0, 50, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return DocumentLoader([DocumentShard(tokens, offsets, None)], B, T)


def wait_until_full(loader: PrefetchLoader) -> None:
    """Until the thread has read ``depth`` micro-batches ahead (so the wrapped loader is ahead of the consumer)."""
    deadline = time.monotonic() + 10
    while loader._queue is None or loader._queue.qsize() < loader.depth:
        assert time.monotonic() < deadline, "the prefetch thread never filled its queue"
        time.sleep(0.005)


@pytest.mark.parametrize("make", [packed, documents])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_same_micro_batches_epochs_and_positions_as_the_loader(make, depth: int) -> None:
    plain, ahead = make(), PrefetchLoader(make(), depth)
    try:
        for _ in range(40):  # several epochs of both
            a, b = plain.next_micro_batch(), ahead.next_micro_batch()
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
            if depth:
                wait_until_full(ahead)
            assert ahead.epoch == plain.epoch
            assert ahead.sequences_left() == plain.sequences_left()
            assert ahead.state_dict() == plain.state_dict()
        assert plain.epoch >= 2
    finally:
        ahead.close()


def test_the_saved_state_is_after_the_taken_micro_batches_not_the_read_ahead() -> None:
    ahead = PrefetchLoader(packed(), depth=4)
    for _ in range(3):
        ahead.next_micro_batch()
    wait_until_full(ahead)
    saved = ahead.state_dict()
    assert ahead.loader.state_dict() != saved  # the wrapped loader really is ahead
    reference = packed()
    for _ in range(3):
        reference.next_micro_batch()
    assert saved == reference.state_dict()
    resumed = packed()
    resumed.load_state_dict(saved)  # the next micro-batch after a resume is the 4th
    fourth = ahead.next_micro_batch()
    assert torch.equal(resumed.next_micro_batch().inputs, fourth.inputs)
    wait_until_full(ahead)
    ahead.close()
    reference.next_micro_batch()
    assert ahead.loader.state_dict() == reference.state_dict()  # close rewinds to the taken position


def test_load_state_dict_and_skip_rest_of_epoch_drop_what_was_read_ahead() -> None:
    plain, ahead = documents(), PrefetchLoader(documents(), depth=3)
    start = plain.state_dict()
    for _ in range(4):
        plain.next_micro_batch()
    middle = plain.state_dict()
    for _ in range(2):
        ahead.next_micro_batch()
    wait_until_full(ahead)
    ahead.load_state_dict(middle)
    assert ahead.state_dict() == middle
    assert torch.equal(ahead.next_micro_batch().inputs, plain.next_micro_batch().inputs)
    wait_until_full(ahead)
    ahead.skip_rest_of_epoch()
    plain.skip_rest_of_epoch()
    assert ahead.epoch == plain.epoch == 1 and ahead.state_dict() == plain.state_dict()
    assert torch.equal(ahead.next_micro_batch().inputs, plain.next_micro_batch().inputs)
    ahead.reset()
    assert ahead.state_dict() == start
    ahead.close()


def test_steps_assembled_from_the_read_ahead_loader_are_the_loaders() -> None:
    """read_step's epoch-dependent decisions (the last window of a document epoch) see the taken position."""
    policy, dist, cpu = StepPolicy(k=3, last_window="drop"), DistContext(), torch.device("cpu")
    plain, ahead = documents(), PrefetchLoader(documents(), depth=3)
    for _ in range(30):
        a, b = read_step(plain, policy, dist, cpu), read_step(ahead, policy, dist, cpu)
        assert a.n_valid == b.n_valid and len(a.micro_batches) == len(b.micro_batches)
        for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
            assert torch.equal(x.targets, y.targets)
        assert ahead.epoch == plain.epoch
    assert plain.epoch >= 2
    ahead.close()


def test_a_reading_error_reaches_the_consumer_in_order() -> None:
    class Failing(TokenStreamLoader):
        reads = 0

        def next_micro_batch(self):  # type: ignore[no-untyped-def]
            self.reads += 1
            if self.reads == 3:
                raise OSError("disk gone")
            return super().next_micro_batch()

    ahead = PrefetchLoader(Failing([np.arange(500) % 50], 2, 8), depth=4)
    ahead.next_micro_batch()
    ahead.next_micro_batch()
    with pytest.raises(OSError, match="disk gone"):
        ahead.next_micro_batch()


def test_reading_overlaps_the_consumer() -> None:
    """With a reader that takes 30 ms a micro-batch and a consumer that computes 30 ms, a step costs ~30 ms."""

    class Slow(TokenStreamLoader):
        def next_micro_batch(self):  # type: ignore[no-untyped-def]
            time.sleep(0.03)
            return super().next_micro_batch()

    def run(depth: int) -> float:
        loader = PrefetchLoader(Slow([np.arange(5000) % 50], 2, 8), depth)
        loader.next_micro_batch()
        started = time.perf_counter()
        for _ in range(8):
            loader.next_micro_batch()
            time.sleep(0.03)  # the step's compute (sleeping releases the GIL, as torch's kernels do)
        loader.close()
        return time.perf_counter() - started

    serial, overlapped = run(0), run(2)
    assert serial > 8 * 0.055
    assert overlapped < 0.8 * serial  # ideally half
