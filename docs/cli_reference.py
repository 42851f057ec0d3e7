"""Write docs/cli.md, the command-line reference, from the parser's own ``--help`` text.

    python docs/cli_reference.py            # rewrite docs/cli.md
    python docs/cli_reference.py --check    # exit 1 when docs/cli.md differs from what the parser says

The parser is :func:`bigbatch.cli.build_parser`, which imports no torch. Help text is wrapped at a fixed width,
so the page does not depend on the terminal it was generated in.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "cli.md"
WIDTH = 100  # columns the help text is wrapped at

INTRO = """\
# Command-line reference

Generated from `bigbatch --help` and each command's `--help` by
[`cli_reference.py`](cli_reference.py): do not edit by hand. After changing a
flag, run `python docs/cli_reference.py`; `python docs/cli_reference.py --check`
exits 1 while this page is stale (`tests/unit/test_docs.py` runs the check).

How the flags of `train` map onto config fields and TOML keys, and what the
main ones mean, is in [configuration.md](configuration.md).
"""


def _fixed_width(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)  # type: ignore[assignment]
    return parser


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    """The page: the top-level help, then each command's, in the order of the command table."""
    from bigbatch.cli import build_parser

    parser = _fixed_width(build_parser())
    commands = _commands(parser)
    parts = [INTRO, "Commands: " + ", ".join(f"[`{name}`](#bigbatch-{name})" for name in commands) + ".\n"]
    parts.append(f"## bigbatch\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    for name, sub in commands.items():
        help_text = _fixed_width(sub).format_help().rstrip()
        parts.append(f"## bigbatch {name}\n\n```text\n{help_text}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale; write nothing")
    check = args.parse_args(argv).check
    page = render()
    current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if check:
        if current != page:
            print(f"{PAGE} is stale: run python docs/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    if current != page:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
