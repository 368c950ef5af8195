"""PUT_DEVICE: the daemon copies a same-node engine's blocks out of the engine's GPU memory,
straight into the arena slots a store reservation handed out.

A GPU engine gathers the pages to save into one device buffer and sends a CUDA IPC handle of
it (``cudaIpcGetMemHandle`` of the buffer's allocation, and the offset in it); the daemon opens
the handle once (an LRU of open handles per connection), registers its arena with CUDA once
(``cudaHostRegister``), and copies each run of reserved slots with one device-to-host DMA
(``cudaMemcpy2DAsync`` when the slots lie at a fixed stride, all queued on one stream, then one
wait) before it commits them. No host copy on
either side, and the client never maps the arena writable: it only lets the daemon *read* one
buffer of its own GPU memory. The CUDA runtime is loaded with ``ctypes`` from the system or the
``nvidia-cuda-runtime`` wheel torch installs, only when a client asks; a daemon without it (or
without a GPU) says ``"put_device": false`` in HELLO and clients use PUT_SHM.

Cost: the first PUT_DEVICE on a GPU makes a CUDA context in the daemon (a few hundred MiB of
that GPU's memory) and registers the arena (page-locking it: it is faulted in already).

The wait has a deadline (``[server] put_device_timeout``): the copies wait on the device for the
client's event, which a client can keep from completing (a kernel that never ends, a hung
context). Past the deadline the copy raises :class:`CopyTimeout` and frees its thread, but the
queued DMAs may still write the slots, so they are *set aside*: the reservation commits nothing
and keeps its slots allocated (``Reservation.quarantine``), the thread's stream is retired with
them (a new one takes its place: later copies must not queue behind the stuck wait), and the
client's IPC mappings they read stay open. :meth:`DeviceCopier.sweep` gives them back once the
retired stream's work is done.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.buffers import address
from kvstore.cudart import cudart_candidates

log = logging.getLogger("kvstore.daemon")

IPC_HANDLE_BYTES = 64
_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2
_LAZY_ENABLE_PEER_ACCESS = 1
OPEN_HANDLES = 16
"""Open IPC handles kept per connection, memory and events (an engine's save buffers come from
its allocator's few large blocks, its events from a small pool); the least recently used is
closed past it."""
_EVENT = b"event:"
_NOT_READY = 600
"""``cudaErrorNotReady``: what ``cudaStreamQuery`` returns while work on the stream is pending."""
POLL_FIRST_S = 50e-6
POLL_MAX_S = 100e-6
"""The wait polls its stream, first after 50 µs, then every 0.1 ms: a blocking
``cudaStreamSynchronize`` cannot be given a deadline. At most ~0.1 ms (plus the scheduler's
wake-up) past the DMAs' end, a few dozen queries for a 4K-token save of an 8B model."""


class CopyTimeout(OSError):
    """The copies had not landed by the deadline (``put_device_timeout``); their slots are set
    aside until they have."""


@dataclass(slots=True, eq=False)
class _SetAside:
    """A timed-out copy's retired stream, the client's mappings it reads, and what gives its
    reservation's slots back once the stream's work is done."""

    device: int
    stream: int
    ptrs: tuple[int, ...]
    slots: int
    owner: str
    release: Callable[[], None] | None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_TIMING_CALLS: tuple[tuple[str, list[Any]], ...] = (
    ("cudaEventCreate", [ctypes.POINTER(ctypes.c_void_p)]),
    ("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
    ("cudaEventElapsedTime", [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]),
)
"""Optional calls: the device time of a copy's DMAs (:attr:`DeviceCopier.last_dma_s`)."""


class CudaRuntime:
    """The few CUDA runtime calls PUT_DEVICE needs, through ``ctypes``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, args in (
            ("cudaSetDevice", [ctypes.c_int]),
            ("cudaGetDeviceCount", [ctypes.POINTER(ctypes.c_int)]),
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]),
            ("cudaIpcCloseMemHandle", [ctypes.c_void_p]),
            ("cudaHostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
            ("cudaHostUnregister", [ctypes.c_void_p]),
            ("cudaMemcpy2DAsync", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
            ("cudaStreamCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
            ("cudaStreamQuery", [ctypes.c_void_p]),
            ("cudaStreamDestroy", [ctypes.c_void_p]),
            ("cudaIpcOpenEventHandle", [ctypes.POINTER(ctypes.c_void_p), _IpcHandle]),
            ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
            ("cudaEventDestroy", [ctypes.c_void_p]),
            ("cudaGetLastError", []),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        self.timing = all(hasattr(lib, name) for name, _ in _TIMING_CALLS)
        """Whether the runtime can time its DMAs on the device (``cudaEventElapsedTime``)."""
        if self.timing:
            for timed, types in _TIMING_CALLS:
                call = getattr(lib, timed)
                call.argtypes = types
                call.restype = ctypes.c_int

    def check(self, err: int, what: str) -> None:
        if err:
            self.lib.cudaGetLastError()  # clear the sticky error of a failed call
            raise OSError(f"{what} failed: CUDA error {err}")


def load_runtime() -> tuple[CudaRuntime | None, str]:
    """The CUDA runtime and a GPU, or None and why not."""
    for name in cudart_candidates():
        try:
            rt = CudaRuntime(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
        count = ctypes.c_int(0)
        if rt.lib.cudaGetDeviceCount(ctypes.byref(count)) or count.value < 1:
            return None, "no CUDA device is visible to the daemon"
        return rt, ""
    return None, "the CUDA runtime (libcudart) is not installed beside the daemon"


class DeviceCopier:
    """Device-to-host DMAs from engines' IPC-exported buffers into one host arena. Thread-safe;
    the handles a connection opened are closed with :meth:`close_session`. ``timeout_s``: how
    long :meth:`copy` waits for its DMAs; ``clock`` and ``sleep`` time that wait (monotonic)."""

    def __init__(self, arena: memoryview, timeout_s: float = 5.0, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._arena = arena
        self._timeout = timeout_s
        self._clock = clock
        self._sleep = sleep
        self._aside: list[_SetAside] = []
        self._held: dict[int, int] = {}
        """Client mappings (device pointers) that set-aside copies still read: how many each."""
        self._deferred: dict[int, list[tuple[int, bytes]]] = {}
        """Mappings sessions closed while set-aside copies read them: closed when those are done
        (a list: a handle opened again is the same pointer, one more reference)."""
        self._base = address(arena) if not arena.readonly else 0
        self._size = arena.nbytes
        self._rt: CudaRuntime | None = None
        self._why = ""
        self._loaded = False
        self._registered = False
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._local = threading.local()

    @property
    def why(self) -> str:
        """Why PUT_DEVICE is not available (after :meth:`available` said so)."""
        return self._why

    def known(self) -> bool | None:
        """Whether PUT_DEVICE can run here, without a lock (for the event loop); None until
        :meth:`available` has loaded the runtime (a blocking call: not on the loop)."""
        return (self._rt is not None) if self._loaded else None

    def available(self) -> bool:
        """Whether PUT_DEVICE can run here (loads the runtime on the first call)."""
        with self._lock:
            if not self._loaded:
                if not self._base:
                    self._why = "the daemon's arena is not writable here"
                else:
                    self._rt, self._why = load_runtime()
                if self._rt is None:
                    log.info("PUT_DEVICE unavailable: %s (GPU engines save through PUT_SHM)", self._why)
                self._loaded = True  # last: known() reads it without the lock
            return self._rt is not None

    def _runtime(self, device: int) -> CudaRuntime:
        if not self.available():
            raise OSError(f"PUT_DEVICE is not available on this daemon: {self._why}")
        rt = self._rt
        assert rt is not None
        rt.check(rt.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        with self._lock:
            if not self._registered:  # once: the whole arena, page-locked for DMA
                rt.check(rt.lib.cudaHostRegister(self._base, self._size, 0), "cudaHostRegister of the arena")
                self._registered = True
        return rt

    def open(self, session: OrderedDict[tuple[int, bytes], int], device: int, handle: bytes,
             event: bool = False) -> int:
        """The device address of memory handle ``handle`` in this process, or with ``event`` the
        event an IPC event handle names (opened once per session)."""
        rt = self._runtime(device)
        key = (device, (_EVENT if event else b"") + bytes(handle))
        ptr = session.get(key)
        if ptr is not None:
            session.move_to_end(key)
            return ptr
        out = ctypes.c_void_p()
        h = _IpcHandle.from_buffer_copy(bytes(handle))
        if event:
            rt.check(rt.lib.cudaIpcOpenEventHandle(ctypes.byref(out), h), "cudaIpcOpenEventHandle")
        else:
            rt.check(rt.lib.cudaIpcOpenMemHandle(ctypes.byref(out), h, _LAZY_ENABLE_PEER_ACCESS),
                     "cudaIpcOpenMemHandle")
        session[key] = int(out.value or 0)
        while len(session) > OPEN_HANDLES:
            self._close(rt, *session.popitem(last=False))
        rt.lib.cudaSetDevice(device)
        return session[key]

    def _close(self, rt: CudaRuntime, key: tuple[int, bytes], ptr: int) -> None:
        with self._lock:
            if ptr in self._held:  # a set-aside copy still reads it: closed by sweep
                self._deferred.setdefault(ptr, []).append(key)
                return
        dev, handle = key
        rt.lib.cudaSetDevice(dev)
        if handle.startswith(_EVENT):
            rt.lib.cudaEventDestroy(ptr)
        else:
            rt.lib.cudaIpcCloseMemHandle(ptr)

    def copy(self, session: OrderedDict[tuple[int, bytes], int], device: int, handle: bytes, offset: int,
             size: int, block_bytes: int, slots: Sequence[tuple[int, int]], first: int,
             after: bytes | None = None, meanwhile: Callable[[], object] | None = None,
             quarantine: Callable[[], Callable[[], None]] | None = None, owner: str = "") -> float:
        """Blocks ``first, first+1, ...`` of the exported buffer (``size`` bytes from ``offset``,
        block ``i`` at ``offset + i * block_bytes``) into arena ``slots`` (``(offset, size)``
        each), one 2-D DMA per run of equally spaced slots, after the event IPC handle ``after``
        names (on the device: the kernels that fill the buffer); ``meanwhile()`` runs once they
        are queued (what the commit needs, built while they cross the link); returns once they
        have landed, with the seconds it took to issue them (the rest was the wait).

        When they have not landed within the deadline: ``quarantine()`` is called (it takes the
        slots from the caller, commits nothing, and returns what gives them back), the copies
        are set aside for ``owner`` (:meth:`quarantined_slots`) until :meth:`sweep` sees them
        done, and :class:`CopyTimeout` is raised."""
        if not slots:
            return 0.0
        if (first + len(slots)) * block_bytes > size:
            raise ValueError(f"blocks {first}..{first + len(slots) - 1} are past the {size}-byte device buffer")
        for off, _ in slots:
            if off < 0 or off + block_bytes > self._size:
                raise ValueError(f"arena slot {off} is outside the arena")
        mem = self.open(session, device, handle)
        src = mem + offset + first * block_bytes
        rt = self._runtime(device)
        stream = self._stream(rt, device)
        ptrs: tuple[int, ...] = (mem,)
        if after is not None:
            ev = self.open(session, device, after, event=True)
            ptrs += (ev,)
            rt.check(rt.lib.cudaStreamWaitEvent(stream, ev, 0), "cudaStreamWaitEvent")
        marks = self._marks(rt, device)
        self._local.dma_s = None
        if marks is not None:  # the DMAs' device time: from here (the client's event done) to their end
            rt.lib.cudaEventRecord(marks[0], stream)
        i, n = 0, len(slots)
        t0 = time.perf_counter()
        queued = 0.0
        try:
            while i < n:
                j, stride = i + 1, 0
                if j < n:
                    stride = slots[j][0] - slots[i][0]
                    while j < n and slots[j][0] - slots[j - 1][0] == stride and stride >= block_bytes:
                        j += 1
                    if stride < block_bytes:
                        j, stride = i + 1, 0
                rows = j - i
                rt.check(rt.lib.cudaMemcpy2DAsync(self._base + slots[i][0], stride or block_bytes,
                                                  src + i * block_bytes, block_bytes, block_bytes, rows,
                                                  _DEVICE_TO_HOST, stream), "cudaMemcpy2DAsync")
                i = j
            queued = time.perf_counter() - t0
            if marks is not None:
                rt.lib.cudaEventRecord(marks[1], stream)
            if meanwhile is not None:
                meanwhile()
        finally:
            # One wait for all of them (the arena is page-locked: each DMA is queued, none
            # blocks); also when one failed to queue, so that none still writes into a slot the
            # caller gives back. Past the deadline they may still write them: set aside.
            synced = self._wait(rt, stream)
            if synced == _NOT_READY:
                self._set_aside(device, stream, ptrs, len(slots), owner, quarantine)
                waited = "the client's CUDA event and " if after is not None else ""
                raise CopyTimeout(
                    f"the copies out of GPU {device} waited {self._timeout:g} s ([server] put_device_timeout) for "
                    f"{waited}their DMAs and had not landed: check that the kernels queued before the client's "
                    "event finish (a kernel that never ends, a hung GPU context) or raise put_device_timeout; "
                    "the save's arena slots stay set aside until the copies are done")
        rt.check(synced, "cudaStreamQuery")
        if marks is not None:
            ms = ctypes.c_float()
            if not rt.lib.cudaEventElapsedTime(ctypes.byref(ms), marks[0], marks[1]):
                self._local.dma_s = ms.value / 1e3
        return queued

    @property
    def last_dma_s(self) -> float | None:
        """This thread's last :meth:`copy`: seconds its DMAs took on the device, from the client's
        event's completion (the gather that fills the buffer) to the last DMA's end; None where the
        runtime cannot time them."""
        return getattr(self._local, "dma_s", None)

    def _marks(self, rt: CudaRuntime, device: int) -> tuple[int, int] | None:
        """This thread's two timing events on ``device`` (made once), or None without timing."""
        if not rt.timing:
            return None
        marks: dict[int, tuple[int, int]] = self._local.__dict__.setdefault("marks", {})
        pair = marks.get(device)
        if pair is None:
            a, b = ctypes.c_void_p(), ctypes.c_void_p()
            if rt.lib.cudaEventCreate(ctypes.byref(a)) or rt.lib.cudaEventCreate(ctypes.byref(b)):
                rt.lib.cudaGetLastError()
                return None
            pair = marks[device] = (int(a.value or 0), int(b.value or 0))
        return pair

    def _wait(self, rt: CudaRuntime, stream: int) -> int:
        """Poll ``stream`` until its work is done (its CUDA status) or the deadline passes
        (``_NOT_READY``), with a bounded back-off."""
        deadline = self._clock() + self._timeout
        pause = POLL_FIRST_S
        while (err := rt.lib.cudaStreamQuery(stream)) == _NOT_READY:
            left = deadline - self._clock()
            if left <= 0:
                break
            self._sleep(min(pause, left))
            pause = min(2 * pause, POLL_MAX_S)
        return err

    def _set_aside(self, device: int, stream: int, ptrs: tuple[int, ...], slots: int, owner: str,
                   quarantine: Callable[[], Callable[[], None]] | None) -> None:
        """Retire this thread's ``stream`` with the slots its copies may still write."""
        self._local.__dict__.setdefault("streams", {}).pop(device, None)  # the next copy makes another
        release = quarantine() if quarantine is not None else None
        with self._lock:
            self._aside.append(_SetAside(device, stream, ptrs, slots, owner, release))
            for p in ptrs:
                self._held[p] = self._held.get(p, 0) + 1
        log.warning("PUT_DEVICE of %d blocks for %r timed out after %g s on GPU %d: its slots are set aside "
                    "until its copies are done", slots, owner, self._timeout, device)

    def quarantined_slots(self, owner: str | None = None) -> int:
        """Arena slots set aside for copies past their deadline (``owner``'s only, when given)."""
        with self._lock:
            return sum(a.slots for a in self._aside if owner is None or a.owner == owner)

    def sweep(self) -> int:
        """Give back the slots of set-aside copies whose stream's work is done (and close the
        mappings their sessions closed meanwhile); returns how many slots. A stream that
        reports an error counts as done: its work stopped (the context is broken)."""
        rt = self._rt
        if rt is None or not self._aside or not self._sweeping.acquire(blocking=False):
            return 0  # (nothing set aside, or another thread sweeps now)
        try:
            return self._sweep(rt)
        finally:
            self._sweeping.release()

    def _sweep(self, rt: CudaRuntime) -> int:
        with self._lock:
            pending = list(self._aside)
        done: list[_SetAside] = []
        for a in pending:
            rt.lib.cudaSetDevice(a.device)
            err = rt.lib.cudaStreamQuery(a.stream)
            if err == _NOT_READY:
                continue
            if err:
                rt.lib.cudaGetLastError()
                log.warning("a set-aside PUT_DEVICE's stream on GPU %d ended with CUDA error %d", a.device, err)
            rt.lib.cudaStreamDestroy(a.stream)
            done.append(a)
        closing: list[tuple[tuple[int, bytes], int]] = []
        with self._lock:
            for a in done:
                self._aside.remove(a)
                for p in a.ptrs:
                    self._held[p] -= 1
                    if not self._held[p]:
                        del self._held[p]
                        closing += [(key, p) for key in self._deferred.pop(p, [])]
        for key, p in closing:
            self._close(rt, key, p)
        for a in done:
            if a.release is not None:
                try:
                    a.release()
                except Exception:  # noqa: BLE001 - the others are still given back
                    log.exception("giving back %d set-aside PUT_DEVICE slots failed", a.slots)
        return sum(a.slots for a in done)

    def _stream(self, rt: CudaRuntime, device: int) -> int:
        """This thread's non-blocking stream on ``device`` (made once): copies of different
        connections, on different threads, neither wait for each other nor for the legacy stream."""
        streams: dict[int, int] = self._local.__dict__.setdefault("streams", {})
        stream = streams.get(device)
        if stream is None:
            out = ctypes.c_void_p()
            rt.check(rt.lib.cudaStreamCreateWithFlags(ctypes.byref(out), 1), "cudaStreamCreateWithFlags")
            stream = streams[device] = int(out.value or 0)
        return stream

    def close_session(self, session: OrderedDict[tuple[int, bytes], int]) -> None:
        rt = self._rt
        while session:
            key, ptr = session.popitem()
            if rt is not None:
                self._close(rt, key, ptr)
