"""Fingerprints of a dataset's tokenizer and of its tokens.

A prepared dataset's ``meta.json`` carries ``fingerprints = {"tokenizer": ..., "data": ...}``, and every
checkpoint carries the fingerprints of the data it was trained on, so a model is never resumed into, or
evaluated on, tokens of another tokenizer that happens to have the same name (``bpe:4096`` trained on other
text), and a change of the training data on resume is noticed.

* tokenizer: ``byte`` and ``gpt2`` are fixed vocabularies, fingerprinted by name; a ``bpe:VOCAB`` or
  ``file:PATH`` tokenizer by the canonical JSON of its ``tokenizer.json`` (the same tokenizer saved compactly or
  pretty-printed matches; a ``file:PATH`` one moved elsewhere matches, another file at the same PATH does not).
* data: SHA-256 over every shard file of the dataset (tokens, document offsets, masks, roles) in the order
  ``meta.json`` lists them. Foreign token shards (build-nanogpt, llm.c), read in place and possibly huge, are
  fingerprinted by file name, size and the first and last MiB of each file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from bigbatch.data.dataset import Dataset
from bigbatch.data.shards import SPLITS, document_mask_name, document_offsets_name, document_roles_name
from bigbatch.data.tokenizers import (
    BPE_FILE,
    FINGERPRINT_LENGTH,
    carries_tokenizer_json,
    file_tokenizer_fingerprint,
    file_tokenizer_path,
    is_file_tokenizer,
)
from bigbatch.errors import DataError

LENGTH = FINGERPRINT_LENGTH  # hex digits kept
_CHUNK = 1 << 20
_SAMPLE = 1 << 20


def tokenizer_fingerprint(name: str, directory: Path | None = None) -> str:
    """The fingerprint of tokenizer ``name``; a ``bpe:VOCAB`` or ``file:PATH`` one is read from the dataset's copy
    in ``directory/tokenizer.json``, a ``file:PATH`` one without such a copy from PATH ("" when there is none)."""
    if not carries_tokenizer_json(name):
        return hashlib.sha256(f"bigbatch-tokenizer:{name}".encode()).hexdigest()[:LENGTH]
    if directory is not None and (Path(directory) / BPE_FILE).is_file():
        return file_tokenizer_fingerprint(Path(directory) / BPE_FILE)
    return file_tokenizer_fingerprint(file_tokenizer_path(name)) if is_file_tokenizer(name) else ""


def tokenizer_cache_key(name: str) -> str:
    """What of a tokenizer goes into the cache key of raw text prepared with it: the name, or for ``file:PATH``
    the content of the file (the same file moved is the same tokenizer; another file at PATH is not)."""
    if not is_file_tokenizer(name):
        return name
    fingerprint = tokenizer_fingerprint(name)
    if not fingerprint:
        raise DataError(
            f"{file_tokenizer_path(name)} is missing: the {name} tokenizer is read from there; restore the file or "
            "point --tokenizer file:PATH at its new place"
        )
    return f"file:{fingerprint}"


def prepared_data_fingerprint(
    directory: Path, shards: dict[str, list[str]], mode: str, masked: bool, roles: bool = False
) -> str:
    """SHA-256 over the shard files of a prepared dataset (tokens, and offsets, masks and the roles of answers in
    documents mode)."""
    digest = hashlib.sha256(f"mode={mode}".encode())
    for split in SPLITS:
        for name in shards.get(split, []):
            names = [name]
            if mode == "documents":
                names.append(document_offsets_name(name))
                if masked:
                    names.append(document_mask_name(name))
                if roles:
                    names.append(document_roles_name(name))
            for part in names:
                digest.update(f"\n{split}/{part}\n".encode())
                with (Path(directory) / part).open("rb") as handle:
                    while chunk := handle.read(_CHUNK):
                        digest.update(chunk)
    return digest.hexdigest()[:LENGTH]


def sampled_files_fingerprint(directory: Path, files: dict[str, list[Path]]) -> str:
    """Name, size, first and last MiB of each file: cheap for token shards of many gigabytes."""
    digest = hashlib.sha256(b"sampled")
    for split in SPLITS:
        for path in files.get(split, []):
            size = path.stat().st_size
            digest.update(f"\n{split}/{path.name}/{size}\n".encode())
            with path.open("rb") as handle:
                digest.update(handle.read(_SAMPLE))
                if size > 2 * _SAMPLE:
                    handle.seek(size - _SAMPLE)
                    digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()[:LENGTH]


def dataset_fingerprints(dataset: Dataset) -> dict[str, str]:
    """``{"tokenizer": ..., "data": ...}`` of an open dataset; empty values where they cannot be known (a
    dataset prepared by an older bigbatch)."""
    meta = dataset.meta
    recorded = getattr(meta, "fingerprints", None) or {}
    tokenizer = str(recorded.get("tokenizer") or "") or tokenizer_fingerprint(meta.tokenizer, dataset.directory)
    data = str(recorded.get("data") or "")
    if not data and hasattr(dataset, "shard_paths"):  # foreign shards: no meta.json to record it in
        data = sampled_files_fingerprint(dataset.directory, {s: dataset.shard_paths(s) for s in SPLITS})
    return {"tokenizer": tokenizer, "data": data}
