"""Hugging Face GPT-2 interoperability, offline: random models built from a GPT2Config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bigbatch.cli import main  # noqa: E402
from bigbatch.errors import CheckpointError  # noqa: E402
from bigbatch.models.gpt.hf import load_hf_gpt2, save_hf_gpt2  # noqa: E402
from bigbatch.verify import check_equivalence  # noqa: E402
from bigbatch.verify.command import token_batch  # noqa: E402

VOCAB = 99


def hf_model(vocab: int = VOCAB, dropout: float = 0.0, **extra: object) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=64,
        vocab_size=vocab,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        **extra,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture
def hf_dir(tmp_path: Path) -> tuple[transformers.GPT2LMHeadModel, Path]:
    model = hf_model()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def test_logits_match_transformers_from_safetensors(hf_dir: tuple) -> None:
    reference, directory = hf_dir
    assert (directory / "model.safetensors").is_file()
    ours = load_hf_gpt2(directory).eval()
    x = torch.randint(0, VOCAB, (3, 40))
    torch.testing.assert_close(logits_of(ours, x), logits_of(reference, x), rtol=0, atol=1e-5)


def test_logits_match_transformers_from_pytorch_model_bin(tmp_path: Path) -> None:
    reference = hf_model()
    directory = tmp_path / "bin"
    directory.mkdir()
    torch.save(reference.state_dict(), directory / "pytorch_model.bin")
    (directory / "config.json").write_text(reference.config.to_json_string())
    ours = load_hf_gpt2(directory).eval()
    x = torch.randint(0, VOCAB, (2, 64))
    torch.testing.assert_close(logits_of(ours, x), logits_of(reference, x), rtol=0, atol=1e-5)


def test_save_then_load_is_bit_exact(hf_dir: tuple, tmp_path: Path) -> None:
    _, directory = hf_dir
    ours = load_hf_gpt2(directory)
    load_back = load_hf_gpt2(save_hf_gpt2(ours, tmp_path / "export"))
    for (name, a), b in zip(ours.state_dict().items(), load_back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_export_loads_in_transformers_with_identical_logits(tmp_path: Path) -> None:
    from bigbatch.models import GPT, GPTConfig

    torch.manual_seed(1)
    ours = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=VOCAB)).eval()
    save_hf_gpt2(ours, tmp_path / "export")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    x = torch.randint(0, VOCAB, (2, 32))
    torch.testing.assert_close(logits_of(theirs, x), logits_of(ours, x), rtol=0, atol=1e-5)
    with pytest.raises(CheckpointError, match="not empty"):
        save_hf_gpt2(ours, tmp_path / "export")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"activation_function": "relu"}, "activation"),
        ({"n_inner": 100}, "n_inner"),
        ({"scale_attn_by_inverse_layer_idx": True}, "attention scaling"),
        ({"model_type": "llama"}, "not gpt2"),
    ],
)
def test_unsupported_variants_are_refused(hf_dir: tuple, change: dict, message: str) -> None:
    _, directory = hf_dir
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_hf_gpt2(directory)


def test_missing_or_damaged_files_are_clear_errors(hf_dir: tuple, tmp_path: Path) -> None:
    _, directory = hf_dir
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf_gpt2(tmp_path / "nowhere")
    (directory / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="damaged"):
        load_hf_gpt2(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds none of"):
        load_hf_gpt2(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_gpt2(directory)


def test_verifier_passes_on_a_hugging_face_gpt2_and_disables_its_dropout() -> None:
    model = hf_model(dropout=0.1).train()
    batch = token_batch(8, 24, VOCAB, ragged=True, generator=torch.Generator().manual_seed(0))
    report = check_equivalence(model, batch, k=4)
    assert report.equivalent, report.format()
    assert any(name.endswith("attn.attn_dropout") for name in report.dropout_disabled)
    assert report.mistakes[0].norm_ratio > 2


def test_train_init_from_a_hugging_face_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    reference = hf_model(vocab=256)  # the byte tokenizer's vocabulary
    reference.save_pretrained(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    argv = [
        "train",
        "--init-from",
        str(tmp_path / "hf"),
        "--data",
        str(corpus),
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--total-batch-tokens",
        "256",
        "--max-steps",
        "2",
        "--eval-every",
        "1",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--lr",
        "1e-4",
        "--warmup-steps",
        "0",
        "--shuffle",
        "off",  # step 1 reads the start of the stream
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"model {tmp_path / 'hf'}" in out
    first_loss = float(out.split("step 1 | loss ")[1].split(" ")[0])
    # The pretrained weights were used: step 1's loss is the reference model's loss on that step's
    # K = 2 micro-batches of 4 x 32, which are the first 256 tokens of the stream.
    data = corpus.read_bytes()[: 2 * 4 * 32 + 1]
    x = torch.tensor(list(data[:-1])).view(8, 32)
    y = torch.tensor(list(data[1:])).view(8, 32)
    expected = torch.nn.functional.cross_entropy(logits_of(reference, x).reshape(-1, 256), y.reshape(-1))
    assert first_loss == pytest.approx(expected.item(), abs=1e-3)


def test_train_init_from_with_a_mismatched_vocabulary_is_a_one_line_error(
    hf_dir: tuple, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, directory = hf_dir
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc " * 2000)
    code = main(
        [
            "train",
            "--init-from",
            str(directory),
            "--data",
            str(corpus),
            "--seq-len",
            "32",
            "--micro-batch",
            "4",
            "--total-batch-tokens",
            "256",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "vocabulary 99" in err and "256" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
