"""A model directory's own tokenizer: ``file:PATH`` of a Hugging Face ``tokenizer.json``, loaded offline.

Every tokenizer here is built inside the test (``tokenizers`` and ``transformers``, no download): a tiny byte-level
BPE, a GPT-2-like one written by ``save_pretrained``, and a Llama-3-like one (Llama 3's pre-tokenizer, a vocabulary
padded to 128,000 and 256 special tokens above it, so its ids need uint32 shards).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bigbatch.data.encode as encode_module
import bigbatch.data.text as text_module
from bigbatch.data.fingerprint import tokenizer_cache_key, tokenizer_fingerprint
from bigbatch.data.prepare import prepare_dataset
from bigbatch.data.shards import DatasetMeta, TokenDataset, check_requested_tokenizer
from bigbatch.data.tokenizer_files import (
    INFO_FILE,
    RUN_TOKENIZER_DIR,
    _bytes_to_unicode,
    checkpoint_tokenizer,
    save_run_tokenizer,
)
from bigbatch.data.tokenizers import (
    BPE_FILE,
    FileTokenizer,
    check_tokenizer_fits,
    file_tokenizer_name,
    get_tokenizer,
    model_dir_tokenizer,
    tokenizer_json_fingerprint,
    tokenizer_label,
)
from bigbatch.errors import ConfigError, DataError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.\n",
    "the cat sat in the hat, and the hat sat on the mat\n",
    "héllo wörld, naïve café — “quotes” and ‘apostrophes’\n",
    "日本語のテキスト、中文文本，한국어 텍스트\n",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷\n",
    "tabs\tand\r\nwindows line ends\n\n\n   indented\n \n",
    "don't won't it's we're I'll they've I'd 12345 3.14159\n",
]
TRICKY = [
    "",
    " ",
    "plain ASCII text with numbers 42 and punctuation!?\n",
    "a literal <|endoftext|> and <|end_of_text|> inside a document stay text\n",
    "controls \x00\x01\x1b[0m and nbsp\u00a0\u3000ideographic space\n",
    "".join(SENTENCES),
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_BASE_VOCAB = 128_000


def corpus(n: int = 40) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def byte_level_bpe(directory: Path) -> Path:
    """A tiny byte-level BPE (GPT-2 pre-tokenization) trained on a few sentences; a bare tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / BPE_FILE))
    return directory


def gpt2_like(directory: Path) -> Path:
    """GPT-2's layout from a small vocab.json + merges.txt, through transformers' GPT2TokenizerFast (named in a
    tokenizer_config.json: the class moved between transformers 4 and 5) and ``save_pretrained``
    (tokenizer.json + tokenizer_config.json naming <|endoftext|> as eos)."""
    from transformers import AutoTokenizer

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    source = directory.parent / f"{directory.name}-slow"
    source.mkdir(parents=True)
    (source / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (source / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))
    fast = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    assert type(fast).__name__ in ("GPT2TokenizerFast", "GPT2Tokenizer") and fast.is_fast
    fast.save_pretrained(str(directory))
    return directory


def llama3_like(directory: Path, eos: str | None = "<|end_of_text|>") -> Path:
    """Llama 3's pre-tokenizer (its split regex, then bytes) and decoder, BOS added by the post-processor, a
    vocabulary padded to 128,000 and 256 special tokens from 128,000 on; ``eos`` in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=_regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    document = json.loads(tokenizer.to_str())
    vocab = document["model"]["vocab"]
    for i in range(len(vocab), LLAMA3_BASE_VOCAB):  # unreachable fillers: the real one has 128,000 merged tokens
        vocab[f"<filler_{i}>"] = i
    document["model"]["ignore_merges"] = True
    padded = Tokenizer.from_str(json.dumps(document))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(256 - len(specials))]
    padded.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    padded.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", LLAMA3_BASE_VOCAB)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    padded.save(str(directory / BPE_FILE))
    config = {"bos_token": "<|begin_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if eos is not None:
        config["eos_token"] = eos
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def _regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)


def reference_tokenizer(directory: Path) -> Any:
    """transformers' own tokenizer of the directory, reading special-token text in a document as text (as bigbatch
    does for every tokenizer, like tiktoken's ``encode_ordinary``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(directory / BPE_FILE), split_special_tokens=True)


