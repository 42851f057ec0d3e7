"""``bigbatch train --nproc N`` and its workers live and die together.

The launcher runs torchrun's agent, which runs the workers. Killing the launcher, even with SIGKILL (which no
process can catch), must not leave workers running and writing checkpoints, so each side watches the other:

* the launcher starts the agent with ``PR_SET_PDEATHSIG = SIGKILL`` (Linux): the kernel kills the agent the
  moment the launcher dies;
* the launcher's pid travels to the workers in ``BIGBATCH_LAUNCHER_PID``; each worker watches it, and its own
  parent (the agent), from a daemon thread blocked on a pidfd (polling where pidfds are missing) and SIGKILLs
  itself as soon as either is gone, so it writes nothing more.

Polite stops still work: the agent runs in its own session, and the launcher forwards SIGINT/SIGTERM to it
once (the agent asks the workers to stop with SIGTERM: they finish the step, save and exit); a second signal
(a second apart or more: a double tap is one press) kills the agent, and with it the workers, at once.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

from bigbatch.parallel.signals import REPEAT_GRACE_SECONDS

LAUNCHER_ENV = "BIGBATCH_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.2


def _parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A function that asks the kernel to send ``sig`` to the calling process when its parent dies (Linux),
    resolved before any fork so that the child only makes one libc call; ``None`` where unavailable."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return arm


def run_supervised(command: Sequence[str]) -> int:
    """Run ``command`` (torchrun's agent) so that it dies with this process; return its exit code."""
    launcher = os.getpid()
    arm = _parent_death_signal(signal.SIGKILL)

    def preexec() -> None:  # in the child, between fork and exec
        if arm is not None:
            arm()
        if os.getppid() != launcher:  # the launcher died before the death signal was armed
            os._exit(1)

    env = {**os.environ, LAUNCHER_ENV: str(launcher)}
    agent = subprocess.Popen(list(command), env=env, preexec_fn=preexec, start_new_session=True)
    forwarded: list[tuple[int, float]] = []  # (signal, when)

    def forward(signum: int, frame: FrameType | None) -> None:
        if not forwarded:
            agent.send_signal(signum)
        elif time.monotonic() - forwarded[0][1] >= REPEAT_GRACE_SECONDS:  # a second request: stop now
            agent.kill()  # the workers die with the agent
        else:
            return  # a double tap of the first request
        forwarded.append((signum, time.monotonic()))

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = agent.wait()
        if forwarded and code != 0:  # torchrun ends with 1 after a stop request: report the request itself
            return 128 + forwarded[0][0]
        return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if agent.poll() is None:  # an exception in this process: take the agent (and the workers) down with it
            agent.kill()


def watch_parents() -> threading.Thread | None:
    """In a torchrun worker: SIGKILL this process as soon as the launcher (``BIGBATCH_LAUNCHER_PID``) or the
    worker's parent (torchrun's agent) is gone. Returns the watching thread, or ``None`` when not a worker."""
    pids = []
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit():
        pids.append(int(launcher))
    if "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() > 1:
        pids.append(os.getppid())
    if not pids:
        return None
    thread = threading.Thread(target=_watch, args=(pids,), name="bigbatch-lifeline", daemon=True)
    thread.start()
    return thread


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(pids: list[int]) -> None:
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            _die()
        except (AttributeError, OSError):  # no pidfds here (old kernel, not Linux): poll instead
            fds = []
            break
    if fds:
        select.select(fds, [], [])  # a pidfd becomes readable when its process exits
        _die()
    parent = os.getppid()
    while True:
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                _die()
            except PermissionError:
                pass
        if os.getppid() != parent:
            _die()
        time.sleep(POLL_SECONDS)
