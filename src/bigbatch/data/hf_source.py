"""The ``hf:`` data source: a Hugging Face dataset read through the ``datasets`` package (bigbatch's ``[hf]`` extra).

Forms (``#COLUMN`` at the end names the text column; default ``text``)::

    hf:NAME[:CONFIG][:SPLIT]          a dataset on the Hub, streamed (needs a network, or its local cache)
    hf:BUILDER:FILES[:SPLIT]          local files through a packaged builder, streamed: BUILDER is one of json
                                      (.json/.jsonl), csv, parquet, text (one document per line), arrow; FILES a
                                      file, a directory or a glob (e.g. hf:json:data/*.jsonl, hf:csv:t.csv#body)
    hf:DIR[:SPLIT]                    a local directory: one written by ``Dataset.save_to_disk`` (memory-mapped
                                      Arrow, read in place, not streamed), or a directory of data files

Local forms never reach the Hub (the builders are packaged with ``datasets``). Records come in the dataset's
order; tokenizing happens in bigbatch's worker processes (:mod:`bigbatch.data.encode`), as for text files.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.data.answers import answer_kind
from bigbatch.data.chat_rows import CONVERSATION_COLUMNS, is_conversation_row
from bigbatch.data.text import first_bad_utf8
from bigbatch.errors import DataError, require_package

PREFIX = "hf:"
DEFAULT_SPLIT = "train"
DEFAULT_COLUMN = "text"
CHAT_COLUMNS = CONVERSATION_COLUMNS
"""A dataset whose records hold ``messages`` or ShareGPT ``conversations`` (and no ``text``) is read as
conversations, whole records (:mod:`bigbatch.data.chat_rows`); one whose records hold ``chosen``/``rejected``, or
``completion`` and ``label``, as rows of answers, whole records too (:mod:`bigbatch.data.answer_rows`)."""
TEXT_BUILDERS = ("json", "csv", "text")
"""The builders that decode their files as UTF-8 text: a byte that is not is found and named (see
:func:`_named_utf8_error`)."""
TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".txt")
"""In a directory of data files (``hf:DIR``), the files those builders read."""
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""Packaged ``datasets`` builders that read local files."""
SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""A directory written by ``save_to_disk`` holds one of these."""


@dataclass(frozen=True)
class HFSource:
    source: str  # as written
    name: str  # a Hub name, a builder, or a local directory
    config: str | None  # a Hub configuration
    data_files: str | None  # a builder's local files (a file, a directory or a glob)
    split: str
    column: str

    @property
    def local_dir(self) -> Path | None:
        path = Path(self.name).expanduser()
        return path if self.data_files is None and path.is_dir() else None

    @property
    def is_local(self) -> bool:
        return self.data_files is not None or self.local_dir is not None


def parse(source: str) -> HFSource:
    """The parts of an ``hf:`` source (see the module's note)."""
    body, _, column = source[len(PREFIX) :].partition("#")
    parts = body.split(":")
    if not parts[0] or len(parts) > 3 or (column == "" and "#" in source):
        raise DataError(
            f"bad Hugging Face source {source!r}; write hf:NAME[:CONFIG][:SPLIT] (e.g. "
            "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train), hf:BUILDER:FILES[:SPLIT] (e.g. hf:json:data/*.jsonl) "
            "or hf:DIR, with #COLUMN at the end for a text column other than 'text'"
        )
    name = parts[0]
    second = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else DEFAULT_SPLIT
    column = column or DEFAULT_COLUMN
    if name in FILE_BUILDERS:
        if second is None:
            raise DataError(
                f"{source}: the {name} builder reads local files; write hf:{name}:FILES, e.g. "
                f"hf:{name}:data/*.{'jsonl' if name == 'json' else name}"
            )
        return HFSource(source, name, None, second, split, column)
    if Path(name).expanduser().is_dir():  # a local directory: the second part, if any, is the split
        return HFSource(source, name, None, None, parts[-1] if len(parts) > 1 and parts[-1] else split, column)
    return HFSource(source, name, second, None, split, column)


def local_files(source: HFSource) -> list[Path]:
    """The files a local source reads (for the cache key and the progress total); empty for the Hub."""
    if source.data_files is not None:
        pattern = os.path.expanduser(source.data_files)
        path = Path(pattern)
        if path.is_dir():
            return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if path.is_file():
            return [path]
        return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if source.local_dir is not None:
        return sorted(p for p in source.local_dir.rglob("*") if p.is_file() and not p.name.startswith("."))
    return []


def _import_datasets() -> Any:
    return require_package("datasets", "the hf: data source", "hf", package="datasets")


@contextmanager
def _local_only(datasets: Any, local: bool) -> Iterator[None]:
    """For a local source, ``datasets`` offline while it runs: no Hub look-up, and none of the download-count
    pings it otherwise sends for its packaged builders (a network call of up to 3 s per load)."""
    if not local:
        yield
        return
    config = datasets.config
    wanted = {"HF_HUB_OFFLINE": True, "HF_DATASETS_OFFLINE": True, "HF_UPDATE_DOWNLOAD_COUNTS": False}
    saved = {name: getattr(config, name) for name in wanted if hasattr(config, name)}  # names vary by version
    for name in saved:
        setattr(config, name, wanted[name])
    # A builder that fails on a file logs "Failed to read file ..." before it raises; the error is said once, in
    # bigbatch's own line (hf_text_records), so the builders' log is kept below that level meanwhile.
    builders = logging.getLogger("datasets.packaged_modules")
    level = builders.level
    builders.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        builders.setLevel(level)
        for name, value in saved.items():
            setattr(config, name, value)


def _open(src: HFSource, datasets: Any) -> Any:
    """The split's records: an ``IterableDataset`` (streamed) or a memory-mapped ``Dataset`` (saved to disk)."""
    if src.data_files is not None:
        if not local_files(src):
            raise DataError(f"{src.source}: {src.data_files!r} matches no files; give a file, a directory or a glob")
        pattern = os.path.expanduser(src.data_files)
        data_files: str | list[str] = [str(p) for p in local_files(src)] if Path(pattern).is_dir() else pattern
        return datasets.load_dataset(src.name, data_files=data_files, split=src.split, streaming=True)
    directory = src.local_dir
    if directory is not None:
        if any((directory / marker).is_file() for marker in SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(directory))
            if isinstance(loaded, datasets.DatasetDict):
                if src.split not in loaded:
                    raise DataError(
                        f"{directory} has the splits {', '.join(loaded)}, not {src.split!r}; write hf:{src.name}:SPLIT"
                    )
                loaded = loaded[src.split]
            return loaded
        return datasets.load_dataset(str(directory), split=src.split, streaming=True)
    return datasets.load_dataset(src.name, src.config, split=src.split, streaming=True)


def _columns(records: Any) -> list[str]:
    names = getattr(records, "column_names", None)
    return list(names) if names else []


def hf_text_records(source: str) -> Iterator[tuple[str, str | dict[str, Any]]]:
    """``(name, text)`` for each record of the ``hf:`` source, in the dataset's order (a missing value is left
    out; an empty text is kept, for prepare to skip as it skips empty files)."""
    src = parse(source)
    datasets = _import_datasets()

    def offline(exc: BaseException) -> DataError:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if src.is_local:
            return DataError(f"{src.source}: the local dataset could not be read ({detail})")
        return DataError(
            f"the dataset {src.name} could not be downloaded ({detail}); offline? save it as text or .jsonl files "
            "where there is a network and give the local copy instead"
        )

    try:
        with _local_only(datasets, src.is_local):
            yield from _records(src, datasets)
    except DataError:
        raise
    except (ConnectionError, TimeoutError, OSError) as exc:
        raise offline(exc) from exc
    except Exception as exc:  # datasets' own errors (a bad file, a schema it cannot read): one line, named
        if not src.is_local:
            raise
        named = _named_utf8_error(src, exc)
        if named is not None:
            raise named from None
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{src.source}: datasets could not read it ({type(exc).__name__}: {detail})") from exc


def _named_utf8_error(src: HFSource, exc: Exception) -> DataError | None:
    """For a local source whose reader failed on text that is not UTF-8 (a ``UnicodeDecodeError``, or pyarrow's
    "Invalid ... UTF-8" from the json builder), the file and line of the first such byte, and what to do: the
    builders name neither. None for another failure, or where no such byte is found."""
    if not (isinstance(exc, UnicodeDecodeError) or "utf-8" in str(exc).lower() or "utf8" in str(exc).lower()):
        return None
    if src.data_files is not None and src.name not in TEXT_BUILDERS:
        return None  # parquet and arrow files are not text: their strings were checked when written
    for path in local_files(src):
        if src.data_files is None and path.suffix.lower() not in TEXT_SUFFIXES:
            continue  # hf:DIR: a binary file beside the text ones (parquet, arrow) is not read as text
        found = first_bad_utf8(path)
        if found is not None:
            return DataError(f"{src.source}: {found.describe(path)}")
    return None


def _records(src: HFSource, datasets: Any) -> Iterator[tuple[str, str | dict[str, Any]]]:
    """The text of each record of ``src``, named ``SOURCE#NUMBER``."""
    records = _open(src, datasets)
    columns = _columns(records)
    # Conversations: #messages (or #conversations) named, or, reading the default column, a dataset with a
    # conversation column and no text one (told from the columns, or where a stream does not list them, from its
    # first record); bigbatch.data.chat reads the whole record, its tools included.
    # Rows of answers (preference pairs, KTO rows: bigbatch.data.answer_rows) are whole records too, told the same
    # way from their columns (chosen/rejected, or completion and label).
    default = src.column == DEFAULT_COLUMN and DEFAULT_COLUMN not in columns
    found = default and any(c in columns for c in CHAT_COLUMNS)
    answers = default and bool(answer_kind(dict.fromkeys(columns)))
    conversations: bool | None = src.column in CHAT_COLUMNS or found or answers
    if columns and src.column not in columns and not (found or answers):
        raise DataError(
            f"{src.source} has no column {src.column!r} (columns: {', '.join(columns)}); name the "
            f"text column with #COLUMN, e.g. {src.source.partition('#')[0]}#{columns[0]}"
        )
    if not columns and src.column == DEFAULT_COLUMN:
        conversations = None  # the first record decides
    for number, record in enumerate(records, start=1):
        if conversations is None:
            conversations = is_conversation_row(record) or bool(answer_kind(record))
        if conversations and answer_kind(record):  # a row of answers: read whole by bigbatch.data.answer_rows
            yield f"{src.source}#{number}", dict(record)
            continue
        if conversations:  # the whole record: the template may read its tools too
            held = [c for c in CHAT_COLUMNS if isinstance(record, dict) and c in record]
            column = src.column if src.column in CHAT_COLUMNS else (held or list(CHAT_COLUMNS))[0]
            if not isinstance(record, dict) or not isinstance(record.get(column), list):
                raise DataError(f"record {number} of {src.source} has no list {column!r} field")
            yield f"{src.source}#{number}", dict(record)
            continue
        text = record.get(src.column) if isinstance(record, dict) else None
        if not isinstance(text, str):
            if text is None and isinstance(record, dict) and src.column in record:
                continue  # a missing value (null in JSON, an empty CSV cell)
            raise DataError(
                f"record {number} of {src.source} has no string {src.column!r} field"
                f"{' (fields: ' + ', '.join(record) + ')' if isinstance(record, dict) else ''}; the hf: source "
                f"reads {src.column!r}: name another column with #COLUMN"
            )
        yield f"{src.source}#{number}", text
