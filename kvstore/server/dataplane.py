"""The data plane: one session per client connection, over TCP (here) or UCX (ucx.py).

A session speaks the frames of :mod:`kvstore.wire.protocol`. Payloads never pass through
JSON or HTTP, and the daemon copies no block it serves from the DRAM arena: a GET takes a lease
on the blocks (promoting them into the arena if needed) and hands views of the arena straight to
``sendmsg``; a same-node client instead maps the arena itself, read-only, and receives offsets
(ACQUIRE), or writes into a daemon-made staging segment that the daemon puts from (PUT_SHM,
each block's checksum verified first). Neither segment has a name another process could open:
their descriptors reach the client through :mod:`kvstore.wire.fdpass`.

Failure containment: a malformed or oversized frame gets an error frame and that connection is
closed; a client that dies mid-transfer only ends its own session. Whatever a session holds
(leases, its staging segment) is given back when it ends, however it ends. A connection must
say HELLO within ``handshake_timeout`` and, once a header has begun, finish it within
``request_timeout``; a put is admitted against the tenant's quota and its bound on bytes in
flight *before* its payload is read; a lease not released within ``lease_timeout`` is taken
back (:mod:`kvstore.server.limits`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import logging
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvstore.api import Lease
from kvstore.block import payload_checksum
from kvstore.errors import KVStoreError, UsageError, error_kind
from kvstore.server.config import is_loopback
from kvstore.server.devcopy import CopyTimeout, DeviceCopier
from kvstore.server.limits import ConnectionGate, InflightBytes, peer_of, silent
from kvstore.server.metrics import Metrics
from kvstore.server.service import AuthError, Service, Tenant, classify
from kvstore.shm import Segment, memfd_segment
from kvstore.wire import protocol as P
from kvstore.wire.fdpass import FdServer

log = logging.getLogger(__name__)
T = TypeVar("T")

FRAME_TIMEOUT_S = 60.0
"""Once a header has arrived, the rest of its frame (and the reply) must move within this."""
_IOV_MAX = 512
RUN_MESSAGE_BYTES = 16 << 20
"""GET_RUNS: the largest run of blocks sent as one message (on UCX one rendezvous each)."""
_METRIC_OP = {P.Op.GET_RUNS: "get"}
"""The ``op`` label of ``kvstore_request_seconds``: a GET_RUNS is a get (the same request, its
payload sent in runs), so dashboards keep one series per operation whichever form a client uses."""


class ChannelClosed(Exception):
    """The peer went away."""


class Channel(ABC):
    """A byte transport with exact-length receives into caller buffers."""

    plane: str = ""
    local: bool = False
    """The peer is on this node (it may map shared memory)."""

    @abstractmethod
    async def recv_into(self, buf: memoryview) -> None:
        """Fill ``buf`` exactly, or raise ChannelClosed."""

    async def recv_many(self, bufs: Sequence[memoryview], received: Callable[[int], None]) -> None:
        """Fill each of ``bufs`` in order (on UCX: one message each, all posted at once);
        ``received(n)`` is told of the bytes in as they land."""
        for b in bufs:
            await self.recv_into(b)
            received(len(b))

    async def recv_some(self, buf: memoryview) -> int:
        """Wait for the first bytes of ``buf`` and return how many arrived (at least one; on a
        message transport, all of them)."""
        await self.recv_into(buf)
        return len(buf)

    @abstractmethod
    async def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        """Send ``bufs`` in order (on UCX: one message each; empty ones are skipped)."""

    @abstractmethod
    async def close(self) -> None: ...


class TcpChannel(Channel):
    plane = "tcp"

    def __init__(self, sock: socket.socket, local: bool) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.local = local
        self._loop = asyncio.get_running_loop()

    async def recv_into(self, buf: memoryview) -> None:
        mv = memoryview(buf).cast("B")
        got, n = 0, len(mv)
        while got < n:
            try:
                k = await self._loop.sock_recv_into(self.sock, mv[got:])
            except OSError as e:
                raise ChannelClosed(str(e)) from e
            if k == 0:
                raise ChannelClosed("peer closed the connection")
            got += k

    async def recv_some(self, buf: memoryview) -> int:
        try:
            k = await self._loop.sock_recv_into(self.sock, buf)
        except OSError as e:
            raise ChannelClosed(str(e)) from e
        if k == 0:
            raise ChannelClosed("peer closed the connection")
        return k

    async def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            try:
                sent = self.sock.sendmsg(views[:_IOV_MAX])
            except BlockingIOError:
                sent = 0
            except OSError as e:
                raise ChannelClosed(str(e)) from e
            P.consume(views, sent)
            if views:
                await self._writable()

    async def _writable(self) -> None:
        fut = self._loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_writer(fd, wake)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class DataContext:
    """What every session shares."""

    service: Service
    pool: ThreadPoolExecutor
    metrics: Metrics
    arena: memoryview | None
    """The daemon's own mapping of the DRAM arena (None when the first tier has none)."""
    node_id: str
    gate: ConnectionGate
    inflight: InflightBytes
    fds: FdServer | None = None
    """Hands the arena and staging descriptors to same-node clients (None: no arena)."""
    arena_fd: int = -1
    """A read-only descriptor of the arena: what a client granted shared memory gets."""
    devcopy: DeviceCopier | None = None
    """PUT_DEVICE's copies out of engines' GPU memory into the arena (None: no arena)."""

    async def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kw))


