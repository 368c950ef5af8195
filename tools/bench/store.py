"""store: the in-process store path, ``KVStore.put`` and ``get_into``, against memcpy.

The workload of the peer comparison (``tools.bench peers``): Llama-8B geometry (32 layers, 8 KV heads, head_dim
128, bf16: 128 KiB per token), 4,096-token requests, one DRAM tier (LRU) of four requests'
capacity, opened just before the first put, so the early rounds fill a fresh arena (where the
page faults of a cold tmpfs arena cost the most unless it is prefaulted) and the later ones
evict. Blocks of 256 tokens (32 MiB, LMCache's chunk) and of 16 tokens (2 MiB, vLLM's page: the per-block costs).
Every request's bytes are read back and checked.

Baseline, same run, interleaved round by round: ``np.copyto`` of the request's bytes between
two private buffers faulted in before timing (the "memcpy same run" baseline), a copy in
one thread. The 256-token blocks run twice: with the DRAM tier's default ``copy_threads``
(``default_copy_threads()``: a batch of 64 MiB or more is split across threads) and with
``copy_threads = 1`` (rows ending ``_1thread``), so the multi-threaded copy's gain is read in
one run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.buffers import default_copy_threads
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from tools.bench._common import result

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
FILL_ROUNDS = 4
"""Requests the DRAM tier holds: the early rounds fill it, the rest evict."""


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    tokens = 512 if args.quick else 4096
    rounds = FILL_ROUNDS + (2 if args.quick else 4)
    for block_tokens, copy_threads in ((256, 0), (256, 1), (16, 0)):
        yield from _measure(tokens, block_tokens, rounds, copy_threads)


def _measure(tokens: int, block_tokens: int, rounds: int, copy_threads: int) -> Iterator[dict[str, Any]]:
    ns = Namespace(f"bench/llama8b-{block_tokens}", KVLayout("bfloat16", block_tokens, (LayerGroup("full", LAYERS, KV_HEADS, HEAD_DIM),)))
    bb = ns.block_bytes
    n = tokens // block_tokens
    nbytes = n * bb
    rng = np.random.default_rng(block_tokens)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, np.uint8)  # faulted in before timing, as the baseline's buffers
    private = np.ones(nbytes, np.uint8)
    chains = [[rng.bytes(16) for _ in range(n)] for _ in range(rounds)]
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-store-"))
    spec = TierSpec("dram", "dram", {"capacity_bytes": FILL_ROUNDS * nbytes, "slab_bytes": max(bb, 64 << 20),
                                     "copy_threads": copy_threads})
    store_s = [0.0] * rounds
    get_s = [0.0] * rounds
    copy_s = [0.0] * rounds
    try:
        t0 = time.perf_counter()
        store = KVStore(StoreConfig(root=tmp, tiers=(spec,), policy="lru", persist_on_close=False))
        open_s = time.perf_counter() - t0
        with store:
            store.register_namespace(ns)
            for r, chain in enumerate(chains):
                src[:8] = r  # each request's own bytes
                t0 = time.perf_counter()
                assert store.put(ns, chain, src) == n
                store_s[r] = time.perf_counter() - t0
                t0 = time.perf_counter()
                np.copyto(private, src)
                copy_s[r] = time.perf_counter() - t0
                t0 = time.perf_counter()
                got = store.get_into(ns, chain, dst)
                get_s[r] = time.perf_counter() - t0
                assert got == n and np.array_equal(dst, src), "get_into returned other bytes"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gb = nbytes / 1e9
    label = f"{tokens}tok_{block_tokens}tok_blocks" + ("_1thread" if copy_threads == 1 else "")
    extra = {"block_bytes": bb, "request_bytes": nbytes, "rounds": rounds, "open_s": round(open_s, 3),
             "copy_threads": copy_threads or default_copy_threads()}
    fill = slice(0, FILL_ROUNDS)
    yield result("store", f"put_{label}_fresh_arena", FILL_ROUNDS * gb / sum(store_s[fill]), "GB/s",
                 FILL_ROUNDS * gb / sum(copy_s[fill]), **extra)
    yield result("store", f"put_{label}", rounds * gb / sum(store_s), "GB/s", rounds * gb / sum(copy_s), **extra)
    yield result("store", f"get_into_{label}", rounds * gb / sum(get_s), "GB/s", rounds * gb / sum(copy_s), **extra)
