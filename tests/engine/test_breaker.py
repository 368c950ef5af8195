"""DaemonLink: the engine's circuit breaker around a daemon client. Open at the first failure,
the fallback at once while open (no call reaches the client), reconnect by a probe (stepped by
hand here: ``start_thread=False``), namespaces registered again, refusals loud and not fatal."""

from __future__ import annotations

import pytest

from engine.breaker import DaemonLink
from kvstore.errors import AuthError, DaemonUnavailableError, MissingPrefixError, TierIOError


class FakeClient:
    """A daemon client whose daemon is up or down."""

    def __init__(self, world: dict[str, bool]) -> None:
        self.world = world
        self.calls = 0

    def health(self) -> dict[str, str]:
        if not self.world["up"]:
            raise DaemonUnavailableError("connection refused")
        return {"status": "ok"}

    def lookup(self) -> int:
        self.calls += 1
        if not self.world["up"]:
            raise DaemonUnavailableError("connection reset")
        return 7


def _link(world: dict[str, bool], registered: list[FakeClient]) -> DaemonLink[FakeClient]:
    def make() -> FakeClient:
        if not world["up"]:
            raise DaemonUnavailableError("connection refused")
        return FakeClient(world)

    return DaemonLink(make, on_connect=registered.append, backoff_s=0.5, max_backoff_s=2.0, start_thread=False)


def test_open_at_first_failure_then_fallback_without_calling() -> None:
    world, registered = {"up": True}, []
    link = _link(world, registered)
    assert not link.is_open and len(registered) == 1  # namespaces registered on connect
    assert link.call(lambda c: c.lookup(), 0) == 7
    world["up"] = False
    assert link.call(lambda c: c.lookup(), 0) == 0  # the failing call answers the fallback
    assert link.is_open and link.breaker.opened == 1
    client = registered[0]
    before = client.calls
    for _ in range(100):
        assert link.call(lambda c: c.lookup(), 0) == 0
    assert client.calls == before  # open: no call reaches the client, no retry delay
    assert link.counters.short_circuited == 100


def test_reconnect_registers_again_and_hits_resume() -> None:
    world, registered = {"up": True}, []
    link = _link(world, registered)
    world["up"] = False
    link.call(lambda c: c.lookup(), 0)
    assert not link.probe() and link.is_open  # still down
    world["up"] = True
    assert link.probe() and not link.is_open
    assert link.counters.reconnects == 1 and len(registered) == 2  # registered again
    assert link.call(lambda c: c.lookup(), 0) == 7


def test_daemon_down_at_start_is_an_open_breaker_not_an_error() -> None:
    world, registered = {"up": False}, []
    link = _link(world, registered)
    assert link.is_open and link.client is None
    assert link.call(lambda c: c.lookup(), -1) == -1
    world["up"] = True
    assert link.probe() and link.call(lambda c: c.lookup(), -1) == 7


def test_a_refused_connection_is_loud_and_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    world = {"up": True}

    def refuse(client: FakeClient) -> None:
        raise AuthError("daemon: HTTP 401: unknown token")

    link = DaemonLink(lambda: FakeClient(world), on_connect=refuse, start_thread=False)
    assert link.is_open and "unknown token" in link.refused
    assert any(r.levelname == "ERROR" and "running without the cache" in r.message for r in caplog.records)
    assert link.call(lambda c: c.lookup(), 0) == 0


@pytest.mark.parametrize("answer", [MissingPrefixError("prefix evicted"), TierIOError("a tier's disk failed")])
def test_answered_errors_are_the_callers_and_do_not_open(answer: Exception) -> None:
    link = _link({"up": True}, [])

    def refused(c: FakeClient) -> int:
        raise answer

    with pytest.raises(type(answer)):
        link.call(refused, 0)
    assert not link.is_open
