"""What the project's own folders hold is in git: a pattern in .gitignore meant for a build output must not hide a
source file (a package named ``build`` once vanished from every fresh clone that way)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("src", "tests", "docs", "benchmarks", "examples", "configs")


def _generated(part: str) -> bool:
    """A folder pip, Python or a tool writes (rightly ignored): caches, egg-info."""
    return part == "__pycache__" or part.endswith(".egg-info") or part.startswith(".")


def test_no_source_file_is_ignored_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = [
        str(path.relative_to(ROOT))
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
        and path.suffix in {".py", ".md", ".toml", ".sh", ".txt"}
        and not any(_generated(p) for p in path.parts)
    ]
    assert files, "the walk found no files"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(files),
        capture_output=True,
        text=True,
    ).stdout.split()
    assert ignored == [], f".gitignore hides these source files (a fresh clone would lack them): {ignored}"
