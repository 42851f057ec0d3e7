"""The curves a metrics.jsonl record gives (bigbatch/observe/scalars.py), and TensorBoard's event files made to match
metrics.jsonl on resume (bigbatch/observe/tensorboard_log.py), read back with TensorBoard's own reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bigbatch.observe.scalars import Point, ScalarSeries

STEP = {
    "kind": "step",
    "step": 1,
    "loss": 2.5,
    "grad_norm": 0.5,
    "lr": 1e-3,
    "tokens": 100,
    "micro_batches": 4,
    "dt": 0.1,
    "skipped": False,
    "tokens_per_s": 1000.0,
}


def test_a_step_gives_every_numeric_field_tokens_seen_and_the_by_tokens_curve() -> None:
    series = ScalarSeries([STEP])
    second = {**STEP, "step": 2, "loss": 2.0, "mfu": 0.25, "noise_scale": 512.0}
    points = series.points(second)
    assert Point("train/loss", 2, 2.0) in points and Point("train/mfu", 2, 0.25) in points
    assert Point("train/noise_scale", 2, 512.0) in points and Point("train/micro_batches", 2, 4.0) in points
    assert Point("train/tokens_seen", 2, 200.0) in points and Point("by_tokens/loss", 200, 2.0) in points
    assert not [p for p in points if p.tag in ("train/skipped", "train/step", "train/kind")]
    assert series.points({"kind": "eval", "step": 2, "val_loss": 1.5}) == [
        Point("val/loss", 2, 1.5),
        Point("by_tokens/val_loss", 200, 1.5),
    ]
    assert series.points({"kind": "eval", "step": 2, "val_loss": 1.5, "val_tokens": 4096}) == [
        Point("val/loss", 2, 1.5),
        Point("by_tokens/val_loss", 200, 1.5),
        Point("val/tokens", 2, 4096.0),
    ]


def test_a_skipped_step_adds_no_second_point_at_its_step() -> None:
    series = ScalarSeries([STEP])
    skipped = {**STEP, "loss": float("nan"), "tokens": 100, "skipped": True}  # keeps step 1
    assert series.points(skipped) == [Point("train/skipped_steps", 1, 1.0)]
    assert series.tokens_seen == 100  # no update: its tokens were not trained on
    assert series.points({**skipped, "step": 1})[0].value == 2.0


def test_event_files_are_made_to_match_metrics_jsonl(tmp_path: Path) -> None:
    """Points after the checkpoint are dropped, lost ones written again, kept ones keep their wall time; a
    directory that already matches is left untouched."""
    pytest.importorskip("tensorboard")
    from logger_readers import tensorboard_scalars
    from torch.utils.tensorboard import SummaryWriter

    from bigbatch.observe.tensorboard_log import event_files, read_scalar_events, reconcile_event_files

    log_dir = tmp_path / "tb"
    writer = SummaryWriter(str(log_dir))
    for step in (1, 2, 4, 5):  # step 3 lost (never flushed), 4 and 5 after the checkpoint at 3
        writer.add_scalar("train/loss", 10.0 - step, step, walltime=1000.0 + step)
    writer.close()
    expected = [Point("train/loss", step, 10.0 - step) for step in (1, 2, 3)]
    reconcile_event_files(log_dir, expected)
    assert tensorboard_scalars(log_dir) == {"train/loss": [(1, 9.0), (2, 8.0), (3, 7.0)]}
    (path,) = event_files(log_dir)
    times = [e.wall_time for e in read_scalar_events(path) if e.WhichOneof("what") == "summary"]
    assert times[:2] == [1001.0, 1002.0] and times[2] > 1005.0
    before = os.stat(path).st_mtime_ns
    reconcile_event_files(log_dir, expected)
    assert event_files(log_dir) == [path] and os.stat(path).st_mtime_ns == before
