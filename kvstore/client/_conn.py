"""Data-plane connections of the client: byte transports (TCP, UCX) and the frame exchange.

Blocking, one request at a time per connection (the client holds a lock around each call).
Payloads land straight in the caller's buffers (``recv_into``; on UCX one message per block, or
per run of blocks for GET_RUNS); on UCX a request and its whole reply take one trip into the
transport's loop thread (``exchange``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from kvstore.errors import (
    AuthError,
    ConfigError,
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    MissingPrefixError,
    QuotaExceededError,
    TierFullError,
    TierIOError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.shm import Segment, attach_arena
from kvstore.ucxenv import Progress, apply_ucx_env, recv_all, send_all
from kvstore.wire import protocol as P
from kvstore.wire.fdpass import receive_fds

log = logging.getLogger("kvstore.client")


class ConnectionLost(ConnectionError):
    """The data connection broke; the client reconnects (and retries idempotent calls)."""


class ConnectionRefused(ConnectionLost):
    """Nothing listens where the daemon should (the connection was refused, or its socket file
    is missing): it is down, or between a stop and its next start. A refusal is instant, so the
    client does not retry it within a call (an engine's circuit breaker reconnects in the
    background); a daemon that hangs is what the timeouts are for."""


def lost(what: str, e: OSError) -> ConnectionLost:
    """``ConnectionRefused`` when ``e`` says nothing listens there, else ``ConnectionLost``."""
    cls = ConnectionRefused if isinstance(e, (ConnectionRefusedError, FileNotFoundError)) else ConnectionLost
    return cls(f"{what}: {e}")


_ERRORS: dict[P.ErrorCode, type[KVStoreError]] = {
    P.ErrorCode.UNAUTHENTICATED: AuthError,
    P.ErrorCode.FORBIDDEN: ForbiddenError,
    P.ErrorCode.QUOTA: QuotaExceededError,
    P.ErrorCode.NOT_FOUND: UnknownNamespaceError,
    P.ErrorCode.CONFLICT: MissingPrefixError,
    P.ErrorCode.FULL: TierFullError,
    # A device or remote store failed (a disk I/O error, S3 down): the daemon is there and
    # answered, so this is neither a full store nor a lost connection.
    P.ErrorCode.UNAVAILABLE: TierIOError,
    P.ErrorCode.BAD_REQUEST: UsageError,
    P.ErrorCode.BAD_FRAME: UsageError,
    P.ErrorCode.TOO_LARGE: UsageError,
}


def open_staging(reply: str, info: dict[str, Any], timeout: float) -> Any:
    """The staging segment a STAGING reply names: a memfd, fetched with the ticket of an
    ``fd:<hex>`` reply from the daemon's fd socket (``info["shm_socket"]``); from an older
    daemon, a /dev/shm name."""
    if not reply.startswith("fd:"):
        return attach_arena(reply)
    try:
        fds = receive_fds(info["shm_socket"], bytes.fromhex(reply[3:]), timeout)
    except (OSError, KeyError, ValueError) as e:
        raise ConnectionLost(f"cannot fetch the staging segment from the daemon: {e}") from e
    return Segment(fds[0], writable=True, name="staging")


class TcpTransport:
    def __init__(self, host: str, port: int, timeout: float) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise lost(f"cannot reach the data plane at {host}:{port}", e) from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        try:
            while views:
                sent = self.sock.sendmsg(views[:512])
                P.consume(views, sent)
        except OSError as e:
            raise ConnectionLost(f"data plane send failed: {e}") from e

    def recv_into(self, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        got, n = 0, len(mv)
        try:
            while got < n:
                k = self.sock.recv_into(mv[got:])
                if k == 0:
                    raise ConnectionLost("the daemon closed the data connection")
                got += k
        except OSError as e:
            raise ConnectionLost(f"data plane receive failed: {e}") from e

    def recv_many(self, bufs: Sequence[memoryview]) -> None:
        for b in bufs:
            self.recv_into(b)

    def exchange(self, frame: Sequence[bytes | memoryview], head: memoryview, steps: ReplySteps) -> None:
        """Send ``frame`` (if any), then receive a reply: its header into ``head``, the metadata
        into the buffer ``steps.meta()`` names, the payload into the ones ``steps.payload()``
        names (:class:`ReplySteps`)."""
        if frame:
            self.send(frame)
        self.recv_into(head)
        self.recv_into(steps.meta())
        self.recv_many(steps.payload())

    def close(self) -> None:
        self.sock.close()


def import_ucxx() -> Any:
    apply_ucx_env()
    try:
        import ucxx
    except ImportError as e:
        raise ConfigError(
            f"plane='ucx' needs ucxx ({e}): `pip install 'kvstore-llm[ucx]'`, or use plane='tcp'"
        ) from e
    return ucxx


class UcxTransport:
    """ucxx is asyncio-only: a private event loop runs its calls, in the calling thread (the
    client's lock makes calls one at a time), and waits in that loop's epoll for the worker's
    events (:class:`kvstore.ucxenv.Progress`: no core spins). A caller whose thread already
    runs an event loop of its own gets the loop run on a helper thread instead."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.ucxx = import_ucxx()
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        self._errors = (self.ucxx.exceptions.UCXError, TimeoutError)
        self._progress: Progress | None = None
        try:
            self.ep = self._run(self._connect(host, port))
        except ConnectionLost:
            self._stop_loop()
            raise

    async def _connect(self, host: str, port: int) -> Any:
        self._progress = Progress.of_running_loop()
        with self._held():  # ucxx's own handshake timeout is 5 s: too short for a loaded machine
            return await self.ucxx.create_endpoint(host, port, connect_timeout=self.timeout)

    def _held(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._progress is None else self._progress.held()

    async def _close(self) -> None:
        with self._held():
            await self.ep.close()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the private loop, here: a trip into a loop thread and back cost two
        thread wake-ups per request, each a wait for a core on a loaded machine."""
        bounded = asyncio.wait_for(coro, self.timeout)
        try:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop runs in this thread: run ours here
                return self._loop.run_until_complete(bounded)
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-ucx")
            return self._helper.submit(self._loop.run_until_complete, bounded).result()
        except self._errors as e:
            raise ConnectionLost(f"UCX transfer failed: {e}") from e

    @staticmethod
    def _arr(b: bytes | memoryview) -> np.ndarray:
        return np.frombuffer(b, dtype=np.uint8)

    async def _send(self, bufs: Sequence[bytes | memoryview]) -> None:
        await send_all(self.ep, [self._arr(b) for b in bufs if len(b)])

    async def _recv(self, bufs: Sequence[memoryview]) -> None:
        await recv_all(self.ep, [self._arr(b) for b in bufs if len(b)])

    def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        self._run(self._send(list(bufs)))

    async def _exchange(self, frame: Sequence[bytes | memoryview], head: memoryview, steps: ReplySteps) -> None:
        if frame:
            await self._send(frame)
        await self._recv([head])
        await self._recv([steps.meta()])
        await self._recv(steps.payload())

    def exchange(self, frame: Sequence[bytes | memoryview], head: memoryview, steps: ReplySteps) -> None:
        """As :meth:`TcpTransport.exchange`, in one run of the UCX loop: a request and its
        reply's header, metadata and payload took four trips into its thread, each a wake-up of
        two threads, which at a load of 10-16 on two cores cost tens of milliseconds each."""
        self._run(self._exchange(list(frame), head, steps))

    def _stop_loop(self) -> None:
        if self._progress is not None:
            self._progress.close()
        self._loop.close()
        if self._helper is not None:
            self._helper.shutdown(wait=True)

    def close(self) -> None:
        with contextlib.suppress(ConnectionLost):  # the daemon is gone already
            self._run(self._close())
        self._stop_loop()


PayloadViews = Callable[[P.Header, bytearray], Sequence[memoryview]]
"""Where a reply's payload lands, given its header and metadata."""


class ReplySteps:
    """What a transport's ``exchange`` asks between the parts of one reply: the buffer for its
    metadata once the header is in, the buffers for its payload once the metadata is in. Both
    only parse (no I/O, no lock), so the UCX transport runs them on its loop's thread; a reply
    that is malformed raises ProtocolError, one that ``into`` cannot place ConnectionLost."""

    def __init__(self, conn: FrameConn, req: int, head: bytearray, into: PayloadViews | None) -> None:
        self._conn, self._req, self._head, self._into = conn, req, head, into
        self.hdr: P.Header | None = None
        self.rmeta = bytearray()

    def meta(self) -> memoryview:
        self.hdr = P.parse_header(self._head, self._conn.limits, reply=True)
        self.rmeta = bytearray(self.hdr.meta_len)
        return memoryview(self.rmeta)

    def payload(self) -> Sequence[memoryview]:
        hdr = self.hdr
        assert hdr is not None
        P.check_crc(self._head, self.rmeta, hdr.crc)
        if hdr.req_id != self._req:
            raise P.ProtocolError(P.ErrorCode.BAD_FRAME, f"reply to request {hdr.req_id}, expected {self._req}")
        if hdr.op is P.Op.ERROR or self._into is None:
            return ()
        return self._into(hdr, self.rmeta)


class FrameConn:
    """Frame exchange over a transport: one request, one reply, in order.

    :meth:`release` sends a RELEASE without waiting for its reply: the reply is read before
    the next request's (:meth:`settle`), so a release costs no round trip on the path of the
    load that made it, and the daemon has handled it before anything this client sends next.
    :meth:`send` and :meth:`take` pipeline requests the same way: several on the wire at once,
    each reply read when its caller asks for it (or kept for it by whoever reads past it).
    """

    def __init__(self, transport: TcpTransport | UcxTransport) -> None:
        self.t = transport
        self._req = 0
        self._owed: list[tuple[int, bool]] = []
        """Requests whose replies are still to be read, oldest first: (id, kept): a RELEASE's
        reply is dropped, a :meth:`send`'s kept for its :meth:`take`."""
        self._kept: dict[int, tuple[P.Header, bytearray] | KVStoreError] = {}
        """Replies (or the daemon's refusals) read past for their :meth:`take`."""
        # Until HELLO says otherwise: room for the largest reply this client could ask for.
        self.limits = P.WireLimits(max_meta_bytes=64 + 16 * 65_536, max_payload_bytes=1 << 40)

    def _send(self, op: P.Op, meta: bytes, payload: Sequence[memoryview] = ()) -> int:
        req, frame = self._frame(op, meta, payload)
        self.t.send(frame)
        return req

    def _frame(self, op: P.Op, meta: bytes, payload: Sequence[memoryview] = ()) -> tuple[int, list[bytes | memoryview]]:
        self._req = (self._req + 1) & 0xFFFFFFFF
        n = sum(len(v) for v in payload)
        return self._req, [P.encode_header(op, self._req, meta, n), meta, *payload]

    def _reply(
        self, req: int, frame: Sequence[bytes | memoryview] = (), into: PayloadViews | None = None
    ) -> tuple[P.Header, bytearray]:
        """Send ``frame`` (if any) and read the reply to request ``req``; ``into(header, meta)``
        names the buffers its payload lands in (none without it)."""
        head = bytearray(P.HEADER_BYTES)
        steps = ReplySteps(self, req, head, into)
        try:
            self.t.exchange(frame, memoryview(head), steps)
        except P.ProtocolError as e:
            raise ConnectionLost(f"malformed reply from the daemon: {e}") from e
        hdr, rmeta = steps.hdr, steps.rmeta
        assert hdr is not None
        if hdr.op is P.Op.ERROR:
            code, msg = P.parse_error(rmeta)
            if code in P.FATAL and code is not P.ErrorCode.UNAUTHENTICATED:
                self.close()  # the daemon closes its end too
            raise _ERRORS.get(code, KVStoreError)(f"daemon: {msg}")
        return hdr, rmeta

    def call(
        self, op: P.Op, meta: bytes, payload: Sequence[memoryview] = (), into: PayloadViews | None = None
    ) -> tuple[P.Header, bytearray]:
        """One request and its reply; ``into(header, meta)`` names the buffers the reply's
        payload lands in (it raises ConnectionLost to refuse a reply it cannot place)."""
        self.settle()
        req, frame = self._frame(op, meta, payload)
        return self._reply(req, frame, into)

    def release(self, lease_id: int) -> None:
        """Give lease ``lease_id`` back; its reply is read by the next :meth:`settle`."""
        self._owed.append((self._send(P.Op.RELEASE, P.encode_u64(lease_id)), False))

    def send(self, op: P.Op, meta: bytes) -> int:
        """Send a request without waiting for its reply (no payload either way); returns its id
        for :meth:`take`. Every request sent must be taken (a reply taken by no one stays here)."""
        req = self._send(op, meta)
        self._owed.append((req, True))
        return req

    def take(self, req: int) -> tuple[P.Header, bytearray]:
        """The reply to request ``req`` (:meth:`send`), reading the replies before it first; the
        daemon's refusal of it raises here, as :meth:`call`'s would."""
        while req not in self._kept:
            if not self._owed:
                raise KeyError(f"request {req} was not sent with send(), or was taken already")
            self._read_owed()
        got = self._kept.pop(req)
        if isinstance(got, KVStoreError):
            raise got
        return got

    def _read_owed(self) -> None:
        req, kept = self._owed.pop(0)
        try:
            got: tuple[P.Header, bytearray] | KVStoreError = self._reply(req)
        except KVStoreError as e:  # a release of a lease the daemon had dropped; a refusal
            if not kept:
                log.debug("release (request %d) answered: %s", req, e)
            got = e
        if kept:
            self._kept[req] = got

    def settle(self) -> None:
        """Read the replies owed to earlier :meth:`release` and :meth:`send` calls (the latter
        kept for their :meth:`take`): once it returns, the daemon has every lease back (what a
        control call that follows may rely on)."""
        while self._owed:
            self._read_owed()

    def close(self) -> None:
        self.t.close()


__all__ = ["ConnectionLost", "ConnectionRefused", "DaemonUnavailableError", "FrameConn", "PayloadViews", "TcpTransport", "UcxTransport"]
