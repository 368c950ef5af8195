"""Every layer's pages in one kernel launch: gather vLLM's pages of some blocks into whole-block
rows (a save's staging), or scatter rows into the pages (a restore's tile), on a GPU.

vLLM gives each attention layer its own page tensor. Copying a block set layer by layer costs
one or two kernel launches a layer: for a 32-layer model ~1 ms of the host's time per gather
(on vLLM's step, for a save) and per tile (on the loader thread, for a restore), and each small
kernel leaves the GPU's copy bandwidth half used. :class:`PageCopier` launches one Triton kernel
over (block, layer) pairs instead, reading each layer's base address from a small device table.

A page is ``[H, N, C]`` elements (heads, tokens, content), possibly strided (vLLM's NHD memory
seen as ``[blocks, H, N, C]``), with ``C`` contiguous; a block row holds each layer's page
contiguous and in layer order, the stored block format (``engine.vllm.pages``). Every layer must
share one dtype and one set of strides; where that does not hold, where Triton is not installed
(vLLM's CUDA builds bring it) or its kernel fails to build, :func:`page_copier` returns None and
the caller copies layer by layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger("kvstore.engine")

BLOCK_WORDS = 1024
"""Words a kernel program copies per step of its loop over one page."""

_KERNELS: dict[bool, Any] = {}
"""The Triton kernel, built once per mode (compiled, or the interpreter's for CPU tests)."""


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel() -> Any:
    """The copy kernel (ImportError without Triton)."""
    mode = _interpret()
    k = _KERNELS.get(mode)
    if k is not None:
        return k
    import triton
    import triton.language as tl

    def copy_pages(ptrs: Any, ids: Any, rows: Any, row_stride: Any, layer0: Any, s0: Any, s1: Any, s2: Any,
                   H: tl.constexpr, N: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
                   TO_ROWS: tl.constexpr) -> None:
        i = tl.program_id(0)  # the block
        layer = tl.program_id(1)
        page = tl.load(ids + i)
        base = tl.load(ptrs + layer0 + layer).to(tl.pointer_type(rows.dtype.element_ty))
        start = base + page * s0
        row = rows + i.to(tl.int64) * row_stride + layer.to(tl.int64) * (H * N * W)
        for lo in range(0, H * N * W, BLOCK):
            r = lo + tl.arange(0, BLOCK)
            mask = r < H * N * W
            src = start + (r // (N * W)) * s1 + ((r // W) % N) * s2 + r % W
            if TO_ROWS:
                tl.store(row + r, tl.load(src, mask=mask), mask=mask)
            else:
                tl.store(src, tl.load(row + r, mask=mask), mask=mask)

    # One build for any block table, tile and row stride: a value Triton specializes on (1, or a
    # multiple of 16) would otherwise build a variant in the middle of a load.
    k = _KERNELS[mode] = triton.jit(copy_pages, do_not_specialize=["ids", "row_stride", "layer0", "s0", "s1", "s2"])
    return k


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


class PageCopier:
    """One-launch gathers and scatters over ``layers`` (each ``[blocks, H, N, C]``, one dtype
    and one set of strides, ``C`` contiguous). Use :func:`page_copier`, which checks that and
    builds the kernel."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        t0 = layers[0]
        self.device = t0.device
        es = t0.element_size()
        h, n, c = (int(x) for x in t0.shape[1:])
        strides = [s * es for s in t0.stride()]  # bytes
        page_bytes = h * n * c * es
        # the widest word every page, row and address is a multiple of
        self.word = next(w for w in _WORDS if all(
            v % w.itemsize == 0 for v in (*strides[:3], c * es, page_bytes, *(t.data_ptr() for t in layers))))
        wb = self.word.itemsize
        self.shape = (h, n, c * es // wb)
        self.strides = tuple(s // wb for s in strides[:3])
        self.page_bytes = page_bytes
        self.num_layers = len(layers)
        self._kernel = _kernel()  # (ImportError without Triton)
        self._ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64, device=self.device)

    def _launch(self, ids: torch.Tensor, rows: torch.Tensor, lo: int, hi: int, to_rows: bool) -> None:
        n = int(ids.shape[0])
        if n == 0 or hi <= lo:
            return
        width = (hi - lo) * self.page_bytes
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[0] != n or rows.shape[1] != width \
                or rows.stride(1) != 1 or rows.device != self.device:
            raise ValueError(f"rows must be [{n}, {width}] uint8 on {self.device} with contiguous rows, got "
                             f"{tuple(rows.shape)} {rows.dtype} stride {rows.stride()} on {rows.device}")
        wb = self.word.itemsize
        if rows.stride(0) % wb or rows.data_ptr() % wb:
            raise ValueError(f"rows must be aligned to {wb} bytes")
        words = rows.view(self.word)
        h, nt, w = self.shape
        s0, s1, s2 = self.strides
        # Triton launches on the current device's current stream: a loader or saver thread's
        # current device is GPU 0 unless set, and a tensor-parallel rank's pages are elsewhere.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._kernel[(n, hi - lo)](self._ptrs, ids, words, words.stride(0), lo, s0, s1, s2,
                                    H=h, N=nt, W=w, BLOCK=BLOCK_WORDS, TO_ROWS=to_rows)

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Pages ``ids`` (a ``long`` tensor on the device) of every layer into ``out``
        (``[n, num_layers * page_bytes]`` uint8, contiguous rows), on the current stream."""
        self._launch(ids, out, 0, self.num_layers, True)

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor, lo: int, hi: int) -> None:
        """Layers ``lo..hi-1`` of ``rows`` (``[n, (hi - lo) * page_bytes]`` uint8, contiguous rows,
        any row stride) into pages ``ids`` of those layers, on the current stream."""
        self._launch(ids, rows, lo, hi, False)


def _rows_of(layers: Sequence[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Pages ``ids`` of every layer as block rows, by torch ops layer by layer (the reference)."""
    n = int(ids.shape[0])
    return torch.cat([t.index_select(0, ids).contiguous().view(torch.uint8).reshape(n, -1) for t in layers], dim=1)


def _write_rows(layers: Sequence[torch.Tensor], ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Block rows into pages ``ids`` of every layer, by torch ops layer by layer."""
    n, t0 = int(ids.shape[0]), layers[0]
    page = rows.view(n, len(layers), -1)
    for i, t in enumerate(layers):
        t.index_copy_(0, ids, page[:, i].contiguous().view(t0.dtype).view(n, *t0.shape[1:]))


def _self_check(copier: PageCopier, layers: Sequence[torch.Tensor]) -> str | None:
    """Page 0 of every layer through the kernel against torch's bytes: gathered; a pattern
    scattered and read back; its own bytes scattered back (the pages end as they began, also
    when a check fails). None when all agree, else what differed."""
    ids = torch.zeros(1, dtype=torch.long, device=copier.device)
    want = _rows_of(layers, ids)
    row = torch.empty_like(want)
    copier.gather(ids, row)
    why = None if torch.equal(row, want) else "gather"
    pattern = want ^ 0x5A
    copier.scatter(ids, pattern, 0, copier.num_layers)
    if why is None and not torch.equal(_rows_of(layers, ids), pattern):
        why = "scatter"
    copier.scatter(ids, want, 0, copier.num_layers)
    if why is None and not torch.equal(_rows_of(layers, ids), want):
        why = "scatter back"
    if why is not None:
        _write_rows(layers, ids, want)
    return why


def page_copier(layers: Sequence[torch.Tensor]) -> PageCopier | None:
    """A :class:`PageCopier` over ``layers`` where one kernel can copy them (a GPU with Triton,
    or Triton's interpreter: ``TRITON_INTERPRET=1``; one dtype, shape and set of strides, the
    content contiguous), built and checked once against torch's bytes on page 0 of every layer
    (:func:`_self_check`: its bytes are back as they were when this returns; call it before the
    pages are in use); else None, and the caller copies layer by layer."""
    if not layers or any(t.dim() != 4 for t in layers):
        return None
    t0 = layers[0]
    if t0.device.type != "cuda" and not _interpret():
        return None
    if any(t.device != t0.device or t.dtype != t0.dtype or t.shape != t0.shape or t.stride() != t0.stride()
           for t in layers) or t0.stride(3) != 1 or t0.shape[0] == 0:
        return None
    try:
        copier = PageCopier(layers)
    except ImportError:
        return None
    try:
        why = _self_check(copier, layers)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build here: the per-layer path
        log.warning("kvstore: the one-launch page copy is unavailable (%s: %s); copying layer by layer",
                    type(e).__name__, e)
        return None
    if why is not None:  # never wrong bytes: a kernel that misbehaves here is not used
        log.warning("kvstore: the one-launch page copy's %s differed from torch's bytes on this GPU; "
                    "copying layer by layer", why)
        return None
    return copier
