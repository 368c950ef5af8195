"""UCX settings the daemon and the client set before ucxx is imported (an operator's own
environment wins: only unset variables are filled in), and how both sides move messages.

Why this module drives ucxx's worker itself (:class:`Progress`): ucxx 0.52's asyncio modes all
spin a core. Its "blocking" mode never re-arms the worker after the first event, so the
worker's wakeup fd stays readable and the event loop calls ``progress()`` without pause, idle
or not (94% of a core with one connected endpoint and nothing moving, measured); and every
``await ep.send()`` / ``ep.recv()`` outside the thread modes waits by ``asyncio.sleep(0)``
until the request is done (``UCXRequest.wait_yield``). Its thread modes trade that for a
progress thread that wakes every millisecond and a notifier thread per completion. On a
machine of two cores a spinning peer takes the CPU that the bytes need: per 64 MiB over
loopback the client and the sender each burnt their whole wall time (34 + 35 ms against a
raw socket's 21 + 14 ms); the current figures are in docs/benchmarks.md, "The daemon's data
and control planes".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

UCX_ENV_DEFAULTS: dict[str, str] = {
    # The worker is driven by :class:`Progress` (an epoll wait, no thread): the mode ucxx must
    # be in for that. Another mode set by the operator is honoured with ucxx's own waiting.
    "UCXPY_PROGRESS_MODE": "blocking",
    # UCX must not warn about the variables below when a transport does not use them.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Messages of 64 KiB and up by rendezvous with the sender writing (put_zcopy): over TCP the
    # receiver then reads the payload from the socket straight into the posted buffer. Eager
    # messages (what ``get_zcopy`` amounted to: TCP has no get, so UCX sent every size eagerly)
    # land in UCX's receive segments and are copied out, a second copy of every byte that cost
    # the receiver more CPU than the kernel's own (perf: 16% against 10% of its samples).
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_RNDV_THRESH": "64K",
    # Receive segments of 64 KiB (UCX's default): the first read of a put lands in one and is
    # copied, so a larger one copies more of each payload (1 MiB ones: the whole of a 1 MiB
    # block); send segments may not exceed them.
    "UCX_TCP_TX_SEG_SIZE": "64K",
    "UCX_TCP_RX_SEG_SIZE": "64K",
    # A send buffer of 4 MiB (the kernel's autotuning stops there, net.ipv4.tcp_wmem); the
    # receive buffer is left to the kernel's autotuning, which grows past what SO_RCVBUF may
    # set (net.core.rmem_max): per 64 MiB the client then spent 21-22 ms against 23-24 with
    # 4 MiB, the daemon 21-22 against 22-23 (docs/benchmarks.md).
    "UCX_TCP_SNDBUF": "4M",
}


def apply_ucx_env() -> None:
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


class Progress:
    """Progress of ucxx's worker from one asyncio loop, waiting in that loop's epoll.

    While something waits (:meth:`wait`, or ucxx's own steps inside :meth:`held`), the loop
    watches the worker's fd. When it turns readable, or right after requests are posted,
    :meth:`_progress` progresses the worker until it has nothing left to do, finishes the waits
    whose requests completed, and re-arms the worker (``ucp_worker_arm``: BUSY means events
    came in meanwhile, so progress again); the loop then sleeps until the next event. Requests
    complete only inside ``progress()``, so checking them after it is exact.

    Several loops (a process with a daemon and a client, several clients) share ucxx's one
    worker: any loop's progress may complete another loop's requests and consume the event that
    would have woken it, so after progressing each loop wakes the others that are waiting; and a
    loop with nothing to wait for stops watching, so an idle client's loop does not wake at every
    event of another. A tick (``TICK_S``) progresses anyway, against a lost wakeup.
    """

    TICK_S = 0.5
    _all: dict[asyncio.AbstractEventLoop, Progress] = {}
    _lock = threading.Lock()
    _making = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop, worker: Any) -> None:
        self.loop = loop
        self.worker = worker
        self._waits: list[list[Any]] = []
        """``[requests, future, index of the first request not seen complete]`` per wait."""
        self._holds = 0
        self._fd = worker.epoll_file_descriptor
        self._watching = False
        self._tick: asyncio.TimerHandle | None = loop.call_later(self.TICK_S, self._on_tick)
        with self._lock:
            self._all[loop] = self

    @classmethod
    def of_running_loop(cls) -> Progress | None:
        """This loop's driver, made on first use (before ucxx makes its own progress task for
        the loop, which it skips for a loop that has one); None where ucxx runs in a mode of
        its own (``UCXPY_PROGRESS_MODE`` other than blocking): then ucxx's waits are used."""
        loop = asyncio.get_running_loop()
        with cls._lock:
            p = cls._all.get(loop)
        if p is not None:
            return p
        if os.environ.get("UCXPY_PROGRESS_MODE", "thread") != "blocking":
            return None
        from ucxx import core
        from ucxx._lib_async import application_context as appctx

        with cls._making:  # ucxx makes its one context on first use, without a lock of its own
            # Claim the loop first: creating the context asks for a progress task for it.
            appctx.ProgressTasks[loop] = None
            try:
                ctx = core._get_ctx()
                ctx.worker.init_blocking_progress_mode()  # the worker's epoll fd (once per worker)
            except BaseException:
                appctx.ProgressTasks.pop(loop, None)
                raise
            p = cls(loop, ctx.worker)
            appctx.ProgressTasks[loop] = p
        return p

    def hold(self) -> None:
        """Watch the worker until :meth:`release`, waits or not: around ucxx's own waiting
        (connecting, closing: it spins the loop and needs someone to progress), and for a
        listener's life (connections come in unasked)."""
        self._holds += 1
        self._progress()

    def release(self) -> None:
        self._holds -= 1
        self._watch()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """:meth:`hold` for as long as the block runs."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def close(self) -> None:
        """Stop watching the worker from this loop (before the loop stops); on its thread."""
        with self._lock:
            self._all.pop(self.loop, None)
        self._holds = 0
        for _, fut, _ in self._waits:
            if not fut.done():
                fut.set_exception(ConnectionError("UCX progress stopped"))
        self._waits.clear()
        self._watch()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def wait(self, requests: list[Any]) -> asyncio.Future[None]:
        """A future done once every request is: its result None, or the first request's error
        (requests of one endpoint complete in order; an endpoint's error fails them all)."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waits.append([requests, fut, 0])
        self._progress()
        return fut

    @property
    def watching(self) -> bool:
        """Whether this loop watches the worker's fd now (something waits, or is held)."""
        return self._watching

    def _watch(self) -> None:
        want = bool(self._waits) or self._holds > 0
        if want and not self._watching:
            self.loop.add_reader(self._fd, self._progress)
        elif self._watching and not want:
            self.loop.remove_reader(self._fd)
        self._watching = want

    def _on_tick(self) -> None:
        self._tick = self.loop.call_later(self.TICK_S, self._on_tick)
        self._progress()

    def _progress(self) -> None:
        while True:
            self.worker.progress()
            self._finish()
            if self.worker.arm():
                break
        if len(self._all) > 1:
            self._wake_others()

    def _finish(self) -> None:
        if self._waits:
            left = []
            for w in self._waits:
                reqs, fut, i = w
                if fut.done():  # cancelled by its caller (a timeout); its requests are ucxx's now
                    continue
                # Requests mostly complete in the order they were posted: resume at the first
                # one not seen complete, so a progress call costs O(1) per wait, not O(requests).
                while i < len(reqs) and reqs[i].completed:
                    i += 1
                if i < len(reqs):
                    w[2] = i
                    left.append(w)
                    continue
                try:
                    for r in reqs:
                        r.check_error()
                except Exception as e:  # a ucxx error: the caller maps it to its own
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            self._waits = left
        self._watch()

    def _wake_others(self) -> None:
        with self._lock:
            others = [p for p in self._all.values() if p is not self and p._waits]
        for p in others:
            try:
                p.loop.call_soon_threadsafe(p._finish)
            except RuntimeError:  # that loop closed without close(): nothing waits there
                with self._lock:
                    self._all.pop(p.loop, None)


def _posted(ep: Any, bufs: Sequence[Any], send: bool) -> list[Any]:
    """ucxx requests of ``bufs`` on endpoint ``ep``, posted in order: ucxx 0.52's
    ``Endpoint.send`` / ``recv`` without their spinning wait (tag matching keeps the order)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    raw = ep._ep
    raw.raise_on_error()
    tag = ep._tags["msg_send" if send else "msg_recv"]
    if not isinstance(tag, Tag):
        tag = Tag(tag)
    if send:
        return [raw.tag_send(Array(b), tag) for b in bufs]
    return [raw.tag_recv(Array(b), tag, TagMaskFull) for b in bufs]


async def send_all(ep: Any, bufs: Sequence[Any]) -> None:
    """Send ``bufs`` (arrays) over ucxx endpoint ``ep``, every message posted at once."""
    await _move(ep, bufs, send=True)


async def recv_all(ep: Any, bufs: Sequence[Any]) -> None:
    """Receive the next ``len(bufs)`` messages of ``ep`` into ``bufs`` (arrays), in order."""
    await _move(ep, bufs, send=False)


async def _move(ep: Any, bufs: Sequence[Any], send: bool) -> None:
    if not bufs:
        return
    p = Progress.of_running_loop()
    if p is None:
        await transfer_all([ep.send(b) if send else ep.recv(b) for b in bufs])
        return
    await p.wait(_posted(ep, bufs, send))


async def transfer_all(ops: list[Coroutine[Any, Any, Any]]) -> None:
    """Run ucxx sends or receives of one endpoint concurrently; the first failure is raised once
    every one has ended.

    Each posts its request at its first step, in list order, and messages of one tag match in
    the order they were posted, so the bytes land as if awaited one by one. Awaited one by one,
    every 1 MiB message waited for its own rendezvous round trips (a wake-up of both processes
    each): on a loaded 2-core machine that ran at a tenth of a raw socket."""
    if len(ops) == 1:
        await ops[0]
        return
    for r in await asyncio.gather(*ops, return_exceptions=True):
        if isinstance(r, BaseException):
            raise r
