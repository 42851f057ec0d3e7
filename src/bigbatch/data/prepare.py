"""Tokenize text into a prepared dataset directory (shards + meta.json): the orchestration.

Documents are read (:mod:`~bigbatch.data.corpus`), cut into pieces at boundaries every tokenizer here keeps
(:mod:`~bigbatch.data.text`) and tokenized — in worker processes when the corpus is large and the tokenizer is
not the byte one, results in order (:mod:`~bigbatch.data.encode`) — and the tokens are written to disk as they
come, so memory holds neither the corpus nor its tokens; then the stream is split (:mod:`~bigbatch.data.split`)
and written as shards (:mod:`~bigbatch.data.writer`). A ``bpe:VOCAB`` tokenizer is first trained on the same
documents (streamed) and saved as ``tokenizer.json`` beside the shards. The cache of prepared raw text is
:mod:`~bigbatch.data.cache`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigbatch.data.answer_encode import AnswerEncoder, answer_audit_lines, shown_groups
from bigbatch.data.answer_prepare import prepare_answers
from bigbatch.data.answer_rows import AnswerRow
from bigbatch.data.answers import AnswerSettings
from bigbatch.data.chat import ChatEncoder, ChatSettings, audit_lines, has_chat_template, template_fingerprint
from bigbatch.data.corpus import Document, hf_documents, is_hf_source, read_documents, resolve_source, text_files
from bigbatch.data.corpus_progress import CorpusProgress
from bigbatch.data.data_mode import resolve_data_mode
from bigbatch.data.encode import encoded_documents, worker_count
from bigbatch.data.fingerprint import prepared_data_fingerprint, tokenizer_fingerprint
from bigbatch.data.resumable import (
    LENGTHS_FILE,
    Checkpoint,
    restore_lengths,
    resumable_directory,
    skip_done,
    write_lengths,
)
from bigbatch.data.shards import META_FILE, DatasetMeta, is_prepared_dataset, token_dtype
from bigbatch.data.split import SPLIT_RULE, SPLIT_SEED, document_splits, packed_splits
from bigbatch.data.text import InvalidUTF8, split_text
from bigbatch.data.tokenizers import (
    BPE_FILE,
    BPETokenizer,
    FileTokenizer,
    Tokenizer,
    bpe_vocab_size,
    file_tokenizer_path,
    is_bpe,
    text_tokenizer,
    train_bpe,
)
from bigbatch.data.writer import ShardNames, TokenCounts, staged_directory, write_documents, write_meta, write_packed
from bigbatch.errors import ConfigError, DataError, require_creatable_dir
from bigbatch.files.lock import FileLock, Holder, LockBusy, acquire
from bigbatch.progress import plural
from bigbatch.settings.choices import DATA_MODE

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000
_STREAM_FILE = ".tokens.tmp"
_MASK_FILE = ".mask.tmp"  # documents mode: a byte per token of the stream, 1 = trained on as a target

Encoded = tuple[np.ndarray, "np.ndarray | None", int, int]
"""One document tokenized: (ids, trained mask or None for a prompt length's, masked positions, bytes of text)."""


@dataclass
class _Tokenized:
    """What tokenizing the corpus into the stream file found, per document and in all."""

    lengths: list[int] = field(default_factory=list)  # tokens per document
    prompt_lengths: list[int] = field(default_factory=list)  # masked (untrained) tokens per document: its prompt's
    n_bytes: int = 0  # text read
    seconds: float = 0.0


def prepare_dataset(
    source: str,
    out_dir: Path | str,
    tokenizer_name: str = "byte",
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    mode: str = "packed",
    workers: int | None = None,
    bpe_json: str | None = None,
    wait_for_lock: bool = False,
    chat: ChatSettings | None = None,
    answers: AnswerSettings | None = None,
) -> DatasetMeta:
    """Tokenize ``source`` into ``out_dir``.

    ``packed``: documents are tokenized in sorted file order and joined (with the
    tokenizer's end-of-text token where it has one) into one stream; ``val_fraction`` of its tokens become the
    validation split: whole documents drawn at random (seeded) and the tail of at most one more (a single text:
    its last ``val_fraction``), see :mod:`~bigbatch.data.split`.

    ``documents``: each document stays a unit (one sequence when training, padded; a document longer than
    the sequence length is split into windows or truncated by the training run's ``long_documents`` policy,
    which needs the sequence length and so is not fixed here); shards store document offsets beside the
    tokens, a ``.mask.npy`` marks the tokens to train on when any document has a
    masked prompt, and ``val_fraction`` of the documents, drawn at random (seeded), are validation.

    ``tokenizer_name`` ``bpe:VOCAB`` trains a byte-level BPE with that vocabulary on the documents first and
    keeps it in ``out_dir/tokenizer.json``; with ``bpe_json`` (a ``tokenizer.json`` document, e.g. a run's own)
    that tokenizer is used and kept instead of training one.

    Rows holding ``messages`` (or ShareGPT ``conversations``) are conversations (:mod:`~bigbatch.data.chat`): they
    need ``documents`` mode (what ``mode="auto"`` picks for a source whose first row is one; for any other source
    ``auto`` is ``packed``, see :mod:`~bigbatch.data.data_mode`) and a ``file:PATH`` tokenizer whose directory has
    the model's chat template; ``chat`` says which tokens are trained (default: every assistant turn) and
    ``meta.json`` keeps the audit.

    Rows of answers (preference pairs ``prompt``/``chosen``/``rejected``, KTO rows ``prompt``/``completion``/
    ``label``; :mod:`~bigbatch.data.answer_rows`) need ``documents`` mode too (``auto`` picks it): each row becomes
    a group of documents with their roles (:mod:`~bigbatch.data.answer_prepare`); ``answers`` says what becomes of
    bad and over-long rows (default: bad rows refused, long ones by ``chat``'s ``long_conversations`` and
    ``max_tokens``) and ``meta.json`` keeps the counts.

    ``workers``: processes that tokenize; ``None`` picks one per CPU core when the corpus is large enough
    to gain from it and the tokenizer is not ``byte``, 1 tokenizes in this process. The shards are the same
    either way.

    The directory is built under a temporary name and renamed into place, so a
    failed run leaves nothing half-written; an existing non-empty ``out_dir`` is
    never overwritten. One process at a time prepares ``out_dir`` (:func:`preparation_lock`); with
    ``wait_for_lock`` another one waits for it and returns what it prepared.
    """
    _check_settings(val_fraction, shard_tokens, mode, workers)
    mode = resolve_data_mode(mode, source, tokenizer_name)  # auto: documents for conversations, else packed
    out = Path(out_dir)
    _refuse_existing(out)
    require_creatable_dir(out, "dataset directory")
    with preparation_lock(out, wait_for_lock):
        if wait_for_lock and is_prepared_dataset(out):  # the process waited for prepared it
            return DatasetMeta.from_file(out / META_FILE)
        _refuse_existing(out)
        settings = chat or ChatSettings()
        answer_settings = answers or default_answer_settings(settings)
        return _prepare(
            source, out, tokenizer_name, val_fraction, shard_tokens, mode, workers, bpe_json, settings, answer_settings
        )


def default_answer_settings(chat: ChatSettings, bad_rows: str = "refuse") -> AnswerSettings:
    """Rows of answers kept within a row as conversations are (``chat``'s ``long_conversations`` and
    ``max_tokens``), bad rows by ``bad_rows``."""
    return AnswerSettings(bad_rows=bad_rows, long_rows=chat.long_conversations, max_tokens=chat.max_tokens)


def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty; choose a new --out or remove it first")


def preparation_lock(out: Path, wait: bool) -> FileLock:
    """Held while ``out`` is prepared (``.NAME.lock`` beside it): one process prepares a dataset; another one
    refuses, or with ``wait`` waits and then finds it prepared."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def waiting(holder: Holder | None) -> None:
        log.info("waiting for %s, which is preparing %s", holder.describe() if holder else "another process", out)

    try:
        return acquire(out.parent / f".{out.name}.lock", wait=wait, on_wait=waiting)
    except LockBusy as exc:
        who = exc.holder.describe() if exc.holder else "another process"
        raise DataError(
            f"{out} is being prepared by another process ({who}); wait for it to finish, or choose another --out"
        ) from None


def _prepare(
    source: str,
    out: Path,
    tokenizer_name: str,
    val_fraction: float,
    shard_tokens: int,
    mode: str,
    workers: int | None,
    bpe_json: str | None,
    chat_settings: ChatSettings,
    answer_settings: AnswerSettings,
) -> DatasetMeta:
    """:func:`prepare_dataset` once ``out`` is held and known to be new."""
    tokenizer: Tokenizer | None = None
    if is_bpe(tokenizer_name):
        bpe_vocab_size(tokenizer_name)  # a bad name fails before any work
        if bpe_json:
            tokenizer = BPETokenizer.from_str(tokenizer_name, bpe_json)
    else:
        tokenizer = text_tokenizer(tokenizer_name)
    hf = is_hf_source(source)
    documents, local = _source_documents(source)
    total_bytes = sum(path.stat().st_size for path in local) if local else None  # unknown for a stream
    started = time.perf_counter()
    first = _first_document(documents, source, tokenizer, tokenizer_name, mode)
    answers = _answer_rows(first, mode)
    if answers is not None:
        request = _AnswersRequest(source, tokenizer_name, val_fraction, shard_tokens, workers, total_bytes)
        return _prepare_answers(request, out, tokenizer, documents, answers, answer_settings, started)
    chat = _source_chat(first, hf, tokenizer, tokenizer_name, mode, chat_settings)
    # An hf: source of text (a stream, maybe remote and long) is prepared resumably (bigbatch/data/resumable.py).
    resumable = hf and chat is None
    directory = resumable_directory(out, _resume_key(source, tokenizer_name, bpe_json)) if resumable else _staged(out)
    with directory as (staging, checkpoint):
        if tokenizer is None:
            if checkpoint and checkpoint.position.tokenizer_ready and (staging / BPE_FILE).is_file():
                tokenizer = BPETokenizer.from_str(tokenizer_name, (staging / BPE_FILE).read_text())
            else:
                tokenizer = _train_bpe(tokenizer_name, documents, source)
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.save(staging / BPE_FILE)
            if checkpoint:
                checkpoint.save(tokenizer_ready=True)
        dtype = token_dtype(tokenizer.vocab_size)
        n_workers = worker_count(workers, tokenizer, total_bytes)
        invalid = InvalidUTF8()
        checked = invalid if tokenizer.name != "byte" else None  # the byte tokenizer keeps any bytes as they are
        stream_path = staging / _STREAM_FILE
        mask_path = staging / _MASK_FILE if mode == "documents" and not resumable else None

        def encode(docs: Callable[[], Iterable[Document]]) -> Iterator[Encoded]:
            if chat is not None:
                return _encoded_conversations(docs, chat, dtype)
            return (
                (ids, None, p, size) for ids, p, size in encoded_documents(docs, tokenizer, dtype, n_workers, checked)
            )

        found = _tokenize(documents, encode, stream_path, mask_path, total_bytes, checked, checkpoint)
        if not found.lengths:
            what = "no conversation with an assistant token" if chat is not None else "no text"
            raise DataError(f"the corpus {source} holds {what}; give non-empty text files instead")
        masked = mode == "documents" and any(found.prompt_lengths)
        shard_names, token_counts = _write_shards(
            staging, stream_path, mask_path if masked else None, dtype, mode, found, val_fraction, shard_tokens
        )
        stream_path.unlink()
        if mask_path is not None:
            mask_path.unlink()
        (staging / LENGTHS_FILE).unlink(missing_ok=True)
        replaced = invalid.replacements if checked is not None else None
        meta = _dataset_meta(
            staging, source, tokenizer, dtype, mode, masked, shard_names, token_counts, found, replaced
        )
        if chat is not None:
            meta.extra["chat"] = _chat_record(chat, chat_settings)
        write_meta(staging, meta)
    _log_prepared(out, meta, found, tokenizer.name, mode, time.perf_counter() - started, n_workers)
    if invalid.replacements:
        log.warning("%s: %s", out, invalid.describe(tokenizer.name))
    return meta


def _first_document(
    documents: Callable[[], Iterable[Document]],
    source: str,
    tokenizer: Tokenizer | None,
    tokenizer_name: str,
    mode: str,
) -> Document | None:
    """The first non-empty document of ``source``, which tells conversations and rows of answers from text; None
    where it is not read: an ``hf:`` source (a stream, perhaps remote) prepared packed with a tokenizer without a
    chat template is read as text, in one pass (a row of answers in it is refused when it comes to be tokenized;
    ``auto`` told it apart before, see :mod:`~bigbatch.data.data_mode`)."""
    if is_hf_source(source) and mode != "documents" and not _could_render(tokenizer, tokenizer_name):
        return None
    return next((doc for doc in documents() if not doc.empty), None)


def _could_render(tokenizer: Tokenizer | None, tokenizer_name: str) -> bool:
    """Whether conversations could be rendered: a ``file:`` tokenizer whose directory has a chat template."""
    return isinstance(tokenizer, FileTokenizer) and has_chat_template(file_tokenizer_path(tokenizer_name).parent)


def _answer_rows(first: Document | None, mode: str) -> AnswerRow | None:
    """The first row when the source holds rows of answers (pairs or KTO), else None; they need documents mode."""
    if first is None or first.answers is None:
        return None
    if mode != "documents":
        raise ConfigError(
            f"{first.name} is a row of {first.answers.kind} (prompt and answers): each answer is prepared as a "
            "document of its own, the prompt masked; add --mode documents (train: --data-mode documents), or leave it "
            "at auto"
        )
    return first.answers


@dataclass(frozen=True)
class _AnswersRequest:
    source: str
    tokenizer_name: str
    val_fraction: float
    shard_tokens: int
    workers: int | None
    total_bytes: int | None


def _prepare_answers(
    request: _AnswersRequest,
    out: Path,
    tokenizer: Tokenizer | None,
    documents: Callable[[], Iterable[Document]],
    first: AnswerRow,
    settings: AnswerSettings,
    started: float,
) -> DatasetMeta:
    """:func:`_prepare` for rows of answers (:mod:`~bigbatch.data.answer_prepare`), in a staged directory."""
    with staged_directory(out) as staging:
        if tokenizer is None:
            tokenizer = _train_bpe(request.tokenizer_name, documents, request.source)
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.save(staging / BPE_FILE)
        dtype = token_dtype(tokenizer.vocab_size)
        chat = _answers_chat_encoder(first, tokenizer, request.tokenizer_name)
        n_workers = worker_count(request.workers, tokenizer, request.total_bytes) if chat is None else 1
        invalid = InvalidUTF8()
        checked = invalid if tokenizer.name != "byte" else None
        encoder = AnswerEncoder(settings, tokenizer, dtype, chat, n_workers, checked)
        if chat is not None:
            encoder.audit.template = template_fingerprint(chat.template.directory)
        prepared = prepare_answers(
            documents,
            encoder,
            staging,
            dtype,
            request.val_fraction,
            request.shard_tokens,
            request.source,
            request.total_bytes,
        )
        found = _Tokenized(prepared.lengths, prepared.masked, prepared.n_bytes, prepared.seconds)
        replaced = invalid.replacements if checked is not None else None
        meta = _dataset_meta(
            staging,
            request.source,
            tokenizer,
            dtype,
            "documents",
            True,
            prepared.shard_names,
            prepared.token_counts,
            found,
            replaced,
            roles=True,
        )
        meta.extra["answers"] = prepared.audit.kind
        meta.extra["answer_rows"] = prepared.audit.to_dict()
        write_meta(staging, meta)
    elapsed = time.perf_counter() - started
    _log_prepared(out, meta, found, tokenizer.name, "documents", elapsed, n_workers)
    if invalid.replacements:
        log.warning("%s: %s", out, invalid.describe(tokenizer.name))
    return meta


def _answers_chat_encoder(first: AnswerRow, tokenizer: Tokenizer, tokenizer_name: str) -> ChatEncoder | None:
    """The encoder of conversational rows of answers (the model's template renders them, last assistant turn
    trained), or None for text rows."""
    if not first.conversational:
        return None
    if not isinstance(tokenizer, FileTokenizer):
        raise ConfigError(
            f"{first.name} holds conversations, rendered with the model's own chat template: give the model's "
            f"tokenizer, --tokenizer file:DIR (the directory with tokenizer.json and its chat template), not "
            f"{tokenizer_name}"
        )
    settings = ChatSettings(loss_on="last-assistant", no_assistant="drop", long_conversations="refuse")
    return ChatEncoder(tokenizer.to_str(), file_tokenizer_path(tokenizer_name).parent, settings)


def _log_prepared(
    out: Path, meta: DatasetMeta, found: _Tokenized, tokenizer: str, mode: str, elapsed: float, n_workers: int
) -> None:
    n_bytes = found.n_bytes
    log.info(
        "prepared %s: %s, %.1f MB of text -> %s train + %s val tokens (%s, %s) in %.1fs (%.1f MB/s; "
        "tokenizing %.1f MB/s with %d %s)",
        out,
        plural(len(found.lengths), "document"),
        n_bytes / 1e6,
        f"{meta.tokens['train']:,}",
        f"{meta.tokens['val']:,}",
        tokenizer,
        mode,
        elapsed,
        n_bytes / 1e6 / max(elapsed, 1e-9),
        n_bytes / 1e6 / max(found.seconds, 1e-9),
        n_workers,
        "process" if n_workers == 1 else "processes",
    )


def _source_documents(source: str) -> tuple[Callable[[], Iterator[Document]], list[Path]]:
    """A fresh iterator over the source's documents on each call, and its local files (for sizes)."""
    hf = is_hf_source(source)
    files = [] if hf else text_files(resolve_source(source))

    def documents() -> Iterator[Document]:
        return hf_documents(source) if hf else read_documents(files)

    return documents, _hf_local_files(source) if hf else files


def _chat_record(chat: ChatEncoder, settings: ChatSettings) -> dict[str, object]:
    """What ``meta.json`` keeps of preparing conversations: the audit, the settings and the template's
    fingerprint."""
    return {
        **chat.audit.to_dict(),
        "loss_on": settings.loss_on,
        "no_assistant": settings.no_assistant,
        "long_conversations": settings.long_conversations,
        "max_tokens": settings.max_tokens,
        "template": template_fingerprint(chat.template.directory),
    }


def _source_chat(
    first: Document | None,
    hf: bool,
    tokenizer: Tokenizer | None,
    tokenizer_name: str,
    mode: str,
    settings: ChatSettings,
) -> ChatEncoder | None:
    """The encoder of a source of conversations, or None for text. Whether it is conversations is read from its
    ``first`` row: for an hf: source (a stream, perhaps remote) only where a chat template could render it."""
    if hf and not _could_render(tokenizer, tokenizer_name):
        return None
    return _chat_encoder(first, tokenizer, tokenizer_name, mode, settings)


@contextmanager
def _staged(out: Path) -> Iterator[tuple[Path, Checkpoint | None]]:
    with staged_directory(out) as staging:
        yield staging, None


def _hf_local_files(source: str) -> list[Path]:
    from bigbatch.data.hf_source import local_files, parse

    return local_files(parse(source))


def _resume_key(source: str, tokenizer_name: str, bpe_json: str | None) -> str:
    """What an interrupted prepare's partial directory must match to be resumed: the source (with its local
    files' sizes and times) and the tokenizer."""
    stats = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in _hf_local_files(source)]
    payload = json.dumps([source, tokenizer_name, bpe_json or "", stats])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _check_settings(val_fraction: float, shard_tokens: int, mode: str, workers: int | None) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be positive, got {shard_tokens}")
    if mode not in DATA_MODE:
        raise ConfigError(f"unknown data mode {mode!r}; choose one of: {', '.join(DATA_MODE.values)}")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers must be positive, got {workers}")


