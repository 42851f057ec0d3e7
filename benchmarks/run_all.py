"""``make bench``: every benchmark in this folder, each printing ratios measured side by side in one run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARIES = {
    "run_all.py",
    "reference_gpt.py",
    "bench_config.py",
}  # imported by the benchmarks, not benchmarks themselves


def main() -> int:
    failed = 0
    for script in sorted(HERE.glob("*.py")):
        if script.name in LIBRARIES:
            continue
        print(f"== {script.name}", flush=True)
        failed += subprocess.call([sys.executable, str(script)]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
