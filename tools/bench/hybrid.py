"""hybrid: sliding-window and hybrid models stored as full part + checkpoint windows.

Three parts, each with its baseline from the same run (``docs/hybrid.md``):

- **bytes**: payload bytes stored per cached token for one 32K-token chain, against storing
  every layer of every block, for the layer plans of gpt-oss (half SWA, W = 128), Gemma-2
  (half SWA, W = 4096), Gemma-3 (5 of 6 SWA, W = 1024), Mistral-7B-v0.1 (all SWA,
  W = 4096) and Qwen3-Next (3 of 4 layers gated delta-net linear attention, a fixed-size state;
  its baseline stores that state at every block), at several checkpoint intervals C. Exact from the layouts, and checked by a real
  store run: the chain put through a :class:`KVStore` over a null tier (bookkeeping only, the
  same layouts with 1 KV head x 8 dims so the payloads stay small), bytes read back from
  ``namespace_usage``. Goal: <= 0.55x for a half-SWA model at W << context.
- **replay**: replayed tokens per hit through the engine (a small random Gemma-3 on the CPU)
  for hits ending at random places in a stored chain, against the bound (C - 1) x block tokens;
  the logits of every hit are compared with the store-everything engine's.
- **ttft** (CUDA only, or a CPU smoke run with ``--quick``): time to first token with a 32K
  prefix cached, a Gemma-3-architecture model of Llama-3-8B size with every other layer sliding
  (W = 128), bf16: the hybrid engine (hit on a checkpoint; hit between checkpoints) against the
  store-everything engine on the same prompts, and against full prefill. Goal: within 10% of
  store-everything.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.reference.hybrid import HybridLM, namespace_of, window_bytes_per_token
from kvstore.config import StoreConfig, TierSpec
from kvstore.hybrid import CheckpointPolicy, HybridNamespaces
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from tools.bench._common import best_of, result
from tools.bench._gpu import random_bf16_on_cuda

CONTEXT = 32_768
BT = 64

# Layer plans of public models (bf16, 64-token blocks): (full layers, sliding layers, window,
# kv heads, head dim, recurrent layers, state elements per recurrent layer).
PLANS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "gpt-oss-120b": (18, 18, 128, 8, 64, 0, 0),
    "gemma-2-27b": (23, 23, 4096, 16, 128, 0, 0),
    "gemma-3-27b": (10, 52, 1024, 16, 128, 0, 0),
    "mistral-7b-v0.1": (0, 32, 4096, 8, 128, 0, 0),
    # Gated delta net: conv state 8192 channels x kernel 4, recurrent state 32 heads x 128 x 128.
    "qwen3-next-80b": (12, 0, 0, 2, 256, 36, 8192 * 4 + 32 * 128 * 128),
}
INTERVALS = (16, 21, 24, 32, 64, 0)  # blocks between periodic checkpoints; 0: only the end of the prompt


def _ns(name: str, scale: int = 1) -> Namespace:
    """``scale`` > 1: the same plan with 1 KV head x 8 dims and the state / scale (small payloads)."""
    full, sliding, w, h, d, rec, state = PLANS[name]
    if scale > 1:
        h, d, state = 1, 8, max(1, state // scale)
    groups = []
    if full:
        groups.append(LayerGroup("full", full, h, d))
    if sliding:
        groups.append(LayerGroup("sliding", sliding, h, d, window=w))
    if rec:
        groups.append(LayerGroup("recurrent", rec, latent_dim=state))
    return Namespace(f"bench/{name}", KVLayout("bfloat16", BT, tuple(groups)))


def _policy(c: int) -> CheckpointPolicy:
    return CheckpointPolicy(every_blocks=c or 1 << 30)


def _store_run(ns: Namespace, context: int, policy: CheckpointPolicy) -> tuple[int, int]:
    """(hybrid bytes, store-everything bytes) that a real store holds after one chain."""
    hyb = HybridNamespaces.of(ns)
    n = context // ns.block_tokens
    with tempfile.TemporaryDirectory() as d:
        tiers = (TierSpec("null", "null", {"capacity_bytes": 1 << 40}),)
        store = KVStore(StoreConfig(root=Path(d), tiers=tiers, persist_on_close=False))
        try:
            store.register_namespace(ns)
            hyb.register(store)
            tokens = np.random.default_rng(0).integers(0, 50_000, n * ns.block_tokens)
            every = ns.block_bytes
            store.put(ns, hash_blocks(ns, tokens), [memoryview(bytearray(every))] * n)
            hashes = hyb.hashes(tokens)
            if hyb.full is not None:
                store.put(hyb.full, hashes, [memoryview(bytearray(hyb.full.block_bytes))] * n)
            ckpts = policy.new_checkpoints(0, n - 1)
            if hyb.window is not None:
                wbuf = memoryview(bytearray(hyb.window.block_bytes))
                for j in sorted({j for i in ckpts for j in hyb.checkpoint_blocks(i)}):
                    chain = hyb.window_chain(hashes, j)
                    store.put(hyb.window, chain, [wbuf], start=len(chain) - 1)
            if hyb.state is not None:
                sbuf = memoryview(bytearray(hyb.state.block_bytes))
                for i in ckpts:
                    chain = hyb.state_chain(hashes, i)
                    store.put(hyb.state, chain, [sbuf], start=len(chain) - 1)
            usage = store.namespace_usage()
            hybrid = sum(usage.get(p.root, (0, 0))[1] for p in hyb.parts())
            return hybrid, usage[ns.root][1]
        finally:
            store.close()


def bytes_rows(quick: bool) -> Iterator[dict[str, Any]]:
    context = 8192 if quick else CONTEXT
    for name in PLANS:
        ns = _ns(name)
        small = _ns(name, scale=64)
        for c in INTERVALS:
            policy = _policy(c)
            exact = window_bytes_per_token(ns, context, policy)
            hybrid, everything = _store_run(small, context, policy)
            yield result(
                "hybrid", f"bytes_per_token_{name}_C{c or 'end'}", exact["hybrid_bytes_per_token"], "B",
                exact["everything_bytes_per_token"], context=context, window=PLANS[name][2] or None,
                checkpoints=int(exact["checkpoints"]), window_pieces=int(exact["window_pieces"]), every_blocks=c, store_run_ratio=round(hybrid / everything, 4),
                replay_bound_tokens=(c - 1) * BT if c else None,
                goal_ratio=0.55 if PLANS[name][0] == PLANS[name][1] else None,
            )


def _tiny_gemma3(window: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=window,
        sliding_window_pattern=2,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _dram_store(root: str, capacity: int) -> KVStore:
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": capacity, "slab_bytes": 64 << 20}),)
    return KVStore(StoreConfig(root=Path(root), tiers=tiers, persist_on_close=False))


def replay_rows(quick: bool) -> Iterator[dict[str, Any]]:
    bt, c, w = 16, 8, 48
    model = _tiny_gemma3(w)
    g = torch.Generator().manual_seed(1)
    stored = torch.randint(0, 256, (1024,), generator=g)
    hits = 8 if quick else 40
    with tempfile.TemporaryDirectory() as d:
        store = _dram_store(d, 256 << 20)
        try:
            lm = HybridLM(model, store, namespace_of(model, "bench/tiny-gemma3", bt), policy=CheckpointPolicy(every_blocks=c))
            every = HybridLM(model, store, namespace_of(model, "bench/tiny-gemma3-all", bt), everything=True)
            lm.prefill(stored)
            every.prefill(stored)
            replayed, hit, worst_err = [], [], 0.0
            rng = np.random.default_rng(2)
            for _ in range(hits):
                cut = int(rng.integers(bt * 2, stored.numel()))
                prompt = torch.cat([stored[:cut], torch.randint(0, 256, (bt,), generator=g)])
                a = lm.prefill(prompt, store=False)
                b = every.prefill(prompt, store=False)
                replayed.append(a.replayed_tokens)
                hit.append(a.hit_tokens)
                worst_err = max(worst_err, float((a.logits - b.logits).abs().max() / b.logits.abs().max()))
        finally:
            store.close()
    yield result(
        "hybrid", "replayed_tokens_per_hit", float(np.mean(replayed)), "tokens", float((c - 1) * bt),
        max_replayed=int(max(replayed)), mean_hit_tokens=float(np.mean(hit)), hits=hits, every_blocks=c,
        block_tokens=bt, window=w, logits_rel_err_vs_everything=float(f"{worst_err:.2e}"),
        note="baseline = the bound (C-1) x block_tokens",
    )


def trace_rows(quick: bool) -> Iterator[dict[str, Any]]:
    """Replayed tokens per hit on a document-QA trace, with and without checkpoints where hits
    end (``CheckpointPolicy.at_hits``): documents of 300-900 tokens (not block-aligned), each
    asked several questions in an interleaved order; every request is the document and one
    question, stored after it is served. A first question stores the document's blocks with a
    checkpoint at the request's end, past the document; later questions' hits end at the
    document's last full block, between checkpoints."""
    bt, c, w = 16, 8, 48
    model = _tiny_gemma3(w)
    g = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    docs = [torch.randint(0, 256, (int(rng.integers(300, 900)),), generator=g) for _ in range(3 if quick else 6)]
    asks = 3 if quick else 5
    order = [d for d in range(len(docs)) for _ in range(asks)]
    rng.shuffle(order)
    prompts = [torch.cat([docs[d], torch.randint(0, 256, (int(rng.integers(20, 60)),), generator=g)]) for d in order]
    for at_hits in (False, True):
        with tempfile.TemporaryDirectory() as d:
            store = _dram_store(d, 256 << 20)
            try:
                ns = namespace_of(model, f"bench/tiny-gemma3-trace-{at_hits}", bt)
                lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=c, at_hits=at_hits))
                replayed, hits, stored = [], 0, 0
                for p in prompts:
                    pre = lm.prefill(p)
                    stored += pre.stored_bytes
                    if pre.hit_tokens:
                        hits += 1
                        replayed.append(pre.replayed_tokens)
            finally:
                store.close()
        yield result(
            "hybrid", f"trace_replayed_tokens_per_hit_{'at_hits' if at_hits else 'periodic_and_end'}", float(np.mean(replayed)),
            "tokens", float((c - 1) * bt), requests=len(prompts), hits=hits, documents=len(docs), every_blocks=c,
            block_tokens=bt, window=w, at_hits=at_hits, stored_bytes=stored, max_replayed=int(max(replayed)),
            note="baseline = the bound (C-1) x block_tokens",
        )


