"""The engine's circuit breaker: the cache never breaks the engine.

:class:`Breaker` is the one breaker of every engine-side client (``EngineCache``, the vLLM
connector, the SGLang backend); :class:`DaemonLink` adds what the two adapters need around it: a
client made (and namespaces registered) by the breaker's probe, so an engine may start before
its daemon, and ``call(fn, fallback)``. While the daemon answers, calls go through. The first call that finds it
unreachable (refused, reset, or slower than the client's timeout) opens the breaker: from then
on every call returns its fallback at once (a lookup answers "no hit", a load fails and is
recomputed, a save is dropped), with no connection attempt and no retry delay. The breaker's
thread reconnects with backoff; the first success closes it and hits resume by themselves.

An error the daemon *answered* (a missing prefix, a quota) is the caller's to handle and does
not open the breaker. A daemon that refuses the connection itself (a bad token, a namespace it
will not take) is logged as an error and the engine runs without the cache.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.errors import DaemonUnavailableError, KVStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store could not be reached (as opposed to a refusal by a store
    that answered: a missing prefix, a full tier, a quota)."""
    if isinstance(exc, DaemonUnavailableError):
        return True
    # A tier's own I/O error (TierIOError) is an OSError too, but the daemon answered.
    return isinstance(exc, OSError) and not isinstance(exc, KVStoreError)


class Breaker:
    """A circuit breaker whose recovery is a background probe, not a trial call.

    ``closed`` (the default): calls go out. :meth:`trip` opens it: callers check :attr:`closed`
    and skip the store, so an open breaker costs a callers no network round trip and no retry
    delay. A prober thread runs ``probe`` after ``backoff_s``, doubling the wait (with jitter)
    up to ``max_backoff_s`` after each failure; the first probe that returns closes the breaker.
    The thread is started with the breaker and waits for a trip: the call that trips it (an
    engine's) starts nothing, which on a loaded machine could cost milliseconds.
    With ``background=False`` nothing probes by itself: :meth:`probe_now` does one probe
    (tests step it that way instead of waiting).
    """

    def __init__(
        self,
        probe: Callable[[], None],
        *,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        background: bool = True,
        name: str = "kvstore",
    ) -> None:
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s} and {max_backoff_s}")
        self._probe = probe
        self._backoff = (backoff_s, max_backoff_s)
        self._name = name
        self._lock = threading.Lock()
        self._tripped = threading.Event()
        self._wake = threading.Event()
        """Set by :meth:`close`: ends the prober's back-off wait."""
        self._stop = False
        self.closed = True
        """Calls may go out. Read without the lock: a stale read costs one call or one miss."""
        self.opened = 0
        """Times the breaker opened."""
        self.probes = 0
        """Probes made (each one a connection attempt)."""
        self.last_error = ""
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvstore-reconnect", daemon=True)
            self._thread.start()

    def trip(self, exc: BaseException) -> None:
        """Open the breaker (idempotent); the prober starts reconnecting."""
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if not self.closed:
                return
            self.closed = False
            self.opened += 1
            self._tripped.set()
        log.warning("%s unavailable (%s): answering 'no hit' and dropping stores until it is back",
                    self._name, self.last_error)

    def probe_now(self) -> bool:
        """One probe; closes the breaker when it succeeds. Returns whether the breaker is closed."""
        self.probes += 1
        try:
            self._probe()
        except (KVStoreError, OSError) as e:
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        with self._lock:
            if not self.closed:
                log.warning("%s is back after %d probes: loads and stores resume", self._name, self.probes)
            self.closed = True
        return True

    def _run(self) -> None:
        base, cap = self._backoff
        while True:
            self._tripped.wait()
            delay = base
            while not self._stop and not self.closed:
                self._wake.wait(delay * random.uniform(0.5, 1.0))
                if self._stop:
                    return
                self.probe_now()
                delay = min(delay * 2, cap)
            if self._stop:
                return
            with self._lock:
                # Wait for the next trip only while closed, under the lock: a trip that came
                # after the probe that closed it keeps the breaker open.
                if self.closed:
                    self._tripped.clear()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._tripped.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a probe stuck in a connect ends with its own timeout


@dataclass(slots=True)
class LinkCounters:
    calls: int = 0
    failures: int = 0
    """Calls that found the daemon unreachable (each opens the breaker)."""
    short_circuited: int = 0
    """Calls answered with the fallback at once because the breaker was open."""
    reconnects: int = 0

    @property
    def opened(self) -> int:  # kept beside the others for reports
        return self.failures


class DaemonLink(Generic[C]):
    """``make_client()`` builds a connected client; ``on_connect(client)`` runs after each new
    connection (register namespaces). ``start_thread=False``: nothing reconnects by itself
    (tests call :meth:`probe`)."""

    def __init__(
        self,
        make_client: Callable[[], C],
        *,
        name: str = "kvstore",
        on_connect: Callable[[C], None] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        start_thread: bool = True,
    ) -> None:
        self.name = name
        self._make = make_client
        self._on_connect = on_connect
        self._client: C | None = None
        self._connected_once = False
        self.refused = ""
        """The daemon's last refusal of a (re)connection (empty: none)."""
        self.counters = LinkCounters()
        self.breaker = Breaker(self._reconnect, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                               background=start_thread, name=f"{name} daemon")
        if not self.breaker.probe_now():
            self.breaker.trip(DaemonUnavailableError(self.breaker.last_error or "not connected yet"))

    @property
    def is_open(self) -> bool:
        return not self.breaker.closed

    @property
    def client(self) -> C | None:
        return self._client if self.breaker.closed else None

    def _reconnect(self) -> None:
        """The breaker's probe: a client (new, or the old one's health), namespaces registered."""
        client = self._client
        try:
            if client is None:
                client = self._make()
            else:
                client.health()  # type: ignore[attr-defined]
            if self._on_connect is not None:
                self._on_connect(client)
        except KVStoreError as e:
            if unreachable(e):
                raise
            if str(e) != self.refused:  # the daemon answered and refused: loud, not fatal
                self.refused = str(e)
                log.error("%s: the daemon refused this engine (%s); running without the cache until "
                          "that is fixed", self.name, e)
            raise
        self._client = client
        if self._connected_once:
            self.counters.reconnects += 1
        self._connected_once = True

    def probe(self) -> bool:
        """One reconnection attempt now; True when the breaker is closed afterwards."""
        return self.breaker.closed or self.breaker.probe_now()

    def call(self, fn: Callable[[C], T], fallback: T) -> T:
        """``fn(client)``, or ``fallback`` at once while the breaker is open or when the call
        finds the daemon unreachable (which opens it)."""
        self.counters.calls += 1
        client = self._client
        if not self.breaker.closed or client is None:
            self.counters.short_circuited += 1
            return fallback
        try:
            return fn(client)
        except (KVStoreError, OSError) as e:
            if not unreachable(e):
                raise
            self.counters.failures += 1
            self.breaker.trip(e)
            return fallback

    def close(self) -> None:
        self.breaker.close()
        client, self._client = self._client, None
        close = getattr(client, "close", None)
        if close is not None:
            with contextlib.suppress(KVStoreError, OSError):
                close()
