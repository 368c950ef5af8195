"""vLLM's paged KV as kvstore blocks.

vLLM hands a connector one tensor per attention layer, a logical ``[B, H, N, C]`` view (B pages,
H KV heads of this rank, N = block_size tokens, C = the content of one token and head: K then V)
whose memory order is the engine's resolved ``KVCacheLayout`` (``LBHNC`` on CPU). A kvstore
block is one vLLM page of every layer, layer-major: ``[layer][H][N][C]`` in logical order, so a
block is the same bytes whatever the memory order, and one layer of one block is one contiguous
run (the loader writes layer i before layer i+1 is needed).

The namespace records the page: dtype, block size, layers, KV heads, head size (its
``KVLayout``) and, in ``model_revision``, the block format (``PAGE_FORMAT``: the per-layer order
above). An engine with another page gets a different namespace and never reads these blocks; as
it is the same model deployment (model, revision, rank, LoRA) with another layout, the daemon
reports the registration as a layout conflict (a warning in both logs, ``kvctl namespaces``),
so a changed ``--block-size`` or ``--dtype`` is loud, not a silent zero hit rate. vLLM's memory
order (``KVCacheLayout``) is not part of the key: a block holds the same bytes whatever it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.gpu import arena_layer_rows
from kvstore.errors import UsageError
from kvstore.keys import KVLayout, LayerGroup, Namespace

GATHER_STAGE_BYTES = 128 << 20
"""The device staging a gather into host memory uses at most (what a layer's ``index_select`` of
2,048 blocks of Llama-8B takes anyway)."""

PAGE_FORMAT = "vllm-HNC1"
"""Version of the block format above; part of every namespace (a change is a new namespace)."""


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass(frozen=True, slots=True)
class PageSpec:
    """What one vLLM page holds, per rank."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    layout: str
    """vLLM's resolved KV cache layout name (``LBHNC``...)."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def content(self) -> int:
        """C: elements per token and head (K then V)."""
        return 2 * self.head_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer of one block."""
        return self.num_kv_heads * self.block_size * self.content * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    def namespace(self, model_id: str, revision: str, rank: int, world_size: int, lora_id: str = "") -> Namespace:
        layout = KVLayout(
            str(self.dtype).removeprefix("torch."),
            self.block_size,
            (LayerGroup("full", self.num_layers, self.num_kv_heads, self.head_size),),
        )
        ns = Namespace(model_id, layout, model_revision=f"{revision}+{self.tag()}", rank=rank,
                       world_size=world_size, lora_id=lora_id)
        if ns.block_bytes != self.block_bytes:  # a bug: the two descriptions disagree
            raise AssertionError(f"namespace blocks are {ns.block_bytes} bytes, vLLM pages {self.block_bytes}")
        return ns

    def tag(self) -> str:
        """The block format in the revision string: a new format is a new deployment; a new
        block size, dtype or head count is a layout conflict within this one (reported)."""
        return PAGE_FORMAT

    def describe(self) -> str:
        return (
            f"block_size={self.block_size} dtype={str(self.dtype).removeprefix('torch.')} "
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_size={self.head_size} "
            f"layout={self.layout}"
        )


