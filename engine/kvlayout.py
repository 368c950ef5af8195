"""How an engine's KV maps onto store blocks.

A block's payload is layer-major: ``[layers][K, V][kv_heads][block_tokens][head_dim]`` in the
model's dtype. Layer-major lets a loader move the first layers of every block before the last
ones (layer-wise loading: layer i+1 loads while layer i computes), and one layer of one block is
one contiguous run of bytes.

The engine's side is the per-layer ``[batch=1, kv_heads, tokens, head_dim]`` tensors that
Hugging Face caches (and most engines' attention kernels) use. :func:`pack` and :func:`unpack`
convert between the two with a few tensor ops (no per-token or per-block Python). The batched
engine (``engine.reference.batch``) keeps token-major ``[tokens, kv_heads, head_dim]`` rows instead (the
layout of variable-length attention kernels): :func:`layer_rows` and :func:`pack_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstore.keys import KVLayout, LayerGroup, Namespace


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int
    mla: tuple[int, int] | None = None
    """``(latent_dim, rope_dim)`` for an MLA model (``engine.reference.mla``): one latent per token and
    layer, moved as two halves in the K and V places (``kv_heads`` 1, ``head_dim`` half the
    latent), so every byte-moving part of the engine serves it unchanged."""

    def __post_init__(self) -> None:
        if self.mla is not None and (self.kv_heads != 1 or 2 * self.head_dim != sum(self.mla)):
            raise ValueError(f"an MLA shape has kv_heads 1 and head_dim (latent + rope) / 2, not {self}")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block."""
        return 2 * self.kv_heads * self.block_tokens * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def namespace(self, model_id: str, revision: str = "main", **kw: Any) -> Namespace:
        group = (LayerGroup("mla", self.num_layers, latent_dim=self.mla[0], rope_dim=self.mla[1]) if self.mla
                 else LayerGroup("full", self.num_layers, self.kv_heads, self.head_dim))
        layout = KVLayout(self.dtype_name, self.block_tokens, (group,))
        return Namespace(model_id, layout, model_revision=revision, **kw)


def shape_of(config: Any, dtype: torch.dtype, block_tokens: int) -> KVShape:
    """The KV shape of a Hugging Face decoder config (full attention layers)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVShape(cfg.num_hidden_layers, kv_heads, head_dim, dtype, block_tokens)


def pack(keys: list[torch.Tensor], values: list[torch.Tensor], shape: KVShape, start: int, stop: int) -> torch.Tensor:
    """Blocks ``start..stop-1`` of per-layer ``[1, H, T, D]`` tensors as ``[n, block_bytes]`` uint8."""
    bt = shape.block_tokens
    n = stop - start
    t0, t1 = start * bt, stop * bt
    k = torch.stack([x[0, :, t0:t1] for x in keys])  # [L, H, n*bt, D]
    v = torch.stack([x[0, :, t0:t1] for x in values])
    kv = torch.stack([k, v], dim=1)  # [L, 2, H, n*bt, D]
    kv = kv.reshape(shape.num_layers, 2, shape.kv_heads, n, bt, shape.head_dim)
    blocks = kv.permute(3, 0, 1, 2, 4, 5).contiguous()  # [n, L, 2, H, bt, D]
    return blocks.view(n, -1).view(torch.uint8)


def unpack_layer(blocks: torch.Tensor, shape: KVShape, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer`` of ``[n, block_bytes]`` uint8 blocks as new ``[1, H, n*bt, D]`` K and V."""
    n = blocks.shape[0] * shape.block_tokens
    k = torch.empty((1, shape.kv_heads, n, shape.head_dim), dtype=shape.dtype, device=blocks.device)
    v = torch.empty_like(k)
    unpack_layer_into(blocks, shape, layer, k, v)
    return k, v


def unpack_layer_into(blocks: torch.Tensor, shape: KVShape, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write layer ``layer`` of the blocks into contiguous ``[1, H, n*bt, D]`` ``k`` and ``v``:
    one strided copy kernel each, reading the blocks where they are."""
    n = blocks.shape[0]
    lb = shape.layer_bytes
    part = blocks[:, layer * lb : (layer + 1) * lb].view(shape.dtype)
    part = part.view(n, 2, shape.kv_heads, shape.block_tokens, shape.head_dim)
    k.view(shape.kv_heads, n, shape.block_tokens, shape.head_dim).copy_(part[:, 0].permute(1, 0, 2, 3))
    v.view(shape.kv_heads, n, shape.block_tokens, shape.head_dim).copy_(part[:, 1].permute(1, 0, 2, 3))


def wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte elements along the last dim, where the layout allows (else
    ``t``). The index kernels (``index_copy_``, ``index_select``) and strided copies move one
    element per thread: on bf16 or uint8 elements they run several times slower than on int64."""
    size = t.element_size()
    if t.dtype == torch.int64 or t.stride(-1) != 1 or (t.shape[-1] * size) % 8 or (t.storage_offset() * size) % 8:
        return t
    if any((st * size) % 8 for st in t.stride()[:-1]):
        return t
    return t.view(torch.int64)


def layer_rows(blocks: torch.Tensor, shape: KVShape, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer`` of ``[n, >=(layer+1)*layer_bytes]`` uint8 rows (any row pitch) as token-major
    ``[n, block_tokens, kv_heads, head_dim]`` K and V views: no copy, ready to scatter into rows."""
    n, lb = blocks.shape[0], shape.layer_bytes
    part = blocks[:, layer * lb : (layer + 1) * lb].view(shape.dtype)
    part = part.view(n, 2, shape.kv_heads, shape.block_tokens, shape.head_dim)
    return part[:, 0].transpose(1, 2), part[:, 1].transpose(1, 2)


def block_rows(rows: torch.Tensor, shape: KVShape) -> torch.Tensor:
    """Token-major ``[rows, H, D]`` K or V (rows a multiple of ``block_tokens``) as one row per
    block, ``[rows / block_tokens, width]``, in the units of :func:`wide` over bytes: the form the
    HBM pages' parts have (:meth:`engine.reference.hbm_cache.HbmCache.part`)."""
    return wide(rows.view(torch.uint8).view(rows.shape[0] // shape.block_tokens, -1))


def pack_rows(keys: list[torch.Tensor], values: list[torch.Tensor], shape: KVShape, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of per-layer token-major ``[rows, H, D]`` K/V as ``[m, block_bytes]`` uint8 payloads.

    ``blocks`` (int64, on the rows' device) numbers row blocks of ``block_tokens`` rows: block b
    is rows ``b*bt .. (b+1)*bt-1``. Two copies per layer and K/V, whatever the number of blocks."""
    m, bt = int(blocks.numel()), shape.block_tokens
    out = torch.empty((m, shape.num_layers, 2, shape.kv_heads, bt, shape.head_dim), dtype=shape.dtype, device=blocks.device)
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        for j, x in enumerate((k, v)):
            src = wide(x.view(-1, bt, shape.kv_heads, shape.head_dim)).index_select(0, blocks)
            wide(out[:, layer, j]).copy_(src.transpose(1, 2))
    return out.view(m, -1).view(torch.uint8)
