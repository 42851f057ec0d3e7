"""Which handler SIGTERM reaches decides what a closed output pipe does: stop politely only inside the loop."""

from __future__ import annotations

import signal

from bigbatch.parallel.signals import StopRequest, listening_stop_request, sigterm_unwinds


def test_only_the_training_loop_listens_for_a_polite_stop() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert listening_stop_request() is None
    with sigterm_unwinds():  # what the CLI installs around every command: SIGTERM unwinds, it does not stop politely
        assert callable(signal.getsignal(signal.SIGTERM)) and listening_stop_request() is None
        with StopRequest() as stop:
            assert listening_stop_request() is stop
        assert listening_stop_request() is None
    assert signal.getsignal(signal.SIGTERM) == before
