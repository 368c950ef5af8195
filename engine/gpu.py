"""Host-to-device loads straight from the store's shared-memory DRAM arena.

The arena is mapped once per process and registered with the CUDA driver
(``cudaHostRegister``), so a cached block is copied from where it lies in the arena to the
device with one asynchronous DMA: no CPU gather, no staging copy on the host. Blocks are held by
a store lease (:meth:`kvstore.store.KVStore.acquire`) until the copies that read them complete.

Copies go in block order on one stream per direction; callers split a block into layer groups
(:meth:`ArenaBlocks.copy_range`) to load layer-wise, and record events instead of synchronizing.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from typing import Any

import torch

from kvstore.cudart import cudart_candidates
from kvstore.shm import attach_arena

_ARENAS: dict[str, tuple[Any, torch.Tensor]] = {}
_LOCK = threading.Lock()


_CUDART: Any = None


def _memcpy2d() -> Any:
    """``cudaMemcpy2DAsync`` from the CUDA runtime that torch loaded, or None if not found.

    torch has no strided host-to-device copy, and one ``copy_`` per block and layer group costs
    several microseconds of CPU each (thousands for a 32K-token prefix): long enough to delay
    the model's first kernel. One 2-D copy moves a layer group of a whole run of blocks that lie
    at a fixed stride in the arena.
    """
    global _CUDART
    if _CUDART is None:
        _CUDART = False
        for name in cudart_candidates():
            try:
                fn = ctypes.CDLL(name).cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _CUDART = fn
            break
    return _CUDART or None




def runs(offsets: list[int]) -> list[tuple[int, int, int]]:
    """Split block offsets into runs ``(first block, count, stride)`` of equally spaced blocks."""
    out: list[tuple[int, int, int]] = []
    i, n = 0, len(offsets)
    while i < n:
        if i + 1 == n:
            out.append((i, 1, 0))
            break
        stride = offsets[i + 1] - offsets[i]
        j = i + 1
        while j + 1 < n and offsets[j + 1] - offsets[j] == stride:
            j += 1
        if stride <= 0:  # out of order: copy the first alone, retry from the next
            out.append((i, 1, 0))
            i += 1
            continue
        out.append((i, j - i + 1, stride))
        i = j + 1
    return out


def arena_tensor(name: str) -> torch.Tensor:
    """The whole arena ``name`` as a host uint8 tensor, page-locked when CUDA is present."""
    with _LOCK:
        hit = _ARENAS.get(name)
        if hit is not None:
            return hit[1]
        shm = attach_arena(name)
        with warnings.catch_warnings():
            # A daemon's arena is mapped read-only: the tensor is only read (copies to the
            # device); a write would fault in this process, never reach the daemon's memory.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            host = torch.frombuffer(shm.buf, dtype=torch.uint8)
        if torch.cuda.is_available():
            # A daemon hands its clients the arena read-only; CUDA registers such memory only
            # with cudaHostRegisterReadOnly (8).
            flags = 8 if shm.buf.readonly else 0
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), flags)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of arena {name} ({host.numel()} bytes) failed: {err}")
        _ARENAS[name] = (shm, host)
        return host


_REGISTERED: dict[int, int] = {}  # address -> bytes of host memory this process registered
"""Host ranges registered by :func:`register_host` (an arena is registered by :func:`arena_tensor`)."""


def register_host(t: torch.Tensor) -> bool:
    """Page-lock the host memory of ``t`` (contiguous uint8, e.g. a daemon connection's staging
    segment) for DMA with ``cudaHostRegister``, once per address; False without CUDA. A range
    registered before at this address with another size is registered again."""
    if not torch.cuda.is_available():
        return False
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    with _LOCK:
        if _REGISTERED.get(ptr) == size:
            return True
        if ptr in _REGISTERED:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        if err == 712:  # cudaErrorHostMemoryAlreadyRegistered: a mapping that was here before
            torch.cuda.cudart().cudaHostUnregister(ptr)
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes of host memory failed: CUDA error {err}")
        _REGISTERED[ptr] = size
        return True


_IPC: dict[str, Any] = {}


def _ipc_calls() -> tuple[Any, Any]:
    """``cudaIpcGetMemHandle`` (the runtime torch loaded) and ``cuMemGetAddressRange_v2`` (the driver)."""
    if not _IPC:
        get = None
        for name in cudart_candidates():
            try:
                get = ctypes.CDLL(name).cudaIpcGetMemHandle
                break
            except (OSError, AttributeError):
                continue
        if get is None:
            raise OSError("the CUDA runtime (libcudart) was not found")
        get.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        get.restype = ctypes.c_int
        rng = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
        rng.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        rng.restype = ctypes.c_int
        _IPC.update(get=get, range=rng)
    return _IPC["get"], _IPC["range"]


def device_export(t: torch.Tensor) -> tuple[int, bytes, int, int]:
    """A CUDA tensor's memory as another process on the node opens it: ``(device, the 64-byte IPC
    handle of its allocation, the tensor's offset in the allocation, bytes from there to the
    allocation's end)``. OSError where CUDA cannot export it (memory mapped with the virtual
    memory API, e.g. an allocator with expandable segments)."""
    if not t.is_cuda:
        raise OSError("only CUDA memory can be exported")
    get, rng = _ipc_calls()
    torch.cuda.set_device(t.device)  # the thread's current context: the tensor's device's
    ptr = t.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = rng(ctypes.byref(base), ctypes.byref(size), ptr)
    if err:
        raise OSError(f"cuMemGetAddressRange failed: CUDA driver error {err}")
    handle = (ctypes.c_char * 64)()
    err = get(ctypes.byref(handle), ctypes.c_void_p(base.value))
    if err:
        raise OSError(f"cudaIpcGetMemHandle failed: CUDA error {err}")
    off = ptr - int(base.value)
    return int(t.device.index or 0), bytes(handle), off, int(size.value) - off


def unregister_host(t: torch.Tensor) -> None:
    """Undo :func:`register_host` (before the memory is unmapped)."""
    ptr = t.data_ptr()
    with _LOCK:
        if _REGISTERED.pop(ptr, None) is not None and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(ptr)


def release_arenas() -> None:
    """Unmap (and unregister) every arena mapped so far; call only when no lease is held and no
    copy from an arena is in flight (benchmarks that close a store and open another)."""
    with _LOCK:
        items = list(_ARENAS.values())
        _ARENAS.clear()
    if torch.cuda.is_available():
        for _, host in items:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    shms = [shm for shm, _ in items]
    items.clear()  # the tensors export the mapping: drop them before closing it
    for shm in shms:
        with contextlib.suppress(BufferError):  # a tensor over it is still alive: it stays mapped
            shm.close()


def arena_layer_rows(buf: torch.Tensor, offsets: list[int], layer: int, page_bytes: int) -> torch.Tensor:
    """Layer ``layer`` of blocks at byte ``offsets`` of ``buf`` (1-D uint8) as ``[n, page_bytes]``:
    a strided view when the blocks are equally spaced (no copy), else one gather."""
    n = len(offsets)
    base = offsets[0] + layer * page_bytes
    if n == 1:
        return buf[base : base + page_bytes].view(1, page_bytes)
    step = offsets[1] - offsets[0]
    if step > 0 and all(offsets[i + 1] - offsets[i] == step for i in range(n - 1)):
        return buf.as_strided((n, page_bytes), (step, 1), base)
    idx = torch.as_tensor([o + layer * page_bytes for o in offsets], dtype=torch.long)
    rows = buf.as_strided((buf.numel() - page_bytes + 1, page_bytes), (1, 1))
    return rows.index_select(0, idx)


class _ArenaRows:
    """Blocks at ``locations`` (``(offset, size)`` each) of a shared-memory arena, mapped and
    registered once per process (:func:`arena_tensor`), and the 2-D DMAs between them and rows
    of a device tensor."""

    def __init__(self, arena: str, locations: tuple[tuple[int, int], ...]) -> None:
        self.locations = locations
        self.host = arena_tensor(arena) if locations else torch.empty(0, dtype=torch.uint8)
        self._runs_of: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.locations)

    def block(self, i: int) -> torch.Tensor:
        off, size = self.locations[i]
        return self.host[off : off + size]

    def runs_of(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """:func:`runs` of blocks ``first .. first+count-1`` (relative to ``first``), computed
        once per range (a restore copies the same range once per layer group)."""
        got = self._runs_of.get((first, count))
        if got is None:
            got = self._runs_of[first, count] = runs([off for off, _ in self.locations[first : first + count]])
        return got

    def _copy(self, dev: torch.Tensor, lo: int, hi: int, first: int, to_device: bool, stream: Any = None) -> int:
        """Bytes ``lo:hi`` of blocks ``first, first+1, ...`` to (or from) the rows of ``dev``
        (``[count, hi-lo]`` uint8, any row pitch), asynchronously on the current stream: one
        ``cudaMemcpy2DAsync`` per run of equally spaced blocks in the arena (one copy per block
        when the CUDA runtime cannot be called directly, or ``dev`` is in host memory). Returns
        the copy calls it queued. ``stream``: a ``torch.cuda.Stream`` to queue the DMAs on
        instead of the current stream (no stream switch where the 2-D DMA is called directly)."""
        count = dev.shape[0]
        locs = self.locations
        if first + count > len(locs):
            raise IndexError(f"blocks {first}..{first + count - 1} of {len(locs)} in the arena")
        copy2d = _memcpy2d() if dev.is_cuda else None
        if copy2d is None or dev.stride(1) != 1:
            if stream is not None and dev.is_cuda:
                with torch.cuda.stream(stream):
                    return self._copy(dev, lo, hi, first, to_device)
            for i in range(count):
                off = locs[first + i][0]
                if to_device:
                    dev[i].copy_(self.host[off + lo : off + hi], non_blocking=True)
                else:
                    self.host[off + lo : off + hi].copy_(dev[i], non_blocking=True)
            return count
        stream = (torch.cuda.current_stream(dev.device) if stream is None else stream).cuda_stream
        base, dpitch, width = self.host.data_ptr(), dev.stride(0), hi - lo
        runs_ = self.runs_of(first, count)
        for r0, n, stride in runs_:
            d, h, hpitch = dev.data_ptr() + r0 * dpitch, base + locs[first + r0][0] + lo, stride or width
            if to_device:  # 1: cudaMemcpyHostToDevice, 2: cudaMemcpyDeviceToHost
                err = copy2d(d, dpitch, h, hpitch, width, n, 1, stream)
            else:
                err = copy2d(h, hpitch, d, dpitch, width, n, 2, stream)
            if err:
                raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
        return len(runs_)


class _ArenaSource(_ArenaRows):
    """Arena rows read to the device: the copies of a lease's blocks and of a peek's."""

    def layer_rows(self, first: int, count: int, layer: int, page_bytes: int) -> torch.Tensor:
        """Layer ``layer`` of blocks ``first..first+count-1`` as a host view ``[count,
        page_bytes]`` (strided where the blocks are equally spaced; a gather otherwise): the CPU
        engine's restore reads its pages' rows from it."""
        offsets = [off for off, _ in self.locations[first : first + count]]
        return arena_layer_rows(self.host, offsets, layer, page_bytes)

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Bytes ``lo:hi`` of every block into ``dst[i, lo:hi]`` (asynchronous on the current
        stream): one 2-D DMA per run of equally spaced blocks in the arena (one per block when
        the CUDA runtime cannot be called directly)."""
        self.copy_into(dst[:, lo:hi], lo, hi)

    def copy_into(self, dst: torch.Tensor, lo: int, hi: int, first: int = 0, stream: Any = None) -> int:
        """Bytes ``lo:hi`` of blocks ``first, first+1, ...`` into the rows of ``dst`` (``[count,
        hi-lo]`` uint8, any row pitch), asynchronously on the current stream (or ``stream``: no
        stream switch where a caller queues one copy on a side stream). Returns the copy calls
        it queued."""
        return self._copy(dst, lo, hi, first, True, stream)


