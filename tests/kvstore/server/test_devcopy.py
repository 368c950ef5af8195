"""PUT_DEVICE's copier (``kvstore.server.devcopy``) against a fake CUDA runtime: the calls it
queues for a reservation's slots, that a copy that fails to queue still waits for the ones
queued before it (the caller then gives the slots back: no DMA may still be writing them), and
the wait's deadline: copies behind a client's CUDA event that never completes fail the request,
their slots set aside until the event completes (on a fake clock here, and through a daemon)."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client, connect
from kvstore.clock import FakeClock
from kvstore.errors import UsageError
from kvstore.server.config import Limits, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.devcopy import POLL_MAX_S, CopyTimeout, CudaRuntime, DeviceCopier
from tests.conftest import SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.conftest import TOKEN_A, TOKEN_B, TOKEN_OPS
from tests.kvstore.server.test_metrics import _scrape

BB = SMALL_NS.block_bytes
NOT_READY = 600


class _Fn:
    """One fake runtime call: records its arguments, returns what ``impl`` returns (or ``codes``
    in turn, then 0)."""

    def __init__(self, name: str, calls: list[tuple[str, tuple[Any, ...]]], codes: list[int] | None = None,
                 impl: Any = None) -> None:
        self.name, self.calls, self.codes, self.impl = name, calls, list(codes or []), impl
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        self.calls.append((self.name, args))
        if self.codes:
            return self.codes.pop(0)
        return int(self.impl(*args)) if self.impl is not None else 0


class _FakeLib:
    """libcudart as PUT_DEVICE calls it. Streams run their work in order: a copy queued after an
    event that has not completed (:meth:`hang`) waits until :meth:`complete`; a stream with work
    waiting answers ``cudaStreamQuery`` with cudaErrorNotReady. Copies move bytes between host
    addresses (what :meth:`export` hands out stands for device memory) when ``real``."""

    def __init__(self, copy_codes: list[int] | None = None, real: bool = False, dma_ms: float | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.real = real
        self._lock = threading.RLock()
        self._queues: dict[int, deque[tuple[str, Any]]] = {}
        self._events: dict[int, bytes] = {}
        self._memory: dict[bytes, int] = {}
        self._hung: set[bytes] = set()
        self._next = 0x1000
        for name in ("cudaSetDevice", "cudaGetDeviceCount", "cudaIpcCloseMemHandle", "cudaHostRegister",
                     "cudaHostUnregister", "cudaGetLastError", "cudaEventDestroy", "cudaStreamDestroy"):
            setattr(self, name, _Fn(name, self.calls))
        self.cudaIpcOpenMemHandle = _Fn("cudaIpcOpenMemHandle", self.calls, impl=self._open_mem)
        self.cudaIpcOpenEventHandle = _Fn("cudaIpcOpenEventHandle", self.calls, impl=self._open_event)
        self.cudaStreamCreateWithFlags = _Fn("cudaStreamCreateWithFlags", self.calls, impl=self._create)
        self.cudaStreamWaitEvent = _Fn("cudaStreamWaitEvent", self.calls,
                                       impl=lambda s, ev, _f: self._queue(s, ("wait", self._events[ev])))
        self.cudaMemcpy2DAsync = _Fn("cudaMemcpy2DAsync", self.calls, copy_codes,
                                     impl=lambda *a: self._queue(a[7], ("copy", a[:6])))
        self.cudaStreamQuery = _Fn("cudaStreamQuery", self.calls,
                                   impl=lambda s: NOT_READY if self._queues.get(s) else 0)
        if dma_ms is not None:  # a runtime that times events: each elapsed time is dma_ms
            self.cudaEventCreate = _Fn("cudaEventCreate", self.calls, impl=lambda out: self._create(out, 0))
            self.cudaEventRecord = _Fn("cudaEventRecord", self.calls)
            self.cudaEventElapsedTime = _Fn("cudaEventElapsedTime", self.calls,
                                            impl=lambda out, _a, _b: setattr(out._obj, "value", dma_ms) or 0)

    def export(self, handle: bytes, buf: bytearray) -> None:
        """``handle`` names ``buf`` (the client's "device" buffer)."""
        self._memory[handle] = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))

    def hang(self, event: bytes) -> None:
        self._hung.add(event)

    def complete(self, event: bytes) -> None:
        with self._lock:
            self._hung.discard(event)
            for s in self._queues:
                self._run(s)

    def _open_mem(self, out: Any, handle: Any, _flags: int) -> int:
        out._obj.value = self._memory.get(bytes(handle), 1 << 40)
        return 0

    def _open_event(self, out: Any, handle: Any) -> int:
        with self._lock:
            self._next += 1
            self._events[self._next] = bytes(handle)
            out._obj.value = self._next
        return 0

    def _create(self, out: Any, _flags: int) -> int:
        with self._lock:
            self._next += 1
            self._queues[self._next] = deque()
            out._obj.value = self._next
        return 0

    def _queue(self, stream: int, op: tuple[str, Any]) -> int:
        with self._lock:
            self._queues[stream].append(op)
            self._run(stream)
        return 0

    def _run(self, stream: int) -> None:
        q = self._queues[stream]
        while q and not (q[0][0] == "wait" and q[0][1] in self._hung):
            kind, args = q.popleft()
            if kind == "copy" and self.real:
                dst, dpitch, src, spitch, width, rows = args
                for r in range(rows):
                    ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def named(self, *names: str) -> list[str]:
        return [n for n, _ in self.calls if n in names]


