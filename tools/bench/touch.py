"""touch: the policy's share of a lease, ``KVStore.acquire`` of a long cached prefix.

A lease of 2,048 blocks (an agent's 131k-token context in 64-token blocks) touches every block
in every tier's policy. The store tells each policy once per tier with ``touch_many``; the
shipped policies answer it in one pass. Figure: microseconds per ``acquire`` + ``release`` of
the whole prefix with the default policy (``chain``), in a DRAM-only store (DRAM is the last
tier: the policy orders leaves) and in a DRAM + NVMe store (DRAM is an upper tier: a segmented
LRU). Baseline, same run, interleaved trial by trial: the same store with the policy's
``touch_many`` called once per block (the store's per-block path before ``touch_many``). Each figure is the trial with the median ratio.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from tools.bench._common import median_trial, result

NS = Namespace("bench/touch", KVLayout("bfloat16", 64, (LayerGroup("full", 1, 1, 8),)))
"""64-token blocks of 2 KiB: the per-block costs, not the bytes."""


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    blocks = 256 if args.quick else 2048
    rounds = 5 if args.quick else 21
    for tiers in ("dram", "dram+nvme"):
        yield from _measure(tiers, blocks, rounds)


def _store(root: Path, tiers: str, blocks: int) -> KVStore:
    room = f"{4 * blocks * NS.block_bytes}B"
    specs = [TierSpec("dram", "dram", {"capacity_bytes": room, "slab_bytes": room})]
    if tiers == "dram+nvme":
        specs.append(TierSpec("nvme", "nvme", {"capacity_bytes": room, "slab_bytes": room}))
    return KVStore(StoreConfig(root=root, tiers=tuple(specs), persist_on_close=False))


def _per_block(store: KVStore) -> None:
    """The baseline: every policy of ``store`` told of one block per call, as the store did
    before ``touch_many`` (``touch(bid, now)`` is ``touch_many([bid], now)`` in ``chain``)."""
    for pol in store._ledger.policies:  # noqa: SLF001  # the baseline wraps the store's own policies
        batch = pol.touch_many

        def one_by_one(bids: list[int], now: float, batch: Callable[[list[int], float], None] = batch) -> None:
            for bid in bids:
                batch([bid], now)

        pol.touch_many = one_by_one  # type: ignore[method-assign]  # an instance override, for the baseline only


def _measure(tiers: str, blocks: int, rounds: int) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(7)
    chain = [rng.bytes(16) for _ in range(blocks)]
    payload = rng.integers(0, 256, blocks * NS.block_bytes, dtype=np.uint8)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-touch-"))
    try:
        fast, slow = _store(tmp / "fast", tiers, blocks), _store(tmp / "slow", tiers, blocks)
        _per_block(slow)
        with fast, slow:
            for store in (fast, slow):
                store.register_namespace(NS)
                assert store.put(NS, chain, payload) == blocks
            policy = type(fast._ledger.policies[0]).__name__  # noqa: SLF001

            def lease(store: KVStore) -> Callable[[], None]:
                def once() -> None:
                    held = store.acquire(NS, chain)
                    store.release(held)
                    assert held.num_blocks == blocks
                return once

            sides = [lease(fast), lease(slow)]
            for fn in sides:
                fn()  # warm-up
            trials = []
            for r in range(rounds):
                t = [0.0, 0.0]
                for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    sides[k]()
                    t[k] = time.perf_counter() - t0
                trials.append((1e6 * t[0], 1e6 * t[1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # median_trial takes rates; a time's median ratio is the same trial, so feed inverses.
    inv = [(1 / v, 1 / b) for v, b in trials]
    value, baseline, ratios = median_trial(inv)
    yield result("touch", f"acquire_{blocks}_blocks_{tiers.replace('+', '_')}", 1 / value, "us", 1 / baseline,
                 policy=policy, rounds=rounds, trial_ratios=[round(1 / x, 4) for x in ratios],
                 us_per_block=round(1 / value / blocks, 4), baseline_us_per_block=round(1 / baseline / blocks, 4))
