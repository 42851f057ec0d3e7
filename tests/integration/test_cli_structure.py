"""The command line's shape: a table of commands, help without torch, and every closed choice from one place."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from bigbatch.cli import COMMANDS, build_parser
from bigbatch.errors import ConfigError
from bigbatch.run.configuration.train_config import SECTIONS, TrainConfig
from bigbatch.settings import choices
from bigbatch.settings.choices import DATA_MODE, PRECISION, SWITCH, Choices
from bigbatch.settings.ranges import AUTO

SRC = Path(__file__).resolve().parents[2] / "src"


def imported_modules(*argv: str) -> set[str]:
    """The modules ``python -X importtime -m bigbatch ARGV`` imports (a fresh interpreter)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "bigbatch", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: bigbatch" in done.stdout
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize(
    "argv", [["--help"], ["train", "--help"], ["verify", "--help"], ["memory", "--help"], ["critical-batch", "--help"]]
)
def test_help_does_not_import_torch(argv: list[str]) -> None:
    modules = imported_modules(*argv)
    assert "bigbatch.cli.app" in modules  # the measurement saw the CLI
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy") or m.startswith("bigbatch.data"))
    assert not heavy, heavy


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_command_is_one_module_with_its_arguments_and_run() -> None:
    parsers = subparsers()
    assert (
        list(parsers)
        == list(COMMANDS)
        == [
            "prepare",
            "train",
            "sample",
            "plan",
            "memory",
            "verify",
            "report",
            "export",
            "eval",
            "critical-batch",
        ]
    )
    for name, module in COMMANDS.items():
        assert callable(module.add_arguments) and callable(module.run), name
        assert parsers[name].get_default("handler") is module.run


def test_cli_choices_come_from_bigbatch_choices() -> None:
    parsers = subparsers()
    for name in ("plan", "memory", "verify", "eval"):
        assert option(parsers[name], "--precision").choices is PRECISION, name
    assert option(parsers["prepare"], "--mode").choices is DATA_MODE
    assert option(parsers["train"], "--compile").choices is SWITCH
    assert ", ".join(choices.TOKENIZER_NAMES) in option(parsers["prepare"], "--tokenizer").help


def test_the_model_flags_commands_share_take_the_models_own_vocabulary() -> None:
    """plan, memory and verify read --vocab-size alike: auto, the model's own, unless a number is given (memory
    once assumed 256 byte tokens, which left out most of GPT-2's head)."""
    parsers = subparsers()
    for name in ("plan", "memory", "verify"):
        vocab = option(parsers[name], "--vocab-size")
        assert vocab.default == AUTO and vocab.type("auto") == AUTO, name
        assert vocab.type("256") == 256 and "auto: the model's" in vocab.help, name


def shared_flags() -> dict[str, tuple[str, object]]:
    """Each flag that several commands take, with its meaning (the config field's help, or --k's) and its one
    default (the config field's; auto for an auto field)."""
    from bigbatch.cli.common import K_MEANING
    from bigbatch.run.configuration.train_config import flag_of

    found: dict[str, tuple[str, object]] = {"--k": (K_MEANING, 4)}
    for cls in SECTIONS.values():
        for f in fields(cls):
            default = AUTO if f.metadata.get("auto") and f.default == 0 else f.default
            found[f"--{flag_of(f)}"] = (f.metadata["help"], default)
    return found


EACH_COMMANDS_OWN = {"--out", "--overwrite"}
"""Flags whose meaning is the command's own output: where it writes, and whether it may replace what is there."""


