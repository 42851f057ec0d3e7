"""The catalogue of bad inputs: every command refuses each one with exit code 2, a line or two on stderr
that names the problem, no traceback, and no existing file changed.

Each case runs ``main()`` in-process (a flag that does not parse included: it returns 2 too) inside
one shared workspace holding a corpus, a prepared dataset, a finished run and files that belong to the
user; the workspace's files (bytes and mtimes) are compared before and after every case. Cases that need
other processes (``--nproc 2``, a closed output pipe) run as subprocesses below the table.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import corpus_bytes, run_main, snapshot

from bigbatch.data.cache import ensure_prepared

SRC_DIR = Path(__file__).resolve().parents[2] / "src"
MAX_STDERR_LINES = 1  # "bigbatch: error: ...", also for a flag that does not parse


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    says: str  # a fragment the error line must contain (usually the flag's name)
    code: int = 2


def T(*argv: str) -> tuple[str, ...]:  # noqa: N802 - a train command on the workspace's tiny setup
    return (
        "train",
        "--data",
        "corpus.txt",
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--total-batch-tokens",
        "256",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--cache-dir",
        "cache",
        "--out",
        "new-run",
        *argv,
    )


def D(*argv: str) -> tuple[str, ...]:  # noqa: N802 - T with the default run directory (runs/<model>-<hash>)
    base = T(*argv)
    at = base.index("--out")
    return base[:at] + base[at + 2 :]


CASES = [
    # --- every command: a mistyped flag names the nearest one (git's way) ---
    Case("train-typo-flag", T("--mciro-batch", "4"), "unknown flag --mciro-batch; did you mean --micro-batch?"),
    Case("prepare-typo-flag", ("prepare", "corpus.txt", "--out", "ds2", "--workrs", "2"), "did you mean --workers?"),
    Case("sample-typo-flag", ("sample", "--checkpoint", "run", "--temprature", "1"), "did you mean --temperature?"),
    Case("plan-typo-flag", ("plan", "--tokens-per-stp", "1024"), "did you mean --tokens-per-step?"),
    Case("memory-typo-flag", ("memory", "--max-mciro-batch", "2"), "did you mean --max-micro-batch?"),
    Case("verify-typo-flag", ("verify", "--tolerence", "1"), "did you mean --tolerance?"),
    Case("eval-typo-flag", ("eval", "run", "--data", "corpus.txt", "--batchs", "2"), "did you mean --batches?"),
    Case("report-typo-flag", ("report", "run", "--ot", "r"), "did you mean --out?"),
    Case("export-typo-flag", ("export", "run", "new-export", "--formt", "hf"), "did you mean --format?"),
    Case("critical-batch-typo-flag", ("critical-batch", "run", "--tolerence", "1"), "did you mean --tolerance?"),
    Case("typo-command", ("trian",), "did you mean train?"),
    Case("train-typo-choice", T("--parallel", "dpp"), "did you mean ddp?"),
    # --- train with the default run directory: nothing (not even runs/) is made for settings that fail ---
    Case("train-default-out-data-missing", D("--data", "no-such-corpus.txt"), "does not exist"),
    Case("train-default-out-not-divisible", D("--total-batch-tokens", "100"), "total_batch_tokens"),
    Case("train-default-out-seq-len-over-block", D("--seq-len", "4096", "--total-batch-tokens", "16384"), "block_size"),
    Case("train-default-out-toml-type", D("--config", "bad-type.toml"), 'must be int or "auto"'),
    Case(
        "plan-tokens-not-divisible",
        ("plan", "--tokens-per-step", "2M", "--micro-batch", "4", "--seq-len", "32768"),
        "2Mi",
    ),
    # --- train: every numeric flag is range-checked with its name (argparse level) ---
    Case("train-beta1-above-1", T("--beta1", "1.5"), "--beta1"),
    Case("train-beta2-negative", T("--beta2", "-1"), "--beta2"),
    Case("train-eps-negative", T("--eps", "-1"), "--eps"),
    Case("train-eps-zero", T("--eps", "0"), "--eps"),
    Case("train-lr-nan", T("--lr", "nan"), "--lr"),
    Case("train-lr-inf", T("--lr", "inf"), "--lr"),
    Case("train-lr-zero", T("--lr", "0"), "--lr"),
    Case("train-micro-batch-zero", T("--micro-batch", "0"), "or auto"),
    Case("train-micro-batch-negative", T("--micro-batch", "-3"), "--micro-batch"),
    Case("train-micro-batch-word", T("--micro-batch", "big"), "--micro-batch"),
    Case("train-max-steps-zero", T("--max-steps", "0"), "--max-steps"),
    Case("train-max-steps-text", T("--max-steps", "abc"), "--max-steps"),
    Case("train-seq-len-zero", T("--seq-len", "0"), "--seq-len"),
    Case("train-total-negative", T("--total-batch-tokens", "-1"), "--total-batch-tokens"),
    Case("train-dropout-one", T("--dropout", "1.0"), "--dropout"),
    Case("train-val-fraction-one", T("--val-fraction", "1"), "--val-fraction"),
    Case("train-min-lr-ratio-2", T("--min-lr-ratio", "2"), "--min-lr-ratio"),
    Case("train-weight-decay-negative", T("--weight-decay", "-0.1"), "--weight-decay"),
    Case("train-grad-clip-negative", T("--grad-clip", "-1"), "--grad-clip"),
    Case("train-warmup-negative", T("--warmup-steps", "-1"), "--warmup-steps"),
    Case("train-decay-negative", T("--decay-steps", "-2"), "--decay-steps"),
    Case("train-eval-batches-zero", T("--eval-batches", "0"), "--eval-batches"),
    Case("train-eval-every-negative", T("--eval-every", "-1"), "--eval-every"),
    Case("train-save-every-negative", T("--save-every", "-1"), "--save-every"),
    Case("train-log-every-zero", T("--log-every", "0"), "--log-every"),
    Case("train-keep-negative", T("--keep-checkpoints", "-1"), "--keep-checkpoints"),
    Case("train-skips-zero", T("--max-consecutive-skips", "0"), "--max-consecutive-skips"),
    Case("train-timeout-zero", T("--collective-timeout", "0"), "--collective-timeout"),
    Case("train-nproc-zero", T("--nproc", "0"), "--nproc"),
    Case("train-seed-negative", T("--seed", "-1"), "--seed"),
    Case("train-bad-step-unknown", T("--bad-step", "retry"), "bad_step must be one of skip-micro"),
    Case("train-loss-spike-negative", T("--loss-spike", "-1"), "--loss-spike"),
    Case("train-replay-every-zero", T("--replay-every", "0"), "--replay-every"),
    Case("train-replay-every-fsdp", T("--replay-every", "2", "--parallel", "fsdp"), "--replay-every 2 does not work"),
    Case("train-memory-budget-negative", T("--memory-budget", "-5"), "--memory-budget"),
    Case("train-token-budget-negative", T("--token-budget", "-1"), "--token-budget"),
    Case("train-peak-flops-negative", T("--peak-flops", "-1"), "--peak-flops"),
    Case("train-block-size-negative", T("--block-size", "-1"), "--block-size"),
    Case("train-sample-tokens-negative", T("--sample-tokens", "-1"), "--sample-tokens"),
    # --- train: the same ranges from a TOML file, and settings that only fail together ---
    Case("train-toml-beta1", T("--config", "bad-beta1.toml"), "optim.beta1"),
    Case("train-toml-micro-batch-zero", T("--config", "bad-micro-batch.toml"), "batch.micro_batch"),
    Case("train-decay-below-warmup", T("--decay-steps", "5", "--warmup-steps", "10"), "decay_steps"),
    Case("train-total-not-divisible", T("--total-batch-tokens", "100"), "total_batch_tokens"),
    Case("train-seq-len-over-block", T("--seq-len", "4096", "--total-batch-tokens", "16384"), "block_size"),
    Case("train-data-missing", T("--data", "no-such-corpus.txt"), "does not exist"),
    Case("train-block-size-beyond-memory", T("--block-size", "1000000000000"), "out of memory"),
    # --- train: never write into a directory bigbatch did not make ---
    Case("train-out-foreign-dir", T("--out", "mine"), "was not made by bigbatch"),
    Case("train-out-is-a-file", T("--out", "corpus.txt"), "is a file"),
    Case(
        "train-micro-batch-over-documents",
        T("--data", "docs", "--data-mode", "documents", "--micro-batch", "8", "--total-batch-tokens", "256"),
        "documents",
    ),
    # --- train --nproc 2: refused before torchrun starts (so these run in-process, in one process) ---
    Case("train-nproc2-unknown-device", T("--nproc", "2", "--device", "tpu"), "unknown device"),
    Case("train-nproc2-not-divisible", T("--nproc", "2", "--total-batch-tokens", "192"), "world_size"),
    Case("train-nproc2-out-foreign-dir", T("--nproc", "2", "--out", "mine"), "was not made by bigbatch"),
    Case("train-nproc2-data-missing", T("--nproc", "2", "--data", "no-such-corpus.txt"), "does not exist"),
    Case(
        "train-nproc2-micro-batch-over-documents",
        T(
            "--nproc",
            "2",
            "--data",
            "docs",
            "--data-mode",
            "documents",
            "--micro-batch",
            "2",
            "--total-batch-tokens",
            "128",
        ),
        "x 2 processes",
    ),
    # --- prepare ---
    Case(
        "prepare-val-fraction-above-1",
        ("prepare", "corpus.txt", "--out", "ds2", "--val-fraction", "1.5"),
        "--val-fraction",
    ),
    Case(
        "prepare-val-fraction-negative",
        ("prepare", "corpus.txt", "--out", "ds2", "--val-fraction", "-0.1"),
        "--val-fraction",
    ),
    Case(
        "prepare-shard-tokens-negative",
        ("prepare", "corpus.txt", "--out", "ds2", "--shard-tokens", "-1"),
        "--shard-tokens",
    ),
    Case("prepare-workers-negative", ("prepare", "corpus.txt", "--out", "ds2", "--workers", "-2"), "--workers"),
    Case("prepare-out-foreign-dir", ("prepare", "corpus.txt", "--out", "mine"), "not empty"),
    Case("prepare-out-is-a-file", ("prepare", "corpus.txt", "--out", "notes.txt"), "notes.txt"),
    Case("prepare-source-missing", ("prepare", "no-such.txt", "--out", "ds2"), "does not exist"),
    # --- sample ---
    Case("sample-max-new-tokens-zero", ("sample", "--checkpoint", "run", "--max-new-tokens", "0"), "--max-new-tokens"),
    Case("sample-temperature-negative", ("sample", "--checkpoint", "run", "--temperature", "-1"), "--temperature"),
    Case("sample-top-k-negative", ("sample", "--checkpoint", "run", "--top-k", "-1"), "--top-k"),
    Case("sample-num-samples-zero", ("sample", "--checkpoint", "run", "--num-samples", "0"), "--num-samples"),
    Case("sample-seed-negative", ("sample", "--checkpoint", "run", "--seed", "-5"), "--seed"),
    Case("sample-checkpoint-missing", ("sample", "--checkpoint", "no-run"), "does not exist"),
    Case("sample-checkpoint-foreign", ("sample", "--checkpoint", "notes.txt"), "notes.txt"),
    # --- plan ---
    Case(
        "plan-seq-len-zero", ("plan", "--seq-len", "0", "--tokens-per-step", "1024", "--micro-batch", "2"), "--seq-len"
    ),
    Case(
        "plan-micro-batch-zero",
        ("plan", "--seq-len", "64", "--tokens-per-step", "1024", "--micro-batch", "0"),
        "--micro-batch",
    ),
    Case("plan-k-negative", ("plan", "--seq-len", "64", "--tokens-per-step", "1024", "--k", "-1"), "--k"),
    Case(
        "plan-devices-zero",
        ("plan", "--seq-len", "64", "--tokens-per-step", "1024", "--micro-batch", "2", "--devices", "0"),
        "--devices",
    ),
    Case(
        "plan-vocab-negative",
        ("plan", "--seq-len", "64", "--micro-batch", "2", "--k", "2", "--vocab-size", "-1"),
        "--vocab-size",
    ),
    Case(
        "plan-tokens-negative",
        ("plan", "--seq-len", "64", "--tokens-per-step", "-5", "--micro-batch", "2"),
        "--tokens-per-step",
    ),
    Case(
        "plan-tokens-infinite",
        ("plan", "--seq-len", "64", "--tokens-per-step", "infM", "--micro-batch", "2"),
        "--tokens-per-step",
    ),
    # --- memory (refused before any measuring) ---
    Case("memory-k-one", ("memory", "--k", "1"), "--k"),
    Case("memory-max-micro-batch-zero", ("memory", "--max-micro-batch", "0"), "--max-micro-batch"),
    Case("memory-seq-len-negative", ("memory", "--seq-len", "-1"), "--seq-len"),
    Case("memory-vocab-zero", ("memory", "--vocab-size", "0"), "--vocab-size"),
    Case(
        "memory-plot-exists",
        ("memory", "--model", "pico", "--max-micro-batch", "1", "--plot", "plot.png"),
        "--overwrite",
    ),
    Case(
        "memory-plot-is-a-dir", ("memory", "--model", "pico", "--max-micro-batch", "1", "--plot", "mine"), "directory"
    ),
    # --- verify ---
    Case("verify-k-zero", ("verify", "--k", "0"), "--k"),
    Case("verify-micro-batch-zero", ("verify", "--micro-batch", "0"), "--micro-batch"),
    Case("verify-seq-len-zero", ("verify", "--seq-len", "0"), "--seq-len"),
    Case("verify-dropout-above-1", ("verify", "--dropout", "1.5"), "--dropout"),
    Case("verify-tolerance-negative", ("verify", "--tolerance", "-1"), "--tolerance"),
    Case("verify-top-negative", ("verify", "--top", "-1"), "--top"),
    Case("verify-nproc-zero", ("verify", "--nproc", "0"), "--nproc"),
    Case("verify-vocab-negative", ("verify", "--vocab-size", "-1"), "--vocab-size"),
    Case("verify-seed-negative", ("verify", "--seed", "-1"), "--seed"),
    Case(
        "verify-micro-batch-beyond-memory",
        ("verify", "--model", "pico", "--micro-batch", "1000000000"),
        "out of memory",
    ),
    Case("verify-json-exists", ("verify", "--model", "pico", "--json", "notes.txt"), "--overwrite"),
    # --- eval ---
    Case("eval-batches-negative", ("eval", "run", "--data", "corpus.txt", "--batches", "-1"), "--batches"),
    Case("eval-micro-batch-zero", ("eval", "run", "--data", "corpus.txt", "--micro-batch", "0"), "--micro-batch"),
    Case("eval-seq-len-zero", ("eval", "run", "--data", "corpus.txt", "--seq-len", "0"), "--seq-len"),
    Case("eval-run-missing", ("eval", "no-run", "--data", "corpus.txt"), "does not exist"),
    # --- report ---
    Case("report-out-foreign-dir", ("report", "run", "--out", "mine"), "was not made by bigbatch"),
    Case("report-out-is-a-file", ("report", "run", "--out", "notes.txt"), "is a file"),
    Case("report-run-missing", ("report", "no-run"), "does not exist"),
    # --- export ---
    Case("export-out-not-empty", ("export", "run", "mine"), "not empty"),
    Case("export-out-is-a-file", ("export", "run", "notes.txt"), "notes.txt"),
    Case("export-run-missing", ("export", "no-run", "new-export"), "does not exist"),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A corpus, a prepared cache, a documents corpus of 3 files, a finished run, and the user's own files."""
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "corpus.txt").write_bytes(corpus_bytes(30_000))
    docs = root / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"doc{i}.txt").write_text(f"document {i}: to be.")  # shorter than seq_len: one sequence each
    mine = root / "mine"
    mine.mkdir()
    (mine / "config.toml").write_text("# the user's own file\n")
    (root / "notes.txt").write_text("the user's notes\n")
    (root / "plot.png").write_bytes(b"not really a png, but the user's\n")
    (root / "bad-beta1.toml").write_text("[optim]\nbeta1 = 1.5\n")
    (root / "bad-micro-batch.toml").write_text("[batch]\nmicro_batch = 0\n")
    (root / "bad-type.toml").write_text('[batch]\nmicro_batch = "4"\n')
    old = Path.cwd()
    os.chdir(root)
    try:
        code, _, err = run_main(list(T("--out", "run", "--save-every", "1")))
        assert code == 0, err
        ensure_prepared("docs", "byte", 0.1, "cache", mode="documents")  # as train would, before the case
        yield root
    finally:
        os.chdir(old)


