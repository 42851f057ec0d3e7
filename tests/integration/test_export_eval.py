"""bigbatch export (Hugging Face GPT-2 layout, loaded by transformers offline) and bigbatch eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.artifacts.evaluate import EvalResult, evaluate_checkpoint
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.loop.validation_loss import ValidationResult


@pytest.fixture(autouse=True)
def _offline(isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export_eval")
    text = corpus_bytes(60_000)
    (path / "corpus.txt").write_bytes(text)
    return path


@pytest.fixture(scope="module")
def run_dir(workspace: Path) -> Path:
    out = workspace / "run"
    argv = [
        "train",
        "--data",
        str(workspace / "corpus.txt"),
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--total-batch-tokens",
        "256",
        "--eval-every",
        "2",
        "--eval-batches",
        "3",
        "--sample-tokens",
        "0",
        "--max-steps",
        "3",
        "--cache-dir",
        str(workspace / "cache"),
        "--out",
        str(out),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    return out


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


def test_export_loads_in_transformers_with_identical_logits(run_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    code, stdout, stderr = run_main(["export", str(run_dir), "--format", "hf", str(out)])
    assert code == 0, stderr
    assert "exported step 3" in stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"

    ours = ckpt.model_from_checkpoint(ckpt.load_checkpoint(run_dir)).eval()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True).eval()
    x = torch.randint(0, ours.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(x)[..., : ours.config.vocab_size]
        actual = theirs(x).logits
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_export_refuses_a_non_empty_directory(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, stdout, stderr = run_main(["export", str(run_dir), "--format", "hf", str(out)])
    assert "not empty" in assert_one_line_error(code, stdout, stderr)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_export_of_a_run_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, stdout, stderr = run_main(["export", str(tmp_path / "empty"), "--format", "hf", str(tmp_path / "hf")])
    assert "no complete checkpoints" in assert_one_line_error(code, stdout, stderr)
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------------------------
# eval
# --------------------------------------------------------------------------------------------


def last_val_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r["kind"] == "eval"][-1]


def test_eval_reproduces_the_runs_validation_loss(run_dir: Path, workspace: Path) -> None:
    """Raw text with the run's defaults (micro-batch, seq_len, eval_batches, tokenizer, val split) gives the
    loss the trainer logged after its last step."""
    code, stdout, stderr = run_main(
        [
            "eval",
            str(run_dir),
            "--data",
            str(workspace / "corpus.txt"),
            "--cache-dir",
            str(workspace / "cache"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0, stderr
    expected = last_val_loss(run_dir)
    match = stdout.split("| loss ")[1].split()
    assert float(match[0]) == pytest.approx(expected, abs=1e-4)
    assert f"perplexity {math.exp(expected):,.2f}" in stdout
    assert "3 micro-batches of 4 x 32 | 384 tokens" in stdout
    result = evaluate_checkpoint(run_dir, str(workspace / "corpus.txt"), cache_dir=workspace / "cache")
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-6)


def test_the_eval_line_words_one_micro_batch_in_the_singular() -> None:
    scored = ValidationResult(loss_sum=64.0, tokens=32, micro_batches=1)
    result = EvalResult(scored, "val", Path("data"), "byte", 3, 1, 32, whole_split=True)
    assert result.format() == (
        "eval step 3 | val split of data (byte) | 1 micro-batch (the whole split) of 1 x 32 | 32 tokens | "
        f"loss 2.0000 | perplexity {math.exp(2.0):,.2f}"
    )


def test_eval_is_a_token_weighted_mean_whatever_the_batching(run_dir: Path, workspace: Path) -> None:
    data, cache = str(workspace / "corpus.txt"), workspace / "cache"
    one = evaluate_checkpoint(run_dir, data, batches=8, micro_batch=1, seq_len=32, cache_dir=cache)
    eight = evaluate_checkpoint(run_dir, data, batches=1, micro_batch=8, seq_len=32, cache_dir=cache)
    assert one.tokens == eight.tokens == 256
    assert one.loss == pytest.approx(eight.loss, rel=1e-6)
    train = evaluate_checkpoint(run_dir, data, split="train", batches=2, cache_dir=cache)
    assert train.split == "train" and train.tokens == 256 and train.loss != one.loss


def test_eval_whole_split_from_a_prepared_directory(run_dir: Path, workspace: Path) -> None:
    prepared = ckpt.load_checkpoint(run_dir)["dataset"]
    code, stdout, stderr = run_main(["eval", str(run_dir), "--data", prepared, "--batches", "0", "--device", "cpu"])
    assert code == 0, stderr
    assert "(the whole split)" in stdout
    result = evaluate_checkpoint(run_dir, prepared, batches=0)
    assert result.whole_split and result.tokens > 3 * 4 * 32
    meta = json.loads((Path(prepared) / "meta.json").read_text())
    assert result.tokens <= meta["tokens"]["val"]


def test_eval_refuses_a_dataset_of_another_tokenizer(run_dir: Path, tmp_path: Path) -> None:
    document = ckpt.load_checkpoint(run_dir)
    document["tokenizer"] = "gpt2"  # pretend the model was trained on GPT-2 tokens
    other = tmp_path / "other_run"
    ckpt.save_checkpoint(
        {k: v for k, v in document.items() if k not in ("format", "version")}, ckpt.single_file_path(other, 3)
    )
    code, stdout, stderr = run_main(["eval", str(other), "--data", document["dataset"], "--device", "cpu"])
    line = assert_one_line_error(code, stdout, stderr)
    assert "byte tokenizer" in line and "gpt2" in line


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--seq-len", "128"], "exceeds the model's block size 64; lower --seq-len to at most 64"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--batches", "-1"], "--batches"),
    ],
    ids=["seq-len-above-block", "zero-micro-batch", "negative-batches"],
)
def test_eval_bad_arguments_are_one_line_errors(run_dir: Path, workspace: Path, extra: list[str], needle: str) -> None:
    prepared = ckpt.load_checkpoint(run_dir)["dataset"]
    code, stdout, stderr = run_main(["eval", str(run_dir), "--data", prepared, "--device", "cpu", *extra])
    assert needle in assert_one_line_error(code, stdout, stderr)


def test_eval_of_missing_data(run_dir: Path, tmp_path: Path) -> None:
    code, stdout, stderr = run_main(["eval", str(run_dir), "--data", str(tmp_path / "nope.txt"), "--device", "cpu"])
    assert "does not exist" in assert_one_line_error(code, stdout, stderr)


@pytest.mark.parametrize("model", ["pico", "llama-pico", "hf:gpt2"])
@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_every_exported_file_follows_the_umask(
    model: str, umask: int, file_mode: int, dir_mode: int, workspace: Path, tmp_path: Path
) -> None:
    """Each family's export (transformers' own save_pretrained for hf:, which writes model.safetensors 0600)."""
    import os
    import stat

    if model.startswith("hf:"):
        pytest.importorskip("transformers")
        from hf_models import save_hf

        save_hf("gpt2", tmp_path / "gpt2")
        model = f"hf:{tmp_path / 'gpt2'}"
    run = tmp_path / "run"
    argv = ["train", "--data", str(workspace / "corpus.txt"), "--model", model, "--seq-len", "32", "--micro-batch"]
    argv += ["2", "--total-batch-tokens", "64", "--max-steps", "1", "--eval-every", "0", "--sample-tokens", "0"]
    argv += ["--cache-dir", str(workspace / "cache"), "--out", str(run)]
    code, _, err = run_main(argv)
    assert code == 0, err
    old = os.umask(umask)
    try:
        code, _, err = run_main(["export", str(run), str(tmp_path / "hf")])
    finally:
        os.umask(old)
    assert code == 0, err
    written = [tmp_path / "hf", *(tmp_path / "hf").rglob("*")]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert modes == {p.name: dir_mode if p.is_dir() else file_mode for p in written}


@pytest.mark.parametrize("tokenizer", ["bpe:300", "byte", "file"])
def test_the_export_names_the_tokenizers_end_of_text(tokenizer: str, workspace: Path, tmp_path: Path) -> None:
    """config.json's bos/eos ids (what generate() stops at) are the run's tokenizer's end-of-text, not the last id
    (a word for a bpe: run); a tokenizer without one (byte) leaves them out."""
    transformers = pytest.importorskip("transformers")
    if tokenizer == "file":  # a tokenizer.json whose end-of-text is not its last id
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        made = Tokenizer(models.BPE())
        made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        made.train_from_iterator(
            [corpus_bytes(20_000).decode("utf-8", "replace")],
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
            ),
        )
        (tmp_path / "tok").mkdir()
        made.save(str(tmp_path / "tok" / "tokenizer.json"))
        tokenizer = f"file:{tmp_path / 'tok'}"
    run = tmp_path / "run"
    argv = ["train", "--data", str(workspace / "corpus.txt"), "--model", "pico", "--seq-len", "32", "--micro-batch"]
    argv += ["2", "--total-batch-tokens", "64", "--max-steps", "1", "--eval-every", "0", "--sample-tokens", "0"]
    argv += ["--tokenizer", tokenizer, "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]
    code, out, err = run_main(argv)
    assert code == 0, out + err
    code, out, err = run_main(["export", str(run), str(tmp_path / "hf")])
    assert code == 0, err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if tokenizer == "byte":
        assert "eos_token_id" not in config and "bos_token_id" not in config
        return
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    eot = reloaded.convert_tokens_to_ids("<|endoftext|>")
    assert config["eos_token_id"] == config["bos_token_id"] == eot != config["vocab_size"] - 1
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert model.generation_config.eos_token_id == eot  # what generate() stops at


def test_an_export_that_fails_leaves_nothing(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything is written into a hidden folder beside OUT, renamed into place at the end: a failure (here the
    reload check) leaves neither OUT nor the folder; a missing package is refused before anything is written."""
    import bigbatch.artifacts.export as export

    def broken(*args: object) -> object:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(export, "_reloaded_logits", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export.export_hf(run_dir, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []

    def missing(package: str, what: str, extra: str) -> object:
        raise export.BigBatchError(f"{what} needs the {package} package: pip install 'bigbatch[{extra}]'")

    monkeypatch.setattr(export, "require_package", missing)
    line = assert_one_line_error(*run_main(["export", str(run_dir), str(tmp_path / "hf")]))
    assert "needs the transformers package" in line and list(tmp_path.iterdir()) == []
