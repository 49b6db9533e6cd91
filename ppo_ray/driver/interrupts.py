"""Stopping a run from outside: one Ctrl-C (SIGINT) or one SIGTERM (`ray job stop`, `kill PID`)
raises KeyboardInterrupt in the driver, which unwinds (the actors shut down; the last
checkpoint, written atomically, stays the latest and resumable).

Ways one signal could go unnoticed, and what answers each:
- SIGINT inherited as ignored. A shell without job control starts `cmd &` with SIGINT (and
  SIGQUIT) ignored (POSIX), as a CI script or a backgrounded job does, and Python installs
  its KeyboardInterrupt handler only where SIGINT is at its default: the Ctrl-C would be
  ignored. `stop_on_signals` installs the handler whatever the process inherited.
- ray.init replaces SIGTERM's handler with its own (sys.exit after a stack dump):
  ppo_ray.driver.cluster.init_ray puts the caller's SIGINT and SIGTERM handlers back.
- A KeyboardInterrupt raised where Python drops it. A signal handler runs between any two
  bytecodes of the main thread, finalizers (__del__, weakref callbacks) included, and an
  exception raised in a finalizer is printed ("Exception ignored in ...") and dropped. So the
  handler also records the signal, and `raise_if_stopped`, which ppo_ray.driver.supervisor calls
  before every call the driver makes to an actor, raises it again.
A handler only ever runs in the main thread, so no Ray callback or thread can swallow it; a
signal that arrives while ray.get waits comes out of ray.get as the KeyboardInterrupt, and
neither Ray nor vLLM installs a SIGINT handler in the driver (tests/test_launch.py presses
once, mid-run, on a launch.py that inherited SIGINT ignored).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # signals received while stop_on_signals is active (main thread)


def _stop(signum: int, frame) -> None:
    _received.append(signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, whatever handler
    or disposition the process had (an inherited "ignored" included), and are recorded for
    raise_if_stopped. The previous handlers come back on exit. Outside the main thread (where
    Python allows no handler) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, _stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            # None: a handler not installed from Python; the default is the closest
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        _received.clear()


def raise_if_stopped() -> None:
    """KeyboardInterrupt if a stop signal arrived (stop_on_signals) and the run still goes: its
    own KeyboardInterrupt was lost on the way."""
    if _received:
        raise KeyboardInterrupt(f"{signal.Signals(_received[0]).name} (received earlier; its KeyboardInterrupt "
                                "was dropped on the way)")
