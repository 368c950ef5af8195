"""A daemon client behind a circuit breaker: the cache never breaks the engine.

While the daemon answers, calls go through. The first call that finds it unreachable (refused,
reset, or slower than the client's timeout) opens the breaker: from then on every call returns
its fallback at once (a lookup answers "no hit", a load fails and is recomputed, a save is
dropped), with no connection attempt and no retry delay. A background thread tries to reconnect
after ``backoff_s``, doubling up to ``max_backoff_s``; the first success closes the breaker and
hits resume by themselves.

An error the daemon *answered* (a missing prefix, a quota) is the caller's to handle and does
not open the breaker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.errors import DaemonUnavailableError, KVStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")

DOWN_ERRORS: tuple[type[BaseException], ...] = (DaemonUnavailableError, OSError)
"""What says the daemon is unreachable (the client raises DaemonUnavailableError for a lost
connection or a timeout; OSError covers a socket error raised before the client wraps it)."""


@dataclass(slots=True)
class BreakerCounters:
    calls: int = 0
    failures: int = 0
    """Calls that found the daemon unreachable (each opens the breaker)."""
    short_circuited: int = 0
    """Calls answered with the fallback at once because the breaker was open."""
    opened: int = 0
    reconnects: int = 0
    probes: int = 0


class DaemonLink(Generic[C]):
    """``make_client()`` builds a connected client (raising a DOWN error when it cannot);
    ``on_connect(client)`` runs after each new connection (register namespaces).

    ``clock`` (monotonic seconds) decides when a probe is due; the background thread sleeps
    until then. Tests pass ``start_thread=False`` and call :meth:`probe` themselves.
    """

    def __init__(
        self,
        make_client: Callable[[], C],
        *,
        name: str = "kvstore",
        on_connect: Callable[[C], None] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        start_thread: bool = True,
    ) -> None:
        self.name = name
        self._make = make_client
        self._on_connect = on_connect
        self._clock = clock
        self._backoff0 = backoff_s
        self._max_backoff = max_backoff_s
        self._backoff = backoff_s
        self._lock = threading.Lock()
        self._client: C | None = None
        self._open = True  # closed only once a client is connected
        self._next_probe = clock()
        self._wake = threading.Event()
        self._stop = False
        self.counters = BreakerCounters()
        self.refused = ""
        """The daemon's last refusal of a (re)connection (empty: none)."""
        self._thread: threading.Thread | None = None
        self.probe()
        if start_thread:
            self._thread = threading.Thread(target=self._run, name=f"{name}-reconnect", daemon=True)
            self._thread.start()

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def client(self) -> C | None:
        return None if self._open else self._client

    def call(self, fn: Callable[[C], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` at once while the breaker is open or when the call
        finds the daemon unreachable (which opens it)."""
        self.counters.calls += 1
        client = self._client
        if self._open or client is None:
            self.counters.short_circuited += 1
            return fallback
        try:
            return fn(client)
        except DOWN_ERRORS as e:
            self.trip(e)
            return fallback

    def trip(self, err: BaseException) -> None:
        """Open the breaker after a failure; the next probe is ``backoff`` from now."""
        with self._lock:
            self.counters.failures += 1
            if self._open:
                return
            self._open = True
            self.counters.opened += 1
            self._next_probe = self._clock() + self._backoff
        log.warning(
            "%s: daemon unreachable (%s); answering 'no hit' and dropping saves until it is back "
            "(next try in %.1f s)", self.name, err, self._backoff,
        )
        self._wake.set()

    def probe_due(self) -> bool:
        return self._open and self._clock() >= self._next_probe

    def probe(self) -> bool:
        """Try to (re)connect now; True when the breaker is closed afterwards."""
        if not self._open:
            return True
        self.counters.probes += 1
        try:
            client = self._client
            if client is None:
                client = self._make()
            else:
                client.health()  # type: ignore[attr-defined]
            if self._on_connect is not None:
                self._on_connect(client)
        except DOWN_ERRORS as e:
            self._retry_later()
            log.debug("%s: reconnect failed (%s); next try in %.1f s", self.name, e, self._backoff)
            return False
        except KVStoreError as e:
            # The daemon answered and refused (a bad token, a namespace it will not take): the
            # engine runs without the cache rather than not at all; say so loudly and retry.
            self._retry_later()
            if str(e) != self.refused:
                self.refused = str(e)
                log.error("%s: the daemon refused this engine (%s); running without the cache "
                          "until that is fixed (retrying every %.0f s at most)", self.name, e, self._max_backoff)
            return False
        with self._lock:
            self._client = client
            was_counted = self.counters.opened > 0
            self._open = False
            self._backoff = self._backoff0
            if was_counted:
                self.counters.reconnects += 1
        if was_counted:
            log.warning("%s: daemon reachable again; cache hits resume", self.name)
        return True

    def _retry_later(self) -> None:
        with self._lock:
            self._next_probe = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self._max_backoff)

    def _run(self) -> None:
        while not self._stop:
            if not self._open:
                self._wake.wait()  # set by trip() or close()
                self._wake.clear()
                continue
            wait = self._next_probe - self._clock()
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self.probe()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        client, self._client = self._client, None
        if client is not None:
            close = getattr(client, "close", None)
            if close is not None:
                with contextlib.suppress(*DOWN_ERRORS):
                    close()
