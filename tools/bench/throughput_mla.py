"""throughput --model mla: the throughput stream on a scaled-down DeepSeek-V3 (MLA) shape.

The same stream, engines and rows as :mod:`tools.bench.throughput` (the Llama-3-8B figures):
(a) the batching engine without the store, (b) hits from DRAM, (c) hits from HBM, (d) the
HBM-resident ideal, each at the target hit rates, with :class:`engine.reference.batch_mla.BatchedMLA` as
the engine. What the store and the HBM pages hold per token and layer is the MLA latent
(``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 values: 1,152 bytes in bf16), not per-head K/V.

The shape (random bf16 weights, one H200): DeepSeek-V3's attention dims as they are
(``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128, ``v_head_dim`` 128,
``q_lora_rank`` 1,536), scaled in depth and width: 24 layers of 61, hidden 4,096 of 7,168, 64
heads of 128 (V3's 56 hidden units per head would give 73; 64 keeps the heads a power of two), a
dense MLP of 10,752 (V3's dense layers' 18,432 / 7,168 ratio) in every layer instead of the MoE
(routed experts with random weights measure the router, not the cache), V3's vocabulary. About
5.9 B parameters (12 GiB); 27 KiB of latent per token (the full 61-layer V3: 69 KiB).

Hits are not free in MLA's naive prefill form (what runs here, :func:`engine.reference.mla.choose_form`):
every cached token is decompressed by ``kv_b_proj`` in every layer (2 x 512 x heads x 256 FLOPs
per token and layer), so the FLOP bound (:func:`flop_bound`) counts that beside each new token's
attention over its whole prefix.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch

from engine.client import EngineCache
from engine.reference.batch_mla import BatchedMLA
from engine.reference.mla import latent_shape, mla_config
from tools.bench import throughput
from tools.bench._common import result
from tools.bench._gpu import random_bf16_on_cuda
from tools.bench.throughput import Bench, _Resident


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
    return random_bf16_on_cuda(transformers.DeepseekV3ForCausalLM, cfg)


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
    MFU): :func:`tools.bench.throughput.flop_bound`, with MLA's decompression of every hit."""
    return throughput.flop_bound(config, histories, turns, prompt_flops=_prompt_flops)


def flop_bound_by_length(config: Any, h: float) -> dict[str, float]:
    """:func:`tools.bench.throughput.flop_bound_by_length` with MLA's count."""
    return throughput.flop_bound_by_length(config, h, prompt_flops=_prompt_flops)


def _check(lm: BatchedMLA, model: Any, cache: EngineCache, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """The batch against each request alone (the same engine and store, one prompt per pass):
    same greedy token, logits' relative error. (The stream's histories are random latent bytes,
    so a full recompute would not be the reference.)"""
    alone = BatchedMLA(model, cache, attention=lm.attention, block_tokens=lm.shape.block_tokens, form=lm.form)
    return throughput.agreement([alone.prefill([p], store=False)[0] for p in prompts], lm.prefill(prompts, store=False))


MLA = Bench(
    name="throughput-mla", command="throughput --model mla", model=mla_model, shape=latent_shape, engine=BatchedMLA,
    resident=_ResidentMLA, check=_check, flop_bound=flop_bound, flop_bound_by_length=flop_bound_by_length,
    extra=lambda shape, n_blocks: {"model": "mla", "layers": shape.num_layers,
                                   "kv_bytes_per_token": shape.block_bytes // shape.block_tokens,
                                   "kv_gib": round(n_blocks * shape.block_bytes / (1 << 30), 2)},
    after_run=lambda lm: {"forms": dict(lm.forms_run)}, metric_prefix="mla_", compare_attention=False,
)


def measure(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from throughput.measure(args, MLA)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    yield from measure(args)


FORM_SHAPES = ((8, 2048), (32, 2048), (128, 2048), (512, 2048), (2048, 2048))
"""``(new tokens, tokens in all)`` of one request, for :func:`forms`."""


def forms(heads: int = 8, repeat: int = 3, shapes: tuple[tuple[int, int], ...] = FORM_SHAPES) -> Iterator[dict[str, Any]]:
    """One MLA layer's attention on the CPU (float32, DeepSeek-V3's per-head dims, ``heads``
    heads) in the absorbed form against the naive one, per ``(s, n)``: the time of each (best
    of ``repeat``) and the form :func:`engine.reference.mla.choose_form` picks by FLOPs."""
    import transformers

    from engine.reference.mla import ATTEND, Dims, choose_form, project

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
