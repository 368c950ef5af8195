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
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

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


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


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
            ("cudaStreamSynchronize", [ctypes.c_void_p]),
            ("cudaIpcOpenEventHandle", [ctypes.POINTER(ctypes.c_void_p), _IpcHandle]),
            ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
            ("cudaEventDestroy", [ctypes.c_void_p]),
            ("cudaGetLastError", []),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

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
    the handles a connection opened are closed with :meth:`close_session`."""

    def __init__(self, arena: memoryview) -> None:
        self._arena = arena
        self._base = address(arena) if not arena.readonly else 0
        self._size = arena.nbytes
        self._rt: CudaRuntime | None = None
        self._why = ""
        self._loaded = False
        self._registered = False
        self._lock = threading.Lock()
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

    @staticmethod
    def _close(rt: CudaRuntime, key: tuple[int, bytes], ptr: int) -> None:
        dev, handle = key
        rt.lib.cudaSetDevice(dev)
        if handle.startswith(_EVENT):
            rt.lib.cudaEventDestroy(ptr)
        else:
            rt.lib.cudaIpcCloseMemHandle(ptr)

    def copy(self, session: OrderedDict[tuple[int, bytes], int], device: int, handle: bytes, offset: int,
             size: int, block_bytes: int, slots: Sequence[tuple[int, int]], first: int,
             after: bytes | None = None, meanwhile: Callable[[], object] | None = None) -> float:
        """Blocks ``first, first+1, ...`` of the exported buffer (``size`` bytes from ``offset``,
        block ``i`` at ``offset + i * block_bytes``) into arena ``slots`` (``(offset, size)``
        each), one 2-D DMA per run of equally spaced slots, after the event IPC handle ``after``
        names (on the device: the kernels that fill the buffer); ``meanwhile()`` runs once they
        are queued (what the commit needs, built while they cross the link); returns once they
        have landed, with the seconds it took to issue them (the rest was the wait)."""
        if not slots:
            return 0.0
        if (first + len(slots)) * block_bytes > size:
            raise ValueError(f"blocks {first}..{first + len(slots) - 1} are past the {size}-byte device buffer")
        for off, _ in slots:
            if off < 0 or off + block_bytes > self._size:
                raise ValueError(f"arena slot {off} is outside the arena")
        src = self.open(session, device, handle) + offset + first * block_bytes
        rt = self._runtime(device)
        stream = self._stream(rt, device)
        if after is not None:
            ev = self.open(session, device, after, event=True)
            rt.check(rt.lib.cudaStreamWaitEvent(stream, ev, 0), "cudaStreamWaitEvent")
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
            if meanwhile is not None:
                meanwhile()
        finally:
            # One wait for all of them (the arena is page-locked: each DMA is queued, none
            # blocks); also when one failed to queue, so that none still writes into a slot the
            # caller gives back.
            synced = rt.lib.cudaStreamSynchronize(stream)
        rt.check(synced, "cudaStreamSynchronize")
        return queued

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
