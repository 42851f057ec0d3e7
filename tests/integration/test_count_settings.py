"""Counts and sizes: no number means something else than it says.

Every numeric flag of every command and every numeric config key refuses 0 and -1 in one line, or its help says
what 0 means (disables, no limit, none, ...); a value that used to mean "automatic" as 0 is spelt ``auto`` (a
config file's old 0 still reads as auto). ``seq_len`` auto is the model's block size, and a data folder's binary
files are skipped with a word about it.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main
from text_corpus import text_corpus

from bigbatch.cli import build_parser
from bigbatch.errors import ConfigError
from bigbatch.run.configuration.config_sources import apply_mapping
from bigbatch.run.configuration.identity import default_run_dir
from bigbatch.run.configuration.seq_len import resolve_seq_len
from bigbatch.run.configuration.train_config import SECTIONS, TrainConfig
from bigbatch.settings.ranges import NON_NEGATIVE_INT, POSITIVE_INT

NOT_NUMBERS = (None, str, Path)  # a flag with another type= parses a number (int, float, a Range, a count)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def numeric_flags() -> list[tuple[str, argparse.Action]]:
    return [
        (name, action)
        for name, parser in subparsers().items()
        for action in parser._actions
        if action.option_strings and action.type not in NOT_NUMBERS
    ]


def says_what_zero_means(help_text: str | None) -> bool:
    """The help names 0 itself (``0 disables``, ``0: none``), not only as the default."""
    text = re.sub(r"\(default: [^)]*\)", "", help_text or "")
    return re.search(r"(?<![\w.])0(?![\w.])", text) is not None


def accepts(action: argparse.Action, text: str) -> bool:
    try:
        action.type(text)  # type: ignore[misc]
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def zero_problem(action: argparse.Action) -> str | None:
    """Why this numeric flag's 0 or -1 is a silent surprise, or ``None``."""
    flag = action.option_strings[0]
    if accepts(action, "-1"):
        return f"{flag} accepts -1"
    if accepts(action, "0") and not says_what_zero_means(action.help):
        return f"{flag} accepts 0 but its help does not say what 0 means: {action.help!r}"
    return None


FLAGS = numeric_flags()


def test_the_walk_finds_the_numeric_flags_of_every_command() -> None:
    commands = {name for name, _ in FLAGS}
    assert commands == {"prepare", "train", "sample", "plan", "memory", "verify", "eval", "critical-batch"}
    found = {(name, action.option_strings[0]) for name, action in FLAGS}
    for expected in [
        ("prepare", "--workers"),
        ("prepare", "--shard-tokens"),
        ("train", "--seq-len"),
        ("train", "--decay-steps"),
        ("plan", "--tokens-per-step"),
        ("critical-batch", "--budget"),
    ]:
        assert expected in found
    assert len(FLAGS) >= 60


@pytest.mark.parametrize(
    ("command", "action"), FLAGS, ids=[f"{name} {action.option_strings[0]}" for name, action in FLAGS]
)
def test_a_numeric_flag_refuses_zero_and_negatives_in_one_line_or_says_what_zero_means(
    command: str, action: argparse.Action
) -> None:
    assert zero_problem(action) is None
    flag = action.option_strings[0]
    for value in ("0", "-1"):
        if accepts(action, value):
            continue
        line = assert_one_line_error(*run_main([command, flag, value]))
        assert flag in line and value in line, line  # the flag, the value and (from the range) what is allowed


def test_the_check_catches_a_count_flag_that_accepts_zero_silently() -> None:
    parser = argparse.ArgumentParser()
    silent = parser.add_argument("--widgets", type=NON_NEGATIVE_INT.argtype(), help="widgets per batch (default: 0)")
    plain = parser.add_argument("--gadgets", type=int, help="gadgets")
    said = parser.add_argument("--gizmos", type=NON_NEGATIVE_INT.argtype(), help="gizmos; 0 disables them")
    refused = parser.add_argument("--doodads", type=POSITIVE_INT.argtype(), help="doodads")
    assert "accepts 0" in str(zero_problem(silent))
    assert "accepts -1" in str(zero_problem(plain))
    assert zero_problem(said) is None and zero_problem(refused) is None


