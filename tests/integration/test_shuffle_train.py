"""``bigbatch train`` with shuffled windows: a stopped run resumes bitwise; a run resumes only in the order it was
saved in, and says how in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main


def train_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--total-batch-tokens",
        "64",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--noise-scale-every",
        "0",
        "--warmup-steps",
        "1",
        "--decay-steps",
        "6",
        "--cache-dir",
        str(out.parent / "cache"),
        "--out",
        str(out),
        *extra,
    ]


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"{i} little pigs built {i % 7} houses of straw and sticks.\n" for i in range(60)))
    return path  # ~3,300 tokens: 186 windows of 16 for training, an epoch every ~47 steps of 4 windows


@pytest.mark.usefixtures("isolated")
def test_a_shuffled_run_resumed_mid_epoch_equals_an_uninterrupted_one(corpus: Path, tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_main(train_args(corpus, whole, "--max-steps", "6"))[0] == 0
    assert run_main(train_args(corpus, split, "--max-steps", "3"))[0] == 0
    code, out, err = run_main(train_args(corpus, split, "--max-steps", "6"))
    assert code == 0, err
    assert losses(split) == losses(whole)  # bitwise: the same windows in the same order, the same updates
    ordered = tmp_path / "ordered"
    assert run_main(train_args(corpus, ordered, "--max-steps", "6", "--shuffle", "off"))[0] == 0
    assert losses(ordered) != losses(whole)


@pytest.mark.usefixtures("isolated")
def test_resuming_in_another_order_is_one_line(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_main(train_args(corpus, run, "--max-steps", "2", "--shuffle", "off"))[0] == 0
    line = assert_one_line_error(*run_main(train_args(corpus, run, "--max-steps", "4")))
    assert "resume with --shuffle off" in line
    code, _, err = run_main(train_args(corpus, run, "--max-steps", "4", "--shuffle", "off"))
    assert code == 0, err
    assert len(losses(run)) == 4


def test_the_window_order_is_part_of_the_default_run_directory() -> None:
    """Shuffled and in-order runs compute different things: each gets its own default directory, so a run made
    before --shuffle existed (its directory's fingerprint had no order) is not resumed by the shuffled default."""
    from bigbatch.run.configuration.identity import default_run_dir, identity_settings, settings_diff
    from bigbatch.run.configuration.train_config import TrainConfig

    shuffled, in_order = TrainConfig(), TrainConfig()
    shuffled.data.shuffle, in_order.data.shuffle = "on", "off"
    assert default_run_dir(shuffled) != default_run_dir(in_order)
    # `make demo` made by a bigbatch before --shuffle (in order) lived here: --shuffle off still finds it, the
    # shuffled default starts its own run instead of being refused by the in-order checkpoint
    assert default_run_dir(in_order) == Path("runs/nano-6f51172515")
    assert "data.shuffle" in identity_settings(shuffled)
    # with --out pointing at the other order's run, the loader's saved state refuses it (the test above), not the
    # settings comparison, so its one-line message can say how to go on
    assert settings_diff(in_order.to_dict(), shuffled) == []
