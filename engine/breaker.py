"""A daemon client behind the engine's circuit breaker: the cache never breaks the engine.

The breaker is the reference engine's (:class:`engine.client.Breaker`); :class:`DaemonLink` adds
what the vLLM connector and the SGLang backend need around it: a client made (and namespaces
registered) by the breaker's probe, so an engine may start before its daemon, and ``call(fn,
fallback)``. While the daemon answers, calls go through. The first call that finds it
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.client import Breaker, unreachable
from kvstore.errors import DaemonUnavailableError, KVStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")


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