def numeric_keys() -> list[tuple[str, str]]:
    return [(section, f.name) for section, cls in SECTIONS.items() for f in fields(cls) if f.type in ("int", "float")]


@pytest.mark.parametrize(("section", "key"), numeric_keys(), ids=[f"{s}.{k}" for s, k in numeric_keys()])
def test_a_numeric_config_key_refuses_zero_and_negatives_or_reads_zero_as_documented(section: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{key} .*got -1"):
        apply_mapping(TrainConfig(), {section: {key: -1}}, origin="old.toml")
    config = TrainConfig()
    try:
        apply_mapping(config, {section: {key: 0}}, origin="old.toml")
    except ConfigError as exc:
        assert f"{section}.{key}" in str(exc) and "\n" not in str(exc)
        return
    meta = {f.name: f for f in fields(SECTIONS[section])}[key].metadata
    if meta.get("auto"):  # a file from before the word auto: its 0 is auto, and auto is what is written back
        assert meta.get("legacy_zero") and getattr(getattr(config, section), key) == 0
        assert tomllib.loads(config.to_toml())[section][key] == "auto"
    else:
        assert says_what_zero_means(meta["help"]), meta["help"]


def test_auto_is_the_default_spelt_out_in_help_and_zero_is_refused_on_the_command_line() -> None:
    train = subparsers()["train"].format_help()
    for flag in ("--seq-len", "--block-size", "--decay-steps"):
        assert re.search(rf"{flag} INT\|auto", train), flag
    assert re.search(r"--peak-flops FLOAT\|auto", train) and re.search(r"--memory-budget FLOAT\|auto", train)
    assert "0 means" not in train and "0 looks" not in train and "0 keeps the preset" not in train
    assert "(default: 'auto')" in re.sub(r"\s+", " ", train)
    line = assert_one_line_error(*run_main(["train", "--decay-steps", "0"]))
    assert "--decay-steps" in line and "or auto, got 0" in line
    prepare = re.sub(r"\s+", " ", subparsers()["prepare"].format_help())
    assert "auto: one per CPU core" in prepare and "(default: 100,000,000)" in prepare


def test_prepare_help_default_is_the_library_default() -> None:
    from bigbatch.cli.prepare import SHARD_TOKENS
    from bigbatch.data.prepare import DEFAULT_SHARD_TOKENS

    assert SHARD_TOKENS == DEFAULT_SHARD_TOKENS


def test_an_old_config_file_with_zero_for_auto_still_loads(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text(
        "[model]\nblock_size = 0\n[batch]\nmemory_budget = 0.0\n[optim]\ndecay_steps = 0\n[run]\npeak_flops = 0\n"
    )
    code, out, err = run_main(["train", "--config", str(old), "--print-config"])
    assert code == 0, err
    written = tomllib.loads(out)
    assert written["model"]["block_size"] == written["optim"]["decay_steps"] == "auto"
    assert written["batch"]["memory_budget"] == written["run"]["peak_flops"] == "auto"
    assert written["batch"]["seq_len"] == "auto"
    (tmp_path / "zero-seq.toml").write_text("[batch]\nseq_len = 0\n")  # never allowed: 0 tokens per sequence
    line = assert_one_line_error(*run_main(["train", "--config", str(tmp_path / "zero-seq.toml")]))
    assert "batch.seq_len" in line and "got 0" in line


# ------------------------------------------------------------------------------------------------
# seq_len auto: the model's block size
# ------------------------------------------------------------------------------------------------


def with_settings(**sections: dict) -> TrainConfig:
    config = TrainConfig()
    apply_mapping(config, sections, origin="test")
    return config


def test_seq_len_auto_is_the_block_size_of_the_preset_the_flag_or_init_from(tmp_path: Path) -> None:
    assert resolve_seq_len(TrainConfig()).batch.seq_len == 256  # nano
    assert resolve_seq_len(with_settings(model={"preset": "pico"})).batch.seq_len == 64
    assert resolve_seq_len(with_settings(model={"preset": "pico", "block_size": 48})).batch.seq_len == 48
    assert resolve_seq_len(with_settings(model={"preset": "pico"}, batch={"seq_len": 32})).batch.seq_len == 32
    hf = tmp_path / "hf"
    hf.mkdir()  # config.json alone: no weights are read
    (hf / "config.json").write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 40}))
    assert resolve_seq_len(with_settings(model={"init_from": str(hf)})).batch.seq_len == 40
    config = TrainConfig()
    assert resolve_seq_len(config) is not config and config.batch.seq_len == 0  # a copy: the caller's stays auto


