"""TensorBoard and W&B (offline) through a crash: a run killed in step 5 (checkpoint at step 3, step 4 already
logged) and resumed by the same command. Read back with the packages' own readers, each logger holds exactly
what metrics.jsonl holds: every step once, no point of the lost step 4 left twice, one W&B run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import corpus_bytes
from logger_readers import metrics_records, tensorboard_scalars, wandb_offline_env, wandb_run

STEPS = 6


def train(corpus: Path, run_dir: Path, env: dict[str, str], fault: str | None = None) -> subprocess.CompletedProcess:
    args = [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
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
        "--save-every",
        "3",
        "--noise-scale-every",
        "2",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(corpus.parent / "cache"),
        "--out",
        str(run_dir),
        "--tensorboard",
        "--wandb",
        "proj",
    ]
    env = {**env, "BIGBATCH_FAULT": fault} if fault else {k: v for k, v in env.items() if k != "BIGBATCH_FAULT"}
    return subprocess.run(
        [sys.executable, "-m", "bigbatch", *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loggers")
    corpus = root / "text.txt"
    corpus.write_bytes(corpus_bytes(60_000))
    # No WANDB_* of this process: an in-process W&B run earlier in the session leaves WANDB_SERVICE, which would
    # attach the subprocesses to its service (and the killed one's run would stay open there).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env = {**clean, "OMP_NUM_THREADS": "1", "BIGBATCH_CACHE": str(root / "env-cache"), **wandb_offline_env(root)}
    run_dir = root / "run"
    killed = train(corpus, run_dir, env, fault="kill:step=5")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "step 4 | loss" in killed.stdout  # logged after the checkpoint at step 3, then lost
    resumed = train(corpus, run_dir, env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "at step 3" in resumed.stdout
    return run_dir


def _expected(run_dir: Path) -> tuple[list[dict], list[dict]]:
    records = metrics_records(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)) and [r["step"] for r in evals] == [3, 6]
    assert any("noise_scale" in r for r in steps)  # the noise-scale fields are among those compared
    return steps, evals


def _numeric(record: dict) -> dict[str, float]:
    return {
        k: v
        for k, v in record.items()
        if k not in ("kind", "step", "skipped") and isinstance(v, int | float) and not isinstance(v, bool)
    }


@pytest.mark.slow
def test_tensorboard_curves_are_metrics_jsonl_after_a_kill_and_resume(resumed_run: Path) -> None:
    steps, evals = _expected(resumed_run)
    scalars = tensorboard_scalars(resumed_run / "tensorboard")
    fields = sorted({key for r in steps for key in _numeric(r)})
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "micro_batches", "noise_scale"} <= set(fields)
    for key in fields:
        want = [(r["step"], pytest.approx(r[key], rel=1e-6, nan_ok=True)) for r in steps if key in r]
        assert scalars[f"train/{key}"] == want, key  # every step once, in order: nothing of the lost step 4 twice
    assert scalars["val/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in evals]
    seen = [sum(r["tokens"] for r in steps[:i]) for i in range(1, STEPS + 1)]
    assert [v for _, v in scalars["train/tokens_seen"]] == seen
    assert scalars["by_tokens/loss"] == [
        (n, pytest.approx(r["loss"], rel=1e-6)) for n, r in zip(seen, steps, strict=True)
    ]
    assert [s for s, _ in scalars["by_tokens/val_loss"]] == [seen[2], seen[5]]
    assert "train/skipped_steps" not in scalars


@pytest.mark.slow
def test_wandb_offline_run_is_metrics_jsonl_after_a_kill_and_resume(resumed_run: Path) -> None:
    steps, evals = _expected(resumed_run)
    run_id, logged = wandb_run(resumed_run)
    sessions = sorted(p.name for p in (resumed_run / "wandb").iterdir() if p.is_dir() and not p.is_symlink())
    assert len(sessions) == 2 and all(name.startswith("offline-run-") and name.endswith(run_id) for name in sessions)
    assert [row["_step"] for row in logged.rows] == list(range(1, STEPS + 1))  # one W&B run, each step once
    for row, record in zip(logged.rows, steps, strict=True):
        assert {k: row[f"train/{k}"] for k in _numeric(record)} == pytest.approx(_numeric(record), nan_ok=True)
    assert {row["_step"]: row["val/loss"] for row in logged.rows if "val/loss" in row} == {
        r["step"]: r["val_loss"] for r in evals
    }
    assert logged.config["run"]["max_steps"] == STEPS and logged.config["model"]["preset"] == "pico"
    assert logged.config_records == 1  # recorded once (the killed session's file lost it: the resumed one did)


@pytest.mark.slow
def test_a_resumed_wandb_session_logs_no_step_twice_and_the_config_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process: a session that ended cleanly after step 3, resumed from a checkpoint at step 2 with one
    setting changed: step 3 (replayed) is not logged again, step 4 is; one W&B run; the config once, then only
    the changed setting."""
    from bigbatch.engine.accumulate import StepRecord
    from bigbatch.observe.metrics import open_metrics, truncate_metrics

    for key, value in wandb_offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    sink = open_metrics(run_dir, wandb_project="proj", config={"a": 1, "b": 2})
    for step in (1, 2, 3):
        sink.write_step(StepRecord(step, 5.0 - step, 0.5, 1e-3, 64, 2, 0.1))
    sink.close()
    truncate_metrics(run_dir, 2)
    sink = open_metrics(run_dir, wandb_project="proj", config={"a": 1, "b": 3})
    for step in (3, 4):
        sink.write_step(StepRecord(step, 5.0 - step, 0.5, 1e-3, 64, 2, 0.1))
    sink.close()
    run_id, logged = wandb_run(run_dir)
    assert len([p for p in (run_dir / "wandb").iterdir() if p.name.endswith(run_id) and not p.is_symlink()]) == 2
    assert [(row["_step"], row["train/loss"]) for row in logged.rows] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    assert logged.config == {"a": 1, "b": 3} and logged.config_records == 2  # all once, then only "b"
