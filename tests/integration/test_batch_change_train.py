"""When the tokens per step change, the optimizer follows: Seesaw's doublings (same tokens, fewer steps, exact
resume across a doubling), a resume with another --total-batch-tokens (the rule scales from the run's first size),
the lines and records of each change, and bad input said in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main
from reliability_runs import assert_same_final_model, run_cli, step_losses

from bigbatch.engine.optim import CosineSchedule
from bigbatch.sizing.seesaw import SeesawSchedule

UNIT = 2 * 32  # micro_batch x seq_len
SEESAW_STEPS = 56  # the cosine run's steps, whose tokens the Seesaw run trains in fewer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


def train_args(corpus: Path, out: Path, *extra: str, steps: int = SEESAW_STEPS) -> list[str]:
    return [
        "train",
        *("--data", str(corpus), "--model", "pico", "--micro-batch", "2", "--seq-len", "32"),
        *("--total-batch-tokens", "128", "--max-steps", str(steps), "--warmup-steps", "1"),
        *("--eval-every", "0", "--sample-tokens", "0", "--noise-scale-every", "0"),
        *("--cache-dir", str(out.parent / "cache"), "--out", str(out)),
        *extra,
    ]


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def seesaw_golden(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted Seesaw run with dropout (the generators matter for a bitwise resume)."""
    out = tmp_path_factory.mktemp("seesaw") / "golden"
    done = run_cli(train_args(corpus, out, "--schedule", "seesaw", "--dropout", "0.1"))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_seesaw_doubles_where_the_cosine_halves_and_trains_the_same_tokens_in_fewer_steps(seesaw_golden: Path) -> None:
    """K doubles at the schedule's halvings (K 2 -> 4 -> 8 -> 16 for a cosine to 0.1 x lr); the tokens are the
    cosine run's; each step's learning rate is the schedule where it stands in tokens times sqrt(K / 2), beta2 is
    0.95 ** (K / 2); one batch_change record per doubling."""
    steps = records(seesaw_golden, "step")
    expected = SeesawSchedule(CosineSchedule(2e-3, 2e-4, 1, SEESAW_STEPS), 2, 16, SEESAW_STEPS)
    assert [r["micro_batches"] for r in steps] == [expected.k(s) for s in range(expected.total_steps)]
    assert sorted({expected.size_k(s) for s in range(len(steps))}) == [2, 4, 8, 16]
    assert steps[-1]["micro_batches"] < 16  # the last step holds only the tokens left
    assert sum(r["tokens"] for r in steps) == SEESAW_STEPS * 128  # the same tokens as the cosine run
    assert len(steps) == expected.total_steps < SEESAW_STEPS
    for s, record in enumerate(steps):
        factor = math.sqrt(expected.size_k(s) / 2)
        assert record["lr"] == pytest.approx(expected(s) * factor, rel=1e-12)
    changes = records(seesaw_golden, "batch_change")
    assert [(c["tokens_per_step_before"], c["tokens_per_step_after"]) for c in changes] == [
        (128, 256),
        (256, 512),
        (512, 1024),
    ]
    for change in changes:
        ratio = change["tokens_per_step_after"] / change["tokens_per_step_before"]
        assert change["cause"] == "seesaw"
        assert change["lr_after"] == pytest.approx(change["lr_before"] * math.sqrt(ratio), rel=1e-12)
        assert change["beta2_after"] == pytest.approx(change["beta2_before"] ** ratio, rel=1e-12)
        assert change["beta1_after"] == change["beta1_before"] == 0.9


