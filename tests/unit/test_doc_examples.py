"""Every command example in README.md and docs/*.md is parsed by the program's own parsers; the ones that run on one
machine in seconds run, and what the docs print beside them is checked against what they print.

An example is a line of a ```bash block (backslash continuations joined, ``# comments`` dropped) or an inline code
span that starts with a command (``bigbatch``, ``.venv/bin/bigbatch``, ``python -m bigbatch``, ``torchrun``).
A line may hold several commands (``|``, ``&&``, ``;``); each is checked by its program:

* ``bigbatch ...``: :func:`bigbatch.cli.app.parse_command_line`, which refuses unknown and abbreviated flags; a
  ``train`` line is also resolved into its config (:func:`config_from_args`: ranges, choices, a ramp's spelling);
* ``torchrun ...``: torch's own parser, and the ``-m bigbatch ...`` it launches as above;
* ``make TARGET``: a target of the Makefile; ``pip install -e '.[EXTRA]'``: an extra of pyproject.toml.

A synopsis (``bigbatch eval RUN [--data DATA]``, ``--tokens-per-step N,N,...``, a bare ``bigbatch report`` in prose)
is not a command line: its command must exist, each ``--flag`` it names must be one of that command's, and each
value it lists for a closed choice (``--split val|train``) must be one of the choices. Single capitals stand for
numbers (:data:`PLACEHOLDERS`); other placeholders (``RUN``, ``runs/<run>``, ``models/my-chat-model``) are parsed as
the paths they stand for.

Every full example either runs (:data:`RUNS`, keyed by the command as the docs write it) or is exempt
(:data:`EXEMPT`: one table, each row a pattern and the reason). A run runs in-process in a temporary directory; its
exit code, the claims the prose makes beside it and the ```text block the docs show as its output are checked: the
block whitespace collapsed (the docs wrap long lines and align columns their own way) and ``...`` standing for
anything the docs leave out. The numbers live in the docs only, so changing either side fails here. docs/cli.md is
generated from the parsers (tests/unit/test_docs.py checks it) and is not read here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"cli.md"}  # written from the parsers' own --help: nothing to check against them

SHELL_FENCES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
COMMAND_START = re.compile(r"^(?:\.venv/bin/)?(?:bigbatch|torchrun|python3? -m bigbatch)(?:\s|$)")
SYNOPSIS = re.compile(r"\.\.\.|\[|\\\||\w\|\w")  # elided arguments, optional parts, alternatives
SEPARATORS = {"|", "||", "&&", ";"}

PLACEHOLDERS = {"N": "2", "M": "1", "R": "8"}
"""What a one-letter placeholder stands for when an example is parsed (``--nproc N``, ``--lora-rank R``)."""

BIGBATCH = {"bigbatch", ".venv/bin/bigbatch"}
PIPE_READERS = {"head", "tail", "grep", "less"}  # the reader of a bigbatch command's output: nothing to check


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    text: str  # the command as the docs write it, continuation lines joined, a trailing comment dropped
    inline: bool  # a code span in prose (or a table), not a line of a shell block

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.text}"


def _drop_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` that starts a word outside quotes)."""
    quote = ""
    for at, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (at == 0 or line[at - 1].isspace()):
            return line[:at].rstrip()
    return line.rstrip()