def _copier(lib: _FakeLib, clock: FakeClock | None = None,
            timeout_s: float = 5.0) -> tuple[DeviceCopier, OrderedDict[tuple[int, bytes], int]]:
    arena = memoryview(bytearray(64 * BB))
    clock = clock or FakeClock(0.0)
    c = DeviceCopier(arena, timeout_s, clock=clock, sleep=clock.advance)
    c._rt, c._loaded = CudaRuntime(lib), True  # type: ignore[arg-type]  # the fake stands for libcudart
    handle = bytes(64)
    return c, OrderedDict({(0, handle): 1 << 40})  # the handle as opened before


def _names(lib: _FakeLib) -> list[str]:
    return lib.named("cudaMemcpy2DAsync", "cudaStreamQuery")


def test_runs_of_equally_spaced_slots_go_as_one_queued_copy_each_then_one_wait() -> None:
    lib = _FakeLib([])
    c, session = _copier(lib)
    slots = [(0, BB), (BB, BB), (2 * BB, BB), (10 * BB, BB), (30 * BB, BB), (31 * BB, BB)]
    c.copy(session, 0, bytes(64), 0, 6 * BB, BB, slots, 0)
    assert _names(lib) == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaStreamQuery"]
    copies = [args for n, args in lib.calls if n == "cudaMemcpy2DAsync"]
    assert [a[5] for a in copies] == [3, 2, 1]  # rows: three adjacent, two 20 blocks apart, one alone
    assert [a[1] for a in copies] == [BB, 20 * BB, BB]  # the destination pitch


def test_the_dmas_device_time_is_taken_between_events_around_them_where_the_runtime_times() -> None:
    lib = _FakeLib(dma_ms=2.5)
    copier, session = _copier(lib)
    copier.copy(session, 0, bytes(64), 0, 4 * BB, BB, [(0, BB), (BB, BB), (2 * BB, BB)], 0, after=bytes(range(64)))
    order = lib.named("cudaStreamWaitEvent", "cudaEventRecord", "cudaMemcpy2DAsync", "cudaStreamQuery",
                      "cudaEventElapsedTime")
    # after the client's event, around the copies; read once they have landed
    assert order == ["cudaStreamWaitEvent", "cudaEventRecord", "cudaMemcpy2DAsync", "cudaEventRecord",
                     "cudaStreamQuery", "cudaEventElapsedTime"]
    assert copier.last_dma_s == pytest.approx(2.5e-3)
    copier.copy(session, 0, bytes(64), 0, 4 * BB, BB, [(0, BB)], 0)
    assert lib.named("cudaEventCreate") == ["cudaEventCreate"] * 2  # one pair per thread and device

    plain = _FakeLib()
    copier, session = _copier(plain)
    copier.copy(session, 0, bytes(64), 0, 4 * BB, BB, [(0, BB)], 0)
    assert copier.last_dma_s is None


def test_a_copy_that_fails_to_queue_still_waits_for_the_queued_ones() -> None:
    lib = _FakeLib([0, 1])  # the second run's copy is refused
    c, session = _copier(lib)
    slots = [(0, BB), (BB, BB), (10 * BB, BB), (11 * BB, BB), (30 * BB, BB)]
    with pytest.raises(OSError, match="cudaMemcpy2DAsync"):
        c.copy(session, 0, bytes(64), 0, 5 * BB, BB, slots, 0)
    assert _names(lib) == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "cudaStreamQuery"]


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
    names = lib.named("cudaMemcpy2DAsync", "prepare", "cudaStreamQuery")
    assert names == ["cudaMemcpy2DAsync", "cudaMemcpy2DAsync", "prepare", "cudaStreamQuery"]


