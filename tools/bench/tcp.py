"""tcp: a hit through the daemon's framed TCP data plane, against a raw socket of the same bytes.

Figure: ``Client.get_into`` on the TCP plane of 128 blocks of 1 MiB from a daemon on loopback
(the daemon sends straight from its arena with ``sendmsg``; the client ``recv_into``\\s the
caller's buffers). Baseline, same run: a raw sender process doing ``sendall`` of the same bytes
per request and this process ``recv_into`` one buffer. Goal: >= 80% of the raw socket.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.client import connect
from tools.bench._common import result
from tools.bench._daemon import BENCH_NS, bench_daemon, chain

RAW_SENDER = """
import socket, sys
n = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(n)
while conn.recv(1):
    conn.sendall(buf)
"""


def raw_round(sock: socket.socket, dst: memoryview) -> None:
    sock.sendall(b"g")
    got = 0
    while got < len(dst):
        k = sock.recv_into(dst[got:])
        if not k:
            raise ConnectionError("raw sender went away")
        got += k


@contextlib.contextmanager
def raw_sender(nbytes: int) -> Iterator[socket.socket]:
    """A :data:`RAW_SENDER` process sending ``nbytes`` per round, and a TCP_NODELAY connection to
    it (the baseline of :func:`raw_round`); the process is killed on exit."""
    sender = subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        port = int(sender.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield raw
    finally:
        sender.kill()
        sender.wait()


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 16 if args.quick else 128
    rounds = 3 if args.quick else 10
    hashes, blocks = chain(n)
    nbytes = blocks.nbytes
    with raw_sender(nbytes) as raw, bench_daemon() as d, connect(d.url, plane="tcp") as c:
        c.put(BENCH_NS, hashes, blocks)
        dst = np.ones(nbytes, np.uint8)
        view = memoryview(dst)
        ours = base = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = c.get_into(BENCH_NS, hashes, dst)
            ours += time.perf_counter() - t0
            assert got == n
            t0 = time.perf_counter()
            raw_round(raw, view)
            base += time.perf_counter() - t0
        c.get_into(BENCH_NS, hashes, dst)
        assert np.array_equal(dst, blocks)
    gbps = rounds * nbytes / 1e9
    yield result("tcp", f"get_tcp_{n}x1MiB", gbps / ours, "GB/s", gbps / base, goal_ratio=0.8)