def page_spec(kv_cache_config: Any, cache_layout: str | None) -> PageSpec:
    """The page of a vLLM ``KVCacheConfig`` (one group of full-attention layers with dense K/V);
    anything else is a :class:`UsageError` saying what kvstore's connector supports."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise UsageError(
            f"kvstore's vLLM connector supports models with one KV cache group; this one has {len(groups)} "
            "(a hybrid or multi-spec model)"
        )
    spec = groups[0].kv_cache_spec
    missing = [a for a in ("num_kv_heads", "head_size", "dtype", "block_size") if not hasattr(spec, a)]
    if missing:
        raise UsageError(f"kvstore's vLLM connector needs an attention KV cache; got {type(spec).__name__}")
    dense = (
        getattr(spec, "head_size_v", spec.head_size) == spec.head_size
        and getattr(spec, "page_size_padded", None) is None
        and getattr(spec, "num_head_slots", None) is None
        and getattr(spec, "state_content_bytes", None) is None
        and getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE") == "NONE"
        and "MLA" not in type(spec).__name__
    )
    if not dense:
        raise UsageError(
            f"kvstore's vLLM connector stores dense K/V pages; this model's cache is {spec!r} "
            "(MLA, quantised or padded pages are not supported yet)"
        )
    names = tuple(sorted(groups[0].layer_names, key=_natural_key))
    return PageSpec(names, int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size), spec.dtype,
                    cache_layout or "LBHNC")


class PagedKV:
    """Moves blocks between vLLM's per-layer page tensors and kvstore block buffers."""

    def __init__(self, spec: PageSpec, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in spec.layer_names if n not in kv_caches]
        if missing:
            raise UsageError(f"vLLM registered no KV cache for layer(s) {', '.join(missing[:4])}")
        self.spec = spec
        self.layers = [kv_caches[n] for n in spec.layer_names]
        self.index = {n: i for i, n in enumerate(spec.layer_names)}
        want = (spec.num_kv_heads, spec.block_size, spec.content)
        for name, t in zip(spec.layer_names, self.layers, strict=True):
            if t.dim() != 4 or tuple(t.shape[1:]) != want or t.dtype != spec.dtype:
                raise UsageError(
                    f"layer {name}: vLLM's KV view is {tuple(t.shape)} {t.dtype}; kvstore expects "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {spec.dtype} (an attention backend "
                    "with another page format is not supported yet)"
                )
        self.device = self.layers[0].device
        self._page = (spec.num_kv_heads, spec.block_size, spec.content)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy pages ``block_ids`` of every layer into ``out`` (``[n, block_bytes]`` uint8), on
        the current stream. An ``out`` off the pages' device (a pinned host buffer) is filled
        from a device staging buffer of at most ``GATHER_STAGE_BYTES``, one contiguous copy per
        piece: a strided device-to-host copy per layer ran at 0.6-1.2 GB/s on the H200."""
        if out.device == self.device:
            self._gather(self._ids(block_ids), out)
        else:
            self._gather_staged(block_ids, lambda a, b, staged: out[a:b].copy_(staged, non_blocking=True))

    def gather_to_slots(self, block_ids: Sequence[int], slots: Any) -> None:
        """Copy pages ``block_ids`` of every layer into the arena slots of a store reservation
        (``engine.gpu.ArenaSlots``, slot ``i`` for block ``block_ids[i]``), on the current
        stream: gathered into device staging as :meth:`gather` does, each piece copied to the
        host by one DMA per run of slots, straight into the memory the store keeps the blocks
        in (no pinned buffer, no host copy). Commit the slots once the stream has synchronized."""
        self._gather_staged(block_ids, lambda a, b, staged: slots.copy_from(staged, first=a))

    def _gather_staged(self, block_ids: Sequence[int], out: Callable[[int, int, torch.Tensor], Any]) -> None:
        """Gather blocks ``a:b`` of ``block_ids`` into a device staging buffer, piece by piece,
        and hand each piece to ``out(a, b, staged)`` to copy off the device."""
        n, bb = len(block_ids), self.spec.block_bytes
        step = max(1, min(n, GATHER_STAGE_BYTES // bb))
        staged = torch.empty((step, bb), dtype=torch.uint8, device=self.device)
        for a in range(0, n, step):  # one stream: a piece's gather waits for the last one's copy out
            b = min(a + step, n)
            self._gather(self._ids(block_ids[a:b]), staged[: b - a])
            out(a, b, staged[: b - a])

    def _gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        n, pb = ids.numel(), self.spec.page_bytes
        dst = out.view(n, self.num_layers, pb)
        for i, t in enumerate(self.layers):
            dst[:, i].view(self.spec.dtype).view(n, *self._page).copy_(t.index_select(0, ids))

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write layer ``layer`` of ``n`` blocks: ``src`` is ``[n, page_bytes]`` uint8 (any row
        stride, e.g. a view of the daemon's arena or of a host buffer of whole blocks)."""
        n = src.shape[0]
        pages = src.view(self.spec.dtype).view(n, *self._page)
        if pages.device != self.device:
            pages = pages.to(self.device, non_blocking=True)
        self.layers[layer].index_copy_(0, block_ids, pages)

    def block_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self._ids(block_ids)


layer_rows = arena_layer_rows
"""Layer ``layer`` of blocks at byte ``offsets`` of a 1-D uint8 buffer as ``[n, page_bytes]``
(:func:`engine.gpu.arena_layer_rows`)."""