def test_a_shared_flag_means_one_thing_with_one_default_in_every_command() -> None:
    """Every flag of every command that a config field (or --k) also names: the field's meaning (help) and default,
    unless the command's own default is in OWN_DEFAULTS with its reason (and then it really differs). train's flags
    are the config's own (a TOML file fills them)."""
    from bigbatch.cli.common import OWN_DEFAULTS

    shared = shared_flags()
    seen: dict[str, list[str]] = {}
    for command, parser in subparsers().items():
        for action in parser._actions:
            for flag in (set(action.option_strings) & shared.keys()) - EACH_COMMANDS_OWN:
                meaning, default = shared[flag]
                seen.setdefault(flag, []).append(command)
                assert (action.help or "").startswith(meaning), (command, flag, action.help)
                if command == "train":
                    continue
                if (command, flag) in OWN_DEFAULTS:
                    assert action.default != default, f"{command} {flag}: listed as its own default, but it is not"
                else:
                    assert action.default == default, (command, flag, action.default, default)
                assert f"(default: {'unset' if action.default is None else action.default})" in (action.help or "")
    assert {"--model", "--seq-len", "--micro-batch", "--k", "--device"} <= {f for f, c in seen.items() if len(c) > 2}
    assert {command for command, _ in OWN_DEFAULTS} <= set(subparsers())