def own_encoding(directory: Path, text: str, reference: Any = None) -> list[int]:
    """The tokenizer's own ids for ``text`` as transformers gives them (no special tokens added)."""
    tokenizer = reference if reference is not None else reference_tokenizer(directory)
    return list(tokenizer.encode(text, add_special_tokens=False))


MAKERS: dict[str, Callable[[Path], Path]] = {"bpe": byte_level_bpe, "gpt2": gpt2_like, "llama3": llama3_like}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MAKERS[request.param](tmp_path_factory.mktemp(request.param) / "model")


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> FileTokenizer:
    """The module's tokenizer read once (the Llama 3 one has 128,256 entries: reading it per test costs seconds)."""
    return load(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return reference_tokenizer(model_dir)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama3_like(tmp_path_factory.mktemp("llama") / "model")


def load(directory: Path) -> FileTokenizer:
    name = model_dir_tokenizer(directory)
    assert name is not None
    tokenizer = get_tokenizer(name)
    assert isinstance(tokenizer, FileTokenizer)
    return tokenizer


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY)
def test_text_round_trips_and_matches_the_tokenizers_own_ids(
    model_dir: Path, loaded: FileTokenizer, reference: Any, text: str
) -> None:
    tokenizer = loaded
    ids = tokenizer.encode(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert ids == own_encoding(model_dir, text, reference)
    assert tokenizer.eot_token not in ids  # a literal end-of-text in a document is text, never the separator


def test_random_unicode_round_trips(loaded: FileTokenizer) -> None:
    tokenizer = loaded
    rng = random.Random(1)
    for _ in range(50):
        ranges = [(0x20, 0x7E), (0xA0, 0xD7FF), (0xE000, 0x10FFFF)]  # printable ASCII, then no surrogates
        text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40)))
        assert tokenizer.decode(tokenizer.encode(text.encode("utf-8"))) == text


def test_decoded_ids_encode_back_to_the_same_text(loaded: FileTokenizer) -> None:
    """Any ids (even ones that cut a character in two) decode to text that encodes and decodes to itself."""
    tokenizer = loaded
    rng = random.Random(2)
    ordinary = min(tokenizer.vocab_size, LLAMA3_BASE_VOCAB)
    for _ in range(30):
        text = tokenizer.decode([rng.randrange(ordinary) for _ in range(rng.randint(1, 20))])
        assert tokenizer.decode(tokenizer.encode(text.encode("utf-8"))) == text
    assert tokenizer.decode([-1, tokenizer.vocab_size, 10**9]) == ""  # ids outside the vocabulary are dropped


def test_invalid_utf8_is_replaced_as_by_the_other_text_tokenizers(loaded: FileTokenizer) -> None:
    tokenizer = loaded
    assert tokenizer.encode(b"ab\xffcd\xc3") == tokenizer.encode("ab\ufffdcd\ufffd".encode())


@pytest.mark.slow
def test_vocabulary_and_end_of_text_of_each_kind(tmp_path: Path, llama_dir: Path) -> None:
    bpe = load(byte_level_bpe(tmp_path / "bpe"))  # no tokenizer_config.json: the <|endoftext|> it has
    assert bpe.vocab_size == 400 and bpe.eot_text == "<|endoftext|>" and bpe.eot_token is not None
    gpt2 = load(gpt2_like(tmp_path / "gpt2"))  # tokenizer_config.json's eos_token
    assert gpt2.vocab_size == 256 + 8 + 1 and (gpt2.eot_text, gpt2.eot_token) == ("<|endoftext|>", 264)
    llama = load(llama_dir)
    assert llama.vocab_size == LLAMA3_BASE_VOCAB + 256
    assert (llama.eot_text, llama.eot_token) == ("<|end_of_text|>", LLAMA3_BASE_VOCAB + 1)
    instruct = load(llama3_like(tmp_path / "instruct", eos="<|eot_id|>"))
    assert instruct.eot_token == LLAMA3_BASE_VOCAB + 2
    bare = llama3_like(tmp_path / "bare", eos=None)
    (bare / "tokenizer_config.json").unlink()
    assert load(bare).eot_text == "<|end_of_text|>"  # no config: a known end-of-text token


