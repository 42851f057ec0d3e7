"""A one-process training run that SIGKILLs itself in the middle of saving the checkpoint of step 3.

``python kill_mid_save.py CORPUS OUT POINT OFFSET [async]``: POINT is where the save dies: ``state`` (while
rank 0 writes ``state.pt``), ``shard`` (after OFFSET bytes of the shard files), ``marker`` (every file written,
before the commit marker). With ``async`` the checkpoints are written in the background.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reliability_runs import make_config
from torch.distributed.checkpoint import filesystem as dcp_files

from bigbatch.run.checkpoints import sharded
from bigbatch.run.loop.trainer import Trainer

DYING_STEP = "step_0000003"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class DyingStream:
    def __init__(self, stream: Any, budget: list[int]) -> None:
        self.stream, self.budget = stream, budget

    def write(self, data: Any) -> int:
        if len(data) >= self.budget[0]:
            self.stream.write(bytes(data)[: self.budget[0]])
            self.stream.flush()
            die()
        self.budget[0] -= len(data)
        return int(self.stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def plant(point: str, offset: int) -> None:
    if point == "state":
        real_write = sharded.write_atomically

        def write_atomically(path: Path, write: Any) -> None:
            if path.name == sharded.STATE_FILE and DYING_STEP in str(path):
                die()
            real_write(path, write)

        sharded.write_atomically = write_atomically  # type: ignore[assignment]
    elif point == "shard":
        real_stream = dcp_files.FileSystem.create_stream
        budget = [offset]

        @contextlib.contextmanager
        def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
            with real_stream(self, path, mode) as stream:
                dying = DYING_STEP in str(path) and str(path).endswith(".distcp") and "w" in mode
                yield DyingStream(stream, budget) if dying else stream

        dcp_files.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    elif point == "marker":
        real_marker = sharded.write_marker

        def write_marker(marker: Path, step: int, files: dict[str, Any]) -> None:
            if DYING_STEP in marker.name:
                die()
            real_marker(marker, step, files)

        sharded.write_marker = write_marker  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def main() -> None:
    corpus, out, point, offset = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    plant(point, offset)
    asynchronous = len(sys.argv) > 5 and sys.argv[5] == "async"
    Trainer(make_config(corpus, out, save_every=1, keep_checkpoints=0, async_checkpoint=asynchronous)).train()
    raise SystemExit("the save of step 3 was expected to die")


if __name__ == "__main__":
    main()