def _tokenize(
    documents: Callable[[], Iterable[Document]],
    encode: Callable[[Callable[[], Iterable[Document]]], Iterator[Encoded]],
    stream_path: Path,
    mask_path: Path | None,
    total_bytes: int | None,
    invalid: InvalidUTF8 | None,
    checkpoint: Checkpoint | None = None,
) -> _Tokenized:
    """Every document's tokens appended to the file ``stream_path`` (and its trained mask to ``mask_path``), with
    progress; their lengths kept. With a ``checkpoint`` the position is saved as it goes, and a saved one is
    resumed (the documents it holds are read past, not tokenized again; a resumable source has no mask file)."""
    found = _Tokenized()
    started = time.perf_counter()
    progress = CorpusProgress("tokenized", started, total_bytes=total_bytes)
    mode = "wb"
    if checkpoint is not None and checkpoint.position.documents:
        done = checkpoint.position
        found.lengths, found.prompt_lengths = restore_lengths(stream_path.parent, stream_path, done)
        found.n_bytes = done.n_bytes
        if invalid is not None:
            invalid.replacements, invalid.documents = done.utf8_replacements, done.utf8_documents
        documents, mode = skip_done(documents, done.documents), "ab"
    with ExitStack() as stack:
        stack.enter_context(progress)
        stream_file = stack.enter_context(open(stream_path, mode))
        mask_file = stack.enter_context(open(mask_path, mode)) if mask_path is not None else None
        lengths_file = stack.enter_context(open(stream_path.parent / LENGTHS_FILE, mode)) if checkpoint else None
        for ids, mask, masked_length, size in encode(documents):
            stream_file.write(ids.tobytes())
            if mask_file is not None:
                if mask is None:  # a prompt's tokens first
                    mask = np.ones(len(ids), dtype=np.uint8)
                    mask[:masked_length] = 0
                mask_file.write(mask.astype(np.uint8).tobytes())
            found.lengths.append(len(ids))
            found.prompt_lengths.append(masked_length)
            found.n_bytes += size
            progress.update(len(found.lengths), found.n_bytes)
            if checkpoint is not None and lengths_file is not None:
                write_lengths(lengths_file, len(ids), masked_length)
                if checkpoint.due():
                    checkpoint.sync(
                        stream_file,
                        lengths_file,
                        documents=len(found.lengths),
                        n_bytes=found.n_bytes,
                        utf8_replacements=invalid.replacements if invalid else 0,
                        utf8_documents=invalid.documents if invalid else 0,
                    )
    found.seconds = time.perf_counter() - started
    return found


