"""The command line: training end to end on a tiny corpus, sampling, help, config files, and user errors."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, run_main
from text_corpus import text_corpus

from bigbatch.cli import main
from bigbatch.run.checkpoints.checkpoint import load_checkpoint

CORPUS_BYTES = 60_000
SRC_DIR = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """main() reconfigures the root logger onto the current stdout; undo that after each test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _isolated_cwd_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything written by accident (default runs/ dir, default cache) lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "env-cache"))


def corpus_text() -> bytes:
    return text_corpus(CORPUS_BYTES)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def corpus(workspace: Path) -> Path:
    path = workspace / "corpus.txt"
    path.write_bytes(corpus_text())
    return path


@pytest.fixture(scope="module")
def cache_dir(workspace: Path) -> Path:
    return workspace / "cache"


def tiny_args(data: Path | str, cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
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
        "2",
        "--sample-tokens",
        "20",
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def trained_run(workspace: Path, corpus: Path, cache_dir: Path) -> tuple[int, str, str, Path]:
    run_dir = workspace / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        code, out, err = run_main(tiny_args(corpus, cache_dir, run_dir, "--max-steps", "3"))
    return code, out, err, run_dir


def exit_code(fn: Callable[[], object]) -> int:
    with pytest.raises(SystemExit) as info:
        fn()
    return int(info.value.code or 0)


# --------------------------------------------------------------------------------------------
# train, end to end
# --------------------------------------------------------------------------------------------


def test_train_exits_zero_and_logs_plan_and_steps(trained_run: tuple[int, str, str, Path]) -> None:
    code, out, err, _ = trained_run
    assert code == 0, err
    assert "Traceback" not in out + err
    plan_lines = [line for line in out.splitlines() if line.startswith("plan")]
    assert len(plan_lines) == 1
    assert "K 2" in plan_lines[0]
    assert "micro_batch 4 x seq_len 32" in plan_lines[0]
    assert "256 tokens/step" in plan_lines[0]
    for step in (1, 2, 3):
        assert re.search(rf"^step {step} \| loss \d+\.\d+", out, re.MULTILINE), out
    assert not re.search(r"^step 4 ", out, re.MULTILINE)
    assert re.search(r"^eval step 2 \| val loss", out, re.MULTILINE)
    assert "done | 3 steps | 768 tokens" in out
    assert "compiling" not in out and "threads |" not in out  # eager on CPU (auto); one process


def test_the_header_says_that_the_first_step_compiles_and_the_threads_bigbatch_chose(
    corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile on: torch.compile works during the first step, silent for up to minutes, so the header's last line
    says so. Under bigbatch's launcher (its environment, set here) a worker says the threads it was given in one
    line, instead of torchrun's banner."""
    from bigbatch.parallel.launch import set_worker_threads

    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)  # compiling itself takes ~1 min on CPU
    environ: dict[str, str] = {}
    set_worker_threads(environ)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    code, out, err = run_main(tiny_args(corpus, cache_dir, tmp_path / "run", "--compile", "on", "--max-steps", "1"))
    assert code == 0, err
    lines = out.splitlines()
    compiling = [i for i, line in enumerate(lines) if line.startswith("compiling | ")]
    assert len(compiling) == 1 and "torch.compile compiles the model during the first step" in lines[compiling[0]]
    assert compiling[0] < next(i for i, line in enumerate(lines) if line.startswith("step 1 | "))
    first = next(i for i, line in enumerate(lines) if line.startswith("bigbatch "))  # the header's first line
    assert lines[first + 1].startswith("threads | 1 CPU thread per process (OMP_NUM_THREADS=1"), lines[first:]
    assert len([line for line in lines if "OMP_NUM_THREADS" in line]) == 1  # said once


def test_plan_counts_the_parameters_as_train_does(
    trained_run: tuple[int, str, str, Path], capsys: pytest.CaptureFixture
) -> None:
    """One count, one format: the trained model's header and plan's table for the same shape."""
    code, out, err, _ = trained_run
    assert code == 0, err
    said = re.search(r"^model pico \| (\d[\d,]*\.\d\dM parameters) \| ", out, re.MULTILINE)
    assert said, out
    argv = ["plan", "--model", "pico", "--vocab-size", "256", "--seq-len", "32", "--micro-batch", "4", "--k", "2"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert re.search(rf"^model pico +{re.escape(said[1])}$", table, re.MULTILINE), (said[1], table)


def test_train_writes_run_directory(trained_run: tuple[int, str, str, Path], cache_dir: Path) -> None:
    code, _, _, run_dir = trained_run
    assert code == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000003", "step_0000003.commit"]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_0000003").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "state.pt",
    ]
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["model"]["preset"] == "pico"
    assert {k: config["batch"][k] for k in ("total_batch_tokens", "micro_batch", "seq_len")} == {
        "total_batch_tokens": 256,
        "micro_batch": 4,
        "seq_len": 32,
    }
    assert config["batch"]["token_budget"] == 0
    assert config["run"]["max_steps"] == 3
    assert config["run"]["out"] == str(run_dir)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens"] == 256 and r["micro_batches"] == 2 and not r["skipped"] for r in steps)
    assert all(r["loss"] > 0 for r in steps)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 3]
    # the raw text was prepared inside the given cache dir
    assert [p for p in cache_dir.iterdir() if (p / "meta.json").is_file()]


