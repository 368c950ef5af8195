"""What a lease costs: ``KVStore.acquire`` + ``release`` of a prefix the arena holds.

``python -m tools.lab.probes.lease [--json] [--blocks 256,2048] [--reps R] [--policy NAME]``

A store with one DRAM tier holds a chain of ``N`` blocks (512 bytes each: the cost is per block,
not per byte); ``acquire`` of the whole chain is timed ``R`` times after 5 untimed ones, each
lease released untimed. Rows: ``lease_{N}``: median ms; baseline: the same run's median ``lookup``
of the same chain (the index match under the store lock, which a lease does too), interleaved
rep by rep. ``--policy``: the store's eviction policy (default: the store's default); a lease
counts as a hit, so every block is touched in every tier's policy. The GPU restore takes a lease of every prefix it loads (``tools/bench/_peers/paged.py``:
2,048 blocks for a 32K-token prompt of Llama-8B).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from kvstore.version import version
from tools.bench._common import result

NS = Namespace("bench/lease", KVLayout("bfloat16", 16, (LayerGroup("full", 1, 1, 8),)))
WARM = 5


def run(blocks: Sequence[int] = (256, 2048), reps: int = 30, policy: str = "") -> Iterator[dict[str, Any]]:
    bb = NS.block_bytes
    with tempfile.TemporaryDirectory(prefix="lease-bench-") as d:
        for n in blocks:
            cap = -(-(n * bb + (16 << 20)) // (16 << 20)) * (16 << 20)
            tiers = (TierSpec("dram", "dram", {"capacity_bytes": cap, "slab_bytes": 16 << 20}),)
            cfg = StoreConfig(root=Path(d) / str(n), tiers=tiers, persist_on_close=False,
                              **({"policy": policy} if policy else {}))
            with KVStore(cfg) as kv:
                used = kv.config.policy
                kv.register_namespace(NS)
                chain = hash_blocks(NS, np.arange(n * NS.block_tokens, dtype=np.int64))
                kv.put(NS, chain, np.zeros(n * bb, np.uint8))
                lease_s: list[float] = []
                lookup_s: list[float] = []
                for i in range(WARM + reps):
                    t0 = time.perf_counter()
                    lease = kv.acquire(NS, chain)
                    t1 = time.perf_counter()
                    kv.release(lease)
                    if lease.num_blocks != n:
                        raise RuntimeError(f"a lease of {n} cached blocks held {lease.num_blocks}")
                    t2 = time.perf_counter()
                    kv.lookup(NS, chain)
                    t3 = time.perf_counter()
                    if i >= WARM:
                        lease_s.append(t1 - t0)
                        lookup_s.append(t3 - t2)
            med, base = statistics.median(lease_s), statistics.median(lookup_s)
            yield result("peers", f"lease_{n}", med * 1e3, "ms", base * 1e3, blocks=n, reps=reps, policy=used,
                         baseline_what="lookup of the same chain", min_ms=round(min(lease_s) * 1e3, 3),
                         max_ms=round(max(lease_s) * 1e3, 3))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.lab.probes.lease", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--blocks", default="256,2048", help="comma-separated chain lengths (default 256,2048)")
    p.add_argument("--reps", type=int, default=30, help="timed leases per length (default 30)")
    p.add_argument("--policy", default="", help="the store's eviction policy (default: the store's default)")
    args = p.parse_args(argv)
    blocks = [int(x) for x in args.blocks.split(",") if x.strip()]
    if args.reps <= 0 or not blocks or min(blocks) <= 0:
        p.error("--reps and every --blocks length must be positive")
    for row in run(blocks, args.reps, args.policy):
        print(json.dumps(row) if args.json else
              f"{row['metric']} ({row['policy']}): {row['value']:.3f} ms (lookup {row['baseline']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
