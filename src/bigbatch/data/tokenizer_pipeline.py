"""The pipeline a model directory's ``tokenizer.json`` really encodes with, and how a piece that continues a text
is encoded.

**transformers' pipeline.** ``AutoTokenizer.from_pretrained(DIR)`` does not always encode with ``tokenizer.json``
as it is: transformers 5 picks a class from ``tokenizer_config.json`` (``tokenizer_class``) and ``config.json``
(``model_type``), and a class with its own ``__init__`` (``LlamaTokenizer``, ``GemmaTokenizer``, ``T5Tokenizer``,
``GPT2Tokenizer``, ``Qwen2Tokenizer``, ... 54 of them) takes only the vocabulary, the merges and the
post-processor from the file and builds its own normalizer, pre-tokenizer and decoder (``LlamaTokenizer``:
Metaspace, ``split`` false, prepend ``first``, or ``always`` with ``legacy`` true). Encoded with the raw file, a
Llama-2-style tokenizer puts a ``▁`` after every special token. :func:`transformers_pipeline` gives the
``tokenizer.json`` text that encodes as ``AutoTokenizer`` does: the file's own text when transformers keeps its
pipeline (so its fingerprint, and the cache keys and checkpoints made with it, stay as they were), else the
pipeline of ``AutoTokenizer(...).backend_tokenizer``, which gives ``AutoTokenizer``'s ids and offsets. Where
that cannot be known or reproduced it refuses in one line: transformers missing for a directory whose class it
rebuilds, a directory transformers cannot load, a Python-only tokenizer, or one whose ids differ from its own
pipeline's.

**Continuations.** A SentencePiece-style pipeline (a Metaspace pre-tokenizer, or a Prepend normalizer) adds a
``▁`` at the start of the text it encodes; a document's later pieces and a completion after its prompt are not
the start of the text. :func:`continuation_tokenizer` is the same pipeline without that prefix.
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError, DataError, install_hint

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MODEL_CONFIG = "config.json"
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` names that load ``tokenizer.json`` as it is; any other names a class that transformers may
rebuild the pipeline of."""
ENCODING_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder", "added_tokens")
"""What of a ``tokenizer.json`` decides the ids without added special tokens, and the text they decode to (the
post-processor only adds special tokens; truncation and padding transformers turns off per call)."""
PROBES = (
    "Hello world",
    " leading space",
    "two  spaces and\nlines\n\n  indented",
    "naïve café 日本語 中文 😀",
    "x",
)
"""Texts that :func:`transformers_pipeline` encodes both ways to check it (with the special tokens around them)."""


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _named_class(directory: Path) -> str | None:
    """The specialized tokenizer class a directory names (``tokenizer_config.json``, else ``config.json``), or
    ``None`` (none, or a generic one)."""
    for name in (TOKENIZER_CONFIG, MODEL_CONFIG):
        value = (_json_object(directory / name) or {}).get("tokenizer_class")
        if isinstance(value, str) and value:
            return None if value in GENERIC_CLASSES else value
    return None


def _rebuilt_class(directory: Path, text: str) -> str | None:
    """The class whose pipeline transformers builds instead of the file's, as far as it can be told without
    transformers: a specialized ``tokenizer_class``, except ``LlamaTokenizer`` over a byte-level file (which
    transformers loads as it is)."""
    named = _named_class(directory)
    if named is not None and named.removesuffix("Fast") == "LlamaTokenizer" and '"ByteLevel"' in text:
        return None
    return named


def _consulted(path: Path) -> bool:
    """Whether transformers chooses how the ``tokenizer.json`` at ``path`` encodes: a ``tokenizer_config.json``
    beside it that names a specialized class, or a ``config.json`` (whose ``model_type`` can choose one). A bare
    file, a dataset's copy and the run's copy are used as they are."""
    if path.name != TOKENIZER_JSON:
        return False  # AutoTokenizer of the directory would read another file
    return _named_class(path.parent) is not None or (path.parent / MODEL_CONFIG).is_file()


def _stamp(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)


def transformers_pipeline(path: Path, text: str) -> str:
    """The ``tokenizer.json`` text that encodes as ``AutoTokenizer.from_pretrained(path.parent)`` does, where
    ``text`` is the file at ``path`` (see the module's docstring); ``text`` itself when transformers keeps it."""
    path = Path(path)
    if not _consulted(path):
        return text
    directory = path.parent
    stamps = tuple(_stamp(directory / name) for name in (TOKENIZER_CONFIG, MODEL_CONFIG))
    return _pipeline(os.path.abspath(directory), stamps, text)


@lru_cache(maxsize=8)
def _pipeline(directory_name: str, stamps: tuple[tuple[int, int], ...], text: str) -> str:
    """:func:`transformers_pipeline`, once per directory, settings and file text in a process."""
    del stamps  # a part of the cache key only
    from tokenizers import Tokenizer

    directory = Path(directory_name)
    try:
        file_parts = _encoding_parts(Tokenizer.from_str(text))
    except Exception:  # a damaged or foreign file: FileTokenizer.from_str names it
        return text
    try:
        import transformers  # noqa: F401  (the hf extra)
    except ImportError:
        rebuilt = _rebuilt_class(directory, text)
        if rebuilt is None:
            return text
        raise ConfigError(
            f"{directory} names the tokenizer class {rebuilt}, whose pipeline transformers builds its own way from "
            "the vocabulary (not tokenizer.json's as it is), so without transformers bigbatch cannot encode as the "
            f"model's AutoTokenizer does: {install_hint('hf')}"
        ) from None
    auto = _auto_tokenizer(directory)
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise DataError(
            f"transformers encodes {directory} with {type(auto).__name__}, a Python tokenizer without a tokenizers "
            f"pipeline, so bigbatch cannot give its ids; {_ESCAPE}"
        )
    result = text if file_parts == _encoding_parts(backend) else _without_limits(backend.to_str())
    _check_probes(auto, result, directory)
    if result is not text:
        log.info(
            "%s: encoding with the pipeline transformers builds for %s, not tokenizer.json's as it is",
            directory,
            type(auto).__name__,
        )
    return result


