"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

On disk, the checkpoint of step 100 is a directory and a marker beside it::

    checkpoints/step_0000100/
        state.pt            rank 0: the run record and the small state (engine counters, schedule, loader
                            position, tokens seen, ramp, every rank's generators, the optimizer's param groups)
        .metadata           DCP's index of the tensors (written by rank 0 once every rank has written)
        __R_I.distcp        DCP: rank R's shards of the model's and the optimizer's tensors
    checkpoints/step_0000100.commit
                            JSON, written last by rank 0 once every rank's files are on disk: the step, every
                            file's size and SHA-256 (each rank hashes its own), and one digest of them all

Nothing is gathered onto one rank: under FSDP2 a rank writes its shard; under DDP and in one process each
tensor is written once (DCP spreads replicated tensors over the ranks). Because DCP records every tensor's
global shape and each shard's offsets, any world size reads the checkpoint back (:func:`load_sharded`), and one
process consolidates it into whole tensors (:func:`read_tensors`) for sample, eval and export.

Only tensors go to DCP, and its index is read with an unpickler that admits DCP's own metadata classes alone,
so reading a checkpoint from someone else runs none of its code (as ``weights_only`` does for ``state.pt``).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from bigbatch.errors import CheckpointError
from bigbatch.files.atomic import fsync_dir, write_atomically
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.progress import plural

STATE_FILE = "state.pt"
METADATA_FILE = ".metadata"
SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_CHUNK = 1 << 20
DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)

# What DCP's index may name: its own metadata classes, shapes, dtypes and layouts, and a path (the checkpoint id).
_INDEX_MODULES = {"torch.distributed.checkpoint.metadata"}
_INDEX_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _INDEX_MODULES or (module, name) in _INDEX_NAMES or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint index")


def _safe_reader(folder: Path) -> Any:
    """DCP's file reader, reading the index with :class:`_IndexUnpickler` instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _IndexUnpickler(io.BytesIO((folder / METADATA_FILE).read_bytes())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def read_index(folder: Path) -> Any:
    """DCP's index of the checkpoint in ``folder`` (every tensor's name, global shape and dtype)."""
    return _safe_reader(folder).read_metadata()


def file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def rank_files(folder: Path, rank: int) -> list[Path]:
    """The shard files rank ``rank`` wrote into ``folder`` (DCP names them ``__RANK_N.distcp``)."""
    return sorted(p for p in folder.iterdir() if (m := SHARD_FILE.match(p.name)) and int(m.group(1)) == rank)


def checkpoint_digest(files: dict[str, dict[str, Any]]) -> str:
    """One SHA-256 for a whole sharded checkpoint: of its files' names, sizes and checksums."""
    text = json.dumps({name: [entry["size"], entry["sha256"]] for name, entry in sorted(files.items())})
    return hashlib.sha256(text.encode()).hexdigest()


def write_marker(marker: Path, step: int, files: dict[str, dict[str, Any]]) -> None:
    document = {"step": step, "format": "sharded", "files": files, "sha256": checkpoint_digest(files)}
    write_atomically(marker, lambda handle: handle.write(json.dumps(document).encode() + b"\n"))


def verify_sharded(folder: Path, marker: dict[str, Any]) -> str | None:
    """Why the sharded checkpoint in ``folder`` does not match its commit marker, or ``None`` when it does."""
    files = marker.get("files")
    if not isinstance(files, dict) or STATE_FILE not in files or METADATA_FILE not in files:
        return "its commit marker lists no files"
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"its file {name} is missing"
        if path.stat().st_size != int(entry["size"]):
            return (
                f"its file {name} is {path.stat().st_size} bytes, the commit marker says {entry['size']} (truncated?)"
            )
        if file_digest(path)["sha256"] != entry["sha256"]:
            return f"its file {name} does not match the commit marker's checksum (damaged on disk?)"
    return None


