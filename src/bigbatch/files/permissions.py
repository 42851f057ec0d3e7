"""File modes: what bigbatch writes gets the permissions the user's umask gives, as ``open()`` would.

``tempfile.mkstemp`` creates 0600 files and ``mkdtemp`` 0700 directories, whatever the umask; files written
that way and renamed into place (checkpoints, exports, prepared datasets) are set to ``0666 & ~umask``
(directories ``0777 & ~umask``) before the rename.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def apply_umask(target: Path | str | int, directory: bool = False) -> None:
    """Give ``target`` (a path, or an open file descriptor) the mode a plain ``open``/``mkdir`` would have."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)