def _chat_encoder(
    first: Document | None,
    tokenizer: Tokenizer | None,
    tokenizer_name: str,
    mode: str,
    settings: ChatSettings,
) -> ChatEncoder | None:
    """The encoder of a source of conversations (its ``first`` document tells), or None for text. Conversations
    need documents mode and the model's own tokenizer, beside which its chat template lives."""
    if first is None or first.conversation is None:
        return None
    if mode != "documents":
        raise ConfigError(
            f"{first.name} is a conversation: conversations are prepared one per document (packed into rows when "
            "training), with their assistant tokens masked in; add --mode documents (train: --data-mode documents)"
        )
    if not isinstance(tokenizer, FileTokenizer):
        raise ConfigError(
            f"{first.name} is a conversation, rendered with the model's own chat template: give the model's "
            f"tokenizer, --tokenizer file:DIR (the directory with tokenizer.json and its chat template), not "
            f"{tokenizer_name}"
        )
    return ChatEncoder(tokenizer.to_str(), file_tokenizer_path(tokenizer_name).parent, settings)


def _encoded_conversations(
    documents: Callable[[], Iterable[Document]], encoder: ChatEncoder, dtype: np.dtype
) -> Iterator[Encoded]:
    """Each conversation rendered, tokenized and masked, in order; a dropped one (no assistant token) is left out
    and counted in the encoder's audit."""
    for doc in documents():
        if doc.empty:
            continue
        if doc.conversation is None:
            what = f"a row of {doc.answers.kind}" if doc.answers is not None else "text"
            raise DataError(
                f"{doc.name} is {what} in a dataset of conversations; give every row as 'messages', or prepare the "
                "others apart"
            )
        encoded = encoder.encode(doc.conversation)
        if encoded is None:
            continue
        masked = int(len(encoded.mask) - encoded.mask.sum())
        yield encoded.ids.astype(dtype), encoded.mask, masked, doc.conversation.size()