def _tensor_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted.name: tensor}`` of a nested dict; anything but tensors is refused (DCP would pickle it)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if not isinstance(tree, dict):
        raise TypeError(f"{prefix or 'the state'} is a {type(tree).__name__}; sharded checkpoints hold tensors only")
    leaves: dict[str, Any] = {}
    for key, value in tree.items():
        leaves.update(_tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def read_tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of the sharded checkpoint in ``folder`` as a whole tensor, in this one process, nested as
    saved (``{"model": {...}, "optimizer": {...}}``). Memory: the whole model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_index(folder)
    flat: dict[str, torch.Tensor] = {}
    for name, entry in index.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder} holds a non-tensor entry {name!r}: it was not written by bigbatch")
        flat[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with _single_process_quiet():
        dcp.load(
            flat,
            storage_reader=_safe_reader(folder),
            planner=DefaultLoadPlanner(flatten_state_dict=False),
            no_dist=True,
        )
    nested: dict[str, Any] = {}
    paths = index.planner_data or {}
    for name, tensor in flat.items():
        where = nested
        path = [str(part) for part in paths.get(name, name.split("."))]
        for part in path[:-1]:
            where = where.setdefault(part, {})
        where[path[-1]] = tensor
    return nested


def load_sharded(folder: Path, state: dict[str, Any], dist: DistContext) -> None:
    """Fill ``state`` (nested dicts of this rank's tensors or DTensor shards, e.g. from ``get_state_dict``) in
    place from the checkpoint in ``folder``, resharding to this world size. A collective."""
    import torch.distributed.checkpoint as dcp

    _tensor_leaves(state)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=_safe_reader(folder), no_dist=not dist.is_distributed)
    except DCP_ERRORS as exc:
        raise CheckpointError(f"cannot load the shards of checkpoint {folder}: {root_cause(exc)}") from exc