def examples(path: Path) -> list[Example]:
    """The command examples of one page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    prose: list[str] = []  # the page with fenced blocks blanked, so that line numbers stay
    fence = ""
    pending, pending_line = "", 0
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if match and (not fence or match.group(1) == fence.split(" ")[0]):
            fence = "" if fence else f"{match.group(1)} {match.group(2)}"
            prose.append("")
            continue
        if not fence:
            prose.append(line)
            continue
        prose.append("")
        if fence.split(" ")[1] not in SHELL_FENCES:
            continue
        text = _drop_comment(line.strip())
        if not pending:
            pending_line = number
        if text.endswith("\\"):  # continued on the next line
            pending += text[:-1].rstrip() + " "
            continue
        text, pending = (pending + text).strip(), ""
        if text:
            found.append(Example(path, pending_line, text.removeprefix("$ "), inline=False))
    joined = "\n".join(prose)
    for paragraph in re.finditer(r"(?:[^\n]|\n(?!\s*\n))+", joined):  # a code span never crosses a blank line
        for span in CODE_SPAN.finditer(paragraph.group(0)):
            text = " ".join(span.group(2).split())
            if COMMAND_START.match(text):
                at = joined.count("\n", 0, paragraph.start() + span.start()) + 1
                found.append(Example(path, at, text, inline=True))
    return sorted(found, key=lambda e: e.line)


def all_examples() -> list[Example]:
    return [example for page in pages() for example in examples(page)]


def is_synopsis(example: Example) -> bool:
    """A usage line, not a command: elisions, optional parts, alternatives, or a bare ``bigbatch COMMAND`` in
    prose (the name of a command; its required arguments are elsewhere)."""
    if not COMMAND_START.match(example.text):  # make, pip: always a command
        return False
    if example.inline and (len(example.text.split()) <= 2 or example.text.startswith("torchrun")):
        return True  # prose naming a command, or torchrun's flags
    return bool(SYNOPSIS.search(example.text))


def commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line: words, a command substitution ``$(...)`` standing for one word,
    leading ``VAR=value`` assignments and ``srun`` dropped."""
    text = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", text)
    found: list[list[str]] = []
    current: list[str] = []
    for word in [*shlex.split(text), ";"]:
        if word not in SEPARATORS:
            current.append(word)
            continue
        while current and (re.match(r"^[A-Za-z_]\w*=", current[0]) or current[0] == "srun"):
            current.pop(0)
        if current:
            found.append([PLACEHOLDERS.get(word, word) for word in current])
        current = []
    return found


# --- the parsers ------------------------------------------------------------------------------------------------


def bigbatch_words(words: list[str]) -> list[str] | None:
    """The arguments of bigbatch in one command (``python -m bigbatch X`` too), or None for another program."""
    if words[0] in BIGBATCH:
        return words[1:]
    if re.fullmatch(r"(\.venv/bin/)?python3?", words[0]) and words[1:3] == ["-m", "bigbatch"]:
        return words[3:]
    return None


def parse_bigbatch(argv: list[str]) -> str | None:
    """Why ``bigbatch argv`` does not parse, or None. ``--help`` parses (and prints, which is swallowed)."""
    from bigbatch.cli.app import UsageError, build_parser, parse_command_line

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_command_line(build_parser(), argv)
    except UsageError as exc:
        return str(exc)
    except SystemExit as exc:  # --help, --version; argparse's own exit for the top-level parser
        return None if exc.code in (0, None) else f"argparse exited {exc.code}"
    if args.command == "train" and args.config is None:  # --config names the reader's file
        from bigbatch.errors import BigBatchError
        from bigbatch.run.configuration.config_sources import config_from_args

        try:
            config_from_args(args)
        except BigBatchError as exc:
            return f"the config does not resolve: {exc}"
    return None


