"""The shuffled packed order of a run planned for more than one pass: its passes, up to four, mixed in one
permutation (:func:`~bigbatch.data.windows.passes_per_order`, :class:`~bigbatch.data.windows.ShuffledWindowOrder`),
the order of a run of one pass or less unchanged, and both resumable bitwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bigbatch import checkpoint as ckpt
from bigbatch.config import TrainConfig
from bigbatch.data.loader import ShuffledPackedLoader
from bigbatch.data.windows import (
    MAX_ORDER_ITEMS,
    MAX_PASSES_PER_ORDER,
    ShuffledWindowOrder,
    epoch_order,
    epoch_shift,
    passes_per_order,
    pooled_order,
)
from bigbatch.trainer import Trainer

T = 5
N = 40 + 23  # windows of T tokens in shards()
POOLED = 2 * N  # planned_windows giving two passes per order: blocks of 126 rows


def shards() -> list[np.ndarray]:
    """Two shards whose token values reveal their positions (and shard): 40 + 23 windows of T tokens."""
    return [np.arange(0, 203, dtype=np.uint16), np.arange(10_000, 10_118, dtype=np.uint16)]


def rows(batch) -> list[tuple[int, ...]]:  # noqa: ANN001
    return [tuple(r) for r in batch.inputs.tolist()]


def test_passes_per_order() -> None:
    assert MAX_PASSES_PER_ORDER == 4
    # one pass or less, or nothing planned (0: unknown): a new order every pass
    assert [passes_per_order(planned, 10) for planned in (0, 1, 9, 10)] == [1, 1, 1, 1]
    assert passes_per_order(100, 0) == 1  # no window at all
    # more: the passes the run reads, rounded up, at most four
    assert [passes_per_order(planned, 10) for planned in (11, 20, 21, 30, 31, 40)] == [2, 2, 3, 3, 4, 4]
    assert [passes_per_order(planned, 10) for planned in (41, 1000, 10**12)] == [4, 4, 4]
    # and one order holds at most MAX_ORDER_ITEMS items: fewer passes for a split of many windows
    assert MAX_ORDER_ITEMS == 2**25
    quarter = MAX_ORDER_ITEMS // 4
    assert passes_per_order(10**12, quarter) == 4  # exactly at the cap
    assert passes_per_order(10**12, quarter + 1) == 3
    assert passes_per_order(10**12, MAX_ORDER_ITEMS // 2 + 1) == 1  # two passes would not fit
    assert passes_per_order(10**12, MAX_ORDER_ITEMS // 2) == 2
    assert passes_per_order(10**12, MAX_ORDER_ITEMS + 5) == 1


def test_one_pass_per_order_is_bitwise_the_order_of_each_epoch() -> None:
    """P == 1: row q reads window epoch_order(n, seed, e)[q % n] moved epoch_shift(T, seed, e), e = q // n (the order
    every shuffled run had before passes were pooled, so a run of one pass or less reads what it always read)."""
    n, seq_len, seed = 17, 9, 123
    order = ShuffledWindowOrder(n, seq_len, seed, 1)
    q = np.arange(5 * n + 3, dtype=np.int64)
    windows, shifts = order.at(q)
    expected = [int(epoch_order(n, seed, int(r) // n)[int(r) % n]) for r in q]
    assert windows.tolist() == expected
    assert shifts.tolist() == [epoch_shift(seq_len, seed, int(r) // n) for r in q]
    assert np.array_equal(pooled_order(n, seed, 3, 1), epoch_order(n, seed, 3))
    # and so does the loader of a run planned for at most one pass, micro-batch after micro-batch
    unknown = ShuffledPackedLoader(shards(), 4, T, seed=8)  # planned_windows 0: unknown
    planned = [ShuffledPackedLoader(shards(), 4, T, seed=8, planned_windows=p) for p in (N // 2, N)]
    assert unknown.order.passes == 1 and all(loader.order.passes == 1 for loader in planned)
    windows = unknown.windows
    for m in range(40):  # 160 rows: into epoch 2
        q = 4 * m + np.arange(4)
        epochs = q // N
        expected = windows.read(
            [int(epoch_order(N, 8, int(e))[int(r) % N]) for r, e in zip(q, epochs, strict=True)],
            shifts=np.array([epoch_shift(T, 8, int(e)) for e in epochs]),
        )
        for loader in (unknown, *planned):
            assert torch.equal(loader.next_micro_batch().inputs, expected.inputs)


@pytest.mark.parametrize("passes", [2, 3])
def test_pooled_passes_read_every_window_once_per_pass_and_mix(passes: int) -> None:
    n, seq_len, seed = 50, 1000, 4  # T large: every pass's shift is its own, so a read's shift names its pass
    order = ShuffledWindowOrder(n, seq_len, seed, passes)
    for block in range(2):
        first_pass = block * passes
        pass_shifts = [epoch_shift(seq_len, seed, first_pass + p) for p in range(passes)]
        assert len(set(pass_shifts)) == passes  # the precondition of reading passes off the shifts
        q = block * passes * n + np.arange(passes * n, dtype=np.int64)
        windows, shifts = order.at(q)
        assert set(shifts.tolist()) == set(pass_shifts)  # only this block's passes, each at its own shift
        where = {}
        for p, moved in enumerate(pass_shifts):
            mine = shifts == moved
            assert sorted(windows[mine].tolist()) == list(range(n)), (block, p)  # every window once per pass
            where[p] = np.flatnonzero(mine)
        # mixed: every later pass begins before the previous one ends, well before (not passes one after another)
        for p in range(1, passes):
            assert where[p].min() < where[p - 1].max() - n // 2
        # the motivating property: the block's first pass-length of rows already holds repeats (later passes)
        first_rows = shifts[:n]
        assert 0 < int((first_rows != pass_shifts[0]).sum()) < n
    # blocks are drawn apart from each other, and apart from the one-pass orders
    assert not np.array_equal(pooled_order(n, seed, 0, passes), pooled_order(n, seed, 1, passes))
    assert sorted(pooled_order(n, seed, 0, passes).tolist()) == list(range(passes * n))


def step_rows(micro_batch: int, world: int, steps: int, rows_per_step: int = 4, seed: int = 7) -> list[list[tuple]]:
    """The rows (inputs) of each global step, in stream order: micro-batch by micro-batch, rank by rank."""
    ranks = [
        ShuffledPackedLoader(shards(), micro_batch, T, rank=r, world_size=world, seed=seed, planned_windows=POOLED)
        for r in range(world)
    ]
    assert all(loader.order.passes == 2 for loader in ranks)
    k = rows_per_step // (micro_batch * world)
    out = []
    for _ in range(steps):
        step: list[tuple] = []
        for _ in range(k):
            for loader in ranks:
                step += rows(loader.next_micro_batch())
        out.append(step)
    return out


def test_pooled_steps_do_not_depend_on_micro_batch_or_world_size() -> None:
    # 4 rows per step, blocks of 126 rows: step 31 (rows 124-127) straddles the border of blocks 0 and 1
    reference = step_rows(4, 1, steps=40)
    assert step_rows(2, 2, steps=40) == reference
    assert step_rows(1, 4, steps=40) == reference
    assert step_rows(2, 1, steps=40) == reference  # K = 2
    assert step_rows(1, 2, steps=40) == reference  # K = 2 on two ranks
    assert step_rows(4, 1, steps=40, seed=8) != reference
    # ... and the pooled order is not the one-pass one
    unpooled = ShuffledPackedLoader(shards(), 4, T, seed=7)
    assert [rows(unpooled.next_micro_batch()) for _ in range(40)] != reference


@pytest.mark.parametrize("consumed", [0, 5, 31, 40])  # micro-batches of 3 rows: 31 ends at row 93, 40 past 126
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
@pytest.mark.parametrize("planned_then", [POOLED, 0, 10 * N])
def test_resume_mid_block_is_bitwise(consumed: int, rank: int, world: int, planned_then: int) -> None:
    """A loader resumed from a state reads what the uninterrupted one reads, even when the resuming run plans
    another number of windows (``planned_then``): the order is the one the run was started with."""
    original = ShuffledPackedLoader(shards(), 3, T, rank=rank, world_size=world, seed=11, planned_windows=POOLED)
    for _ in range(consumed):
        original.next_micro_batch()
    state = original.state_dict()
    assert state["passes_per_order"] == 2
    fresh = ShuffledPackedLoader(shards(), 3, T, rank=rank, world_size=world, seed=11, planned_windows=planned_then)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh.order.passes == 2
    for _ in range(60):  # across block borders
        a, b = original.next_micro_batch(), fresh.next_micro_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert original.epoch == fresh.epoch


def test_resume_mid_block_under_another_micro_batch_and_world() -> None:
    one = ShuffledPackedLoader(shards(), 4, T, seed=5, planned_windows=POOLED)
    for _ in range(30):  # 120 rows: 6 before the border of blocks 0 and 1
        one.next_micro_batch()
    state = one.state_dict()
    for micro_batch, world in [(2, 2), (1, 4)]:
        ranks = [ShuffledPackedLoader(shards(), micro_batch, T, rank=r, world_size=world, seed=5) for r in range(world)]
        for loader in ranks:
            loader.load_state_dict(state)
            assert loader.order.passes == 2
        follower = ShuffledPackedLoader(shards(), 4, T, seed=5, planned_windows=POOLED)
        follower.load_state_dict(state)
        for _ in range(10):
            assert rows(follower.next_micro_batch()) == [
                row for loader in ranks for row in rows(loader.next_micro_batch())
            ]


def test_a_state_saved_before_pooling_resumes_with_one_order_per_pass() -> None:
    """A checkpoint from before orders spanned several passes has no ``passes_per_order``: it continues in one
    order per pass, as it started, even when this run is planned for several passes."""
    old = ShuffledPackedLoader(shards(), 3, T, seed=2)  # the order such a run read: one per pass
    for _ in range(30):
        old.next_micro_batch()
    state = old.state_dict()
    del state["passes_per_order"]
    new = ShuffledPackedLoader(shards(), 3, T, seed=2, planned_windows=10 * N)
    assert new.order.passes == 4
    new.load_state_dict(state)
    assert new.order.passes == 1 and new.state_dict()["passes_per_order"] == 1
    for _ in range(50):  # across epoch ends
        assert torch.equal(old.next_micro_batch().inputs, new.next_micro_batch().inputs)


# ---- through the Trainer -------------------------------------------------------------------------------------

STEPS = 12  # 4 windows per step, 10 windows: 48 rows planned -> 4 passes per order (blocks of 40 rows) and so for 24


def make_config(corpus: Path, out: Path, max_steps: int, total_steps: int = 2 * STEPS) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(corpus)
    config.data.tokenizer = "byte"
    config.data.val_fraction = 0.0
    config.data.cache_dir = str(corpus.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 16, 64  # K = 2
    config.optim.warmup_steps, config.optim.decay_steps = 2, total_steps  # the same schedule for 12 steps and 24
    config.run.max_steps = max_steps
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    config.run.noise_scale_every = 0
    config.run.out = str(out)
    return config


@pytest.mark.usefixtures("isolated")
def test_a_pooled_run_resumed_mid_block_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    """Train 12 steps, save, resume to 24: bitwise the 24 steps trained straight (96 rows: blocks 0, 1 and part of
    2; the resume at row 48, mid block 1). The passes per order are fixed at the start of a run (a resumed run
    keeps its checkpoint's), so both lengths are chosen to pool the cap of four passes."""
    corpus = tmp_path / "text.txt"
    corpus.write_bytes(bytes(range(33, 33 + 80)) * 2 + b"!")  # 161 byte tokens: 10 windows of 16
    golden = Trainer(make_config(corpus, tmp_path / "golden", 2 * STEPS))
    loader = golden.parts.train_loader
    assert isinstance(loader, ShuffledPackedLoader)
    assert loader.windows.count == 10 and loader.order.passes == 4  # build.py: 24 x 64 // 16 = 96 rows planned
    golden.train()

    first = Trainer(make_config(corpus, tmp_path / "resumed", STEPS))
    assert first.parts.train_loader.order.passes == 4  # 12 x 64 // 16 = 48 rows planned: 4.8 passes, capped
    first.train()
    saved = ckpt.load_checkpoint(tmp_path / "resumed")
    assert saved["engine"]["step_count"] == STEPS
    assert saved["loader"]["row"] == 48 and saved["loader"]["passes_per_order"] == 4

    resumed = Trainer(make_config(corpus, tmp_path / "resumed", 2 * STEPS))
    assert resumed.resumed_from is not None
    resumed.train()
    for (name, a), b in zip(golden.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.train_loader.state_dict() == golden.train_loader.state_dict()
    # build.py plans max_steps x tokens per step // T rows: 3 steps -> 12 rows -> 2 passes per order
    assert Trainer(make_config(corpus, tmp_path / "short", 3)).parts.train_loader.order.passes == 2
