"""shm: a hit through the daemon over shared memory, against a plain memcpy of the same bytes.

Figure: ``Client.get_into`` on the shared-memory plane (a lease request to the daemon, one copy
from its arena into the caller's buffer, the lease given back) of 128 blocks of 1 MiB. The
daemon itself copies nothing.

Baselines, same run, same destination buffer:
* ``memcpy_arena``: a memcpy of the same blocks from where they lie in the arena (mapped
  through a lease held for the whole baseline): what the shared-memory plane adds. Goal >= 80%.
* ``memcpy_private``: ``np.copyto`` between two private buffers of this process. These get
  transparent huge pages and the tmpfs arena does not (``shmem_enabled`` is ``never`` on the
  dev machines), so this one is also a measure of 4 KiB pages against 2 MiB ones.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.client import connect
from tools.bench._common import result
from tools.bench._daemon import BENCH_NS, bench_daemon, chain


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 16 if args.quick else 128
    rounds = 3 if args.quick else 10
    bb = BENCH_NS.block_bytes
    hashes, blocks = chain(n)
    nbytes = blocks.nbytes
    with bench_daemon() as d, connect(d.url, plane="shm") as c:
        c.put(BENCH_NS, hashes, blocks)
        dst = np.ones(nbytes, np.uint8)  # faulted in before timing
        src = blocks.copy()
        ours = arena = private = 0.0
        out = memoryview(dst)
        with c.acquire(BENCH_NS, hashes) as lease:
            for _ in range(rounds):  # interleaved so that drift in machine speed hits all alike
                t0 = time.perf_counter()
                got = c.get_into(BENCH_NS, hashes, dst)
                ours += time.perf_counter() - t0
                assert got == n
                t0 = time.perf_counter()
                for i, view in enumerate(lease.views):
                    out[i * bb : (i + 1) * bb] = view
                arena += time.perf_counter() - t0
                t0 = time.perf_counter()
                np.copyto(dst, src)
                private += time.perf_counter() - t0
        out.release()
        c.get_into(BENCH_NS, hashes, dst)
        assert np.array_equal(dst, blocks)
    gb = rounds * nbytes / 1e9
    yield result("shm", f"get_shm_{n}x1MiB_vs_memcpy_arena", gb / ours, "GB/s", gb / arena, goal_ratio=0.8)
    yield result("shm", f"get_shm_{n}x1MiB_vs_memcpy_private", gb / ours, "GB/s", gb / private)
