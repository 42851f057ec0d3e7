"""The Trainer reads ahead in a background thread, yet a checkpoint saves the position after the micro-batches
trained on: a resumed run is bitwise the uninterrupted one, even when the reader is far ahead at each save."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import corpus_bytes

from bigbatch.data.stream import TokenStreamLoader
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

STEPS = 6


def make_config(corpus: Path, out: Path, max_steps: int, save_every: int = 0) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(corpus)
    config.data.cache_dir = str(corpus.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 192  # K = 3
    config.optim.warmup_steps, config.optim.decay_steps = 2, STEPS  # the same schedule for 3 steps and 6
    config.run.max_steps = max_steps
    config.run.save_every = save_every
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    config.run.noise_scale_every = 0
    config.run.out = str(out)
    return config


def wait_for_read_ahead(trainer: Trainer) -> None:
    """Let the reading thread fill its queue at each step end, so a save happens while it is ahead."""
    step = trainer.engine.step

    def stepping(*args: object, **kwargs: object) -> object:
        record = step(*args, **kwargs)
        reader = trainer.train_loader
        deadline = time.monotonic() + 10
        while reader._queue is None or reader._queue.qsize() < reader.depth:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return record

    trainer.engine.step = stepping  # type: ignore[method-assign]


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("shuffle", ["on", "off"])
def test_resume_from_a_checkpoint_saved_while_reading_ahead_is_bitwise(tmp_path: Path, shuffle: str) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_bytes(corpus_bytes(60_000))

    def config(out: Path, max_steps: int, save_every: int = 0) -> TrainConfig:
        made = make_config(corpus, out, max_steps, save_every)
        made.data.shuffle = shuffle
        return made

    golden = Trainer(config(tmp_path / "golden", STEPS))
    golden.train()

    first = Trainer(config(tmp_path / "resumed", 3, save_every=1))
    wait_for_read_ahead(first)
    first.train()
    saved = ckpt.load_checkpoint(tmp_path / "resumed")
    assert saved["engine"]["step_count"] == 3
    # the same loader, unwrapped, that read exactly 3 steps x K = 3 micro-batches
    plain = Trainer(config(tmp_path / "plain", 3)).parts.train_loader
    if shuffle == "off":
        assert isinstance(plain, TokenStreamLoader)
    for _ in range(3 * 3):
        plain.next_micro_batch()
    assert saved["loader"] == plain.state_dict()

    resumed = Trainer(config(tmp_path / "resumed", STEPS))
    assert resumed.resumed_from is not None
    resumed.train()
    for (name, a), b in zip(golden.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.train_loader.state_dict() == golden.train_loader.state_dict()


@pytest.mark.usefixtures("isolated")
def test_without_prefetch_the_run_is_the_same(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_bytes(corpus_bytes(60_000))
    ahead = Trainer(make_config(corpus, tmp_path / "ahead", 4))
    ahead.train()
    inline = Trainer(make_config(corpus, tmp_path / "inline", 4), prefetch=False)
    inline.train()
    for a, b in zip(ahead.model.parameters(), inline.model.parameters(), strict=True):
        assert torch.equal(a, b)
