"""Starting the processes the integration tests need: tests/support on every worker's import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent


def support_pythonpath() -> str:
    """PYTHONPATH for a child process: tests/support first, then whatever was there."""
    return os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p)


def torchrun(*args: str, nproc: int = 2, extra: tuple[str, ...] = ("--standalone",), cwd: Path | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": support_pythonpath()}
    command = [sys.executable, "-m", "torch.distributed.run", *extra, f"--nproc-per-node={nproc}", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