class RequestError(Exception):
    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_LINGERING: list[Segment] = []
"""Staging segments of ended sessions still mapped: a put that was in flight when its session
ended still holds a view of the bytes. Closed at the next chance."""


@atexit.register
def _forget_lingering() -> None:
    # At exit a view that kept a segment mapped may still be alive (held by a traceback); the
    # process's end unmaps it anyway.
    for seg in _LINGERING:
        seg.forget()


def close_lingering() -> int:
    """Close the unlinked staging segments no view holds any more; returns how many remain."""
    kept: list[Segment] = []
    for shm in _LINGERING:
        try:
            shm.close()
        except BufferError:
            kept.append(shm)
    _LINGERING[:] = kept
    return len(kept)


class Session:
    """One client connection; see the module docstring."""

    def __init__(self, channel: Channel, ctx: DataContext) -> None:
        self.ch = channel
        self.ctx = ctx
        lim = ctx.service.limits
        self.wire = P.WireLimits(lim.max_meta_bytes, lim.max_payload_bytes)
        self.tenant: Tenant | None = None
        self.leases: dict[int, tuple[Lease, float]] = {}
        """lease id -> (lease, deadline on the loop's clock)"""
        self.staging: Segment | None = None
        self.devices: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        """CUDA IPC handles this connection's PUT_DEVICEs opened (``kvstore.server.devcopy``)."""
        self.busy = False
        self._unread = 0  # payload bytes of the current frame not read yet
        self._next_lease = 1
        self.task: asyncio.Task[None] | None = None

    def displace(self) -> None:
        """Closed to admit a newer connection (the connection gate): it never authenticated."""
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        m = self.ctx.metrics
        m.connections.labels(self.ch.plane).inc()
        lim = self.ctx.service.limits
        try:
            async with asyncio.timeout(lim.handshake_timeout_s):  # HELLO, whole, or the door
                if not await self._next_frame():
                    return
            while await self._next_frame():
                pass
        except ChannelClosed:
            pass
        except TimeoutError:
            m.timeouts.labels(self.ch.plane, "handshake" if self.tenant is None else "frame").inc()
            log.info("%s client stalled (no HELLO within %.0f s, a header cut short for %.0f s, or a "
                     "frame for %.0f s); closing it", self.ch.plane, lim.handshake_timeout_s,
                     lim.request_timeout_s, FRAME_TIMEOUT_S)
        finally:
            self.busy = False
            m.connections.labels(self.ch.plane).dec()
            await self._cleanup()

    async def _next_frame(self) -> bool:
        """Read and handle one frame; False when the connection must close. Idle between frames
        without a deadline (an engine's connection waits for its next request), but a header
        that has begun must be whole within ``request_timeout``."""
        head = bytearray(P.HEADER_BYTES)
        mv = memoryview(head)
        got = await self.ch.recv_some(mv)
        if got < len(mv):
            async with asyncio.timeout(self.ctx.service.limits.request_timeout_s):
                await self.ch.recv_into(mv[got:])
        self.busy = True
        try:
            return await self._frame(head)
        finally:
            self.busy = False

    async def _frame(self, head: bytearray) -> bool:
        """Handle one frame; False when the connection must close."""
        req_id = 0
        t0 = time.perf_counter()
        op = "bad"
        try:
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                try:
                    hdr = P.parse_header(head, self.wire)
                    req_id, op = hdr.req_id, _METRIC_OP.get(hdr.op) or hdr.op.name.lower()
                    meta = bytearray(hdr.meta_len)
                    if hdr.meta_len:
                        await self.ch.recv_into(memoryview(meta))
                    P.check_crc(head, meta, hdr.crc)
                    self._unread = hdr.payload_len
                    await self._dispatch(hdr, meta)
                except P.ProtocolError as e:
                    self.ctx.metrics.observe(self.ch.plane, op, time.perf_counter() - t0, "bad_frame")
                    await self._error(req_id, e.code, str(e))
                    return not e.fatal
                except RequestError as e:
                    self.ctx.metrics.observe(self.ch.plane, op, time.perf_counter() - t0, e.code.name.lower())
                    await self._drain()
                    await self._error(req_id, e.code, str(e))
                    return e.code not in P.FATAL
        except (ChannelClosed, TimeoutError):
            raise
        except Exception:
            log.exception("data-plane request %s failed; closing that connection", op)
            with contextlib.suppress(ChannelClosed, TimeoutError):
                await self._error(req_id, P.ErrorCode.INTERNAL, "internal error in the daemon; see its log")
            return False
        self.ctx.metrics.observe(self.ch.plane, op, time.perf_counter() - t0)
        return True

    async def _error(self, req_id: int, code: P.ErrorCode, msg: str) -> None:
        meta = P.encode_error(code, msg)
        await self.ch.send([P.encode_header(P.Op.ERROR, req_id, meta, 0), meta])

    async def _reply(self, req_id: int, meta: bytes, payload: Sequence[memoryview] = ()) -> None:
        n = sum(len(v) for v in payload)
        await self.ch.send([P.encode_header(P.Op.REPLY, req_id, meta, n), meta, *payload])

    def _received(self, n: int) -> None:
        self._unread -= n

    async def _drain(self) -> None:
        scratch = memoryview(bytearray(min(self._unread, 1 << 20)))
        while self._unread:
            k = min(self._unread, len(scratch))
            await self.ch.recv_into(scratch[:k])
            self._unread -= k

    async def _call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """A blocking service call in the pool; its errors become error frames."""
        try:
            return await self.ctx.run(fn, *args, **kw)
        except Exception as e:
            if (refusal := _refusal(e)) is None:
                raise
            raise refusal from e

    @staticmethod
    def _inline(fn: Callable[..., T], *args: Any) -> T:
        """A service call that only reads the service's own maps (a namespace's block size), on
        the loop: a pool hop for it cost a load two thread wake-ups on a busy machine."""
        try:
            return fn(*args)
        except Exception as e:
            if (refusal := _refusal(e)) is None:
                raise
            raise refusal from e

    # ---- ops ----------------------------------------------------------------------------------

    async def _dispatch(self, hdr: P.Header, meta: bytearray) -> None:
        op = hdr.op
        if op is P.Op.HELLO:
            return await self._hello(hdr, meta)
        if self.tenant is None:
            raise P.ProtocolError(P.ErrorCode.UNAUTHENTICATED, "send HELLO with your bearer token first")
        if op is not P.Op.PUT and hdr.payload_len:
            raise P.ProtocolError(P.ErrorCode.BAD_FRAME, f"{op.name} carries no payload")
        handler = {
            P.Op.GET: self._get,
            P.Op.GET_RUNS: self._get,
            P.Op.PUT: self._put,
            P.Op.ACQUIRE: self._acquire,
            P.Op.RELEASE: self._release,
            P.Op.STAGING: self._staging,
            P.Op.PUT_SHM: self._put_shm,
            P.Op.PUT_DEVICE: self._put_device,
            P.Op.LOOKUP: self._lookup,
            P.Op.LOOKUP_LEASE: self._lookup_lease,
        }[op]
        await handler(hdr, meta)

    async def _hello(self, hdr: P.Header, meta: bytearray) -> None:
        try:
            token = bytes(meta).decode("utf-8")
        except UnicodeDecodeError:
            raise P.ProtocolError(P.ErrorCode.BAD_FRAME, "the HELLO token is not UTF-8") from None
        try:
            self.tenant = self.ctx.service.authenticate(token or None)
        except AuthError as e:
            raise P.ProtocolError(P.ErrorCode.UNAUTHENTICATED, str(e)) from None
        self.ctx.gate.prove(self)  # never closed to make room for an unauthenticated one
        lim = self.ctx.service.limits
        fds = self.ctx.fds
        shm = self.tenant.spec.allow_shm and self.ch.local and self.ctx.arena is not None and fds is not None
        info = {
            "version": P.VERSION,
            "tenant": self.tenant.name,
            "node_id": self.ctx.node_id,
            "arena": self.ctx.service.arena if shm else None,
            "max_blocks": lim.max_blocks,
            "max_payload_bytes": lim.max_payload_bytes,
            "max_staging_bytes": lim.max_staging_bytes,
            "put_tokens": True,  # PUT / PUT_SHM may carry their blocks' token ids (protocol.PUT_TOKENS)
            "lookup": True,  # LOOKUP frames: an engine's lookups without the HTTP control plane
            "lookup_lease": True,  # LOOKUP_LEASE: a lookup that leases what the arena holds of it
            "get_runs": True,  # GET_RUNS: a GET whose payload moves in runs (one UCX message each)
            # PUT_DEVICE: the daemon copies a GPU engine's blocks out of its device memory itself
            "put_device": False,
            # ... after a CUDA IPC event (DEVICE_AFTER_EVENT): sent before the buffer is filled
            "put_device_event": False,
        }
        if shm:
            why = await self.ctx.run(self._put_device_unavailable)
            info["put_device"] = info["put_device_event"] = why is None
            if why is not None:
                info["put_device_unavailable"] = why  # for the engine's log: why its saves take PUT_SHM
        if shm:
            assert fds is not None
            # The arena has no name to open: a read-only descriptor, fetched with this ticket.
            try:
                ticket = fds.offer([self.ctx.arena_fd], self.tenant.name, (id(self), "arena"))
            except OSError as e:  # out of descriptors (EMFILE): this connection goes without the arena
                log.warning("a %s connection of tenant %r gets no shared memory (%s): it moves its blocks "
                            "over the socket; raise the daemon's descriptor limit (LimitNOFILE)",
                            self.ch.plane, self.tenant.name, e)
                info.update(arena=None, put_device=False, put_device_event=False)
                info.pop("put_device_unavailable", None)
            else:
                info["shm_socket"] = fds.address
                info["arena_ticket"] = ticket.hex()
        await self._reply(hdr.req_id, json.dumps(info).encode())

    def _shm_allowed(self) -> Tenant:
        t = self.tenant
        assert t is not None
        if not t.spec.allow_shm:
            raise RequestError(P.ErrorCode.FORBIDDEN, f"tenant {t.name!r} may not use shared memory; use TCP")
        if not self.ch.local:
            raise RequestError(P.ErrorCode.FORBIDDEN, "shared memory is for clients on the daemon's node only")
        return t

    async def _lookup(self, hdr: P.Header, meta: bytearray) -> None:
        """As ``POST /v1/lookup`` by hashes: answered on the loop from memory when the store is
        not busy (no thread hop), else in the pool. Over HTTP the daemon spent ~0.3 ms of CPU
        per lookup at rest (uvicorn, FastAPI, JSON), which a loaded box stretched past 1 ms."""
        r, _ = await self._lookup_result(meta)
        await self._reply(hdr.req_id, r if isinstance(r, bytes) else P.encode_lookup(r.num_blocks, r.tiers, r.unavailable))

    async def _lookup_result(self, meta: bytearray) -> tuple[Any, P.BlockRequest | None]:
        """A LOOKUP's result and its parsed request, or its refusal (bytes: a user's error,
        named by class as the HTTP error body does: an error code alone would turn a
        LayoutMismatchError into a MissingPrefixError, both CONFLICT, at the client) and None."""
        svc, t = self.ctx.service, self.tenant
        assert t is not None
        try:
            if len(meta) > INLINE_LOOKUP_META:  # parsed and answered in the pool, whole
                return await self.ctx.run(_lookup_blocking, svc, t, meta)
            req = P.parse_blocks(meta, svc.limits.max_blocks)
            return svc.lookup_nowait(t, req.ns_id, req.hashes) or await self.ctx.run(
                svc.lookup, t, req.ns_id, req.hashes), req
        except Exception as e:
            code, status = classify(e)
            if code is P.ErrorCode.INTERNAL:
                raise
            return P.encode_refusal(error_kind(e) or "KVStoreError", status, str(e)), None

    async def _lookup_lease(self, hdr: P.Header, meta: bytearray) -> None:
        """LOOKUP_LEASE: a LOOKUP, and a lease on the leading blocks of its answer that the arena
        holds (as ACQUIRE's, released by RELEASE or at its deadline): the scheduler of an
        engine on this node looks a prompt up and its worker copies from the lease without an
        ACQUIRE of its own. Right after the lookup on the loop (nothing moves in between); no
        lease where ACQUIRE would be refused or would wait (another plane, no shared memory
        for the tenant, this connection's lease limit, the tenant's share of the arena, a
        block on a lower tier, a busy store): the answer is the lookup's all the same."""
        r, req = await self._lookup_result(meta)
        if req is None:
            await self._reply(hdr.req_id, P.encode_lookup_lease(r))
            return
        lookup = P.encode_lookup(r.num_blocks, r.tiers, r.unavailable)
        svc, t = self.ctx.service, self.tenant
        assert t is not None
        tier = svc.store.arena_tier
        k = 0
        if tier is not None:
            while k < r.num_blocks and r.tiers[k] == tier.name:
                k += 1
        k = min(k, INLINE_ACQUIRE_BLOCKS)  # (what an ACQUIRE serves on the loop; the worker leases the rest)
        lease = None
        if (k and t.spec.allow_shm and self.ch.local and self.ctx.arena is not None
                and len(self.leases) < svc.limits.max_leases):
            try:
                lease = svc.acquire_nowait(t, req.ns_id, req.hashes[:k])
            except KVStoreError as e:  # the tenant's share of the arena is held already, say
                log.debug("LOOKUP_LEASE of %d blocks for %r: no lease (%s)", k, t.name, e)
        if lease is None or not lease.locations:
            if lease is not None:
                await self._give_back(lease)
            await self._reply(hdr.req_id, P.encode_lookup_lease(lookup))
            return
        await self._reply(hdr.req_id, P.encode_lookup_lease(lookup, self._hold(lease), lease.locations))

    async def _get(self, hdr: P.Header, meta: bytearray) -> None:
        svc, t = self.ctx.service, self.tenant
        runs: list[int] | None = None
        if hdr.op is P.Op.GET_RUNS:
            req, runs = P.parse_get_runs(meta, svc.limits.max_blocks)
        else:
            req = P.parse_blocks(meta, svc.limits.max_blocks)
        bb = self._inline(svc.block_bytes, t, req.ns_id)
        hashes = req.hashes[: max(1, svc.limits.max_payload_bytes // bb)]
        lease = None
        if self.ctx.arena is not None:
            lease = await self._call(svc.acquire, t, req.ns_id, hashes, for_client=False)
            if lease.num_blocks < len(hashes) and (await self._call(svc.peek, t, req.ns_id, hashes)).num_blocks > lease.num_blocks:
                # The arena could not take the whole prefix (full of blocks in use): serve it
                # from where it is, through a buffer, rather than a shorter hit.
                await self.ctx.run(svc.release, lease)
                lease = None
        if lease is not None:
            try:
                arena = self.ctx.arena
                assert arena is not None
                locs = lease.locations  # a block of another size is of another namespace: the hit ends
                k = next((i for i, (_, size) in enumerate(locs) if size != bb), len(locs))
                offsets = [off for off, _ in locs[:k]]
                n = len(offsets)
                await self._send_blocks(hdr.req_id, arena, offsets, bb, runs)
            finally:
                await self.ctx.run(svc.release, lease)
        else:
            buf = np.empty(len(hashes) * bb, np.uint8)
            n = await self._call(svc.get_into, t, req.ns_id, hashes, buf)
            await self._send_blocks(hdr.req_id, buf.data, [i * bb for i in range(n)], bb, runs)
        self.ctx.metrics.bytes.labels(self.ch.plane, "out").inc(n * bb)

    async def _send_blocks(
        self, req_id: int, src: memoryview, offsets: list[int], bb: int, runs: list[int] | None
    ) -> None:
        """A GET's reply: blocks at ``offsets`` of ``src``. For GET_RUNS (``runs``: the caller's
        destination runs) blocks go in runs, each back to back in ``src`` and in one run of the
        caller's, of at most :data:`RUN_MESSAGE_BYTES`, named in the reply's metadata: on UCX
        each run is one message, and 4-16 MiB messages moved 1.6-2x the bytes of 1 MiB ones
        posted at once (docs/benchmarks.md)."""
        if runs is None:
            views = [src[off : off + bb] for off in offsets]
            await self._reply(req_id, P.encode_data_meta(len(views), bb), views)
            return
        cap = max(1, RUN_MESSAGE_BYTES // bb)
        cuts = _run_ends(runs, len(offsets))
        msgs: list[int] = []
        views = []
        i = 0
        while i < len(offsets):
            j = i + 1
            while j < len(offsets) and j - i < cap and j not in cuts and offsets[j] == offsets[j - 1] + bb:
                j += 1
            msgs.append(j - i)
            views.append(src[offsets[i] : offsets[i] + (j - i) * bb])
            i = j
        await self._reply(req_id, P.encode_runs_meta(len(offsets), bb, msgs), views)

    async def _put(self, hdr: P.Header, meta: bytearray) -> None:
        svc, t = self.ctx.service, self.tenant
        req = P.parse_put(meta, svc.limits.max_blocks)
        bb = await self._call(svc.block_bytes, t, req.ns_id)
        count = len(req.hashes) - req.start
        tok_bytes = count * 4 * (await self._call(svc.namespace, t, req.ns_id)).block_tokens if req.tokens else 0
        if hdr.payload_len != count * bb + tok_bytes:
            raise RequestError(
                P.ErrorCode.BAD_REQUEST,
                f"payload of {hdr.payload_len} bytes is not {count} blocks of {bb} bytes"
                + (f" and {tok_bytes} bytes of their token ids" if tok_bytes else ""),
            )
        assert t is not None
        # Quota and the bound on bytes in flight before a byte of payload is read: a refused
        # put is drained through a small scratch buffer, a waiting one stays in the socket.
        reserved = await self._call(svc.reserve, t, req.ns_id, len(req.hashes), req.start)
        try:
            await self.ctx.inflight.acquire(t.name, hdr.payload_len)
            try:
                buf = np.empty(count * bb, np.uint8)
                mv = buf.data
                # One receive per block (UCX messages are blocks), posted at once on UCX: one
                # at a time, each block's rendezvous waited for the one before.
                await self.ch.recv_many([mv[i * bb : (i + 1) * bb] for i in range(count)], self._received)
                tokens = None
                if tok_bytes:  # one more message: the token ids
                    tokens = np.empty(tok_bytes // 4, "<i4")
                    await self.ch.recv_into(tokens.data.cast("B"))
                    self._unread -= tok_bytes
                new = await self._call(svc.put, t, req.ns_id, req.hashes, buf, req.start, req.durable,
                                       reserved=reserved, tokens=tokens)
            finally:
                await self.ctx.inflight.release(t.name, hdr.payload_len)
        finally:
            svc.unreserve(reserved)  # once: a put that gave it back already is not counted twice
        self.ctx.metrics.bytes.labels(self.ch.plane, "in").inc(hdr.payload_len)
        await self._reply(hdr.req_id, P.encode_u64(new))

    async def _acquire(self, hdr: P.Header, meta: bytearray) -> None:
        svc, t = self.ctx.service, self._shm_allowed()
        if len(self.leases) >= svc.limits.max_leases:
            raise RequestError(
                P.ErrorCode.BAD_REQUEST, f"this connection holds {len(self.leases)} leases; release some first"
            )
        req = P.parse_blocks(meta, svc.limits.max_blocks)
        # On the loop when the arena serves it at once (no pool hop: two thread wake-ups that
        # a busy machine stretched to a millisecond), else in the pool.
        lease = (self._inline(svc.acquire_nowait, t, req.ns_id, req.hashes)
                 if len(req.hashes) <= INLINE_ACQUIRE_BLOCKS else None)
        if lease is None:
            lease = await self._call(svc.acquire, t, req.ns_id, req.hashes)
        await self._reply(hdr.req_id, P.encode_lease(self._hold(lease), lease.locations))

    def _hold(self, lease: Lease) -> int:
        """Keep ``lease`` for this connection until its RELEASE or its deadline; its id."""
        lease_id = self._next_lease
        self._next_lease += 1
        self.leases[lease_id] = (lease, asyncio.get_running_loop().time() + self.ctx.service.limits.lease_timeout_s)
        self.ctx.metrics.leases.inc()
        return lease_id

    async def _release(self, hdr: P.Header, meta: bytearray) -> None:
        held = self.leases.pop(P.parse_u64(meta), None)
        if held is not None:  # an unknown id: released already (a retry, or its deadline passed)
            await self._give_back(held[0])
        # Replied once the store has the blocks back, so a client's next call (a delete, a
        # put that needs the room) sees the release: the control plane is another socket.
        await self._reply(hdr.req_id, b"")

    async def _give_back(self, lease: Lease) -> None:
        self.ctx.metrics.leases.dec()
        if self.ctx.service.release_nowait(lease, self.tenant):
            return
        # shield: a cancelled session (shutdown) must still give its leases back
        await asyncio.shield(self.ctx.run(self.ctx.service.release, lease, self.tenant))

    async def expire_leases(self, now: float) -> int:
        """Release the leases whose deadline has passed (``now`` on the loop's clock)."""
        due = [i for i, (_, deadline) in self.leases.items() if deadline <= now]
        for i in due:
            lease, _ = self.leases.pop(i)
            await self._give_back(lease)
        if due:
            self.ctx.metrics.leases_expired.inc(len(due))
            log.info("released %d lease(s) of tenant %r not released within %.0f s", len(due),
                     self.tenant.name if self.tenant else "?", self.ctx.service.limits.lease_timeout_s)
        return len(due)

    async def _staging(self, hdr: P.Header, meta: bytearray) -> None:
        self._shm_allowed()
        size = P.parse_u64(meta)
        limit = self.ctx.service.limits.max_staging_bytes
        if not 0 < size <= limit:
            raise RequestError(P.ErrorCode.BAD_REQUEST, f"staging size must be 1..{limit} bytes, got {size}")
        self._close_staging()
        fds = self.ctx.fds
        if fds is None:
            raise RequestError(P.ErrorCode.FORBIDDEN, "this daemon has no shared-memory plane; use TCP")
        try:
            self.staging = memfd_segment(size, f"kvs-stage-{secrets.token_hex(4)}")
        except OSError as e:
            raise RequestError(P.ErrorCode.UNAVAILABLE, f"cannot create a staging segment: {e}") from e
        # A memfd: no name, so only this client (handed the descriptor) and the daemon map it.
        # The daemon keeps its mapping, not the descriptor: a connection holds its socket and
        # at most two tickets (fdpass.py), whatever it sends.
        ticket = fds.offer([self.staging.fileno()], self.tenant.name if self.tenant else "", (id(self), "staging"))
        self.staging.close_fd()
        await self._reply(hdr.req_id, b"fd:" + ticket.hex().encode())

    async def _put_shm(self, hdr: P.Header, meta: bytearray) -> None:
        svc, t = self.ctx.service, self._shm_allowed()
        req = P.parse_put(meta, svc.limits.max_blocks, shm=True)
        if self.staging is None:
            raise RequestError(P.ErrorCode.BAD_REQUEST, "no staging segment: send STAGING first")
        bb = await self._call(svc.block_bytes, t, req.ns_id)
        n = (len(req.hashes) - req.start) * bb
        bt = (await self._call(svc.namespace, t, req.ns_id)).block_tokens if req.tokens else 0
        tok_bytes = (len(req.hashes) - req.start) * 4 * bt
        off = req.staging_offset
        if off + n + tok_bytes > self.staging.size:
            raise RequestError(
                P.ErrorCode.BAD_REQUEST,
                f"bytes {off}..{off + n + tok_bytes} are outside the {self.staging.size}-byte staging segment",
            )
        src = self.staging.buf[off : off + n]
        # The token ids are copied out: the client may reuse its staging once we reply.
        tokens = np.frombuffer(self.staging.buf[off + n : off + n + tok_bytes], "<i4").copy() if tok_bytes else None
        try:
            bad = None if req.checksums is None else await self.ctx.run(_first_mismatch, src, req.checksums, bb)
            if bad is not None:
                raise RequestError(
                    P.ErrorCode.BAD_REQUEST,
                    f"block {req.start + bad} of this PUT_SHM does not match its checksum: the staged "
                    "bytes are not the ones the client checksummed; nothing was stored",
                )
            new = await self._call(svc.put, t, req.ns_id, req.hashes, src, req.start, req.durable, tokens=tokens)
        finally:
            src.release()
        self.ctx.metrics.bytes.labels(self.ch.plane + "+shm", "in").inc(n)
        await self._reply(hdr.req_id, P.encode_u64(new))

    def _put_device_unavailable(self) -> str | None:
        """Why this daemon cannot take PUT_DEVICE from a shared-memory client; None when it can."""
        if self.ctx.devcopy is None:
            return "the daemon's arena is not writable here"
        why = self.ctx.service.store.reservable()
        if why is not None:
            return why
        return None if self.ctx.devcopy.available() else self.ctx.devcopy.why

    async def _put_device(self, hdr: P.Header, meta: bytearray) -> None:
        """PUT_DEVICE (``kvstore.server.devcopy``): arena slots reserved for the new blocks,
        filled by device-to-host DMAs from the client's exported GPU buffer, then committed.
        Copies past ``put_device_timeout`` fail the request with their slots set aside; a
        tenant whose set-aside copies have not landed yet is refused until they have."""
        svc, t = self.ctx.service, self._shm_allowed()
        req = P.parse_put_device(meta, svc.limits.max_blocks)
        copier = self.ctx.devcopy
        # Both on the loop once the runtime is loaded: a pool hop each cost a save two thread
        # wake-ups before its reservation.
        ok = copier.known() if copier is not None else False
        if copier is not None and ok is None:  # (the first PUT_DEVICE: the runtime loads in the pool)
            ok = await self.ctx.run(copier.available)
        if copier is None or not ok:
            raise RequestError(P.ErrorCode.BAD_REQUEST,
                               "this daemon cannot copy from GPU memory (HELLO says put_device: false): use PUT_SHM")
        bb = self._inline(svc.block_bytes, t, req.ns_id)
        devices = self.devices

        marks: list[float] = []

        def fill(res: Any) -> int:
            marks.append(time.perf_counter())
            # The blocks' records are built while the DMAs run (Reservation.prepare): a commit
            # that built them under the store's lock took 18 ms for 2,048 blocks on an H100 host.
            marks.append(copier.copy(devices, req.device, req.handle, req.offset, req.size, bb, res.locations,
                                     res.first - req.start, after=req.event, meanwhile=res.prepare,
                                     quarantine=res.quarantine, owner=t.name))
            marks.append(time.perf_counter())
            dma_s = copier.last_dma_s
            if dma_s is not None:
                marks.append(dma_s)
            return int(res.num_blocks)

        def put() -> int:
            copier.sweep()  # the slots of earlier copies past their deadline that have landed since
            if held := copier.quarantined_slots(t.name):
                raise UsageError(
                    f"PUT_DEVICE refused, nothing stored: an earlier save of tenant {t.name!r} passed its deadline "
                    f"([server] put_device_timeout) and its copies, waiting on its CUDA event, still hold {held} "
                    "arena slots; until its GPU work completes, save through PUT_SHM")
            return svc.put_device(t, req.ns_id, req.hashes, req.start, fill)

        t0 = time.perf_counter()
        try:
            new = await self._call(put)
        except CopyTimeout as e:  # its slots stay set aside until the copies land (devcopy.sweep)
            self.ctx.metrics.put_device_timeouts.inc()
            raise RequestError(P.ErrorCode.BAD_REQUEST, f"PUT_DEVICE failed, nothing stored: {e}") from e
        except (OSError, ValueError) as e:  # a handle that does not open, a buffer too small
            raise RequestError(P.ErrorCode.BAD_REQUEST, f"PUT_DEVICE failed, nothing stored: {e}") from e
        if len(marks) >= 3:
            filled, queued, copied = marks[:3]
            phases = self.ctx.metrics.put_device
            for phase, s in (("reserve", filled - t0), ("queue", queued), ("wait", copied - filled - queued),
                             ("commit", time.perf_counter() - copied)):
                phases.labels(phase).observe(s)
            if len(marks) == 4:  # the DMAs' own device time (within queue + wait)
                phases.labels("dma").observe(marks[3])
        self.ctx.metrics.bytes.labels(self.ch.plane + "+device", "in").inc(new * bb)
        await self._reply(hdr.req_id, P.encode_u64(new))

    # ---- end of session -----------------------------------------------------------------------

    def _close_staging(self) -> None:
        if self.staging is not None:
            _LINGERING.append(self.staging)  # unmapped when no view holds it
            self.staging = None
        close_lingering()

    async def _cleanup(self) -> None:
        leases, self.leases = list(self.leases.values()), {}
        for lease, _ in leases:
            await self._give_back(lease)
        if self.devices and self.ctx.devcopy is not None:
            await self.ctx.run(self.ctx.devcopy.close_session, self.devices)
        self._close_staging()
        if self.ctx.fds is not None:  # tickets this connection never claimed
            for slot in ("arena", "staging"):
                self.ctx.fds.revoke_slot((id(self), slot))
        await self.ch.close()


INLINE_ACQUIRE_BLOCKS = 2048
"""An ACQUIRE of up to 2,048 blocks, all in the arena, is served on the loop when the store is
not busy (~1 µs a block: a 32K-token prompt of an 8B model at 16 tokens a block); a larger one,
or one that must read a slower tier, in the pool."""

INLINE_LOOKUP_META = 16 * 2048
"""A LOOKUP of up to 2,048 hashes is parsed and answered on the loop (from memory, when the store
is not busy); a larger one, up to ``max_blocks``, in the pool, so that it never delays another
connection's frames or /healthz (as ``POST /v1/lookup`` does with large bodies)."""


def _run_ends(runs: list[int], n: int) -> set[int]:
    """The block indices (< ``n``) where a new run of ``runs`` starts."""
    out, at = set(), 0
    for r in runs:
        at += r
        if at >= n:
            break
        out.add(at)
    return out


def _lookup_blocking(svc: Service, t: Tenant, meta: bytearray) -> tuple[Any, P.BlockRequest]:
    req = P.parse_blocks(meta, svc.limits.max_blocks)
    return svc.lookup(t, req.ns_id, req.hashes), req


def _refusal(e: Exception) -> RequestError | None:
    """The error frame of a service call's exception; None for a bug (INTERNAL: it is raised as
    it is, logged, and the connection closed)."""
    code, _ = classify(e)
    return None if code is P.ErrorCode.INTERNAL else RequestError(code, str(e))


def _first_mismatch(src: memoryview, checksums: Sequence[int], bb: int) -> int | None:
    """The first block of ``src`` whose xxh3-64 is not its checksum, or None."""
    if len(checksums) * bb != len(src):
        return 0
    for i, want in enumerate(checksums):
        if payload_checksum(src[i * bb : (i + 1) * bb]) != want:
            return i
    return None


class TcpDataServer:
    """Accepts data-plane connections; one :class:`Session` task each."""

    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        self.sessions: dict[asyncio.Task[None], Session] = {}
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None

    def bind(self, host: str, port: int) -> int:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        return self.adopt(socket.create_server((host, port), family=fam, backlog=1024))

    def adopt(self, sock: socket.socket) -> int:
        """Serve on a listening socket bound already; returns its port."""
        self._sock = sock
        sock.setblocking(False)
        return int(sock.getsockname()[1])

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._accept = loop.create_task(self._accept_loop())
        self._reaper = loop.create_task(reap_leases(self.sessions, lease_check_interval(self.ctx)))

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as e:
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.05)  # e.g. out of file descriptors: do not spin
                continue
            peer = peer_of(addr)
            s = Session(TcpChannel(conn, is_loopback(addr[0])), self.ctx)
            if not self.ctx.gate.admit(peer, s, s.displace, functools.partial(silent, conn.fileno())):
                conn.close()  # over a limit: the clients already connected carry on
                continue
            task = loop.create_task(s.run())
            s.task = task
            self.sessions[task] = s
            task.add_done_callback(functools.partial(self._ended, peer, s))

    def _ended(self, peer: str, s: Session, task: asyncio.Task[None]) -> None:
        self.sessions.pop(task, None)
        self.ctx.gate.leave(peer, s)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; let requests in flight finish (up to ``grace_s``); end every session."""
        for task in (self._accept, self._reaper):
            if task is not None:
                task.cancel()
        if self._sock is not None:
            self._sock.close()
        await stop_sessions(self.sessions, grace_s)


def lease_check_interval(ctx: DataContext) -> float:
    return min(1.0, ctx.service.limits.lease_timeout_s / 4)


async def reap_leases(sessions: dict[asyncio.Task[None], Session], interval_s: float) -> None:
    """Forever: take back the leases of ``sessions`` whose deadline has passed."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        for s in list(sessions.values()):
            if s.leases:
                try:
                    await s.expire_leases(loop.time())
                except Exception:
                    log.exception("releasing expired leases failed; will retry")


async def stop_sessions(sessions: dict[asyncio.Task[None], Any], grace_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while any(s.busy for s in sessions.values()) and loop.time() < deadline:
        await asyncio.sleep(0.01)  # bounded wait for requests in flight
    tasks = list(sessions)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)

