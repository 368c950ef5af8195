"""Descriptors for same-node clients: the arena (read-only) and staging segments (memfds).

Neither has a name any process could open: the daemon removes the arena's name from
``/dev/shm`` once it has mapped it, and a staging segment is a memfd. A session that grants
shared memory *offers* descriptors here and tells its client a one-time ticket (16 random bytes)
on its authenticated data connection; the client connects to this server's abstract Unix socket,
sends the ticket and receives the descriptors with ``SCM_RIGHTS``. A ticket is good once and for
:data:`TICKET_TTL_S`; a wrong or used one gets the connection closed. Knowing the socket's name
gives nothing without a ticket, and a ticket only travels to the client that authenticated.

Every unclaimed ticket holds duplicated descriptors, so tickets are bounded: one per *slot* (a
connection's arena ticket, its staging ticket: a new offer for a slot revokes the one before,
and a session's slots are revoked when it ends), at most :data:`MAX_TICKETS_PER_OWNER` per tenant
(a new one revokes that tenant's oldest), and expired ones are swept once a second, not only
when a new one is issued. Connections to the socket itself are bounded too
(:data:`MAX_PENDING_CLAIMS`, the oldest closed for a new one): one that sends no ticket is
closed after 5 s. A tenant that never
claims its tickets therefore holds a bounded number of descriptors, and only its own tickets
are revoked.

The socket is abstract (Linux, no file): it is reachable from the daemon's network namespace,
where its same-node clients are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)

TICKET_BYTES = 16
TICKET_TTL_S = 30.0
MAX_TICKETS_PER_OWNER = 16
"""Unclaimed tickets of one tenant; a client claims its ticket at once, so a few suffice."""
MAX_PENDING_CLAIMS = 64
"""Connections to the fd socket at once (each waits up to 5 s for its ticket)."""
SWEEP_INTERVAL_S = 1.0


@dataclass(slots=True)
class _Offer:
    fds: list[int]
    deadline: float
    owner: str
    slot: Hashable


class FdServer:
    def __init__(self, *, max_per_owner: int = MAX_TICKETS_PER_OWNER, max_claims: int = MAX_PENDING_CLAIMS) -> None:
        self._offers: dict[bytes, _Offer] = {}
        """ticket -> offer, oldest first"""
        self._slots: dict[Hashable, bytes] = {}
        self._owned: Counter[str] = Counter()
        self.max_per_owner = max_per_owner
        self.max_claims = max_claims
        self._claims: dict[asyncio.Task[None], None] = {}
        """Connections to the fd socket waiting for their ticket, oldest first."""
        self.revoked = 0
        """Tickets revoked unclaimed (replaced in their slot, past the owner's bound, or their
        session ended); expired ones are not counted here."""
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.address = ""
        """The abstract socket's name as clients see it: ``@`` for the leading NUL."""

    def start(self) -> str:
        name = f"kvstore-{os.getpid()}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._accept_loop())
        self._sweeper = loop.create_task(self._sweep_forever())
        self.address = "@" + name
        return self.address

    def offer(self, fds: list[int], owner: str = "", slot: Hashable | None = None) -> bytes:
        """A ticket for copies of ``fds`` (the caller keeps its own), issued to tenant ``owner``
        for ``slot`` (its earlier unclaimed ticket there is revoked)."""
        self.sweep()
        if slot is not None and (old := self._slots.get(slot)) is not None:
            self._revoke(old)
        while self._owned[owner] >= self.max_per_owner:
            oldest = next(t for t, o in self._offers.items() if o.owner == owner)
            self._revoke(oldest)
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._offers[ticket] = _Offer([os.dup(fd) for fd in fds], time.monotonic() + TICKET_TTL_S, owner, slot)
        self._owned[owner] += 1
        if slot is not None:
            self._slots[slot] = ticket
        return ticket

    def revoke_slot(self, slot: Hashable) -> None:
        """Revoke ``slot``'s unclaimed ticket, if any (its session ended)."""
        if (ticket := self._slots.get(slot)) is not None:
            self._revoke(ticket)

    def pending(self, owner: str | None = None) -> int:
        """Unclaimed tickets (of ``owner``, or of all)."""
        return len(self._offers) if owner is None else self._owned[owner]

    def _revoke(self, ticket: bytes) -> None:
        if (offer := self._take(ticket)) is not None:
            _close_all(offer.fds)
            self.revoked += 1

    def _take(self, ticket: bytes) -> _Offer | None:
        """Remove an offer from the books; the caller closes or hands over its descriptors."""
        offer = self._offers.pop(ticket, None)
        if offer is None:
            return None
        self._owned[offer.owner] -= 1
        if self._owned[offer.owner] <= 0:
            del self._owned[offer.owner]
        if offer.slot is not None and self._slots.get(offer.slot) == ticket:
            del self._slots[offer.slot]
        return offer

    def sweep(self) -> int:
        """Close the expired tickets' descriptors; returns how many went."""
        now = time.monotonic()
        due = [t for t, o in self._offers.items() if o.deadline < now]
        for ticket in due:
            offer = self._take(ticket)
            if offer is not None:
                _close_all(offer.fds)
        return len(due)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                log.warning("fd socket accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            if len(self._claims) >= self.max_claims:
                # A flood of connections that send no ticket: the oldest goes. A real client
                # sends its ticket as it connects, so it is served before a flood can push it out.
                oldest = next(iter(self._claims))
                oldest.cancel()
                del self._claims[oldest]
            task = loop.create_task(self._claim(conn))
            self._claims[task] = None
            task.add_done_callback(lambda t: self._claims.pop(t, None))

    async def _claim(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.closing(conn):
            conn.setblocking(False)
            ticket = bytearray()
            try:
                async with asyncio.timeout(5):
                    while len(ticket) < TICKET_BYTES:
                        chunk = await loop.sock_recv(conn, TICKET_BYTES - len(ticket))
                        if not chunk:
                            return
                        ticket += chunk
            except (TimeoutError, OSError, asyncio.CancelledError):
                return
            offer = self._take(bytes(ticket))
            if offer is None or offer.deadline < time.monotonic():
                if offer is not None:
                    _close_all(offer.fds)
                log.info("fd socket: a client sent an unknown, revoked or expired ticket")
                return
            fds = offer.fds
            try:
                socket.send_fds(conn, [b"k"], fds)
            except OSError as e:
                log.info("fd socket: handing descriptors over failed: %s", e)
            finally:
                _close_all(fds)

    def close(self) -> None:
        for task in (self._task, self._sweeper):
            if task is not None:
                task.cancel()
        if self._sock is not None:
            self._sock.close()
        for offer in self._offers.values():
            _close_all(offer.fds)
        self._offers.clear()
        self._slots.clear()
        self._owned.clear()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def receive_fds(address: str, ticket: bytes, timeout: float) -> list[int]:
    """The client's side: the descriptors offered under ``ticket`` at ``address``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.closing(sock):
        sock.settimeout(timeout)
        sock.connect("\0" + address[1:] if address.startswith("@") else address)
        sock.sendall(ticket)
        _, fds, _, _ = socket.recv_fds(sock, 16, 8)
    if not fds:
        raise ConnectionError(f"the daemon's fd socket {address} handed over no descriptor (a stale ticket?)")
    return fds
