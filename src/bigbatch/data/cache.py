"""The cache of prepared raw text: where it lives, the key of a source, and :func:`ensure_prepared`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from bigbatch.data.answers import AnswerSettings
from bigbatch.data.chat import ChatSettings, has_chat_template, template_fingerprint
from bigbatch.data.corpus import BUILTIN, is_hf_source, resolve_source
from bigbatch.data.data_mode import holds_answers, resolve_data_mode
from bigbatch.data.fingerprint import tokenizer_cache_key
from bigbatch.data.foreign import foreign_files
from bigbatch.data.prepare import default_answer_settings, prepare_dataset
from bigbatch.data.shards import is_prepared_dataset
from bigbatch.data.split import SPLIT_RULE
from bigbatch.data.tokenizers import (
    file_tokenizer_path,
    is_bpe,
    is_file_tokenizer,
    tokenizer_json_fingerprint,
    tokenizer_label,
)

log = logging.getLogger(__name__)


def _source_fingerprint(source: str, tokenizer_name: str, val_fraction: float, mode: str) -> str:
    entries: list[Any] = []
    if is_hf_source(source):
        entries.append(source)  # the source names it; local files (hf:json:..., hf:DIR) are also stat'ed
        from bigbatch.data.hf_source import local_files, parse

        for path in local_files(parse(source)):
            stat = path.stat()
            entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    else:
        for path in resolve_source(source):
            stat = path.stat()
            entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    payload = json.dumps(
        {"files": entries, "tokenizer": tokenizer_name, "val_fraction": val_fraction, "mode": mode, "split": SPLIT_RULE}
    )  # the split rule: data prepared under another rule is prepared again
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _chat_key(tokenizer_name: str, chat: ChatSettings) -> str:
    """What decides how conversations become tokens, beside the tokenizer: the chat template of a ``file:``
    tokenizer's directory and the chat settings; empty for a tokenizer without a template (so the keys of text
    prepared with it stay as they were)."""
    if not is_file_tokenizer(tokenizer_name):
        return ""
    directory = file_tokenizer_path(tokenizer_name).parent
    if not has_chat_template(directory):
        return ""
    return f"{template_fingerprint(directory)}:{chat.key()}"


def default_cache_dir() -> Path:
    env = os.environ.get("BIGBATCH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bigbatch"


def ensure_prepared(
    data: str,
    tokenizer_name: str,
    val_fraction: float,
    cache_dir: Path | str | None = None,
    mode: str = "packed",
    bpe_json: str | None = None,
    chat: ChatSettings | None = None,
    answers: AnswerSettings | None = None,
) -> Path:
    """A prepared dataset directory for ``data``.

    ``data`` is either a prepared directory or foreign token shards (build-nanogpt ``.npy``, llm.c ``.bin``:
    a directory, file or glob), used as they are, or raw text (``builtin``, a file, a directory or a glob),
    prepared once into the cache and reused while the files are unchanged. ``mode`` ``auto`` is resolved
    (:mod:`~bigbatch.data.data_mode`) before the cache key is made. ``bpe_json``: see
    :func:`~bigbatch.data.prepare.prepare_dataset` (its fingerprint becomes part of the cache key). Rows of answers
    (preference pairs, KTO rows) are keyed apart from the same files read otherwise, with ``answers`` (default:
    bad rows refused, long ones as ``chat`` keeps conversations within a row).
    """
    path = Path(data).expanduser()
    if tokenizer_name in ("", "auto"):  # raw text's default; prepared or token-shard data keeps its own
        tokenizer_name = "byte"
    raw = data == BUILTIN or is_hf_source(data)
    if not raw and is_prepared_dataset(path):
        return path
    if not raw and foreign_files(data):
        return path  # token shards from build-nanogpt or llm.c: read as they are
    # auto resolved first: text keeps the key (and directory name) it had under the old default, packed
    mode = resolve_data_mode(mode, data, tokenizer_name)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = _source_fingerprint(data, tokenizer_cache_key(tokenizer_name), val_fraction, mode)
    if bpe_json and is_bpe(tokenizer_name):
        key = hashlib.sha256(f"{key}:{tokenizer_json_fingerprint(bpe_json)}".encode()).hexdigest()[:16]
    chat_settings = chat or ChatSettings()
    chat_key = _chat_key(tokenizer_name, chat_settings)
    if chat_key:
        key = hashlib.sha256(f"{key}:{chat_key}".encode()).hexdigest()[:16]
    answer_settings = answers or default_answer_settings(chat_settings)
    # rows of answers are keyed apart from the same files read otherwise (KTO rows were once prompt/completion)
    if mode == "documents" and holds_answers(data, tokenizer_name, open_remote=True):
        key = hashlib.sha256(f"{key}:{answer_settings.key()}".encode()).hexdigest()[:16]
    if is_hf_source(data):
        label = re.sub(r"[^\w.-]+", "_", data[3:]).strip("_") or "hf"
    else:
        label = "builtin" if data == BUILTIN else Path(data).name.replace("*", "_") or "data"
    target = cache / f"{label}-{tokenizer_label(tokenizer_name)}-{mode}-{key}"
    if is_prepared_dataset(target):
        return target
    log.info("preparing %s with the %s tokenizer into %s (once; later runs reuse it)", data, tokenizer_name, target)
    prepare_dataset(
        data,
        target,
        tokenizer_name=tokenizer_name,
        val_fraction=val_fraction,
        mode=mode,
        bpe_json=bpe_json if is_bpe(tokenizer_name) else None,
        wait_for_lock=True,
        chat=chat,
        answers=answer_settings,
    )
    return target
