"""Where a hybrid replay's device time goes (CUDA only): attention kernels and a kernel profile.

``python -m tools.lab.probes.hybrid_kernels [attention|profile ...] [--quick] [--c 21]``: JSON lines.

- **attention**: one full layer's attention of ``S`` new queries over ``K`` keys (the queries
  are the last ``S`` positions: causal aligned bottom-right), Llama-3-8B heads (32 query heads,
  8 KV heads, 128 dims, bf16), with every exact attention torch has on this device:
  FlashAttention-2 (``aten._flash_attention_forward``, what ``attention="flash"`` runs), cuDNN
  SDPA with ``is_causal`` (its alignment is checked, not assumed), cuDNN split in two (the
  queries against the keys before them without a mask, and against their own square block
  causally, merged by their log-sum-exp), and the memory-efficient kernel with a lower-right
  causal bias. Each is checked against a float32 reference (relative error) and timed (median
  of CUDA-event timed calls); TFLOP/s counts the causal work (4 · S · K_seen · D per head).
- **profile**: ``torch.profiler`` over one hybrid hit that replays ``r`` blocks, kernel time
  by kind (attention, matrix products, other), against the same hit on a checkpoint.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.reference.hybrid import HybridLM, namespace_of
from kvstore.hybrid import CheckpointPolicy
from tools.bench._common import result
from tools.bench.hybrid import BT, CONTEXT, _dram_store, _gpu_model

HQ, HKV, D = 32, 8, 128


def _time(fn: Callable[[], Any], n: int = 20) -> float:
    """Median milliseconds of ``n`` calls after 3 warm-ups (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 attention, bottom-right causal; ``[H, S, D]`` inputs (k, v with HKV heads)."""
    s, n = q.shape[1], k.shape[1]
    rep = q.shape[0] // k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    mask = torch.arange(n, device=q.device)[None, :] <= (torch.arange(s, device=q.device)[:, None] + n - s)
    for h in range(q.shape[0]):
        sc = (q[h].float() @ k[h // rep].float().T) * scale
        sc.masked_fill_(~mask, float("-inf"))
        out[h] = torch.softmax(sc, -1) @ v[h // rep].float()
    return out


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Two partial attentions over disjoint keys, merged by their log-sum-exp (``[B, H, S]``)."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def attention_rows(quick: bool) -> Iterator[dict[str, Any]]:
    if not torch.cuda.is_available():
        print("hybrid attention: skipped, needs a CUDA device", flush=True)
        return
    dev = torch.device("cuda")
    scale = D ** -0.5
    cases = [(512, 4096 + 512)] if quick else [(512, 32768 + 512), (512 + 64 * 10, 32768 + 512), (512 + 64 * 20, 32768 + 512)]
    for s, n in cases:
        yield from _attention_case(s, n, dev, scale)


def _attention_case(s: int, n: int, dev: torch.device, scale: float) -> Iterator[dict[str, Any]]:
    """The rows of one (queries, keys) shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device=dev).manual_seed(s)
    q = torch.randn((HQ, s, D), device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn((HKV, n, D), device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn((HKV, n, D), device=dev, dtype=torch.bfloat16, generator=g)
    ref = _reference(q, k, v, scale)
    flops = 4 * D * HQ * sum(n - s + i + 1 for i in range(s))
    cu_q = torch.tensor([0, s], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, n], dtype=torch.int32, device=dev)
    qs, ks, vs = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    q4, k4, v4 = q[None], k[None], v[None]
    k4e, v4e = k4.repeat_interleave(HQ // HKV, 1), v4.repeat_interleave(HQ // HKV, 1)

    def flash() -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(qs, ks, vs, cu_q, cu_k, s, n, 0.0, True, False, scale=scale)[0].transpose(0, 1)

    def cudnn_causal(gqa: bool) -> Callable[[], torch.Tensor]:
        def f() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                if gqa:
                    return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)[0]
                return torch.nn.functional.scaled_dot_product_attention(q4, k4e, v4e, is_causal=True, scale=scale)[0]
        return f

    def cudnn_split() -> torch.Tensor:
        p = n - s
        a = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4e[:, :, :p], v4e[:, :, :p], None, True, 0.0, False, False, scale=scale)
        b = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4e[:, :, p:], v4e[:, :, p:], None, True, 0.0, True, False, scale=scale)
        return _merge(a[0], a[1].view(1, HQ, s), b[0], b[1].view(1, HQ, s))[0]

    def efficient() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4e, v4e, attn_mask=causal_lower_right(s, n), scale=scale)[0]

    base = math.nan
    for name, fn in (("flash2", flash), ("cudnn_causal_gqa", cudnn_causal(True)), ("cudnn_causal", cudnn_causal(False)),
                     ("cudnn_split_lse", cudnn_split), ("efficient_lower_right", efficient)):
        try:
            out = fn()
            err = float((out.float() - ref).norm() / ref.norm())
            ms = _time(fn)
            row = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "rel_err": round(err, 5), "ok": err < 2e-2}
            if name == "flash2":
                base = ms
        except Exception as e:  # a backend that refuses these inputs: recorded, not fatal
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        yield result("hybrid", f"attention_{name}_q{s}_k{n}", row.get("ms", math.nan), "ms", base, baseline_is="flash2", queries=s, keys=n,
                     q_heads=HQ, kv_heads=HKV, head_dim=D, **row)


