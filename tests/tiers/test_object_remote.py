"""The object tier's request machinery (tiers/object/remote.py): the circuit breaker on a fake
clock, the bounded write queue, and how request errors are classified."""

from __future__ import annotations

import errno

import fsspec
import pytest

from kvstore.clock import FakeClock
from kvstore.errors import TierUnavailableError
from tiers.object.remote import DOWN, ERROR, MISS, Breaker, Queued, Remote, WriteQueue


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through() -> None:
    clock = FakeClock()
    b = Breaker(clock, failures=2, retry_s=10)
    b.failure()
    b.success()  # not consecutive: starts over
    b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.available() and not b.allow()
    assert (b.opened, b.rejected) == (1, 1)
    clock.advance(10)
    assert b.available()
    assert b.allow()  # the trial
    assert b.state == "trial" and not b.allow() and not b.available()  # only one
    b.failure()  # the trial failed: open for another interval
    assert b.state == "open" and not b.available()
    clock.advance(10)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.opened == 1


def test_write_queue_is_bounded_in_bytes_and_keeps_the_newest_write() -> None:
    q = WriteQueue(bound_bytes=10)
    k1, k2 = b"a" * 16, b"b" * 16
    first = Queued("p1", b"12345", 5)
    assert q.offer(k1, first)  # type: ignore[arg-type]
    newer = Queued("p1", b"123456", 6)
    assert q.offer(k1, newer)  # type: ignore[arg-type]  # replaces, not adds
    assert (len(q), q.bytes) == (1, 6)
    assert not q.offer(k2, Queued("p2", b"12345", 5))  # type: ignore[arg-type]
    assert q.dropped == 1
    q.done(k1, first)  # type: ignore[arg-type]  # an older write finished: the newer one stays
    assert q.get(k1) is newer  # type: ignore[arg-type]
    q.done(k1, newer)  # type: ignore[arg-type]
    assert (len(q), q.bytes, q.drained) == (0, 0, 1)
    assert q.offer(k2, Queued("p2", b"12345", 5))  # type: ignore[arg-type]
    assert q.drop_all() == 1 and q.dropped == 2


def test_errors_are_a_miss_an_outage_or_an_error() -> None:
    remote = Remote(
        fsspec.filesystem("memory"), name="r", breaker=Breaker(FakeClock(), 1, 1), concurrency=4
    )
    assert remote.classify(FileNotFoundError("no such key")) == MISS
    for down in (ConnectionRefusedError(), TimeoutError(), OSError(errno.EBUSY, "SlowDown")):
        assert remote.classify(down) == DOWN
    assert remote.classify(PermissionError("AccessDenied")) == ERROR


def test_a_batch_that_only_fails_to_connect_counts_against_the_breaker() -> None:
    clock = FakeClock()
    remote = Remote(fsspec.filesystem("memory"), name="r", breaker=Breaker(clock, 1, 5), concurrency=4)

    async def refused() -> None:
        raise ConnectionRefusedError("refused")

    async def missing() -> None:
        raise FileNotFoundError("gone")

    out = remote.run([missing, refused])  # the server answered once: it is up
    assert isinstance(out[0], FileNotFoundError) and isinstance(out[1], ConnectionRefusedError)
    assert remote.breaker.state == "closed"
    remote.run([refused, refused])
    assert remote.breaker.state == "open"
    with pytest.raises(TierUnavailableError, match="unavailable"):
        remote.run([missing])
