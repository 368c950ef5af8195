"""index: bytes of index memory per cached block at 1M blocks.

Measured with tracemalloc (numpy reports its buffers to it) around building the index.
Baseline, in the same run: an object-per-node radix tree in the SGLang style (a slotted node
with a children dict, parent link, counters and timestamps) holding the same blocks.
Goal: <= 256 bytes per block.
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.index import NO_PARENT, RadixIndex
from tools.bench._common import result


@dataclass(slots=True)
class _Node:
    key: bytes
    parent: _Node | None
    children: dict[bytes, _Node] = field(default_factory=dict)
    depth: int = 0
    size: int = 0
    tiers: int = 0
    hits: int = 0
    pins: int = 0
    in_use: int = 0
    last_access: float = 0.0
    expiry: float = 0.0


def _keys(raw: bytes, start: int, stop: int) -> list[bytes]:
    """Fresh 16-byte key objects (allocated inside the measurement, as a store would hold them)."""
    return [raw[i * 16 : (i + 1) * 16] for i in range(start, stop)]


def _measure(build: Any) -> tuple[float, Any]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, obj


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n_blocks = 100_000 if args.quick else 1_000_000
    chain_len = 64
    raw = np.random.default_rng(1).integers(0, 256, size=n_blocks * 16, dtype=np.uint8).tobytes()

    def build_ours() -> RadixIndex:
        idx = RadixIndex()
        for c in range(0, n_blocks, chain_len):
            idx.insert_chain(_keys(raw, c, min(c + chain_len, n_blocks)), NO_PARENT, 0, 1 << 20, 0, 1, 1.7e9, 1.8e9)
        return idx

    def build_objects() -> dict[bytes, _Node]:
        table: dict[bytes, _Node] = {}
        for c in range(0, n_blocks, chain_len):
            parent = None
            for d, k in enumerate(_keys(raw, c, min(c + chain_len, n_blocks))):
                node = _Node(k, parent, depth=d, size=1 << 20, tiers=1, last_access=1.7e9, expiry=1.8e9)
                if parent is not None:
                    parent.children[k] = node
                table[k] = node
                parent = node
        return table

    ours_bytes, idx = _measure(build_ours)
    assert len(idx) == n_blocks
    del idx
    base_bytes, table = _measure(build_objects)
    del table
    yield result(
        "index",
        f"bytes_per_block_at_{n_blocks}",
        ours_bytes / n_blocks,
        "B",
        base_bytes / n_blocks,
        goal_bytes=256,
        note="includes the 16-byte hash key objects in both",
    )
