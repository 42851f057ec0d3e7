"""Which handler SIGTERM reaches decides what a closed output pipe does: stop politely only inside the loop."""

from __future__ import annotations

import signal

from bigbatch.signals import StopRequest, polite_stop_listening, sigterm_unwinds


def test_only_the_training_loop_listens_for_a_polite_stop() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert not polite_stop_listening()
    with sigterm_unwinds():  # what the CLI installs around every command: SIGTERM unwinds, it does not stop politely
        assert callable(signal.getsignal(signal.SIGTERM)) and not polite_stop_listening()
        with StopRequest():
            assert polite_stop_listening()
        assert not polite_stop_listening()
    assert signal.getsignal(signal.SIGTERM) == before