def _gpu_model(quick: bool) -> Any:
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4 if quick else 32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        sliding_window=128, sliding_window_pattern=2, attn_implementation="sdpa",
    )
    return random_bf16_on_cuda(transformers.Gemma3ForCausalLM, cfg)


def _runs_here(what: str, quick: bool) -> bool:
    """CUDA, or a CPU smoke run (``--quick``); otherwise says why the part is skipped."""
    if torch.cuda.is_available() or quick:
        return True
    print(f"hybrid {what}: skipped, needs a CUDA device (--quick runs a CPU smoke test)", flush=True)
    return False


ATTENTION = ("auto",)
"""Attention of the TTFT rows (``HybridLM(attention=...)``; ``auto`` is FlashAttention-2 on CUDA),
the same for the hybrid engine and both store-everything baselines."""


def _attentions(names: tuple[str, ...] | None, on_gpu: bool) -> list[str]:
    return list(dict.fromkeys(names or ATTENTION)) if on_gpu else ["model"]


def _summary(tl: dict[str, Any] | None) -> dict[str, Any] | None:
    """The per-layer timeline (``HybridPrefill.timeline``) and what it says: when the last load
    completed, when the last layer ended, and how long the compute stream waited for loads."""
    if tl is None:
        return None
    loads = [x for x in tl["load_ms"] if x is not None]
    starts, ends = tl["start_ms"], tl["end_ms"]
    waited = 0.0  # time the compute stream stood still before a layer whose load was late
    for i, ld in enumerate(tl["load_ms"]):
        prev_end = ends[i - 1] if i else starts[0]
        if ld is not None and starts[i] is not None and prev_end is not None and ld > prev_end:
            waited += min(starts[i], ld) - prev_end
    return {"last_load_ms": max(loads) if loads else None, "first_start_ms": starts[0], "last_end_ms": ends[-1],
            "compute_ms": round(sum(e - b for b, e in zip(starts, ends, strict=True) if b is not None and e is not None), 3),
            "waited_for_loads_ms": round(waited, 3), **tl}