class ArenaBlocks(_ArenaSource):
    """The leading cached blocks of a prompt, held in the arena by a lease."""

    def __init__(self, store: Any, lease: Any) -> None:
        super().__init__(lease.arena, tuple(lease.locations) if lease.num_blocks else ())
        self._store = store
        self.lease = lease

    def release(self) -> None:
        """Give the lease back; call only after the copies that read the blocks completed."""
        self._store.release(self.lease)


class HeldBlocks(_ArenaSource):
    """Blocks in the arena that a lease of another connection holds (an engine's scheduler took
    it at its lookup: ``Client.lookup_lease``): copies from them are queued at once, and the
    holder gives the lease back once they have landed."""


class PeekedBlocks(_ArenaSource):
    """Blocks where the arena held them at a :meth:`kvstore.store.KVStore.peek_arena`, held by
    nothing: a copy from them may be queued before the lease is taken, and is kept only for the
    leading blocks :meth:`kvstore.store.KVStore.confirm_peek` confirms against that lease (the
    rest are copied again from the lease, on the same stream, after it)."""

    def __init__(self, peek: Any) -> None:
        super().__init__(peek.arena, tuple(peek.locations))
        self.peek = peek

    def release(self) -> None:
        """Nothing is held."""


class ArenaSlots(_ArenaRows):
    """The arena slots of a store reservation (:meth:`kvstore.store.KVStore.reserve`), written
    straight from the device: a save's one device-to-host copy lands where the store keeps the
    block, and nothing copies it again on the host. Only for an in-process store (a daemon's
    clients map its arena read-only)."""

    def __init__(self, reservation: Any) -> None:
        super().__init__(reservation.arena, tuple(reservation.locations))
        self.reservation = reservation

    @property
    def first(self) -> int:
        """Chain position of the first slot's block."""
        return int(self.reservation.first)

    def copy_from(self, src: torch.Tensor, first: int = 0) -> int:
        """Rows of ``src`` (``[count, block_bytes]`` uint8 on the device, any row pitch) into
        slots ``first, first+1, ...``, asynchronously on the current stream (one 2-D DMA per run
        of equally spaced slots). Returns the copy calls it queued."""
        return self._copy(src, 0, src.shape[1], first, False)

    def prepare(self) -> None:
        """Build what the commit publishes while the copies are in flight (optional: the
        commit after it is shorter; ``Reservation.prepare``)."""
        self.reservation.prepare()

    def commit(self, count: int | None = None) -> int:
        """Publish the leading ``count`` slots (default: all); call only once the copies into
        them completed. Returns the blocks that were new."""
        return int(self.reservation.commit(count))

    def abort(self) -> None:
        self.reservation.abort()


