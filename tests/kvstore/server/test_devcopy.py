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
                     "cudaStreamSynchronize", "cudaGetLastError", "cudaIpcOpenEventHandle", "cudaStreamWaitEvent",
                     "cudaEventDestroy"):
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


def test_a_copy_after_an_event_waits_for_it_on_the_device_and_opens_it_once() -> None:
    """PUT_DEVICE with DEVICE_AFTER_EVENT: the engine's gather may still run when the request
    comes; the copies wait for its event on the daemon's stream (no host wait), the event is
    opened once per session and destroyed with it (memory handles are closed)."""
    lib = _FakeLib([])
    c, session = _copier(lib)
    event = bytes(range(64))
    for _ in range(2):
        c.copy(session, 0, bytes(64), 0, 2 * BB, BB, [(0, BB), (BB, BB)], 0, after=event)
    names = [n for n, _ in lib.calls if n in ("cudaIpcOpenEventHandle", "cudaStreamWaitEvent", "cudaMemcpy2DAsync")]
    assert names == ["cudaIpcOpenEventHandle", "cudaStreamWaitEvent", "cudaMemcpy2DAsync",
                     "cudaStreamWaitEvent", "cudaMemcpy2DAsync"]
    c.close_session(session)
    closed = [n for n, _ in lib.calls if n in ("cudaEventDestroy", "cudaIpcCloseMemHandle")]
    assert sorted(closed) == ["cudaEventDestroy", "cudaIpcCloseMemHandle"] and not session


def test_put_device_metadata_carries_an_event_handle_only_with_its_flag() -> None:
    from kvstore.wire import protocol as P

    ns_id, hashes = bytes(P.NS_ID_BYTES), [bytes([i]) * P.HASH_BYTES for i in range(3)]
    plain = P.parse_put_device(P.encode_put_device(ns_id, hashes, 1, 0, bytes(64), 8, 3 * BB), 16)
    assert plain.event is None and plain.hashes == hashes and plain.start == 1
    meta = P.encode_put_device(ns_id, hashes, 1, 0, bytes(64), 8, 3 * BB, event=b"e" * 64)
    req = P.parse_put_device(meta, 16)
    assert req.event == b"e" * 64 and req.hashes == hashes and (req.offset, req.size) == (8, 3 * BB)
    with pytest.raises(P.ProtocolError, match="hashes"):
        P.parse_put_device(meta[:-1], 16)
    with pytest.raises(ValueError, match="event handle"):
        P.encode_put_device(ns_id, hashes, 0, 0, bytes(64), 0, BB, event=b"short")


def test_what_the_commit_needs_is_built_while_the_copies_run() -> None:
    """``meanwhile`` (the reservation's prepare: its blocks' records) runs once every DMA is
    queued and before the wait, so the commit under the store's lock is short."""
    lib = _FakeLib([])
    c, session = _copier(lib)
    c.copy(session, 0, bytes(64), 0, 3 * BB, BB, [(0, BB), (BB, BB), (5 * BB, BB)], 0,
           meanwhile=lambda: lib.calls.append(("prepare", ())))
    names = [n for n, _ in lib.calls if n in ("cudaMemcpy2DAsync", "prepare", "cudaStreamSynchronize")]
    assert names == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "prepare", "cudaStreamSynchronize"]


def test_known_says_nothing_until_the_runtime_was_looked_for_then_what_available_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop asks ``known()`` (no lock, no loading); ``None`` sends it to the pool once."""
    import kvstore.server.devcopy as devcopy

    c = DeviceCopier(memoryview(bytearray(4 * BB)))
    assert c.known() is None
    monkeypatch.setattr(devcopy, "load_runtime", lambda: (None, "no CUDA device is visible to the daemon"))
    assert c.available() is False
    assert c.known() is False and "no CUDA device" in c.why
    readonly = DeviceCopier(memoryview(bytes(4 * BB)))
    assert readonly.available() is False and readonly.known() is False
    assert "not writable" in readonly.why
    c2, _ = _copier(_FakeLib([]))
    assert c2.known() is True
