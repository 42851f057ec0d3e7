"""Atomic writes (bigbatch/files/atomic.py): a file is the old one or the whole new one, never half of either,
and every file bigbatch rewrites in place goes through them."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from bigbatch.files import atomic as atomic_file
from bigbatch.files.atomic import write_atomically, write_json_atomically, write_text_atomically

SRC = Path(atomic_file.__file__).resolve().parent.parent  # src/bigbatch


def test_write_text_atomically_replaces_the_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old content that is longer than the new one\n")
    write_text_atomically(target, "new\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize("indent", [2, 1, None])
def test_write_json_atomically_writes_what_json_dumps_gives_and_a_newline(tmp_path: Path, indent: int | None) -> None:
    """The same bytes as the ``write_text_atomically(path, json.dumps(payload, indent=...) + "\\n")`` it replaces."""
    payload = {"b": [1, 2.5, None], "a": {"nested": True}, "text": "caf\u00e9"}
    write_json_atomically(tmp_path / "out.json", payload, indent=indent)
    assert (tmp_path / "out.json").read_text() == json.dumps(payload, indent=indent) + "\n"
    write_json_atomically(tmp_path / "default.json", payload)
    assert (tmp_path / "default.json").read_text() == json.dumps(payload, indent=2) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default.json", "out.json"]


def test_the_new_file_gets_the_mode_the_umask_gives(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_text_atomically(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o640  # not mkstemp's 0600


def test_a_write_that_fails_halfway_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "metrics.jsonl"
    target.write_text('{"step": 1}\n')

    def half_then_fail(handle: Any) -> None:
        handle.write(b'{"step": 2')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, half_then_fail)
    assert target.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_an_interrupt_during_the_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "config.toml"
    target.write_text("seed = 1\n")

    def interrupted(handle: Any) -> None:
        handle.write(b"seed =")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert target.read_text() == "seed = 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_the_data_and_the_rename_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's data before the rename, then its directory after: else a power cut can leave an empty file
    under the new name (ext4 delayed allocation) or the old name back."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(atomic_file.os, "fsync", fsync)
    monkeypatch.setattr(atomic_file.os, "replace", replace)
    write_text_atomically(tmp_path / "f.json", "{}")
    assert events == ["fsync file", "rename", "fsync dir"]


# Where bigbatch may still rename or write a file directly, and why that is safe.
DIRECT_WRITES_ALLOWED = {
    "files/atomic.py": "the atomic writer itself",
    "data/writer.py": "files inside a staging directory, renamed into place as a whole",
    "data/resumable.py": "a staging directory renamed into place, and its append-only token stream",
    "data/answer_prepare.py": "the token stream of rows of answers inside a staging directory, renamed into place",
    "models/hf_files.py": "files inside a staging directory, renamed into place as a whole",
    "data/tokenizer_files.py": "files inside a staging directory, renamed into place as a whole",
    "parallel/launch.py": "one-shot notes from a worker to its launcher in a private temporary folder",
    "sizing/memory.py": "/proc/self/clear_refs, not a file",
    "observe/metrics.py": "the append-only metrics log (a cut last line is skipped on read)",
    "artifacts/export.py": "a whole export folder, written beside OUT under a hidden name and renamed into place once",
    "files/lock.py": "a lock file: its holder's own record, complete before a rename puts it over a dead holder's",
}
DIRECT = re.compile(r"os\.replace\(|os\.rename\(|\.write_text\(|\.write_bytes\(|open\([^)]*[\"'][wa]b?[\"']")


def test_every_file_bigbatch_rewrites_goes_through_the_atomic_writer() -> None:
    """The class, not the example: no module renames or writes a file in place unless it is listed above with
    the reason that is safe (a new module that does must use files/atomic.py or say why here)."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name in DIRECT_WRITES_ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert offenders == [], "write these through bigbatch.files.atomic:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(DIRECT_WRITES_ALLOWED))
def test_each_allowed_module_still_exists(name: str) -> None:
    assert (SRC / name).is_file(), f"{name} is gone: drop it from DIRECT_WRITES_ALLOWED"


def test_a_missing_folder_is_reported_with_the_name_asked_for(tmp_path: Path) -> None:
    target = tmp_path / "no-such-folder" / "report.json"
    with pytest.raises(FileNotFoundError) as caught:
        write_text_atomically(target, "{}")
    assert caught.value.filename == str(target)  # not the temporary file's name
    assert not (tmp_path / "no-such-folder").exists()
