"""Command-line interface: ``bigbatch prepare | train | sample | plan | memory | verify | report | export | eval
| critical-batch``.

One module per command (:data:`bigbatch.cli.app.COMMANDS`), each with ``add_arguments(parser)`` and
``run(args)``: the CLI only parses arguments and calls the library, which ``run`` imports when it runs, so
``bigbatch --help`` does not import torch. User errors (:class:`~bigbatch.errors.BigBatchError`) become one
line on stderr and exit code 2 (:func:`main`).
"""

from bigbatch.cli.app import COMMANDS, EXIT_BROKEN_PIPE, EXIT_USER_ERROR, CommandParser, UsageError, build_parser, main
from bigbatch.cli.output import CurrentStdoutHandler, out_of_memory, silence_stdout

__all__ = [
    "COMMANDS",
    "EXIT_BROKEN_PIPE",
    "EXIT_USER_ERROR",
    "CommandParser",
    "CurrentStdoutHandler",
    "UsageError",
    "build_parser",
    "main",
    "out_of_memory",
    "silence_stdout",
]
