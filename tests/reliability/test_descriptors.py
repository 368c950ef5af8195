"""No client runs the daemon out of descriptors (issue 33, item 2).

Every STAGING frame, and every HELLO of a shared-memory tenant, duplicates a descriptor for a
ticket the client may claim on the fd socket. Unclaimed tickets used to live 30 s, swept only
when a new one was issued: one connection took the daemon to 4,095 of 4,096 descriptors in
2.2 s. These tests drive every frame type in a loop without claiming anything, flood the fd
socket with connections that send no ticket, and check that the daemon's open descriptors (the
test process's: the daemon runs in it) stay bounded while another tenant keeps working.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import Counter
from collections.abc import Callable

import numpy as np

from kvstore.client import connect
from kvstore.server.config import Limits, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.limits import open_descriptors
from kvstore.wire import protocol as P
from kvstore.wire.fdpass import MAX_PENDING_CLAIMS, MAX_TICKETS_PER_OWNER, FdServer
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import eventually
from tests.reliability.harness import pick

TOKEN_A = "token-of-fd-tenant-a-012345"
TOKEN_B = "token-of-fd-tenant-b-012345"
ROUNDS = pick(60, 1000)
LIMITS = dict(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096)
SLACK = 48
"""Descriptors the daemon may open for its own work meanwhile (store files, sockets being
accepted, the worker pool): far below what one ticket per frame would add."""


class RawConn:
    """A data-plane connection that sends frames by hand and never claims a ticket."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.req = 0

    def call(self, op: P.Op, meta: bytes, payload: bytes = b"") -> tuple[P.Header, bytes]:
        self.req += 1
        self.sock.sendall(P.encode_header(op, self.req, meta, len(payload)) + meta + payload)
        head = self._read(P.HEADER_BYTES)
        hdr = P.parse_header(head, P.WireLimits(1 << 24, 1 << 30), reply=True)
        body = self._read(hdr.meta_len)
        self._read(hdr.payload_len)
        return hdr, body

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def _every_frame(c: RawConn, token: bytes, i: int) -> Counter[str]:
    """One round of every frame type (HELLO, STAGING, PUT, PUT_SHM, GET, GET_RUNS, ACQUIRE,
    RELEASE, LOOKUP), none of its tickets claimed; returns the replies by kind."""
    seen: Counter[str] = Counter()
    chain = chain_for(10_000 + i, 2)
    blocks = b"".join(payload(h) for h in chain)
    frames: list[tuple[P.Op, bytes, bytes]] = [
        (P.Op.HELLO, token, b""),
        (P.Op.STAGING, P.encode_u64(4 * BB), b""),
        (P.Op.PUT, P.encode_put(SMALL_NS.root, chain, 0, False), blocks),
        (P.Op.PUT_SHM, P.encode_put(SMALL_NS.root, chain, 0, False, 0, [0, 0]), b""),
        (P.Op.GET, P.encode_blocks(SMALL_NS.root, chain), b""),
        (P.Op.GET_RUNS, P.encode_get_runs(SMALL_NS.root, chain, [2]), b""),
        (P.Op.ACQUIRE, P.encode_blocks(SMALL_NS.root, chain), b""),
        (P.Op.RELEASE, P.encode_u64(i + 1), b""),
        (P.Op.LOOKUP, P.encode_blocks(SMALL_NS.root, chain), b""),
        (P.Op.STAGING, P.encode_u64(2 * BB), b""),
    ]
    for op, meta, body in frames:
        hdr, reply = c.call(op, meta, body)
        seen[f"{op.name}:{P.parse_error(reply)[0].name if hdr.op is P.Op.ERROR else 'ok'}"] += 1
    return seen


def _other_tenant_works(d: ThreadedDaemon, seed: int) -> None:
    with connect(d.url, token=TOKEN_B, plane="shm") as b:
        assert b.plane == "shm"
        b.register_namespace(SMALL_NS)
        chain = chain_for(seed, 3)
        b.put(SMALL_NS, chain, np.frombuffer(b"".join(payload(h) for h in chain), np.uint8))
        out = np.empty(3 * BB, np.uint8)
        assert b.get_into(SMALL_NS, chain, out) == 3
        assert out.tobytes() == b"".join(payload(h) for h in chain)


