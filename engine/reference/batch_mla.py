"""Batched prefill of an MLA model (DeepSeek-V2/V3 layers) with a cache of latents.

:class:`BatchedMLA` is :class:`engine.reference.batch.BatchedLM` with MLA attention: the KV each request's
blocks carry, in the store, in the HBM pages and in the engine's rows, is the latent of
:mod:`engine.reference.mla` (``kv_lora_rank + qk_rope_head_dim`` values per token and layer, a namespace with
one ``mla`` layer group), not per-head K and V. For DeepSeek-V3's 512 + 64 that is 1,152 bytes
per token and layer in bf16, where its 128 heads' decompressed K and V (192 + 128 values each)
would be 80 KiB.

Everything that moves bytes is BatchedLM's, unchanged: the latent shape
(:func:`engine.reference.mla.latent_shape`) is a :class:`engine.kvlayout.KVShape` of one "head" of half
the latent in the K place and the other half in the V place, so planning, HBM matching, DRAM
leases, the layer-wise loads overlapped with compute, promotion, admission, packing and the
background stores serve latents as they serve K/V. What differs is the forward: the decoder's
layers are run here (embeddings, per layer the input norm, MLA attention over the rows, the
MLP, the final norm) instead of through transformers' attention, which would decompress every
cached latent into per-head K/V before it attends. Each layer writes its new tokens' latents
into the rows through the batch's cache ``update`` (which first waits for that layer's loads)
and attends over the whole rows of that layer:

- ``attention="varlen"`` (CUDA): the naive form for the whole batch: the layer's rows
  decompressed with one ``kv_b_proj`` GEMM, then one FlashAttention-2 variable-length call (V
  zero-padded to the ``nope + rope`` head size FlashAttention-2 needs, as vLLM does); ``form=
  "absorbed"`` runs the per-request loop below instead (``"auto"`` stays naive here);
- ``attention="loop"``: one SDPA call per request, in the form ``form`` names (``"auto"``:
  :func:`engine.reference.mla.choose_form` per batch, by FLOPs).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from engine.client import EngineCache
from engine.reference.batch import _BATCH, BatchedLM, _Layout, _RowsCache
from engine.reference.mla import (
    ATTEND,
    FORMS,
    Dims,
    choose_form,
    decoder,
    decompress,
    latent_shape,
    project,
)


class BatchedMLA(BatchedLM):
    """A DeepSeek-V3-style causal LM prefilling many prompts per forward pass over latent rows."""

    def __init__(self, model: Any, cache: EngineCache | None, *, form: str = "auto", **kw: Any) -> None:
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, not {form!r}")
        base = decoder(model)
        bt = kw.get("block_tokens", 64)
        dtype = next(model.parameters()).dtype
        if cache is not None and cache.shape.mla is None:
            raise ValueError("the EngineCache of an MLA model needs engine.reference.mla.latent_shape (a namespace "
                             "with an 'mla' layer group), not a per-head K/V shape")
        super().__init__(model, cache, **kw)
        if cache is None:
            self.shape = latent_shape(model.config, dtype, bt)
        self.form = form
        """``"naive"``, ``"absorbed"`` or ``"auto"`` (per batch, by FLOPs). With
        ``attention="varlen"``, ``"auto"`` stays naive (FlashAttention-2) and ``"absorbed"``
        runs one request at a time."""
        self.forms_run: dict[str, int] = {"naive": 0, "absorbed": 0}
        """Batches run in each form."""
        self._decoder = base
        self._dims = Dims.of(base.layers[0].self_attn)
        self._base = self._forward  # BatchedLM._run calls self._base(...) for the model's layers

    def _forward(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = True,
                 **cache_kw: Any) -> Any:
        """The decoder over the batch's packed new tokens; ``cache_kw`` holds the batch's
        :class:`engine.reference.batch._RowsCache` (as ``cache`` or ``past_key_values``)."""
        rows = next(iter(cache_kw.values()))
        if not isinstance(rows, _RowsCache):
            raise RuntimeError("BatchedMLA's forward runs only inside BatchedLM.prefill")
        lay = _BATCH.get()
        assert lay is not None
        lengths = [(b - a, n) for a, b, n in zip(lay.q_starts, lay.q_starts[1:], lay.k_lens, strict=False)]
        # The absorbed form has no variable-length kernel here (FlashMLA-style kernels are not
        # available): with varlen attention "auto" keeps the batch on FlashAttention-2.
        form = "naive" if lay.varlen and self.form == "auto" else choose_form(self.form, self._dims, lengths)
        self.forms_run[form] += 1
        dec = self._decoder
        h = dec.embed_tokens(input_ids)
        cos, sin = dec.rotary_emb(h, position_ids)
        h = h[0]
        for i, layer in enumerate(dec.layers):
            x = layer.input_layernorm(h)
            h = h + self._attention(layer.self_attn, x, cos, sin, rows, i, lay, form)
            h = h + layer.mlp(layer.post_attention_layernorm(h).unsqueeze(0))[0]
        return SimpleNamespace(last_hidden_state=dec.norm(h).unsqueeze(0))

    def _attention(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: _RowsCache,
                   layer: int, lay: _Layout, form: str) -> torch.Tensor:
        d = self._dims
        q_nope, q_pe, latent = project(attn, x, cos, sin)
        half = self.shape.head_dim
        k, v = cache.update(latent[:, :half].view(1, 1, -1, half), latent[:, half:].view(1, 1, -1, half), layer)
        rows = torch.cat([k[0, 0], v[0, 0]], dim=-1)  # [rows, latent + rope]: this layer's latents
        s = q_nope.shape[0]
        if lay.varlen and form == "naive":
            kk, vv = decompress(attn, rows, d, pad_v=True)
            q = torch.cat([q_nope, q_pe], dim=-1)
            out = torch.ops.aten._flash_attention_forward(
                q, kk, vv, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, 0.0, True, False,
                scale=attn.scaling, seqused_k=lay.used_k,
            )[0][..., : d.v]
        else:
            out = q_nope.new_empty((s, d.heads, d.v))
            fn = ATTEND[form]
            for i, k0 in enumerate(lay.k_starts):
                q0, q1 = lay.q_starts[i], lay.q_starts[i + 1]
                out[q0:q1] = fn(attn, q_nope[q0:q1], q_pe[q0:q1], rows[k0 : k0 + lay.k_lens[i]])
        return attn.o_proj(out.reshape(s, d.heads * d.v))