def test_a_tokenizer_without_an_end_of_text_token_has_none(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.save(str(tmp_path / BPE_FILE))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|nope|>"}}))
    loaded = get_tokenizer(f"file:{tmp_path}")
    assert loaded.eot_token is None and loaded.vocab_size == 300


# --------------------------------------------------------------------------------------------
# Names, model directories, bad files
# --------------------------------------------------------------------------------------------


def test_model_dir_tokenizer_names_the_file_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "weights-only").mkdir()
    assert model_dir_tokenizer(tmp_path / "weights-only") is None
    assert model_dir_tokenizer(tmp_path / "not-there") is None
    byte_level_bpe(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert model_dir_tokenizer("m") == f"file:{tmp_path / 'm' / BPE_FILE}"
    (tmp_path / "link").symlink_to(tmp_path / "m")  # a Hugging Face cache snapshot: links kept, not resolved
    assert model_dir_tokenizer("link") == f"file:{tmp_path / 'link' / BPE_FILE}"
    assert get_tokenizer("file:m").name == get_tokenizer(f"file:m/{BPE_FILE}").name == model_dir_tokenizer("m")
    assert tokenizer_label(file_tokenizer_name(tmp_path / "my model" / BPE_FILE)) == "file-my_model"
    assert tokenizer_label("bpe:4096") == "bpe4096" and tokenizer_label("gpt2") == "gpt2"


def test_a_missing_or_damaged_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is missing") as info:
        get_tokenizer(f"file:{tmp_path / 'gone' / BPE_FILE}")
    assert "\n" not in str(info.value)
    (tmp_path / BPE_FILE).write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json") as info:
        get_tokenizer(f"file:{tmp_path}")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="file:PATH"):
        get_tokenizer("file:")


def test_check_tokenizer_fits_refuses_ids_past_the_models_vocabulary() -> None:
    check_tokenizer_fits(50_257, 50_257)
    check_tokenizer_fits(50_257, 50_304)  # a padded vocabulary: fine
    with pytest.raises(ConfigError) as info:
        check_tokenizer_fits(50_300, 50_257, "the tokenizer in /models/gpt2")
    message = str(info.value)
    assert message.startswith("the tokenizer in /models/gpt2 has 50,300 tokens but the model's vocabulary is 50,257")
    assert "\n" not in message and "--tokenizer auto" in message


# --------------------------------------------------------------------------------------------
# Fingerprints: the content, not the name
# --------------------------------------------------------------------------------------------


def test_the_fingerprint_is_the_files_content(tmp_path: Path) -> None:
    original = byte_level_bpe(tmp_path / "a")
    moved = tmp_path / "elsewhere" / "b"
    shutil.copytree(original, moved)
    name_a, name_b = f"file:{original}", f"file:{moved / BPE_FILE}"
    assert tokenizer_fingerprint(name_a) == tokenizer_fingerprint(name_b) != ""
    assert tokenizer_fingerprint(name_a) == tokenizer_json_fingerprint((original / BPE_FILE).read_text())
    assert tokenizer_cache_key(name_a) == tokenizer_cache_key(name_b)
    pretty = json.dumps(json.loads((moved / BPE_FILE).read_text()), indent=4)
    (moved / BPE_FILE).write_text(pretty)  # the same tokenizer, formatted otherwise
    assert tokenizer_fingerprint(name_b) == tokenizer_fingerprint(name_a)

    document = json.loads((moved / BPE_FILE).read_text())
    document["model"]["vocab"]["Ġextra"] = max(document["model"]["vocab"].values()) + 1
    (moved / BPE_FILE).write_text(json.dumps(document))  # another tokenizer under the same path
    assert tokenizer_fingerprint(name_b) != tokenizer_fingerprint(name_a)
    assert tokenizer_cache_key(name_b) != tokenizer_cache_key(name_a)
    with pytest.raises(DataError, match="is missing"):
        tokenizer_cache_key(f"file:{tmp_path / 'none.json'}")


# --------------------------------------------------------------------------------------------
# prepare --tokenizer file:PATH
# --------------------------------------------------------------------------------------------


