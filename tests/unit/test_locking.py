"""The lock file under every writer: one holder, named when busy, taken over when its holder died, and gone
after a clean release."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from bigbatch.files.lock import (
    INHERITED_ENV,
    FileLock,
    Holder,
    LockBusy,
    acquire,
    environment_for_workers,
    inherited,
    read_holder,
    this_process,
)
from bigbatch.parallel.signals import StopRequest

HOLD_IN_CHILD = """
import sys, time
from pathlib import Path
from bigbatch.files.lock import acquire
lock = acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def hold_in_child(path: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD_IN_CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_second_holder_is_refused_with_the_first_ones_name(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with acquire(path) as lock:
        assert lock.held and read_holder(path) == lock.holder
        assert lock.holder.pid == os.getpid() and lock.stale is None
        with pytest.raises(LockBusy) as busy:
            acquire(path)  # another open file description: refused within one process too
        assert busy.value.holder == lock.holder
        assert f"pid {os.getpid()} on host " in str(busy.value)
    assert not path.exists()  # a clean release removes the file
    with acquire(path) as again:
        assert again.stale is None  # nothing was left behind to take over


def test_a_lock_whose_holder_was_killed_is_taken_over_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    child = hold_in_child(path)
    try:
        with pytest.raises(LockBusy) as busy:
            acquire(path)
        assert busy.value.holder is not None and busy.value.holder.pid == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert path.exists()  # a killed holder leaves its record behind
    with acquire(path) as lock:
        assert lock.stale is not None and lock.stale.pid == child.pid
        assert read_holder(path) == lock.holder


def test_waiting_takes_the_lock_once_it_is_released(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    first = acquire(path)
    seen: list[Holder | None] = []
    threading.Timer(0.3, first.release).start()
    started = time.monotonic()
    with acquire(path, wait=True, on_wait=seen.append, poll=0.05) as second:
        assert second.held and time.monotonic() - started >= 0.25
    assert seen == [first.holder]  # told once whom it waits for


def test_a_released_and_removed_file_is_never_held_twice(tmp_path: Path) -> None:
    """Many threads taking and releasing in turn: at any moment at most one holds the name."""
    path = tmp_path / "lock"
    holding: list[int] = []
    overlaps: list[int] = []

    def worker(n: int) -> None:
        for _ in range(20):
            with acquire(path, wait=True, poll=0.001):
                holding.append(n)
                if len(holding) > 1:
                    overlaps.append(n)
                time.sleep(0.0005)
                holding.remove(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [] and not path.exists()


def race(path: Path, threads: int) -> tuple[int, list[Holder | None]]:
    """``threads`` threads take the lock at once (no waiting); how many got it and the refusals' holders."""
    start = threading.Barrier(threads)
    won: list[FileLock] = []
    refused: list[Holder | None] = []

    def attempt() -> None:
        start.wait()
        try:
            won.append(acquire(path))
        except LockBusy as busy:
            refused.append(busy.holder)

    workers = [threading.Thread(target=attempt) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for lock in won:
        lock.release()
    return len(won), refused


def test_every_refusal_of_a_lock_taken_at_the_same_moment_names_its_holder(tmp_path: Path) -> None:
    """The lock is never visible before its record: a process that finds it held always learns who holds it
    (an empty record used to say "another process" when the second came between the first's lock and write)."""
    path = tmp_path / "lock"
    refusals = 0
    for _ in range(150):
        won, refused = race(path, threads=6)
        assert won == 1
        assert all(holder is not None and holder.pid == os.getpid() for holder in refused), refused
        refusals += len(refused)
        assert not path.exists() and list(tmp_path.iterdir()) == []  # no record left beside it either
    assert refusals == 150 * 5


def test_a_dead_holders_lock_taken_over_at_the_same_moment_names_the_live_holder(tmp_path: Path) -> None:
    """While one process takes over a dead holder's file, the others are refused with the new holder's name,
    never the dead one's."""
    path = tmp_path / "lock"
    no_process = 2**22  # above any pid Linux (at most 2**22 - 1) or macOS hands out: never alive
    for _ in range(100):
        record = Holder(this_process().host, no_process, 0.0, "bigbatch train", "gone")
        path.write_text(json.dumps(asdict(record)) + "\n")  # left by a holder that was killed
        won, refused = race(path, threads=6)
        assert won == 1
        assert all(holder is not None and holder.pid == os.getpid() for holder in refused), refused


def test_workers_recognise_the_lock_their_launcher_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lock"
    assert inherited(path) is None
    with acquire(path) as lock:
        monkeypatch.setenv(INHERITED_ENV, environment_for_workers(lock)[INHERITED_ENV])
        found = inherited(path)
        assert found is not None and not found.held and found.holder == lock.holder
        found.release()  # a worker never releases its launcher's lock
        assert read_holder(path) == lock.holder
        assert inherited(tmp_path / "other") is None
    assert inherited(path) is None  # the token no longer matches a file


def test_holder_record_round_trips_and_reads_well() -> None:
    holder = this_process("bigbatch train --model nano")
    assert Holder.parse('{"host": 1}') is None and Holder.parse("") is None
    text = Holder(holder.host, 42, 0.0, "bigbatch train", "t").describe(now=150.0)
    assert text == f"pid 42 on host {holder.host} since 1970-01-01 00:00:00 UTC, 2 min ago: bigbatch train"


def test_the_first_stop_is_announced_at_once_and_a_double_tap_is_one_press() -> None:
    now = [100.0]
    announced: list[int] = []
    stop = StopRequest(announced.append, clock=lambda: now[0])
    stop._handle(signal.SIGINT, None)
    assert stop.signum == signal.SIGINT and announced == [signal.SIGINT]
    now[0] += 0.5
    stop._handle(signal.SIGINT, None)  # within the grace: the same press, still stopping politely
    stop._handle(signal.SIGTERM, None)  # a second SIGTERM: already stopping
    assert announced == [signal.SIGINT]
    now[0] += 1.0
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)  # a real second Ctrl-C: abort
