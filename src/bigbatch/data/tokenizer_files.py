"""The tokenizer a run owns: Hugging Face tokenizer files in the run directory and in exports.

The tokenizer of a prepared dataset lives beside its shards, in a cache that may move or be cleared. A run
keeps its own copy in ``RUN_DIR/tokenizer/`` (written when training starts), a ``bpe:VOCAB`` (or ``file:PATH``)
checkpoint also carries its ``tokenizer.json`` inside, and ``bigbatch export`` writes the same files next to the
model:

* ``tokenizer.json`` (Hugging Face ``tokenizers``), ``tokenizer_config.json``, ``special_tokens_map.json``:
  ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads them;
* for ``gpt2`` and ``bpe:VOCAB`` also ``vocab.json`` + ``merges.txt`` (the slow ``GPT2Tokenizer`` files; not for
  ``file:PATH``, whose pre-tokenizer may not be GPT-2's);
* ``bigbatch_tokenizer.json``: bigbatch's name for the tokenizer and its fingerprint.

``byte`` is written as a byte-level BPE without merges (token id = byte value), ``gpt2`` is converted from
tiktoken's encoding (its merges recovered from the ranks), ``file:PATH`` is the ``tokenizer.json`` it encodes with
(the file as it was read, so every copy has the original's fingerprint, or the pipeline transformers builds for its
tokenizer class: ``data/tokenizer_pipeline.py``) with its end-of-text token as ``eos_token`` and the model
directory's ``add_bos_token``/``add_eos_token``, under the class ``PreTrainedTokenizerFast``, which transformers
loads as it is: ``AutoTokenizer`` of a copy or an export encodes the ids the run trained on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from bigbatch.data.fingerprint import tokenizer_fingerprint
from bigbatch.data.tokenizer_pipeline import transformers_pipeline
from bigbatch.data.tokenizers import (
    BPE_FILE,
    EOT_TEXT,
    BPETokenizer,
    FileTokenizer,
    Tokenizer,
    carries_tokenizer_json,
    file_tokenizer_path,
    get_tokenizer,
    is_bpe,
    is_file_tokenizer,
    read_eos_token,
    tokenizer_json_fingerprint,
)
from bigbatch.errors import BigBatchError, CheckpointError, DataError
from bigbatch.files.atomic import apply_umask

log = logging.getLogger(__name__)

RUN_TOKENIZER_DIR = "tokenizer"
INFO_FILE = "bigbatch_tokenizer.json"
TOKENIZER_FILES = (BPE_FILE, "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", INFO_FILE)


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=False))


def _unicode(token: bytes) -> str:
    table = _bytes_to_unicode()
    return "".join(table[b] for b in token)


def _recover_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts that BPE merged into ``token``: apply the merges of lower rank to its bytes."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise BigBatchError(f"cannot recover the BPE merge of token {token!r} from its rank")
    return parts[0], parts[1]


def _byte_level_json(vocab: dict[str, int], merges: list[tuple[str, str]], special: dict[str, int]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=bool(merges))
    tokenizer.decoder = decoders.ByteLevel()
    if special:
        tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special])
    return str(tokenizer.to_str())


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The Hugging Face ``tokenizer.json`` of one of bigbatch's tokenizers (same ids for the same text)."""
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.to_str()
    if tokenizer.name == "byte":
        table = _bytes_to_unicode()
        return _byte_level_json({table[b]: b for b in range(256)}, [], {})
    if tokenizer.name == "gpt2":
        encoding = tokenizer._encoding  # type: ignore[attr-defined]
        ranks: dict[bytes, int] = dict(encoding._mergeable_ranks)
        vocab = {_unicode(token): rank for token, rank in ranks.items()}
        merges = []
        for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
            if len(token) > 1:
                a, b = _recover_merge(ranks, token)
                merges.append((_unicode(a), _unicode(b)))
        special = dict(encoding._special_tokens)
        return _byte_level_json(vocab, merges, special)
    raise BigBatchError(f"no Hugging Face tokenizer files for the {tokenizer.name} tokenizer")


