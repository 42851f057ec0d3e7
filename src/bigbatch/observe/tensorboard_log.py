"""TensorBoard scalars in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``).

The curves are those of :mod:`bigbatch.observe.scalars`: ``train/*`` and ``val/loss`` against the optimizer step,
``by_tokens/*`` against tokens seen. Event files are flushed after every step, and when the logger opens, the
event files already there are made to hold exactly what ``metrics.jsonl`` holds (which the trainer has cut
back to the checkpoint it resumes from, or emptied for a fresh start): points written after that checkpoint
by a run that crashed are dropped, points lost with it (not yet flushed) are written again from
``metrics.jsonl``, and the kept points keep their wall times. A resumed run so continues the same curves
without a duplicate point, for any reader (TensorBoard's purge-on-restart is not needed).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bigbatch.engine.accumulate import StepRecord
from bigbatch.errors import require_package
from bigbatch.files.atomic import write_atomically
from bigbatch.observe.scalars import Point, ScalarSeries, eval_values, step_values

log = logging.getLogger(__name__)

FEATURE = "run.tensorboard (--tensorboard)"
PIP_NAME = "tensorboard"
EVENTS_MARK = "tfevents"
"""TensorBoard reads the files whose name holds this."""


class TensorBoardLog:
    """A :class:`~bigbatch.observe.metrics.MetricsSink` writing TensorBoard event files; ``history``: the records of
    ``metrics.jsonl`` so far (the run's earlier sessions)."""

    def __init__(self, log_dir: Path | str, history: list[dict[str, Any]] | None = None) -> None:
        module = require_package("torch.utils.tensorboard", FEATURE, PIP_NAME)
        self.log_dir = Path(log_dir)
        self.series = ScalarSeries(history or [])
        reconcile_event_files(self.log_dir, self.series.history)
        self.writer = module.SummaryWriter(log_dir=str(self.log_dir))

    def _write(self, points: list[Point]) -> None:
        for point in points:
            self.writer.add_scalar(point.tag, point.value, point.step)
        self.writer.flush()  # a crash loses no step: what is on disk matches metrics.jsonl

    def write_step(self, record: StepRecord, mfu: float | None = None) -> None:
        self._write(self.series.points({"kind": "step", **step_values(record, mfu)}))

    def write_eval(
        self, step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
    ) -> None:
        self._write(self.series.points({"kind": "eval", **eval_values(step, val_loss, val_tokens, values)}))

    def close(self) -> None:
        self.writer.close()


def event_files(log_dir: Path) -> list[Path]:
    """TensorBoard's event files in ``log_dir``, in the order TensorBoard reads them (by name)."""
    if not log_dir.is_dir():
        return []
    return sorted(p for p in log_dir.iterdir() if EVENTS_MARK in p.name and p.is_file())


def read_scalar_events(path: Path) -> list[Any]:
    """The events of one event file (``tensorboard.compat.proto.event_pb2.Event``), as written; a record cut
    short by a crash ends the file."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    events = []
    for data in RawEventFileLoader(str(path)).Load():
        event = event_pb2.Event()
        event.ParseFromString(data)
        events.append(event)
    return events


def _scalar_key(event: Any) -> tuple[str, int] | None:
    if event.WhichOneof("what") != "summary" or len(event.summary.value) != 1:
        return None
    value = event.summary.value[0]
    return (value.tag, int(event.step)) if value.WhichOneof("value") == "simple_value" else None


def reconcile_event_files(log_dir: Path, expected: list[Point]) -> None:
    """Make the event files in ``log_dir`` hold the ``expected`` points, in order, and nothing else (see the
    module's note); untouched when they already do."""
    files = event_files(log_dir)
    if not files:
        return
    try:
        events = [event for path in files for event in read_scalar_events(path)]
    except Exception as exc:  # a damaged file: rewritten from metrics.jsonl
        log.warning(
            "cannot read the TensorBoard event files in %s (%s); writing them again from metrics.jsonl", log_dir, exc
        )
        events = []
    found: dict[tuple[str, int], list[Any]] = {}
    for event in events:
        key = _scalar_key(event)
        if key is not None:
            found.setdefault(key, []).append(event)
    wanted = Counter((p.tag, p.step) for p in expected)
    if events and all(len(found.get(key, ())) == n for key, n in wanted.items()) and set(found) <= set(wanted):
        return  # nothing missing, nothing extra
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    now = time.time()
    used: Counter[tuple[str, int]] = Counter()
    kept, restored = [], 0
    for point in expected:
        key = (point.tag, point.step)
        previous = found.get(key, [])
        if used[key] < len(previous):
            kept.append(previous[used[key]])
        else:  # lost by the crash before it was flushed: from metrics.jsonl, stamped now
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=point.tag, simple_value=point.value)])
            kept.append(event_pb2.Event(wall_time=now, step=point.step, summary=summary))
            restored += 1
        used[key] += 1
    first_time = min([e.wall_time for e in kept] + [now])
    header = event_pb2.Event(wall_time=first_time, step=0, file_version="brain.Event:2")
    # Named to sort before the event file the new writer opens (TensorBoard reads files in name order).
    target = log_dir / f"events.out.{EVENTS_MARK}.{int(first_time):010d}.bigbatch.0"

    def write_events(handle: Any) -> None:
        writer = RecordWriter(handle)
        for event in [header, *kept]:
            writer.write(event.SerializeToString())
        writer.flush()

    write_atomically(target, write_events)
    for path in files:
        if path != target:
            path.unlink()
    dropped = sum(len(v) for v in found.values()) - (len(kept) - restored)
    log.info(
        "TensorBoard event files in %s made to match metrics.jsonl: %d points after the checkpoint dropped, "
        "%d lost ones written again",
        log_dir,
        dropped,
        restored,
    )