def test_checkpoint_loads_with_weights_only(trained_run: tuple[int, str, str, Path]) -> None:
    _, _, _, run_dir = trained_run
    document = torch.load(run_dir / "checkpoints" / "step_0000003" / "state.pt", map_location="cpu", weights_only=True)
    for key in ("engine", "loader", "config", "step", "optimizer_param_groups"):
        assert key in document, key
    assert "model" not in document and "optimizer" not in document  # in the shards
    consolidated = load_checkpoint(run_dir)
    assert set(consolidated["model"]) and set(consolidated["optimizer"]["state"]) <= set(consolidated["model"])
    assert document["step"] == 3
    assert document["tokens_seen"] == 3 * 256
    assert document["tokenizer"] == "byte"
    assert document["config"]["batch"]["micro_batch"] == 4
    # 3 steps x 2 micro-batches x 4 windows of 32 tokens read in the shuffled order (--shuffle on, the default)
    assert document["loader"]["order"] == "shuffle"
    assert document["loader"]["row"] == 3 * 2 * 4
    assert document["loader"]["epoch"] == 0
    assert all(isinstance(v, torch.Tensor) for v in consolidated["model"].values())


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------


def test_sample_continues_the_prompt(trained_run: tuple[int, str, str, Path], capsys: pytest.CaptureFixture) -> None:
    _, _, _, run_dir = trained_run
    argv = ["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--device", "cpu"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("ROMEO:")
    assert len(first.out.rstrip("\n")) > len("ROMEO:")
    assert "Traceback" not in first.err
    # the same seed gives the same text; a checkpoint file works as well as the run directory
    argv[2] = str(run_dir / "checkpoints" / "step_0000003")
    assert main(argv) == 0
    assert capsys.readouterr().out == first.out


def test_sample_streams_the_same_text_as_a_batch(
    trained_run: tuple[int, str, str, Path], capsys: pytest.CaptureFixture
) -> None:
    from bigbatch.data.tokenizers import get_tokenizer
    from bigbatch.models.sampling import generate
    from bigbatch.run.checkpoints.checkpoint import load_checkpoint, model_from_checkpoint

    _, _, _, run_dir = trained_run
    for temperature in ("0", "0.8"):
        argv = [
            "sample",
            "--checkpoint",
            str(run_dir),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "30",
            "--temperature",
            temperature,
            "--seed",
            "5",
            "--device",
            "cpu",
        ]
        assert main(argv) == 0
        streamed = capsys.readouterr().out
        document = load_checkpoint(run_dir)
        model = model_from_checkpoint(document)
        tokenizer = get_tokenizer(str(document.get("tokenizer", "byte")))
        prompt = tokenizer.encode(b"ROMEO:")
        out = generate(model, torch.tensor([prompt]), 30, float(temperature), 50, torch.Generator().manual_seed(5))
        assert streamed == "ROMEO:" + tokenizer.decode(out[0, len(prompt) :].tolist()) + "\n"


def test_sample_several(trained_run: tuple[int, str, str, Path], capsys: pytest.CaptureFixture) -> None:
    _, _, _, run_dir = trained_run
    argv = ["sample", "--checkpoint", str(run_dir), "--prompt", "A", "--max-new-tokens", "5", "--num-samples", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--- sample 1" in out and "--- sample 2" in out


def test_sample_from_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["sample", "--checkpoint", str(tmp_path / "nope"), "--prompt", "ROMEO:"])
    captured = capsys.readouterr()
    line = assert_one_line_error(code, captured.out, captured.err)
    assert "does not exist" in line
    assert not (tmp_path / "nope").exists()


def test_sample_from_directory_without_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty_run").mkdir()
    code = main(["sample", "--checkpoint", str(tmp_path / "empty_run")])
    captured = capsys.readouterr()
    assert "no complete checkpoints" in assert_one_line_error(code, captured.out, captured.err)


def test_sample_from_damaged_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "run" / "checkpoints" / "step_0000001.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    code = main(["sample", "--checkpoint", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert "damaged" in assert_one_line_error(code, captured.out, captured.err)


# --------------------------------------------------------------------------------------------
# help
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["prepare", "train", "sample", "plan", "memory", "verify", "report", "export", "eval"]),
        (
            ["train"],
            ["--total-batch-tokens", "--micro-batch", "--seq-len", "--print-config", "tokens per optimizer step"],
        ),
        (["sample"], ["--checkpoint", "--prompt", "--max-new-tokens"]),
        (["prepare"], ["--out", "--tokenizer", "--val-fraction"]),
        (["plan"], ["--tokens-per-step", "--devices", "--measure"]),
        (["memory"], ["--max-micro-batch", "--plot"]),
        (["verify"], ["--factory", "--nproc"]),
        (["report"], ["--out"]),
        (["export"], ["--format"]),
        (["eval"], ["--data", "--split"]),
    ],
    ids=["top", "train", "sample", "prepare", "plan", "memory", "verify", "report", "export", "eval"],
)
def test_help(argv: list[str], expected: list[str], capsys: pytest.CaptureFixture) -> None:
    assert exit_code(lambda: main([*argv, "--help"])) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert out.startswith("usage: bigbatch")
    for text in expected:
        assert text in out, text