def test_plan_without_model_or_micro_batch_plans_trains_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """An unset --model is train's nano (its block size for --seq-len auto), an unset --micro-batch train's 16
    with K derived; given --k, the micro-batch is derived instead."""
    from bigbatch.cli.app import main

    assert main(["plan", "--tokens-per-step", "16384"]) == 0
    out = capsys.readouterr().out
    assert "seq_len 256 (the nano model's block size)" in out and "model nano" in out
    assert re.search(r"micro-batch per device \(B\)\s+16\n", out) and re.search(r"accumulation steps \(K\)\s+4\n", out)
    assert main(["plan", "--tokens-per-step", "16384", "--seq-len", "64", "--k", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"micro-batch per device \(B\)\s+32\n", out) and "derived: micro_batch" in out


@pytest.mark.slow  # a fresh process per measured size
def test_memory_measures_the_models_own_vocabulary_unless_told(capsys: pytest.CaptureFixture[str]) -> None:
    from bigbatch.cli.app import main

    base = ["memory", "--model", "pico", "--seq-len", "8", "--max-micro-batch", "1", "--k", "2", "--device", "cpu"]
    assert main(base) == 0
    assert capsys.readouterr().out.startswith("pico | vocab 50,257 | seq_len 8 |")  # GPT-2's tokenizer, as trained
    assert main([*base, "--vocab-size", "256"]) == 0
    assert capsys.readouterr().out.startswith("pico | vocab 256 | seq_len 8 |")


def choice_fields() -> list[tuple[str, str, Choices, str]]:
    return [
        (section, f.name, f.metadata["choices"], f.metadata["help"])
        for section, cls in SECTIONS.items()
        for f in fields(cls)
        if "choices" in f.metadata
    ]


def choice_params() -> list[object]:
    return [pytest.param(*row, id=f"{row[0]}.{row[1]}") for row in choice_fields()]


def test_every_closed_config_field_declares_its_choices() -> None:
    declared = {c.setting for _, _, c, _ in choice_fields()}
    everything = {v.setting for v in vars(choices).values() if isinstance(v, Choices)}
    assert declared == everything  # no choice set left unused by the config, none duplicated outside it


@pytest.mark.parametrize(("section", "name", "allowed", "help_text"), choice_params())
def test_config_help_validation_and_choices_agree(section: str, name: str, allowed: Choices, help_text: str) -> None:
    for value in allowed:  # the help names every value, and every value validates
        assert value in help_text, (name, value)
        config = TrainConfig()
        setattr(getattr(config, section), name, value)
        config.validate()
    config = TrainConfig()
    setattr(getattr(config, section), name, "bogus")
    with pytest.raises(ConfigError, match=rf"^{allowed.setting} must be .*, got 'bogus'$"):
        config.validate()


def test_choice_messages_keep_their_wording() -> None:
    with pytest.raises(ConfigError, match="^long_documents must be split or truncate, got 'cut'$"):
        choices.LONG_DOCUMENTS.check("cut")
    with pytest.raises(ConfigError, match="^parallel must be one of auto, none, ddp, fsdp, got 'tp'$"):
        choices.PARALLEL.check("tp")


def test_names_the_parser_lists_match_the_library() -> None:
    """The torch-free copy the help uses of the tokenizers; the model presets come from the registry itself, which
    the parser reads without torch (:func:`test_help_does_not_import_torch`)."""
    from bigbatch.data.tokenizers import TOKENIZER_NAMES
    from bigbatch.models import LLAMA_PRESETS, MODEL_PRESETS

    assert choices.TOKENIZER_NAMES == TOKENIZER_NAMES
    model_help = option(subparsers()["train"], "--model").help or ""
    for name in [*MODEL_PRESETS, *LLAMA_PRESETS, "hf:DIR"]:
        assert name in model_help


def test_relaunch_runs_the_launcher_without_nproc(monkeypatch: pytest.MonkeyPatch) -> None:
    from bigbatch.parallel import launch, lifeline

    seen: list[list[str]] = []
    monkeypatch.setattr(lifeline, "run_supervised", lambda command: seen.append(command) or 7)
    code = launch.relaunch_under_torchrun(3, "verify", ["--k", "2", "--nproc", "3", "--nproc=3", "--seed", "1"])
    assert code == 7
    (command,) = seen
    assert command[1:] == [
        "-m",
        "bigbatch.cli.launcher",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=0",
        "-m",
        "bigbatch",
        "verify",
        "--k",
        "2",
        "--seed",
        "1",
    ]
    launch.relaunch_under_torchrun(2, "train", ["--max-restarts", "4"], max_restarts=4)
    assert "--max-restarts=4" in seen[-1][: seen[-1].index("bigbatch")]  # torchrun's flag, before the command


def test_torchrun_under_bigbatchs_launcher_prints_no_thread_banner(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for several processes when it is missing, in a four-line banner on every
    run; bigbatch's launcher sets the same first (the same bits as torchrun run directly), keeps the user's own,
    and the workers' header says it once (test_cli.py)."""
    import os

    from torch.distributed.run import config_from_args, parse_args

    from bigbatch.parallel import launch

    def said() -> str:  # torch's logging goes to stderr, or to pytest's log capture
        text = capfd.readouterr().err + caplog.text
        caplog.clear()
        return text

    torchrun = ["--standalone", "--nproc-per-node=2", "-m", "bigbatch", "train"]
    for name in ("OMP_NUM_THREADS", launch.THREADS_SET_ENV):  # set, then removed: restored as found afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    config_from_args(parse_args(torchrun))
    assert "Setting OMP_NUM_THREADS" in said()  # what the user saw on every run
    monkeypatch.delenv("OMP_NUM_THREADS")
    launch.set_worker_threads(os.environ)
    assert os.environ["OMP_NUM_THREADS"] == os.environ[launch.THREADS_SET_ENV] == "1"
    config_from_args(parse_args(torchrun))
    assert "OMP_NUM_THREADS" not in said()
    assert (launch.worker_threads_note() or "").startswith("1 CPU thread per process (OMP_NUM_THREADS=1, ")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a worker whose OMP_NUM_THREADS is not the launcher's choice
    assert launch.worker_threads_note() is None
    users = {"OMP_NUM_THREADS": "6"}
    launch.set_worker_threads(users)
    assert users == {"OMP_NUM_THREADS": "6"}  # kept, and nothing to say


def test_default_tolerances_cover_the_resolved_precisions() -> None:
    from bigbatch.verify import DEFAULT_TOLERANCE

    assert set(DEFAULT_TOLERANCE) == set(choices.RESOLVED_PRECISIONS)
    assert set(PRECISION) == {"auto", *choices.RESOLVED_PRECISIONS}


@pytest.mark.parametrize(("section", "name", "allowed", "help_text"), choice_params())
def test_configuration_flag_table_names_every_choice(section: str, name: str, allowed: Choices, help_text: str) -> None:
    import re

    from bigbatch.run.configuration.train_config import flag_of

    field = next(f for f in fields(SECTIONS[section]) if f.name == name)
    readme = (SRC.parent / "docs" / "configuration.md").read_text()
    rows = [
        line for line in readme.splitlines() if line.startswith("| ") and f"`--{flag_of(field)}" in line.split("|")[1]
    ]
    assert rows, f"docs/configuration.md's flag table has no row for --{flag_of(field)}"
    for value in allowed:
        assert any(re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", row) for row in rows), (name, value)


def test_no_flag_is_taken_by_a_prefix_in_any_command() -> None:
    """Every proper prefix of every flag of every command that is not itself a flag is refused in one line naming the
    flags it would have abbreviated (`train --k 8` was taken as --keep-checkpoints 8); argparse's own prefix
    matching is off in every parser."""
    from bigbatch.cli.app import UsageError, build_parser, parse_command_line

    parser = build_parser()
    checked = 0
    for command, sub in subparsers().items():
        assert sub.allow_abbrev is False, command
        flags = {name for action in sub._actions for name in action.option_strings if name.startswith("--")}
        for flag in flags:
            for end in range(3, len(flag)):
                prefix = flag[:end]
                if prefix in flags or prefix.endswith("-"):
                    continue
                with pytest.raises(UsageError) as refused:
                    parse_command_line(parser, [command, f"{prefix}=1"])
                message = str(refused.value)
                assert "\n" not in message and (
                    f"unknown flag {prefix}; did you mean " in message or "does not take" in message
                )
                checked += 1
    assert parser.allow_abbrev is False and checked > 500


@pytest.mark.parametrize("flag", ["--k", "--tokens-per-step"])
def test_train_refuses_the_plan_flags_naming_total_batch_tokens(flag: str) -> None:
    from bigbatch.cli.app import UsageError, build_parser, parse_command_line

    with pytest.raises(UsageError, match=rf"bigbatch train does not take {flag}: .*--total-batch-tokens N"):
        parse_command_line(build_parser(), ["train", flag, "8"])


HUGE = "99999999999999999999999"
"""An integer no setting can hold (about 2**76)."""


def integer_flags() -> list[tuple[str, str, str]]:
    """``(command, flag, huge value)`` for every flag of every command whose value is an integer (or a list of
    them, as --tokens-per-step)."""
    found = []
    for command, parser in subparsers().items():
        for action in parser._actions:
            if not action.option_strings or action.type is None or not callable(action.type):
                continue
            for sample, huge in (("7", HUGE), ("7,8", f"7,{HUGE}")):
                try:
                    value = action.type(sample)
                except (argparse.ArgumentTypeError, ValueError, TypeError):
                    continue
                items = value if isinstance(value, list) else [value]
                if items and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                    found.append((command, action.option_strings[0], huge))
                    break
    return found


def test_every_integer_flag_of_every_command_refuses_what_no_setting_holds() -> None:
    """A huge integer is refused in one line naming the flag (it was once accepted and written into config.toml),
    from the command line, from a config file, and inside a count such as --batch-ramp's."""
    from helpers import assert_one_line_error, run_main

    flags = integer_flags()
    assert len(flags) >= 55 and ("train", "--replay-every", HUGE) in flags
    assert ("critical-batch", "--tokens-per-step", f"7,{HUGE}") in flags
    assert ("plan", "--tokens-per-step", HUGE) in flags
    for command, flag, huge in flags:
        line = assert_one_line_error(*run_main([command, flag, huge]))
        bounded = "2**62" in line or re.search(r"must be an integer in \[\d+, \d+\]", line)  # --seed's own bound
        assert flag in line and bounded, (command, flag, line)
    line = assert_one_line_error(*run_main(["plan", "--batch-ramp", f"1K:{HUGE}", "--tokens-per-step", "4Ki"]))
    assert "2**62" in line
    for section, section_cls in SECTIONS.items():  # the same ranges from a config file (or Python)
        for f in fields(section_cls):
            declared = f.metadata.get("range")
            if declared is not None and declared.kind is int:
                config = TrainConfig()
                setattr(getattr(config, section), f.name, int(HUGE))
                with pytest.raises(ConfigError, match=rf"\(({section}.{f.name})\) must be an integer.*, got {HUGE}$"):
                    config.validate()
    assert TrainConfig().batch.total_batch_tokens < 2**62  # the limit leaves every ordinary value alone
