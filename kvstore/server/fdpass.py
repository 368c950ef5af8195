"""Descriptors for same-node clients: the arena (read-only) and staging segments (memfds).

Neither has a name any process could open: the daemon removes the arena's name from
``/dev/shm`` once it has mapped it, and a staging segment is a memfd. A session that grants
shared memory *offers* descriptors here and tells its client a one-time ticket (16 random bytes)
on its authenticated data connection; the client connects to this server's abstract Unix socket,
sends the ticket and receives the descriptors with ``SCM_RIGHTS``. A ticket is good once and for
:data:`TICKET_TTL_S`; a wrong or used one gets the connection closed. Knowing the socket's name
gives nothing without a ticket, and a ticket only travels to the client that authenticated.

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

log = logging.getLogger(__name__)

TICKET_BYTES = 16
TICKET_TTL_S = 30.0


class FdServer:
    def __init__(self) -> None:
        self._offers: dict[bytes, tuple[list[int], float]] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""
        """The abstract socket's name as clients see it: ``@`` for the leading NUL."""

    def start(self) -> str:
        name = f"kvstore-{os.getpid()}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())
        self.address = "@" + name
        return self.address

    def offer(self, fds: list[int]) -> bytes:
        """A ticket for copies of ``fds`` (the caller keeps its own)."""
        self._sweep()
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._offers[ticket] = ([os.dup(fd) for fd in fds], time.monotonic() + TICKET_TTL_S)
        return ticket

    def _sweep(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, (_, deadline) in self._offers.items() if deadline < now]:
            _close_all(self._offers.pop(ticket)[0])

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
            loop.create_task(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
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
            except (TimeoutError, OSError):
                return
            offer = self._offers.pop(bytes(ticket), None)
            if offer is None or offer[1] < time.monotonic():
                log.info("fd socket: a client sent an unknown or expired ticket")
                return
            fds = offer[0]
            try:
                socket.send_fds(conn, [b"k"], fds)
            except OSError as e:
                log.info("fd socket: handing descriptors over failed: %s", e)
            finally:
                _close_all(fds)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sock is not None:
            self._sock.close()
        for fds, _ in self._offers.values():
            _close_all(fds)
        self._offers.clear()


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
