"""``python tests/support/no_network.py ARGS``: bigbatch's CLI with an audit hook that reports on stderr every
attempt to reach the Internet (a DNS look-up or an IP connect), as ``NETWORK: ...`` lines; nothing is blocked."""

from __future__ import annotations

import socket
import sys
from typing import Any


def _report(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.getaddrinfo":
        print(f"NETWORK: look-up of {args[0]}:{args[1]}", file=sys.stderr, flush=True)
    elif event == "socket.connect" and getattr(args[0], "family", None) in (socket.AF_INET, socket.AF_INET6):
        print(f"NETWORK: connect to {args[1]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.addaudithook(_report)
    from bigbatch.cli import main

    raise SystemExit(main(sys.argv[1:]))
