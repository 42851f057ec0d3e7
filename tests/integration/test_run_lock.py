"""One writer per run directory, with real processes: the same command twice (together, staggered, under
--nproc 2), a killed holder, --wait-for-lock, data prepared by two processes at once, and what Ctrl-C says."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.prepare import preparation_lock
from bigbatch.data.shards import is_prepared_dataset
from bigbatch.run.checkpoints.checkpoint import list_checkpoints
from bigbatch.run.loop.run_dir_lock import RUN_LOCK

pytestmark = pytest.mark.slow


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus_bytes(40_000))
    return path


def train_args(corpus: Path, out: Path, *extra: str, steps: int = 1_000_000) -> list[str]:
    return [
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
        "128",
        "--max-steps",
        str(steps),
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--noise-scale-every",
        "0",
        "--cache-dir",
        str(out.parent / "cache"),
        "--out",
        str(out),
        *extra,
    ]


class Run:
    """A ``bigbatch`` process with its output (stdout and stderr together) in a file."""

    def __init__(self, args: list[str], log: Path, fault: str = "") -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("BIGBATCH_FAULT", None)
        if fault:
            env["BIGBATCH_FAULT"] = fault
        self.log = log
        with open(log, "wb") as handle:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bigbatch", *args], env=env, stdout=handle, stderr=subprocess.STDOUT
            )

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 120) -> int:
        return self.process.wait(timeout=timeout)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None, f"ended ({self.process.returncode}) before {text!r}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{self.output}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step"]


def wait_for_steps(out: Path, n: int, runs: list[Run], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(steps_logged(out)) < n:
        assert all(r.process.poll() is None for r in runs), "\n".join(r.output for r in runs)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def refusal(run: Run, holder: Run, out: Path) -> str:
    """The one line a refused run printed: it names the directory and the holder's pid."""
    code = run.wait()
    lines = run.output.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in run.output, run.output
    line = lines[0]
    assert line.startswith(f"bigbatch: error: run directory {out} is in use by another bigbatch process (pid "), line
    assert f"pid {holder.process.pid} on host " in line and "--wait-for-lock" in line
    return line


def polite_stop(run: Run, out: Path) -> None:
    """SIGINT: the console says at once what happens, the step's line says it, a checkpoint is saved."""
    run.process.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.output
    text = run.output
    said = text.index("bigbatch: SIGINT: stopping after step ")
    assert "press Ctrl-C again to abort without saving" in text[said:]
    assert text.index("saved checkpoint", said) > said  # announced before the save, not after it
    announced = re.search(r"stopping after step (\d+) ", text[said:])
    stopped = re.search(r"stopped by SIGINT after step (\d+);", text)
    assert announced and stopped and announced.group(1) == stopped.group(1), text  # the step announced is kept
    lines = [line for line in text.splitlines() if "| stopping: saving a checkpoint" in line]
    # the step's line says it, unless the signal came after that line was written (between steps)
    assert all(line.startswith(f"step {stopped.group(1)} |") for line in lines), lines
    assert list_checkpoints(out)


