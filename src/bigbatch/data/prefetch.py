"""Data loading off the critical path: a loader read ahead by a background thread.

:class:`PrefetchLoader` wraps a training loader (a :class:`~bigbatch.data.loader.ResumableLoader`, packed or
documents) from outside. A background thread reads up to ``depth`` micro-batches ahead (pinning them when the
device is CUDA, so the engine's non-blocking copy overlaps compute) while the current step computes; the step
assembler takes them in order, in the main thread, exactly as it would from the loader itself.

What the wrapper reports is the state **after the micro-batches taken**, never after those read ahead:
``epoch``, ``sequences_left()`` and ``state_dict()`` come from a snapshot the thread takes after reading each
micro-batch, so a checkpoint saved mid-run resumes at the first micro-batch not yet trained on (bitwise, as
without prefetching), and an epoch ends where the consumer sees it end. Anything that moves the position
(``skip_rest_of_epoch``, ``load_state_dict``, ``reset``) stops the thread, puts the loader back at the taken
position, applies the change, and reading ahead starts again at the next take.

Only the thread touches the wrapped loader while it runs; ``depth=0`` reads synchronously (no thread).
"""

from __future__ import annotations

import copy
import queue
import threading
from dataclasses import dataclass
from typing import Any

from bigbatch.data.loader import ResumableLoader
from bigbatch.engine.batch import MicroBatch


@dataclass(frozen=True)
class _Position:
    """The loader's state right after some micro-batch was read."""

    state: dict[str, Any]
    epoch: int
    sequences_left: int | None
    sequences_per_epoch: int | None  # packed documents: the rows of this epoch, which may differ from the next's


def _position(loader: ResumableLoader) -> _Position:
    return _Position(
        copy.deepcopy(loader.state_dict()), int(loader.epoch), loader.sequences_left(), loader.sequences_per_epoch()
    )


class PrefetchLoader:
    """``loader`` read ``depth`` micro-batches ahead by a background thread (see the module docstring)."""

    def __init__(self, loader: ResumableLoader, depth: int, pin_memory: bool = False) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.loader = loader
        self.depth = depth
        self.pin_memory = pin_memory
        self._taken = _position(loader)  # where the consumer stands
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the consumer's view: MicroBatchSource, at the taken position ------------------------------------------
    @property
    def epoch(self) -> int:
        return self._taken.epoch

    def sequences_left(self) -> int | None:
        return self._taken.sequences_left

    def sequences_per_micro_batch(self) -> int:
        return self.loader.sequences_per_micro_batch()

    def sequences_per_epoch(self) -> int | None:
        return self._taken.sequences_per_epoch

    def known_valid_targets(self) -> int | None:
        return self.loader.known_valid_targets()

    def next_micro_batch(self) -> MicroBatch:
        if self.depth == 0:
            batch = self._read()
            self._taken = _position(self.loader)
            return batch
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._join()
            raise item
        batch, self._taken = item
        return batch

    def __iter__(self) -> PrefetchLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    # -- moves of the position: back to the taken one, then the change --------------------------------------
    def skip_rest_of_epoch(self) -> None:
        self._rewind()
        self.loader.skip_rest_of_epoch()
        self._taken = _position(self.loader)

    def reset(self) -> None:
        self._rewind()
        self.loader.reset()
        self._taken = _position(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the micro-batches taken (not after those read ahead)."""
        return copy.deepcopy(self._taken.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rewind()
        try:
            self.loader.load_state_dict(state)
        finally:
            self._taken = _position(self.loader)

    def close(self) -> None:
        """Stop reading ahead and put the loader back at the taken position (reading resumes on the next take)."""
        self._rewind()

    def __getattr__(self, name: str) -> Any:  # what else the loader has (n_sequences, micro_batch, ...)
        if name == "loader":  # not yet set: during construction or unpickling
            raise AttributeError(name)
        return getattr(self.loader, name)

    # -- the reading thread -------------------------------------------------------------------------------------
    def _read(self) -> MicroBatch:
        batch = self.loader.next_micro_batch()
        return batch.pin_memory() if self.pin_memory else batch

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="bigbatch-prefetch", daemon=True)
        self._thread.start()

    def _run(self, out: queue.Queue[Any]) -> None:
        try:
            while not self._stop.is_set():
                out.put((self._read(), _position(self.loader)))  # blocks while ``depth`` are waiting
        except BaseException as exc:  # handed to the consumer, raised at its next take
            out.put(exc)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._thread, self._queue = None, None

    def _rewind(self) -> None:
        """Stop the thread, drop what it read ahead, and put the loader back where the consumer stands."""
        if self._thread is None:
            return
        self._stop.set()
        assert self._queue is not None
        while self._thread.is_alive():  # drain, so that a put blocked on a full queue returns and sees the stop
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._join()
        self.loader.load_state_dict(self._taken.state)
