"""A fourth model family added as ``docs/models.md`` says: its folder (``tests/support/toy_family``, copied into a
copy of the package as ``models/toy``) and one line in the registry; then the whole command line works with it.

The commands run in fresh interpreters on the copy (``PYTHONPATH``), as a user's would after the edit."""

from __future__ import annotations

import filecmp
import json
import os
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


def bigbatch_cli(root: Path, cwd: Path, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "BIGBATCH_CACHE": str(cwd / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "bigbatch", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_adding_a_family_is_its_folder_and_one_registry_line(extended: Path) -> None:
    assert changed_files(PACKAGE, extended / "bigbatch") == ["models/registry.py", "models/toy"]
    before = (PACKAGE / "models" / "registry.py").read_text().splitlines(keepends=True)
    after = (extended / "bigbatch" / "models" / "registry.py").read_text().splitlines(keepends=True)
    assert [line for line in after if line not in before] == [REGISTRY_LINE] and len(after) == len(before) + 1


def test_the_whole_command_line_works_with_the_new_family(extended: Path, tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(corpus_bytes(20_000))
    help_text = bigbatch_cli(extended, tmp_path, "train", "--help")
    assert "toy-pico" in help_text
    train = ["train", "--data", "corpus.txt", "--model", "toy-pico", "--seq-len", "32", "--micro-batch", "2"]
    train += ["--total-batch-tokens", "256", "--max-steps", "3", "--sample-tokens", "0", "--eval-every", "0"]
    out = bigbatch_cli(extended, tmp_path, *train, "--out", "run")
    assert "toy: 2 layers, 16 wide" in out and "K 4" in out

    verified = bigbatch_cli(extended, tmp_path, "verify", "--model", "toy-pico", "--top", "0")
    assert "verdict: EQUIVALENT" in verified
    planned = bigbatch_cli(extended, tmp_path, "plan", "--model", "toy-pico", "--tokens-per-step", "1024", "--k", "4")
    assert "sequence length (T)" in planned and "model toy-pico" in planned and "parameters" in planned
    measured = bigbatch_cli(extended, tmp_path, "memory", "--model", "toy-pico", "--max-micro-batch", "2", "--k", "2")
    assert "toy-pico | vocab 256 | seq_len 64" in measured

    assert "perplexity" in bigbatch_cli(extended, tmp_path, "eval", "run", "--batches", "2")
    sampled = bigbatch_cli(
        extended, tmp_path, "sample", "--checkpoint", "run", "--prompt", "the", "--max-new-tokens", "8"
    )
    assert sampled.startswith("the")
    exported = bigbatch_cli(extended, tmp_path, "export", "run", "exported")
    assert "Hugging Face toy layout" in exported
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == "bigbatch-toy"
    resumed = train[:3] + ["--init-from", "exported"] + train[5:]
    again = bigbatch_cli(extended, tmp_path, *resumed, "--max-steps", "1", "--out", "from-export")
    assert "model exported" in again

    # The run's checkpoint holds the toy family's weights; the new run started from the exported ones.
    step3 = torch.load(sorted((tmp_path / "run").glob("**/*.pt"))[-1], weights_only=False)
    assert step3["model_family"] == "toy"
