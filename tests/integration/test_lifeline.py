"""``bigbatch train --nproc N``: the workers die with the launcher, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import corpus_bytes

from bigbatch.parallel.lifeline import LAUNCHER_ENV

pytestmark = pytest.mark.slow


def processes_of(launcher: int) -> list[int]:
    """Live (not zombie) processes started under ``launcher``: torchrun's agent and the workers carry its pid."""
    found = []
    needle = f"{LAUNCHER_ENV}={launcher}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def run_dir_files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def start_long_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(40_000))
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "bigbatch",
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
        "1000000",
        "--save-every",
        "1",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--keep-checkpoints",
        "2",
        "--nproc",
        "2",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(run),
    ]
    log = open(tmp_path / "launcher.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return launcher, run


def wait_for_checkpoint(launcher: subprocess.Popen, run: Path, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (run.is_dir() and any(run.rglob("step_*.commit"))):
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def test_sigkill_of_the_launcher_kills_every_worker_and_nothing_more_is_written(tmp_path: Path) -> None:
    launcher, run = start_long_run(tmp_path)
    try:
        wait_for_checkpoint(launcher, run, tmp_path / "launcher.log")
        children = processes_of(launcher.pid)
        assert len(children) >= 3, children  # torchrun's agent and two workers
        launcher.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait()
        while processes_of(launcher.pid) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        last_exit = time.monotonic() - killed
        print(f"launcher SIGKILL -> last worker gone: {last_exit:.3f}s")
        assert not processes_of(launcher.pid), (
            f"still alive 10 s after the launcher's SIGKILL: {processes_of(launcher.pid)}"
        )
        before = run_dir_files(run)
        time.sleep(3)
        assert run_dir_files(run) == before  # nothing new, nothing rewritten
    finally:
        for pid in processes_of(launcher.pid):  # clean up after a failure: only what this test started
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_sigterm_to_the_launcher_stops_the_workers_politely(tmp_path: Path) -> None:
    """A polite stop still reaches the workers through the launcher: they finish the step, save and exit."""
    launcher, run = start_long_run(tmp_path)
    try:
        wait_for_checkpoint(launcher, run, tmp_path / "launcher.log")
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
        log = (tmp_path / "launcher.log").read_text()
        assert code == 128 + signal.SIGTERM, log[-3000:]
        assert "stopped by SIGTERM after step" in log, log[-3000:]
        assert not processes_of(launcher.pid)
    finally:
        for pid in processes_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
