"""Shared set-up for the GPU benchmarks: shapes, a DRAM-only store, a random-weight model."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore

SLAB = 64 << 20

# 64-token blocks. Llama-3-8B: 32 layers x (K,V) x 8 KV heads x 128 x bf16 = 8 MiB per block.
LLAMA3_8B = Namespace("bench/llama-3-8b", KVLayout("bfloat16", 64, (LayerGroup("full", 32, 8, 128),)))
# DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x bf16 = ~4.3 MiB per block.
DEEPSEEK_V3 = Namespace("bench/deepseek-v3", KVLayout("bfloat16", 64, (LayerGroup("mla", 61, latent_dim=512, rope_dim=64),)))


def need_cuda(bench: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"{bench}: skipped, needs a CUDA device (see docs/benchmarks.md for the H200 figures)", file=sys.stderr)
    return False


@contextmanager
def dram_store(n_blocks: int, block_bytes: int, root: str | None = None) -> Iterator[KVStore]:
    """A store whose only tier is a shared-memory DRAM arena with room for ``n_blocks``."""
    with tempfile.TemporaryDirectory(dir=root) as d:
        per_slab = SLAB // (-(-block_bytes // 4096) * 4096)
        cap = (-(-n_blocks // per_slab) + 1) * SLAB
        tiers = (TierSpec("dram", "dram", {"capacity_bytes": cap, "slab_bytes": SLAB}),)
        store = KVStore(StoreConfig(root=Path(d), tiers=tiers, persist_on_close=False))
        try:
            yield store
        finally:
            store.close()


def cuda_time(fn: Any, repeat: int) -> float:
    """Best wall time of ``fn`` in seconds, measured with CUDA events around it."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def llama_8b(quick: bool) -> Any:
    """Llama-3-8B shape with random bf16 weights on the GPU (4 layers with --quick)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=4 if quick else 32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500000.0,
    )
    return random_bf16_on_cuda(transformers.LlamaForCausalLM, cfg)


def random_bf16_on_cuda(model_class: Any, config: Any) -> Any:
    """``model_class(config)`` with random weights (seed 0) built in bf16 straight on the GPU
    (no float32 copy on the host), in eval mode; the default dtype is restored."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = model_class(config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()
