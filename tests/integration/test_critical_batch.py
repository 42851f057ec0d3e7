"""``bigbatch critical-batch``: branches from a tiny run's checkpoint at several tokens per step, exact and
resumable; the comparison at equal tokens, the result files; one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.critical_batch.rules import critical_batch_size
from bigbatch.run.checkpoints import checkpoint as ckpt

PARENT_STEPS, PARENT_TPS = 4, 128  # micro-batch 2 x seq_len 32 x K 2
SIZES, BUDGET = [64, 128, 256], 512  # K 1, 2, 4; 8, 4 and 2 steps
BASE = f"critical-batch/step_{PARENT_STEPS:07d}-sqrt-beta2"


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pico run of 4 steps: constant learning rate after a 2-step warmup, the noise scale measured every step."""
    root = tmp_path_factory.mktemp("critical")
    corpus = root / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    run_dir = root / "parent"
    code, out, err = run_main(train_args(corpus, run_dir, PARENT_STEPS))
    assert code == 0, out + err
    return run_dir


def train_args(corpus: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--total-batch-tokens",
        str(PARENT_TPS),
        "--warmup-steps",
        "2",
        "--min-lr-ratio",
        "1.0",
        "--max-steps",
        str(steps),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--noise-scale-every",
        "1",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(corpus.parent / "cache"),
        "--out",
        str(run_dir),
    ]


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def critical_batch(run_dir: Path, sizes: list[int] = SIZES, budget: int = BUDGET, *extra: str) -> tuple[int, str, str]:
    return run_main(
        [
            "critical-batch",
            str(run_dir),
            "--tokens-per-step",
            ",".join(map(str, sizes)),
            "--budget",
            str(budget),
            *extra,
        ]
    )


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def final_state(branch_dir: Path) -> dict:
    """The newest checkpoint of a run or branch, its shards consolidated in this process."""
    return ckpt.load_checkpoint(ckpt.list_checkpoints(branch_dir)[-1])


def assert_same_tensors(a: object, b: object, where: str = "") -> None:
    """Equal, bitwise for tensors, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def measured(parent: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The command run once on a copy of the parent: (the copy, its output)."""
    run_dir = copy_of(parent, tmp_path_factory.mktemp("measured"))
    code, out, err = critical_batch(run_dir)
    assert code == 0, out + err
    return run_dir, out


