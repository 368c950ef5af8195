"""throughput: prefill tokens/s counting hits, a batching engine with and without the store.

A stream of multi-turn conversations (shared system prompts, histories of 4K-32K tokens) at a
target token hit rate h: every turn's prompt is the conversation's history (cached) plus new
tokens making up a fraction 1-h of the prompt (rounded to whole blocks, so the next turn finds
the whole prompt cached). Requests go through :class:`engine.reference.batch.BatchedLM` in batches of at
most ``--max-batch-tokens`` computed tokens (and a KV-row budget), one forward pass each.

Figures (tokens/s counting hits: prompt tokens served per second), each against (a) the same
batching engine without the store (every prompt computed in full), measured in the same run:

- (b) ``dram``: hits loaded from the store's DRAM arena (leases, layer-wise 2-D DMAs
  overlapped with compute, new blocks stored in the background);
- (c) ``hbm``: the same with an :class:`engine.reference.hbm_cache.HbmCache` in front (hot blocks
  gathered from device memory; DRAM hits promoted, computed blocks admitted);
- (d) ``ideal``: the HBM-resident ideal, the same batches with each prompt's cached prefix
  already in the KV rows (no lookup, load or store): the compute-only bound.

Round 0 of each engine is a warm-up (kernels; the HBM cache fills by promotion); the
rest are timed. The wait for the last background stores after each round is reported
(``store_wait_s``) but not timed: in a server a conversation's next turn comes after decode.

Llama-3-8B shape with random bf16 weights on the GPU. ``--smoke``: a tiny float32 model on the
CPU with short prompts, to check the plumbing (figures meaningless).
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from engine.client import EngineCache
from engine.gpu import arena_tensor, release_arenas
from engine.kvlayout import KVShape, shape_of
from engine.reference.batch import BatchedLM, BatchResult, Loads, Plan, batches
from engine.reference.hbm_cache import HbmCache
from engine.reference.hf import CachedLM
from kvstore.config import StoreConfig, TierSpec
from kvstore.store import KVStore
from tools.bench._common import result
from tools.bench._gpu import SLAB, llama_8b, need_cuda

HIT_RATES = (0.5, 0.8, 0.96, 0.99)
GOALS = {"hbm": 20.0, "dram": 15.0}


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int
    rounds: int
    min_len: int
    max_len: int
    system_prompts: int
    system_len: int
    block_tokens: int
    max_batch_tokens: int
    max_rows: int
    max_kv_bytes: int
    """Distinct KV of the stream at most (fewer conversations at low hit rates, whose histories
    grow faster): what the DRAM arena and the HBM budget must hold."""


H200 = Workload(16, 3, 4096, 32768, 4, 2048, 64, 65536, 262_144, 32 << 30)
QUICK = Workload(8, 3, 4096, 16384, 2, 2048, 64, 65536, 262_144, 8 << 30)
SMOKE = Workload(4, 3, 64, 256, 2, 32, 16, 512, 4096, 1 << 30)


def conversations(w: Workload, h: float, vocab: int, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial histories (cached before the stream) and each round's prompts, per conversation.

    History lengths start log-uniform in ``[min_len, max_len * h**rounds]`` (at least
    ``min_len``) so that the final round stays near ``max_len``; each turn adds
    ``(1-h)/h`` of the history in whole blocks (at least one block)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    bt = w.block_tokens
    systems = [torch.randint(0, vocab, (w.system_len,), generator=g) for _ in range(w.system_prompts)]
    top = max(w.min_len, w.max_len * h**w.rounds)
    histories, turns = [], []
    for c in range(w.conversations):
        n0 = int(math.exp(rng.uniform(math.log(w.min_len), math.log(top)))) // bt * bt
        own = torch.randint(0, vocab, (max(bt, n0 - w.system_len),), generator=g)
        hist = torch.cat([systems[c % w.system_prompts], own])[: max(n0, bt)]
        histories.append(hist)
        conv = []
        for _ in range(w.rounds):
            new = max(1, round(hist.numel() * (1 - h) / h / bt)) * bt
            hist = torch.cat([hist, torch.randint(0, vocab, (new,), generator=g)])
            conv.append(hist)
        turns.append(conv)
    return histories, turns


def _flops(config: Any) -> tuple[float, float]:
    """(FLOPs of the linear layers per token, attention FLOPs per (query, earlier token) pair)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * hd
    per_token = 2 * cfg.num_hidden_layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)
    return per_token, 4 * q * cfg.num_hidden_layers


