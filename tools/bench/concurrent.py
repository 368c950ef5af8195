"""concurrent: 64 clients at once against one daemon, every loaded byte checked; zero errors.

Figure: aggregate requests/s of 64 client threads (half on shared memory, half on TCP), each
storing its own 8-block chain on top of a shared 4-block prefix, loading it back, checking every
byte, and looking it up, for several rounds. Baseline, same run: one client doing the same work
alone. ``errors`` counts exceptions and wrong bytes and must be 0.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.client import connect
from tools.bench._common import result
from tools.bench._daemon import BENCH_NS, bench_daemon, chain

CLIENTS = 64
BB = BENCH_NS.block_bytes


def _work(url: str, plane: str, seed: int, rounds: int, prefix: tuple[list[bytes], np.ndarray],
          errors: list[str]) -> int:
    done = 0
    try:
        with connect(url, plane=plane) as c:
            own, own_blocks = chain(8, seed=1000 + seed)
            hashes = prefix[0] + own
            blocks = np.concatenate([prefix[1], own_blocks])
            out = np.empty_like(blocks)
            for _ in range(rounds):
                c.put(BENCH_NS, hashes, blocks)
                got = c.get_into(BENCH_NS, hashes, out)
                if got != len(hashes) or not np.array_equal(out, blocks):
                    errors.append(f"client {seed}: loaded {got} blocks, bytes equal: {np.array_equal(out, blocks)}")
                if c.lookup(BENCH_NS, hashes).num_blocks != len(hashes):
                    errors.append(f"client {seed}: lookup missed")
                done += 3
    except Exception as e:  # counted, not raised: the figure is how many went wrong
        errors.append(f"client {seed}: {type(e).__name__}: {e}")
    return done


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    rounds = 2 if args.quick else 5
    prefix = chain(4, seed=7)
    errors: list[str] = []
    # 64 clients x 12 blocks of 1 MiB, once each (the prefix is shared): fits 1 GiB of DRAM.
    with bench_daemon("1GiB") as d:
        t0 = time.perf_counter()
        single = _work(d.url, "tcp", 999, rounds, prefix, errors)
        t_single = time.perf_counter() - t0
        counts = [0] * CLIENTS

        def worker(i: int) -> None:
            counts[i] = _work(d.url, "shm" if i % 2 else "tcp", i, rounds, prefix, errors)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_all = time.perf_counter() - t0
    yield result("concurrent", f"requests_per_s_{CLIENTS}_clients", sum(counts) / t_all, "req/s",
                 single / t_single, clients=CLIENTS, errors=len(errors), first_errors=errors[:3])