def test_default_run_directories_are_unchanged_by_seq_len_auto() -> None:
    # runs/nano-6771823094 is the default nano run's directory from before seq_len auto (the README shows it)
    assert default_run_dir(TrainConfig()) == Path("runs/nano-6771823094")
    assert default_run_dir(with_settings(batch={"seq_len": 256})) == Path("runs/nano-6771823094")
    assert default_run_dir(with_settings(model={"preset": "pico"})) == default_run_dir(
        with_settings(model={"preset": "pico"}, batch={"seq_len": 64})
    )  # auto is the run of the number it resolves to
    assert default_run_dir(with_settings(batch={"seq_len": 128})) != default_run_dir(TrainConfig())


def test_plan_takes_seq_len_from_the_model_trains_by_default() -> None:
    code, out, err = run_main(["plan", "--model", "pico", "--tokens-per-step", "1024", "--micro-batch", "4"])
    assert code == 0, err
    assert "seq_len 64 (the pico model's block size)" in out
    assert re.search(r"accumulation steps \(K\)\s+4", out), out
    code, out, err = run_main(["plan", "--tokens-per-step", "2048", "--micro-batch", "4"])  # no --model: nano
    assert code == 0, err
    assert "seq_len 256 (the nano model's block size)" in out and re.search(r"accumulation steps \(K\)\s+2", out)


def test_memory_measures_at_the_presets_block_size_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from bigbatch.sizing import memory

    asked: list[int] = []

    class Sweep:
        def format(self) -> str:
            return "measured"

    def sweep(model: str, seq_len: int, *args: object, **kwargs: object) -> Sweep:
        asked.append(seq_len)
        return Sweep()

    monkeypatch.setattr(memory, "sweep_memory", sweep)  # the measuring itself takes seconds per size
    for argv, expected in ((["--model", "pico"], 64), ([], 256), (["--model", "pico", "--seq-len", "16"], 16)):
        code, out, err = run_main(["memory", *argv, "--device", "cpu"])
        assert code == 0, err
        assert asked.pop() == expected, argv


def mixed_folder(root: Path) -> Path:
    """Two text files and three binary ones, as a folder of notes with pictures beside them holds."""
    folder = root / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_bytes(text_corpus(20_000))
    (folder / "b.txt").write_bytes(text_corpus(30_000)[20_000:])
    for name in ("a.png", "b.jpg", "c.zip"):
        (folder / name).write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    return folder


@pytest.mark.usefixtures("isolated")
def test_prepare_says_how_many_binary_files_it_skipped(tmp_path: Path) -> None:
    code, out, err = run_main(["prepare", str(mixed_folder(tmp_path)), "--out", str(tmp_path / "ds")])
    assert code == 0, err
    said = [line for line in out.splitlines() if "binary" in line]
    assert len(said) == 1 and re.search(r"skipped 3 binary files \(e\.g\. \S+\.png\): not text", said[0]), out
    assert "2 documents" in out


@pytest.mark.usefixtures("isolated")
def test_train_pico_without_seq_len_uses_its_block_size_and_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out, err = run_main(
        [
            "train",
            "--data",
            str(mixed_folder(tmp_path)),
            "--model",
            "pico",
            "--micro-batch",
            "4",
            "--total-batch-tokens",
            "512",
            "--max-steps",
            "2",
            "--eval-every",
            "0",
            "--sample-tokens",
            "0",
            "--noise-scale-every",
            "0",
            "--out",
            str(run_dir),
        ]
    )
    assert code == 0, err
    (plan,) = [line for line in out.splitlines() if line.startswith("plan |")]
    assert "micro_batch 4 x seq_len 64 x K 2" in plan and plan.endswith("| seq_len 64 (the model's block size)")
    assert len([line for line in out.splitlines() if "skipped 3 binary files" in line]) == 1, out
    assert tomllib.loads((run_dir / "config.toml").read_text())["batch"]["seq_len"] == 64  # the number, not auto