def test_copies_past_the_deadline_are_set_aside_until_the_event_completes() -> None:
    """A client's event that does not complete: the wait polls with a bounded back-off until the
    deadline (a fake clock), then frees the thread with CopyTimeout; the reservation's slots are
    taken aside (``quarantine``) and given back only once the stream's work is done, the client's
    mappings stay open until then, and the thread's next copy does not queue behind the stuck one."""
    lib = _FakeLib()
    clock = FakeClock(0.0)
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.advance(s)

    c, session = _copier(lib, clock, timeout_s=2.0)
    c._sleep = sleep  # (the copier's injected sleep, recorded)
    event = bytes(range(64))
    lib.hang(event)
    taken: list[str] = []
    released: list[str] = []

    def quarantine() -> Any:
        taken.append("a")
        return lambda: released.append("a")

    slots = [(0, BB), (BB, BB), (5 * BB, BB)]
    with pytest.raises(CopyTimeout, match=r"waited 2 s \(\[server\] put_device_timeout\) for the client's CUDA event"):
        c.copy(session, 0, bytes(64), 0, 3 * BB, BB, slots, 0, after=event, quarantine=quarantine, owner="a")
    assert clock() == pytest.approx(2.0) and max(sleeps) == POLL_MAX_S and sleeps[0] < sleeps[1]
    assert taken == ["a"] and released == []
    assert (c.quarantined_slots(), c.quarantined_slots("a"), c.quarantined_slots("b")) == (3, 3, 0)

    c.copy(session, 0, bytes(64), 0, BB, BB, [(20 * BB, BB)], 0)  # the same thread: a fresh stream
    streams = [args[7] for name, args in lib.calls if name == "cudaMemcpy2DAsync"]
    assert streams[-1] != streams[0]
    c.close_session(session)  # the set-aside copies still read its mappings: not closed yet
    assert lib.named("cudaIpcCloseMemHandle", "cudaEventDestroy") == []

    assert c.sweep() == 0 and released == []  # still waiting on the event
    lib.complete(event)
    assert c.sweep() == 3 and released == ["a"] and c.quarantined_slots() == 0
    assert sorted(lib.named("cudaIpcCloseMemHandle", "cudaEventDestroy")) == ["cudaEventDestroy", "cudaIpcCloseMemHandle"]
    destroyed = [args[0] for name, args in lib.calls if name == "cudaStreamDestroy"]
    assert destroyed == [streams[0]]
    assert c.sweep() == 0


def test_an_event_that_completes_within_the_deadline_is_an_ordinary_copy() -> None:
    lib = _FakeLib()
    clock = FakeClock(0.0)
    event = bytes(range(64))
    lib.hang(event)

    def sleep(s: float) -> None:  # the engine's kernels finish 1 s into the 2 s wait
        if clock.advance(s) >= 1.0:
            lib.complete(event)

    c, session = _copier(lib, clock, timeout_s=2.0)
    c._sleep = sleep
    c.copy(session, 0, bytes(64), 0, 2 * BB, BB, [(0, BB), (BB, BB)], 0, after=event,
           quarantine=lambda: pytest.fail("an on-time copy is not set aside"), owner="a")
    assert 1.0 <= clock() < 2.0 and c.quarantined_slots() == 0


# ---- through a daemon --------------------------------------------------------------------------

SHM_TENANTS = (
    TenantSpec("a", TOKEN_A, allow_shm=True),
    TenantSpec("b", TOKEN_B, allow_shm=True),
    TenantSpec("ops", TOKEN_OPS, admin=True),
)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeLib:
    """The daemon's PUT_DEVICE on the fake runtime, its copies moving real bytes."""
    lib = _FakeLib(real=True, dma_ms=1.5)
    monkeypatch.setattr("kvstore.server.devcopy.load_runtime", lambda: (CudaRuntime(lib), ""))  # type: ignore[arg-type]
    return lib


def _daemon(start_daemon: Callable[..., ThreadedDaemon], timeout_s: float) -> ThreadedDaemon:
    return start_daemon(SHM_TENANTS, tiers=small_tiers(dram_blocks=8)[:1],
                        limits=Limits(max_blocks=256, max_payload_bytes=64 * BB, put_device_timeout_s=timeout_s))


def _device(lib: _FakeLib, handle: bytes, chain: list[bytes]) -> bytearray:
    """The client's "device" buffer of ``chain``'s payloads, exported as ``handle``."""
    buf = bytearray(b"".join(payload(h) for h in chain))
    lib.export(handle, buf)
    return buf


def _reads(c: Client, chain: list[bytes]) -> int:
    """Leading blocks of ``chain`` the daemon serves, each checked against its payload."""
    out = np.zeros(len(chain) * BB, np.uint8)
    n = c.get_into(SMALL_NS, chain, out)
    assert out[: n * BB].tobytes() == b"".join(payload(h) for h in chain[:n])
    return n


