"""gpu_load: cached blocks from the store's DRAM arena into an engine's GPU KV pages.

Figure: GB/s of copying N cached blocks, each from where it lies in the pinned shared-memory
arena (held by a store lease) to a page of a GPU page pool, one DMA per block, on one stream.
Baseline, same run: one pinned host tensor of the same bytes copied to the GPU in one copy (the
pinned peak). Shapes: Llama-3-8B (8 MiB blocks) and DeepSeek-V3 MLA (~4.3 MiB blocks), 64
tokens per block. Goal: >= 0.9 of the pinned peak.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.gpu import ArenaBlocks
from kvstore.keys import Namespace, hash_blocks
from tools.bench._common import result
from tools.bench._gpu import DEEPSEEK_V3, LLAMA3_8B, cuda_time, dram_store, need_cuda


def _measure(label: str, ns: Namespace, total: int, repeat: int) -> dict[str, Any]:
    bb = ns.block_bytes
    n = max(2, total // bb)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=n * bb, dtype=np.uint8)
    hashes = hash_blocks(ns, rng.integers(0, 100_000, n * ns.block_tokens))
    with dram_store(n, bb) as store:
        store.register_namespace(ns)
        store.put(ns, hashes, data)
        lease = store.acquire(ns, hashes)
        assert lease.num_blocks == n
        src = ArenaBlocks(store, lease)
        pages = torch.empty((n, bb), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()

        def ours() -> None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                src.copy_range(pages, 0, bb)
            torch.cuda.current_stream().wait_stream(stream)

        pinned = torch.from_numpy(data).pin_memory()
        flat = torch.empty(n * bb, dtype=torch.uint8, device="cuda")

        def peak() -> None:
            flat.copy_(pinned, non_blocking=True)

        ours(), peak()  # warm up
        t = cuda_time(ours, repeat)
        b = cuda_time(peak, repeat)
        mid = n // 2
        ok = bool(torch.equal(pages[mid].cpu(), torch.from_numpy(data[mid * bb : (mid + 1) * bb])))
        src.release()
    gb = n * bb / 1e9
    return result(
        "gpu_load", f"{label}_{bb >> 10}KiB_blocks", gb / t, "GB/s", gb / b,
        blocks=n, block_bytes=bb, verified=ok, goal_ratio=0.9,
    )


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if not need_cuda("gpu_load"):
        return
    total = (256 << 20) if args.quick else (4 << 30)
    for label, ns in (("llama3_8b", LLAMA3_8B), ("deepseek_v3_mla", DEEPSEEK_V3)):
        yield _measure(label, ns, total, 3 if args.quick else 5)
