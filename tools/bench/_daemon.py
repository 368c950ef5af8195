"""Helpers for the daemon benchmarks: each starts its own daemon on loopback, DRAM only."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.keys import KVLayout, LayerGroup, Namespace

# 8 layers x 8 KV heads x 128 dims x 2 (K, V) x bf16 x 32 tokens = 1 MiB per block.
BENCH_NS = Namespace("bench/daemon", KVLayout("bfloat16", 32, (LayerGroup("full", 8, 8, 128),)))
TOKEN = "bench-token-0123456789abcdef"

_TOML = """
[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "{dram}"
slab_bytes = "64MiB"

[server]
max_payload = "1GiB"

{tenants}
"""
_TENANT = f"""
[[tenants]]
name = "bench"
token = "{TOKEN}"
allow_shm = true
admin = true
"""


@contextlib.contextmanager
def bench_daemon(dram: str = "1GiB", ucx: bool = False) -> Iterator[LocalDaemon]:
    """A daemon with one DRAM tier; with ``ucx`` also a tenant (UCX sessions authenticate)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    try:
        cfg = tmp / "kvstore.toml"
        cfg.write_text(_TOML.format(dram=dram, tenants=_TENANT if ucx else ""))
        with start_daemon(tmp / "store", cfg, args=["--ucx"] if ucx else []) as d:
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def chain(n: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    """``n`` block hashes (any distinct 16 bytes do: the daemon does not re-hash) and payloads."""
    rng = np.random.default_rng(seed)
    hashes = [bytes(h) for h in rng.integers(0, 256, (n, 16), dtype=np.uint8)]
    return hashes, rng.integers(0, 256, n * BENCH_NS.block_bytes, dtype=np.uint8)


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))
