"""Caller-owned buffers as flat byte views, without copying.

A leaf module (it imports only :mod:`kvstore.errors`): tiers, the store and the daemon client
all turn what a caller passes (bytes, bytearray, memoryview, numpy arrays, CPU tensors) into
``memoryview`` slices here, so every I/O lands in memory the caller owns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.errors import BufferSizeError, UsageError

Buffer = memoryview | bytes | bytearray


def byte_view(buf: Buffer, *, writable: bool = False) -> memoryview:
    """``buf`` as a flat, C-contiguous unsigned-byte view, without copying.

    Accepts numpy/torch-backed views of any item format and shape. UsageError for a strided
    view or, with ``writable``, a read-only buffer.
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        raise UsageError("the buffer must be C-contiguous; pass a contiguous copy or view")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise UsageError("the destination buffer is read-only; pass a writable buffer")
    return mv


def as_view(buf: Any, writable: bool) -> memoryview:
    """Any buffer a caller may pass (a contiguous CPU tensor included) as a flat byte view."""
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise UsageError("torch buffers must be contiguous CPU tensors")
        buf = buf.view(-1).view(__import__("torch").uint8).numpy()
    try:
        return byte_view(buf, writable=writable)
    except TypeError:
        raise UsageError(
            f"expected a buffer (bytes, bytearray, numpy array, tensor), got {type(buf).__name__}"
        ) from None


def _split(buf: Any, bb: int, writable: bool, count: int | None) -> list[memoryview]:
    mv = as_view(buf, writable)
    if count is None:
        if len(mv) % bb:
            raise BufferSizeError(
                f"buffer of {len(mv)} bytes is not a whole number of {bb}-byte blocks"
            )
        count = len(mv) // bb
    elif len(mv) != count * bb:
        raise BufferSizeError(f"expected {count} blocks of {bb} bytes ({count * bb} bytes), got {len(mv)}")
    return [mv[i * bb : (i + 1) * bb] for i in range(count)]


def dst_views(dst: Any, bb: int) -> list[memoryview]:
    """Writable views of ``bb``-byte blocks: one per buffer of a list (each at least ``bb``
    bytes), or ``dst`` cut into whole blocks."""
    if isinstance(dst, list | tuple):
        views = [as_view(d, True) for d in dst]
        for i, v in enumerate(views):
            if len(v) < bb:
                raise BufferSizeError(f"destination buffer {i} has {len(v)} bytes; a block needs {bb}")
        return views
    return _split(dst, bb, True, None)


def src_views(blocks: Any, bb: int, count: int) -> list[memoryview]:
    """Read-only views of ``count`` payloads of exactly ``bb`` bytes: one per buffer of a list,
    or ``blocks`` cut into ``count`` blocks."""
    if isinstance(blocks, list | tuple):
        if len(blocks) != count:
            raise UsageError(f"expected {count} block payloads, got {len(blocks)}")
        views = [as_view(b, False) for b in blocks]
        for i, v in enumerate(views):
            if len(v) != bb:
                raise BufferSizeError(f"payload {i} has {len(v)} bytes; a block of this namespace has {bb}")
        return views
    return _split(blocks, bb, False, count)


def address(mv: memoryview) -> int:
    """The memory address of ``mv``'s first byte (read-only views too)."""
    return int(np.frombuffer(mv, np.uint8).__array_interface__["data"][0])



def span(first: memoryview, nbytes: int, *, writable: bool = True) -> memoryview | None:
    """A view of ``nbytes`` from ``first``'s first byte on, of the exporter ``first`` was cut
    from (so that views lying back to back in it move in one copy: a copy of many MiB runs with
    the non-temporal stores that one of 2 MiB does not get); None when that memory is not one
    flat buffer of that size (writable, with ``writable``)."""
    try:
        whole = byte_view(first.obj, writable=writable)
    except (UsageError, TypeError, ValueError):
        return None
    at = address(first) - address(whole)
    if at < 0 or at + nbytes > whole.nbytes:
        return None
    return whole[at : at + nbytes]
