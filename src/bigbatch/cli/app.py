"""The command table, the parser built from it, and :func:`main`: how every command's result, user error,
closed pipe, signal or exhausted memory becomes an exit code (and at most one line on stderr)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from bigbatch import __version__
from bigbatch.cli import critical_batch, evaluate, export, memory, plan, prepare, report, sample, train, verify
from bigbatch.cli.output import CurrentStdoutHandler, out_of_memory, out_of_memory_advice, silence_stdout
from bigbatch.errors import EXIT_USER_ERROR, BigBatchError, did_you_mean
from bigbatch.parallel.launch import peer_exit_code, record_quiet_exit, record_user_error

EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a writer ended by a closed pipe

COMMANDS: dict[str, ModuleType] = {
    "prepare": prepare,
    "train": train,
    "sample": sample,
    "plan": plan,
    "memory": memory,
    "verify": verify,
    "report": report,
    "export": export,
    "eval": evaluate,
    "critical-batch": critical_batch,
}
"""Each command's module: ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> exit code``.
A module imports only what its parser needs; ``run`` imports the library (torch) when it runs."""


class UsageError(BigBatchError):
    """A command line that does not parse: reported like every user error (one line, exit 2)."""


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a usage error is one line (the usage of ``train`` alone is dozens), with a pointer to
    ``--help`` and, for a mistyped choice, the nearest one, and exit code 2 as for every user error."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            message += did_you_mean(choice[1], re.findall(r"'([^']*)'", choice[2]))
        raise UsageError(f"{message} (see {self.prog} --help)")


class TopParser(CommandParser):
    """``bigbatch`` itself: a mistyped command is one line naming the nearest (``trian``: did you mean train?);
    no command at all prints the usage, the list of commands."""

    def error(self, message: str) -> Any:
        if "invalid choice" in message:
            return super().error(message)
        return argparse.ArgumentParser.error(self, message)


def unknown_flag(
    parser: argparse.ArgumentParser, words: list[str], refused: dict[str, str] | None = None
) -> UsageError | None:
    """The one line for the first ``--flag`` in ``words`` that ``parser`` does not take, naming the nearest known
    one as git does: ``unknown flag --mciro-batch; did you mean --micro-batch?``. Only a whole flag is taken: a
    prefix (``--k`` of ``--keep-checkpoints``) would silently mean another flag. ``refused``: flags other commands
    take that this one refuses with its own advice (train's ``--k``). Found before parsing, so a mistyped flag is
    named before a missing one."""
    flags = [name for action in parser._actions for name in action.option_strings if name.startswith("--")]
    for word in words:
        if word == "--":  # what follows is positional
            break
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        if flag in flags:
            continue
        if refused and flag in refused:
            return UsageError(f"{parser.prog} does not take {flag}: {refused[flag]}")
        longer = [known for known in flags if known.startswith(flag)]  # what an abbreviation would have meant
        hint = f"; did you mean {' or '.join(longer[:3])}?" if longer else did_you_mean(flag, flags)
        return UsageError(f"unknown flag {flag}{hint} (see {parser.prog} --help)")
    return None


def build_parser() -> CommandParser:
    parser = TopParser(
        prog="bigbatch",
        allow_abbrev=False,  # a prefix of a flag is never taken for it (see unknown_flag)
        description="Train GPT-style models with exact gradient accumulation: the update of a huge batch "
        "on a machine that holds only a small one.",
    )
    parser.add_argument("--version", action="version", version=f"bigbatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    commands.required = True
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION or None, allow_abbrev=False)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.run)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, raw: list[str]) -> argparse.Namespace:
    """``raw`` parsed; :class:`UsageError` for anything the command does not take, naming the nearest flag."""
    subcommands: dict[str, argparse.ArgumentParser] = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr, assignment]
    at = next((i for i, word in enumerate(raw) if word in subcommands), None)
    if at is not None:
        refusal = unknown_flag(subcommands[raw[at]], raw[at + 1 :], getattr(COMMANDS[raw[at]], "REFUSED_FLAGS", None))
        if refusal is not None:
            raise refusal
    return parser.parse_args(raw)


def broken_collective(exc: BaseException) -> str | None:
    """What a failed collective (a peer that died or hung past --collective-timeout) says, in one line; ``None``
    for any other error."""
    import torch.distributed as dist

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not isinstance(exc, dist.DistError) and "gloo" not in text and "NCCL" not in text:
        return None
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[source.cc:129] " prefix
    return f"a collective failed ({cause}): a peer process died or hung past --collective-timeout"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_command_line(parser, raw)
    except UsageError as exc:
        print(f"bigbatch: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    args.argv = raw[1:]  # after the subcommand
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 speaks
    if "RANK" in os.environ:
        from bigbatch.parallel.lifeline import watch_parents

        watch_parents()  # a worker dies with its launcher and its torchrun agent
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handler = CurrentStdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    from bigbatch.parallel.signals import Terminated, sigterm_unwinds

    def user_error(message: str) -> int:
        """One line from one process: under bigbatch's launcher it prints the first rank's; else rank 0."""
        recorded = world > 1 and record_user_error(message)
        if rank == 0 and not recorded:
            print(f"bigbatch: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR

    try:
        with sigterm_unwinds():
            return int(args.handler(args))
    except BigBatchError as exc:
        return user_error(str(exc))
    except BrokenPipeError:  # the reader of our output went away (| head): end quietly, as a pipe's writer does
        silence_stdout()
        if world > 1:
            record_quiet_exit(EXIT_BROKEN_PIPE)
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # disk full, permissions, a file where a directory should be
        where = f": {exc.filename}" if exc.filename else ""
        print(
            f"bigbatch: error: {exc.strerror or exc}{where}; check the path, its permissions and free space",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    except Terminated:
        print("bigbatch: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("bigbatch: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = peer_exit_code() if world > 1 else None
        if code is not None:  # a broken collective after a peer's user error or closed pipe: not news
            return code
        if out_of_memory(exc):  # the settings asked for more than there is
            return user_error(f"out of memory: {out_of_memory(exc)}; {out_of_memory_advice(args.command)}")
        broken = broken_collective(exc) if world > 1 else None
        if broken:  # a peer died or hung: this rank's one line; torchrun's agent restarts or ends the job
            print(f"bigbatch: error: rank {rank}: {broken}", file=sys.stderr)
            return 1
        raise