def _kind(name: str) -> str:
    n = name.lower()
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n or "cudnn" in n:
        return "attention"
    if "gemm" in n or "sm90" in n or "nvjet" in n or "cutlass" in n or "matmul" in n or "xmma" in n:
        return "matmul"
    return "other"


def profile_row(prefill: Callable[[], Any], label: str, baseline: float) -> dict[str, Any]:
    """Kernel time of one call of ``prefill`` under ``torch.profiler``, by kind and the top kernels
    (``baseline``: another call's total, e.g. the same hit on a checkpoint; 0 for none)."""
    from torch.profiler import ProfilerActivity, profile

    prefill()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0))
        if us <= 0:
            continue
        kinds[_kind(ev.key)] = kinds.get(_kind(ev.key), 0.0) + us / 1e3
        kernels.append((us / 1e3, ev.count, ev.key[:120]))
    kernels.sort(reverse=True)
    total = sum(kinds.values())
    return result("hybrid", f"profile_{label}", total, "ms", baseline, baseline_is="kernel ms of the first profiled hit", kinds_ms={k: round(v, 3) for k, v in kinds.items()},
                 top_kernels=[{"ms": round(a, 3), "calls": c, "name": k} for a, c, k in kernels[:25]])


def profile_part(quick: bool, c: int = 21, replays: tuple[int, ...] = (0, 10, 20)) -> Iterator[dict[str, Any]]:
    """Kernel time by kind (:func:`profile_row`) of hybrid hits at C = ``c``
    that replay ``replays`` blocks, the 32K prefix and model of the TTFT rows (CUDA only)."""
    if not torch.cuda.is_available():
        print("hybrid profile: skipped, needs a CUDA device", flush=True)
        return
    model, prefix_len = _gpu_model(quick), (4096 if quick else CONTEXT)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (prefix_len,), generator=g)
    tail = torch.randint(0, model.config.vocab_size, (512,), generator=g)
    ns = namespace_of(model, "bench/gemma3-8b-shape-profile", BT)
    n_blocks = prefix_len // BT
    with tempfile.TemporaryDirectory() as d:
        store = _dram_store(d, -(-(n_blocks + 8) * ns.block_bytes // (64 << 20)) * (64 << 20) + (128 << 20))
        try:
            lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=c))
            lm.prefill(prefix)
            p = (n_blocks - c) // c * c - 1
            first = 0.0
            for r in replays:
                prompt = torch.cat([prefix, tail]) if r == 0 else torch.cat([prefix[: (p + 1 + r) * BT], tail])
                row = profile_row(lambda prompt=prompt: lm.prefill(prompt, store=False), f"C{c}_replay_{r}_blocks_{lm.attention}", first)
                first = first or row["value"]
                yield row
            lm.close()
        finally:
            store.close()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from kvstore.version import version

    p = argparse.ArgumentParser(prog="python -m tools.lab.probes.hybrid_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("parts", nargs="*", choices=["attention", "profile"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--c", type=int, default=21, help="the checkpoint interval of the profiled hits (default 21)")
    a = p.parse_args(argv)
    parts = {"attention": lambda: attention_rows(a.quick), "profile": lambda: profile_part(a.quick, a.c)}
    for name in a.parts or list(parts):
        for row in parts[name]():
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
