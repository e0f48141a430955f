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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_abort_swallowed_by_a_callback_is_delivered_again() -> None:
    """Python only reports ("Exception ignored") a SystemExit raised inside a weakref or at-fork callback; a
    checkpoint writer's fork runs logging's at-fork callbacks, so the abort can land there. It must still end
    the run, with the second signal's exit code."""
    import sys
    import weakref

    class _Object:
        pass

    before = sys.unraisablehook
    with pytest.raises(SystemExit) as aborted, StopRequests() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stops.requested()
        stops._first_at -= REPEAT_WINDOW_S  # the second signal comes later than the repeat window

        def _callback(_ref: object) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the callback, and swallowed
            time.sleep(0.01)

        obj = _Object()
        ref = weakref.ref(obj, _callback)
        del obj
        assert ref() is None, "the callback has run and the run goes on"
        for _ in range(300):  # re-delivered within about 0.05 s
            time.sleep(0.01)
    assert aborted.value.code == 128 + signal.SIGINT
    assert sys.unraisablehook is before, "the previous hook is restored"
