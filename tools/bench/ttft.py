"""ttft and overlap: time to first token with a cached 32K-token prefix (Llama-3-8B shape).

``ttft``: a 32,768-token prefix cached in the DRAM tier, 512 new tokens. Figure: time to first
token through the reference engine (hash, lookup, lease, layer-wise load, suffix prefill,
logits). Baseline, same run: full prefill of all 33,280 tokens. Goal: baseline / figure >= 12.

``overlap`` (``python -m tools.bench overlap``): the same cached run against the same suffix
computed with the prefix KV already resident in GPU memory. Goal: ratio <= 1.1 (loads hidden
behind compute). Also reported for longer suffixes, where there is more compute to hide behind.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch

from engine.client import EngineCache
from engine.kvlayout import shape_of
from engine.reference.hf import CachedLM, out_cache
from tools.bench._common import result
from tools.bench._gpu import dram_store, llama_8b, need_cuda

PREFIX = 32_768
SUFFIX = 512


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(args: argparse.Namespace, want: str) -> Iterator[dict[str, Any]]:
    if not need_cuda(want):
        return
    quick = args.quick
    prefix_len = 4096 if quick else PREFIX
    model = llama_8b(quick)
    shape = shape_of(model.config, torch.bfloat16, 64)
    ns = shape.namespace("bench/llama-3-8b-random" + ("-quick" if quick else ""))
    g = torch.Generator().manual_seed(0)
    suffixes = [SUFFIX] if want == "ttft" else [SUFFIX, 2048, 8192]
    prefix = torch.randint(0, model.config.vocab_size, (prefix_len,), generator=g)
    tails = {s: torch.randint(0, model.config.vocab_size, (s,), generator=g) for s in suffixes}
    repeat = 2 if quick else 3
    with dram_store(prefix_len // 64 + 8, shape.block_bytes) as store:
        cache = EngineCache(store, ns, shape)
        lm = CachedLM(model, cache, layer_groups=args.layer_groups)
        plain = CachedLM(model, None)
        warm = lm.prefill(prefix)  # computes the prefix and stores its blocks
        cache.flush()
        resident = [(lay.keys, lay.values) for lay in warm.cache.layers]
        plain.prefill(prefix[:1024])  # kernels warm
        for s in suffixes:
            prompt = torch.cat([prefix, tails[s]])
            cached = lm.prefill(prompt, store=False)
            assert cached.hit_tokens == prefix_len, cached.hit_tokens
            t_cached = _best(lambda p=prompt: lm.prefill(p, store=False), repeat)
            if want == "ttft":
                full = plain.prefill(prompt)
                t_full = _best(lambda p=prompt: plain.prefill(p), repeat)
                rel = float((cached.logits - full.logits).abs().max() / full.logits.abs().max())
                yield result(
                    "ttft", f"ttft_{prefix_len}_cached_{s}_new", t_cached * 1e3, "ms", t_full * 1e3,
                    speedup=round(t_full / t_cached, 2), goal_speedup=12,
                    hit_tokens=cached.hit_tokens, logits_rel_err_bf16=round(rel, 4),
                    same_next_token=bool(cached.logits.argmax() == full.logits.argmax()),
                )
            else:
                ids = tails[s].unsqueeze(0).cuda()

                def on_gpu(ids: torch.Tensor = ids) -> None:
                    from transformers import DynamicCache

                    kv = DynamicCache(config=model.config)
                    for i, (k, v) in enumerate(resident):
                        kv.update(k, v, i)  # the prefix KV, already in GPU memory
                    out = model(input_ids=ids, use_cache=True, **lm.forward_kwargs(kv))
                    out_cache(out)
                    out.logits[0, -1].float()

                on_gpu()
                t_res = _best(on_gpu, repeat)
                yield result(
                    "overlap", f"cached_vs_resident_{prefix_len}_prefix_{s}_new", t_cached * 1e3, "ms",
                    t_res * 1e3, goal_ratio=1.1, kv_bytes=prefix_len // 64 * shape.block_bytes,
                )
        cache.close()


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from measure(args, "ttft")
