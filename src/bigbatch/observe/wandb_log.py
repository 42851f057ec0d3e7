"""A Weights & Biases run for a bigbatch run; ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it).

* Files go to ``RUN_DIR/wandb/`` (one directory per session of the run, as W&B lays them out).
* The W&B run id is kept in ``RUN_DIR/wandb.json``: a resumed bigbatch run resumes the same W&B run
  (``resume="allow"``; offline, each session is a fragment of that run, which ``wandb sync`` uploads in order).
  A fresh start (nothing in ``metrics.jsonl``) or another project starts a new W&B run.
* The config is recorded once, when the W&B run is created; a resumed session records only the settings that
  changed (e.g. ``max_steps``).
* Curves: those of :mod:`bigbatch.observe.scalars` against the optimizer step (W&B's own x-axis; ``train/tokens_seen``
  can be chosen as the x-axis in its UI), without the ``by_tokens/`` copies.
* Resume: W&B steps only go forward, and W&B buffers its file (a killed process loses its whole session, config
  included), so a resumed session first reads what the earlier sessions' files hold; it logs from
  ``metrics.jsonl`` the steps they lost, does not log again the steps they hold (replayed after the checkpoint:
  the same values, the resume being exact), and records the config if it was lost. The W&B run so holds what
  ``metrics.jsonl`` holds, each step once.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.engine.accumulate import StepRecord
from bigbatch.errors import require_package
from bigbatch.files.atomic import write_json_atomically
from bigbatch.observe.scalars import BY_TOKENS, Point, ScalarSeries, eval_values, step_values

log = logging.getLogger(__name__)

EXIT_WAIT_SECONDS = 30.0
STATE_FILE = "wandb.json"
"""In the run directory: the W&B project, run id and recorded config."""

_LOG_HEADER = b":W&B"
_BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf Records in blocks of this size
_RECORD_HEADER = 7  # crc32 (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """The serialized ``wandb_internal_pb2.Record`` s of one ``.wandb`` file, in order; a record cut short by a
    crash ends the file."""
    data = path.read_bytes()
    if data[:4] != _LOG_HEADER:
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + _RECORD_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER:  # the rest of a block too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        chunk = data[pos + _RECORD_HEADER : pos + _RECORD_HEADER + length]
        if kind == 0 or len(chunk) < length:
            break  # zeros past the end, or a record cut short
        pos += _RECORD_HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of the W&B run ``run_id`` under ``wandb_dir``, one per session, oldest first."""
    if not wandb_dir.is_dir():
        return []
    files = [
        p / f"run-{run_id}.wandb"
        for p in wandb_dir.iterdir()
        if p.is_dir() and not p.is_symlink() and p.name.endswith(f"-{run_id}")
    ]
    return sorted((f for f in files if f.is_file()), key=lambda f: f.parent.name.split("run-", 1)[-1])


@dataclass
class LoggedRun:
    """What the ``.wandb`` files of a W&B run hold (read with W&B's own record format, ``wandb.proto``)."""

    rows: list[dict[str, Any]] = field(default_factory=list)  # history rows, ``{key: value}`` with ``_step``
    config: dict[str, Any] = field(default_factory=dict)  # the recorded config, W&B's ``_wandb`` left out
    config_records: int = 0  # records that set config values

    @property
    def last_step(self) -> int:
        return max((int(row["_step"]) for row in self.rows if "_step" in row), default=0)


def read_logged_run(wandb_dir: Path, run_id: str) -> LoggedRun:
    """The history and config that the W&B run ``run_id``'s files under ``wandb_dir`` hold, all sessions."""
    from wandb.proto import wandb_internal_pb2

    found = LoggedRun()
    for path in run_files(wandb_dir, run_id):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                found.rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind in ("run", "config"):
                items = record.run.config.update if kind == "run" else record.config.update
                values = {item.key: json.loads(item.value_json) for item in items if item.key != "_wandb"}
                found.config.update(values)
                found.config_records += bool(values)
    return found