@pytest.mark.slow
def test_a_seesaw_run_killed_after_a_doubling_resumes_bitwise(
    corpus: Path, seesaw_golden: Path, tmp_path: Path
) -> None:
    """SIGKILLed inside the step after the second doubling, the same command resumes from the checkpoint before
    it and ends bitwise where the uninterrupted run did: K and the settings are functions of the step."""
    doubling = records(seesaw_golden, "batch_change")[1]["step"]
    out = tmp_path / "run"
    args = train_args(corpus, out, "--schedule", "seesaw", "--dropout", "0.1", "--save-every", "1")
    killed = run_cli(args, fault=f"kill:step={doubling + 1},micro=1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {doubling}" in resumed.stdout
    assert step_losses(out) == step_losses(seesaw_golden)  # bitwise
    assert records(out, "batch_change") == records(seesaw_golden, "batch_change")  # said once each, not again
    assert_same_final_model(out, seesaw_golden)


def test_a_resume_with_another_batch_size_needs_allowing_then_the_rule_scales_from_the_first(
    corpus: Path, tmp_path: Path
) -> None:
    """A new --total-batch-tokens on resume is refused in one line naming --allow-batch-change; with it, the run
    goes on at the new size from the next step, and the rule scales the settings from the run's first size."""
    out = tmp_path / "run"
    first = train_args(corpus, out, "--lr", "1e-3", "--min-lr-ratio", "1", steps=3)
    code, stdout, err = run_main(first)
    assert code == 0, err
    grown = [a if a != "128" else "512" for a in first]
    grown[grown.index("--max-steps") + 1] = "5"
    code, stdout, err = run_main(grown)
    line = assert_one_line_error(code, stdout, err)
    assert "total_batch_tokens is 128, this run's is 512" in line and "--allow-batch-change" in line
    code, stdout, err = run_main([*grown, "--allow-batch-change"])
    assert code == 0, err
    assert "--allow-batch-change: total_batch_tokens 128 -> 512" in stdout
    assert "batch change at step 4 (resume, 384 tokens seen): 128 -> 512 tokens/step (x4)" in stdout
    steps = records(out, "step")
    assert [r["micro_batches"] for r in steps] == [2, 2, 2, 8, 8]
    assert [r["lr"] for r in steps] == pytest.approx([1e-3] * 3 + [2e-3] * 2, rel=1e-12)  # constant lr x sqrt(4)
    (change,) = records(out, "batch_change")
    assert (change["step"], change["cause"], change["tokens_seen"]) == (4, "resume", 384)
    assert change["beta2_after"] == pytest.approx(0.95**4, rel=1e-12)


def test_a_rule_on_a_run_whose_batch_never_changes_says_it_changes_nothing(corpus: Path, tmp_path: Path) -> None:
    code, out, err = run_main(train_args(corpus, tmp_path / "run", "--batch-change-rule", "linear", steps=1))
    assert code == 0, err
    assert "--batch-change-rule linear changes nothing in this run: its tokens per step (128) never change" in out
    assert not records(tmp_path / "run", "batch_change")


def test_seesaw_says_where_the_cap_stops_its_doublings(corpus: Path, tmp_path: Path) -> None:
    args = train_args(corpus, tmp_path / "run", "--schedule", "seesaw", "--max-batch-tokens", "256", steps=6)
    code, out, err = run_main([*args, "--max-steps", "6"])
    assert code == 0, err
    assert "seesaw stops doubling at 256 tokens/step (K 4, from step" in out
    assert "--max-batch-tokens 256 holds no further doubling" in out
    assert {r["micro_batches"] for r in records(tmp_path / "run", "step")} == {2, 4}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--schedule", "seesaw", "--batch-ramp", "64:512"), "--schedule seesaw sets the tokens of every step itself"),
        (("--max-batch-tokens", "512"), "--max-batch-tokens caps the doublings of --schedule seesaw"),
        (("--schedule", "seesaw", "--max-batch-tokens", "64"), "--max-batch-tokens is below total_batch_tokens"),
        (("--schedule", "seesaw", "--max-batch-tokens", "300"), "not a whole number of micro-batches of 64 tokens"),
        (("--batch-ramp", "from:nowhere"), "--batch-ramp from:nowhere: no such run or file"),
        (("--batch-change-rule", "cubic"), "batch_change_rule must be one of auto, none, sqrt, linear"),
    ],
)
def test_bad_batch_change_settings_are_one_line_errors(
    corpus: Path, tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "run"
    code, stdout, err = run_main(train_args(corpus, out, *extra, steps=2))
    assert message in assert_one_line_error(code, stdout, err)
    assert not (out / "checkpoints").exists()
