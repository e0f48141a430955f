"""`staging.sigterm_raises`: a SIGTERM during a checkpoint write ends the block in SystemExit(143), also when the
handler's SystemExit never reaches the block (Python prints and drops an exception raised in a finalizer, such as a
WeakKeyDictionary's remove callback, and a library may swallow it)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_omni.checkpoint.staging import sigterm_raises


def test_a_dropped_sigterm_still_ends_the_block_in_system_exit() -> None:
    finished = []
    with pytest.raises(SystemExit) as stopped:
        with sigterm_raises():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # the handler runs between bytecodes of the main thread
            except SystemExit:
                pass  # what a finalizer or a swallowing library does with it
            finished.append(True)
    assert finished == [True] and stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_block_without_a_signal_ends_normally() -> None:
    with sigterm_raises():
        pass
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