def _next_second(wandb_dir: Path, run_id: str) -> None:
    """Wait (at most a second) until no session directory of ``run_id`` is named after the current second: W&B
    names them ``...-YYYYMMDD_HHMMSS-ID``, and a second session started in the same second would share one."""
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and any(wandb_dir.glob(f"*-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}")):
        time.sleep(0.05)


def new_run_id() -> str:
    """Eight characters of ``[a-z0-9]``, as W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLog:
    """A :class:`~bigbatch.observe.metrics.MetricsSink` logging to W&B project ``project``; ``history``: the records of
    ``metrics.jsonl`` so far (empty for a fresh start)."""

    def __init__(
        self,
        project: str,
        run_dir: Path | str,
        config: dict[str, Any] | None = None,
        history: list[dict[str, Any]] | None = None,
    ) -> None:
        self.wandb = require_package("wandb", f"run.wandb (--wandb {project})", "wandb")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        history = history or []
        config = json.loads(json.dumps(config or {}, default=str))
        state = self._state()
        resume = bool(history) and state.get("project") == project and bool(state.get("id"))
        run_id = str(state["id"]) if resume else new_run_id()
        logged = LoggedRun()
        if resume:
            try:
                logged = read_logged_run(self.run_dir / "wandb", run_id)
            except (OSError, ValueError) as exc:
                log.warning("cannot read the earlier W&B files of run %s (%s); steps may be logged twice", run_id, exc)
        self.logged_through = logged.last_step  # steps at or below this are in the W&B run's files already
        if resume:
            _next_second(self.run_dir / "wandb", run_id)
        self.run = self.wandb.init(
            project=project,
            dir=str(self.run_dir),
            name=self.run_dir.name,
            id=run_id,
            resume="allow",
            config=None if logged.config else config,
        )
        changed = {key: value for key, value in config.items() if logged.config.get(key) != value}
        if logged.config and changed:
            self.run.config.update(changed, allow_val_change=True)
        self._save_state({"project": project, "id": run_id})
        self.series = ScalarSeries()
        for record in history:  # the steps the earlier sessions' files lost, from metrics.jsonl
            self._log(int(record.get("step", 0)), self.series.points(record))

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self, state: dict[str, Any]) -> None:
        path = self.run_dir / STATE_FILE
        write_json_atomically(path, state, indent=1)

    def _log(self, step: int, points: list[Point]) -> None:
        if step <= self.logged_through:
            return  # replayed after a resume: already in the run
        values = {p.tag: p.value for p in points if not p.tag.startswith(BY_TOKENS)}
        if values:
            self.run.log(values, step=step)

    def write_step(self, record: StepRecord, mfu: float | None = None) -> None:
        self._log(record.step, self.series.points({"kind": "step", **step_values(record, mfu)}))

    def write_eval(
        self, step: int, val_loss: float, val_tokens: int | None = None, values: Mapping[str, float] | None = None
    ) -> None:
        self._log(step, self.series.points({"kind": "eval", **eval_values(step, val_loss, val_tokens, values)}))

    def close(self) -> None:
        path = Path(self.run.dir).parent / f"run-{self.run.id}.wandb"  # this session's file
        writes = str(getattr(self.run.settings, "mode", "")) != "disabled"  # WANDB_MODE=disabled writes nothing
        self.run.finish()
        if writes:
            wait_for_exit_record(path)


def wait_for_exit_record(path: Path, timeout: float = EXIT_WAIT_SECONDS) -> bool:
    """Wait until W&B's service has written the run's last record (``finish()`` can return before it has, when
    the process goes on, and a next session reads these files); ``False`` after ``timeout`` seconds."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        try:
            for data in wandb_records(path):
                record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "exit":
                    return True
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            log.warning("W&B has not finished writing %s after %.0f s", path, timeout)
            return False
        time.sleep(0.05)
