"""throughput --model mla: the throughput stream on a scaled-down DeepSeek-V3 (MLA) shape.

The same stream, engines and rows as :mod:`tools.bench.throughput` (the Llama-3-8B figures):
(a) the batching engine without the store, (b) hits from DRAM, (c) hits from HBM, (d) the
HBM-resident ideal, each at the target hit rates, with :class:`engine.batch_mla.BatchedMLA` as
the engine. What the store and the HBM pages hold per token and layer is the MLA latent
(``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 values: 1,152 bytes in bf16), not per-head K/V.

The shape (random bf16 weights, one H200): DeepSeek-V3's attention dims as they are
(``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128, ``v_head_dim`` 128,
``q_lora_rank`` 1,536), scaled in depth and width: 24 layers of 61, hidden 4,096 of 7,168, 64
heads of 128 (V3's 56 hidden units per head would give 73; 64 keeps the heads a power of two), a
dense MLP of 10,752 (V3's dense layers' 18,432 / 7,168 ratio) in every layer instead of the MoE
(routed experts with random weights measure the router, not the cache), V3's vocabulary. About
5.9 B parameters (12 GiB); 27 KiB of latent per token (the full 61-layer V3: 69 KiB).

Hits are not free in MLA's naive prefill form (what runs here, :func:`engine.mla.choose_form`):
every cached token is decompressed by ``kv_b_proj`` in every layer (2 x 512 x heads x 256 FLOPs
per token and layer), so the FLOP bound (:func:`flop_bound`) counts that beside each new token's
attention over its whole prefix.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.batch_mla import BatchedMLA
from engine.client import EngineCache
from engine.gpu import release_arenas
from engine.hbm_cache import HbmCache
from engine.kvlayout import KVShape
from engine.mla import latent_shape, mla_config
from tools.bench._common import result
from tools.bench._gpu import need_cuda
from tools.bench.throughput import (
    H200,
    HIT_RATES,
    QUICK,
    SMOKE,
    Workload,
    _blocks_of,
    _populate,
    _Resident,
    _rows,
    _Run,
    _store,
    _stream,
    conversations,
    ring_bytes,
)


class _ResidentMLA(_Resident, BatchedMLA):
    """(d) for the MLA engine: the cached latents taken to be in the rows already."""


def mla_model(smoke: bool, quick: bool) -> Any:
    """The scaled-down DeepSeek-V3 (module docstring) on CUDA in bf16, 4 layers with ``quick``;
    ``smoke``: a tiny float32 one on the CPU."""
    import transformers

    if smoke:
        cfg = transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=4096,
        )
        torch.manual_seed(0)
        return transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    layers = 4 if quick else 24
    cfg = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=4096, intermediate_size=10752, num_hidden_layers=layers,
        first_k_dense_replace=layers, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.DeepseekV3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def _prompt_flops(config: Any, n: float, c: float) -> tuple[float, float]:
    """(FLOPs of a prompt of ``n`` tokens in full, with its first ``c`` cached), naive form:
    linear layers per computed token, ``kv_b_proj`` per cached token (decompression), attention
    ``2 x heads x (nope + rope + v)`` per (query, earlier token) pair and layer."""
    cfg = mla_config(config)
    hd, h, layers = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = hd * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else hd * h * qk
    decomp = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    lin = q + hd * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + decomp + h * cfg.v_head_dim * hd
    lin += 3 * hd * cfg.intermediate_size
    per_token, per_cached = 2 * layers * lin, 2 * layers * decomp
    per_pair = 2 * layers * h * (qk + cfg.v_head_dim)
    full = n * per_token + per_pair * n * n / 2
    return full, (n - c) * per_token + c * per_cached + per_pair * (n * n - c * c) / 2


def flop_bound(config: Any, histories: list[torch.Tensor], turns: list[list[torch.Tensor]]) -> float:
    """Compute of the timed rounds without the store over that with the prefixes cached (equal
    MFU): as :func:`tools.bench.throughput.flop_bound`, with MLA's decompression of every hit."""
    full = cached = 0.0
    for conv in turns:
        for r in range(1, len(conv)):
            f, c = _prompt_flops(config, conv[r].numel(), conv[r - 1].numel())
            full += f
            cached += c
    return full / cached if cached else 0.0


def flop_bound_by_length(config: Any, h: float, lengths: tuple[int, ...] = (1024, 4096, 8192, 16384, 32768)) -> dict[str, float]:
    out = {}
    for n in lengths:
        f, c = _prompt_flops(config, n, n * h)
        out[str(n)] = round(f / c, 2)
    return out