def test_version(capsys: pytest.CaptureFixture) -> None:
    from bigbatch import __version__

    assert exit_code(lambda: main(["--version"])) == 0
    assert capsys.readouterr().out.strip() == f"bigbatch {__version__}"


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert exit_code(lambda: main([])) == 2
    assert "usage:" in capsys.readouterr().err


def test_python_dash_m_help_in_a_subprocess(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR))
    result = subprocess.run(
        [sys.executable, "-m", "bigbatch", "--help"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bigbatch")
    for command in ("prepare", "train", "sample", "plan"):
        assert command in result.stdout
    assert result.stderr == ""


# --------------------------------------------------------------------------------------------
# config: --print-config and --config
# --------------------------------------------------------------------------------------------


def print_config(argv: list[str], capsys: pytest.CaptureFixture) -> dict:
    assert main(["train", "--print-config", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return tomllib.loads(captured.out)


def test_print_config_applies_overrides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = print_config(
        ["--model", "pico", "--seq-len", "32", "--lr", "0.003", "--compile", "--sample-prompt", 'say "hi"\n'], capsys
    )
    assert set(config) == {"model", "data", "batch", "optim", "run", "guard", "objective", "rewards"}
    assert config["model"]["preset"] == "pico"
    assert config["batch"]["seq_len"] == 32
    assert config["batch"]["micro_batch"] == 16  # default untouched
    assert config["optim"]["lr"] == 0.003
    assert config["run"]["compile"] == "on"
    assert config["run"]["sample_prompt"] == 'say "hi"\n'
    # printing the config trains nothing and creates nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_print_config_round_trips_through_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--print-config", "--model", "pico", "--eps", "1e-08", "--no-compile", "--out", "x\\y"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == text


def test_config_file_is_applied_and_flags_override_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\npreset = "pico"\n\n[batch]\nmicro_batch = 8\nseq_len = 64\n\n[optim]\nlr = 2\n\n[run]\nmax_steps = 7\n'
    )
    config = print_config(["--config", str(path), "--seq-len", "32", "--max-steps", "9"], capsys)
    assert config["model"]["preset"] == "pico"  # from the file
    assert config["batch"]["micro_batch"] == 8  # from the file
    assert config["batch"]["seq_len"] == 32  # flag beats file
    assert config["run"]["max_steps"] == 9  # flag beats file
    assert config["optim"]["lr"] == 2.0  # int accepted for a float field
    assert config["batch"]["total_batch_tokens"] == 16384  # default


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[batch]\nmicro_batchez = 4\n", "micro_batchez"),
        ('[batch]\nmicro_batch = "4"\n', "batch.micro_batch"),
        ("[run]\ncompile = 1\n", "run.compile"),
        ('[optim]\nlr = "fast"\n', "optim.lr"),
        ("[trainer]\nlr = 1.0\n", "trainer"),
        ("[batch\nmicro_batch = 4\n", "not valid TOML"),
    ],
    ids=["unknown-key", "wrong-type-int", "wrong-type-bool", "wrong-type-float", "unknown-section", "syntax"],
)
def test_bad_config_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, toml: str, needle: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    code = main(["train", "--config", str(path), "--print-config"])
    captured = capsys.readouterr()
    line = assert_one_line_error(code, captured.out, captured.err)
    assert needle in line
    assert str(path) in line


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["train", "--config", str(tmp_path / "nope.toml")])
    captured = capsys.readouterr()
    assert "does not exist" in assert_one_line_error(code, captured.out, captured.err)