def write_tokenizer_files(directory: Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """Write the tokenizer files into ``directory`` (which exists)."""
    text = hf_tokenizer_json(tokenizer)
    document = json.loads(text)
    own = isinstance(tokenizer, FileTokenizer)  # a model's own: its file as it is, and its end-of-text token
    if isinstance(tokenizer, FileTokenizer):
        special = {"eos_token": tokenizer.eot_text} if tokenizer.eot_text else {}
        special = {**_model_tokens(tokenizer.name), **special}
    else:
        eot = EOT_TEXT if tokenizer.eot_token is not None else None
        special = {"bos_token": eot, "eos_token": eot, "unk_token": eot} if eot else {}
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2TokenizerFast" if tokenizer.name == "gpt2" else "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        **({} if own else {"add_prefix_space": False}),  # a setting transformers would apply to its pre-tokenizer
        "clean_up_tokenization_spaces": False,
        **special,
        **(_special_settings(tokenizer.name) if own else {}),
        **_chat_template(tokenizer.name),
    }
    files = {
        BPE_FILE: text,
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
        INFO_FILE: json.dumps({"name": tokenizer.name, "fingerprint": _fingerprint(tokenizer.name, text)}) + "\n",
    }
    model = document.get("model", {})
    if tokenizer.name != "byte" and not own and model.get("type") == "BPE":
        vocab = dict(model.get("vocab", {}))
        for added in document.get("added_tokens", []):
            vocab.setdefault(added["content"], added["id"])
        merges = [" ".join(m) if isinstance(m, list) else str(m) for m in model.get("merges", [])]
        files["vocab.json"] = json.dumps(vocab, ensure_ascii=False) + "\n"
        files["merges.txt"] = "#version: 0.2\n" + "".join(m + "\n" for m in merges)
    for name, content in files.items():
        (directory / name).write_text(content, encoding="utf-8")


