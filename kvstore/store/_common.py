"""Small helpers of the store's parts: the scratch buffer for tier-to-tier copies and the atomic
file write (``namespaces.json``, ``pins.json``)."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from kvstore.errors import TierIOError


class Scratch:
    """A page-aligned, reusable buffer for tier-to-tier copies (O_DIRECT wants alignment)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(-1, max(size, 1 << 20))
        return memoryview(self._map)[:size]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TierIOError(f"cannot write {path}: {e.strerror}; check the store directory") from e
