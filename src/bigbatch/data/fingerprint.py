"""Fingerprints of a dataset's tokenizer and of its tokens.

A prepared dataset's ``meta.json`` carries ``fingerprints = {"tokenizer": ..., "data": ...}``, and every
checkpoint carries the fingerprints of the data it was trained on, so a model is never resumed into, or
evaluated on, tokens of another tokenizer that happens to have the same name (``bpe:4096`` trained on other
text), and a change of the training data on resume is noticed.

* tokenizer: ``byte`` and ``gpt2`` are fixed vocabularies, fingerprinted by name; a ``bpe:VOCAB`` tokenizer by
  the canonical JSON of its ``tokenizer.json`` (the same tokenizer saved compactly or pretty-printed matches).
* data: SHA-256 over every shard file of the dataset (tokens, document offsets, masks) in the order
  ``meta.json`` lists them. Foreign token shards (build-nanogpt, llm.c), read in place and possibly huge, are
  fingerprinted by file name, size and the first and last MiB of each file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bigbatch.data.dataset import Dataset
from bigbatch.data.shards import SPLITS, document_mask_name, document_offsets_name
from bigbatch.data.tokenizers import BPE_FILE, is_bpe
from bigbatch.errors import DataError

LENGTH = 16  # hex digits kept
_CHUNK = 1 << 20
_SAMPLE = 1 << 20


def tokenizer_json_fingerprint(text: str) -> str:
    """The fingerprint of a Hugging Face ``tokenizer.json`` document, independent of its formatting."""
    try:
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError:
        canonical = text
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:LENGTH]


def tokenizer_fingerprint(name: str, directory: Path | None = None) -> str:
    """The fingerprint of tokenizer ``name``; a ``bpe:VOCAB`` one is read from ``directory/tokenizer.json``."""
    if is_bpe(name):
        if directory is None or not (Path(directory) / BPE_FILE).is_file():
            return ""
        try:
            return tokenizer_json_fingerprint((Path(directory) / BPE_FILE).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {Path(directory) / BPE_FILE}: {exc}; re-run bigbatch prepare") from exc
    return hashlib.sha256(f"bigbatch-tokenizer:{name}".encode()).hexdigest()[:LENGTH]


def prepared_data_fingerprint(directory: Path, shards: dict[str, list[str]], mode: str, masked: bool) -> str:
    """SHA-256 over the shard files of a prepared dataset (tokens, and offsets and masks in documents mode)."""
    digest = hashlib.sha256(f"mode={mode}".encode())
    for split in SPLITS:
        for name in shards.get(split, []):
            names = [name]
            if mode == "documents":
                names.append(document_offsets_name(name))
                if masked:
                    names.append(document_mask_name(name))
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
