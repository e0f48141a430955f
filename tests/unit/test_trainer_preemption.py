"""StopRequests: the first signal asks to stop after the step, a repeat within the window (Ctrl-C under
torchrun arrives from the terminal and again from torchrun) is the same request, a later one aborts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_omni.trainer.preemption import REPEAT_WINDOW_S, StopRequests


def test_a_repeat_inside_the_window_is_one_request_and_a_later_signal_aborts() -> None:
    # What was installed before (Python's default, or SIG_IGN in a shell's background job) comes back.
    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stops:
        assert not stops.requested()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the torchrun-forwarded copy: must not abort
        assert stops.requested() and stops.signame == "SIGINT"
        time.sleep(REPEAT_WINDOW_S + 0.2)
        with pytest.raises(SystemExit) as aborted:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs between bytecodes of the main thread
    assert aborted.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is before, "the previous handler is restored"