def test_every_frame_type_in_a_loop_keeps_descriptors_bounded(
    start_daemon: Callable[..., ThreadedDaemon], figures: Callable[..., None]
) -> None:
    tenants = (TenantSpec("a", TOKEN_A, allow_shm=True), TenantSpec("b", TOKEN_B, allow_shm=True))
    d = start_daemon(tenants, limits=Limits(**LIMITS))
    with connect(d.url, token=TOKEN_A, plane="tcp") as a:
        a.register_namespace(SMALL_NS)
    _other_tenant_works(d, 1)
    base = open_descriptors()
    conns = [RawConn(d.info["data_port"]) for _ in range(4)]
    peak = 0
    replies: Counter[str] = Counter()
    try:
        for i in range(ROUNDS):
            replies += _every_frame(conns[i % len(conns)], TOKEN_A.encode(), i)
            peak = max(peak, open_descriptors() - base)
            if i % 20 == 0:
                _other_tenant_works(d, 100 + i)
        # Tickets of one tenant: at most its bound, whatever it sent (plus its 4 sockets).
        assert peak <= MAX_TICKETS_PER_OWNER + len(conns) + SLACK, peak
        _other_tenant_works(d, 99)
    finally:
        for c in conns:
            c.close()
    # The connections' unclaimed tickets go with them.
    assert eventually(lambda: open_descriptors() - base <= SLACK)
    assert replies["STAGING:ok"] == 2 * ROUNDS and replies["HELLO:ok"] == ROUNDS, dict(replies)
    figures(rounds=ROUNDS, frames=sum(replies.values()), peak_extra_descriptors=peak,
            bound=MAX_TICKETS_PER_OWNER + len(conns), replies=dict(sorted(replies.items())))


def test_a_flood_of_silent_fd_socket_connections_is_bounded(
    start_daemon: Callable[..., ThreadedDaemon], figures: Callable[..., None]
) -> None:
    """Connections to the fd socket that never send a ticket (any local process can open
    them): at most MAX_PENDING_CLAIMS are held, the oldest closed for each new one, so a real
    client's claim, sent as it connects, still works."""
    d = start_daemon((TenantSpec("b", TOKEN_B, allow_shm=True),), limits=Limits(**LIMITS))
    with connect(d.url, token=TOKEN_B, plane="shm") as b:
        address = b.info["shm_socket"]
    base = open_descriptors()
    flood: list[socket.socket] = []
    n = 4 * MAX_PENDING_CLAIMS
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(OSError):
                s.connect("\0" + address[1:])
            flood.append(s)
        # our own n sockets, and on the daemon's side no more than its bound of held claims
        assert eventually(lambda: open_descriptors() - base - n <= MAX_PENDING_CLAIMS + SLACK)
        _other_tenant_works(d, 7)
    finally:
        for s in flood:
            s.close()
    figures(silent_connections=n, held_at_most=MAX_PENDING_CLAIMS)


def test_tickets_expire_on_a_timer_and_slots_replace_their_ticket() -> None:
    """Unit: a slot's new ticket revokes its old one; an owner holds at most its bound; expiry
    needs no new offer (the sweep runs by itself; here it is called as the timer would)."""
    fds = FdServer(max_per_owner=3)
    r, w = os.pipe()
    try:
        before = open_descriptors()
        first = fds.offer([r], "a", ("conn", "staging"))
        fds.offer([r], "a", ("conn", "staging"))
        assert fds.pending("a") == 1 and first not in fds._offers
        for i in range(10):
            fds.offer([r], "a", ("conn", i))
        assert fds.pending("a") == 3 and open_descriptors() - before == 3
        fds.offer([r], "b")
        assert fds.pending("b") == 1
        for o in fds._offers.values():
            o.deadline = 0.0  # as if TICKET_TTL_S had passed
        assert fds.sweep() == 4 and fds.pending() == 0 and open_descriptors() == before
    finally:
        fds.close()
        os.close(r)
        os.close(w)

