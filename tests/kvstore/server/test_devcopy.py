"""PUT_DEVICE's copier (``kvstore.server.devcopy``) against a fake CUDA runtime: the calls it
queues for a reservation's slots, and that a copy that fails to queue still waits for the ones
queued before it (the caller then gives the slots back: no DMA may still be writing them)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest

from kvstore.server.devcopy import CudaRuntime, DeviceCopier

BB = 4096


class _Fn:
    """One fake runtime call: records its arguments, returns ``codes`` in turn (then 0)."""

    def __init__(self, name: str, calls: list[tuple[str, tuple[Any, ...]]], codes: list[int] | None = None) -> None:
        self.name, self.calls, self.codes = name, calls, list(codes or [])
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        self.calls.append((self.name, args))
        return self.codes.pop(0) if self.codes else 0


class _FakeLib:
    def __init__(self, copy_codes: list[int]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in ("cudaSetDevice", "cudaGetDeviceCount", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle",
                     "cudaHostRegister", "cudaHostUnregister", "cudaStreamCreateWithFlags",
                     "cudaStreamSynchronize", "cudaGetLastError"):
            setattr(self, name, _Fn(name, self.calls))
        self.cudaMemcpy2DAsync = _Fn("cudaMemcpy2DAsync", self.calls, copy_codes)


def _copier(lib: _FakeLib) -> tuple[DeviceCopier, OrderedDict[tuple[int, bytes], int]]:
    arena = memoryview(bytearray(64 * BB))
    c = DeviceCopier(arena)
    c._rt, c._loaded = CudaRuntime(lib), True  # type: ignore[arg-type]  # the fake stands for libcudart
    handle = bytes(64)
    return c, OrderedDict({(0, handle): 1 << 40})  # the handle as opened before


def _names(lib: _FakeLib) -> list[str]:
    return [n for n, _ in lib.calls if n in ("cudaMemcpy2DAsync", "cudaStreamSynchronize")]


def test_runs_of_equally_spaced_slots_go_as_one_queued_copy_each_then_one_wait() -> None:
    lib = _FakeLib([])
    c, session = _copier(lib)
    slots = [(0, BB), (BB, BB), (2 * BB, BB), (10 * BB, BB), (30 * BB, BB), (31 * BB, BB)]
    c.copy(session, 0, bytes(64), 0, 6 * BB, BB, slots, 0)
    assert _names(lib) == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaStreamSynchronize"]
    copies = [args for n, args in lib.calls if n == "cudaMemcpy2DAsync"]
    assert [a[5] for a in copies] == [3, 2, 1]  # rows: three adjacent, two 20 blocks apart, one alone
    assert [a[1] for a in copies] == [BB, 20 * BB, BB]  # the destination pitch


def test_a_copy_that_fails_to_queue_still_waits_for_the_queued_ones() -> None:
    lib = _FakeLib([0, 1])  # the second run's copy is refused
    c, session = _copier(lib)
    slots = [(0, BB), (BB, BB), (10 * BB, BB), (11 * BB, BB), (30 * BB, BB)]
    with pytest.raises(OSError, match="cudaMemcpy2DAsync"):
        c.copy(session, 0, bytes(64), 0, 5 * BB, BB, slots, 0)
    assert _names(lib) == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaStreamSynchronize"]