def write_corpus(root: Path, texts: list[str]) -> Path:
    root.mkdir(parents=True)
    for i, text in enumerate(texts):
        (root / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize("maker", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])
def test_prepared_tokens_are_the_tokenizers_own_ids_joined_by_its_eot(maker: str, tmp_path: Path) -> None:
    model = MAKERS[maker](tmp_path / "model")
    texts = corpus(12) + [text for text in TRICKY[2:] if "\x00" not in text]  # a NUL byte: a binary file, skipped
    source = write_corpus(tmp_path / "corpus", texts)
    name = model_dir_tokenizer(model)
    assert name is not None
    meta = prepare_dataset(str(source), tmp_path / "ds", tokenizer_name=name, val_fraction=0.0)
    tokenizer = load(model)
    assert tokenizer.eot_token is not None
    expected = [t for text in texts for t in [*own_encoding(model, text), tokenizer.eot_token]]
    dataset = TokenDataset(tmp_path / "ds")
    assert np.concatenate(dataset.shard_arrays("train")).tolist() == expected
    assert meta.tokenizer == name and meta.vocab_size == tokenizer.vocab_size and meta.eot_token == tokenizer.eot_token
    assert meta.dtype == ("uint32" if maker == "llama3" else "uint16")
    assert meta.fingerprints["tokenizer"] == tokenizer_json_fingerprint((model / BPE_FILE).read_text())
    assert (tmp_path / "ds" / BPE_FILE).read_text() == (model / BPE_FILE).read_text()  # the dataset's own copy
    assert meta.extra["utf8_replacements"] == 0

    shutil.rmtree(model)  # the model directory moved away: the dataset still has its tokenizer
    again = get_tokenizer(meta.tokenizer, tmp_path / "ds")
    assert again.eot_token == tokenizer.eot_token and again.encode(texts[0].encode()) == tokenizer.encode(
        texts[0].encode()
    )
    assert tokenizer_fingerprint(meta.tokenizer, tmp_path / "ds") == meta.fingerprints["tokenizer"]


