"""ppo_ray/driver/interrupts.py: a stop signal that Python dropped still stops the run at the driver's
next call to an actor (the supervisor asks before each attempt). Whole launch.py runs stopped
by one signal: tests/test_launch.py (SIGINT, inherited ignored), tests/test_launch_sigterm.py."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from ppo_ray.driver.interrupts import raise_if_stopped, stop_on_signals
from ppo_ray.driver.supervisor import Supervisor
from helpers import FakeMetrics, FakeRoles


class _SignalledWhileFinalized:
    """An object whose finalizer receives `signum` (the handler runs inside __del__, where
    Python prints an exception and drops it)."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)
        for _ in range(3):  # bytecodes still inside __del__: the handler runs here at the latest
            pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_dropped_in_a_finalizer_stops_the_next_actor_call(monkeypatch, signum):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    supervisor = Supervisor(FakeRoles(), FakeMetrics(), max_retries=2)
    attempts = []
    with stop_on_signals():
        _SignalledWhileFinalized(signum)  # collected at once: its KeyboardInterrupt is dropped
        assert dropped == [KeyboardInterrupt]  # Python's rule, which the recorded signal answers
        with pytest.raises(KeyboardInterrupt, match=signal.Signals(signum).name):
            supervisor.run(attempts.append, where="evaluation", step=3, recover=lambda: None)
    assert attempts == []  # no actor was called
    raise_if_stopped()  # handled: outside stop_on_signals nothing is pending


def test_stop_on_signals_puts_the_previous_handlers_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals():
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is not before[signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before
