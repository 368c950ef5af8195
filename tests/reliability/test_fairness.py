"""Authenticated clients keep working while unauthenticated ones flood (issue 33, item 5).

Every same-node engine connects from 127.0.0.1, so the per-address limit is shared by all of
them. A process with no token that kept that limit full of idle connections (renewing each as
the handshake deadline closed it) let a real client succeed 1 time in 20. Now an unproven
connection (no HELLO with a known token, no HTTP request carrying one) is closed to admit a
newer one, and a proven one never is.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

import numpy as np

from kvstore.client import connect
from kvstore.errors import KVStoreError
from kvstore.server.config import Limits, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.reliability.harness import pick

TOKEN = "token-of-the-real-engine-0123"
PER_PEER = 24
ATTEMPTS = pick(20, 200)


def _flood(ports: list[int], stop: threading.Event, opened: list[int]) -> None:
    """Keep the per-address limit full of idle connections that never authenticate,
    reopening each one the daemon closes (as the review's flooder did)."""
    held: list[socket.socket] = []
    try:
        while not stop.is_set():
            for port in ports:
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                    opened[0] += 1
            if len(held) > 4 * PER_PEER:
                for s in held[: 2 * PER_PEER]:
                    s.close()
                del held[: 2 * PER_PEER]
    finally:
        for s in held:
            s.close()


def test_a_flood_of_unauthenticated_connections_does_not_lock_out_an_engine(
    start_daemon: Callable[..., ThreadedDaemon], figures: Callable[..., None]
) -> None:
    lim = Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096,
                 max_connections_per_peer=PER_PEER, handshake_timeout_s=30)
    d = start_daemon((TenantSpec("engine", TOKEN),), limits=lim)
    chain = chain_for(3, 2)
    blocks = np.frombuffer(b"".join(payload(h) for h in chain), np.uint8)
    stop, opened = threading.Event(), [0]
    # an engine connected before the flood keeps its connections: they are proven
    early = connect(d.url, token=TOKEN, plane="tcp", retries=0)
    early.register_namespace(SMALL_NS)
    flooder = threading.Thread(target=_flood, args=([d.info["data_port"], d.info["http_port"]], stop, opened))
    flooder.start()
    ok = 0
    try:
        while opened[0] < 4 * PER_PEER:
            stop.wait(0.01)  # (the flood has filled the limit: bounded by the flooder's pace)
        for _ in range(ATTEMPTS):
            try:
                with connect(d.url, token=TOKEN, plane="tcp", retries=1, timeout=30) as c:
                    c.register_namespace(SMALL_NS)
                    c.put(SMALL_NS, chain, blocks)
                    ok += c.lookup(SMALL_NS, chain).num_blocks == 2
            except KVStoreError:
                pass
        out = np.empty(2 * BB, np.uint8)
        assert early.get_into(SMALL_NS, chain, out) == 2
    finally:
        stop.set()
        flooder.join()
        early.close()
    assert ok == ATTEMPTS, f"{ok} of {ATTEMPTS} engine connections worked during the flood"
    figures(attempts=ATTEMPTS, succeeded=ok, flood_connections=opened[0], per_peer_limit=PER_PEER)
