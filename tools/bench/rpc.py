"""rpc: control-plane lookup latency at a steady 1,000 requests/s on loopback.

Figure: p50 and p99 of ``Client.lookup(ns, hashes)`` (a 32-block chain, all cached), what an
engine calls before each prefill: the client library end to end (a LOOKUP frame on its data
connection, the daemon, the reply decoded). Sent open loop at 1,000 req/s over one connection (a
request late on its schedule goes at once, and its latency counts from when it went). Baseline,
same run, same client and pacing: ``Client.health()`` (``GET /healthz``), which does no store
work: the floor of the client's HTTP + FastAPI + uvicorn on this machine. Goal: p99 <= 2 ms.
Beside it, ``lookup_http_*``: the same lookups as ``POST /v1/lookup`` (how a client reaches a
daemon without LOOKUP frames), from a second client, interleaved with the others. And
``acquire_*``: a shared-memory client's ``Client.acquire`` of the same chain and its release
(what a same-node engine's load takes before its first copy; served on the daemon's event loop
when the arena holds it), against that client's own LOOKUP of the chain in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvstore.client import connect
from tools.bench._common import result
from tools.bench._daemon import BENCH_NS, bench_daemon, chain, percentile

RATE = 1000.0


def paced(n: int, send: Callable[[], None]) -> list[float]:
    """Latencies (ms) of ``n`` calls scheduled every 1/RATE s."""
    out: list[float] = []
    start = time.perf_counter()
    for i in range(n):
        due = start + i / RATE
        while (now := time.perf_counter()) < due:
            if due - now > 0.0002:
                time.sleep(due - now - 0.0001)  # pacing the load generator, not a test
        t0 = time.perf_counter()
        send()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 300 if args.quick else 5000
    hashes, blocks = chain(32)
    with bench_daemon("256MiB") as d, connect(d.url, plane="tcp") as c, connect(d.url, plane="tcp") as old, \
            connect(d.url, plane="shm") as shm:
        c.put(BENCH_NS, hashes, blocks)
        old.info["lookup"] = False  # as a daemon without LOOKUP frames answers HELLO

        def lookup() -> None:
            r = c.lookup(BENCH_NS, hashes)
            assert r.num_blocks == 32, r

        def lookup_http() -> None:
            r = old.lookup(BENCH_NS, hashes)
            assert r.num_blocks == 32, r

        def health() -> None:
            assert c.health()["status"] == "ok"

        def acquire() -> None:
            lease = shm.acquire(BENCH_NS, hashes)
            assert lease.num_blocks == 32, lease.num_blocks
            lease.release()  # (its reply is read with the next call's)

        def shm_lookup() -> None:
            r = shm.lookup(BENCH_NS, hashes)
            assert r.num_blocks == 32, r

        paced(n // 10, lookup)  # warm-up
        paced(n // 10, lookup_http)
        paced(n // 10, acquire)
        ours: list[float] = []
        http: list[float] = []
        base: list[float] = []
        leases: list[float] = []
        shm_base: list[float] = []
        for _ in range(5):  # interleaved blocks of each, so drift hits all alike
            ours += paced(n // 5, lookup)
            http += paced(n // 5, lookup_http)
            base += paced(n // 5, health)
            leases += paced(n // 5, acquire)
            shm_base += paced(n // 5, shm_lookup)
    for q in (50, 99):
        yield result("rpc", f"lookup_p{q}_at_1000rps", percentile(ours, q), "ms", percentile(base, q),
                     requests=len(ours), goal_ms=2.0 if q == 99 else None)
    for q in (50, 99):
        yield result("rpc", f"lookup_http_p{q}_at_1000rps", percentile(http, q), "ms", percentile(base, q),
                     requests=len(http))
    for q in (50, 99):
        yield result("rpc", f"acquire_p{q}_at_1000rps", percentile(leases, q), "ms", percentile(shm_base, q),
                     requests=len(leases), blocks=32, baseline_what="the same shared-memory client's LOOKUP")