class _Seen(NamedTuple):
    """What a row keeps of an untimed prefill (its KV cache, gigabytes on the device, is let go)."""

    logits: torch.Tensor
    replayed_tokens: int
    hit_tokens: int
    loaded_bytes: int


class _Warm(list[tuple[_Seen, _Seen, _Seen]]):
    """The first warm pass's (hybrid, everything, everything-needed) prefill of every case, and
    how many passes the warm-up took (``pass_seconds``: each pass's wall time)."""

    passes: int = 0
    pass_seconds: list[float]


WARM_TOLERANCE = 0.05
"""The warm-up ends when a pass over every case takes within this share of the pass before."""
WARM_PASSES = 4
"""At most this many warm passes on CUDA (one on the CPU smoke run)."""


def _warm(cases: list[tuple[int, bool, HybridLM, int, torch.Tensor]], every: HybridLM, needed: HybridLM,
          on_gpu: bool, clock: Callable[[], float] = time.perf_counter) -> _Warm:
    """Every engine over every case's prompt, untimed, until the machine is steady. The hybrid
    engine and both baselines are warmed alike: each pass runs each case through all three, so
    each prompt shape has met its kernels (cuDNN plans, the allocator's blocks, the one-time
    ``auto`` check) on every path before any row is timed. A fresh machine's first rows ran
    slow (up to 1.17x at 15 blocks, baselines slow too, with a single warm-up pass), so one pass is not taken to
    be enough: passes repeat until one's wall time is within ``WARM_TOLERANCE`` of the last."""
    out = _Warm()
    out.pass_seconds = []
    for k in range(WARM_PASSES if on_gpu else 1):
        t0 = clock()
        for _, _, lm, _, prompt in cases:
            seen = tuple(_Seen(x.logits, x.replayed_tokens, x.hit_tokens, x.loaded_bytes)
                         for x in (lm.prefill(prompt, store=False), every.prefill(prompt, store=False),
                                   needed.prefill(prompt, store=False)))
            if k == 0:
                out.append(seen)  # type: ignore[arg-type]
        out.pass_seconds.append(round(clock() - t0, 3))
        out.passes = k + 1
        if k and abs(out.pass_seconds[-1] - out.pass_seconds[-2]) <= WARM_TOLERANCE * out.pass_seconds[-2]:
            break
    return out