def test_invalid_flag_value_is_reported(capsys: pytest.CaptureFixture) -> None:
    code = main(["train", "--print-config", "--max-steps", "0"])
    captured = capsys.readouterr()
    assert "--max-steps" in assert_one_line_error(code, captured.out, captured.err)


def test_an_error_about_a_config_files_value_names_its_key_and_the_file(
    tmp_path: Path, corpus: Path, cache_dir: Path
) -> None:
    """A value from --config was never a flag: an error about it names the file's key (``data.tokenizer``, not
    ``--tokenizer``) and the file, wherever the error comes from; a flag on the command line is still the flag."""
    data = tmp_path / "data"
    assert run_main(["prepare", str(corpus), "--out", str(data), "--tokenizer", "byte"])[0] == 0
    path = tmp_path / "run.toml"
    path.write_text(f'[data]\ndata = "{data}"\ntokenizer = "bpe:300"\n\n[model]\npreset = "pico"\n')
    train = ["train", "--config", str(path), "--cache-dir", str(cache_dir), "--out", str(tmp_path / "run")]
    line = assert_one_line_error(*run_main(train))
    assert "--tokenizer" not in line and "--data" not in line, line
    assert "data.tokenizer bpe:300 contradicts the data" in line and "drop data.tokenizer" in line
    assert line.endswith(f"(data.data and data.tokenizer are set in {path})"), line
    line = assert_one_line_error(*run_main([*train, "--tokenizer", "bpe:300"]))
    assert "--tokenizer bpe:300 contradicts the data" in line and "drop --tokenizer" in line
    assert line.endswith(f"(data.data is set in {path})"), line
    path.write_text("[model]\nlora_alpha = 8.0\n")  # the config's own validation
    line = assert_one_line_error(*run_main(["train", "--config", str(path), "--print-config"]))
    assert line.startswith("bigbatch: error: model.lora_alpha, --lora-dropout and --lora-targets shape LoRA")
    assert line.endswith(f"(model.lora_alpha is set in {path})")
    path.write_text('[run]\ncompile = "maybe"\n')  # a word out of its choices names the file and key too
    line = assert_one_line_error(*run_main(["train", "--config", str(path), "--print-config"]))
    assert f"{path}: run.compile must be one of auto, on, off, got 'maybe'" in line


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------


def test_plan_prints_k(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "--total-batch-tokens", "524288", "--micro-batch", "16", "--seq-len", "1024", "--world-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^accumulation steps \(K\)\s+4$", out, re.MULTILINE), out
    assert re.search(r"^tokens per step\s+524,288$", out, re.MULTILINE), out
    assert re.search(r"^devices \(world size\)\s+8$", out, re.MULTILINE), out


def test_plan_non_divisible_is_refused_with_both_neighbours(capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", "--total-batch-tokens", "500000", "--micro-batch", "16", "--seq-len", "1024"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "--tokens-per-step 500,000 is not a multiple of the 16,384 tokens each increment of K adds" in captured.err
    assert "the nearest that are: 491,520 = 480Ki (K 30) or 507,904 = 496Ki (K 31)" in captured.err


def test_plan_inconsistent_settings_are_a_one_line_error(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "plan",
            "--total-batch-tokens",
            "500000",
            "--micro-batch",
            "16",
            "--seq-len",
            "1024",
            "--k",
            "4",
            "--devices",
            "1",
        ]
    )
    captured = capsys.readouterr()
    assert "leave one of them out" in assert_one_line_error(code, captured.out, captured.err)


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------


