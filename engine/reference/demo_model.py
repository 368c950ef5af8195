"""The reference engine part of ``make demo``: a real transformers model skipping cached prefill.

A small random-weight Llama (grouped-query attention, float32, CPU) serves a handful of prompts
that share a 1,024-token system prompt through the embedded store. For each it prints how many
prompt tokens came from the cache, from which tier, and the time to first token with and without
the cache (after a warm-up, the median and the range of several interleaved runs), and checks
that both runs pick the same next token. A speed-up is printed only when the two ranges do not
overlap; otherwise the row says "within noise" (a prompt that hit nothing ran without the cache
both ways, so its two columns differ only by noise).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvstore.config import load_config
from kvstore.store import KVStore


def run_model_demo(root: Path, prompts: int = 4, seed: int = 0, repeats: int = 5) -> dict[str, Any]:
    """``repeats``: TTFT is the median of this many runs of each prompt, after a warm-up."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"needs torch and transformers: {e}; pip install 'kvstore-llm[engine]'"}
    from engine.client import EngineCache
    from engine.kvlayout import shape_of
    from engine.reference.hf import CachedLM

    cfg = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    shape = shape_of(cfg, torch.float32, 32)
    ns = shape.namespace("demo/llama-random-6-layers")
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, cfg.vocab_size, (1024,), generator=g)
    asks = [torch.cat([system, torch.randint(0, cfg.vocab_size, (48,), generator=g)]) for _ in range(prompts)]
    t0 = time.perf_counter()
    rows = []
    with KVStore(load_config(root=root)) as store:
        cache = EngineCache(store, ns, shape)
        cached, plain = CachedLM(model, cache), CachedLM(model, None)
        # Warm up both paths (kernels, allocator, the store's load path) on a prompt of another
        # system prompt, so that no row pays a first-call cost.
        other = torch.randint(0, cfg.vocab_size, (asks[0].numel(),), generator=g)
        for _ in range(2):
            plain.prefill(other)
            cached.prefill(other)
            cache.flush()
        for p in asks:
            where = store.lookup(ns, cache.hashes(p)).tiers
            warm = cached.prefill(p)  # the first visit: what it hits, and the next token
            cache.flush()  # the background store of this prompt's new blocks
            cold = plain.prefill(p)
            # Repeats in the state of the first visit: with its hits (they stay cached), or, for
            # a prompt that hit nothing, without the cache (now that its blocks are stored).
            again = (lambda p=p: cached.prefill(p, store=False)) if warm.hit_tokens else (
                lambda p=p: cached.prefill(p, use_cache=False, store=False))
            colds, warms = [cold.seconds], [warm.seconds]
            for _ in range(repeats - 1):  # interleaved, so the machine's drift hits both alike
                colds.append(plain.prefill(p).seconds)
                warms.append(again().seconds)
            t_cold, t_warm = statistics.median(colds), statistics.median(warms)
            rows.append({
                "prompt_tokens": int(p.numel()),
                "hit_tokens": warm.hit_tokens,
                "tier": Counter(where).most_common(1)[0][0] if warm.hit_tokens else "-",
                "ttft_ms_without_cache": round(t_cold * 1e3, 1),
                "ttft_ms_with_cache": round(t_warm * 1e3, 1),
                "ttft_ms_without_cache_range": [round(min(colds) * 1e3, 1), round(max(colds) * 1e3, 1)],
                "ttft_ms_with_cache_range": [round(min(warms) * 1e3, 1), round(max(warms) * 1e3, 1)],
                "speedup": speedup(colds, warms) if warm.hit_tokens else None,
                "same_next_token": bool(cold.logits.argmax() == warm.logits.argmax()),
            })
        cache.close()
    return {"model": "llama (random weights, 6 layers, GQA 8/2 heads)", "prompts": rows, "repeats": repeats,
            "seconds": round(time.perf_counter() - t0, 2)}


def speedup(colds: list[float], warms: list[float]) -> float | None:
    """Median cold / median cached TTFT, or None when the runs' ranges overlap (the difference is
    inside the machine's noise)."""
    if max(warms) >= min(colds):
        return None
    return round(statistics.median(colds) / statistics.median(warms), 1)


def print_model_demo(out: dict[str, Any]) -> None:
    if "skipped" in out:
        print(f"reference engine: skipped ({out['skipped']})")
        return
    print(f"reference engine: {out['model']} on transformers, prompts sharing a 1,024-token system prompt")
    print(f"  TTFT: median [min-max] of {out.get('repeats', 1)} interleaved runs each, after a warm-up; "
          "a speed-up only where the ranges do not overlap")
    print("  prompt  tokens  from cache  tier      TTFT no cache              TTFT cached                gain          same next token")
    for i, r in enumerate(out["prompts"]):
        lo_c, hi_c = r["ttft_ms_without_cache_range"]
        lo_w, hi_w = r["ttft_ms_with_cache_range"]
        if not r["hit_tokens"]:
            gain = "no hit"
        elif r["speedup"] is None:
            gain = "within noise"
        else:
            gain = f"{r['speedup']:.1f}x faster"
        print(f"  {i:>6}  {r['prompt_tokens']:>6}  {r['hit_tokens']:>10}  {r['tier']:<8}  "
              f"{r['ttft_ms_without_cache']:>7.1f} ms [{lo_c:.0f}-{hi_c:.0f}]".ljust(27)
              + f"{r['ttft_ms_with_cache']:>7.1f} ms [{lo_w:.0f}-{hi_w:.0f}]".ljust(27)
              + f"{gain:<14}{r['same_next_token']}")
