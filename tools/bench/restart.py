"""restart: seconds of warm restart per million cached blocks.

A store directory is filled with chains of 64 blocks, half on an NVMe tier and half on a local
object tier (written through the tiers, so that the figure is the store's reopening, not its
puts), then a :class:`KVStore` is opened on it and, for the fixed cost, on an empty directory
(best of 3 each). Baseline, in the same run: opening the same tiers and scanning them without
a store (``Tier.scan_columns``), the part of a restart that is the tiers' own (RocksDB records,
object headers); the
difference is what the store's recovery adds (merging the scans, the index rebuild, the
policies learning the blocks, the expiry pass). Goal: <= 10 s per million blocks.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.registry import make_tier
from kvstore.store import KVStore
from tools.bench._common import result

CHAIN = 64
NS = Namespace("bench/restart", KVLayout("uint8", 16, (LayerGroup("full", 1, 1, 16),)))


def _specs(n: int) -> tuple[TierSpec, ...]:
    bb = NS.block_bytes
    return (
        TierSpec("nvme", "nvme", {"capacity_bytes": (n // 2 + 4096) * 4096, "slab_bytes": 1024 * 4096}),
        TierSpec("object", "object", {"capacity_bytes": 2 * n * bb, "sweep_interval_s": 0}),
    )


def _populate(root: Path, n: int, clock: FakeClock) -> None:
    specs = _specs(n)
    with KVStore(StoreConfig(root=root, tiers=specs, persist_on_close=False), clock=clock) as s:
        s.register_namespace(NS)  # namespaces.json, as a store that ran before leaves it
    tiers = [make_tier(t.kind, t.name, dict(t.options), root, clock) for t in specs]
    payload = bytes(range(256)) * (NS.block_bytes // 256)
    now = clock()
    for c in range(n // CHAIN):
        hashes = hash_blocks(NS, list(range(c * CHAIN * 16, (c + 1) * CHAIN * 16)))
        tier = tiers[c % 2]
        items = [
            (h, payload, BlockMeta(NS.root, hashes[i - 1] if i else NS.root, i, NS.block_bytes,
                                   now + 72 * 3600, payload_checksum(payload), now))
            for i, h in enumerate(hashes)
        ]
        errors = tier.write_many(items)
        if any(e is not None for e in errors):
            raise RuntimeError(f"populating the bench store failed: {next(e for e in errors if e)}")
    for t in tiers:
        t.flush()
        t.close()


def _open_store(root: Path, n: int, clock: FakeClock) -> tuple[float, float]:
    """Wall and processor seconds of opening a store on ``root``."""
    t0, c0 = time.perf_counter(), time.process_time()
    s = KVStore(StoreConfig(root=root, tiers=_specs(n), persist_on_close=False), clock=clock)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    blocks = s.stats()["blocks"]
    s.close()
    if root.name == "full" and blocks != n:
        raise RuntimeError(f"the store recovered {blocks} blocks of {n}")
    return dt, dc


def _open_tiers(root: Path, n: int, clock: FakeClock) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    tiers = [make_tier(t.kind, t.name, dict(t.options), root, clock) for t in _specs(n)]
    for t in tiers:
        for _ in t.scan_columns():
            pass
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    for t in tiers:
        t.close()
    return dt, dc


def _best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The fastest of the runs, in wall and in processor seconds (each its own minimum)."""
    return min(r[0] for r in runs), min(r[1] for r in runs)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 16_384 if args.quick else 131_072  # --quick: 16 Ki blocks
    clock = FakeClock()
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-restart-"))
    try:
        full, empty = tmp / "full", tmp / "empty"
        t0 = time.perf_counter()
        _populate(full, n, clock)
        populate_s = time.perf_counter() - t0
        store_full, store_full_cpu = _best([_open_store(full, n, clock) for _ in range(3)])
        store_empty, store_empty_cpu = _best([_open_store(empty, n, clock) for _ in range(3)])
        tiers_full, tiers_full_cpu = _best([_open_tiers(full, n, clock) for _ in range(3)])
        tiers_empty, tiers_empty_cpu = _best([_open_tiers(empty, n, clock) for _ in range(3)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    per_m = (store_full - store_empty) / n * 1e6
    tiers_per_m = (tiers_full - tiers_empty) / n * 1e6
    # Processor seconds too: on a shared machine the wall time is mostly waiting for a core
    # and the disk; the processor time is what the code costs.
    cpu_per_m = (store_full_cpu - store_empty_cpu) / n * 1e6
    tiers_cpu_per_m = (tiers_full_cpu - tiers_empty_cpu) / n * 1e6
    yield result("restart", "warm_restart_s_per_million_blocks", per_m, "s", tiers_per_m,
                 goal=10.0, blocks=n, restart_s=round(store_full, 3), empty_s=round(store_empty, 3),
                 tiers_scan_s=round(tiers_full, 3), store_recovery_s_per_million_blocks=round(per_m - tiers_per_m, 2),
                 restart_cpu_s_per_million_blocks=round(cpu_per_m, 2),
                 tiers_scan_cpu_s_per_million_blocks=round(tiers_cpu_per_m, 2),
                 store_recovery_cpu_s_per_million_blocks=round(cpu_per_m - tiers_cpu_per_m, 2),
                 populate_s=round(populate_s, 1))

