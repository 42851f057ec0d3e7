"""Helpers shared by the CLI-level tests."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
from pathlib import Path

import torch
from text_corpus import text_corpus

from bigbatch.cli import main
from bigbatch.engine.accumulate import token_loss_sum
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch


def run_main(argv: list[str], stderr: io.StringIO | None = None) -> tuple[int, str, str]:
    """main() in-process with stdout/stderr captured (usable outside capsys, e.g. in module fixtures).

    main() points the root logger at the current stdout; the logger is restored afterwards.
    """
    out, err = io.StringIO(), stderr if stderr is not None else io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, out: str, err: str) -> str:
    """Exit code 2, exactly one 'bigbatch: error:' line on stderr, no traceback anywhere; returns the line."""
    assert code == 2, (out, err)
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("bigbatch: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def corpus_bytes(limit: int = 60_000) -> bytes:
    """The first ``limit`` bytes of the tests' own English-like corpus (text_corpus.py): the same on every machine,
    never periodic, so train and validation splits differ."""
    return text_corpus(limit)


def mean_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean next-token loss over valid targets, from bigbatch's one loss definition (a sum); ``positions`` for
    rows packed with several documents."""
    return token_loss_sum(model, MicroBatch(inputs, targets, positions)) / (targets != IGNORE_INDEX).sum()


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: its SHA-256 and mtime (ns); every directory, so an empty one made counts too
    (compare two snapshots to see that a refused command made or changed nothing)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            found[str(path.relative_to(root)) + "/"] = ("directory", 0)
        elif path.is_file():
            found[str(path.relative_to(root))] = (
                hashlib.sha256(path.read_bytes()).hexdigest(),
                path.stat().st_mtime_ns,
            )
    return found