def ttft_rows(quick: bool, intervals: tuple[int, ...] | None = None, attentions: tuple[str, ...] | None = None,
              trace: bool = False, cones: tuple[bool, ...] = (True,)) -> Iterator[dict[str, Any]]:
    """Two store-everything baselines on the same blocks (every layer of every block stored):
    ``everything`` loads every layer of the cached blocks, as a store-everything connector does
    (the goal's baseline); ``everything_needed`` loads only what the model reads (full layers,
    the sliding layers' last window), the best such an engine can do."""
    if not _runs_here("ttft", quick):
        return
    on_gpu = torch.cuda.is_available()
    suffix = 512
    if on_gpu:
        model, prefix_len, repeat = _gpu_model(quick), (4096 if quick else CONTEXT), 3
    else:
        model, prefix_len, repeat, suffix = _tiny_gemma3(128), 2048, 1, 64
    intervals = intervals or ((16,) if quick else (21, 24))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g)
    tail = torch.randint(0, vocab, (suffix,), generator=g)
    ns = namespace_of(model, "bench/gemma3-8b-shape" + ("-quick" if quick else ""), BT)
    ns_all = replace(ns, model_id=ns.model_id + "-all")
    n_blocks = prefix_len // BT
    cap = (n_blocks + 8) * ns.block_bytes * (1 + len(intervals))  # every layer, and each split
    with tempfile.TemporaryDirectory() as d:
        store = _dram_store(d, -(-cap // (64 << 20)) * (64 << 20) + (128 << 20))
        try:
            plain = HybridLM(model, None, ns)
            HybridLM(model, store, ns_all, everything=True).prefill(prefix)
            for c in intervals:
                HybridLM(model, store, replace(ns, model_id=f"{ns.model_id}-C{c}"), policy=CheckpointPolicy(every_blocks=c)).prefill(prefix)
            plain.prefill(prefix[:1024], use_cache=False, store=False)  # kernels warm
            full_t = best_of(lambda: plain.prefill(torch.cat([prefix, tail]), use_cache=False, store=False), repeat)
            ref = plain.prefill(torch.cat([prefix, tail]), use_cache=False, store=False).logits
            plain.close()
            for attention in _attentions(attentions, on_gpu):
                kw = {"attention": attention}
                every = HybridLM(model, store, ns_all, everything=True, **kw)
                needed = HybridLM(model, store, ns_all, everything=True, all_layers=False, **kw)
                engines: list[HybridLM] = []
                cases: list[tuple[int, bool, HybridLM, int, torch.Tensor]] = []
                for c, cone in ((c, cone) for c in intervals for cone in cones):
                    lm = HybridLM(model, store, replace(ns, model_id=f"{ns.model_id}-C{c}"), policy=CheckpointPolicy(every_blocks=c),
                                  cone=cone, **kw)
                    engines.append(lm)
                    # A hit on a checkpoint (the stored prompt's end), and hits that leave the chain
                    # r blocks after periodic checkpoint p, so that r blocks replay (at most C - 1).
                    p = (n_blocks - c) // c * c - 1
                    prompts = {0: torch.cat([prefix, tail])}
                    for r in sorted({c // 4, c // 2, 3 * c // 4, c - 1}):
                        prompts[r] = torch.cat([prefix[: (p + 1 + r) * BT], tail])
                    for r, prompt in prompts.items():
                        if cone or r != 0:  # without the cone a checkpoint hit is the same: nothing replays
                            cases.append((c, cone, lm, r, prompt))
                first = _warm(cases, every, needed, on_gpu)
                for i, (c, cone, lm, r, prompt) in enumerate(cases):
                    a, b, bn = first[i]
                    assert a.replayed_tokens == r * BT, (r, a.replayed_tokens)
                    # Timed: the three engines in turn, best of ``repeat`` each, so that a drift of
                    # the machine during the row reaches the hybrid and its baselines alike.
                    ha = hb = hn = None
                    for _ in range(repeat):
                        x, y, z = lm.prefill(prompt, store=False), every.prefill(prompt, store=False), needed.prefill(prompt, store=False)
                        ha = x if ha is None or x.seconds < ha.seconds else ha
                        hb = y if hb is None or y.seconds < hb.seconds else hb
                        hn = z if hn is None or z.seconds < hn.seconds else hn
                        del x, y, z
                    assert ha is not None and hb is not None and hn is not None
                    t_h, t_e = ha.seconds, hb.seconds
                    extra: dict[str, Any] = {}
                    if trace and on_gpu:
                        for e in (lm, every, needed):
                            e.trace = True
                        extra = {"timeline": _summary(lm.prefill(prompt, store=False).timeline),
                                 "everything_timeline": _summary(every.prefill(prompt, store=False).timeline),
                                 "everything_needed_timeline": _summary(needed.prefill(prompt, store=False).timeline)}
                        for e in (lm, every, needed):
                            e.trace = False
                    rel = float((a.logits - b.logits).abs().max() / b.logits.abs().max())
                    vs_full = {}
                    if r == 0:  # the same prompt as the full prefill: the loaded path against no cache
                        vs_full = {"same_next_token_as_full_prefill": bool(a.logits.argmax() == ref.argmax()),
                                   "logits_rel_err_vs_full_prefill": round(float((a.logits - ref).abs().max() / ref.abs().max()), 4)}
                    case = ("on_checkpoint" if r == 0 else f"replay_{r}_blocks") + ("" if cone or r == 0 else "_no_cone")
                    yield result(
                        "hybrid", f"ttft_{prefix_len}_C{c}_{case}_{suffix}_new", t_h * 1e3, "ms", t_e * 1e3,
                        cone=list(ha.cone), cone_share=round(sum(ha.cone) / (len(ha.cone) * ha.computed_tokens), 4) if ha.cone else 1.0,
                        baseline_is="store-everything", goal_ratio=1.1, full_prefill_ms=round(full_t * 1e3, 2),
                        speedup_vs_full=round(full_t / t_h, 2), every_blocks=c, replayed_tokens=a.replayed_tokens,
                        hit_tokens=a.hit_tokens, loaded_bytes=a.loaded_bytes, everything_loaded_bytes=b.loaded_bytes,
                        everything_needed_ms=round(hn.seconds * 1e3, 3), ratio_vs_everything_needed=round(t_h / hn.seconds, 4),
                        everything_needed_loaded_bytes=bn.loaded_bytes,
                        same_next_token_as_everything_needed=bool(a.logits.argmax() == bn.logits.argmax()),
                        attention=attention, phases_ms=ha.phases, everything_phases_ms=hb.phases,
                        same_next_token=bool(a.logits.argmax() == b.logits.argmax()), logits_rel_err=round(rel, 4), **vs_full,
                        warm_passes=first.passes, warm_pass_s=first.pass_seconds,
                        device=torch.cuda.get_device_name() if on_gpu else "cpu (smoke)", **extra,
                    )
                    del ha, hb, hn
                for lm in engines:
                    lm.close()
                every.close()
                needed.close()
        finally:
            store.close()


def syncs_rows(quick: bool) -> Iterator[dict[str, Any]]:
    """CUDA: the host-device synchronisations inside one cached prefill of each engine
    (``torch.cuda.set_sync_debug_mode``): each one stops the host until the compute stream,
    which waits for the loads, catches up, so the model's later kernels are issued late."""
    if not torch.cuda.is_available():
        print("hybrid syncs: skipped, needs a CUDA device", flush=True)
        return
    import traceback
    import warnings

    model = _gpu_model(quick)
    prefix_len = 4096 if quick else CONTEXT
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, model.config.vocab_size, (prefix_len,), generator=g)
    prompt = torch.cat([prefix, torch.randint(0, model.config.vocab_size, (512,), generator=g)])
    ns = namespace_of(model, "bench/gemma3-syncs", BT)
    cap = (prefix_len // BT + 8) * ns.block_bytes * 2
    with tempfile.TemporaryDirectory() as d:
        store = _dram_store(d, -(-cap // (64 << 20)) * (64 << 20) + (128 << 20))
        try:
            for name, kw in (("hybrid", {}), ("everything", {"everything": True}), ("hybrid_flash", {"attention": "flash"})):
                lm = HybridLM(model, store, replace(ns, model_id=f"{ns.model_id}-{name}"), policy=CheckpointPolicy(every_blocks=21), **kw)
                lm.prefill(prefix)
                lm.prefill(prompt, store=False)
                seen: dict[str, int] = {}

                def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None,
                         seen: dict[str, int] = seen) -> None:
                    if "synchroniz" not in str(message):
                        return
                    frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
                    where = "; ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:])
                    seen[where] = seen.get(where, 0) + 1

                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = note
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        pre = lm.prefill(prompt, store=False)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                yield result("hybrid", f"syncs_in_prefill_{name}", float(sum(seen.values())), "syncs", 0.0,
                             places=seen, ttft_ms=round(pre.seconds * 1e3, 2), phases_ms=pre.phases)
                lm.close()
        finally:
            store.close()


def trace_ttft_rows(quick: bool, attention: str | None = None) -> Iterator[dict[str, Any]]:
    """TTFT on a document-QA trace (CUDA; ``--quick`` on the CPU: a smoke run): documents of
    8K-24K tokens (not block-aligned), each asked 4 questions of 100-600 tokens in an
    interleaved order, served one at a time and stored after each, by three engines on one
    store: store-everything, and the hybrid split at C = 24 (bytes <= 0.55x) with and without
    checkpoints where hits end (``at_hits``). Figures over the requests that hit: mean TTFT
    against store-everything's on the same requests, mean replayed tokens."""
    if not _runs_here("trace ttft", quick):
        return
    on_gpu = torch.cuda.is_available()
    c = 24
    if on_gpu:
        model, lo, hi, qlo, qhi, docs, asks = _gpu_model(quick), 8192, 24576, 100, 600, 6, 4
    else:
        model, lo, hi, qlo, qhi, docs, asks = _tiny_gemma3(128), 1600, 3000, 20, 120, 2, 3
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    texts = [torch.randint(0, vocab, (int(rng.integers(lo, hi)),), generator=g) for _ in range(docs)]
    order = [d for d in range(docs) for _ in range(asks)]
    rng.shuffle(order)
    prompts = [torch.cat([texts[d], torch.randint(0, vocab, (int(rng.integers(qlo, qhi)),), generator=g)]) for d in order]
    ns = namespace_of(model, "bench/gemma3-trace" + ("-quick" if quick else ""), BT)
    tokens = sum(int(t.numel()) for t in texts) + len(prompts) * qhi  # distinct tokens stored, at most
    # Every layer once, each split under that, and room to spare: nothing may be evicted (a
    # hit cut short by eviction would measure the arena, not the engines).
    cap = 3 * (tokens // BT + len(prompts)) * ns.block_bytes + (512 << 20)
    (attention,) = _attentions((attention or ATTENTION[0],), on_gpu)
    kw = {"attention": attention}
    with tempfile.TemporaryDirectory() as d:
        store = _dram_store(d, -(-cap // (64 << 20)) * (64 << 20))
        try:
            engines = {
                # Same blocks as "everything", loading only what the model reads; runs first on each
                # prompt and stores nothing (its hit is everything's).
                "everything_needed": HybridLM(model, store, replace(ns, model_id=ns.model_id + "-all"), everything=True,
                                              all_layers=False, **kw),
                "everything": HybridLM(model, store, replace(ns, model_id=ns.model_id + "-all"), everything=True, **kw),
                "at_hits": HybridLM(model, store, replace(ns, model_id=f"{ns.model_id}-C{c}-hits"),
                                    policy=CheckpointPolicy(every_blocks=c), **kw),
                "periodic_and_end": HybridLM(model, store, replace(ns, model_id=f"{ns.model_id}-C{c}"),
                                             policy=CheckpointPolicy(every_blocks=c, at_hits=False), **kw),
            }
            warm = torch.randint(0, vocab, (1024,), generator=g)
            for lm in engines.values():
                lm.prefill(warm, use_cache=False, store=False)
            ttft: dict[str, list[float]] = {k: [] for k in engines}
            replayed: dict[str, list[int]] = {k: [] for k in engines}
            hits: dict[str, list[int]] = {k: [] for k in engines}
            phases: dict[str, list[dict[str, float]]] = {k: [] for k in engines}
            hit = []
            for prompt in prompts:
                pres = {k: lm.prefill(prompt, store=k != "everything_needed") for k, lm in engines.items()}
                if pres["everything"].hit_tokens:
                    hit.append(True)
                    for k, pre in pres.items():
                        ttft[k].append(pre.seconds)
                        replayed[k].append(pre.replayed_tokens)
                        hits[k].append(pre.hit_tokens + pre.replayed_tokens)  # the full part's hit
                        phases[k].append(pre.phases)
            evicted = store.stats()["evictions"]
            for lm in engines.values():
                lm.close()
        finally:
            store.close()
    base = float(np.mean(ttft["everything"])) * 1e3
    for k in ("at_hits", "periodic_and_end"):
        ratios = [a / b for a, b in zip(ttft[k], ttft["everything"], strict=True)]
        yield result(
            "hybrid", f"trace_ttft_C{c}_{k}", float(np.mean(ttft[k])) * 1e3, "ms", base, baseline_is="store-everything",
            goal_ratio=1.1, requests=len(prompts), hit_requests=len(hit), documents=docs, every_blocks=c,
            mean_replayed_tokens=float(np.mean(replayed[k])), max_replayed_tokens=int(max(replayed[k])),
            same_hits_as_everything=hits[k] == hits["everything"], mean_hit_tokens=float(np.mean(hits["everything"])),
            evictions=int(evicted), ttft_ms=[round(x * 1e3, 1) for x in ttft[k]],
            everything_ttft_ms=[round(x * 1e3, 1) for x in ttft["everything"]],
            per_request_ratio_max=round(max(ratios), 3), per_request_ratio_median=round(float(np.median(ratios)), 3),
            attention=attention, mean_phases_ms=_mean_phases(phases[k]),
            everything_needed_mean_ms=round(float(np.mean(ttft["everything_needed"])) * 1e3, 2),
            everything_needed_ttft_ms=[round(x * 1e3, 1) for x in ttft["everything_needed"]],
            everything_needed_mean_phases_ms=_mean_phases(phases["everything_needed"]),
            everything_mean_phases_ms=_mean_phases(phases["everything"]), everything_phases_ms=phases["everything"],
            device=torch.cuda.get_device_name() if on_gpu else "cpu (smoke)",
        )


def _mean_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(float(np.mean([r.get(k, 0.0) for r in rows])), 3) for k in rows[0]} if rows else {}


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from bytes_rows(args.quick)
    yield from replay_rows(args.quick)
    yield from trace_rows(args.quick)
    yield from ttft_rows(args.quick)
    yield from trace_ttft_rows(args.quick)


def main(argv: list[str]) -> None:
    """``python -m tools.bench.hybrid [bytes|replay|trace|ttft|trace_ttft|syncs ...] [--quick]
    [--c 21,24] [--attention auto,model] [--trace]``: the named parts only (all but ``syncs`` by
    default); ``--c`` the checkpoint intervals and ``--attention`` the attention of the TTFT rows
    (the first also runs ``trace_ttft``); ``--trace`` adds each TTFT row's per-layer device
    timeline."""
    import json

    from kvstore.version import version

    p = argparse.ArgumentParser(
        prog="python -m tools.bench.hybrid",
        description="Hybrid (sliding-window) model benchmarks: bytes per cached token, bounded replay, "
        "document-QA traces and, on CUDA, TTFT against store-everything; JSON lines on stdout.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("parts", nargs="*", choices=["bytes", "replay", "trace", "ttft", "trace_ttft", "syncs"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--c", default="", help="checkpoint intervals of the TTFT rows, comma-separated")
    p.add_argument("--attention", default="", help="attention of the TTFT rows (auto, model, flash), comma-separated")
    p.add_argument("--trace", action="store_true", help="per-layer device timelines in the TTFT rows")
    p.add_argument("--cone", default="on", help="TTFT rows: the hybrid engine with its dependency cone (on), without (off), or both (on,off)")
    a = p.parse_args(argv)
    cs = tuple(int(x) for x in a.c.split(",") if x) or None
    vs = tuple(x for x in a.attention.split(",") if x) or None
    parts = {
        "bytes": lambda: bytes_rows(a.quick), "replay": lambda: replay_rows(a.quick), "trace": lambda: trace_rows(a.quick),
        "ttft": lambda: ttft_rows(a.quick, cs, vs, a.trace, tuple(x == "on" for x in a.cone.split(",") if x)), "trace_ttft": lambda: trace_ttft_rows(a.quick, vs[0] if vs else None),
        "syncs": lambda: syncs_rows(a.quick),
    }
    for name in a.parts or [k for k in parts if k != "syncs"]:
        for row in parts[name]():
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