def _write_shards(
    staging: Path,
    stream_path: Path,
    mask_path: Path | None,
    dtype: np.dtype,
    mode: str,
    found: _Tokenized,
    val_fraction: float,
    shard_tokens: int,
) -> tuple[ShardNames, TokenCounts]:
    """The token stream file split and written as the shards of ``mode``."""
    stream = np.memmap(stream_path, dtype=dtype, mode="r")
    try:
        if mode == "packed":
            return write_packed(staging, stream, packed_splits(found.lengths, val_fraction), shard_tokens)
        splits = document_splits(len(found.lengths), val_fraction)
        masks = np.memmap(mask_path, dtype=np.uint8, mode="r") if mask_path is not None else None
        try:
            return write_documents(staging, stream, found.lengths, masks, splits, shard_tokens)
        finally:
            del masks
    finally:
        del stream


def _dataset_meta(
    staging: Path,
    source: str,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    mode: str,
    masked: bool,
    shard_names: ShardNames,
    token_counts: TokenCounts,
    found: _Tokenized,
    utf8_replacements: int | None,
    roles: bool = False,
) -> DatasetMeta:
    """The ``meta.json`` of the shards written in ``staging``, with their fingerprints and what the notes of
    :func:`prepared_notes` need (``utf8_replacements``: ``None`` for the byte tokenizer, which replaces none)."""
    meta = DatasetMeta(
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        dtype=dtype.name,
        shards=shard_names,
        tokens=token_counts,
        source=source,
        documents=len(found.lengths),
        eot_token=tokenizer.eot_token,
        mode=mode,
        masked=masked,
        fingerprints={
            "tokenizer": tokenizer_fingerprint(tokenizer.name, staging),
            "data": prepared_data_fingerprint(staging, shard_names, mode, masked, roles),
        },
    )
    if utf8_replacements is not None:
        meta.extra["utf8_replacements"] = utf8_replacements
    meta.extra["split"] = {"rule": SPLIT_RULE, "seed": SPLIT_SEED}
    if mode == "documents":
        meta.extra["longest_document"] = max(found.lengths)
        # targets are positions 1.. of a document; a prompt masks the first prompt-length of them
        untrained = sum(1 for n, p in zip(found.lengths, found.prompt_lengths, strict=False) if n - max(p, 1) <= 0)
        meta.extra["documents_without_targets"] = untrained
    return meta


