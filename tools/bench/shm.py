"""shm: a hit through the daemon over shared memory, against a plain memcpy of the same bytes.

Figure: ``Client.get_into`` on the shared-memory plane (a lease request to the daemon, the copy
from its arena into the caller's buffer, the lease given back) of 128 blocks of 1 MiB. The
daemon itself copies nothing; the client copies blocks that lie back to back in the arena and
in the caller's buffer in one memcpy.

Baselines, same run, same destination buffer:
* ``memcpy_arena``: a memcpy of each block from where it lies in the arena (mapped through a
  lease held for the whole baseline), block by block: what the shared-memory plane adds to
  copying the blocks out. Goal >= 80%.
* ``memcpy_arena_run``: one memcpy of the same bytes as one run (the blocks lie back to back
  here): the floor of the copy itself (large copies get non-temporal stores). No goal.
* ``memcpy_private``: ``np.copyto`` between two private buffers of this process. These get
  transparent huge pages and the tmpfs arena does not (``shmem_enabled`` is ``never`` on the
  dev machines), so this one is also a measure of 4 KiB pages against 2 MiB ones.

Measurement: one untimed round of each side first (the client's mapping of the arena and the
destination faulted in, the daemon's pool warm), then ``rounds`` trials, each side once per
trial in an order that rotates, so a noisy neighbour hits every side alike; each figure is the
trial with the median ratio (``trial_ratios`` lists them all).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvstore.client import connect
from tools.bench._common import median_trial, result, rotating_trials
from tools.bench._daemon import BENCH_NS, bench_daemon, chain


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 16 if args.quick else 128
    rounds = 3 if args.quick else 15
    bb = BENCH_NS.block_bytes
    hashes, blocks = chain(n)
    nbytes = blocks.nbytes
    gb = nbytes / 1e9
    with bench_daemon() as d, connect(d.url, plane="shm") as c:
        c.put(BENCH_NS, hashes, blocks)
        dst = np.ones(nbytes, np.uint8)  # faulted in before timing
        src = blocks.copy()
        out = memoryview(dst)
        with c.acquire(BENCH_NS, hashes) as lease:
            locs = lease.locations
            back_to_back = all(locs[i + 1][0] == locs[i][0] + bb for i in range(n - 1))
            whole = memoryview(lease.views[0].obj)  # the arena's mapping, released below
            run_view = whole if back_to_back else None
            run_off = locs[0][0]

            def ours() -> None:
                assert c.get_into(BENCH_NS, hashes, dst) == n

            def arena() -> None:
                for i, view in enumerate(lease.views):
                    out[i * bb : (i + 1) * bb] = view

            def arena_run() -> None:
                if run_view is not None:
                    out[:] = run_view[run_off : run_off + nbytes]
                else:
                    arena()

            def private() -> None:
                np.copyto(dst, src)

            sides: list[tuple[str, Callable[[], None]]] = [
                ("ours", ours), ("arena", arena), ("arena_run", arena_run), ("private", private)
            ]
            rates = rotating_trials(sides, rounds, gb)
            run_view = None
            whole.release()
        out.release()
        c.get_into(BENCH_NS, hashes, dst)
        assert np.array_equal(dst, blocks)
    for base, goal in (("arena", 0.8), ("arena_run", None), ("private", None)):
        value, baseline, ratios = median_trial(list(zip(rates["ours"], rates[base], strict=True)))
        yield result("shm", f"get_shm_{n}x1MiB_vs_memcpy_{base}", value, "GB/s", baseline, goal_ratio=goal,
                     trial_ratios=ratios, **({"arena_back_to_back": back_to_back} if base == "arena_run" else {}))