def _put_device_metrics(d: ThreadedDaemon) -> tuple[float, float]:
    m = _scrape(d.url)
    return m[("kvstore_put_device_timeouts_total", ())], m[("kvstore_put_device_quarantined_slots", ())]


def test_put_device_through_a_daemon_stores_the_device_bytes(
    start_daemon: Callable[..., ThreadedDaemon], fake_cuda: _FakeLib,
) -> None:
    d = _daemon(start_daemon, 5.0)
    chain = chain_for(70, 4)
    with connect(d.url, token=TOKEN_A) as a:
        assert a.plane == "shm" and a.info["put_device"] and a.info["put_device_event"]
        a.register_namespace(SMALL_NS)
        buf = _device(fake_cuda, b"A" * 64, chain)
        assert a.put_device(SMALL_NS, chain, device=0, handle=b"A" * 64, offset=0, size=len(buf),
                            after=b"E" * 64) == 4
        assert _reads(a, chain) == 4
    assert _put_device_metrics(d) == (0, 0)
    m = _scrape(d.url)  # the DMAs' device time, as the runtime timed it, beside the other phases
    dma = (("phase", "dma"),)
    assert m[("kvstore_put_device_seconds_count", dma)] == 1
    assert m[("kvstore_put_device_seconds_sum", dma)] == pytest.approx(1.5e-3)
    assert m[("kvstore_put_device_seconds_count", (("phase", "wait"),))] == 1


def test_a_save_whose_event_never_completes_fails_and_its_slots_wait_for_the_event(
    start_daemon: Callable[..., ThreadedDaemon], fake_cuda: _FakeLib,
) -> None:
    """Tenant a's save waits on an event that does not complete: it fails at the (tiny)
    deadline with nothing stored, its 4 arena slots are set aside (a's next save is refused
    until they are back), tenant b's saves go on in the slots left, and when a's event
    completes at last its copies land only in the set-aside slots, which the next PUT_DEVICE
    gives back."""
    d = _daemon(start_daemon, 0.05)
    lib = fake_cuda
    stuck, event = chain_for(71, 4), b"E" * 64
    with connect(d.url, token=TOKEN_A) as a, connect(d.url, token=TOKEN_B) as b:
        a.register_namespace(SMALL_NS)
        b.register_namespace(SMALL_NS)
        lib.export(b"A" * 64, bytearray(b"\xaa" * (4 * BB)))  # not the chain's bytes: seen if it lands
        lib.hang(event)
        with pytest.raises(UsageError, match=r"put_device_timeout.*CUDA event"):
            a.put_device(SMALL_NS, stuck, device=0, handle=b"A" * 64, offset=0, size=4 * BB, after=event)
        assert a.lookup(SMALL_NS, stuck).num_blocks == 0
        assert _put_device_metrics(d) == (1, 4)
        later = chain_for(72, 1)
        later_buf = _device(lib, b"L" * 64, later)
        with pytest.raises(UsageError, match="still hold 4 arena slots"):
            a.put_device(SMALL_NS, later, device=0, handle=b"L" * 64, offset=0, size=len(later_buf))

        other = chain_for(73, 8)
        other_buf = _device(lib, b"B" * 64, other)
        # 8 slots, 4 set aside: b's save gets the other 4 (a truncated put), none of a's
        assert b.put_device(SMALL_NS, other, device=0, handle=b"B" * 64, offset=0, size=len(other_buf)) == 4
        assert _reads(b, other) == 4

        lib.complete(event)  # a's copies land now: in the set-aside slots only
        assert _reads(b, other) == 4
        assert a.lookup(SMALL_NS, stuck).num_blocks == 0
        assert _put_device_metrics(d) == (1, 4)  # until the next PUT_DEVICE (or maintenance) sweeps
        assert a.put_device(SMALL_NS, later, device=0, handle=b"L" * 64, offset=0, size=len(later_buf)) == 1
        assert _put_device_metrics(d) == (1, 0)
        assert _reads(a, later) == 1
        # all 8 slots serve again: b's whole chain fits (a's one block makes room)
        rest_buf = _device(lib, b"R" * 64, other[4:])
        assert b.put_device(SMALL_NS, other, start=4, device=0, handle=b"R" * 64, offset=0, size=len(rest_buf)) == 4
        assert b.lookup(SMALL_NS, other).num_blocks == 8
        with connect(d.url, token=TOKEN_B, plane="tcp") as tcp:  # (a shm client's leases: half the arena)
            assert _reads(tcp, other) == 8


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