def prepared_notes(meta: DatasetMeta) -> list[str]:
    """What ``bigbatch prepare`` reports beside the token counts: invalid UTF-8 replaced by a text tokenizer, and
    in documents mode what the long-document policy drops (decided when training, where seq_len is known)."""
    notes = []
    replaced = int(meta.extra.get("utf8_replacements", 0) or 0)  # type: ignore[call-overload]
    if "utf8_replacements" in meta.extra:
        notes.append(f"{plural(replaced, 'invalid UTF-8 sequence')} replaced by U+FFFD ({meta.tokenizer} tokenizer)")
    chat = meta.extra.get("chat")
    if isinstance(chat, dict):
        notes.extend(audit_lines(chat, str(chat.get("loss_on", "assistant"))))
    answer_rows = meta.extra.get("answer_rows")
    if meta.answers and isinstance(answer_rows, dict):
        notes.extend(answer_audit_lines(answer_rows))
        if not answer_rows.get("max_tokens"):
            notes.append(
                f"{meta.answers}: every document must fit a row of seq_len+1 tokens when training (a KTO row's KL "
                "document is cut to fit); prepare with --seq-len to apply --long-conversations here"
            )
        return notes
    if meta.mode == "documents":
        untrained = int(meta.extra.get("documents_without_targets", 0) or 0)  # type: ignore[call-overload]
        if untrained:
            refused = "; training on them alone is refused" if untrained == meta.documents else ""
            notes.append(
                f"{untrained:,} of {plural(meta.documents, 'document')} {'has' if untrained == 1 else 'have'} no "
                "target to train on (a single token, or "
                f"wholly prompt: an empty completion){refused}"
            )
        longest = int(meta.extra.get("longest_document", 0) or 0)  # type: ignore[call-overload]
        notes.append(
            f"long documents: longest {longest:,} tokens; training splits those longer than seq_len+1 into seq_len "
            "windows (--long-documents split, the default: 0 tokens dropped); --long-documents truncate keeps only "
            "the first seq_len+1 tokens of each (the run header counts what that drops)"
        )
    return notes


