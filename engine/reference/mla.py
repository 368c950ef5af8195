"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

What an MLA model caches is not per-head K and V but, per token and layer, one latent of
``kv_lora_rank + qk_rope_head_dim`` values (512 + 64 in DeepSeek-V3): the normalised compressed
KV ``c_kv`` and the shared RoPE'd key ``k_pe``. ``kv_b_proj`` (``[heads * (nope + v),
kv_lora_rank]``) turns ``c_kv`` into every head's no-RoPE key and value. transformers'
``DeepseekV3Attention`` computes that for its own forward; this module computes the same
attention from the module's weights over latent rows the engine keeps, in two forms (as vLLM's
``vllm/v1/attention/backends/mla/common.py`` and DeepSeek's inference code do):

- **naive** (vLLM's "compute friendly" form, what it runs for prefill): decompress the cached
  latents with ``kv_b_proj`` (``n x kv_lora_rank x heads x (nope + v)`` multiply-adds) and run
  ordinary attention with a ``nope + rope`` key and a ``v`` value per head;
- **absorbed** (the "data-movement friendly" form, what vLLM runs for decode): fold
  ``kv_b_proj``'s K part into the query (``q_nope @ W_UK``: a query of ``kv_lora_rank`` per head)
  and its V part into the output (``o_latent @ W_UV^T``), so attention runs in the latent space
  as multi-query attention over the latent rows themselves (key ``c_kv | k_pe``, value ``c_kv``),
  and nothing per cached token is decompressed.

Per query token and cached token the absorbed form costs ``kv_lora_rank * 2 + rope`` (1,088)
multiply-adds per head in attention against the naive ``nope + rope + v`` (320), but it never
decompresses the ``n`` cached rows (``kv_lora_rank * (nope + v)`` = 131,072 per head and row).
So the naive form wins unless a request adds fewer than ~170 tokens to a long prefix (decode,
or a tiny suffix): :func:`choose_form` decides by that arithmetic, per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from engine.kvlayout import KVShape

FORMS = ("auto", "naive", "absorbed")


def mla_config(config: Any) -> Any:
    """The decoder config of an MLA model; a clear error for any other model."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(cfg, "kv_lora_rank", None) or not getattr(cfg, "qk_rope_head_dim", None):
        raise ValueError(f"{type(cfg).__name__} is not an MLA model (no kv_lora_rank / qk_rope_head_dim); "
                         "use engine.reference.batch.BatchedLM for it")
    return cfg


def latent_shape(config: Any, dtype: torch.dtype, block_tokens: int) -> KVShape:
    """The KV shape of an MLA model's latent cache: ``kv_lora_rank + qk_rope_head_dim`` values
    per token and layer (a store namespace with one ``mla`` layer group)."""
    cfg = mla_config(config)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if width % 2:
        raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {width} is odd: the latent is moved as two halves")
    return KVShape(cfg.num_hidden_layers, 1, width // 2, dtype, block_tokens, mla=(cfg.kv_lora_rank, cfg.qk_rope_head_dim))


@dataclass(frozen=True, slots=True)
class Dims:
    heads: int
    nope: int
    rope: int
    v: int
    latent: int

    @classmethod
    def of(cls, attn: Any) -> Dims:
        return cls(attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank)


def request_flops(form: str, d: Dims, s: int, n: int) -> float:
    """Attention FLOPs of one request of ``s`` new tokens over ``n`` tokens in all (causal: each
    new token sees about ``n - s/2``), in ``form``: what :func:`choose_form` compares."""
    pairs = s * (n - s / 2)
    if form == "naive":
        return 2 * n * d.latent * d.heads * (d.nope + d.v) + 2 * pairs * d.heads * (d.nope + d.rope + d.v)
    return 2 * s * d.heads * d.latent * (d.nope + d.v) + 2 * pairs * d.heads * (2 * d.latent + d.rope)


def choose_form(form: str, d: Dims, lengths: list[tuple[int, int]]) -> str:
    """``form``, or for ``"auto"`` the form with fewer FLOPs over the batch's ``(new, total)``."""
    if form != "auto":
        return form
    naive = sum(request_flops("naive", d, s, n) for s, n in lengths)
    absorbed = sum(request_flops("absorbed", d, s, n) for s, n in lengths)
    return "absorbed" if absorbed < naive else "naive"


def _rope_fns() -> tuple[Any, Any]:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    return m.apply_rotary_pos_emb, m.apply_rotary_pos_emb_interleave


def project(attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections of ``x`` (``[S, hidden]``, normalised) through a ``DeepseekV3Attention``:
    ``(q_nope [S, H, nope], q_pe [S, H, rope], latent [S, kv_lora_rank + rope])``, RoPE applied
    (``cos``/``sin`` ``[1, S, rope]`` from the model's rotary embedding), ``c_kv`` normalised: the
    latent is what the cache keeps."""
    d = Dims.of(attn)
    s = x.shape[0]
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(s, d.heads, d.nope + d.rope)
    q_nope, q_rot = q[..., : d.nope], q[..., d.nope :]
    ckv = attn.kv_a_proj_with_mqa(x)
    c, k_rot = ckv[:, : d.latent], ckv[:, d.latent :]
    c = attn.kv_a_layernorm(c)
    plain, interleave = _rope_fns()
    fn = interleave if getattr(attn.config, "rope_interleave", False) else plain
    q_rot, k_rot = fn(q_rot.transpose(0, 1).unsqueeze(0), k_rot.view(1, 1, s, d.rope), cos, sin)
    return q_nope, q_rot[0].transpose(0, 1), torch.cat([c, k_rot[0, 0]], dim=-1)


def decompress(attn: Any, rows: torch.Tensor, d: Dims, pad_v: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head ``K [n, H, nope + rope]`` and ``V [n, H, v]`` of latent rows ``[n, latent + rope]``
    (``pad_v``: V zero-padded to K's width, for kernels that need one head size)."""
    n = rows.shape[0]
    kv = attn.kv_b_proj(rows[:, : d.latent]).view(n, d.heads, d.nope + d.v)
    k = kv.new_empty((n, d.heads, d.nope + d.rope))
    k[..., : d.nope] = kv[..., : d.nope]
    k[..., d.nope :] = rows[:, None, d.latent :]
    if not pad_v:
        return k, kv[..., d.nope :]
    v = kv.new_zeros((n, d.heads, d.nope + d.rope))
    v[..., : d.v] = kv[..., d.nope :]
    return k, v


def attend_naive(attn: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One request: ``s`` new tokens (their queries) over its ``n`` latent rows (the cached
    prefix, then the new tokens), causal aligned bottom-right. Returns ``[s, H, v]``."""
    d = Dims.of(attn)
    s, n = q_nope.shape[0], rows.shape[0]
    k, v = decompress(attn, rows, d)
    q = torch.cat([q_nope, q_pe], dim=-1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=causal_lower_right(s, n), scale=attn.scaling,
    )
    return o[0].transpose(0, 1)


def absorbed_weights(attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [H, nope, latent], W_UV [H, v, latent])``: views of ``kv_b_proj``'s weight."""
    d = Dims.of(attn)
    w = attn.kv_b_proj.weight.view(d.heads, d.nope + d.v, d.latent)
    return w[:, : d.nope], w[:, d.nope :]


_SCORES = 1 << 28
"""Scores (float32 elements) the absorbed form holds at once: queries go in chunks under it."""


def attend_absorbed(attn: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """As :func:`attend_naive`, in the latent space: multi-query attention of ``H`` queries of
    ``latent + rope`` over the rows themselves (key: the whole latent, value: ``c_kv``). One key
    for every head lets the heads fold into the rows of two plain GEMMs (scores ``[H*s, n]``,
    output ``[H*s, latent]``), in query chunks of at most ``_SCORES`` scores; softmax in float32."""
    d = Dims.of(attn)
    s, n = q_nope.shape[0], rows.shape[0]
    w_uk, w_uv = absorbed_weights(attn)
    q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk), q_pe.transpose(0, 1)], dim=-1)  # [H, s, latent + rope]
    o = q.new_empty((d.heads, s, d.latent))
    step = max(1, _SCORES // (d.heads * n))
    for a in range(0, s, step):
        b = min(s, a + step)
        scores = (q[:, a:b].reshape(d.heads * (b - a), -1) @ rows.T).view(d.heads, b - a, n).float() * attn.scaling
        # Query i of the request sees keys up to n - s + i (its cached prefix, then causally).
        later = torch.ones((b - a, n), dtype=torch.bool, device=rows.device).triu_(n - s + a + 1)
        p = torch.softmax(scores.masked_fill_(later, float("-inf")), dim=-1).to(rows.dtype)
        o[:, a:b] = (p.view(d.heads * (b - a), n) @ rows[:, : d.latent]).view(d.heads, b - a, d.latent)
    return torch.bmm(o, w_uv.transpose(1, 2)).transpose(0, 1)  # [s, H, v]


ATTEND = {"naive": attend_naive, "absorbed": attend_absorbed}


def decoder(model: Any) -> Any:
    """The ``DeepseekV3Model`` (embeddings, layers, norm, rotary embedding) of a causal LM, or a
    clear error when its layers are not MLA layers this module can run."""
    mla_config(model.config)
    base = model.base_model
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            raise ValueError(f"{type(base).__name__} has no {name!r}: not a DeepSeek-V2/V3-style decoder")
    for i, layer in enumerate(base.layers):
        a = getattr(layer, "self_attn", None)
        if a is None or not hasattr(a, "kv_b_proj") or not hasattr(a, "kv_a_proj_with_mqa"):
            raise ValueError(f"layer {i} has no MLA attention (kv_a_proj_with_mqa, kv_b_proj)")
    return base