class HostBlocks:
    """Blocks already copied into a caller buffer (``[n, block_bytes]`` uint8, pinned when CUDA
    is present): the path for stores without leases (a remote daemon over TCP)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    def block(self, i: int) -> torch.Tensor:
        return self.blocks[i]

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        self.copy_into(dst[:, lo:hi], lo, hi)

    def copy_into(self, dst: torch.Tensor, lo: int, hi: int, first: int = 0, stream: Any = None) -> int:
        """As :meth:`ArenaBlocks.copy_into`: one copy for all the rows."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dst.copy_(self.blocks[first : first + dst.shape[0], lo:hi], non_blocking=True)
        return 1

    def layer_rows(self, first: int, count: int, layer: int, page_bytes: int) -> torch.Tensor:
        return self.blocks[first : first + count, layer * page_bytes : (layer + 1) * page_bytes]

    def release(self) -> None:
        pass


class HostRing:
    """One host buffer (page-locked when CUDA is present), allocated once and handed out in
    FIFO order: the staging of the blocks an engine stores in the background.

    ``torch.empty(..., pin_memory=True)`` per store costs a ``cudaHostAlloc`` whenever a new
    size comes (hundreds of ms per GiB, on the engine thread); the ring pays it once.
    :meth:`take` returns a ``[nbytes]`` uint8 view and a ticket; :meth:`give` returns the
    ticket when the store that read the view is done (any thread). Space is reused in the
    order it was taken, so a ticket given back out of order frees its space only once every
    older one is back. :meth:`take` waits while the ring is full (back-pressure from a store
    that falls behind) and returns None for a request larger than the whole ring.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a host ring needs a positive size, not {nbytes} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.capacity = nbytes
        self._cond = threading.Condition()
        self._live: dict[int, tuple[int, int, bool]] = {}  # ticket -> (start, end, given back)
        self._order: list[int] = []  # tickets in the order taken
        self._head = 0  # end of the newest ticket's bytes
        self._next = 0
        self.waits = 0
        """How many takes had to wait for space."""

    def _fits(self, n: int) -> int | None:
        """Start offset for ``n`` contiguous bytes, or None. In use: from the oldest live
        ticket's start to ``head``, wrapping past the end when the newest started before the
        oldest."""
        if not self._order:
            return 0
        oldest = self._live[self._order[0]][0]
        newest = self._live[self._order[-1]][0]
        if oldest <= newest:  # in use: [oldest, head); free: [head, capacity) and [0, oldest)
            if self.capacity - self._head >= n:
                return self._head
            return 0 if oldest >= n else None
        return self._head if oldest - self._head >= n else None  # free: [head, oldest)

    def take(self, nbytes: int, timeout: float | None = None) -> tuple[torch.Tensor, int] | None:
        if nbytes > self.capacity or nbytes <= 0:
            return None
        with self._cond:
            start = self._fits(nbytes)
            if start is None:
                self.waits += 1
                if not self._cond.wait_for(lambda: self._fits(nbytes) is not None, timeout):
                    return None
                start = self._fits(nbytes)
                assert start is not None
            ticket = self._next
            self._next += 1
            self._live[ticket] = (start, start + nbytes, False)
            self._order.append(ticket)
            self._head = start + nbytes
            return self.buf[start : start + nbytes], ticket

    def give(self, ticket: int) -> None:
        with self._cond:
            start, end, _ = self._live[ticket]
            self._live[ticket] = (start, end, True)
            while self._order and self._live[self._order[0]][2]:
                del self._live[self._order.pop(0)]
            if not self._order:
                self._head = 0
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        """Tickets taken and not yet freed (given back, or waiting on an older one)."""
        with self._cond:
            return len(self._order)
