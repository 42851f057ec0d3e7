"""Resume that keeps its promise: the same command continues the same run, other settings are refused by name,
the schedule is part of the run, a finished run succeeds again, the data and tokenizer are fingerprinted, and a
run owns its tokenizer (run directory, exports) and writes files with the user's umask."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, corpus_bytes, run_main

from bigbatch.engine.optim import CosineSchedule
from bigbatch.errors import ConfigError
from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.identity import MAY_CHANGE, default_run_dir, identity_settings
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

STEPS = 6


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)  # a default runs/ directory lands here
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(corpus_bytes(60_000))
    return path


def make_config(corpus: Path, out: Path | None, **run: object) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.data.data = str(corpus)
    config.data.cache_dir = str(corpus.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 256  # K = 4
    config.optim.warmup_steps = 2
    config.run.max_steps = STEPS
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    config.run.out = str(out) if out else ""
    for key, value in run.items():
        setattr(config.run, key, value)
    return config


def records(run_dir: Path, kind: str = "step") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


class Crash(RuntimeError):
    pass


def crash_in_step(trainer: Trainer, step: int) -> None:
    inner = trainer.engine.loss_fn

    def failing(model: torch.nn.Module, batch: object) -> torch.Tensor:
        if model.training and trainer.engine.step_count + 1 == step:
            raise Crash(f"injected crash in step {step}")
        return inner(model, batch)

    trainer.engine.loss_fn = failing


def cli(corpus: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--total-batch-tokens",
        "256",
        "--warmup-steps",
        "2",
        "--max-steps",
        str(STEPS),
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(corpus.parent / "cache"),
        *extra,
    ]


# --------------------------------------------------------------------------------------------
# The same command resumes
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_same_command_without_out_continues_the_run(corpus: Path, tmp_path: Path) -> None:
    """Stopped by SIGTERM after step 3, the identical command (no --out) continues at step 4 in the same run
    directory; run once more, it says the run is complete and exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(fault: str | None = None) -> subprocess.CompletedProcess:
        env.pop("BIGBATCH_FAULT", None)
        if fault:
            env["BIGBATCH_FAULT"] = fault
        return subprocess.run(
            [sys.executable, "-m", "bigbatch", *cli(corpus)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = run("sigterm:step=3")
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    assert "stopped by SIGTERM after step 3" in first.stdout and "run the same command to resume" in first.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("pico-")

    again = run()
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from runs/{run_dir.name}/checkpoints/step_0000003 at step 3" in again.stdout
    assert "step 4 | loss" in again.stdout and "step 1 | loss" not in again.stdout
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))

    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"is complete: it reached step {STEPS} (max_steps {STEPS})" in done.stdout
    assert "| loss" not in done.stdout  # no step trained


def test_the_default_run_directory_follows_the_defining_settings_only(corpus: Path) -> None:
    base = make_config(corpus, None)
    same = make_config(corpus, None, max_steps=100, eval_every=5, device="cpu", log_every=3)
    same.batch.micro_batch = 4
    assert default_run_dir(base) == default_run_dir(same)
    other = make_config(corpus, None)
    other.optim.lr = 1e-3
    assert default_run_dir(other) != default_run_dir(base)
    moved = make_config(corpus.parent / "elsewhere.txt", None)
    assert default_run_dir(moved) != default_run_dir(base)  # another command, another run
    assert set(identity_settings(base)).isdisjoint(MAY_CHANGE)


def test_other_settings_in_an_existing_run_are_refused_by_name(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2)).train()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, stdout, stderr = run_main(
        [*cli(corpus, "--lr", "1e-3", "--seed", "7", "--dropout", "0.1"), "--out", str(out)]
    )
    line = assert_one_line_error(code, stdout, stderr)
    assert "optim.lr 0.002 -> 0.001" in line and "run.seed 1337 -> 7" in line and "model.dropout 0.0 -> 0.1" in line
    assert "batch.micro_batch" not in line
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written
    # Settings that may change on resume do not count.
    config = make_config(corpus, out, max_steps=3, log_every=2, keep_checkpoints=5, device="cpu")
    config.batch.micro_batch = 4
    trainer = Trainer(config)
    assert trainer.resumed_from is not None and trainer.engine.step_count == 2