def run_case(argv: list[str]) -> tuple[int, str, str]:
    """``main()`` in-process; a usage error returns 2 like every user error (a SystemExit would fail here)."""
    return run_main(argv, stderr=io.StringIO())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_and_changes_nothing(
    case: Case, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("BIGBATCH_CACHE", str(workspace / "env-cache"))
    before = snapshot(workspace)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code, out, err = run_case(list(case.argv))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = err.strip("\n").splitlines()
    assert code == case.code, (out, err)
    assert 1 <= len(lines) <= MAX_STDERR_LINES, err
    assert lines[-1].startswith("bigbatch: error: "), err
    assert case.says in err, err
    assert "Traceback" not in out + err
    after = snapshot(workspace)
    changed = sorted(k for k in before if before[k] != after.get(k))
    created = sorted(set(after) - set(before))
    assert not changed, f"changed or removed: {changed}"
    assert not created, f"created: {created}"


def test_the_catalogue_is_large_and_covers_every_command() -> None:
    assert len(CASES) >= 50
    commands = {c.argv[0] for c in CASES}
    assert commands == {
        "train",
        "prepare",
        "sample",
        "plan",
        "memory",
        "verify",
        "eval",
        "report",
        "export",
        "critical-batch",
        "trian",  # a mistyped command
    }
    assert len({c.id for c in CASES}) == len(CASES)


# ------------------------------------------------------------------------------------------------
# declared once: every numeric setting has a range, every numeric flag is range-checked
# ------------------------------------------------------------------------------------------------


def test_every_numeric_config_field_declares_a_range() -> None:
    from dataclasses import fields

    from bigbatch.run.configuration.train_config import SECTIONS

    missing = [
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in fields(cls)
        if str(f.type) in ("int", "float") and "range" not in f.metadata
    ]
    assert not missing, f"numeric settings without a declared range: {missing}"


def test_no_command_has_an_unchecked_numeric_flag() -> None:
    import argparse

    from bigbatch.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    unchecked = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.type in (int, float)
    ]
    assert not unchecked, f"numeric flags parsed without a range: {unchecked}"


