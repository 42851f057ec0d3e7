"""Shuffled training order (``--shuffle``, on by default): packed windows in a seeded permutation per epoch whose
global steps do not depend on the micro-batch or the number of processes; documents' sequences permuted per
epoch; resumable bitwise; ``--shuffle off`` is the order of the data."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import pytest
import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.shards import DocumentShard
from bigbatch.data.stream import ShuffledTokenStreamLoader, TokenStreamLoader
from bigbatch.data.windows import TokenStreamWindows, epoch_order, epoch_shift
from bigbatch.errors import ConfigError, DataError
from bigbatch.run.configuration.config_sources import add_config_arguments, apply_mapping, config_from_args
from bigbatch.run.configuration.identity import settings_diff
from bigbatch.run.configuration.train_config import TrainConfig

T = 5


def shards() -> list[np.ndarray]:
    """Two shards whose token values reveal their positions (and shard): 40 + 23 windows of T tokens."""
    return [np.arange(0, 203, dtype=np.uint16), np.arange(10_000, 10_118, dtype=np.uint16)]


def rows(batch) -> list[tuple[int, ...]]:  # noqa: ANN001
    return [tuple(r) for r in batch.inputs.tolist()]


def step_windows(micro_batch: int, world: int, k: int, steps: int, seed: int = 7) -> list[list[tuple[int, ...]]]:
    """The windows (as input rows) of each global step: K micro-batches from every rank."""
    ranks = [
        ShuffledTokenStreamLoader(shards(), micro_batch, T, rank=r, world_size=world, seed=seed) for r in range(world)
    ]
    out = []
    for _ in range(steps):
        step: list[tuple[int, ...]] = []
        for _ in range(k):
            for loader in ranks:
                step += rows(loader.next_micro_batch())
        out.append(sorted(step))
    return out


def test_windows_of_a_global_step_do_not_depend_on_micro_batch_or_world_size() -> None:
    # 8 windows per step, 63 windows per epoch: 40 steps cross several epoch ends mid-step
    reference = step_windows(micro_batch=8, world=1, k=1, steps=40)
    assert step_windows(micro_batch=4, world=2, k=1, steps=40) == reference  # world 1 vs 2
    assert step_windows(micro_batch=2, world=1, k=4, steps=40) == reference  # micro-batch 2 vs 8
    assert step_windows(micro_batch=2, world=2, k=2, steps=40) == reference
    assert step_windows(micro_batch=4, world=1, k=2, steps=40) == reference  # micro-batch 2 vs 4
    assert step_windows(micro_batch=8, world=1, k=1, steps=40, seed=8) != reference  # but the seed matters


def test_each_epoch_reads_every_window_once_in_a_new_order() -> None:
    loader = ShuffledTokenStreamLoader(shards(), micro_batch=1, seq_len=T, seed=3)
    n = TokenStreamWindows(shards(), T).count
    assert n == 40 + 23
    epochs = []
    for _ in range(3):
        assert loader.epoch == len(epochs)
        epochs.append([rows(loader.next_micro_batch())[0] for _ in range(n)])
    windows = TokenStreamWindows(shards(), T)
    for epoch, read in enumerate(epochs):
        shift = epoch_shift(T, 3, epoch)  # every window of a later epoch moved by the same seeded shift
        assert (shift == 0) == (epoch == 0) and 0 <= shift < T
        every = sorted(rows(windows.read(list(range(n)), shifts=np.full(n, shift))))
        assert sorted(read) == every  # a permutation: each (moved) window once
        assert Counter(read).most_common(1)[0][1] == 1
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])  # not the order of the data
    # a repeated epoch reads new windows, not the first epoch's again (only a shard's last window may stay put)
    assert len(set(epochs[0]) & set(epochs[1])) <= 2
    # the permutation depends on the seed and the epoch only
    assert np.array_equal(epoch_order(n, 3, 1), epoch_order(n, 3, 1))
    assert not np.array_equal(epoch_order(n, 3, 1), epoch_order(n, 4, 1))


def test_targets_are_the_inputs_shifted_within_each_window() -> None:
    batch = ShuffledTokenStreamLoader(shards(), micro_batch=6, seq_len=T, seed=1).next_micro_batch()
    assert batch.inputs.shape == (6, T)
    assert torch.equal(batch.targets, batch.inputs + 1)  # the token values are positions
    assert all(int(row[0]) % T == 0 for row in batch.inputs % 10_000)  # windows start at multiples of T


@pytest.mark.parametrize("consumed", [0, 5, 31, 40])
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_resume_mid_epoch_is_bitwise(consumed: int, rank: int, world: int) -> None:
    def make() -> ShuffledTokenStreamLoader:
        return ShuffledTokenStreamLoader(shards(), 3, T, rank=rank, world_size=world, seed=11)

    original = make()
    for _ in range(consumed):
        original.next_micro_batch()
    state = original.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    for _ in range(50):  # across epoch ends
        a, b = original.next_micro_batch(), fresh.next_micro_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert original.epoch == fresh.epoch


def test_resume_under_another_micro_batch_and_world_continues_the_same_stream() -> None:
    one = ShuffledTokenStreamLoader(shards(), 4, T, seed=5)
    for _ in range(7):
        one.next_micro_batch()
    state = one.state_dict()
    two = [ShuffledTokenStreamLoader(shards(), 2, T, rank=r, world_size=2, seed=5) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    for _ in range(20):
        assert sorted(rows(one.next_micro_batch())) == sorted(
            rows(two[0].next_micro_batch()) + rows(two[1].next_micro_batch())
        )


def test_a_run_resumes_only_in_the_order_it_was_saved_in() -> None:
    sequential = TokenStreamLoader(shards(), 2, T)
    shuffled = ShuffledTokenStreamLoader(shards(), 2, T, seed=1)
    with pytest.raises(ConfigError, match="resume with --shuffle off"):
        shuffled.load_state_dict(sequential.state_dict())  # also a checkpoint from before --shuffle
    with pytest.raises(ConfigError, match="resume with --shuffle on"):
        sequential.load_state_dict(shuffled.state_dict())
    state = shuffled.state_dict() | {"windows": 62}
    with pytest.raises(DataError, match="was the data changed"):
        ShuffledTokenStreamLoader(shards(), 2, T, seed=1).load_state_dict(state)


def test_shuffle_off_reads_the_data_in_order() -> None:
    from bigbatch.data.loader import loader_for

    class Meta:
        mode = "packed"

    class Data:
        meta = Meta()

        def shard_arrays(self, split: str) -> list[np.ndarray]:
            return shards()

    ordered = loader_for(Data(), "train", 2, T, shuffle=False)  # type: ignore[arg-type]
    assert type(ordered) is TokenStreamLoader
    assert ordered.next_micro_batch().inputs.flatten().tolist() == list(range(2 * T))
    assert isinstance(loader_for(Data(), "train", 2, T, shuffle=True, seed=1), ShuffledTokenStreamLoader)  # type: ignore[arg-type]


def test_shuffle_is_on_by_default_and_switched_by_flag_and_toml() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args([])).data.shuffle == "on"
    assert config_from_args(parser.parse_args(["--shuffle", "off"])).data.shuffle == "off"
    assert config_from_args(parser.parse_args(["--no-shuffle"])).data.shuffle == "off"
    config = TrainConfig()
    apply_mapping(config, {"data": {"shuffle": False}}, origin="t.toml")
    assert config.data.shuffle == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--shuffle", "sometimes"])
    # a run saved before --shuffle existed is the same run; its loader state decides the order
    assert settings_diff({"data": {}}, config) == []


def documents(lengths: list[int]) -> DocumentShard:
    tokens = np.concatenate([np.full(n, i + 1, dtype=np.uint16) for i, n in enumerate(lengths)])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return DocumentShard(tokens, offsets, None)


def test_documents_shuffle_permutes_each_epochs_sequences_and_keeps_epoch_ends() -> None:
    shard = documents([3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 2])  # 11 documents, one sequence each (T=8)
    loader = DocumentLoader([shard], micro_batch=2, seq_len=8, rank=0, world_size=2, shuffle=True, seed=4)
    ordered = DocumentLoader([shard], micro_batch=2, seq_len=8, rank=0, world_size=2)
    assert ordered.n_sequences == 11
    epochs: list[list[int]] = []
    for _ in range(2):
        seen: list[int] = []
        start = loader.epoch
        while loader.epoch == start:
            seen += [int(row[0]) for row in loader.next_micro_batch().inputs if int(row[0]) != 0]
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    # rank 0 reads 2 of every 4 sequences; over 3 micro-batches (the last one of 3 sequences) it read 6
    assert len(epochs[0]) == len(epochs[1]) == 6
    state = loader.state_dict()
    again = DocumentLoader([shard], micro_batch=2, seq_len=8, rank=0, world_size=2, shuffle=True, seed=4)
    again.load_state_dict(state)
    for _ in range(5):
        assert torch.equal(loader.next_micro_batch().inputs, again.next_micro_batch().inputs)
    with pytest.raises(ConfigError, match="--shuffle on"):
        ordered.load_state_dict(state)


def test_documents_shuffle_reads_every_sequence_once_per_epoch_over_all_ranks() -> None:
    shard = documents([3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 2])
    ranks = [DocumentLoader([shard], 2, 8, rank=r, world_size=2, shuffle=True, seed=9) for r in range(2)]
    seen: list[int] = []
    while ranks[0].epoch == 0:
        for loader in ranks:
            seen += [int(row[0]) for row in loader.next_micro_batch().inputs if int(row[0]) != 0]
    assert sorted(seen) == list(range(1, 12))
    assert seen != list(range(1, 12))


@pytest.mark.parametrize("seq_len", [1, 3, 8])
def test_reading_windows_is_the_slice_of_each_window_moved_unless_it_would_overrun(seq_len: int) -> None:
    """TokenStreamWindows.read gathers each shard's rows at once; row by row it must be the plain slice: window i of a
    shard at [i*T, i*T + T + 1), moved by its shift unless that runs past the shard's end; -1 is padding."""
    rng = np.random.default_rng(seq_len)
    data = [rng.integers(0, 50, size=n).astype(np.uint16) for n in (seq_len * 5 + 1, 0, seq_len * 3 + 2, 7, 40)]
    windows = TokenStreamWindows(data, seq_len)
    for _ in range(20):
        index = rng.integers(-1, windows.count, size=9)
        shifts = rng.integers(0, seq_len, size=9)
        batch = windows.read(index, pad_token=3, shifts=shifts)
        for row, (window, shift) in enumerate(zip(index.tolist(), shifts.tolist(), strict=True)):
            if window < 0:
                assert (batch.inputs[row] == 3).all() and (batch.targets[row] == -100).all()
                continue
            shard = int(np.searchsorted(windows.first, window, side="right")) - 1
            start = (window - int(windows.first[shard])) * seq_len
            if start + shift + seq_len + 1 <= len(data[shard]):
                start += shift
            expected = torch.from_numpy(data[shard][start : start + seq_len + 1].astype(np.int64))
            assert torch.equal(batch.inputs[row], expected[:-1]) and torch.equal(batch.targets[row], expected[1:])
