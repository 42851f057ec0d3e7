"""A model directory whose tokenizer transformers builds its own way (Llama-2-style ``LlamaTokenizer``): bigbatch
encodes, copies and decodes it as ``AutoTokenizer.from_pretrained(DIR)`` does, and keeps a file that
transformers loads as it is (byte-level) byte for byte, with its fingerprint.

Every directory is built here, offline (``support/sentencepiece_layout.py``: a BPE with byte fallback, Llama 2's
two front-end layouts, ``legacy`` true or false).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_models import conversations
from sentencepiece_layout import CORPUS, llama2_like

import bigbatch.data.text as text_module
import bigbatch.data.tokenizer_pipeline as pipeline_module
from bigbatch.data.corpus import Document
from bigbatch.data.encode import encoded_documents
from bigbatch.data.fingerprint import tokenizer_cache_key, tokenizer_fingerprint
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import TokenDataset
from bigbatch.data.tokenizer_files import RUN_TOKENIZER_DIR, checkpoint_tokenizer, save_run_tokenizer
from bigbatch.data.tokenizers import (
    BPE_FILE,
    BPETokenizer,
    FileTokenizer,
    continuation_decoder,
    get_tokenizer,
    tokenizer_json_fingerprint,
)
from bigbatch.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "<s>[INST] hi [/INST] ok</s>",
    "hello</s><s>world <unk> x",
    "The quick brown fox",
    " a leading space",
    "  two leading spaces and   runs    of spaces",
    "def add(a, b):\n    return a + b\n\n\nprint(1)",
    "\nstarts with a newline",
    "日本語のテキスト 中文 한국어 😀",  # most of it unseen: byte fallback
    "naïve café",
]
VARIANTS = [("normalizer", True), ("normalizer", False), ("metaspace", True), ("metaspace", False)]


def auto_tokenizer(directory: Path) -> Any:
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def auto_ids(auto: Any, text: str, split: bool = True) -> list[int]:
    """AutoTokenizer's ids, no special tokens added; ``split``: special-token text read as text (as bigbatch reads
    a document), else as the special tokens (as a chat template's text)."""
    return list(auto(text, add_special_tokens=False, split_special_tokens=split)["input_ids"])


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{layout}-legacy_{legacy}" for layout, legacy in VARIANTS])
def llama2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    layout, legacy = request.param
    directory = llama2_like(tmp_path_factory.mktemp(f"{layout}-{legacy}") / "model", layout=layout, legacy=legacy)
    return directory, auto_tokenizer(directory)


def load(directory: Path) -> FileTokenizer:
    tokenizer = get_tokenizer(f"file:{directory}")
    assert isinstance(tokenizer, FileTokenizer)
    return tokenizer


# --------------------------------------------------------------------------------------------
# Encoding as AutoTokenizer does
# --------------------------------------------------------------------------------------------


def test_the_raw_file_encodes_otherwise_but_bigbatch_as_autotokenizer(llama2: tuple[Path, Any]) -> None:
    from tokenizers import Tokenizer

    directory, auto = llama2
    raw = Tokenizer.from_file(str(directory / BPE_FILE))
    raw.encode_special_tokens = True
    tokenizer = load(directory)
    assert any(raw.encode(text, add_special_tokens=False).ids != auto_ids(auto, text) for text in TEXTS)  # the bug
    for text in TEXTS:
        ids = tokenizer.encode(text.encode())
        assert ids == auto_ids(auto, text), text
        assert tokenizer.decode(ids) == auto.decode(ids, skip_special_tokens=False)  # decodes as transformers
    assert tokenizer.eot_text == "</s>" and tokenizer.eot_token == 2
    assert tokenizer_fingerprint(tokenizer.name) == tokenizer_json_fingerprint(tokenizer.to_str())
    assert tokenizer_fingerprint(tokenizer.name) != tokenizer_json_fingerprint((directory / BPE_FILE).read_text())


def test_conversations_encode_as_apply_chat_template(llama2: tuple[Path, Any]) -> None:
    """Chat data is encoded with the run's tokenizer.json (special-token text as the special tokens):
    ``Tokenizer.from_str(FileTokenizer.to_str())`` gives ``apply_chat_template(tokenize=True)``'s ids."""
    from tokenizers import Tokenizer

    directory, auto = llama2
    run_pipeline = Tokenizer.from_str(load(directory).to_str())
    run_pipeline.encode_special_tokens = False
    raw = Tokenizer.from_file(str(directory / BPE_FILE))
    raw_differs = 0
    for row in conversations():
        rendered = auto.apply_chat_template(row["messages"], tokenize=False)
        want = auto.apply_chat_template(row["messages"], tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert run_pipeline.encode(rendered, add_special_tokens=False).ids == want
        assert auto_ids(auto, rendered, split=False) == want
        raw_differs += raw.encode(rendered, add_special_tokens=False).ids != want
    assert raw_differs > 0


def test_pieces_and_completions_continue_the_text(llama2: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A long document cut into pieces, and a completion after its prompt, get no ``▁`` of their own: the ids are
    AutoTokenizer's of the whole text (the prompt's length its own ids'), in this process and in a worker's copy."""
    directory, auto = llama2
    tokenizer = load(directory)
    monkeypatch.setattr(text_module, "PIECE_BYTES", 40)
    long_text = "\n".join(CORPUS * 3) + "\n"
    pairs = [("Q: what is 2+2?\nA:", " 4"), ("x", "y"), ("[INST] hi [/INST]", " ok</s>"), ("hello", "  world")]
    docs = [Document("long", long_text.encode())] + [
        Document(f"pair {i}", completion.encode(), prompt.encode()) for i, (prompt, completion) in enumerate(pairs)
    ]
    assert len(text_module.split_text(long_text.encode())) > 5
    found = list(encoded_documents(lambda: docs, tokenizer, np.dtype(np.uint32), 1))
    assert len(found) == len(docs)
    for doc, (ids, prompt_length, _) in zip(docs, found, strict=True):
        whole = (doc.prompt + doc.data).decode()
        assert ids.tolist() == [*auto_ids(auto, whole), tokenizer.eot_token], doc.name
        assert prompt_length == len(auto_ids(auto, doc.prompt.decode())) if doc.prompt else prompt_length == 0
    worker = BPETokenizer.from_str(tokenizer.name, tokenizer.to_str())  # what a prepare worker encodes with
    assert worker.encode_continuation(b"y") == tokenizer.encode_continuation(b"y") != tokenizer.encode(b"y")


def test_prepared_tokens_and_the_datasets_copy(tmp_path: Path) -> None:
    directory = llama2_like(tmp_path / "model")
    auto = auto_tokenizer(directory)
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.txt").write_text(TEXTS[0] + "\n" + TEXTS[5], encoding="utf-8")
    (source / "b.txt").write_text(TEXTS[7], encoding="utf-8")
    name = f"file:{directory}"
    meta = prepare_dataset(str(source), tmp_path / "ds", tokenizer_name=name, val_fraction=0.0)
    tokenizer = load(directory)
    texts = [TEXTS[0] + "\n" + TEXTS[5], TEXTS[7]]
    expected = [t for text in texts for t in [*auto_ids(auto, text), tokenizer.eot_token]]
    assert np.concatenate(TokenDataset(tmp_path / "ds").shard_arrays("train")).tolist() == expected
    assert (tmp_path / "ds" / BPE_FILE).read_text() == tokenizer.to_str()  # the pipeline it was encoded with
    assert meta.fingerprints["tokenizer"] == tokenizer_fingerprint(name) == tokenizer_fingerprint(name, tmp_path / "ds")


# --------------------------------------------------------------------------------------------
# Files transformers keeps as they are: the same text, the same fingerprint
# --------------------------------------------------------------------------------------------


def byte_level_dir(directory: Path, tokenizer_class: str, model_type: str | None) -> Path:
    """A small byte-level BPE (Llama 3 / GPT-2 style), its tokenizer_config.json naming ``tokenizer_class`` (and,
    for GPT-2, its end-of-text token as bos, eos and unk, as GPT-2's does), and a ``config.json`` of
    ``model_type`` (transformers reads both to choose a class)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(TEXTS * 3, trainer=trainer)
    eos = "<|endoftext|>" if model_type == "gpt2" else "<|end_of_text|>"
    tokenizer.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
    directory.mkdir(parents=True)
    (directory / BPE_FILE).write_text(json.dumps(json.loads(tokenizer.to_str()), indent=1), encoding="utf-8")
    config = {"tokenizer_class": tokenizer_class, "eos_token": eos}
    if model_type == "gpt2":
        config.update(bos_token=eos, unk_token=eos)
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    return directory


@pytest.mark.parametrize(
    ("tokenizer_class", "model_type"),
    [("PreTrainedTokenizerFast", "llama"), ("GPT2TokenizerFast", "gpt2"), ("LlamaTokenizerFast", "llama")],
)
def test_a_byte_level_file_keeps_its_text_and_fingerprint(
    tmp_path: Path, tokenizer_class: str, model_type: str
) -> None:
    directory = byte_level_dir(tmp_path / "model", tokenizer_class, model_type)
    text = (directory / BPE_FILE).read_text()
    tokenizer = load(directory)
    assert tokenizer.to_str() == text  # as it was read, formatting and all
    assert tokenizer_fingerprint(tokenizer.name) == tokenizer_json_fingerprint(text)
    assert tokenizer_cache_key(tokenizer.name) == f"file:{tokenizer_json_fingerprint(text)}"
    auto = auto_tokenizer(directory)
    for sample in TEXTS:
        assert tokenizer.encode(sample.encode()) == auto_ids(auto, sample)


# --------------------------------------------------------------------------------------------
# The run's copy, checkpoints, exports, sampling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma"])
def test_the_run_copy_and_an_export_encode_as_the_model_directory(tmp_path: Path, model_type: str) -> None:
    directory = llama2_like(tmp_path / "model", layout="normalizer", legacy=False)
    original = auto_tokenizer(directory)
    tokenizer = load(directory)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    copy = save_run_tokenizer(run_dir, tokenizer, model_max_length=64)
    assert (copy / BPE_FILE).read_text() == tokenizer.to_str()
    export = tmp_path / "export"
    shutil.copytree(copy, export)  # what bigbatch export puts beside the model's config.json
    (export / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    for where in (copy, export):
        reloaded = auto_tokenizer(where)
        for text in TEXTS:
            assert auto_ids(reloaded, text) == auto_ids(original, text), (where.name, text)
            assert reloaded(text)["input_ids"] == original(text)["input_ids"]  # BOS added alike
        assert reloaded.eos_token == "</s>"

    shutil.rmtree(directory)  # the model directory moved away: the run's copy decodes as training encoded
    fingerprint = tokenizer_json_fingerprint(tokenizer.to_str())
    document = {"tokenizer": tokenizer.name, "fingerprints": {"tokenizer": fingerprint}, "dataset": str(tmp_path)}
    found = checkpoint_tokenizer(document, run_dir / "checkpoints" / "step_1.pt")
    assert isinstance(found, FileTokenizer) and found.to_str() == tokenizer.to_str()
    for text in TEXTS:
        assert found.encode(text.encode()) == tokenizer.encode(text.encode())
    shutil.rmtree(run_dir / RUN_TOKENIZER_DIR)
    document["tokenizer_json"] = tokenizer.to_str()  # only the checkpoint's own copy left
    last = checkpoint_tokenizer(document, run_dir / "checkpoints" / "step_1.pt")
    assert isinstance(last, FileTokenizer) and last.to_str() == tokenizer.to_str()


def test_a_checkpoint_of_the_raw_file_is_not_decoded_with_the_rebuilt_pipeline(tmp_path: Path) -> None:
    """A run made before (with the file as it is) keeps decoding with what it trained with: the model directory's
    pipeline now has another fingerprint, so it is skipped."""
    directory = llama2_like(tmp_path / "model")
    raw = (directory / BPE_FILE).read_text()
    document = {
        "tokenizer": f"file:{directory / BPE_FILE}",
        "fingerprints": {"tokenizer": tokenizer_json_fingerprint(raw)},
        "tokenizer_json": raw,
    }
    found = checkpoint_tokenizer(document, tmp_path / "nowhere" / "step_1.pt")
    assert isinstance(found, FileTokenizer) and found.to_str() == raw


def test_sampling_keeps_the_space_that_starts_a_continuation(tmp_path: Path) -> None:
    tokenizer = load(llama2_like(tmp_path / "model"))
    prompt = tokenizer.encode(b"The quick")
    whole = tokenizer.encode(b"The quick brown fox")
    generated = whole[len(prompt) :]
    assert whole[: len(prompt)] == prompt
    assert tokenizer.decode(generated) == "brown fox"  # a SentencePiece decoder strips the first space
    assert continuation_decoder(tokenizer, prompt)(generated) == " brown fox"


# --------------------------------------------------------------------------------------------
# Refusals: one line
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    pipeline_module._pipeline.cache_clear()
    yield
    pipeline_module._pipeline.cache_clear()


@pytest.mark.usefixtures("no_transformers")
def test_without_transformers_a_rebuilt_class_is_refused_and_byte_level_files_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        get_tokenizer(f"file:{llama2_like(tmp_path / 'llama2')}")
    message = str(info.value)
    assert "\n" not in message and "LlamaTokenizer" in message and "pip install" in message and "[hf]" in message
    for name, tokenizer_class, model_type in [
        ("generic", "PreTrainedTokenizerFast", "llama"),
        ("llama3", "LlamaTokenizerFast", None),  # LlamaTokenizer over a byte-level file: transformers keeps it
    ]:
        directory = byte_level_dir(tmp_path / name, tokenizer_class, model_type)
        text = (directory / BPE_FILE).read_text()
        assert load(directory).to_str() == text
        assert tokenizer_fingerprint(f"file:{directory}") == tokenizer_json_fingerprint(text)
    raw = (tmp_path / "llama2" / BPE_FILE).read_text()
    document = {
        "tokenizer": f"file:{tmp_path / 'llama2' / BPE_FILE}",
        "fingerprints": {"tokenizer": tokenizer_json_fingerprint(raw)},
        "tokenizer_json": raw,
    }
    found = checkpoint_tokenizer(document, tmp_path / "nowhere" / "step_1.pt")  # the model's dir skipped, saying why
    assert isinstance(found, FileTokenizer) and found.to_str() == raw
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(tmp_path / "llama2" / BPE_FILE, bare / BPE_FILE)  # no tokenizer_config.json: the file as it is
    assert load(bare).to_str() == (bare / BPE_FILE).read_text()


def test_a_directory_transformers_cannot_load_is_refused(tmp_path: Path) -> None:
    directory = llama2_like(tmp_path / "model", tokenizer_class="BertJapaneseTokenizer")  # needs its vocab.txt
    with pytest.raises(DataError, match="transformers cannot load the tokenizer of") as info:
        get_tokenizer(f"file:{directory}")
    assert "\n" not in str(info.value)


class _Fake:
    """An AutoTokenizer stand-in: a tokenizers pipeline (or none), and ids that differ from it."""

    def __init__(self, backend: Any) -> None:
        if backend is not None:
            self.backend_tokenizer = backend
        self.all_special_tokens = ["<s>"]

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [0]}


@pytest.mark.parametrize("backend", [True, False], ids=["ids-differ", "python-only"])
def test_a_tokenizer_whose_ids_cannot_be_reproduced_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: bool
) -> None:
    from tokenizers import Tokenizer

    directory = llama2_like(tmp_path / "model")
    fake = _Fake(Tokenizer.from_file(str(directory / BPE_FILE)) if backend else None)
    monkeypatch.setattr(pipeline_module, "_auto_tokenizer", lambda _: fake)
    pipeline_module._pipeline.cache_clear()
    with pytest.raises(DataError, match="cannot give" + (" the same ids" if backend else " its ids")) as info:
        get_tokenizer(f"file:{directory}")
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.usefixtures("isolated")
def test_a_run_trains_samples_and_exports_with_the_pipeline_transformers_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from bigbatch.cli import main
    from bigbatch.run.configuration.train_config import TrainConfig
    from bigbatch.run.loop.trainer import Trainer

    model = llama2_like(tmp_path / "model", layout="normalizer", legacy=False)
    original = auto_tokenizer(model)
    tokenizer = load(model)
    (tmp_path / "c.txt").write_text("\n".join(CORPUS * 40) + "\n", encoding="utf-8")
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(tmp_path / "c.txt")
    config.data.tokenizer = f"file:{model}"
    config.data.cache_dir = str(tmp_path / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128
    config.run.max_steps, config.run.eval_every, config.run.eval_batches, config.run.sample_tokens = 2, 2, 1, 0
    config.run.out = str(tmp_path / "run")
    assert Trainer(config).train().steps == 2
    assert (tmp_path / "run" / RUN_TOKENIZER_DIR / BPE_FILE).read_text() == tokenizer.to_str()
    shutil.rmtree(model)  # sample and export read the run's own copy
    capsys.readouterr()
    argv = ["sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "The quick", "--max-new-tokens", "6"]
    assert main([*argv, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "export")]) == 0
    assert "builds another pipeline" not in caplog.text
    exported = auto_tokenizer(tmp_path / "export")
    for text in TEXTS:
        assert auto_ids(exported, text) == auto_ids(original, text) == tokenizer.encode(text.encode())
        assert exported(text)["input_ids"] == original(text)["input_ids"]