def test_prepare_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.txt").write_bytes(b"x" * 1000)
    assert main(["prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "ds"), "--val-fraction", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "train 800 tokens" in out and "val 200 tokens" in out
    assert (tmp_path / "ds" / "meta.json").is_file()
    # a second time into the same directory is refused
    code = main(["prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "ds")])
    captured = capsys.readouterr()
    assert "not empty" in assert_one_line_error(code, captured.out, captured.err)


# --------------------------------------------------------------------------------------------
# train: user errors exit 2 with one line, no traceback, no run directory
# --------------------------------------------------------------------------------------------


def _empty_corpus(tmp_path: Path, corpus: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    return path, []


def _short_corpus(tmp_path: Path, corpus: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "short.txt"
    path.write_bytes(corpus.read_bytes()[:100])  # 90 train tokens < 4 x 32 + 1
    return path, []


def _non_divisible(tmp_path: Path, corpus: Path) -> tuple[Path, list[str]]:
    return corpus, ["--total-batch-tokens", "300"]


def _seq_len_above_block(tmp_path: Path, corpus: Path) -> tuple[Path, list[str]]:
    return corpus, ["--seq-len", "128", "--total-batch-tokens", "1024"]  # pico's block size is 64


def _missing_data(tmp_path: Path, corpus: Path) -> tuple[Path, list[str]]:
    return tmp_path / "no_such_corpus.txt", []


BAD_INPUTS = {
    "empty-corpus": (_empty_corpus, "no text"),
    "short-corpus": (_short_corpus, "129"),
    "non-divisible-batch": (_non_divisible, "nearest valid"),
    "seq-len-above-block-size": (_seq_len_above_block, "block_size"),
    "missing-data": (_missing_data, "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_train_input_is_one_line_exit_2(
    case: str, tmp_path: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    make, needle = BAD_INPUTS[case]
    data, extra = make(tmp_path, corpus)
    run_dir = tmp_path / "run"
    code = main(tiny_args(data, cache_dir, run_dir, "--max-steps", "3", *extra))
    captured = capsys.readouterr()
    line = assert_one_line_error(code, captured.out, captured.err)
    assert needle in line, line
    assert not run_dir.exists()
    assert not (tmp_path / "runs").exists()
    assert not list(tmp_path.rglob("*.pt"))


def test_run_dir_with_checkpoints_is_refused_and_untouched(
    tmp_path: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    existing = run_dir / "checkpoints" / "step_0000005.pt"
    existing.parent.mkdir(parents=True)
    payload = os.urandom(4096)
    existing.write_bytes(payload)
    before = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*"))

    code = main(tiny_args(corpus, cache_dir, run_dir, "--max-steps", "3"))
    captured = capsys.readouterr()
    line = assert_one_line_error(code, captured.out, captured.err)
    assert "holds checkpoints but none is complete and valid" in line  # --resume auto finds nothing to trust
    code = main(tiny_args(corpus, cache_dir, run_dir, "--max-steps", "3", "--resume", "never"))
    captured = capsys.readouterr()
    line = assert_one_line_error(code, captured.out, captured.err)
    assert "already holds checkpoints" in line and "--overwrite" in line
    assert existing.read_bytes() == payload
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == before  # no config.toml, no metrics


@pytest.mark.slow
def test_bad_train_input_in_a_real_subprocess_has_no_traceback(tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR), BIGBATCH_CACHE=str(tmp_path / "env-cache"))
    argv = tiny_args(corpus, tmp_path / "cache", run_dir, "--max-steps", "3", "--total-batch-tokens", "300")
    result = subprocess.run(
        [sys.executable, "-m", "bigbatch", *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert result.returncode == 2
    lines = result.stderr.strip("\n").splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bigbatch: error: ") and "nearest valid" in lines[0]
    assert "Traceback" not in result.stdout and "Traceback" not in result.stderr
    assert not run_dir.exists()
    assert not list(tmp_path.rglob("*.pt"))


@pytest.mark.parametrize("where", ["train-out", "train-cache-dir", "prepare-out"])
def test_path_under_a_regular_file_is_a_one_line_error(
    where: str, tmp_path: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    if where == "train-out":
        argv = tiny_args(corpus, cache_dir, blocker / "run", "--max-steps", "1")
    elif where == "train-cache-dir":
        argv = tiny_args(corpus, blocker, tmp_path / "run", "--max-steps", "1")
    else:
        argv = ["prepare", str(corpus), "--out", str(blocker / "ds")]
    code = main(argv)
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.out, captured.err)
    assert blocker.read_text() == "not a directory"
