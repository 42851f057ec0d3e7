"""Where commands write: never into someone else's directory, never over an existing file unasked.

A directory that bigbatch creates for its output (a run, a report) gets a small
marker file; a later command may write into an existing, non-empty directory
only when it finds that marker (or, for directories made before markers
existed, the unmistakable files of the same kind of output). A single output
file (a plot, a JSON report) is never replaced unless the user passes the flag
that says so. Every check runs before the work whose result would be written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bigbatch import __version__
from bigbatch.errors import ConfigError, require_creatable_dir
from bigbatch.files.atomic import write_json_atomically

RUN_MARKER = ".bigbatch-run"
RUN_LOCK = ".bigbatch-lock"  # held while a process trains in the run (see bigbatch.run.loop.run_dir_lock)
REPORT_MARKER = ".bigbatch-report"


def is_legacy_run(path: Path) -> bool:
    """A run directory without a marker: from before markers (it holds bigbatch's checkpoints or metrics log), or
    one a run has just created and holds (its lock)."""
    return (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file() or (path / RUN_LOCK).is_file()


def is_bigbatch_run(path: Path) -> bool:
    """Whether ``path`` is a bigbatch run directory: its marker, or the checkpoints, metrics or lock of one."""
    return (path / RUN_MARKER).is_file() or is_legacy_run(path)


def require_own_run_dir(path: Path) -> None:
    """Refuse ``--out path`` unless it is new, empty or a bigbatch run (see :func:`require_own_dir`)."""
    require_own_dir(path, "run directory", "--out", RUN_MARKER, is_legacy_run)


def is_legacy_report(path: Path) -> bool:
    """A report directory from before markers: only ``summary.txt`` and PNG plots."""
    names = [p.name for p in path.iterdir()]
    return "summary.txt" in names and all(n == "summary.txt" or n.endswith(".png") for n in names)


def require_own_dir(
    path: Path, what: str, flag: str, marker: str, legacy: Callable[[Path], bool] | None = None
) -> None:
    """Refuse ``path`` if it is a file, or an existing non-empty directory that bigbatch did not create."""
    require_creatable_dir(path, what)
    if not path.is_dir() or not any(path.iterdir()):
        return
    if (path / marker).is_file() or (legacy is not None and legacy(path)):
        return
    raise ConfigError(
        f"{what} {path} already exists, is not empty and was not made by bigbatch; nothing was written to it: "
        f"choose a new or empty directory with {flag}"
    )


def mark_own_dir(path: Path, marker: str, kind: str) -> None:
    """Create ``path`` (if needed) and leave the marker that lets bigbatch write into it again."""
    path.mkdir(parents=True, exist_ok=True)
    target = path / marker
    if not target.exists():
        write_json_atomically(target, {"made_by": f"bigbatch {__version__}", "kind": kind}, indent=None)


def require_new_file(path: Path, flag: str, overwrite: bool, overwrite_flag: str = "--overwrite") -> None:
    """Refuse to write ``path`` if it exists (unless ``overwrite``) or if it cannot be created."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not overwrite:
        raise ConfigError(f"{flag} {path} already exists; choose another name, or pass {overwrite_flag} to replace it")
    require_creatable_dir(path.parent, f"the directory of {flag}")
