"""A fourth model family added as ``docs/models.md`` says: its folder (``tests/support/toy_family``, copied into a
copy of the package as ``models/toy``) and one line in the registry; then the whole command line works with it.

The commands run in fresh interpreters on the copy (``PYTHONPATH``), as a user's would after the edit."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import corpus_bytes

import bigbatch

PACKAGE = Path(bigbatch.__file__).parent
TOY = Path(__file__).parents[1] / "support" / "toy_family"
REGISTRY_ANCHOR = '    "bigbatch.models.hf.family",\n'
REGISTRY_LINE = '    "bigbatch.models.toy.family",\n'

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package with the toy family's folder and its registry line: the directory to put on
    ``PYTHONPATH``."""
    root = tmp_path_factory.mktemp("extended")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE, root / "bigbatch", ignore=ignore)
    shutil.copytree(TOY, root / "bigbatch" / "models" / "toy", ignore=ignore)
    registry = root / "bigbatch" / "models" / "registry.py"
    text = registry.read_text()
    assert text.count(REGISTRY_ANCHOR) == 1
    registry.write_text(text.replace(REGISTRY_ANCHOR, REGISTRY_ANCHOR + REGISTRY_LINE))
    return root


def changed_files(left: Path, right: Path) -> list[str]:
    """Paths (relative) that differ between two trees, or exist in only one, ``__pycache__`` aside."""
    found = []
    comparison = filecmp.dircmp(left, right, ignore=["__pycache__"])
    stack = [(comparison, Path())]
    while stack:
        node, relative = stack.pop()
        found += [str(relative / name) for name in node.left_only + node.right_only + node.diff_files]
        stack += [(sub, relative / name) for name, sub in node.subdirs.items()]
    return sorted(found)


COMMANDS_IN_ONE_INTERPRETER = """
import contextlib, io, json, sys
from bigbatch.cli import main
outputs = []
for argv in json.loads(sys.argv[1]):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            code = main(argv)
        except SystemExit as exit:  # --help
            code = exit.code
    outputs.append([code, buffer.getvalue()])
print(json.dumps(outputs))
"""
"""Runs several commands in one fresh interpreter (one torch import), each one's exit code and stdout returned."""


def bigbatch_cli(root: Path, cwd: Path, *commands: list[str]) -> list[str]:
    """The stdout of each command, run in order by the package copy under ``root``; each must exit 0."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "BIGBATCH_CACHE": str(cwd / "cache")}
    argv = [sys.executable, "-c", COMMANDS_IN_ONE_INTERPRETER, json.dumps(list(commands))]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for command, (code, out) in zip(commands, results, strict=True):
        assert code == 0, f"{command}: exit {code}\n{out}{done.stderr}"
    return [out for _, out in results]


def test_adding_a_family_is_its_folder_and_one_registry_line(extended: Path) -> None:
    assert changed_files(PACKAGE, extended / "bigbatch") == ["models/registry.py", "models/toy"]
    before = (PACKAGE / "models" / "registry.py").read_text().splitlines(keepends=True)
    after = (extended / "bigbatch" / "models" / "registry.py").read_text().splitlines(keepends=True)
    assert [line for line in after if line not in before] == [REGISTRY_LINE] and len(after) == len(before) + 1


def test_the_whole_command_line_works_with_the_new_family(extended: Path, tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(corpus_bytes(20_000))
    train = ["train", "--data", "corpus.txt", "--model", "toy-pico", "--seq-len", "32", "--micro-batch", "2"]
    train += ["--total-batch-tokens", "256", "--max-steps", "3", "--sample-tokens", "0", "--eval-every", "0"]
    from_export = [*train[:3], "--init-from", "exported", *train[5:], "--max-steps", "1", "--out", "from-export"]
    outputs = bigbatch_cli(
        extended,
        tmp_path,
        ["train", "--help"],
        [*train, "--out", "run"],
        ["verify", "--model", "toy-pico", "--top", "0"],
        ["plan", "--model", "toy-pico", "--tokens-per-step", "1024", "--k", "4"],
        ["memory", "--model", "toy-pico", "--max-micro-batch", "2", "--k", "2"],
        ["eval", "run", "--batches", "2"],
        ["sample", "--checkpoint", "run", "--prompt", "the", "--max-new-tokens", "8"],
        ["export", "run", "exported"],
        from_export,
    )
    help_text, trained, verified, planned, measured, evaluated, sampled, exported, again = outputs
    assert "toy-pico" in re.sub(r"-\s+", "-", help_text)  # argparse may wrap the name at its hyphen
    assert "toy: 2 layers, 16 wide" in trained and "K 4" in trained
    assert "verdict: EQUIVALENT" in verified
    assert "sequence length (T)" in planned and "model toy-pico" in planned and "parameters" in planned
    assert "toy-pico | vocab 256 | seq_len 64" in measured
    assert "perplexity" in evaluated
    assert sampled.startswith("the")
    assert "Hugging Face toy layout" in exported
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == "bigbatch-toy"
    assert "model exported" in again
    checkpoint = torch.load(sorted((tmp_path / "run").glob("**/*.pt"))[-1], weights_only=False)
    assert checkpoint["model_family"] == "toy"  # what resume, branches and export read