def test_a_fresh_start_after_a_crash_before_the_first_checkpoint_starts_the_metrics_clean(
    corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    trainer = Trainer(make_config(corpus, out))  # no checkpoint before the last step
    crash_in_step(trainer, 3)
    with pytest.raises(Crash):
        trainer.train()
    assert [r["step"] for r in records(out)] == [1, 2]
    assert not ckpt.list_checkpoints(out)
    Trainer(make_config(corpus, out)).train()
    assert [r["step"] for r in records(out)] == list(range(1, STEPS + 1))


# --------------------------------------------------------------------------------------------
# The schedule is part of the run
# --------------------------------------------------------------------------------------------


def test_resuming_with_more_steps_keeps_the_schedule_unless_asked(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    golden = tmp_path / "golden"
    Trainer(make_config(corpus, golden)).train()
    golden_lr = [r["lr"] for r in records(golden)]
    saved = CosineSchedule(2e-3, 2e-4, 2, STEPS)
    assert golden_lr == pytest.approx([saved(s) for s in range(STEPS)], rel=1e-12)

    def stopped_at_3(name: str) -> Path:
        out = tmp_path / name
        trainer = Trainer(make_config(corpus, out, save_every=1))
        crash_in_step(trainer, 4)
        with pytest.raises(Crash):
            trainer.train()
        return out

    kept = stopped_at_3("kept")
    Trainer(make_config(corpus, kept, max_steps=10)).train()
    lrs = [r["lr"] for r in records(kept)]
    assert lrs[:STEPS] == golden_lr  # the resume step and after: exactly the uninterrupted run's
    assert lrs[STEPS:] == [pytest.approx(2e-4)] * 4  # after the saved decay: the minimum, not a new cosine
    assert "the schedule is kept" in caplog.text and "--extend-schedule" in caplog.text

    with pytest.raises(ConfigError, match=r"optim.decay_steps 0 -> 20 .*--extend-schedule"):
        config = make_config(corpus, kept, max_steps=20)
        config.optim.decay_steps = 20
        Trainer(config)

    extended = stopped_at_3("extended")
    caplog.clear()
    Trainer(make_config(corpus, extended, max_steps=10, extend_schedule=True)).train()
    lrs = [r["lr"] for r in records(extended)]
    stretched = CosineSchedule(2e-3, 2e-4, 2, 10)
    assert lrs[:3] == golden_lr[:3]
    assert lrs[3:] == pytest.approx([stretched(s) for s in range(3, 10)], rel=1e-12)
    assert "cosine decay now ends at step 10 (was 6)" in caplog.text
    assert ckpt.load_checkpoint(extended)["schedule"]["decay_steps"] == 10  # and stays so on the next resume


# --------------------------------------------------------------------------------------------
# Fingerprints: tokenizer and data
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_bpe_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two datasets with a bpe:300 tokenizer each, trained on different text."""
    from bigbatch.data.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("bpe")
    text = corpus_bytes(120_000)
    (root / "a.txt").write_bytes(text[:60_000])
    (root / "b.txt").write_bytes(text[60_000:].upper())
    prepare_dataset(str(root / "a.txt"), root / "ds_a", tokenizer_name="bpe:300")
    prepare_dataset(str(root / "b.txt"), root / "ds_b", tokenizer_name="bpe:300")
    return root / "ds_a", root / "ds_b"


def bpe_run(dataset: Path, out: Path, cache: Path) -> list[str]:
    return [
        "train",
        "--data",
        str(dataset),
        "--model",
        "pico",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--total-batch-tokens",
        "128",
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
    ]


def test_a_same_named_tokenizer_trained_on_other_text_is_refused_on_resume_and_eval(
    two_bpe_datasets: tuple[Path, Path], tmp_path: Path
) -> None:
    ds_a, ds_b = two_bpe_datasets
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (ds_a, ds_b))
    assert meta_a["vocab_size"] == meta_b["vocab_size"] == 300
    assert meta_a["fingerprints"]["tokenizer"] != meta_b["fingerprints"]["tokenizer"]
    out = tmp_path / "run"
    code, stdout, stderr = run_main(bpe_run(ds_a, out, tmp_path / "cache"))
    assert code == 0, stdout + stderr
    code, stdout, stderr = run_main([*bpe_run(ds_b, out, tmp_path / "cache"), "--max-steps", "4"])
    line = assert_one_line_error(code, stdout, stderr)
    assert "bpe:300 tokenizer other than the model's" in line
    code, stdout, stderr = run_main(["eval", str(out), "--data", str(ds_b)])
    line = assert_one_line_error(code, stdout, stderr)
    assert "bpe:300 tokenizer other than the model's" in line
    code, stdout, stderr = run_main(["eval", str(out), "--data", str(ds_a)])
    assert code == 0 and "loss" in stdout, stderr


def test_a_change_of_data_on_resume_is_refused_unless_asked(corpus: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_bytes(corpus.read_bytes())
    out = tmp_path / "run"
    Trainer(make_config(data, out, max_steps=2)).train()

    moved = tmp_path / "moved" / "data.txt"  # the same text elsewhere: the same data, the run continues
    moved.parent.mkdir()
    shutil.copyfile(data, moved)
    assert Trainer(make_config(moved, out, max_steps=3)).engine.step_count == 2

    data.write_bytes(corpus.read_bytes()[::-1])  # the same path, other text
    code, stdout, stderr = run_main([*cli(data, "--max-steps", "3"), "--out", str(out)])
    line = assert_one_line_error(code, stdout, stderr)
    assert "data of the run" in line and "changed" in line and "--allow-data-change" in line
    code, stdout, stderr = run_main([*cli(data, "--max-steps", "3", "--allow-data-change"), "--out", str(out)])
    assert code == 0, stderr
    assert "--allow-data-change: the run continues on changed data" in stdout and "step 3 | loss" in stdout


# --------------------------------------------------------------------------------------------
# The run owns its tokenizer
# --------------------------------------------------------------------------------------------


def test_the_run_and_its_export_carry_a_loadable_tokenizer_and_survive_a_moved_cache(
    corpus: Path, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from bigbatch.data.tokenizers import BPETokenizer

    cache, out = tmp_path / "cache", tmp_path / "run"
    argv = [
        *cli(corpus, "--tokenizer", "bpe:300", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1"),
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
    ]
    code, stdout, stderr = run_main(argv)
    assert code == 0, stdout + stderr
    ours = BPETokenizer.from_file("bpe:300", out / "tokenizer" / "tokenizer.json")
    text = "To be, or not to be: that is the question.\n"
    hf = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    assert hf.encode(text) == ours.encode(text.encode()) and hf.decode(hf.encode(text)) == text

    code, stdout, stderr = run_main(["export", str(out), "--format", "hf", str(tmp_path / "hf")])
    assert code == 0 and "+ tokenizer files" in stdout, stderr
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert exported.encode(text) == ours.encode(text.encode())
    assert exported.eos_token == "<|endoftext|>"

    shutil.move(cache, tmp_path / "cache-moved")  # the prepared data (and its tokenizer.json) are gone
    code, stdout, stderr = run_main(
        ["sample", "--checkpoint", str(out), "--prompt", "To be", "--max-new-tokens", "8", "--device", "cpu"]
    )
    assert code == 0 and stdout.startswith("To be"), stderr
    code, stdout, stderr = run_main(["eval", str(out), "--device", "cpu"])  # the run's own data, prepared again
    assert code == 0 and "loss" in stdout, stderr


def test_eval_defaults_to_the_runs_own_data(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    Trainer(make_config(corpus, out, max_steps=2, eval_every=2, eval_batches=2)).train()
    (val,) = records(out, "eval")
    code, stdout, stderr = run_main(["eval", str(out), "--device", "cpu"])
    assert code == 0, stderr
    assert f"loss {val['val_loss']:.4f}" in stdout


def test_gpt2_tokenizer_files_give_tiktokens_ids(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """tiktoken's GPT-2 encoding needs a download, so a small encoding with GPT-2's pattern and arbitrary ranks
    stands in: the merges recovered from the ranks give the same ids in transformers."""
    transformers = pytest.importorskip("transformers")
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    from bigbatch.data.tokenizer_files import write_tokenizer_files
    from bigbatch.data.tokenizers import TiktokenGPT2Tokenizer

    ranks = {bytes([b]): i for i, b in enumerate(sorted(range(256), key=lambda b: (b * 37) % 256))}
    for merge in [b"th", b"the", b" t", b" th", b" the", b"he", b"ll", b"llo", b"He", b"Hello", b"in", b"ing"]:
        ranks.setdefault(merge, len(ranks))
    encoding = tiktoken.Encoding(
        "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    ours = TiktokenGPT2Tokenizer()
    write_tokenizer_files(tmp_path, ours, 64)
    text = "Hello there, the thing is singing!  été 123\n\n"
    for cls in (transformers.AutoTokenizer, transformers.GPT2Tokenizer):
        hf = cls.from_pretrained(str(tmp_path), local_files_only=True)
        assert hf.encode(text) == ours.encode(text.encode()), cls


# --------------------------------------------------------------------------------------------
# Files follow the user's umask
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int, file_mode: int, dir_mode: int) -> None:
    from bigbatch.data.prepare import prepare_dataset
    from bigbatch.models import GPT, GPTConfig
    from bigbatch.models.gpt.hf import save_hf_gpt2

    (tmp_path / "c.txt").write_bytes(corpus_bytes(5_000))
    old = os.umask(umask)
    try:
        path = ckpt.save_checkpoint({"step": 1, "w": torch.zeros(4)}, ckpt.single_file_path(tmp_path / "run", 1))
        export = save_hf_gpt2(
            GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=16)), tmp_path / "hf"
        )
        prepare_dataset(str(tmp_path / "c.txt"), tmp_path / "ds", val_fraction=0.1)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(path) == mode(ckpt.commit_path(path)) == file_mode
    assert mode(export) == mode(tmp_path / "ds") == dir_mode
    assert {mode(p) for p in [*export.iterdir(), *(tmp_path / "ds").iterdir()]} == {file_mode}


def test_the_run_directory_copy_of_the_tokenizer_follows_the_runs_tokenizer(tmp_path: Path) -> None:
    """A run started over (--resume never --overwrite) with other data replaces a stale tokenizer copy."""
    from bigbatch.data.tokenizer_files import INFO_FILE, save_run_tokenizer
    from bigbatch.data.tokenizers import ByteTokenizer, train_bpe

    run = tmp_path / "run"
    run.mkdir()
    save_run_tokenizer(run, ByteTokenizer(), 32)
    assert json.loads((run / "tokenizer" / INFO_FILE).read_text())["name"] == "byte"
    bpe = train_bpe("bpe:300", [corpus_bytes(20_000).decode()])
    save_run_tokenizer(run, bpe, 32)
    assert json.loads((run / "tokenizer" / INFO_FILE).read_text())["name"] == "bpe:300"
    assert (run / "tokenizer" / "merges.txt").is_file()
    assert [p.name for p in run.iterdir()] == ["tokenizer"]  # no staging directory left behind


def test_byte_tokenizer_files_give_byte_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from bigbatch.data.tokenizer_files import write_tokenizer_files
    from bigbatch.data.tokenizers import ByteTokenizer

    write_tokenizer_files(tmp_path, ByteTokenizer(), 64)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "héllo  wörld\n\tdef f(x): return 1 😀"
    assert hf.encode(text) == list(text.encode()) and hf.decode(list(text.encode())) == text
