"""What keeps one client from taking the daemon down: connection limits and request deadlines.

* :class:`ConnectionGate`: open connections of both planes together, per peer address and in
  all, kept under the process's descriptor limit. A connection over a limit is closed as soon as
  it is accepted, so the daemon never runs out of descriptors and the clients already connected
  (and ``/healthz`` on their keep-alive connections) carry on.
* :func:`gated_http_protocol`: uvicorn's HTTP protocol with the gate and a deadline on every
  request's head and body (uvicorn times out idle keep-alive connections, but not a connection
  that never sends a request, nor one that sends half of one).
* :class:`InflightBytes`: payload bytes of one tenant's puts being received at once; a put over
  the bound waits, and meanwhile its bytes stay in the client's socket (TCP backpressure).
* :class:`ZmqPortGate`: the same gate for ports that ZeroMQ accepts on (the KV event ports).

The data plane's own deadlines (a HELLO within ``handshake_timeout``, the rest of a header
within ``request_timeout``) are in :mod:`kvstore.server.dataplane`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import resource
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

RESERVED_FDS = 256
"""Descriptors kept for the store's own files (RocksDB, the slab, objects, logs) and the pool."""


def descriptor_budget(configured: int, extra: int = 0) -> int:
    """``configured`` connections, or fewer when RLIMIT_NOFILE would run out first, keeping
    :data:`RESERVED_FDS` and ``extra`` more (the fd-passing tickets' bound) for the daemon. The
    soft limit is raised to the hard one first (what a daemon may do for itself)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return configured
    keep = RESERVED_FDS + extra
    room = max(16, soft - keep if soft > 2 * keep else soft // 2)
    if room < configured:
        log.warning("RLIMIT_NOFILE is %d: at most %d connections (max_connections = %d); raise "
                    "LimitNOFILE for more", soft, room, configured)
    return min(configured, room)


class ConnectionGate:
    """Counts open connections per peer and in all; not thread-safe (the event loop's).

    Fairness: every same-node engine is 127.0.0.1, so a local process with no token could fill
    the per-address limit with idle connections (renewing each as the handshake deadline
    closes it) and lock the engines out. A connection is *unproven* until it authenticates (a
    data connection's HELLO with a known token; an HTTP connection's first request carrying
    one, or any request when the daemon has no tenants); a new connection over a limit closes
    the oldest unproven one of its peer (or of anyone, over the total limit) instead of being
    refused. A flood of unauthenticated connections then only displaces itself: proven ones are
    never closed for it, and a real client's connection, which authenticates as it connects,
    is served before a flood can push it out."""

    def __init__(self, max_total: int, max_per_peer: int, on_refuse: Callable[[], None] | None = None,
                 what: str = "connections") -> None:
        self.max_total = max_total
        self._what = what
        self._on_refuse = on_refuse
        self.max_per_peer = max_per_peer
        self.total = 0
        self.refused = 0
        self.displaced = 0
        """Unproven connections closed to admit a newer one."""
        self._peers: Counter[str] = Counter()
        self._open: dict[Any, str] = {}
        """key -> peer of every connection counted (keys: the connection's own object)"""
        self._unproven: dict[Any, tuple[Callable[[], None], Callable[[], bool]]] = {}
        """key -> how to close it, and whether it is silent; oldest first"""
        self._last_warning = 0.0
        self.http: set[Any] = set()
        """The open HTTP connections (their protocols), for :func:`sweep_http`."""

    def admit(self, peer: str, key: Any = None, close: Callable[[], None] | None = None,
              silent: Callable[[], bool] = lambda: True) -> bool:
        """Count a new connection from ``peer``; False (and nothing counted) over a limit that
        no unproven connection can make room under. ``key`` (the connection's object) and
        ``close`` make it unproven until :meth:`prove`; without them it counts as proven.
        ``silent``: whether it has sent nothing yet (a silent one is displaced first: a real
        client's connection has its HELLO or request on the way)."""
        over_peer = self._peers[peer] >= self.max_per_peer
        if (self.total >= self.max_total or over_peer) and not self._displace(peer if over_peer else None):
            self._refuse(peer)
            return False
        self.total += 1
        self._peers[peer] += 1
        if key is not None:
            self._open[key] = peer
            if close is not None:
                self._unproven[key] = (close, silent)
        return True

    def prove(self, key: Any) -> None:
        """The connection ``key`` authenticated: never closed to make room for another."""
        self._unproven.pop(key, None)

    def _displace(self, peer: str | None) -> bool:
        """Close the oldest unproven connection (of ``peer``, or of anyone); False if none."""
        mine = [k for k in self._unproven if peer is None or self._open.get(k) == peer]
        victim = next((k for k in mine if self._unproven[k][1]()), mine[0] if mine else None)
        if victim is None:
            return False
        close, _ = self._unproven.pop(victim)
        self.leave(self._open[victim], victim)
        self.displaced += 1
        if self._on_refuse is not None:  # a connection closed over a limit, as a refused one
            self._on_refuse()
        close()
        return True

    def _refuse(self, peer: str) -> None:
        self.refused += 1
        if self._on_refuse is not None:
            self._on_refuse()
        now = time.monotonic()
        if now - self._last_warning > 10:  # one line per burst, not one per connection
            self._last_warning = now
            log.warning("refusing %s over the limit (%d open, %d from %s; limits %d and %d "
                        "per peer); %d refused so far", self._what, self.total, self._peers[peer], peer,
                        self.max_total, self.max_per_peer, self.refused)

    def forget(self, key: Any) -> None:
        """:meth:`leave` of the keyed connection ``key`` (nothing if it is not counted)."""
        peer = self._open.get(key)
        if peer is not None:
            self.leave(peer, key)

    def leave(self, peer: str, key: Any = None) -> None:
        """A connection closed (once per connection: a keyed one already displaced is not
        counted again)."""
        if key is not None:
            if self._open.pop(key, None) is None:
                return
            self._unproven.pop(key, None)
        self.total -= 1
        self._peers[peer] -= 1
        if self._peers[peer] <= 0:
            del self._peers[peer]


def silent(fd: int) -> bool:
    """Whether the peer of socket ``fd`` has sent nothing that waits unread (its HELLO or
    request may be in the socket before the loop has read it)."""
    if fd < 0:
        return True
    sock = socket.socket(fileno=fd)
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False  # closed or failed: it goes by itself
    finally:
        sock.detach()


ZMTP_GREETING = 64
"""Bytes of ZeroMQ's greeting (ZMTP 3), the first thing a real ZeroMQ peer sends."""
_TCPI_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info`` (since 4.1)."""


def accepted_socket(fd: int, port: int) -> socket.socket | None:
    """A non-owning socket object for ``fd`` if it is still a TCP connection accepted on local
    ``port`` (a descriptor a ZeroMQ monitor named may be closed, or reused, by the time it is
    looked at); None otherwise. The caller ``detach()``es it."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
            sock.detach()
            return None
        sock.getpeername()
    except (OSError, IndexError, TypeError):
        sock.detach()
        return None
    return sock


def close_accepted(fd: int, port: int, peer: str) -> None:
    """End the connection on ``fd`` accepted on ``port`` from ``peer`` (if ``fd`` still is one):
    ``shutdown``, so that its owner (ZeroMQ's I/O thread) sees the end and closes it itself."""
    sock = accepted_socket(fd, port)
    if sock is None:
        return
    try:
        if peer_of(sock.getpeername()) == peer:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def heard_greeting(fd: int, port: int) -> bool:
    """Whether the peer of the connection on ``fd`` (accepted on ``port``) sent at least a
    ZeroMQ greeting (the kernel's count of bytes received); False when it is gone."""
    sock = accepted_socket(fd, port)
    if sock is None:
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return False
    finally:
        sock.detach()
    if len(info) < _TCPI_BYTES_RECEIVED + 8:
        return True  # an old kernel: cannot tell, so never displace it first
    return int.from_bytes(info[_TCPI_BYTES_RECEIVED:_TCPI_BYTES_RECEIVED + 8], "little") >= ZMTP_GREETING


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_DROP_ALL = (_SockFilter * 1)(_SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K 0: keep no packet
_DROP_ALL_PROG = bytes(_SockFprog(1, _DROP_ALL))  # (points at _DROP_ALL, which lives as long as the module)
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27


def _listener(fd: int, port: int) -> socket.socket | None:
    """A non-owning socket object for ``fd`` if it is a TCP socket listening on ``port``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.getsockname()[1] == port:
            return sock
    except (OSError, IndexError, TypeError):
        pass
    sock.detach()
    return None


def pause_accepting(fd: int, port: int) -> bool:
    """Stop new connections reaching the listening socket ``fd`` (on ``port``) that another
    component accepts on (ZeroMQ's I/O thread): a socket filter that keeps no packet, so the
    kernel drops their SYNs (a client retries, from 1 s later) while the connections accepted
    before carry on. False if ``fd`` is not that listener."""
    sock = _listener(fd, port)
    if sock is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_ALL_PROG)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def resume_accepting(fd: int, port: int) -> None:
    """Undo :func:`pause_accepting`."""
    sock = _listener(fd, port)
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
    except OSError:
        pass  # no filter attached
    finally:
        sock.detach()


def peer_of(transport_or_addr: Any) -> str:
    addr = transport_or_addr
    if hasattr(addr, "get_extra_info"):
        addr = addr.get_extra_info("peername")
    if isinstance(addr, tuple) and addr:
        return str(addr[0])
    return str(addr or "")


def gated_http_protocol(gate: ConnectionGate, request_timeout_s: float,
                        on_timeout: Callable[[], None] | None = None,
                        authenticates: Callable[[str | None], bool] = lambda token: True) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the gate and the request deadline.

    The deadline is set when the connection opens and again after each reply, and cleared when
    a request has fully arrived (``on_message_complete``): it bounds the head and the body,
    never the daemon's own work on a request. Setting it is an attribute write; one sweep a
    second (:func:`sweep_http`) closes the connections past theirs, so a request pays no timer.
    A connection is proven (:meth:`ConnectionGate.prove`) by its first request whose bearer
    token ``authenticates``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GatedHttp(HttpToolsProtocol):  # type: ignore[misc, unused-ignore]  # Any without httptools
        _kv_peer: str | None = None
        kv_deadline: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn gives a Transport
            peer = peer_of(transport)
            sock = transport.get_extra_info("socket")
            fd = sock.fileno() if sock is not None else -1
            if not gate.admit(peer, self, transport.abort, lambda: not self._kv_heard and silent(fd)):
                transport.abort()
                return
            self._kv_peer = peer
            self._kv_proven = False
            self._kv_heard = False
            super().connection_made(transport)
            gate.http.add(self)
            self.kv_deadline = self.loop.time() + request_timeout_s

        def connection_lost(self, exc: Exception | None) -> None:
            if self._kv_peer is None:  # refused at the gate: uvicorn never saw it
                return
            gate.leave(self._kv_peer, self)
            gate.http.discard(self)
            self._kv_peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._kv_peer is not None:
                self._kv_heard = True
                super().data_received(data)

        def on_message_complete(self) -> None:
            self.kv_deadline = None
            if not self._kv_proven:
                auth = next((v for k, v in self.headers if k.lower() == b"authorization"), None)
                token = auth.decode("latin-1").partition(" ")[2] if auth else None
                if authenticates(token or None):
                    self._kv_proven = True
                    gate.prove(self)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.kv_deadline = self.loop.time() + request_timeout_s

        def kv_expire(self) -> None:
            self.kv_deadline = None
            if not self.transport.is_closing():
                if on_timeout is not None:
                    on_timeout()
                self.transport.close()

    return GatedHttp


async def sweep_http(gate: ConnectionGate, interval_s: float = 1.0) -> None:
    """Forever: close the HTTP connections of ``gate`` past their request deadline."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        now = loop.time()
        for proto in [p for p in gate.http if p.kv_deadline is not None and p.kv_deadline <= now]:
            proto.kv_expire()


class InflightBytes:
    """Payload bytes being received per tenant, bounded; waiters are woken in turn."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: defaultdict[str, int] = defaultdict(int)
        self._cond: asyncio.Condition | None = None

    async def acquire(self, tenant: str, n: int) -> None:
        """Wait until ``n`` more bytes of ``tenant`` fit (always, when it has none in flight)."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: self._held[tenant] == 0 or self._held[tenant] + n <= self.limit)
            self._held[tenant] += n

    async def release(self, tenant: str, n: int) -> None:
        assert self._cond is not None
        async with self._cond:
            self._held[tenant] -= n
            if self._held[tenant] <= 0:
                del self._held[tenant]
            self._cond.notify_all()

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)



def _silent_on(fd: int, port: int) -> bool:
    """Whether the connection ``fd`` on ``port`` has sent no ZeroMQ greeting yet."""
    return not heard_greeting(fd, port)

class ZmqPortGate:
    """Connections to ZeroMQ sockets bound on TCP ports (the KV event ports) under a
    :class:`ConnectionGate`, as the data and HTTP planes' are: ZeroMQ accepts them on its own
    thread, so the gate learns of each from the socket's monitor (which names its descriptor)
    and ends one over a limit with ``shutdown``, after which ZeroMQ closes it.

    Proof: ZeroMQ closes a connection that has not completed its handshake (PLAIN
    authentication included, with tenants) by ``handshake_s``; one still open a second past it
    is proven. Until then it may be displaced by a newer connection over a limit, those that sent
    no ZeroMQ greeting first, so a flood of plain connections displaces itself, never a
    subscriber that is connected.

    The descriptor bound, and what it rests on. ZeroMQ's I/O thread accepts whatever reaches a
    listener, at C speed, whether or not this thread (Python, behind the GIL) keeps up; so the
    bound is built from what the kernel enforces and from what this thread decides *before* it
    does any per-connection work:

    * **Paused, the kernel admits nothing new.** :func:`pause_accepting` attaches a socket
      filter that drops every packet to the listener: SYNs, and the ACKs that would complete a
      handshake already begun. ZeroMQ can then accept only what the kernel had completed
      already, at most ``BACKLOG + 1`` per port, however long this thread is starved.
    * **Pause first.** A turn reads the waiting events (up to :attr:`DRAIN` a port) and, as
      each accepted one is read, pauses once the connections open, ending or just accepted
      reach ``max_total + slack``, before it looks at any one of them (the per-connection work,
      several syscalls each and each a wait for the GIL on a busy daemon, is where a starved
      thread loses its time).
    * **Whoever holds them.** The same look pauses while the process holds
      :func:`fd_pause_at` descriptors or more (the last eighth of RLIMIT_NOFILE), counted in
      ``/proc/self/fd``: this counts what the monitor never named (a dropped event, ZeroMQ's own
      descriptors, connections accepted since the last look) and the other planes'.

    So at a look, the ports hold at most ``max_total + slack`` connections (:attr:`descriptors`
    with the backlogs), and once paused at most ``BACKLOG + 1`` per port more, whatever this
    thread's speed. What no in-process gate can bound is what ZeroMQ accepts *while accepting
    is on* between two looks: that is the arrival rate times this thread's delay. It is kept
    small (a look right after every wake-up, the pause before the work) and the process-wide
    count stops it at :func:`fd_pause_at`, short of the limit, at the next look; a bound that
    holds with the thread stopped outright needs the accepts in another process (its own
    RLIMIT_NOFILE), as docs/reliability.md says.

    Use: :meth:`bind` each socket (instead of its own ``bind``), then :meth:`start`; :meth:`close`
    before the sockets are closed. The gate's state is its thread's alone."""

    BACKLOG = 16
    """Each port's listen backlog: what the kernel completes while accepting is paused that
    ZeroMQ may still accept."""
    DRAIN = 256
    """Monitor events taken per port in one turn before the pause is decided again."""

    def __init__(self, max_total: int, max_per_peer: int, handshake_s: float, name: str = "event port") -> None:
        self.gate = ConnectionGate(max_total, max_per_peer, self._count_refused, what=f"{name} connections")
        self.name = name
        self.handshake_s = handshake_s
        self.slack = max(16, max_total // 4)
        self.refused = 0
        """Connections ended over a limit (refused as accepted, or displaced)."""
        self.pauses = 0
        self._socks: list[Any] = []
        self._monitors: dict[Any, int] = {}  # monitor socket -> its port
        self._young: dict[tuple[int, int], float] = {}
        """(port, fd) -> when accepted, of connections still unproven"""
        self._ending: dict[tuple[int, int], float] = {}
        """(port, fd) -> when ended, of connections ended over a limit that ZeroMQ has not closed yet"""
        self._listeners: dict[int, int] = {}  # port -> its listening descriptor (ZeroMQ's)
        self._paused = False
        self._warned: dict[str, float] = {}
        self._stop = False
        self._wake = -1
        self._thread: Any = None

    @property
    def total(self) -> int:
        return self.gate.total

    @property
    def descriptors(self) -> int:
        """Descriptors its connections may hold at most: ``max_total``, the slack before
        accepting pauses, every port's backlog (what the daemon keeps aside for them)."""
        return self.gate.max_total + self.slack + self.BACKLOG * len(self._socks)

    def bind(self, sock: Any, host: str, port: int) -> int:
        """Bind ZeroMQ socket ``sock`` on ``host:port`` (0: a free port) under the gate; the port."""
        import zmq

        sock.setsockopt(zmq.BACKLOG, self.BACKLOG)
        # (the monitor before bind: its first event names the listening descriptor)
        mon = sock.get_monitor_socket(zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._socks.append(sock)
        self._monitors[mon] = -1
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        self._monitors[mon] = port
        return port

    def start(self) -> None:
        import threading

        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="kvstore-port-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and the monitors (before the sockets are closed)."""
        if self._thread is not None:
            self._stop = True
            os.eventfd_write(self._wake, 1)
            self._thread.join(10.0)
            self._thread = None
            os.close(self._wake)
        for sock in self._socks:
            with contextlib.suppress(Exception):  # (a socket closed already: nothing to undo)
                sock.disable_monitor()
        for mon in self._monitors:
            mon.close(0)
        self._monitors.clear()
        self._socks.clear()

    def _count_refused(self) -> None:
        self.refused += 1

    def _warn(self, what: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:  # one line per burst
            self._warned[what] = now
            log.warning(msg, *args)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        while not self._stop:
            try:
                ready = poller.poll(100 if self._paused else None)
                # Pause first: the connections these events name are open already, and the
                # per-connection work below (syscalls, each a wait for the GIL on a busy
                # daemon) is where a starved thread loses time; so the count is checked as
                # each event is read, and the work comes after.
                batch: list[tuple[int, int, int]] = []
                arriving = 0
                for sock, _ in ready:
                    if sock == self._wake:
                        continue
                    for ev in self._drain(sock, self._monitors[sock]):
                        batch.append(ev)
                        if ev[1] == zmq.EVENT_ACCEPTED:
                            arriving += 1
                            if not self._paused and self._held(arriving) >= self.gate.max_total + self.slack:
                                self._pace(arriving)
                self._pace(arriving)
                for port, event, fd in batch:
                    self._on_event(port, event, fd)
                self._pace(0)
            except zmq.ZMQError as e:
                if self._stop:
                    return
                log.warning("the %s gate failed: %s", self.name, e)

    def _drain(self, mon: Any, port: int) -> Iterator[tuple[int, int, int]]:
        """Up to :attr:`DRAIN` waiting events of monitor ``mon``, as (port, event, descriptor)."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        for _ in range(self.DRAIN):
            try:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            yield port, int(msg["event"]), int(msg["value"])

    def _on_event(self, port: int, event: int, fd: int) -> None:
        """One monitor event: a listener named, a connection accepted (admitted or ended), a
        connection gone."""
        import zmq

        gate, young = self.gate, self._young
        key = (port, fd)
        if event == zmq.EVENT_LISTENING:
            self._listeners[port] = fd
            if self._paused:  # (a port bound while paused starts paused)
                pause_accepting(fd, port)
            return
        if event == zmq.EVENT_DISCONNECTED:
            gate.forget(key)
            young.pop(key, None)
            self._ending.pop(key, None)
            return
        now = time.monotonic()
        for k in [k for k, t in young.items() if now - t > self.handshake_s + 1]:
            del young[k]  # still open past the handshake deadline: it completed it
            gate.prove(k)
        sock = accepted_socket(fd, port)
        if sock is None:
            return  # gone already (its DISCONNECTED follows)
        try:
            peer = peer_of(sock.getpeername())
        except OSError:
            return
        finally:
            sock.detach()
        refused = self.refused
        if gate.admit(peer, key, functools.partial(self._end, fd, port, peer, key),
                      functools.partial(_silent_on, fd, port)):
            young[key] = now
        else:
            self._end(fd, port, peer, key)
        if self.refused > refused:
            self._warn("refused", "%s: a connection to port %d from %s ended over the limits (%d open; limits "
                       "%d and %d per peer); %d so far", self.name, port, peer, gate.total, gate.max_total,
                       gate.max_per_peer, self.refused)

    def _end(self, fd: int, port: int, peer: str, key: tuple[int, int]) -> None:
        close_accepted(fd, port, peer)
        self._ending[key] = time.monotonic()

    def _held(self, arriving: int) -> int:
        """Connections open, ended but not yet closed, and ``arriving`` (named, not yet looked at)."""
        return self.gate.total + len(self._ending) + arriving

    def _pace(self, arriving: int) -> None:
        """Pause accepting on every port while the connections open, ended but not yet closed,
        or ``arriving`` (accepted, not yet looked at) are ``slack`` or more over ``max_total``,
        or while the process holds :meth:`fd_pause_at` descriptors or more (whoever holds them);
        resume once both are back within ``max_total`` and :meth:`fd_resume_below`."""
        now = time.monotonic()
        for k in [k for k, t in self._ending.items() if now - t > 10.0]:  # (their DISCONNECTED was missed)
            del self._ending[k]
        held = self._held(arriving)
        fds = open_descriptors() if arriving or self._paused else 0
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if not self._paused and (held >= self.gate.max_total + self.slack or fds >= fd_pause_at(soft)):
            self._paused = True
            self.pauses += 1
            for port, fd in self._listeners.items():
                pause_accepting(fd, port)
            self._warn("pause", "%s: accepting paused (%d connections open, closing or arriving; limit %d; the "
                       "process holds %d descriptors of %d); %d pauses so far", self.name, held,
                       self.gate.max_total, fds, soft, self.pauses)
        elif self._paused and held <= self.gate.max_total and fds < fd_resume_below(soft):
            self._paused = False
            for port, fd in self._listeners.items():
                resume_accepting(fd, port)


def open_descriptors() -> int:
    """The process's open descriptors (``/proc/self/fd``; 0 where there is none)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the one listing it)
    except OSError:
        return 0


def fd_pause_at(soft: int) -> int:
    """The process's descriptor count at which the event ports pause accepting: the last
    eighth of RLIMIT_NOFILE ``soft`` (at least 16) stays for the rest of the daemon."""
    return soft - max(16, soft // 8) if soft != resource.RLIM_INFINITY else 1 << 62


def fd_resume_below(soft: int) -> int:
    """Below this many (the last quarter free), the event ports accept again."""
    return soft - max(32, soft // 4) if soft != resource.RLIM_INFINITY else 1 << 62