def _prompt_flops(config: Any, n: float, c: float) -> tuple[float, float]:
    """(FLOPs of a prompt of ``n`` tokens computed in full, with its first ``c`` cached)."""
    per_token, per_pair = _flops(config)
    return n * per_token + per_pair * n * n / 2, (n - c) * per_token + per_pair * (n * n - c * c) / 2


PromptFlops = Callable[[Any, float, float], tuple[float, float]]


def flop_bound(config: Any, histories: list[torch.Tensor], turns: list[list[torch.Tensor]],
               prompt_flops: PromptFlops = _prompt_flops) -> float:
    """Compute of the timed rounds without the store over that with every cached prefix free:
    the speedup at equal MFU. Hits are not free: each new token still attends to the whole
    prefix (``4 * heads * head_dim`` FLOPs per layer and earlier token), so this is below
    ``1/(1-h)`` for long prompts. Linear layers: 2 FLOPs per weight of a decoder layer.
    ``prompt_flops`` counts one prompt (another model's count: :mod:`tools.bench.throughput_mla`)."""
    full = cached = 0.0
    for conv in turns:
        for r in range(1, len(conv)):
            f, c = prompt_flops(config, conv[r].numel(), conv[r - 1].numel())
            full += f
            cached += c
    return full / cached if cached else 0.0


def flop_bound_by_length(config: Any, h: float, lengths: tuple[int, ...] = (1024, 4096, 8192, 16384, 32768),
                         prompt_flops: PromptFlops = _prompt_flops) -> dict[str, float]:
    """The same bound for one prompt of each length with a share ``h`` of it cached."""
    out = {}
    for n in lengths:
        f, c = prompt_flops(config, n, n * h)
        out[str(n)] = round(f / c, 2)
    return out


def _populate(cache: EngineCache, histories: list[torch.Tensor], chunk: np.ndarray) -> int:
    """Put every history's full blocks into the store (random KV bytes, 'earlier turns')."""
    lease = cache.store.acquire(cache.ns, [])
    arena_tensor(lease.arena)  # pins (and so faults in) the fresh arena once, before the copies
    cache.store.release(lease)
    per = chunk.shape[0] // cache.shape.block_bytes
    n = 0
    for hist in histories:
        hashes = cache.hashes(hist)
        for s in range(0, len(hashes), per):
            e = min(len(hashes), s + per)
            n += cache.store.put(cache.ns, hashes[:e], chunk[: (e - s) * cache.shape.block_bytes], start=s)
    return n


class _Resident(BatchedLM):
    """The HBM-resident ideal: each prompt's cached prefix is taken to be in the KV rows already
    (nothing looked up, loaded or stored; the rows hold whatever the last batch left).

    Rows are filled with random values when allocated: a fresh device allocation reads as zeros,
    and attention over zero K/V runs faster than over real KV (the first profile of this bench:
    FlashAttention took 579 ms over the ideal's never-written rows against 630-636 ms over the
    store engines' loaded rows, same batches), which made the ideal optimistic."""

    hits: list[int]

    def rows_allocated(self, buf: torch.Tensor) -> None:
        buf.normal_()

    def plan(self, ids: torch.Tensor, use_cache: bool) -> Plan:
        p = Plan(ids)
        p.n_hbm = self.hits.pop(0)
        return p

    def load(self, plans: list[Plan], kv: torch.Tensor, k_starts: list[int]) -> Loads:
        return Loads(self.shape.num_layers, 1, None, 0)


