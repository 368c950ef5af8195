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

:class:`RemoteBlobs`: the object tier's remote backend (a :class:`~tiers.object.blobs.BlobStore`)
over the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

from kvstore.block import BlockMeta
from kvstore.clock import Clock
from kvstore.errors import BlockNotFound, KVStoreError, TierIOError, TierUnavailableError
from kvstore.keys import BlockHash
from tiers.object.blobs import Blob, BlobStore, window
from tiers.object.config import ObjectConfig
from tiers.object.format import PROBE_BYTES, Header, decode_object, header_length, unpack_header

T = TypeVar("T")
log = logging.getLogger(__name__)

MISS, DOWN, ERROR = "miss", "down", "error"

# Errors that say the server could not be reached or did not answer in time. Backends add their
# own transport errors (tiers/object/s3.py: botocore's and aiohttp's).
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


class RemoteBlobs(BlobStore):
    """The object tier's remote backend: objects under ``base`` of a remote fsspec filesystem
    (S3 and S3-compatible stores, GCS, ``memory://``), every batch one concurrent round of
    requests through a :class:`Remote`.

    Writes: one PUT per object (atomic on S3-like stores). With ``wake`` (the tier's worker
    runs) and ``write_behind``, non-durable writes are queued and sent in the background; while
    the store is unreachable non-durable writes wait in the queue, or past
    ``write_queue_bytes`` are dropped with TierUnavailableError. ``s3``: the
    :mod:`tiers.object.s3` module for ``s3://`` URLs (paged LIST and DELETE, the lifecycle rule).
    """

    def __init__(
        self,
        fs: Any,
        name: str,
        base: str,
        config: ObjectConfig,
        clock: Clock,
        *,
        s3: Any = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        if s3 is not None:
            s3.configure(fs)
        self.name = name
        self._base = base
        self._config = config
        self._s3 = s3
        self._wake = wake
        self.remote = Remote(
            fs,
            name=name,
            breaker=Breaker(clock, config.breaker_failures, config.breaker_retry_s),
            concurrency=config.max_concurrency,
            transport_errors=s3.transport_errors() if s3 is not None else (),
            deadline_s=config.request_deadline_s
            or config.max_attempts * (config.connect_timeout_s + config.read_timeout_s),
        )
        self.fs = self.remote.fs
        self._queue = WriteQueue(config.write_queue_bytes)
        if s3 is not None and config.lifecycle_days:
            self._apply_lifecycle()

    # ---- plumbing ------------------------------------------------------------------------------

    def _run(self, calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
        """Run a batch through the breaker; while it is open every result is unavailable."""
        if not calls:
            return []
        try:
            return self.remote.run(calls)
        except TierUnavailableError as e:
            return [e] * len(calls)

    def _error(self, exc: BaseException, what: str, key: BlockHash | None = None) -> KVStoreError:
        """A request's exception as the KVStoreError the Tier contract names."""
        if isinstance(exc, KVStoreError):
            return exc
        kind = self.remote.classify(exc)
        if kind == MISS:
            where = f"block {key.hex()}" if key is not None else what
            return BlockNotFound(f"{where} is not in tier {self.name!r}")
        if kind == DOWN:
            return TierUnavailableError(f"object tier {self.name!r}: {what}: {exc!r}")
        return TierIOError(f"object tier {self.name!r}: {what}: {exc}")

    def available(self) -> bool:
        return self.remote.breaker.available()

    # ---- reads ---------------------------------------------------------------------------------

    def read_into(self, items: Sequence[tuple[BlockHash, str, memoryview]]) -> list[BlockMeta | KVStoreError]:
        out: list[BlockMeta | KVStoreError] = [_PENDING] * len(items)
        calls: list[Callable[[], Awaitable[BlockMeta]]] = []
        pending: list[int] = []
        for i, (key, path, dst) in enumerate(items):
            queued = self._queue.get(key)
            if queued is not None:  # not in the store yet: read our own write
                try:
                    out[i] = decode_object(key, queued.blob, dst, queued.path)
                except KVStoreError as e:
                    out[i] = e
                continue
            pending.append(i)
            calls.append(functools.partial(self._get, key, path, dst))
        for i, r in zip(pending, self._run(calls), strict=True):
            key, path, _ = items[i]
            out[i] = r if isinstance(r, BlockMeta) else self._error(r, f"read {path}", key)
        return out

    async def _get(self, key: BlockHash, path: str, out: memoryview) -> BlockMeta:
        data = await self.fs._cat_file(path)
        # Decoded on the loop thread as each object arrives: the payload bytes are dropped at
        # once, so a batch holds at most max_concurrency objects in memory.
        return decode_object(key, data, out, path)

    def headers(self, items: Sequence[tuple[BlockHash, str]]) -> list[Header | KVStoreError]:
        calls = [functools.partial(self._head, k, p) for k, p in items]
        return [
            r if isinstance(r, Header) else self._error(r, f"read header {p}", k)
            for (k, p), r in zip(items, self._run(calls), strict=True)
        ]

    async def _head(self, key: BlockHash, path: str) -> Header:
        head = await self.fs._cat_file(path, start=0, end=PROBE_BYTES)
        length = header_length(head, path)
        if length > len(head):
            head = await self.fs._cat_file(path, start=0, end=length)
        return unpack_header(head, key, path)

    def cat(self, paths: Sequence[str]) -> list[bytes | None]:
        results = self._run([functools.partial(self.fs._cat_file, p) for p in paths])
        return [r if isinstance(r, bytes) else None for r in results]

    def queued(self, key: BlockHash) -> Blob | None:
        q = self._queue.get(key)
        return None if q is None else Blob(key, q.path, q.blob, q.size)

    # ---- writes --------------------------------------------------------------------------------

    def write(self, blobs: Sequence[Blob], *, durable: bool) -> list[KVStoreError | None]:
        out: list[KVStoreError | None] = [None] * len(blobs)
        sync = list(range(len(blobs)))
        if not durable and self._config.write_behind and self._wake is not None:
            sync = [
                i for i in sync
                if not self._queue.offer(blobs[i].key, Queued(blobs[i].path, blobs[i].data, blobs[i].size), count_drop=False)
            ]
            if len(sync) < len(blobs):
                self._wake()
        results = self._run([functools.partial(self.fs._pipe_file, blobs[i].path, blobs[i].data) for i in sync])
        for i, r in zip(sync, results, strict=True):
            b = blobs[i]
            if not isinstance(r, BaseException):
                self._queue.discard(b.key)  # an older queued write of the key is superseded
                continue
            err = self._error(r, f"write {b.path}")
            if isinstance(err, BlockNotFound):
                err = TierIOError(
                    f"object tier {self.name!r}: cannot write {b.path}: the bucket does not "
                    "exist; create it or fix the tier's url"
                )
            if isinstance(err, TierUnavailableError) and not durable:
                if self._queue.offer(b.key, Queued(b.path, b.data, b.size)):
                    continue
                err = TierUnavailableError(
                    f"object tier {self.name!r} is unavailable and its write queue is full "
                    f"({self._config.write_queue_bytes} bytes): write of {b.key.hex()} dropped"
                )
            out[i] = err
        return out

    def put_small(self, blobs: dict[str, bytes]) -> list[bool]:
        results = self._run([functools.partial(self.fs._pipe_file, p, b) for p, b in blobs.items()])
        return [not isinstance(r, BaseException) for r in results]

    def drain(self) -> int:
        """Send writes queued during an outage; returns how many reached the store."""
        items = self._queue.snapshot()
        if not items or not self.available():
            return 0
        results = self._run([functools.partial(self.fs._pipe_file, q.path, q.blob) for _, q in items])
        sent = 0
        for (key, q), r in zip(items, results, strict=True):
            if not isinstance(r, BaseException):
                self._queue.done(key, q)
                sent += 1
        return sent

    # ---- deletes and listings ------------------------------------------------------------------

    def delete(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        if self._s3 is not None:  # DeleteObjects: 1,000 keys per request
            calls = [functools.partial(self._s3.delete_keys, self.fs, list(paths))]
        else:
            calls = [functools.partial(self.fs._rm_file, p) for p in paths]
        for r in self._run(calls):
            if isinstance(r, BaseException) and self.remote.classify(r) != MISS:
                raise self._error(r, f"delete {len(paths)} objects under {self._base}")

    def delete_block(self, key: BlockHash, paths: Sequence[str], *, known: bool) -> bool:
        queued = self._queue.discard(key) is not None
        if queued and not self.available():
            return True  # only ever queued here, as far as this node can tell now
        return super().delete_block(key, paths, known=known or queued)

    def list(self, prefix: str, *, after: str = "", limit: int | None = None) -> dict[str, int]:
        if self._s3 is not None:  # one LIST per 1,000, resumed server-side
            call = functools.partial(self._s3.list_prefix, self.fs, prefix, start_after=after, limit=limit)
        else:
            call = functools.partial(_find_sizes, self.fs, prefix)
        (r,) = self._run([call])
        if isinstance(r, BaseException):
            err = self._error(r, f"list {prefix}")
            if isinstance(err, BlockNotFound):
                return {}
            raise err
        return window(r, after, limit)

    # ---- background work -----------------------------------------------------------------------

    def tick(self) -> None:
        """A trial request when the breaker is due one, then draining queued writes."""
        breaker = self.remote.breaker
        if breaker.state == "open" and breaker.available():
            self._trial()
        if len(self._queue) and breaker.available():
            self.drain()

    def _trial(self) -> None:
        """A cheap request whose only purpose is to learn whether the store answers again."""
        with contextlib.suppress(KVStoreError):
            (r,) = self._run([functools.partial(self.fs._cat_file, f"{self._base}/.probe", start=0, end=1)])
            log.info("object tier %r: trial request answered (%s)", self.name, type(r).__name__)

    def _apply_lifecycle(self) -> None:
        call = functools.partial(self._s3.apply_lifecycle, self.fs, self._base, self._config.lifecycle_days)
        try:
            rule = self.remote.call(call)
            log.info("object tier %r: lifecycle rule %s installed", self.name, rule["ID"])
        except (OSError, KVStoreError) as e:
            log.warning("object tier %r: cannot install the lifecycle rule: %s", self.name, e)

    def flush(self) -> None:
        """Send queued writes if the store answers (acknowledged PUTs are durable already)."""
        self.drain()

    def close(self) -> None:
        lost = self._queue.drop_all()
        if lost:
            log.warning("object tier %r closed with %d queued writes undelivered", self.name, lost)

    def describe(self) -> dict[str, Any]:
        b = self.remote.breaker
        q = self._queue
        return {
            "queued_writes": len(q), "queued_bytes": q.bytes, "dropped_writes": q.dropped,
            "drained_writes": q.drained, "breaker": b.state, "breaker_opened": b.opened,
            "breaker_rejected": b.rejected,
        }


_PENDING = TierIOError("no answer yet")  # a placeholder every slot of a batch overwrites


async def _find_sizes(fs: Any, path: str) -> dict[str, int]:
    found = await fs._find(path, detail=True)
    return {p: int(info.get("size") or 0) for p, info in found.items()}