def test_the_same_command_twice_at_once_trains_once(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    runs = [Run(train_args(corpus, out), tmp_path / f"{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(r.process.poll() is None for r in runs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = next(r for r in runs if r.process.poll() is not None)
        trains = next(r for r in runs if r is not refused)
        refusal(refused, trains, out)
        wait_for_steps(out, 3, [trains])
        polite_stop(trains, out)
    finally:
        for r in runs:
            r.stop()
    steps = steps_logged(out)
    assert steps == list(range(1, len(steps) + 1))  # each step once
    assert not (out / RUN_LOCK).exists()


def test_a_later_run_nproc_or_waiting_run_meets_the_holder(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = Run(train_args(corpus, out), tmp_path / "holder.log")
    others: list[Run] = []
    try:
        wait_for_steps(out, 2, [holder])
        before = steps_logged(out)
        others.append(Run(train_args(corpus, out), tmp_path / "second.log"))
        refusal(others[-1], holder, out)
        others.append(Run(train_args(corpus, out, "--nproc", "2"), tmp_path / "nproc.log"))
        refusal(others[-1], holder, out)
        assert steps_logged(out)[: len(before)] == before
        waiting = Run(train_args(corpus, out, "--wait-for-lock"), tmp_path / "waiting.log")
        others.append(waiting)
        waiting.wait_for(f"run directory {out} is in use by pid {holder.process.pid} on host ")
        polite_stop(holder, out)
        # the holder's last step, from its own words: the waiting run may already have logged more by now
        stopped_at = int(re.search(r"stopped by SIGINT after step (\d+)", holder.output).group(1))  # type: ignore[union-attr]
        waiting.wait_for(f"at step {stopped_at} (")  # "resumed from ... at step N": continues the holder's run
        wait_for_steps(out, stopped_at + 2, [waiting])
        polite_stop(waiting, out)
    finally:
        for r in [holder, *others]:
            r.stop()
    steps = steps_logged(out)
    assert steps == list(range(1, len(steps) + 1))


def test_a_killed_holder_does_not_block_the_same_command(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = train_args(corpus, out, "--save-every", "1", steps=6)
    killed = Run(args, tmp_path / "killed.log", fault="kill:step=4")
    assert killed.wait() == -signal.SIGKILL
    assert (out / RUN_LOCK).is_file()  # left behind, naming the dead holder
    code, stdout, stderr = run_main(args)
    assert code == 0, stderr
    assert f"took over the lock of a process that ended without releasing it (pid {killed.process.pid} " in stdout
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6][:3] + [4, 5, 6]  # resumed from step 3's checkpoint
    assert not (out / RUN_LOCK).exists()


def test_a_second_ctrl_c_aborts_and_says_what_is_kept_a_double_tap_does_not(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = Run(train_args(corpus, out, "--save-every", "1"), tmp_path / "run.log", fault="hang:step=3")
    try:
        wait_for_steps(out, 2, [run])
        time.sleep(1.0)  # into step 3, which hangs
        run.process.send_signal(signal.SIGINT)
        run.wait_for(
            "bigbatch: SIGINT: stopping after step 3 and saving a checkpoint; press Ctrl-C again to abort "
            "without saving (the newest checkpoint is step 2)"
        )
        run.process.send_signal(signal.SIGINT)  # a double tap: the same press
        time.sleep(1.5)
        assert run.process.poll() is None
        run.process.send_signal(signal.SIGINT)
        assert run.wait() == 130
    finally:
        run.stop()
    text = run.output
    assert text.count("stopping after step") == 1
    assert (
        f"aborted without saving during step 3: the run continues from its newest checkpoint, step 2 in {out}" in text
    )
    assert "Traceback" not in text
    assert [int(p.stem.split("_")[1]) for p in list_checkpoints(out)] == [1, 2]
    assert not (out / RUN_LOCK).exists()


def test_a_dataset_being_prepared_is_refused_or_waited_for(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    with preparation_lock(out, wait=False):
        code, stdout, stderr = run_main(["prepare", str(corpus), "--out", str(out)])
        line = assert_one_line_error(code, stdout, stderr)
        assert f"{out} is being prepared by another process (pid {os.getpid()} on host " in line
    assert not out.exists()

    # A run's cache: a process that finds the dataset being prepared waits, then uses it.
    name = ensure_prepared(str(corpus), "byte", 0.1, tmp_path / "probe").name  # where it will be prepared
    cache = tmp_path / "cache"
    found: list[Path] = []
    with preparation_lock(cache / name, wait=False):
        waiting = threading.Thread(target=lambda: found.append(ensure_prepared(str(corpus), "byte", 0.1, cache)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and not found
    waiting.join(timeout=60)
    assert found == [cache / name] and is_prepared_dataset(cache / name)
    assert [p.name for p in cache.iterdir()] == [name]  # prepared once; no lock or staging directory left


def test_two_processes_preparing_one_source_end_with_one_complete_dataset(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    runs = [Run(["prepare", str(corpus), "--out", str(out)], tmp_path / f"p{i}.log") for i in range(2)]
    codes = sorted(r.wait() for r in runs)
    assert codes == [0, 2], [r.output for r in runs]
    refused = next(r for r in runs if r.process.returncode == 2).output
    assert "is being prepared by another process" in refused or "already exists and is not empty" in refused
    assert is_prepared_dataset(out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging, no lock
    trains = [Run(train_args(corpus, tmp_path / f"run{i}", steps=2), tmp_path / f"t{i}.log") for i in range(2)]
    assert [r.wait() for r in trains] == [0, 0], [r.output for r in trains]
    prepared = [p for p in (tmp_path / "cache").iterdir()]
    assert len(prepared) == 1 and is_prepared_dataset(prepared[0])
