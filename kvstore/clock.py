"""Injectable wall clocks.

Expiry is a wall-clock time (seconds since the epoch) because it must survive restarts of the
process and of the machine. Every component that reads the time takes a ``Clock``; tests pass a
:class:`FakeClock` and move it forward instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]
"""A callable returning the current wall-clock time in seconds since the epoch."""

system_clock: Clock = time.time


class FakeClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock cannot move backwards (asked for {seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, now: float) -> None:
        with self._lock:
            self._now = float(now)
