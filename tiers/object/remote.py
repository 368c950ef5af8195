"""Requests to a remote object store: batched and concurrent, behind a circuit breaker, with a
bounded queue for writes made while the store is unreachable.

:class:`Remote` runs many requests of one batch on fsspec's event loop at once (``max_concurrency``
in flight), so a batch of gets or puts costs about one round trip per ``max_concurrency`` objects
instead of one per object. It never raises for a single request: each result is a value or the
exception of that request, classified by :func:`Remote.classify`.

:class:`Breaker`: after ``failures`` consecutive batches that failed for transport reasons
(connection refused, timeouts, 5xx) the tier is *unavailable*: calls fail at once, without a
request, until ``retry_s`` has passed; then exactly one call goes through as a trial. A trial
that gets any answer from the server (a 404 included) closes the breaker. Time comes from the
tier's injected clock, so tests move it instead of sleeping.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

from kvstore.clock import Clock
from kvstore.errors import TierUnavailableError
from kvstore.keys import BlockHash

T = TypeVar("T")

MISS, DOWN, ERROR = "miss", "down", "error"

# Errors that say the server could not be reached or did not answer in time. Backends add their
# own transport errors (tiers/s3.py: botocore's and aiohttp's).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,  # asyncio's too, since 3.11
    FSTimeoutError,
)
# What fsspec backends turn 5xx / SlowDown answers into: the service is there but not serving.
_SERVER_ERRNOS = {errno.EIO, errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)}


class Breaker:
    """A circuit breaker over an injected clock; thread-safe. See the module docstring."""

    def __init__(self, clock: Clock, failures: int, retry_s: float) -> None:
        self._clock = clock
        self._threshold = failures
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._failures = 0
        self._open = False
        self._trial = False
        self._retry_at = 0.0
        self.opened = 0
        """Times the breaker opened."""
        self.rejected = 0
        """Calls refused without a request while open."""

    def allow(self) -> bool:
        """Whether a call may go out now; claims the single trial when one is due."""
        with self._lock:
            if not self._open:
                return True
            if not self._trial and self._clock() >= self._retry_at:
                self._trial = True
                return True
            self.rejected += 1
            return False

    def available(self) -> bool:
        """Closed, or open with a trial due (a lookup may count on the tier again)."""
        with self._lock:
            return not self._open or (not self._trial and self._clock() >= self._retry_at)

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._open = self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial or (not self._open and self._failures >= self._threshold):
                if not self._open:
                    self.opened += 1
                self._open, self._trial = True, False
                self._retry_at = self._clock() + self._retry_s

    @property
    def state(self) -> str:
        with self._lock:
            return "closed" if not self._open else ("trial" if self._trial else "open")


@dataclass(slots=True)
class Queued:
    path: str
    blob: bytes
    """The whole object: header and stored payload."""
    size: int
    """Payload bytes (what capacity counts)."""


class WriteQueue:
    """Writes not sent yet (write-behind, or held while the store is unreachable), oldest first,
    bounded in bytes; thread-safe.

    A queued block is readable from here (read-your-writes) until it is drained or dropped.
    """

    def __init__(self, bound_bytes: int) -> None:
        self._bound = bound_bytes
        self._items: OrderedDict[BlockHash, Queued] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queued = 0
        self.dropped = 0
        self.drained = 0

    def offer(self, key: BlockHash, item: Queued, *, count_drop: bool = True) -> bool:
        """Queue ``item`` (replacing an older write of ``key``); False when over the bound
        (counted as dropped unless ``count_drop`` is False: the caller writes it itself)."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old.blob)
            if self._bytes + len(item.blob) > self._bound:
                self.dropped += count_drop
                return False
            self._items[key] = item
            self._bytes += len(item.blob)
            self.queued += 1
            return True

    def get(self, key: BlockHash) -> Queued | None:
        with self._lock:
            return self._items.get(key)

    def discard(self, key: BlockHash) -> Queued | None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is not None:
                self._bytes -= len(item.blob)
            return item

    def snapshot(self) -> list[tuple[BlockHash, Queued]]:
        with self._lock:
            return list(self._items.items())

    def done(self, key: BlockHash, item: Queued) -> None:
        """``item`` reached the store: forget it unless a newer write of ``key`` replaced it."""
        with self._lock:
            if self._items.get(key) is item:
                del self._items[key]
                self._bytes -= len(item.blob)
                self.drained += 1

    def drop_all(self) -> int:
        with self._lock:
            n = len(self._items)
            self._items.clear()
            self._bytes = 0
            self.dropped += n
            return n

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes


class Remote:
    """Batched requests to one fsspec filesystem through a :class:`Breaker`; thread-safe.

    A synchronous filesystem (memory://, ...) is wrapped so that it takes the same path (its calls
    then run in threads).
    """

    def __init__(
        self,
        fs: Any,
        *,
        name: str,
        breaker: Breaker,
        concurrency: int,
        transport_errors: tuple[type[BaseException], ...] = (),
        deadline_s: float | None = None,
    ) -> None:
        self.fs: Any = fs if isinstance(fs, AsyncFileSystem) else AsyncFileSystemWrapper(fs)
        self.name = name
        self.breaker = breaker
        self._concurrency = concurrency
        self._deadline = deadline_s
        self._transport = TRANSPORT_ERRORS + transport_errors

    def classify(self, exc: BaseException) -> str:
        """MISS (no such object: the server answered), DOWN (unreachable, timed out, 5xx) or
        ERROR (anything else: refused credentials, a bad bucket name, a bug)."""
        if isinstance(exc, FileNotFoundError):
            return MISS
        if isinstance(exc, self._transport):
            return DOWN
        if type(exc) is OSError and exc.errno in _SERVER_ERRNOS:
            return DOWN
        return ERROR

    def unavailable(self) -> TierUnavailableError:
        return TierUnavailableError(
            f"object tier {self.name!r} is unavailable (its store did not answer; retrying "
            "after the breaker's retry interval); the store serves from its other tiers"
        )

    def run(
        self, calls: Sequence[Callable[[], Awaitable[T]]]
    ) -> list[T | BaseException]:
        """Run ``calls`` (coroutine factories) concurrently on fsspec's loop; results in order.

        Raises TierUnavailableError without a request while the breaker is open. The batch counts
        as one success (the server answered at least once) or one failure for the breaker.
        """
        if not calls:
            return []
        if not self.breaker.allow():
            raise self.unavailable()
        try:
            results = sync(self.fs.loop, self._gather, calls)
        except BaseException:
            self.breaker.failure()
            raise
        down = sum(1 for r in results if isinstance(r, BaseException) and self.classify(r) == DOWN)
        if down == len(results):
            self.breaker.failure()
        else:
            self.breaker.success()
        return results

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One request; its exception is raised as is."""
        (r,) = self.run([fn])
        if isinstance(r, BaseException):
            raise r
        return r

    async def _gather(
        self, calls: Sequence[Callable[[], Awaitable[T]]]
    ) -> list[T | BaseException]:
        sem = asyncio.Semaphore(self._concurrency)

        async def one(fn: Callable[[], Awaitable[T]]) -> T | BaseException:
            async with sem:
                try:
                    # The deadline runs from the request's start, not from its wait for a slot.
                    return await asyncio.wait_for(fn(), self._deadline)
                except TimeoutError:
                    return TimeoutError(f"{self.name}: no answer within {self._deadline} s")
                except Exception as e:  # returned, not raised: one object's failure is its own
                    return e

        return await asyncio.gather(*(one(fn) for fn in calls))