@pytest.mark.slow
def test_branches_train_the_same_tokens_at_each_size_and_report_the_critical_batch(
    parent: Path, measured: tuple[Path, str]
) -> None:
    run_dir, out = measured
    result = json.loads((run_dir / BASE / "result.json").read_text())
    branches = result["branches"]
    assert [b["tokens_per_step"] for b in branches] == SIZES
    assert [b["accumulation_steps"] for b in branches] == [1, 2, 4]
    assert [b["steps"] for b in branches] == [8, 4, 2]
    parent_lr = result["parent_lr"]
    assert parent_lr == pytest.approx(2e-3)
    assert [b["lr"] for b in branches] == pytest.approx([parent_lr * 0.5**0.5, parent_lr, parent_lr * 2**0.5])
    # beta2 keeps its half-life in tokens: 0.95 ** (N / N_parent)
    assert [b["beta2"] for b in branches] == pytest.approx([0.95**0.5, 0.95, 0.95**2], rel=1e-12)
    losses = [b["val_loss"] for b in branches]
    critical, within = critical_batch_size(SIZES, losses, 0.01)
    assert result["critical_tokens_per_step"] == critical and [b["within_tolerance"] for b in branches] == within
    # The parent's last usable estimate (positive) at or before the branch point, as the parent logged it: whether
    # any of its 4 noisy measurements is usable depends on the draws, so none is assumed.
    usable = [r for r in step_records(parent) if r["step"] <= PARENT_STEPS and r.get("noise_scale", 0) > 0]
    if usable:
        assert (result["noise_scale_step"], result["noise_scale"]) == (usable[-1]["step"], usable[-1]["noise_scale"])
    else:
        assert result["noise_scale_step"] is None and result["noise_scale"] is None
    assert (run_dir / BASE / "critical-batch.png").stat().st_size > 0
    for size, k, branch in zip(SIZES, [1, 2, 4], branches, strict=True):
        branch_dir = Path(branch["run_dir"])
        assert branch_dir == run_dir / BASE / f"tps_{size}"
        assert f"total_batch_tokens = {size}" in (branch_dir / "config.toml").read_text()
        steps = step_records(branch_dir)
        assert [r["step"] for r in steps] == list(range(PARENT_STEPS + 1, PARENT_STEPS + 1 + BUDGET // size))
        assert {r["micro_batches"] for r in steps} == {k} and sum(r["tokens"] for r in steps) == BUDGET
        assert {r["lr"] for r in steps} == {branch["lr"]}  # constant over the branch
        record = json.loads((branch_dir / "branch.json").read_text())
        assert record["parent_step"] == PARENT_STEPS and record["tokens_per_step"] == size
        assert final_state(branch_dir)["tokens_seen"] == PARENT_STEPS * PARENT_TPS + BUDGET
    # the parent is left as it was
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == [p.name for p in ckpt.list_checkpoints(parent)]
    assert (run_dir / "metrics.jsonl").read_text() == (parent / "metrics.jsonl").read_text()
    # the table
    assert "critical batch: " in out and f"{critical:,} tokens per step" in out
    for size in SIZES:
        assert any(line.split()[:1] == [f"{size:,}"] for line in out.splitlines()), out


@pytest.mark.slow
def test_a_branch_at_the_runs_own_size_is_the_run_continued_bitwise(parent: Path, tmp_path: Path) -> None:
    """The parent's schedule is constant after its warmup, so the branch at its own tokens per step (lr rule:
    any, the ratio is 1) must equal the parent resumed for the same steps: same parameters, optimizer state,
    data position, generators, losses. The parent runs on first, and the branches start from its step-4
    checkpoint (``--step``), not its newest."""
    continued = copy_of(parent, tmp_path)
    code, out, err = run_main(train_args(parent.parent / "corpus.txt", continued, PARENT_STEPS + 2))
    assert code == 0, out + err
    code, out, err = critical_batch(continued, [PARENT_TPS, 2 * PARENT_TPS], 2 * PARENT_TPS, "--step", "4")
    assert code == 0, out + err
    assert f"branched from {continued / 'checkpoints' / 'step_0000004'} at step 4" in out
    branch_dir = continued / BASE / f"tps_{PARENT_TPS}"
    a, b = final_state(branch_dir), final_state(continued)
    assert a["step"] == b["step"] == PARENT_STEPS + 2
    for key in ("model", "optimizer", "loader", "tokens_seen", "rng"):
        assert_same_tensors(a[key], b[key], key)
    losses = [r["loss"] for r in step_records(branch_dir)]
    assert losses == [r["loss"] for r in step_records(continued)][PARENT_STEPS:]


@pytest.mark.slow
def test_rerun_continues_unfinished_branches_and_reuses_finished_ones(
    parent: Path, measured: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir = copy_of(parent, tmp_path)
    code, out, err = critical_batch(run_dir, budget=BUDGET // 2)  # 4, 2 and 1 steps
    assert code == 0, out + err
    code, out, err = critical_batch(run_dir)  # the same branches, trained on to the full budget
    assert code == 0, out + err
    assert "resumed from" in out and "(reused)" not in out
    once = json.loads((measured[0] / BASE / "result.json").read_text())["branches"]
    twice = json.loads((run_dir / BASE / "result.json").read_text())["branches"]
    assert [b["val_loss"] for b in twice] == [b["val_loss"] for b in once]  # bitwise: resume is exact
    for size in SIZES:
        assert_same_tensors(
            final_state(run_dir / BASE / f"tps_{size}")["model"],
            final_state(measured[0] / BASE / f"tps_{size}")["model"],
        )
    metrics = {size: (run_dir / BASE / f"tps_{size}" / "metrics.jsonl").read_text() for size in SIZES}
    code, out, err = critical_batch(run_dir)  # everything done: nothing trains
    assert code == 0, out + err
    assert out.count("(reused)") == len(SIZES) and "branched from" not in out and "resumed from" not in out
    assert {size: (run_dir / BASE / f"tps_{size}" / "metrics.jsonl").read_text() for size in SIZES} == metrics
    code, out, err = critical_batch(run_dir, budget=BUDGET // 2)  # a branch cannot go back
    assert "has trained past this budget" in assert_one_line_error(code, out, err)


@pytest.mark.slow
def test_a_stop_mid_branch_saves_it_and_the_same_command_finishes_the_measurement(
    parent: Path, measured: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = copy_of(parent, tmp_path)
    monkeypatch.setenv("BIGBATCH_FAULT", f"sigterm:step={PARENT_STEPS + 2}")  # in the first branch's 2nd step
    code, out, err = critical_batch(run_dir)
    assert code == 143, out + err
    assert "stopped by SIGTERM" in out and "Traceback" not in out + err
    assert not (run_dir / BASE / "result.json").exists() and not (run_dir / BASE / "tps_128").exists()
    assert [p.name for p in ckpt.list_checkpoints(run_dir / BASE / "tps_64")] == ["step_0000006"]
    monkeypatch.delenv("BIGBATCH_FAULT")
    code, out, err = critical_batch(run_dir)
    assert code == 0, out + err
    assert f"resumed from {run_dir / BASE / 'tps_64' / 'checkpoints' / 'step_0000006'} at step 6" in out
    once = json.loads((measured[0] / BASE / "result.json").read_text())["branches"]
    again = json.loads((run_dir / BASE / "result.json").read_text())["branches"]
    assert [b["val_loss"] for b in again] == [b["val_loss"] for b in once]


@pytest.mark.slow
def test_a_branch_of_another_checkpoint_is_refused(measured: tuple[Path, str], tmp_path: Path) -> None:
    run_dir = copy_of(measured[0], tmp_path)
    record_path = run_dir / BASE / "tps_128" / "branch.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "parent_sha256": "0" * 64}))
    line = assert_one_line_error(*critical_batch(run_dir))
    assert "holds a branch of another checkpoint or setting" in line and "parent_sha256" in line


@pytest.mark.parametrize(
    ("sizes", "budget", "extra", "expected"),
    [
        (
            "100,128",
            "256",
            [],
            "--tokens-per-step 100: total_batch_tokens=100 is not a multiple of micro_batch x "
            "seq_len x world_size = 2 x 32 x 1 = 64; nearest valid totals: 64 (K=1) or 128 (K=2)",
        ),
        ("4K,8Ki", "8Ki", [], "for 4,096 write 4Ki"),
        ("64,256", "128", [], "--budget 128 tokens is smaller than one step of the largest size (256 tokens)"),
        ("64,192", "320", [], "nearest budgets that do: 192 or 384"),
        ("64", "256", [], "give at least two different sizes"),
        ("64,128", "lots", [], "--budget: 'lots' is not a count"),
        ("64,128", "256", ["--tolerance", "-1"], "--tolerance"),
        ("64,128", "256", ["--micro-batch", "3"], "--tokens-per-step 64: total_batch_tokens=64 is not a multiple"),
        ("64,128", "256", ["--step", "2"], "--step 2: no complete checkpoint of"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    parent: Path, sizes: str, budget: str, extra: list[str], expected: str
) -> None:
    code, out, err = run_main(["critical-batch", str(parent), "--tokens-per-step", sizes, "--budget", budget, *extra])
    assert expected in assert_one_line_error(code, out, err)
    assert not (parent / "critical-batch").exists()


def test_a_measurement_in_progress_is_refused_naming_no_flag_critical_batch_lacks(parent: Path, tmp_path: Path) -> None:
    """train's refusal offers --wait-for-lock; critical-batch has no such flag, so its refusal must not."""
    from bigbatch.files.lock import acquire
    from bigbatch.files.outputs import RUN_LOCK

    run_dir = copy_of(parent, tmp_path)
    (run_dir / BASE).mkdir(parents=True)
    held = acquire(run_dir / BASE / RUN_LOCK, wait=False)  # another measurement of the same step and rule
    try:
        line = assert_one_line_error(*critical_batch(run_dir))
    finally:
        held.release()
    assert line.startswith(f"bigbatch: error: critical-batch directory {run_dir / BASE} is in use by another bigbatch")
    assert line.endswith("nothing was written: wait for it to end or stop it"), line
    assert list((run_dir / BASE).iterdir()) == []  # no branch, no result (and the lock gone with its holder)


@pytest.mark.usefixtures("isolated")
def test_no_such_run_and_no_checkpoint_are_one_line(tmp_path: Path) -> None:
    line = assert_one_line_error(*critical_batch(tmp_path / "nowhere"))
    assert "no such run" in line
    (tmp_path / "empty").mkdir()
    line = assert_one_line_error(*critical_batch(tmp_path / "empty"))
    assert "has no checkpoint" in line and "train it first" in line
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("batch", "seq_len", 16, "its seq_len is 32, the branch's 16"),
        ("model", "preset", "nano", "its model differs from the branch's (n_layer 2 -> 4"),
        ("data", "data", "other corpus", "the branch's data differs from the parent's"),
    ],
)
def test_the_branch_mode_refuses_a_parent_of_another_model_sequence_length_or_data(
    parent: Path, tmp_path: Path, section: str, key: str, value: object, expected: str
) -> None:
    from bigbatch.errors import CheckpointError
    from bigbatch.run.checkpoints.checkpoint import latest_valid_checkpoint, load_checkpoint
    from bigbatch.run.configuration.config_sources import config_from_dict
    from bigbatch.run.loop.trainer import Trainer

    checkpoint = latest_valid_checkpoint(parent)
    assert checkpoint is not None
    config = config_from_dict(load_checkpoint(checkpoint)["config"])
    config.run.out = str(tmp_path / "branch")
    if value == "other corpus":
        value = tmp_path / "other.txt"
        value.write_bytes(corpus_bytes(30_000)[::-1])
        value = str(value)
    setattr(getattr(config, section), key, value)
    with pytest.raises(CheckpointError) as caught:
        Trainer(config, branch_from=checkpoint)
    assert expected in str(caught.value)
    assert not (tmp_path / "branch").exists()


@pytest.mark.slow
def test_the_critical_batch_over_a_run_and_a_ramp_that_follows_it(tmp_path: Path) -> None:
    """``--every 2`` measures at the run's checkpoints at steps 2 and 4 (kept: --keep-checkpoints 0), writes the
    curve with the noise scale beside it; a new run with ``--batch-ramp from:RUN`` takes the measured sizes as a
    function of its tokens seen; too few checkpoints is one line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    run_dir = tmp_path / "parent"
    code, out, err = run_main([*train_args(corpus, run_dir, 4), "--save-every", "2", "--keep-checkpoints", "0"])
    assert code == 0, out + err
    code, out, err = critical_batch(run_dir, [64, 128], 256, "--every", "2", "--eval-batches", "1")
    assert code == 0, out + err
    curve = json.loads((run_dir / "critical-batch" / "over-run-sqrt-beta2.json").read_text())
    assert [p["step"] for p in curve["points"]] == [2, 4]
    assert [p["tokens_seen"] for p in curve["points"]] == [2 * PARENT_TPS, 4 * PARENT_TPS]
    for point, step in zip(curve["points"], [2, 4], strict=True):
        result = json.loads((run_dir / "critical-batch" / f"step_{step:07d}-sqrt-beta2" / "result.json").read_text())
        assert point["critical_tokens_per_step"] == point["low"] == result["critical_tokens_per_step"]
        assert point["high"] == (0 if result["bound"] == "at least" else 128)
    assert (run_dir / "critical-batch" / "over-run-sqrt-beta2.png").stat().st_size > 0
    assert "critical batch over the run" in out and "noise scale" in out
    assert f"{2 * PARENT_TPS:,}" in out and f"{4 * PARENT_TPS:,}" in out

    follower = tmp_path / "follower"
    code, out, err = run_main([*train_args(corpus, follower, 4), "--batch-ramp", f"from:{run_dir}"])
    assert code == 0, out + err
    sizes = [max(64, p["low"]) for p in curve["points"]]  # at most the run's 128 tokens per step
    expected, seen = [], 0
    for _ in range(4):
        wanted = max([sizes[0]] + [s for p, s in zip(curve["points"], sizes, strict=True) if p["tokens_seen"] <= seen])
        expected.append(min(128, wanted) // 64)
        seen += expected[-1] * 64
    assert [r["micro_batches"] for r in step_records(follower)] == expected
    assert f"batch ramp | from {run_dir}" in out

    code, out, err = critical_batch(run_dir, [64, 128], 256, "--every", "3")
    line = assert_one_line_error(code, out, err)
    assert "--every 3" in line and "--keep-checkpoints 0" in line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--lr-rule", "sqrt"), "--lr-rule is now --batch-change-rule"),
        (("--every", "2", "--step", "2"), "--every measures at several checkpoints and --step at one"),
        (("--batch-change-rule", "constant"), "invalid choice: 'constant'"),
    ],
)
def test_renamed_and_contradictory_flags_are_one_line_errors(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    code, out, err = critical_batch(tmp_path / "run", SIZES, BUDGET, *extra)
    assert message in assert_one_line_error(code, out, err)