def _train_bpe(name: str, documents: Callable[[], Iterable[Document]], source: str) -> Tokenizer:
    log.info("training the %s tokenizer on %s", name, source)
    started = time.perf_counter()
    progress = CorpusProgress(f"{name} training read", started)
    seen = {"documents": 0, "bytes": 0}

    def texts() -> Iterator[str]:
        for doc in documents():
            texts = doc.answers.texts() if doc.answers else []
            answers = [text.encode("utf-8", errors="surrogatepass") for text in texts]
            for part in (doc.prompt, doc.data, *answers):
                for piece in split_text(part) if part else ():
                    yield piece.decode("utf-8", errors="replace")
            seen["documents"] += 1
            seen["bytes"] += len(doc.data) + len(doc.prompt) + sum(len(a) for a in answers)
            progress.update(seen["documents"], seen["bytes"])

    tokenizer = train_bpe(name, texts())
    elapsed = time.perf_counter() - started
    log.info(
        "trained %s: vocabulary %d on %.1f MB of text in %.1fs (%.1f MB/s)",
        name,
        tokenizer.vocab_size,
        seen["bytes"] / 1e6,
        elapsed,
        seen["bytes"] / 1e6 / max(elapsed, 1e-9),
    )
    return tokenizer


def shown_conversations(
    source: str, tokenizer_name: str, settings: ChatSettings, n: int, answers: AnswerSettings | None = None
) -> Iterator[str]:
    """The first ``n`` conversations (or rows of answers, each document of the group) of ``source`` rendered and
    tokenized as :func:`prepare_dataset` does, the trained tokens marked (``bigbatch prepare --show N``); nothing
    for a source of text, or for rows of answers with a ``bpe:`` tokenizer (trained by prepare itself)."""
    from bigbatch.data.chat import shown_conversations as shown

    documents, _ = _source_documents(source)
    tokenizer = None if is_bpe(tokenizer_name) else text_tokenizer(tokenizer_name)
    first = next((doc for doc in documents() if not doc.empty), None)
    if first is not None and first.answers is not None:
        if tokenizer is None:
            return iter(())
        chat = _answers_chat_encoder(first.answers, tokenizer, tokenizer_name)
        dtype = token_dtype(tokenizer.vocab_size)
        rows = AnswerEncoder(answers or default_answer_settings(settings), tokenizer, dtype, chat)
        decode = chat.decode if chat is not None else tokenizer.decode

        def head() -> Iterator[Document]:
            return itertools.islice((doc for doc in documents() if not doc.empty), n)

        return shown_groups(rows, head, decode)
    encoder = _chat_encoder(first, tokenizer, tokenizer_name, "documents", settings)
    if encoder is None:
        return iter(())
    return shown(encoder, (doc.conversation for doc in documents() if doc.conversation is not None), n)
