"""Evaluation that means something: the whole validation split when it is small, else a fixed sample of windows
spread uniformly over it; the same windows at every evaluation and whatever the micro-batch or processes; the
number of validation tokens logged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.shards import DocumentShard
from bigbatch.data.validation_windows import AUTO_EVAL_TOKENS, ValidationWindows, wanted_windows
from bigbatch.data.windows import TokenStreamWindows, spread_sample
from bigbatch.models import GPT, GPTConfig
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer
from bigbatch.run.loop.validation_loss import summed_loss

T = 4


def windows(n_windows: int) -> TokenStreamWindows:
    """A packed split of ``n_windows`` windows of T tokens whose token values reveal their positions."""
    return TokenStreamWindows([np.arange(n_windows * T + 1, dtype=np.uint16)], T)


def read_all(source: TokenStreamWindows, wanted: int, micro_batch: int, world: int) -> tuple[list[int], list[int]]:
    """(first token of every real window read, on all ranks; micro-batches per rank), one pass."""
    ranks = [ValidationWindows(source, wanted, micro_batch, rank=r, world_size=world) for r in range(world)]
    starts, per_rank = [], []
    for loader in ranks:
        read = 0
        while True:
            batch = loader.next_micro_batch()
            read += 1
            assert batch.inputs.shape == (micro_batch, T)
            starts += [int(row[0]) for row, target in zip(batch.inputs, batch.targets, strict=True) if target[0] >= 0]
            if loader.epoch:
                break
        per_rank.append(read)
    return sorted(starts), per_rank


def test_a_sample_is_spread_uniformly_and_a_small_split_is_read_whole() -> None:
    assert spread_sample(10, 10).tolist() == list(range(10))
    assert spread_sample(7, 100).tolist() == list(range(7))
    sample = spread_sample(1000, 10).tolist()
    assert sample == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]  # the middle of each tenth
    big = spread_sample(10**6, 1000)
    assert len(np.unique(big)) == 1000 and big[0] < 1000 and big[-1] > 10**6 - 1000


def test_the_windows_do_not_depend_on_micro_batch_or_processes() -> None:
    split = windows(1000)
    wanted = 37  # not a multiple of any micro-batch: the last global micro-batch is short (padding)
    reference, _ = read_all(split, wanted, micro_batch=1, world=1)
    assert reference == [i * T for i in spread_sample(1000, wanted).tolist()]
    for micro_batch, world in [(2, 1), (4, 1), (2, 2), (3, 2)]:
        starts, per_rank = read_all(split, wanted, micro_batch, world)
        assert starts == reference
        assert len(set(per_rank)) == 1  # every process reads as many micro-batches (collectives stay matched)
    # auto asks for tokens, not micro-batches: the same whatever B and world
    assert wanted_windows(0, 2, 64, 1) == wanted_windows(0, 16, 64, 8) == AUTO_EVAL_TOKENS // 64
    assert wanted_windows(3, 2, 64, 2) == 12


def test_every_pass_reads_the_same_windows() -> None:
    loader = ValidationWindows(windows(500), 20, micro_batch=4)
    assert not loader.whole and loader.windows == 20 and loader.micro_batches == 5
    passes = []
    for _ in range(3):
        loader.reset()
        passes.append(torch.cat([loader.next_micro_batch().inputs for _ in range(loader.micro_batches)]))
        assert loader.epoch == 1
    assert torch.equal(passes[0], passes[1]) and torch.equal(passes[1], passes[2])
    whole = ValidationWindows(windows(9), 20, micro_batch=4)
    assert whole.whole and whole.windows == 9 and "the whole split" in whole.describe()
    assert "spread uniformly" in loader.describe()
    assert whole.describe() == "9 windows of 4 tokens (the whole split)"
    assert ValidationWindows(windows(1), 20, micro_batch=4).describe() == "1 window of 4 tokens (the whole split)"
    assert ValidationWindows(windows(500), 1, micro_batch=4).describe() == (
        "1 of its 500 windows of 4 tokens, spread uniformly"
    )


def test_the_loss_is_the_same_for_every_micro_batch_size() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=T, vocab_size=4096)).eval()
    split = windows(300)
    losses = []
    for micro_batch in (1, 3, 8):
        totals, _ = summed_loss(model, ValidationWindows(split, 25, micro_batch), torch.device("cpu"))
        assert int(totals[1]) == 25 * T  # padding rows count for nothing
        losses.append(float(totals[0] / totals[1]))
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)


def test_documents_are_sampled_by_sequence() -> None:
    lengths = [5, 9, 3, 7, 6, 4, 8, 5, 6, 7]
    tokens = np.concatenate([np.full(n, i + 1, dtype=np.uint16) for i, n in enumerate(lengths)])
    shard = DocumentShard(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), None)
    source = DocumentLoader([shard], 2, 8)
    loader = ValidationWindows(source, 4, micro_batch=2)
    firsts = [int(row[0]) for _ in range(loader.micro_batches) for row in loader.next_micro_batch().inputs]
    assert firsts == [d + 1 for d in spread_sample(10, 4).tolist()]


def test_a_training_run_logs_its_validation_tokens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data, config.data.cache_dir = str(corpus), str(tmp_path / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128
    config.run.max_steps, config.run.eval_every, config.run.sample_tokens = 2, 1, 0
    config.run.noise_scale_every, config.run.out = 0, str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="bigbatch"):
        Trainer(config).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    val_tokens = (len(corpus.read_bytes()) // 10 - 1) // 32 * 32  # the whole split (far below 131,072 tokens)
    assert [r["val_tokens"] for r in evals] == [val_tokens, val_tokens]
    assert f"| {val_tokens:,} tokens |" in caplog.text
    assert "(the whole split)" in caplog.text and "order | shuffled" in caplog.text
