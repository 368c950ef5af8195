"""outage: what the engine pays while its daemon is down.

A real daemon, an :class:`engine.client.EngineCache` over it, and an engine loop of
``load`` + ``store_async`` per request (a 64-block prompt of 64 KiB blocks). The daemon is
SIGKILLed: the first call finds it down (its reconnect is refused: one connection attempt, no
retries; only a hung daemon would cost the cache's ``timeout_s``), and from then on every call
answers "no hit" without touching the network. Figures: the p50/p99 of one request's
cache calls while the daemon is down (goal: p99 <= 1 ms, "under a few ms"), baseline the same
calls with the daemon up (a full hit over shared memory, measured in the same run); the first
call after the kill; and how long after a restart on the same ports the first hit comes back.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.client import EngineCache
from engine.kvlayout import KVShape
from kvstore.client import connect
from kvstore.client.spawn import start_daemon
from tools.bench._common import result

SHAPE = KVShape(num_layers=8, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_tokens=16)  # 64 KiB blocks
BLOCKS = 64


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _request(cache: EngineCache, hashes: list[bytes], blocks: torch.Tensor) -> tuple[float, int]:
    t0 = time.perf_counter()
    got = cache.load(hashes, BLOCKS)
    n = got.num_blocks
    got.release()
    if n < BLOCKS:
        cache.store_async(hashes, blocks[n:], n)
    return time.perf_counter() - t0, n


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    n = 200 if args.quick else 2000
    tokens = torch.arange(BLOCKS * SHAPE.block_tokens)
    blocks = torch.randint(0, 256, (BLOCKS, SHAPE.block_bytes), dtype=torch.uint8)
    with tempfile.TemporaryDirectory(prefix="kvstore-outage-", dir=".") as tmp:
        root = Path(tmp) / "store"
        d = start_daemon(root)
        ports = ["--http-port", str(d.info["http_port"]), "--data-port", str(d.info["data_port"])]
        client = connect(d.url, timeout=5.0)
        cache = EngineCache(client, SHAPE.namespace("bench/outage"), SHAPE, backoff_s=0.05, max_backoff_s=0.5)
        try:
            hashes = cache.hashes(tokens)
            _request(cache, hashes, blocks)
            cache.flush()
            up = [_request(cache, hashes, blocks) for _ in range(n)]
            assert all(h == BLOCKS for _, h in up), "the daemon did not serve the stored prompt"
            d.kill()
            first, _ = _request(cache, hashes, blocks)
            down = [_request(cache, hashes, blocks) for _ in range(n)]
            assert not cache.available and all(h == 0 for _, h in down)
            t_restart = time.perf_counter()
            d = start_daemon(root, args=ports)
            t_ready = time.perf_counter()
            while time.perf_counter() - t_restart < 120:
                if _request(cache, hashes, blocks)[1] == BLOCKS:
                    break
                cache.flush()
                time.sleep(0.01)
            resumed = time.perf_counter()
        finally:
            cache.close()
            client.close()
            d.stop()
    up_s, down_s = [t for t, _ in up], [t for t, _ in down]
    for q in (50, 99):
        yield result("outage", f"request_cache_calls_p{q}_daemon_down", _percentile(down_s, q) * 1e6, "us",
                     _percentile(up_s, q) * 1e6, requests=n, baseline_kind="daemon up, 64-block hit over shm",
                     goal_us=1000.0 if q == 99 else None, lookups_skipped=cache.counters.lookups_skipped,
                     stores_skipped=cache.counters.stores_skipped)
    yield result("outage", "first_call_after_kill", first * 1e3, "ms", _percentile(up_s, 50) * 1e3,
                 goal_ms=5.0, note="one refused reconnect, no retries (a hung daemon: EngineCache timeout_s, 1 s)")
    yield result("outage", "hits_back_after_restart", (resumed - t_ready) * 1e3, "ms", (t_ready - t_restart) * 1e3,
                 baseline_kind="daemon start to ready", probes=cache.breaker.probes)
