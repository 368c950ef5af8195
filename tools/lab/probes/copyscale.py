"""How a DRAM-tier copy scales with its threads on this machine: what ``copy_threads`` should be.

``python -m tools.lab.probes.copyscale [--json] [--mib N] [--reps R] [--threads 1,2,4,...] [--into-arena]``

One copy of ``N`` MiB from a shared-memory arena (as the DRAM tier's) into private memory (as a
caller's buffer; ``--into-arena``: the other way, as a put copies), by :class:`kvstore.buffers.CopyPool` of each thread count in turn, the counts
interleaved rep by rep so a neighbour's load hits them alike; both buffers faulted in first.
Rows: ``copy_threads_{k}`` (``copy_threads_into_{k}``): median GB/s, baseline the same run's one-thread median, and the
thread count kvstore picks by default here (``default_copy_threads``). Run on the 2-core VM and on
the H200's 16-core host (the bundle's ``run.sh``) for the default's two cases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from kvstore.buffers import CopyPool, default_copy_threads
from kvstore.version import version
from tools.bench._common import result


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    out, k = [], 1
    while k < limit:
        out.append(k)
        k *= 2
    return [*out, limit]


def run(mib: int = 512, reps: int = 5, threads: Sequence[int] = (), into_arena: bool = False) -> Iterator[dict[str, Any]]:
    counts = list(threads) or thread_counts(min(16, max(2, cores())))
    if 1 not in counts:
        counts = [1, *counts]
    n = mib << 20
    shm = SharedMemory(create=True, size=n)
    try:
        src = np.frombuffer(shm.buf, np.uint8)
        src.fill(7)
        dst = np.empty(n, np.uint8)
        dst.fill(1)
        pools = {k: CopyPool(k) for k in counts}
        pair = (memoryview(src), memoryview(dst)) if into_arena else (memoryview(dst), memoryview(src))
        gbps: dict[int, list[float]] = {k: [] for k in counts}
        for _ in range(reps):
            for k, pool in pools.items():
                t0 = time.perf_counter()
                pool.copy((pair,))
                gbps[k].append(n / 1e9 / (time.perf_counter() - t0))
        if not np.array_equal(dst[:: 1 << 20], src[:: 1 << 20]):
            raise RuntimeError("the copies did not land: the arena and the private buffer differ")
        del src, pair
        one = statistics.median(gbps[1])
        way = "into_" if into_arena else ""
        for k in counts:
            yield result("peers", f"copy_threads_{way}{k}", statistics.median(gbps[k]), "GB/s", one,
                         threads=k, direction="into the arena" if into_arena else "out of the arena", mib=mib, reps=reps, cores=cores(), default_copy_threads=default_copy_threads(),
                         min_gbps=round(min(gbps[k]), 3), max_gbps=round(max(gbps[k]), 3))
    finally:
        shm.close()
        shm.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.lab.probes.copyscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--mib", type=int, default=512, help="MiB copied per call (default 512: one 4K-token request)")
    p.add_argument("--reps", type=int, default=5, help="calls per thread count (default 5)")
    p.add_argument("--threads", default="", help="comma-separated thread counts (default 1, 2, 4, ... up to the cores, at most 16)")
    p.add_argument("--into-arena", action="store_true", help="copy into the arena (a put) instead of out of it (a get)")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps <= 0:
        p.error("--mib and --reps must be positive")
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    for row in run(args.mib, args.reps, threads, args.into_arena):
        print(json.dumps(row) if args.json else f"{row['metric']}: {row['value']:.2f} GB/s ({row['ratio']:.2f}x one thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