def parse_torchrun(argv: list[str]) -> str | None:
    """Why ``torchrun argv`` does not parse (torch's parser, no abbreviations), or why its bigbatch part does not."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            args = parser.parse_args(argv)
    except SystemExit:
        return f"torchrun refuses it: {err.getvalue().strip().splitlines()[-1]}"
    if args.module and args.training_script == "bigbatch":
        return parse_bigbatch(list(args.training_script_args))
    return f"torchrun runs {args.training_script}, not -m bigbatch"


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {name for line in text.splitlines() for name in re.findall(r"^([\w.-]+)\s*:(?!=)", line)}


def pip_extras() -> set[str]:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return set(tomllib.load(handle)["project"]["optional-dependencies"])


def check_command(words: list[str]) -> str | None:
    """Why one simple command of an example is wrong, or None."""
    argv = bigbatch_words(words)
    if argv is not None:
        return parse_bigbatch(argv)
    program, rest = words[0], words[1:]
    if program == "torchrun":
        return parse_torchrun(rest)
    if program == "make":
        unknown = [t for t in rest if "=" not in t and t not in make_targets()]
        return f"no Makefile target {unknown}" if unknown else None
    if program in ("pip", "pip3") and rest[:2] == ["install", "-e"]:
        extras = [e for word in rest[2:] for e in re.findall(r"\[([^\]]*)\]", word) for e in e.split(",")]
        unknown = [e for e in extras if e not in pip_extras()]
        return f"no extra {unknown} in pyproject.toml" if unknown else None
    if program in PIPE_READERS:
        return None
    return f"a command of {program!r}: this test does not know how to check it (add it to check_command)"


def check_synopsis(example: Example) -> str | None:
    """Why a synopsis names a command, flag or choice the program does not have, or None."""
    from bigbatch.cli.app import build_parser

    words = shlex.split(example.text.replace("\\|", "|"))
    argv = bigbatch_words(words)
    if argv is None:  # torchrun: its flags
        from torch.distributed.run import get_args_parser

        argv, parser = words, get_args_parser()
    else:
        subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
        if not argv or argv[0].startswith("-"):
            return None
        if argv[0] not in subcommands:
            return f"no command {argv[0]!r}"
        parser = subcommands[argv[0]]
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    for at, word in enumerate(argv[1:], 1):
        flag = word.strip("[]").split("=")[0]
        if not flag.startswith("--"):
            continue
        if flag not in actions:
            return f"{argv[0]} has no flag {flag}"
        choices = actions[flag].choices
        if choices is not None and at + 1 < len(argv):
            listed = [v for v in argv[at + 1].strip("[]").split("|") if v and not re.fullmatch(r"[A-Z_:]+", v)]
            wrong = [v for v in listed if v not in choices]
            if wrong:
                return f"{flag} takes none of {wrong} (choices: {', '.join(map(str, choices))})"
    return None


def problems(example: Example) -> list[str]:
    if is_synopsis(example):
        problem = check_synopsis(example)
        return [problem] if problem else []
    return [problem for words in commands(example.text) if (problem := check_command(words))]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_example_parses(page: Path) -> None:
    wrong = [f"{example.where()}\n    {p}" for example in examples(page) for p in problems(example)]
    assert not wrong, "command examples the program refuses:\n" + "\n".join(wrong)


# --- which examples run, and which do not -----------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """An example run here, in a temporary directory, and what the docs claim it prints."""

    exit_code: int = 0
    quote: tuple[str, str] | None = None  # (page, the start of its ```text block that shows this output)
    prints: tuple[str, ...] = ()  # claims made in prose beside it, as patterns its output must match
    slow: bool = False  # over a second on a quiet 2-core machine


RUNS: dict[str, Run] = {
    "bigbatch plan --tokens-per-step 16384": Run(quote=("docs/sizing.md", "seq_len 256 (the nano model's block size)")),
    "bigbatch plan --tokens-per-step 2M --seq-len 4096 --devices 8 --micro-batch 16 --model gpt2": Run(
        exit_code=2, quote=("docs/sizing.md", "bigbatch: error: --tokens-per-step 2,000,000")
    ),
    "bigbatch plan --tokens-per-step 2Mi --seq-len 4096 --devices 8 --micro-batch 16 --model gpt2": Run(
        prints=(r"tokens per step\s+2,097,152\n", r"accumulation steps \(K\)\s+4\n")  # "plans K=4"
    ),
    "bigbatch train --total-batch-tokens 65536 --micro-batch 12 --seq-len 128": Run(
        exit_code=2, quote=("docs/sizing.md", "bigbatch: error: total_batch_tokens=65,536")
    ),
    "bigbatch plan --tokens-per-step 16384 --seq-len 256 --micro-batch 16 --batch-ramp 4Ki:500K": Run(
        quote=("docs/noise-scale.md", "batch ramp: 4,096 -> 16,384")
    ),
    "bigbatch train --help": Run(prints=(r"--total-batch-tokens INT",)),
    "bigbatch plan --tokens-per-step 512Ki --seq-len 1024 --micro-batch 16 --model gpt2 --optimizer muon": Run(
        prints=(  # docs/optimizers.md: "1.6 TFLOP, 0.36%"; one buffer per hidden-matrix weight, two for the rest
            r"Muon \+ AdamW state \(1 buffer per matrix weight, 2 else\)\s+625\.7 MiB",
            r"Newton-Schulz per step \(5 iterations\)\s+1,630\.75 GFLOP, 0\.36% of the step's training FLOPs",
        )
    ),
    "bigbatch verify --model moe-pico": Run(prints=(r"verdict: EQUIVALENT",), slow=True),  # "is EQUIVALENT with exact"
    "bigbatch verify --model pico --objective dpo --seq-len 32": Run(
        prints=(r"term dpo\s+split empty", r"negative control .* differs, as it must", r"verdict: EQUIVALENT")
    ),
}
"""The examples that run here in seconds, keyed by the command as the docs write it."""

EXEMPT: list[tuple[str, str]] = [
    (r"^make ", "the set-up and the test suite themselves (each target is checked to exist in the Makefile)"),
    (r"^pip install ", "installs packages (each extra is checked to exist in pyproject.toml)"),
    (r"^torchrun --nnodes 2 --nproc-per-node 8|^srun ", "two machines of 8 GPUs, or a SLURM allocation"),
    (r"^torchrun --nnodes 2 --nproc-per-node 1", "two torchrun agents rehearsing two machines: two shells"),
    (r"--nproc|^torchrun --standalone", "several processes or GPUs: tests/integration launches torchrun itself"),
    (r"my-chat-model", "the reader's own Hugging Face model directory, and runs trained from it"),
    (r"hf:json:|\bSOURCE\b", "the reader's own data"),
    (r"runs/<run>|runs/nano-<hash>|\bRUN\b", "needs a trained run: the demo's takes minutes"),
    (r"^bigbatch train ", "trains a model: the demo's run takes minutes (its flags resolve into a config here)"),
    (r"--factory", "a factory in the reader's own package (mypkg, yourpkg)"),
    (r"^bigbatch verify --model gpt2", "GPT-2 124M's gradients, full and accumulated, on a CPU: minutes"),
    (r"^bigbatch verify( --packed| --lora-rank \S+| --optimizer muon)?$", "nano at GPT-2's vocabulary: 26 s of CPU"),
    (r"^bigbatch verify --model llama-nano --packed", "Llama nano, packed: 9 s of CPU"),
    (
        r"^bigbatch verify --model nano --objective",
        "nano's terms at GPT-2's vocabulary under four splits: 10 s of CPU (grpo's five aggregations: 47 s)",
    ),
    (r"^bigbatch memory", "a fresh process per micro-batch size: a minute or more"),
    (r"--measure", "measures GPT-2's micro-step on this machine: minutes on a CPU"),
]
"""(pattern, why it does not run here): the first row whose pattern an example matches (re.search) exempts it."""


def exemption(example: Example) -> str | None:
    return next((reason for pattern, reason in EXEMPT if re.search(pattern, example.text)), None)


def full_examples() -> list[Example]:
    """The examples that are command lines (not synopses) holding at least one command."""
    return [e for e in all_examples() if not is_synopsis(e) and commands(e.text)]


def test_every_example_runs_or_is_exempt() -> None:
    unclassified = [e.where() for e in full_examples() if e.text not in RUNS and exemption(e) is None]
    assert unclassified == [], "add each to RUNS (when it runs in seconds) or to EXEMPT with the reason"


def test_every_run_and_exemption_names_an_example() -> None:
    """A stale entry (the docs' example changed) would silently stop checking it."""
    texts = {e.text for e in full_examples()}
    assert sorted(set(RUNS) - texts) == [], "RUNS entries no page holds as an example"
    unused = [pattern for pattern, _ in EXEMPT if not any(re.search(pattern, text) for text in texts - set(RUNS))]
    assert unused == [], "EXEMPT rows that exempt nothing"


def quoted_block(page: str, start: str) -> str:
    """The ```text block of ``page`` that begins with ``start``."""
    blocks = re.findall(r"^```text\n(.*?)^```", (ROOT / page).read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    found = [block for block in blocks if block.startswith(start)]
    assert len(found) == 1, f"{page} has {len(found)} ```text blocks starting {start!r}"
    return found[0]


def quoted_matches(quoted: str, printed: str) -> bool:
    """Whether ``printed`` holds what the docs quote: whitespace collapsed on both sides (the docs wrap long lines
    and align columns their own way) and each ``...`` of the quote standing for anything."""
    pieces = [re.escape(" ".join(piece.split())) for piece in quoted.split("...")]
    return re.search(".*?".join(pieces), " ".join(printed.split())) is not None


def run_params() -> list[object]:
    return [pytest.param(text, marks=[pytest.mark.slow] if run.slow else []) for text, run in RUNS.items()]


@pytest.mark.usefixtures("isolated")
@pytest.mark.parametrize("text", run_params())
def test_example_prints_what_the_docs_say(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from bigbatch.cli.app import main

    run = RUNS[text]
    threads = torch.get_num_threads()
    # one thread: these models are too small to gain from two, and on a busy machine two threads wait on each other
    # (verify on moe-pico: 4.6 s of CPU on one, 13 s on two, with other work on both cores)
    torch.set_num_threads(1)
    try:
        code = main(shlex.split(text)[1:])
    except SystemExit as exc:  # --help
        code = int(exc.code or 0)
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert code == run.exit_code, f"{text}: exit {code}, not {run.exit_code}\n{printed}"
    missing = [pattern for pattern in run.prints if not re.search(pattern, printed)]
    assert missing == [], f"{text} printed\n{printed}"
    if run.quote:
        quoted = quoted_block(*run.quote)
        assert quoted_matches(quoted, printed), f"{run.quote[0]} quotes\n{quoted}\nbut {text} printed\n{printed}"


def test_quoted_output_allows_wrapping_and_elision() -> None:
    printed = "tokens per step      16,384\nmicro-batch (B)  16\nnote: derived: K (from the budget)\n"
    assert quoted_matches("tokens per step 16,384\n...\nnote: derived: K (...)", printed)
    assert quoted_matches("micro-batch\n(B) 16", printed)
    assert not quoted_matches("tokens per step 16,385", printed)
    assert not quoted_matches("micro-batch (B) 16\n...\ntokens per step", printed)  # order counts


def test_extraction_finds_blocks_spans_and_continuations(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `bigbatch plan\n--tokens-per-step 8` or `--k 2` alone.\n\n"
        "```bash\nbigbatch train --max-steps 2 \\\n  --seed 1   # a comment\n\n# only a comment\n```\n\n"
        "```text\nbigbatch train --not-an-example\n```\n",
        encoding="utf-8",
    )
    found = [(e.line, e.text, e.inline) for e in examples(page)]
    assert found == [
        (1, "bigbatch plan --tokens-per-step 8", True),
        (5, "bigbatch train --max-steps 2 --seed 1", False),
    ]


def test_a_refused_example_is_named_with_its_reason() -> None:
    example = Example(ROOT / "README.md", 7, "bigbatch train --k 8 | head -3", inline=False)
    assert [p.split(":")[0] for p in problems(example)] == ["bigbatch train does not take --k"]
    assert problems(Example(ROOT / "README.md", 7, "bigbatch plan --tokens 8", inline=True))
    assert problems(Example(ROOT / "README.md", 7, "bigbatch eval RUN [--split val|test]", inline=True))
    assert problems(Example(ROOT / "README.md", 7, "make no-such-target", inline=False))
    assert problems(Example(ROOT / "README.md", 7, "bigbatch train --batch-ramp 4K-500K", inline=False))


# --- Python the docs name ---------------------------------------------------------------------------------------

IMPORT = re.compile(r"^\s*from (bigbatch[\w.]*) import ([\w, ()]+?)\s*(?:#.*)?$", re.MULTILINE)
CALL = re.compile(r"`(bigbatch(?:\.\w+)+)\(")  # `bigbatch.models.save_hf_gpt2(model, DIR)`


def test_every_import_the_docs_show_imports() -> None:
    """``from bigbatch.X import Y`` in the docs' code, inline or in a block: X imports and holds Y; a function named
    by its dotted path (``bigbatch.models.save_hf_gpt2(...)``) is there."""
    import importlib

    wrong = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for match in IMPORT.finditer(text.replace("`", "\n")):
            module = importlib.import_module(match.group(1))
            for name in match.group(2).strip("()").split(","):
                if name.strip() and not hasattr(module, name.strip()):
                    wrong.append(f"{page.relative_to(ROOT)}: from {match.group(1)} import {name.strip()}")
        for match in CALL.finditer(text):
            module_name, _, name = match.group(1).rpartition(".")
            if not hasattr(importlib.import_module(module_name), name):
                wrong.append(f"{page.relative_to(ROOT)}: {match.group(1)}")
    assert wrong == []