class _RecordingStream:
    """A file DCP writes, remembering the first OS error of a write (``torch.save`` turns a full disk into a
    RuntimeError, "unexpected pos ...", that hides the cause)."""

    def __init__(self, stream: Any, errors: list[OSError]) -> None:
        self.stream, self.errors = stream, errors

    def write(self, data: Any) -> int:
        try:
            return int(self.stream.write(data))
        except OSError as exc:
            self.errors.append(exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _recording_writer(folder: Path, errors: list[OSError]) -> Any:
    """DCP's file writer, its files wrapped in :class:`_RecordingStream`."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class RecordingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                yield _RecordingStream(stream, errors) if "w" in mode else stream

    writer = FileSystemWriter(str(folder))
    writer.fs = RecordingFileSystem()
    return writer


@dataclass
class _Save:
    """One save in flight: DCP's future (async) and where it goes."""

    step: int
    folder: Path
    marker: Path
    started: float
    say: Say
    future: Future[Any] | None = None
    errors: list[OSError] = field(default_factory=list)  # OS errors of this rank's writes


@dataclass
class ShardedWriter:
    """Writes sharded checkpoints, one at a time; with ``asynchronous`` the tensors are staged in host memory and
    written by a background thread while training goes on (the next save, or :meth:`wait`, waits for it).

    The background thread's collectives run on a gloo group of their own, so they never interleave with the
    training's; the commit marker is written after every rank has hashed its files, so a crash at any moment
    leaves the previous checkpoint the newest valid one."""

    dist: DistContext
    asynchronous: bool = False
    committed: Any = None  # called with (folder, step) on rank 0 after each commit (retention)
    _group: Any = None
    _executor: ThreadPoolExecutor | None = None
    _pending: Future[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.asynchronous:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigbatch-checkpoint")
            if not self.dist.is_distributed:  # DCP's thread warns on every save that it assumes one process
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if self.dist.is_distributed:
                import torch.distributed as dist

                self._group = dist.new_group(backend="gloo")  # every rank creates it at the same point

    def save(
        self,
        step: int,
        folder: Path,
        marker: Path,
        tensors: dict[str, Any],
        record: dict[str, Any] | None,
        say: Say,
    ) -> str:
        """Write ``tensors`` (every rank's own) and, on rank 0, ``record`` as the checkpoint of ``step`` in
        ``folder``; returns the line to say (an empty line for an asynchronous save, which ``say``s it when it
        commits)."""
        self.wait()
        _tensor_leaves(tensors)
        save = _Save(step, folder, marker, time.perf_counter(), say)
        error = self._prepare(save, record) if self.dist.is_main else ""
        error = self.dist.broadcast_object(error)  # the others wait until the folder is ready
        if error:
            raise CheckpointError(error)
        import torch.distributed.checkpoint as dcp

        writer = _recording_writer(folder, save.errors)
        no_dist = not self.dist.is_distributed
        if self._executor is None:
            try:
                with _single_process_quiet():
                    dcp.save(tensors, storage_writer=writer, no_dist=no_dist)
            except DCP_ERRORS as exc:  # DCP gathers every rank's failure and raises it on all of them
                raise CheckpointError(self._failed(save, exc, group=None)) from exc
            return self._commit(save, group=None)
        with _single_process_quiet():  # stages a host copy of the tensors, then writes them in DCP's thread
            response = dcp.async_save(tensors, storage_writer=writer, process_group=self._group, no_dist=no_dist)
        save.future = response if isinstance(response, Future) else response.upload_completion
        self._pending = self._executor.submit(self._finish, save)
        return ""

    def wait(self) -> str:
        """Wait for the asynchronous save in flight (none: at once); its failure is a :class:`CheckpointError`."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else ""

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _prepare(self, save: _Save, record: dict[str, Any] | None) -> str:
        """Rank 0: uncommit a re-save of the same step, clear its folder, write ``state.pt``; a failure's line."""
        try:
            save.marker.unlink(missing_ok=True)
            if save.folder.exists():
                shutil.rmtree(save.folder)
            save.folder.mkdir(parents=True)
            write_atomically(save.folder / STATE_FILE, lambda handle: torch.save(record, handle))
        except OSError as exc:
            return self._failed(save, exc, gather=False)  # rank 0 alone: the others wait for its word
        return ""

    def _finish(self, save: _Save) -> str:
        """The background thread: DCP's write, then the commit (collectives on this writer's own group)."""
        assert save.future is not None
        try:
            save.future.result()
        except DCP_ERRORS as exc:
            raise CheckpointError(self._failed(save, exc, group=self._group)) from exc
        line = self._commit(save, group=self._group)
        if line:
            save.say("%s", line)
        return line

    def _commit(self, save: _Save, group: Any) -> str:
        """Every rank hashes the files it wrote; rank 0 adds ``state.pt`` and the index and writes the marker
        (its failure is every rank's :class:`CheckpointError`)."""
        mine = {p.name: file_digest(p) for p in rank_files(save.folder, self.dist.rank)}
        everyone = [mine]
        if self.dist.is_distributed:
            import torch.distributed as dist

            everyone = [{} for _ in range(self.dist.world_size)]
            dist.all_gather_object(everyone, mine, group=group)
        files = {name: entry for part in everyone for name, entry in part.items()}
        error = self._write_marker(save, files) if self.dist.is_main else ""
        if self.dist.is_distributed:
            import torch.distributed as dist

            holder = [error]
            dist.broadcast_object_list(holder, src=0, group=group)
            error = holder[0]
        if error:
            raise CheckpointError(error)
        if not self.dist.is_main:
            return ""
        if self.committed is not None:
            self.committed(save.folder, save.step)
        size = sum(entry["size"] for entry in files.values())
        seconds = time.perf_counter() - save.started
        how = plural(len(files) - 2, "shard file") + (", in the background" if save.future is not None else "")
        return f"saved checkpoint {save.folder} ({size / 1e6:.1f} MB, {how}, {seconds:.2f}s)"

    def _write_marker(self, save: _Save, files: dict[str, dict[str, Any]]) -> str:
        """Rank 0: the commit marker, last; a failure's line."""
        try:
            for name in (STATE_FILE, METADATA_FILE):
                files[name] = file_digest(save.folder / name)
            fsync_dir(save.folder)
            write_marker(save.marker, save.step, files)
        except OSError as exc:
            return self._failed(save, exc, gather=False)
        return ""

    def _failed(self, save: _Save, exc: BaseException, group: Any = None, gather: bool = True) -> str:
        """The line for a failed save, the same on every rank (a full disk on any rank is named: with ``gather``,
        a collective); rank 0 removes what the save left (never committed)."""
        causes = [save.errors[0].strerror if save.errors and save.errors[0].strerror else ""]
        if gather and self.dist.is_distributed:
            import torch.distributed as dist

            causes = [""] * self.dist.world_size
            dist.all_gather_object(causes, causes[0] if not save.errors else save.errors[0].strerror, group=group)
        cause = next((c for c in causes if c), "") or root_cause(exc)
        if self.dist.is_main:
            shutil.rmtree(save.folder, ignore_errors=True)
        return f"could not save checkpoint {save.folder}: {cause}; earlier checkpoints are intact"


def root_cause(exc: BaseException) -> str:
    """What went wrong, in a few words: the first rank's error inside DCP's gathered ones, an OS error's text."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process; it is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