def test_a_checkpoints_own_config_may_store_auto_as_zero() -> None:
    from bigbatch.run.configuration.config_sources import config_from_dict

    assert config_from_dict({"batch": {"micro_batch": 0}}).batch.micro_batch == 0  # what to_dict() writes for auto


# ------------------------------------------------------------------------------------------------
# the cases that need more than one process
# ------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR), OMP_NUM_THREADS="1")
    env.pop("BIGBATCH_FAULT", None)
    return env


def _bigbatch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "bigbatch", *argv]


@pytest.mark.slow
def test_nproc_user_error_found_before_torchrun_is_one_line(workspace: Path) -> None:
    before = snapshot(workspace)
    result = subprocess.run(
        _bigbatch(*T("--nproc", "2", "--total-batch-tokens", "100")),
        cwd=workspace,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith("bigbatch: error: total_batch_tokens=100")
    assert snapshot(workspace) == before


@pytest.mark.slow
def test_nproc_user_error_inside_the_workers_is_one_line_without_torchrun_traces(workspace: Path) -> None:
    """``--init-from`` is only read by the workers: the error comes from inside torchrun's world."""
    before = snapshot(workspace)
    result = subprocess.run(
        _bigbatch(*T("--nproc", "2", "--init-from", "no-such-hf-dir")),
        cwd=workspace,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "bigbatch: error: no-such-hf-dir is not a directory; give a Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory"
    ], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert snapshot(workspace) == before


@pytest.mark.slow
def test_a_closed_output_pipe_ends_quietly(workspace: Path, tmp_path: Path) -> None:
    """``bigbatch plan ... | true``: every write after the reader left fails; nothing is reported."""
    process = subprocess.Popen(
        _bigbatch("plan", "--seq-len", "64", "--tokens-per-step", "4096", "--micro-batch", "2"),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, err
    assert err == ""


@pytest.mark.slow
def test_train_piped_into_head_stops_politely_without_logging_errors(workspace: Path, tmp_path: Path) -> None:
    """``bigbatch train ... | head -3``: the run ends at the next step, saved, with no 'Logging error' or
    BrokenPipeError trace."""
    argv = [*T("--out", str(tmp_path / "piped"), "--max-steps", "500")]
    process = subprocess.Popen(
        _bigbatch(*argv), cwd=workspace, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    lines = [process.stdout.readline()]
    while not lines[-1].startswith(b"step ") and lines[-1] and len(lines) < 40:  # the header, whatever its length
        lines.append(process.stdout.readline())
    assert lines[-1].startswith(b"step "), lines  # into the step lines, then the reader goes away
    process.stdout.close()
    err = process.stderr.read().decode()
    code = process.wait(timeout=120)
    assert code == 143, err  # stopped as on SIGTERM: 128 + 15
    assert err == "", err
    from bigbatch.run.checkpoints import checkpoint

    (saved,) = checkpoint.list_checkpoints(tmp_path / "piped")
    assert checkpoint.verify_checkpoint(saved) is None and checkpoint.checkpoint_step(saved) < 500


# ------------------------------------------------------------------------------------------------
# a full disk while saving a checkpoint
# ------------------------------------------------------------------------------------------------


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_earlier_checkpoints(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second checkpoint's shard file stops growing after 4 KiB with ENOSPC, as on a full disk: the cause
    is one line, not DCP's gathered traces, and the half-written checkpoint is removed."""
    from bigbatch.run.checkpoints import checkpoint

    class FullDisk:
        def __init__(self, handle: object) -> None:
            self.handle, self.written = handle, 0

        def write(self, data: bytes) -> int:
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.handle.write(data)  # type: ignore[attr-defined, no-any-return]

        def __getattr__(self, name: str) -> object:
            return getattr(self.handle, name)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()  # type: ignore[attr-defined]

    from torch.distributed.checkpoint import filesystem as dcp_files

    real_stream = dcp_files.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: object, path: object, mode: str) -> Iterator[object]:
        with real_stream(self, path, mode) as stream:  # type: ignore[arg-type]
            yield FullDisk(stream) if "step_0000002" in str(path) and "w" in mode else stream

    monkeypatch.setattr(dcp_files.FileSystem, "create_stream", create_stream)
    monkeypatch.chdir(workspace)
    run_dir = tmp_path / "full"
    code, out, err = run_case(list(T("--out", str(run_dir), "--save-every", "1", "--max-steps", "3")))
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()], err
    assert "No space left on device" in err and "earlier checkpoints are intact" in err, err
    assert "Traceback" not in out + err
    files = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert files == ["step_0000001", "step_0000001.commit"], files  # no half-written file left behind
    assert checkpoint.verify_checkpoint(run_dir / "checkpoints" / "step_0000001") is None


# ------------------------------------------------------------------------------------------------
# said, not refused
# ------------------------------------------------------------------------------------------------


def test_parallel_fsdp_in_one_process_is_said(workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(workspace)
    code, out, err = run_case(list(T("--out", str(tmp_path / "fsdp1"), "--parallel", "fsdp", "--max-steps", "1")))
    assert code == 0, err
    assert "--parallel fsdp has no effect in a single process" in out


@pytest.mark.slow
def test_a_bigbatch_run_directory_is_written_again(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The guard refuses foreign directories only: a run bigbatch made continues, and a report is redone."""
    monkeypatch.chdir(workspace)
    run_dir = tmp_path / "again"
    for steps in ("1", "2"):
        code, _, err = run_case(list(T("--out", str(run_dir), "--max-steps", steps)))
        assert code == 0, err
    for _ in range(2):
        code, _, err = run_case(["report", str(run_dir)])
        assert code == 0, err
    assert (run_dir / ".bigbatch-run").is_file() and (run_dir / "report" / ".bigbatch-report").is_file()


@pytest.mark.slow
def test_nproc_train_piped_into_head_ends_quietly(workspace: Path, tmp_path: Path) -> None:
    """Under ``--nproc 2`` rank 0's closed pipe ends every worker quietly: no gloo, torchrun or logging traces."""
    argv = [*T("--nproc", "2", "--out", str(tmp_path / "piped2"), "--max-steps", "500")]
    process = subprocess.Popen(
        _bigbatch(*argv), cwd=workspace, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    for _ in range(3):
        process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) in (141, 143), err  # ended in set-up (141) or stopped after a step, saved (143)
    assert err == "", err


# --------------------------------------------------------------------------------------------
# Advice that is followed gets past the error that gave it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advice:
    id: str
    bad: tuple[str, ...]  # train: flags (after T's) that fail; another command: its arguments
    says: str  # the error's key words, advice included
    followed: tuple[str, ...]  # the same with the advice applied
    needs: tuple[str, ...] = ()  # what the case makes first (see NEEDS)
    command: str = "train"
    cpu_only: bool = False  # the error needs a machine without CUDA


NEEDS = {
    "run": ("train", "--out", "run"),  # T's pico run, one step: a checkpoint at step 1
    "run0": ("train", "--out", "run0", "--val-fraction", "0"),  # without a validation split
    "ds": ("prepare", "corpus.txt", "--out", "ds"),  # a prepared dataset (byte tokens, a val split)
    "ds-bpe": ("prepare", "corpus.txt", "--out", "ds-bpe", "--tokenizer", "bpe:300"),
}
"""Each one the command that makes it; besides: "gpt2" and "qwen2" (hf directories with 64 positions, for
``--model hf:DIR`` and ``--init-from``), "emptydir", "empty.txt" and "notes.txt" (the user's own file)."""


ADVICE = [
    Advice(
        "preset-seq-len-over-block",
        ("--seq-len", "128", "--total-batch-tokens", "512"),
        "lower --seq-len or raise --block-size to at least 128",
        ("--seq-len", "128", "--block-size", "128", "--total-batch-tokens", "512"),
    ),
    Advice(
        "total-not-divisible",
        ("--total-batch-tokens", "100"),
        "nearest valid totals: 128 (K=1)",
        ("--total-batch-tokens", "128"),
    ),
    Advice(
        "decay-below-warmup",
        ("--decay-steps", "1", "--warmup-steps", "2"),
        "raise decay_steps or set it to auto",
        ("--decay-steps", "auto", "--warmup-steps", "2"),
    ),
    Advice(
        "hf-seq-len-over-context",
        ("--model", "hf:gpt2", "--seq-len", "128", "--total-batch-tokens", "512"),
        "lower --seq-len to at most 64, or leave it auto",
        ("--model", "hf:gpt2", "--seq-len", "64", "--total-batch-tokens", "256"),
        needs=("gpt2",),
    ),
    Advice(
        "hf-block-size",
        ("--model", "hf:gpt2", "--block-size", "128"),
        "--block-size does not apply to hf:gpt2",
        ("--model", "hf:gpt2"),
        needs=("gpt2",),
    ),
    Advice(
        "init-from-seq-len-over-context",
        ("--init-from", "gpt2", "--seq-len", "128", "--total-batch-tokens", "512"),
        "lower --seq-len to at most 64, or leave it auto",
        ("--init-from", "gpt2", "--seq-len", "64", "--total-batch-tokens", "256"),
        needs=("gpt2",),
    ),
    Advice(
        "init-from-qwen2",
        ("--init-from", "qwen2"),
        "pass --model hf:qwen2 instead of --init-from",
        ("--model", "hf:qwen2"),
        needs=("qwen2",),
    ),
    Advice(
        "init-from-a-run",
        ("--init-from", "run"),
        "continue it with --out run (and no --init-from)",
        ("--out", "run"),
        needs=("run",),
    ),
    Advice(
        "train-out-of-memory",
        ("--block-size", "1000000000000"),
        "lower --micro-batch (auto: the largest that fits), --seq-len or a preset's --block-size",
        ("--block-size", "64"),
    ),
    Advice(
        "train-resume-never",
        ("--out", "run", "--resume", "never"),
        "continue it with --resume auto",
        ("--out", "run", "--resume", "auto"),  # complete: nothing to do
        needs=("run",),
    ),
    Advice(
        "train-other-settings",
        ("--out", "run", "--lr", "0.01"),
        "or choose another --out",
        ("--out", "run-lr", "--lr", "0.01"),
        needs=("run",),
    ),
    # --- eval ---
    Advice(
        "eval-seq-len-over-block",
        ("run", "--seq-len", "128", "--batches", "1"),
        "lower --seq-len to at most 64, or leave it out",
        ("run", "--seq-len", "64", "--batches", "1"),
        needs=("run",),
        command="eval",
    ),
    Advice(
        "eval-no-val-split",
        ("run0", "--batches", "1"),
        "has no val split; use --split train",
        ("run0", "--split", "train", "--batches", "1"),
        needs=("run0",),
        command="eval",
    ),
    Advice(
        "eval-no-val-split-prepared",
        ("run0", "--batches", "1"),
        "or give --data a dataset with a val split (bigbatch prepare SOURCE --out DIR --tokenizer byte --val-fraction",
        ("run0", "--data", "ds", "--batches", "1"),  # ds: bigbatch prepare corpus.txt --out ds (0.1 by default)
        needs=("run0", "ds"),
        command="eval",
    ),
    Advice(
        "eval-other-tokenizer",
        ("run", "--data", "ds-bpe", "--batches", "1"),
        "give --data raw text (tokenized with the checkpoint's tokenizer)",
        ("run", "--data", "corpus.txt", "--batches", "1"),
        needs=("run", "ds-bpe"),
        command="eval",
    ),
    Advice(
        "eval-no-cuda",
        ("run", "--device", "cuda", "--batches", "1"),
        "use --device cpu",
        ("run", "--device", "cpu", "--batches", "1"),
        needs=("run",),
        command="eval",
        cpu_only=True,
    ),
    # --- critical-batch: every check before the first branch trains ---
    Advice(
        "critical-batch-no-val-split",
        ("run0", "--tokens-per-step", "128,256", "--budget", "256", "--no-plot"),
        "the branches are compared on the run's own val split: branch a run trained with --val-fraction > 0",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--no-plot"),
        needs=("run", "run0"),
        command="critical-batch",
    ),
    Advice(
        "critical-batch-budget-below-a-step",
        ("run", "--tokens-per-step", "128,256", "--budget", "128", "--no-plot"),
        "use --budget 256 or more",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--no-plot"),
        needs=("run",),
        command="critical-batch",
    ),
    Advice(
        "critical-batch-budget-not-whole-steps",
        ("run", "--tokens-per-step", "128,256", "--budget", "300", "--no-plot"),
        "nearest budgets that do: 256 or 512",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--no-plot"),
        needs=("run",),
        command="critical-batch",
    ),
    Advice(
        "critical-batch-size-not-whole-micro-batches",
        ("run", "--tokens-per-step", "100,256", "--budget", "256", "--no-plot"),
        "nearest valid totals: 128 (K=1)",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--no-plot"),
        needs=("run",),
        command="critical-batch",
    ),
    Advice(
        "critical-batch-decimal-k",
        ("run", "--tokens-per-step", "1K,2K", "--budget", "2K", "--no-plot"),
        "for 1,024 write 1Ki",
        ("run", "--tokens-per-step", "1Ki,2Ki", "--budget", "2Ki", "--no-plot"),
        needs=("run",),
        command="critical-batch",
    ),
    Advice(
        "critical-batch-no-checkpoint-at-step",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--step", "5", "--no-plot"),
        "its checkpoints are at steps: 1",
        ("run", "--tokens-per-step", "128,256", "--budget", "256", "--step", "1", "--no-plot"),
        needs=("run",),
        command="critical-batch",
    ),
    # --- plan ---
    Advice(
        "plan-no-tokens-no-k",
        ("--seq-len", "32", "--micro-batch", "4"),
        "without --tokens-per-step, give --micro-batch and --k (missing: --k)",
        ("--seq-len", "32", "--micro-batch", "4", "--k", "2"),
        command="plan",
    ),
    Advice(
        "plan-all-three-disagree",
        ("--tokens-per-step", "1024", "--seq-len", "32", "--micro-batch", "4", "--k", "2", "--devices", "1"),
        "leave one of them out (--micro-batch, --k or --devices) to derive it",
        ("--tokens-per-step", "1024", "--seq-len", "32", "--micro-batch", "4", "--k", "2"),  # 4 devices
        command="plan",
    ),
    Advice(
        "plan-tokens-not-whole",
        ("--tokens-per-step", "1000", "--seq-len", "32", "--micro-batch", "4"),
        "the nearest that are: 896 (K 7) or 1,024 = 1Ki (K 8)",
        ("--tokens-per-step", "1Ki", "--seq-len", "32", "--micro-batch", "4"),
        command="plan",
    ),
    Advice(
        "plan-from-run-and-k",
        ("--from-run", "run", "--k", "2"),
        "leave out --k",
        ("--from-run", "run"),
        needs=("run",),
        command="plan",
    ),
    Advice(
        "plan-ramp-start-above-total",
        ("--tokens-per-step", "1024", "--seq-len", "32", "--micro-batch", "4", "--batch-ramp", "4096:1000"),
        "lower START_TOKENS or raise --total-batch-tokens",
        ("--total-batch-tokens", "4096", "--seq-len", "32", "--micro-batch", "4", "--batch-ramp", "4096:1000"),
        command="plan",
    ),
    Advice(
        "plan-ramp-start-below-a-micro-batch",
        ("--tokens-per-step", "1024", "--seq-len", "32", "--micro-batch", "4", "--batch-ramp", "64:1000"),
        "raise START_TOKENS to at least 128",
        ("--tokens-per-step", "1024", "--seq-len", "32", "--micro-batch", "4", "--batch-ramp", "128:1000"),
        command="plan",
    ),
    Advice(
        "plan-hf-seq-len-over-context",
        ("--model", "hf:gpt2", "--seq-len", "128", "--tokens-per-step", "512", "--micro-batch", "4"),
        "lower --seq-len to at most 64, or leave it out",
        ("--model", "hf:gpt2", "--seq-len", "64", "--tokens-per-step", "256", "--micro-batch", "4"),
        needs=("gpt2",),
        command="plan",
    ),
    # --- verify ---
    Advice(
        "verify-seq-len-over-block",
        ("--model", "pico", "--seq-len", "128", "--k", "2"),
        "lower --seq-len to at most 64",
        ("--model", "pico", "--seq-len", "64", "--k", "2"),
        command="verify",
    ),
    Advice(
        "verify-out-of-memory",
        ("--model", "pico", "--micro-batch", "1000000000"),
        "lower --micro-batch, --k or --seq-len",
        ("--model", "pico", "--micro-batch", "2", "--k", "2"),
        command="verify",
    ),
    Advice(
        "verify-json-exists",
        ("--model", "pico", "--k", "2", "--json", "notes.txt"),
        "pass --overwrite to replace it",
        ("--model", "pico", "--k", "2", "--json", "notes.txt", "--overwrite"),
        needs=("notes.txt",),
        command="verify",
    ),
    # --- prepare: its data source is SOURCE, not --data ---
    Advice(
        "prepare-out-exists",
        ("corpus.txt", "--out", "ds"),
        "choose a new --out or remove it first",
        ("corpus.txt", "--out", "ds-new"),
        needs=("ds",),
        command="prepare",
    ),
    Advice(
        "prepare-empty-directory",
        ("emptydir", "--out", "ds-new"),
        "holds no files; give a directory of text files, a text file or a glob",
        ("corpus.txt", "--out", "ds-new"),
        needs=("emptydir",),
        command="prepare",
    ),
    Advice(
        "prepare-empty-corpus",
        ("empty.txt", "--out", "ds-new"),
        "holds no text; give non-empty text files instead",
        ("corpus.txt", "--out", "ds-new"),
        needs=("empty.txt",),
        command="prepare",
    ),
    Advice(
        "prepare-unknown-tokenizer",
        ("corpus.txt", "--out", "ds-new", "--tokenizer", "gpt3"),
        "choose one of: byte, gpt2, bpe:VOCAB, file:PATH",
        ("corpus.txt", "--out", "ds-new", "--tokenizer", "byte"),
        command="prepare",
    ),
    Advice(
        "prepare-bpe-vocabulary",
        ("corpus.txt", "--out", "ds-new", "--tokenizer", "bpe:10"),
        "with a vocabulary size from 257 to 1,048,576",
        ("corpus.txt", "--out", "ds-new", "--tokenizer", "bpe:300"),
        command="prepare",
    ),
    # --- sample: a mistyped flag names the one that is taken ---
    Advice(
        "sample-typo-flag",
        ("--checkpoint", "run", "--temprature", "1", "--max-new-tokens", "4"),
        "did you mean --temperature?",
        ("--checkpoint", "run", "--temperature", "1", "--max-new-tokens", "4"),
        needs=("run",),
        command="sample",
    ),
]

ADVICE_SLOW = [
    Advice(
        "memory-seq-len-over-block",  # a sweep takes seconds
        ("--model", "pico", "--seq-len", "128", "--max-micro-batch", "1"),
        "lower --seq-len to at most 64, or leave it auto",
        ("--model", "pico", "--seq-len", "64", "--max-micro-batch", "1"),
        command="memory",
    ),
    Advice(
        "train-micro-batch-auto-on-cpu",  # probing what fits takes seconds
        ("--micro-batch", "auto"),
        "--micro-batch auto on CPU needs --memory-budget MIB",
        ("--micro-batch", "auto", "--memory-budget", "1000"),
        cpu_only=True,
    ),
]


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("advice", ADVICE, ids=[a.id for a in ADVICE])
def test_following_an_errors_advice_gets_past_that_error(advice: Advice, workspace: Path, tmp_path: Path) -> None:
    """Each message that names a flag as the fix: the fix, applied, is taken, and the command then succeeds."""
    follow(advice, workspace, tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("advice", ADVICE_SLOW, ids=[a.id for a in ADVICE_SLOW])
def test_following_a_slow_errors_advice_gets_past_that_error(advice: Advice, workspace: Path, tmp_path: Path) -> None:
    follow(advice, workspace, tmp_path)


def test_the_advice_table_covers_every_command_that_advises() -> None:
    rows = ADVICE + ADVICE_SLOW
    assert {a.command for a in rows} == {
        "train",
        "eval",
        "critical-batch",
        "plan",
        "verify",
        "prepare",
        "sample",
        "memory",
    }
    assert len({a.id for a in rows}) == len(rows)


def follow(advice: Advice, workspace: Path, tmp_path: Path) -> None:
    """Run ``advice.bad`` (refused, saying ``advice.says``), then ``advice.followed`` (exit 0, that error gone)."""
    if advice.cpu_only:
        import torch

        if torch.cuda.is_available():
            pytest.skip("the error needs a machine without CUDA")
    (tmp_path / "corpus.txt").write_bytes((workspace / "corpus.txt").read_bytes())
    for need in advice.needs:
        if need in ("gpt2", "qwen2"):
            pytest.importorskip("transformers")
            from hf_models import save_hf

            save_hf(need, tmp_path / need)
        elif need == "emptydir":
            (tmp_path / need).mkdir()
        elif need in ("empty.txt", "notes.txt"):
            (tmp_path / need).write_text("" if need == "empty.txt" else "the user's notes\n")
        else:
            made = NEEDS[need]
            argv = list(T(*made[1:], "--max-steps", "1")) if made[0] == "train" else list(made)
            code, _, err = run_case(argv)
            assert code == 0, err

    def attempt(flags: tuple[str, ...]) -> tuple[int, str]:
        if advice.command != "train":
            code, out, err = run_case([advice.command, *flags])
            return code, out + err
        argv = list(T("--max-steps", "1"))
        argv = argv[: argv.index("--out")] + argv[argv.index("--out") + 2 :] + ["--out", "new-run", *flags]
        if "--model" in flags:  # the case's model replaces T's pico
            at = argv.index("--model")
            del argv[at : at + 2]
        code, out, err = run_case(argv)
        return code, out + err

    code, said = attempt(advice.bad)
    assert code == 2 and advice.says in said, said
    first_error = said.strip().splitlines()[-1]
    code, said = attempt(advice.followed)
    assert first_error not in said, said
    assert code == 0, said  # every fix here is the whole fix