def _source_config(name: str) -> dict[str, Any]:
    """The ``tokenizer_config.json`` beside a ``file:PATH`` tokenizer's file while it is there, else nothing."""
    if not is_file_tokenizer(name):
        return {}
    try:
        config = json.loads((file_tokenizer_path(name).parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_tokens(name: str) -> dict[str, Any]:
    """The model directory's beginning and padding tokens (its chat template may write them)."""
    config = _source_config(name)
    return {key: config[key] for key in ("bos_token", "pad_token") if isinstance(config.get(key), (str, dict))}


def _special_settings(name: str) -> dict[str, Any]:
    """The model directory's ``add_bos_token``/``add_eos_token``: what its ``AutoTokenizer`` adds to a text with
    ``add_special_tokens`` (transformers rebuilds the post-processor from them), so that a copy adds the same."""
    config = _source_config(name)
    return {key: config[key] for key in ("add_bos_token", "add_eos_token") if isinstance(config.get(key), bool)}


def _chat_template(name: str) -> dict[str, Any]:
    """The model directory's chat template, so that the run's copy and every export render conversations as the
    training data was rendered (``chat_template.jinja`` or ``tokenizer_config.json``'s)."""
    if not is_file_tokenizer(name):
        return {}
    jinja = file_tokenizer_path(name).parent / "chat_template.jinja"
    if jinja.is_file():
        try:
            return {"chat_template": jinja.read_text(encoding="utf-8")}
        except UnicodeDecodeError as exc:  # a template is text: one line, not a traceback
            raise DataError(
                f"{jinja} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at byte {exc.start + 1}); re-encode "
                "the file as UTF-8"
            ) from None
    template = _source_config(name).get("chat_template")
    return {"chat_template": template} if template else {}


def _fingerprint(name: str, text: str) -> str:
    return tokenizer_json_fingerprint(text) if carries_tokenizer_json(name) else tokenizer_fingerprint(name)


def _fingerprint_of(tokenizer: Tokenizer) -> str:
    return (
        _fingerprint(tokenizer.name, tokenizer.to_str())
        if isinstance(tokenizer, BPETokenizer)
        else (tokenizer_fingerprint(tokenizer.name))
    )


def copy_tokenizer_files(source: Path, directory: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)


def save_run_tokenizer(run_dir: Path, tokenizer: Tokenizer, model_max_length: int) -> Path:
    """``RUN_DIR/tokenizer/``, written once (atomically: a staging directory renamed into place); a copy of
    another tokenizer (a run started over with other data) is replaced."""
    target = run_dir / RUN_TOKENIZER_DIR
    try:
        if json.loads((target / INFO_FILE).read_text()).get("fingerprint") == _fingerprint_of(tokenizer):
            return target
    except (OSError, ValueError, AttributeError):
        pass  # missing or unreadable: (re)write it
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer.tmp-", dir=run_dir))
    try:
        apply_umask(staging, directory=True)
        write_tokenizer_files(staging, tokenizer, model_max_length)
        if target.exists():
            shutil.rmtree(target)  # an incomplete copy, or another tokenizer's: replace it
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory of ``checkpoints/step_N.pt`` (or a run directory itself), if it looks like one."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        return checkpoint
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


def checkpoint_tokenizer(document: dict[str, Any], location: Path) -> Tokenizer:
    """The tokenizer a checkpoint's model was trained with: from its run directory, from the checkpoint itself
    (``bpe:VOCAB``), or from the dataset directory it was trained on, in that order; a ``file:PATH`` one from its
    run directory, its dataset, PATH, then the checkpoint. A ``tokenizer.json`` is checked against the
    checkpoint's tokenizer fingerprint."""
    name = str(document.get("tokenizer", "byte"))
    if not carries_tokenizer_json(name):
        return get_tokenizer(name)
    expected = str((document.get("fingerprints") or {}).get("tokenizer") or "")
    run_dir = run_dir_of(location)
    embedded = document.get("tokenizer_json")
    dataset = document.get("dataset")
    # where, its tokenizer.json (read when its turn comes), the eos_token beside it
    candidates: list[tuple[str, Callable[[], str | None], str | None]] = []

    def read(path: Path, original: bool) -> str | None:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a damaged copy: the other places are tried, as for a fingerprint mismatch
            log.warning("the tokenizer in %s is not valid UTF-8 (a damaged file); skipped", path)
            return None
        if not original:
            return text
        try:  # the model's own file: what it encodes with now (the pipeline transformers builds, where it does)
            return transformers_pipeline(path, text)
        except BigBatchError as exc:  # e.g. no transformers: the checkpoint's own copy may still do
            log.warning("the tokenizer in %s was skipped: %s", path, exc)
            return None

    def add(path: Path, original: bool = False) -> None:
        if path.is_file():
            candidates.append((str(path), partial(read, path, original), read_eos_token(path.parent)))

    def embedded_text() -> str:
        return str(embedded)

    if run_dir is not None:
        add(run_dir / RUN_TOKENIZER_DIR / BPE_FILE)
    if embedded and is_bpe(name):
        candidates.append(("the checkpoint", embedded_text, None))
    if dataset:
        add(Path(dataset) / BPE_FILE)
    if is_file_tokenizer(name):
        add(file_tokenizer_path(name), original=True)
        if embedded:  # last: no tokenizer_config.json travels with it, so its end-of-text token is guessed
            candidates.append(("the checkpoint", embedded_text, None))
    for where, reader, eos in candidates:
        text = reader()
        if text is None:
            continue
        if expected and tokenizer_json_fingerprint(text) != expected:
            log.warning("the tokenizer in %s is not the one the model was trained with (fingerprint); skipped", where)
            continue
        if is_file_tokenizer(name):
            return FileTokenizer.from_str(name, text, eos, where=where)
        return BPETokenizer.from_str(name, text)
    original = f", not at {file_tokenizer_path(name)}" if is_file_tokenizer(name) else ""
    raise CheckpointError(
        f"the {name} tokenizer of this model was not found: not in the run directory ({RUN_TOKENIZER_DIR}/), "
        f"not in the checkpoint{original}, and not in its dataset {dataset or '(unknown)'}; restore one of them"
    )


def export_tokenizer(document: dict[str, Any], location: Path, out: Path, model_max_length: int) -> str:
    """Put the model's tokenizer files beside an export in ``out``; returns a note for the summary line.

    The run directory's copy is used when there is one; otherwise the files are written from the tokenizer
    (for ``gpt2`` that needs tiktoken's encoding: when it cannot be loaded the export goes on without the
    tokenizer and says so).
    """
    run_dir = run_dir_of(location)
    source = run_dir / RUN_TOKENIZER_DIR if run_dir is not None else None
    if source is not None and (source / INFO_FILE).is_file():
        info = json.loads((source / INFO_FILE).read_text())
        expected = str((document.get("fingerprints") or {}).get("tokenizer") or "")
        if not expected or info.get("fingerprint") == expected:
            copy_tokenizer_files(source, out)
            _check_exported(out)
            return " + tokenizer files"
    try:
        write_tokenizer_files(out, checkpoint_tokenizer(document, location), model_max_length)
    except BigBatchError as exc:
        log.warning("the export has no tokenizer files: %s", exc)
        return ", without tokenizer files"
    _check_exported(out)
    return " + tokenizer files"


def _check_exported(out: Path) -> None:
    """Warn when ``AutoTokenizer.from_pretrained(out)`` would not encode with the ``tokenizer.json`` written there
    (transformers picks a class from the export's ``config.json`` too, and some classes build their own pipeline)."""
    path = out / BPE_FILE
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    try:
        same = transformers_pipeline(path, text) == text
    except BigBatchError as exc:
        log.warning("the export's tokenizer was not checked against transformers: %s", exc)
        return
    if not same:
        log.warning(
            "transformers' AutoTokenizer of %s builds another pipeline than its tokenizer.json, so it may encode "
            "otherwise than the model was trained; load the tokenizer with "
            "PreTrainedTokenizerFast(tokenizer_file=%s)",
            out,
            path,
        )