_ESCAPE = (
    "give another tokenizer, or copy its tokenizer.json alone into a directory of its own to encode with that file "
    "as it is"
)


def _auto_tokenizer(directory: Path) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, offline and quiet; a :class:`DataError` when it fails."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError, ...)
        detail = (str(exc).splitlines() or [""])[0][:160]
        raise DataError(
            f"transformers cannot load the tokenizer of {directory} ({type(exc).__name__}: {detail}), so bigbatch "
            f"cannot check that it encodes as the model's AutoTokenizer does; fix the directory, or {_ESCAPE}"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)


def _encoding_parts(tokenizer: Any) -> str:
    """The canonical JSON of what of a ``tokenizers.Tokenizer`` decides its ids and decoded text (both sides
    written by the tokenizers library, so that defaults it fills in compare equal)."""
    document = json.loads(tokenizer.to_str())
    model = document.get("model")
    if isinstance(model, dict):  # an empty affix is no affix (transformers' classes write "", files often null)
        for key in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key) == "":
                model[key] = None
    return json.dumps({key: document.get(key) for key in ENCODING_PARTS}, sort_keys=True, ensure_ascii=False)


def _without_limits(text: str) -> str:
    """``text`` without truncation or padding (transformers turns both off for a call that asks for neither)."""
    document = json.loads(text)
    document["truncation"] = None
    document["padding"] = None
    return json.dumps(document, ensure_ascii=False)


def _check_probes(auto: Any, text: str, directory: Path) -> None:
    """Refuse (one line) when ``AutoTokenizer`` encodes one of :data:`PROBES` (between special tokens, which are
    read as tokens and as text) otherwise than the pipeline ``text`` does."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(text)
    ours.no_truncation()
    ours.no_padding()
    specials = [str(t) for t in getattr(auto, "all_special_tokens", [])][:4]
    probes = [*PROBES, "".join(specials) + " x " + " y ".join(specials)] if specials else list(PROBES)
    for split in (True, False):
        ours.encode_special_tokens = split
        for probe in probes:
            try:
                want = list(auto(probe, add_special_tokens=False, split_special_tokens=split)["input_ids"])
            except Exception as exc:  # a class whose call takes other arguments: its ids cannot be checked
                raise DataError(
                    f"transformers' {type(auto).__name__} for {directory} does not encode the text {probe!r} "
                    f"({type(exc).__name__}), so bigbatch cannot check that it gives its ids; {_ESCAPE}"
                ) from exc
            got = list(ours.encode(probe, add_special_tokens=False).ids)
            if got != want:
                raise DataError(
                    f"transformers' {type(auto).__name__} for {directory} encodes {probe!r} as {want} but its "
                    f"tokenizers pipeline as {got}, so bigbatch cannot give the same ids; {_ESCAPE}"
                )


# ---------------------------------------------------------------------------------------- continuations


def _no_prefix(part: Any) -> tuple[Any, bool]:
    """A normalizer or pre-tokenizer (as JSON) that adds no ``▁`` at the start of the text, and whether it did."""
    if not isinstance(part, dict):
        return part, False
    kind = part.get("type")
    if kind == "Prepend":
        return None, True
    if kind == "Metaspace" and (part.get("prepend_scheme", "always") != "never" or part.get("add_prefix_space")):
        changed = {**part, "prepend_scheme": "never"}
        if "add_prefix_space" in changed:  # an older serialization of the same setting
            changed["add_prefix_space"] = False
        return changed, True
    for key in ("normalizers", "pretokenizers"):
        if isinstance(part.get(key), list):
            parts = [_no_prefix(p) for p in part[key]]
            if any(found for _, found in parts):
                return {**part, key: [p for p, _ in parts if p is not None]}, True
    return part, False


def continuation_tokenizer(tokenizer: Any) -> Any | None:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) without the ``▁`` its pipeline adds at the start of a text, for
    what continues one (a document's later pieces, a completion after its prompt); ``None`` when it adds none."""
    from tokenizers import Tokenizer

    parts = {}
    for key in ("normalizer", "pre_tokenizer"):
        component = getattr(tokenizer, key, None)
        state = json.loads(component.__getstate__()) if component is not None else None
        parts[key] = _no_prefix(state)
    if not any(found for _, found in parts.values()):
        return None
    document = json.loads(tokenizer.to_str())
    for key, (part, _) in parts.items():
        document[key] = part
    continuation = Tokenizer.from_str(json.dumps(document, ensure_ascii=False))
    continuation.encode_special_tokens = tokenizer.encode_special_tokens
    continuation.no_truncation()
    continuation.no_padding()
    return continuation
