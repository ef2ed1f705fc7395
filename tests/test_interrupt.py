"""Stop signals become one exception that names them: real signals sent to this process."""
from __future__ import annotations

import os
import signal

import pytest

from pilotrun.interrupt import Interrupted, as_interrupted, interruptible


def test_a_repeated_sigterm_does_not_cut_the_recording_short_but_a_second_ctrl_c_does():
    recorded = []
    with interruptible():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()  # the handler raises before this returns
        except Interrupted as stop:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's second SIGTERM while the end is being written
            recorded.append(stop.name)
        with pytest.raises(Interrupted) as again:
            os.kill(os.getpid(), signal.SIGINT)  # a person's Ctrl-C still breaks out of a hung clean-up
            signal.pause()
    assert recorded == ["SIGTERM"] and again.value.how == "Ctrl-C" and again.value.exit_code == 130


def test_a_plain_keyboard_interrupt_is_ctrl_c():
    stop = as_interrupted(KeyboardInterrupt())
    assert (stop.name, stop.how, stop.exit_code) == ("SIGINT", "Ctrl-C", 130)
    assert Interrupted(signal.SIGTERM).exit_code == 143
