"""Reliability: exact resume, atomic verified checkpoints, retention, faults survived, bad input refused."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import corpus_bytes
from reliability_runs import (
    STEPS,
    Crash,
    assert_same_final_model,
    cli_args,
    crash_at,
    make_config,
    run_cli,
    step_losses,
    torchrun_cli,
)

from bigbatch.cli import main
from bigbatch.engine.rng import capture_rng_state, restore_rng_state
from bigbatch.errors import CheckpointError
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.loop.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    text = corpus_bytes(60_000)
    path.write_bytes(text)
    return path


@pytest.fixture(scope="module")
def golden(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden") / "run"
    Trainer(make_config(corpus, out)).train()
    return out


@pytest.mark.parametrize(
    ("save_every", "crash_step"),
    [(1, 2), pytest.param(1, 5, marks=pytest.mark.slow), pytest.param(2, 4, marks=pytest.mark.slow), (2, 6)],
)
def test_resume_after_a_crash_is_bitwise_identical(
    corpus: Path, golden: Path, tmp_path: Path, save_every: int, crash_step: int
) -> None:
    """Crash mid-window, resume from the newest checkpoint: the loss sequence and parameters are bitwise equal."""
    out = tmp_path / "run"
    trainer = Trainer(make_config(corpus, out, save_every=save_every))
    crash_at(trainer, crash_step, micro=2)
    with pytest.raises(Crash):
        trainer.train()
    resumed = Trainer(make_config(corpus, out, save_every=save_every))
    assert resumed.resumed_from is not None
    assert resumed.engine.step_count == (crash_step - 1) // save_every * save_every  # the window is replayed
    resumed.train()
    assert step_losses(out) == step_losses(golden)  # bitwise: == on floats
    assert_same_final_model(out, golden)


def test_resume_never_refuses_and_overwrite_starts_over(corpus: Path, golden: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2)).train()
    from bigbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(make_config(corpus, out, resume="never"))
    Trainer(make_config(corpus, out, resume="never", overwrite=True)).train()
    assert step_losses(out) == step_losses(golden)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [f"step_{STEPS:07d}"]


def test_resume_with_another_model_or_batch_is_refused(corpus: Path, golden: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2)).train()
    other = make_config(corpus, out)
    other.model.preset = "nano"
    with pytest.raises(CheckpointError, match=r"other settings \(model.preset 'pico' -> 'nano'\)"):
        Trainer(other)
    other = make_config(corpus, out)
    other.batch.total_batch_tokens = 512
    with pytest.raises(CheckpointError, match=r"total_batch_tokens is 256, this run's is 512.*--allow-batch-change"):
        Trainer(other)


def test_resume_with_another_micro_batch_keeps_tokens_per_step(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2)).train()
    config = make_config(corpus, out, max_steps=3)
    config.batch.micro_batch = 4  # K 4 -> 2, same 256 tokens per step
    trainer = Trainer(config)
    assert trainer.plan.accumulation_steps == 2 and trainer.engine.step_count == 2
    result = trainer.train()
    assert result.tokens_seen == 3 * 256


def test_reaching_max_steps_again_says_complete_and_succeeds(
    corpus: Path, golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A requeued job of a finished run exits 0 and says the run is complete; nothing in the run changes."""
    before = {p: p.stat().st_mtime_ns for p in golden.rglob("*") if p.is_file()}
    code = main(
        [
            "train",
            "--data",
            str(corpus),
            "--model",
            "pico",
            "--dropout",
            "0.1",
            "--micro-batch",
            "2",
            "--seq-len",
            "32",
            "--total-batch-tokens",
            "256",
            "--max-steps",
            str(STEPS),
            "--eval-every",
            "3",
            "--eval-batches",
            "2",
            "--sample-tokens",
            "0",
            "--cache-dir",
            str(golden.parent / "cache"),
            "--out",
            str(golden),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert f"is complete: it reached step {STEPS} (max_steps {STEPS})" in out
    assert "resumed from" not in out and "| loss" not in out  # complete: nothing resumes, no step trains
    assert {p: p.stat().st_mtime_ns for p in golden.rglob("*") if p.is_file()} == before


# ---- checkpoints on disk -------------------------------------------------------------------------------


def write_checkpoints(run_dir: Path, steps: list[int]) -> list[Path]:
    return [
        ckpt.save_checkpoint({"step": s, "w": torch.full((8,), float(s))}, ckpt.single_file_path(run_dir, s))
        for s in steps
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_marker", "bad_marker"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    older, latest = write_checkpoints(tmp_path, [10, 20])
    data = latest.read_bytes()
    if damage == "truncate":
        latest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        latest.write_bytes(bytes(flipped))
    elif damage == "no_marker":
        ckpt.commit_path(latest).unlink()
    else:
        ckpt.commit_path(latest).write_text("{not json")
    assert ckpt.latest_valid_checkpoint(tmp_path) == older
    assert "skipping checkpoint" in caplog.text and latest.name in caplog.text
    assert ckpt.load_checkpoint(tmp_path)["step"] == 10


def test_a_failed_write_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (first,) = write_checkpoints(tmp_path, [1])
    before = sorted(p.name for p in first.parent.iterdir())

    def disk_full(obj: object, handle: object) -> None:
        handle.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_checkpoint({"step": 2}, ckpt.single_file_path(tmp_path, 2))
    assert sorted(p.name for p in first.parent.iterdir()) == before  # no temp file, no step 2
    assert ckpt.latest_valid_checkpoint(tmp_path) == first


def test_trainer_reports_a_failed_save_and_keeps_old_checkpoints(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2)).train()
    trainer = Trainer(make_config(corpus, out, max_steps=3))

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(
        CheckpointError, match="could not save checkpoint .*No space left.*earlier checkpoints are intact"
    ):
        trainer.train()
    monkeypatch.undo()
    assert ckpt.latest_valid_checkpoint(out) == ckpt.checkpoint_path(out, 2)


def test_retention_keeps_n_and_survives_a_failed_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_checkpoints(tmp_path, [1, 2, 3, 4, 5])
    real_unlink = Path.unlink

    def stubborn(self: Path, missing_ok: bool = False) -> None:
        if self == paths[0]:
            raise PermissionError(13, "Permission denied")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", stubborn)
    removed = ckpt.prune_checkpoints(tmp_path, keep=2)
    assert removed == paths[1:3]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [paths[0].name, paths[3].name, paths[4].name]
    assert ckpt.verify_checkpoint(paths[0]) is not None  # its marker went first: never trusted again
    assert ckpt.latest_valid_checkpoint(tmp_path) == paths[4]


def test_rng_state_round_trips_through_weights_only(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.randn(), torch.rand(1)
    path = ckpt.save_checkpoint({"step": 0, "rng": [capture_rng_state()]}, tmp_path / "r.pt")
    expected = (random.random(), float(np.random.randn()), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(torch.load(path, weights_only=True)["rng"][0])
    got = (random.random(), float(np.random.randn()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from bigbatch.data.prepare import prepare_dataset

    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 2000)
    prepare_dataset(str(corpus), tmp_path / "ds")
    shard = tmp_path / "ds" / "train_000000.npy"
    tokens = np.load(shard)
    tokens[100] = 300
    np.save(shard, tokens)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["vocab_size"] == 256
    code = main(
        [
            "train",
            "--data",
            str(tmp_path / "ds"),
            "--model",
            "pico",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--total-batch-tokens",
            "64",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "token id 300" in err and "256 ids" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_consecutive_non_finite_steps_abort_with_a_clear_error(corpus: Path, tmp_path: Path) -> None:
    from bigbatch.errors import TrainingError

    trainer = Trainer(make_config(corpus, tmp_path / "run", max_consecutive_skips=3))
    inner = trainer.engine.loss_fn
    trainer.engine.loss_fn = lambda model, batch: inner(model, batch) * float("nan")
    with pytest.raises(
        TrainingError, match=r"3 consecutive steps were skipped as bad steps \(the last: non-finite loss\)"
    ):
        trainer.train()
    assert trainer.engine.skipped_steps == 3 and trainer.engine.step_count == 0


# ---- faults in real processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli(cli_args(corpus, out), fault="sigterm:step=3,micro=1")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "stopped by SIGTERM after step 3" in done.stdout
    assert ckpt.latest_valid_checkpoint(out) == ckpt.checkpoint_path(out, 3)
    again = run_cli(cli_args(corpus, out))
    assert again.returncode == 0 and "resumed from" in again.stdout and f"step {STEPS} | loss" in again.stdout


@pytest.mark.slow
def test_restarts_exhausted_is_a_non_zero_exit(corpus: Path, tmp_path: Path) -> None:
    done = torchrun_cli(cli_args(corpus, tmp_path / "run"), fault="kill:step=2,rank=1,attempt=any", max_restarts=1)
    assert done.returncode != 0


@pytest.mark.slow
def test_nan_on_one_rank_makes_both_skip(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = torchrun_cli(cli_args(corpus, out, "--bad-step", "skip-step"), fault="nan:step=2,rank=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SKIPPED (bad step)" in done.stdout
    document = ckpt.load_checkpoint(out)
    assert document["engine"]["skipped_steps"] == 1 and document["step"] == STEPS


def test_loader_state_from_a_smaller_world_continues_in_the_next_shard() -> None:
    from bigbatch.data.stream import TokenStreamLoader

    shards = [np.arange(1000, dtype=np.uint16), np.arange(1000, 2000, dtype=np.uint16)]
    single = TokenStreamLoader(shards, micro_batch=2, seq_len=50)  # global window 100
    for _ in range(8):
        single.next_micro_batch()
    state = single.state_dict()
    assert state["offset"] == 800
    two = [TokenStreamLoader(shards, micro_batch=2, seq_len=50, rank=r, world_size=2) for r in range(2)]  # window 200
    for loader in two:
        loader.load_state_dict(state)  # 800 + 200 + 1 > 1000: no whole window left in shard 0
    first = two[0].next_micro_batch()
    assert first.inputs[0, 0].item() == 1000 and two[0].shard_index == 1


def test_a_sample_that_cannot_load_its_tokenizer_is_only_a_warning(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Training is done and saved; an offline GPT-2 encoding must not turn the run into a failure."""
    from bigbatch.errors import BigBatchError

    trainer = Trainer(make_config(corpus, tmp_path / "run", max_steps=1, sample_tokens=5))

    def offline(*args: object, **kwargs: object) -> str:
        raise BigBatchError("could not load tiktoken's GPT-2 encoding")

    monkeypatch.setattr(trainer, "sample", offline)
    result = trainer.train()
    assert result.steps == 1 and result.sample is None
    assert "no sample: could not load" in caplog.text