@pytest.mark.slow
def test_parallel_prepare_with_llama3_pieces_is_identical_to_serial(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers get the tokenizer as its text; documents cut into pieces (Llama 3's pre-tokenizer) change no id."""
    first = "".join(corpus(60))
    source = write_corpus(tmp_path / "corpus", [first, *corpus(10)])
    monkeypatch.setattr(text_module, "PIECE_BYTES", 300)
    monkeypatch.setattr(encode_module, "TASK_BYTES", 1_000)
    name = f"file:{llama_dir}"
    for out, workers in (("serial", 1), ("parallel", 2)):
        prepare_dataset(str(source), tmp_path / out, tokenizer_name=name, val_fraction=0.0, workers=workers)
    serial = np.concatenate(TokenDataset(tmp_path / "serial").shard_arrays("train"))
    parallel = np.concatenate(TokenDataset(tmp_path / "parallel").shard_arrays("train"))
    assert serial.tolist() == parallel.tolist()
    whole = own_encoding(llama_dir, first)  # the first document, encoded whole
    assert serial.tolist()[: len(whole) + 1] == [*whole, load(llama_dir).eot_token]


def test_invalid_utf8_in_the_corpus_is_counted(tmp_path: Path) -> None:
    model = byte_level_bpe(tmp_path / "model")
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(b"good text \xff\xfe and more \xc3\n")
    meta = prepare_dataset(str(root), tmp_path / "ds", tokenizer_name=f"file:{model}", val_fraction=0.0)
    assert meta.extra["utf8_replacements"] == 3  # \xff, \xfe and the cut-off \xc3


def test_a_requested_file_tokenizer_is_compared_by_content(tmp_path: Path) -> None:
    model = byte_level_bpe(tmp_path / "model")
    source = write_corpus(tmp_path / "corpus", corpus(3))
    prepare_dataset(str(source), tmp_path / "ds", tokenizer_name=f"file:{model}", val_fraction=0.0)
    meta = DatasetMeta.from_file(tmp_path / "ds" / "meta.json")
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    check_requested_tokenizer(meta, f"file:{moved}", tmp_path / "ds")  # the same file elsewhere
    check_requested_tokenizer(meta, "auto", tmp_path / "ds")
    other = byte_level_bpe(tmp_path / "other")
    document = json.loads((other / BPE_FILE).read_text())
    document["added_tokens"][0]["content"] = "<|other|>"
    (model / BPE_FILE).write_text(json.dumps(document))  # another tokenizer at the dataset's own path
    with pytest.raises(DataError, match="contradicts the data") as info:
        check_requested_tokenizer(meta, meta.tokenizer, tmp_path / "ds")
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="is missing"):
        check_requested_tokenizer(meta, f"file:{tmp_path / 'nowhere.json'}", tmp_path / "ds")
    with pytest.raises(DataError, match="holds file:"):
        check_requested_tokenizer(meta, "gpt2", tmp_path / "ds")


# --------------------------------------------------------------------------------------------
# The run's own copy
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_run_owns_a_copy_that_sample_and_export_use_after_the_model_moved(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    source = tmp_path / "model"
    shutil.copytree(model_dir, source)
    tokenizer = load(source)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = save_run_tokenizer(run_dir, tokenizer, model_max_length=64)
    assert target == run_dir / RUN_TOKENIZER_DIR
    assert (target / BPE_FILE).read_text() == (source / BPE_FILE).read_text()
    assert not (target / "merges.txt").exists()  # the slow GPT-2 files are not written for a model's own tokenizer
    info = json.loads((target / INFO_FILE).read_text())
    fingerprint = tokenizer_json_fingerprint((source / BPE_FILE).read_text())
    assert info == {"name": tokenizer.name, "fingerprint": fingerprint}
    assert save_run_tokenizer(run_dir, tokenizer, 64) == target  # unchanged: kept

    text = "".join(SENTENCES)
    fast = AutoTokenizer.from_pretrained(str(target), local_files_only=True)  # what export leaves beside a model
    assert fast.encode(text, add_special_tokens=False) == tokenizer.encode(text.encode())
    assert fast.eos_token == tokenizer.eot_text

    shutil.rmtree(source)  # the model directory moved away, and the dataset cache was cleared
    document = {"tokenizer": tokenizer.name, "fingerprints": {"tokenizer": fingerprint}, "dataset": str(tmp_path / "x")}
    found = checkpoint_tokenizer(document, run_dir / "checkpoints" / "step_1.pt")
    assert isinstance(found, FileTokenizer)
    assert found.encode(text.encode()) == tokenizer.encode(text.encode())
    assert (found.eot_token, found.vocab_size) == (tokenizer.eot_token, tokenizer.vocab_size)

    shutil.rmtree(target)  # only the checkpoint's own copy is left
    document["tokenizer_json"] = tokenizer.to_str()
    found = checkpoint_tokenizer(document, run_dir / "checkpoints" / "step_1.pt")
    assert found.encode(text.encode()) == tokenizer.encode(text.encode())
    del document["tokenizer_json"]
    with pytest.raises(Exception, match="was not found") as info:
        checkpoint_tokenizer(document, run_dir / "checkpoints" / "step_1.pt")
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("isolated")
def test_a_run_samples_and_exports_after_the_model_and_the_cache_are_gone(tmp_path: Path) -> None:
    from bigbatch.cli import main
    from bigbatch.run.configuration.train_config import TrainConfig
    from bigbatch.run.loop.trainer import Trainer

    model = gpt2_like(tmp_path / "model")
    (tmp_path / "c.txt").write_text("".join(corpus(200)), encoding="utf-8")
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(tmp_path / "c.txt")
    config.data.tokenizer = str(model_dir_tokenizer(model))
    config.data.cache_dir = str(tmp_path / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 128
    config.run.max_steps, config.run.eval_every, config.run.eval_batches, config.run.sample_tokens = 2, 2, 1, 0
    config.run.out = str(tmp_path / "run")
    assert Trainer(config).train().steps == 2
    shutil.rmtree(model)
    shutil.rmtree(tmp_path / "cache")
    assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "5"]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / BPE_FILE).is_file()
    exported_config = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    assert exported_config["eos_token"] == "<|endoftext|>"