@dataclass(slots=True)
class _Run:
    tokens: int = 0
    hit: int = 0
    hbm: int = 0
    seconds: float = 0.0
    batches: int = 0
    store_wait: float = 0.0
    phases: dict[str, float] | None = None
    """The engine thread's seconds per phase over the timed rounds (:class:`engine.reference.batch.Timings`)."""
    ring_waits: int = 0
    kernels: list[dict[str, Any]] | None = None
    """With ``PROFILE``: the CUDA kernels of the timed rounds by total device time (torch.profiler)."""

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _sync(dev: torch.device) -> None:
    """The compute stream (the stores' copies to the host are waited for by ``flush``)."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def _stream(lm: BatchedLM, turns: list[list[torch.Tensor]], histories: list[torch.Tensor], w: Workload,
            kind: str, cache: EngineCache | None) -> _Run:
    """Run every round; rounds after round 0 are timed. Round 0 only warms the store
    engines (kernels, HBM promotion); the others skip it after one small warm-up batch."""
    run = _Run()
    prof = None
    prev = [h.numel() for h in histories]
    for r in range(w.rounds):
        if r == 0 and kind in ("none", "ideal"):
            if isinstance(lm, _Resident):
                lm.hits = [0]
            lm.prefill([turns[0][0][: 4 * w.block_tokens]], store=False)
            prev = [conv[0].numel() for conv in turns]
            continue
        prompts = [conv[r] for conv in turns]
        cached = [0 if kind == "none" else p for p in prev]
        reqs = [(p.numel() - c, p.numel()) for p, c in zip(prompts, cached, strict=True)]
        plan = batches(reqs, w.max_batch_tokens, w.max_rows, w.block_tokens)
        _sync(lm.device)
        if r == 1:
            lm.timings.reset()
            prof = _profiler()
        t0 = time.perf_counter()
        out: list[BatchResult] = []
        for idx in plan:
            if isinstance(lm, _Resident):
                lm.hits = [min(cached[i], prompts[i].numel() - 1) // w.block_tokens for i in idx]
            out += lm.prefill([prompts[i] for i in idx], store=kind != "ideal")
        _sync(lm.device)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        if cache is not None:
            cache.flush()
        wait = time.perf_counter() - t1
        if r:
            run.seconds += dt
            run.store_wait += wait
            run.tokens += sum(p.numel() for p in prompts)
            run.hit += sum(x.hit_tokens for x in out)
            run.hbm += sum(x.hbm_tokens for x in out)
            run.batches += len(plan)
        prev = [p.numel() for p in prompts]
    if prof is not None:
        prof.__exit__(None, None, None)
        run.kernels = _top_kernels(prof)
    run.phases = lm.timings.as_dict()
    run.ring_waits = lm.ring_waits
    return run


PROFILE = False
"""Profile the timed rounds of each engine (``python -m tools.bench.throughput``): the kernels'
device time by name, to see where an engine's device time goes against the ideal's."""


def _profiler() -> Any:
    if not PROFILE or not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def _top_kernels(prof: Any, n: int = 14) -> list[dict[str, Any]]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            rows.append({"kernel": e.key[:90], "ms": round(t / 1e3, 2), "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = round(sum(r["ms"] for r in rows), 2)
    return [{"kernel": "(all kernels)", "ms": total, "calls": sum(r["calls"] for r in rows)}, *rows[:n]]


def ring_bytes(turns: list[list[torch.Tensor]], histories: list[torch.Tensor], block_bytes: int, bt: int) -> int:
    """Host staging for the stores: the new blocks of the largest round (+10%), 1-32 GiB."""
    prev = [h.numel() // bt for h in histories]
    most = 0
    for r in range(len(turns[0])):
        now = [conv[r].numel() // bt for conv in turns]
        most = max(most, sum(n - p for n, p in zip(now, prev, strict=True)))
        prev = now
    return min(32 << 30, max(1 << 30, int(most * block_bytes * 1.1)))


def _store(root: Path, n_blocks: int, block_bytes: int) -> KVStore:
    per_slab = SLAB // (-(-block_bytes // 4096) * 4096)
    cap = (-(-int(n_blocks * 1.05) // per_slab) + 2) * SLAB
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": cap, "slab_bytes": SLAB}),)
    return KVStore(StoreConfig(root=root, tiers=tiers, persist_on_close=False))


def _model(smoke: bool, quick: bool) -> Any:
    if not smoke:
        return llama_8b(quick)
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _blocks_of(turns: list[list[torch.Tensor]], histories: list[torch.Tensor], bt: int) -> int:
    """Distinct blocks of the stream (every conversation's last prompt holds all of its own)."""
    return sum(conv[-1].numel() // bt for conv in turns) + len(histories)


def agreement(want: list[Any], got: list[Any], floor: list[Any] | None = None) -> dict[str, Any]:
    """How the batch's results (``got``) agree with each request run alone (``want``): the same
    greedy token, the logits' relative error, the hit tokens; and each request's top-2 margin
    alone (``(top1 - top2) / |top1|``, and ``top1 - top2``).

    ``floor``: each request alone again, computed with another exact attention kernel (a change
    of rounding only). Its largest absolute logit difference from ``want``, ``d0``, is how far
    bf16 rounding alone moves these logits. A greedy token can change under a perturbation of
    size ``d`` only where ``top1 - top2 <= 2 d``; ``flips_beyond_rounding`` counts the batch's
    differing tokens whose margin alone exceeds ``2 d0`` (a change rounding does not explain:
    it must be 0), and ``floor_flips`` the requests whose greedy token the kernel change alone
    flips (there the token is decided by rounding, in any engine)."""
    each: list[bool] = []
    err = 0.0
    margins: list[float] = []
    abs_margins: list[float] = []
    abs_diffs: list[float] = []
    for a, b in zip(want, got, strict=True):
        la, lb = a.logits.float(), b.logits.float()
        top = la.topk(2).values
        each.append(bool(la.argmax() == lb.argmax()))
        diff = float((la - lb).abs().max())
        err = max(err, diff / float(la.abs().max()))
        margins.append(round(float((top[0] - top[1]) / top[0].abs()), 5))
        abs_margins.append(round(float(top[0] - top[1]), 5))
        abs_diffs.append(round(diff, 5))
    out: dict[str, Any] = {
        "checked_requests": len(want), "same_greedy_token": sum(each), "same_greedy_token_each": each,
        "logits_rel_err": round(err, 5),
        "top2_margin_alone": margins, "top2_margin_abs": abs_margins, "logits_abs_diff": abs_diffs,
        "hit_tokens_alone": [a.hit_tokens for a in want], "hit_tokens_batched": [b.hit_tokens for b in got]}
    if floor is not None:
        d0 = [float((a.logits.float() - f.logits.float()).abs().max()) for a, f in zip(want, floor, strict=True)]
        out["floor_abs_diff"] = [round(d, 5) for d in d0]
        out["floor_flips"] = sum(int(a.logits.argmax() != f.logits.argmax()) for a, f in zip(want, floor, strict=True))
        out["flips_beyond_rounding"] = sum(
            int(a.logits.argmax() != b.logits.argmax() and m > 2 * d)
            for a, b, m, d in zip(want, got, abs_margins, d0, strict=True))
    return out


def _check(lm: BatchedLM, model: Any, cache: EngineCache, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """The batch against each request alone (CachedLM, same store): same greedy token; the floor
    is each request alone again with SDPA's math kernel instead of its fused one (on the CPU the
    two may be the same kernel: a floor of 0)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    alone = CachedLM(model, cache)
    want = [_outcome(alone.prefill(p, store=False)) for p in prompts]
    with sdpa_kernel([SDPBackend.MATH]):
        floor = [_outcome(alone.prefill(p, store=False)) for p in prompts]
    return agreement(want, lm.prefill(prompts, store=False), floor)


def _outcome(result: Any) -> SimpleNamespace:
    """What the check compares (logits, hit tokens), without the prefill's KV cache: a 28K-token
    prompt's cache is 3.5 GiB on the device, and the check holds many results at once."""
    return SimpleNamespace(logits=result.logits, hit_tokens=result.hit_tokens)


def _nothing(lm: BatchedLM) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Bench:
    """What the stream's model decides (Llama-3-8B here; the scaled-down DeepSeek-V3 of
    :mod:`tools.bench.throughput_mla`): everything else, the stream, the four engines and the
    rows, is one code for both."""

    name: str  # the namespaces' prefix, ``bench/{name}-{kind}-{h}``
    command: str  # as ``need_cuda`` names it
    model: Callable[[bool, bool], Any]  # (smoke, quick) -> the model
    shape: Callable[[Any, torch.dtype, int], KVShape]  # (config, dtype, block tokens)
    engine: type[BatchedLM]
    resident: type[BatchedLM]  # (d): the engine with its hits taken to be in the rows already
    check: Callable[[BatchedLM, Any, EngineCache, list[torch.Tensor]], dict[str, Any]]
    flop_bound: Callable[[Any, list[torch.Tensor], list[list[torch.Tensor]]], float]
    flop_bound_by_length: Callable[[Any, float], dict[str, float]]
    extra: Callable[[KVShape, int], dict[str, Any]]  # (shape, blocks) -> the model's own fields of the last row
    after_run: Callable[[BatchedLM], dict[str, Any]] = _nothing  # (store engine) -> {name: value}, kept as f"{kind}_{name}"
    metric_prefix: str = ""
    compare_attention: bool = True  # (d) again with the per-request loop when ``--compare-attention``


def measure(args: argparse.Namespace, bench: Bench | None = None) -> Iterator[dict[str, Any]]:
    bench = bench or LLAMA
    smoke = args.smoke
    if not smoke and not need_cuda(bench.command):
        return
    w = SMOKE if smoke else QUICK if args.quick else H200
    if args.conversations:
        w = replace(w, conversations=args.conversations)
    model = bench.model(smoke, args.quick)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    shape: KVShape = bench.shape(model.config, dtype, w.block_tokens)
    vocab = model.config.vocab_size
    rates = tuple(args.hit) if args.hit else ((0.8,) if smoke else HIT_RATES)
    gen = torch.Generator(device=dev).manual_seed(1)
    chunk_blocks = 8 if smoke else 64
    chunk = torch.randn(chunk_blocks * shape.block_bytes // dtype.itemsize, dtype=dtype, device=dev, generator=gen)
    chunk_np = chunk.view(torch.uint8).cpu().numpy()
    del chunk
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for h in [r for _ in range(args.repeat) for r in rates]:
            wh = w
            while True:
                histories, turns = conversations(wh, h, vocab)
                n_blocks = _blocks_of(turns, histories, w.block_tokens)
                if n_blocks * shape.block_bytes <= w.max_kv_bytes or wh.conversations <= 2:
                    break
                wh = replace(wh, conversations=wh.conversations - 1)
            runs: dict[str, _Run] = {}
            extra: dict[str, Any] = {**bench.extra(shape, n_blocks), "conversations": wh.conversations,
                                     "flop_bound": round(bench.flop_bound(model.config, histories, turns), 2),
                                     "flop_bound_by_prompt_tokens": bench.flop_bound_by_length(model.config, h)}
            for kind in ("none", "ideal", "dram", "hbm"):
                t0 = time.perf_counter()
                runs[kind] = _engine_run(bench, kind, h, args, model, shape, wh, histories, turns, n_blocks, chunk_np,
                                         Path(d) / f"{kind}-{h}", extra, last=h == rates[-1], smoke=smoke)
                # Progress on stderr: a run cut by its time limit still says how far each point got.
                print(f"throughput {bench.name}: {kind} at {h} took {time.perf_counter() - t0:.1f} s "
                      f"({runs[kind].tokens} tokens)", file=sys.stderr, flush=True)
                shutil.rmtree(Path(d) / f"{kind}-{h}", ignore_errors=True)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            for row in _rows(h, runs, extra, shape, smoke):
                row["metric"] = bench.metric_prefix + row["metric"]
                yield row


def _engine_run(bench: Bench, kind: str, h: float, args: argparse.Namespace, model: Any, shape: KVShape, w: Workload,
                histories: list[torch.Tensor], turns: list[list[torch.Tensor]], n_blocks: int, chunk: np.ndarray,
                root: Path, extra: dict[str, Any], *, last: bool, smoke: bool) -> _Run:
    """One engine over the stream, with its own store (a fresh DRAM arena) when it has one."""
    dev = next(model.parameters()).device
    attention = "loop" if smoke else args.attention
    if kind == "none":
        return _stream(bench.engine(model, None, attention=attention, block_tokens=w.block_tokens), turns, histories, w, kind, None)
    if kind == "ideal":
        ideal = bench.resident(model, None, attention=attention, block_tokens=w.block_tokens)
        ideal.reserve_rows(w.max_rows)  # allocated (and filled) before the timed rounds
        run = _stream(ideal, turns, histories, w, kind, None)
        if not smoke and bench.compare_attention and args.compare_attention:
            alt = bench.resident(model, None, attention="loop", block_tokens=w.block_tokens)
            extra["ideal_loop_tokens_per_s"] = round(_stream(alt, turns, histories, w, kind, None).rate)
        return run
    store = _store(root, n_blocks, shape.block_bytes)
    cache = EngineCache(store, shape.namespace(f"bench/{bench.name}-{kind}-{h}"), shape, max_pending=1 << 16)
    hbm = None
    try:
        t0 = time.perf_counter()
        _populate(cache, histories, chunk)
        extra[f"{kind}_populate_s"] = round(time.perf_counter() - t0, 2)
        if kind == "hbm":
            budget = int(args.hbm_gib * (1 << 30)) or int(n_blocks * 1.1 + 64) * shape.block_bytes
            hbm = HbmCache(cache, budget, device=dev)
            extra["hbm_budget_gib"] = round(hbm.budget_bytes / (1 << 30), 2)
        ring = ring_bytes(turns, histories, shape.block_bytes, w.block_tokens) if not smoke else None
        lm = bench.engine(model, cache, hbm=hbm, attention=attention, layer_groups=args.layer_groups,
                          block_tokens=w.block_tokens, store_ring_bytes=ring)
        run = _stream(lm, turns, histories, w, kind, cache)
        extra.update({f"{kind}_{k}": v for k, v in bench.after_run(lm).items()})
        if hbm is not None:
            extra[f"{kind}_counters"] = {k: getattr(hbm.counters, k) for k in hbm.counters.__slots__}
        if last:  # HBM: the pages' bytes against the same blocks loaded from the store alone
            check_n = 2 if smoke else getattr(args, "check_requests", 2)
            check = bench.check(lm, model, cache, [conv[-1] for conv in turns[:check_n]])
            extra["check" if kind == "dram" else f"check_{kind}"] = check
            print(f"throughput {bench.name}: {kind} check {check}", file=sys.stderr, flush=True)  # (kept if a later engine fails)
        return run
    finally:
        cache.close()
        if hbm is not None:
            hbm.close()
        store.close()
        release_arenas()


def _rows(h: float, runs: dict[str, _Run], extra: dict[str, Any], shape: KVShape, smoke: bool) -> Iterator[dict[str, Any]]:
    base = runs["none"]
    tag = f"hit{round(h * 100)}"
    common = {"target_hit": h, "bound_1_over_1_minus_h": round(1 / (1 - h), 1), "smoke": smoke}
    for kind in ("dram", "hbm", "ideal"):
        r = runs[kind]
        row = result(
            "throughput", f"{kind}_{tag}_tokens_per_s", r.rate, "tok/s", base.rate,
            speedup=round(r.rate / base.rate, 2) if base.rate else 0.0,
            measured_hit=round(r.hit / r.tokens, 4) if kind != "ideal" else None,
            hbm_share_of_hits=round(r.hbm / r.hit, 4) if r.hit else 0.0,
            tokens=r.tokens, seconds=round(r.seconds, 3), batches=r.batches,
            store_wait_s=round(r.store_wait, 3), baseline_batches=base.batches, phases_s=r.phases,
            ring_waits=r.ring_waits, **({"kernels": r.kernels} if r.kernels else {}),
            hit_gb_per_s=round((r.hit - r.hbm) * shape.block_bytes / shape.block_tokens / r.seconds / 1e9, 2) if r.seconds else 0,
            **common,
        )
        if kind in GOALS and h == 0.96:
            row["goal_speedup"] = GOALS[kind]
        yield row
    ideal = runs["ideal"]
    yield result("throughput", f"hbm_vs_ideal_{tag}", runs["hbm"].rate, "tok/s", ideal.rate,
                 dram_vs_ideal=round(runs["dram"].rate / ideal.rate, 4) if ideal.rate else None,
                 goal_ratio=0.9 if h == 0.96 else None, **common, **extra)


LLAMA = Bench(
    name="throughput", command="throughput", model=_model, shape=shape_of, engine=BatchedLM, resident=_Resident,
    check=_check, flop_bound=flop_bound, flop_bound_by_length=flop_bound_by_length,
    extra=lambda shape, n_blocks: {"kv_gib": round(n_blocks * shape.block_bytes / (1 << 30), 1)},
)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if getattr(args, "model", "llama") == "mla":  # a scaled-down DeepSeek-V3 (tools/bench/throughput_mla.py)
        from tools.bench import throughput_mla

        yield from throughput_mla.measure(args)
        return
    yield from measure(args)


if __name__ == "__main__":  # python -m tools.bench.throughput [--hit H]: one run, every engine profiled
    import json
    import sys

    PROFILE = True
    hit = float(sys.argv[sys.argv.index("--hit") + 1]) if "--hit" in sys.argv else 0.96
    ns = argparse.Namespace(smoke=False, quick=False, conversations=0, hit=[hit], repeat=1, dir=None, attention="varlen",
                            compare_attention=False, hbm_gib=0.0, layer_groups=16)
    for row in measure(ns):
        print(json.dumps(row), flush=True)
