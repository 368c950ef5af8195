"""Authenticated clients keep working while unauthenticated ones flood (issue 33, item 5).

Every same-node engine connects from 127.0.0.1, so the per-address limit is shared by all of
them. A process with no token that kept that limit full of idle connections (renewing each as
the handshake deadline closed it) let a real client succeed 1 time in 20. Now an unproven
connection (no HELLO with a known token, no HTTP request carrying one) is closed to admit a
newer one, and a proven one never is.

The flooder is a process of its own, as the review's was. (It used to be a thread of the test's
process, which is also the daemon's: on a loaded box it then took the daemon's interpreter lock
as well as the CPU, the daemon accepted more slowly than the flood connected, the listen queue
overflowed, and an engine's connect waited for TCP's SYN retransmissions, 1 + 2 + 4 + 8 + 16 s,
past its 30-s timeout; two in one attempt failed the attempt. How long an attempt takes is not
what this test is about: the engine's timeout is long enough for any of that, and a failure
prints each failed attempt's error and time and the listen queue's overflows.)
"""

from __future__ import annotations

import subprocess
import sys
import time
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
ENGINE_TIMEOUT_S = 300
"""Each call of the engine's client; a connect gives up by itself after ~127 s of SYN retransmits."""

FLOOD = r"""
import contextlib, select, socket, sys
ports, per_peer = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2])
held, opened, filled = [], 0, False
while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
    for port in ports:
        with contextlib.suppress(OSError):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            opened += 1
    closed = set(select.select(held, [], [], 0)[0])  # the daemon closed them (EOF or reset)
    for s in closed:
        s.close()
    held = [s for s in held if s not in closed][-8 * per_peer:]  # (the rest are garbage, closed)
    if not filled and opened >= 4 * per_peer:
        filled = True
        print("filled", flush=True)
print(opened, flush=True)
"""
"""Keep the per-address limit full of idle connections that never authenticate, reopening each
one the daemon closes (as the review's flooder did); says ``filled`` once it has opened
``4 x PER_PEER``, and how many it opened when its stdin closes."""


def _listen_overflows() -> int:
    """Connections the kernel dropped because a listen queue was full (all of this host's)."""
    with open("/proc/net/netstat") as f:
        names, values = f.readline().split(), f.readline().split()
    return int(dict(zip(names, values, strict=True)).get("ListenOverflows", 0))


def test_a_flood_of_unauthenticated_connections_does_not_lock_out_an_engine(
    start_daemon: Callable[..., ThreadedDaemon], figures: Callable[..., None]
) -> None:
    lim = Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096,
                 max_connections_per_peer=PER_PEER, handshake_timeout_s=30)
    d = start_daemon((TenantSpec("engine", TOKEN),), limits=lim)
    chain = chain_for(3, 2)
    blocks = np.frombuffer(b"".join(payload(h) for h in chain), np.uint8)
    # an engine connected before the flood keeps its connections: they are proven
    early = connect(d.url, token=TOKEN, plane="tcp", retries=0)
    early.register_namespace(SMALL_NS)
    ports = f"{d.info['data_port']},{d.info['http_port']}"
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD, ports, str(PER_PEER)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert flooder.stdin is not None and flooder.stdout is not None
    ok, failures, slowest = 0, [], 0.0
    overflows = _listen_overflows()
    try:
        assert flooder.stdout.readline() == "filled\n"  # the flood has filled the limit
        for i in range(ATTEMPTS):
            t = time.monotonic()
            try:
                with connect(d.url, token=TOKEN, plane="tcp", retries=1, timeout=ENGINE_TIMEOUT_S) as c:
                    c.register_namespace(SMALL_NS)
                    c.put(SMALL_NS, chain, blocks)
                    ok += c.lookup(SMALL_NS, chain).num_blocks == 2
            except KVStoreError as e:
                failures.append(f"attempt {i} after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e} "
                                f"(cause: {e.__cause__!r})")
            slowest = max(slowest, time.monotonic() - t)
        early_got = early.get_into(SMALL_NS, chain, np.empty(2 * BB, np.uint8))
    finally:
        flooder.stdin.close()
        tail = flooder.stdout.read().split()
        opened = int(tail[-1]) if tail else -1  # (-1: the flooder died)
        flooder.wait()
        early.close()
    overflows = _listen_overflows() - overflows
    assert ok == ATTEMPTS, (f"{ok} of {ATTEMPTS} engine connections worked during the flood ({opened} flood "
                            f"connections, {overflows} listen queue overflows); failures: {failures[:5]}")
    assert early_got == 2  # the engine connected before the flood was served all along
    figures(attempts=ATTEMPTS, succeeded=ok, flood_connections=opened, per_peer_limit=PER_PEER,
            slowest_attempt_s=round(slowest, 2), listen_overflows=overflows)