def _check(lm: BatchedMLA, model: Any, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """The batch against each request alone (the same engine and store, one prompt per pass):
    same greedy token, logits' relative error. (The stream's histories are random latent bytes,
    so a full recompute would not be the reference.)"""
    alone = BatchedMLA(model, lm.cache, attention=lm.attention, block_tokens=lm.shape.block_tokens, form=lm.form)
    want = [alone.prefill([p], store=False)[0] for p in prompts]
    got = lm.prefill(prompts, store=False)
    same = sum(int(a.logits.argmax() == b.logits.argmax()) for a, b in zip(want, got, strict=True))
    err = max(float((a.logits - b.logits).abs().max() / a.logits.abs().max()) for a, b in zip(want, got, strict=True))
    return {"checked_requests": len(prompts), "same_greedy_token": same, "logits_rel_err": round(err, 5),
            "hit_tokens_alone": [a.hit_tokens for a in want], "hit_tokens_batched": [b.hit_tokens for b in got]}


def measure(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    smoke = args.smoke
    if not smoke and not need_cuda("throughput --model mla"):
        return
    w = SMOKE if smoke else QUICK if args.quick else H200
    if args.conversations:
        w = replace(w, conversations=args.conversations)
    model = mla_model(smoke, args.quick)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    shape = latent_shape(model.config, dtype, w.block_tokens)
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
            extra: dict[str, Any] = {
                "model": "mla", "layers": shape.num_layers, "kv_bytes_per_token": shape.block_bytes // shape.block_tokens,
                "conversations": wh.conversations, "kv_gib": round(n_blocks * shape.block_bytes / (1 << 30), 2),
                "flop_bound": round(flop_bound(model.config, histories, turns), 2),
                "flop_bound_by_prompt_tokens": flop_bound_by_length(model.config, h),
            }
            for kind in ("none", "ideal", "dram", "hbm"):
                runs[kind] = _engine_run(kind, h, args, model, shape, wh, histories, turns, n_blocks, chunk_np,
                                         Path(d) / f"{kind}-{h}", extra, last=h == rates[-1], smoke=smoke)
                shutil.rmtree(Path(d) / f"{kind}-{h}", ignore_errors=True)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            for row in _rows(h, runs, extra, shape, smoke):
                row["metric"] = f"mla_{row['metric']}"
                yield row


def _engine_run(kind: str, h: float, args: argparse.Namespace, model: Any, shape: KVShape, w: Workload,
                histories: list[torch.Tensor], turns: list[list[torch.Tensor]], n_blocks: int, chunk: np.ndarray,
                root: Path, extra: dict[str, Any], *, last: bool, smoke: bool) -> _Run:
    """One engine over the stream, with its own store (a fresh DRAM arena) when it has one."""
    dev = next(model.parameters()).device
    kw: dict[str, Any] = {"attention": "loop" if smoke else args.attention, "block_tokens": w.block_tokens}
    if kind == "none":
        return _stream(BatchedMLA(model, None, **kw), turns, histories, w, kind, None)
    if kind == "ideal":
        ideal = _ResidentMLA(model, None, **kw)
        ideal._rows(w.max_rows)  # allocated (and filled) before the timed rounds
        return _stream(ideal, turns, histories, w, kind, None)
    store = _store(root, n_blocks, shape.block_bytes)
    cache = EngineCache(store, shape.namespace(f"bench/throughput-mla-{kind}-{h}"), shape, max_pending=1 << 16)
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
        lm = BatchedMLA(model, cache, hbm=hbm, layer_groups=args.layer_groups, store_ring_bytes=ring, **kw)
        run = _stream(lm, turns, histories, w, kind, cache)
        extra[f"{kind}_forms"] = dict(lm.forms_run)
        if hbm is not None:
            extra[f"{kind}_counters"] = {k: getattr(hbm.counters, k) for k in hbm.counters.__slots__}
        if last:
            extra["check" if kind == "dram" else f"check_{kind}"] = _check(lm, model, [conv[-1] for conv in turns[:2]])
        return run
    finally:
        cache.close()
        if hbm is not None:
            hbm.close()
        store.close()
        release_arenas()


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from measure(args)


FORM_SHAPES = ((8, 2048), (32, 2048), (128, 2048), (512, 2048), (2048, 2048))
"""``(new tokens, tokens in all)`` of one request, for :func:`forms`."""


def forms(heads: int = 8, repeat: int = 3, shapes: tuple[tuple[int, int], ...] = FORM_SHAPES) -> Iterator[dict[str, Any]]:
    """One MLA layer's attention on the CPU (float32, DeepSeek-V3's per-head dims, ``heads``
    heads) in the absorbed form against the naive one, per ``(s, n)``: the time of each (best
    of ``repeat``) and the form :func:`engine.mla.choose_form` picks by FLOPs."""
    import transformers

    from engine.mla import ATTEND, Dims, choose_form, project

    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=1024, intermediate_size=64, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    attn = model.model.layers[0].self_attn
    d = Dims.of(attn)
    for s, n in shapes:
        x = torch.randn(n, cfg.hidden_size)
        pos = torch.arange(n).unsqueeze(0)
        cos, sin = model.model.rotary_emb(x.unsqueeze(0), pos)
        with torch.no_grad():
            q_nope, q_pe, rows = project(attn, x, cos, sin)
            q_nope, q_pe = q_nope[n - s :], q_pe[n - s :]
            best = {}
            for form in ("naive", "absorbed"):
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    ATTEND[form](attn, q_nope, q_pe, rows)
                    times.append(time.perf_counter() - t0)
                best[form] = min(times)
        yield result("throughput_mla", f"absorbed_s{s}_n{n}_seconds", best["absorbed"], "s", best["naive"],
                     heads=heads, auto_form=choose_form("auto", d, [(s, n)]),
                     faster="absorbed" if best["absorbed"] < best["naive"] else "naive")


if __name__ == "__main__":  # python -m tools.bench.throughput_mla --forms: the two forms on the CPU
    import json

    from kvstore.version import version

    p = argparse.ArgumentParser(prog="python -m tools.bench.throughput_mla",
                                description="MLA attention forms on the CPU (the throughput bench: "
                                "python -m tools.bench throughput --model mla)")
    p.add_argument("--forms", action="store_true", help="time the naive and absorbed forms per (new, total) tokens")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    a = p.parse_args()
    if not a.forms:
        p.error("nothing to do: pass --forms (the throughput bench is python -m tools.bench throughput --model mla)")
    for row in forms(a.heads):
        print(json.dumps(row), flush=True)
