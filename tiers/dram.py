"""The DRAM tier: one preallocated arena in POSIX shared memory, cut into slabs.

The arena is created once, at its full size, and never grows: a put copies the payload into a
slot handed out by :class:`tiers._slab.SlabAllocator` and allocates no payload memory. The
segment has a name (:attr:`DramTier.shm_name`) and every block an ``(offset, size)``
(:meth:`DramTier.location`), so that a same-node client can map the arena with
:func:`kvstore.shm.attach_arena` and read a block without a copy through a socket.

Not persistent: the arena is unlinked on :meth:`DramTier.close`, when the tier is garbage
collected, at interpreter exit, and (through multiprocessing's resource tracker) when the process
dies without running any of those.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

from kvstore.block import BlockMeta
from kvstore.buffers import MAX_COPY_THREADS, Buffer, arena_pairs, byte_view, copy_pool
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    KVStoreError,
    TierFullError,
    TierIOError,
)
from kvstore.keys import BlockHash
from kvstore.shm import Prefault, disown_arena, own_arena, reopen_readonly
from kvstore.shm import attach_arena as attach_arena  # re-exported for older imports
from tiers._slab import SlabAllocator, SlabMap
from tiers.base import Tier, TierUsage

_ALIGN = 4096
_MiB = 1024 * 1024
# Linux allows 255 bytes in a /dev/shm name; stay well under it.
_MAX_SHM_NAME = 200
_SHM_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")

@dataclass(frozen=True, slots=True)
class DramConfig:
    """Options of one DRAM tier (``[[tiers]]`` with ``kind = "dram"``)."""

    capacity_bytes: int
    """Arena size (rounded down to whole slabs); one ``/dev/shm`` segment, reserved at start, so
    ``/dev/shm`` must hold it."""
    slab_bytes: int = 64 * _MiB
    """The unit a size class grows by; must hold the largest block."""
    shm_name: str = ""
    """The segment's name without a leading slash; empty picks a unique one
    (``kvs-<pid>-<tier>-<random>``)."""
    copy_threads: int = 0
    """Threads that copy one batched read or write of 64 MiB or more (``read_many``/``write_many``,
    and one large block); 0 picks ``max(min(4, cores), min(16, cores // 2))`` (2 on 2 cores, 8 on
    16), 1 copies in the calling thread only."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ConfigError(
                f"dram capacity_bytes must be a positive size like '4GiB', got {self.capacity_bytes!r}"
            )
        if not isinstance(self.slab_bytes, int) or self.slab_bytes <= 0 or self.slab_bytes % _ALIGN:
            raise ConfigError(
                f"dram slab_bytes must be a positive multiple of {_ALIGN} (e.g. '64MiB'), "
                f"got {self.slab_bytes!r}"
            )
        if self.capacity_bytes < self.slab_bytes:
            raise ConfigError(
                f"dram capacity_bytes ({self.capacity_bytes}) is smaller than one slab "
                f"({self.slab_bytes}); raise capacity_bytes or lower slab_bytes"
            )
        if not isinstance(self.shm_name, str):
            raise ConfigError(f"dram shm_name must be a string, got {self.shm_name!r}")
        if (isinstance(self.copy_threads, bool) or not isinstance(self.copy_threads, int)
                or not 0 <= self.copy_threads <= MAX_COPY_THREADS):
            raise ConfigError(
                f"dram copy_threads must be a whole number in 0..{MAX_COPY_THREADS} (0: picked from the cores), "
                f"got {self.copy_threads!r}"
            )
        if self.shm_name and (
            len(self.shm_name) > _MAX_SHM_NAME or _SHM_NAME_CHARS.search(self.shm_name)
        ):
            raise ConfigError(
                f"dram shm_name {self.shm_name!r} must be at most {_MAX_SHM_NAME} characters of "
                "letters, digits, '_', '.' and '-' (no slash), or empty for a generated name"
            )


def _shm_room() -> int | None:
    """Bytes free in /dev/shm, where shm_open creates segments on Linux; None elsewhere."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _release_segment(shm: SharedMemory, name: str, prefault: list[Prefault]) -> None:
    """Unmap and unlink ``shm`` once; the finalizer of a tier (it must not reference the tier)."""
    for p in prefault:
        p.stop()  # its thread holds a view of the arena
    # BufferError: a view of the arena is still alive somewhere (a caller kept a slice); the
    # mapping goes when that view does. Unlinking the name is what keeps /dev/shm clean.
    with contextlib.suppress(BufferError):
        shm.close()
    # FileNotFoundError: someone removed /dev/shm/<name> by hand; nothing is left to clean.
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()  # also unregisters it from the resource tracker
    disown_arena(name)


class DramTier(Tier):
    """Payloads in one shared-memory arena; ``key -> (offset, BlockMeta)`` in a dict.

    Thread safety: ``_lock`` guards the allocator and the map; payload copies run outside it.
    That is safe because the store never deletes or rewrites a key while a read or write of that
    same key is in flight, so a slot cannot be freed or reused under a copy. Checksums are not
    verified on read: the arena lives and dies with the process, it has no device to rot.
    """

    kind = "dram"
    persistent = False
    Config = DramConfig

    def __init__(
        self, name: str, config: DramConfig, *, root: Path, clock: Clock = system_clock
    ) -> None:
        super().__init__(name)
        self.config = config
        self._clock = clock  # unused today; kept for the constructor convention of every tier
        self._alloc = SlabAllocator(config.capacity_bytes, config.slab_bytes, _ALIGN)
        self._lock = threading.Lock()
        self._map: dict[BlockHash, tuple[int, BlockMeta]] = {}
        self._slots = SlabMap(self._lock, self._map, self._alloc)
        shm_name = config.shm_name or self._generated_name(name)
        size = self._alloc.capacity_bytes  # a partial slab at the end could never be used
        room = _shm_room()
        if room is not None and size > room:
            # Refused before SharedMemory is asked: on Python 3.11 and 3.12 its failed create
            # (ENOMEM from mmap) unregisters a name it never registered, and the resource
            # tracker prints a KeyError traceback at exit after the clean error.
            raise TierIOError(
                f"dram tier {name!r}: cannot reserve {size} bytes of shared memory: /dev/shm has "
                f"{room} bytes free; lower capacity_bytes or enlarge /dev/shm (docker: --shm-size)")
        try:
            shm = SharedMemory(name=shm_name, create=True, size=size)
        except FileExistsError as e:
            raise TierIOError(
                f"dram tier {name!r}: shared memory segment {shm_name!r} already exists; another "
                f"daemon uses it, or a crashed one left /dev/shm/{shm_name} behind (remove it), "
                "or leave shm_name empty for a generated name"
            ) from e
        except OSError as e:
            raise TierIOError(f"dram tier {name!r}: cannot create shared memory: {e}") from e
        # The creator stays registered with the resource tracker on purpose: if this process is
        # killed, the tracker unlinks the arena instead of leaving gigabytes in /dev/shm.
        own_arena(shm_name)
        prefault: list[Prefault] = []
        self._finalizer = weakref.finalize(self, _release_segment, shm, shm_name, prefault)
        try:
            self._reserve(shm)
            assert shm.buf is not None  # a created segment is mapped
            # The pages are reserved now but not mapped: fault them in off the put path.
            prefault.append(Prefault(shm.buf, write=True, name=f"kvstore-prefault-{name}"))
        except BaseException:
            self._finalizer()
            raise
        self.prefault = prefault[0]
        self._shm = shm
        self._buf: memoryview = shm.buf
        self._shm_name = shm_name
        self._copy = copy_pool(config.copy_threads)

    @staticmethod
    def _generated_name(name: str) -> str:
        safe = _SHM_NAME_CHARS.sub("_", name)[:64]
        return f"kvs-{os.getpid()}-{safe}-{secrets.token_hex(4)}"

    def _reserve(self, shm: SharedMemory) -> None:
        """Back the whole arena with memory now.

        ftruncate on tmpfs only sets a size; a write past what /dev/shm can hold then kills the
        process with SIGBUS. posix_fallocate turns that into an error at open (a container's
        /dev/shm is often 64 MiB).
        """
        fd = getattr(shm, "_fd", -1)
        if fd < 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, 0, self._alloc.capacity_bytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # this filesystem cannot preallocate
                return
            raise TierIOError(
                f"dram tier {self.name!r}: cannot reserve {self._alloc.capacity_bytes} bytes of "
                f"shared memory ({e}); lower capacity_bytes or enlarge /dev/shm "
                "(docker: --shm-size)"
            ) from e

    # ---- zero-copy surface -------------------------------------------------------------------

    def arena(self) -> DramTier:
        """This tier: every block lies in its shared-memory segment (:class:`tiers.base.Arena`)."""
        return self

    @property
    def shm_name(self) -> str:
        """The arena's shared-memory name (no leading slash), for :func:`kvstore.shm.attach_arena`."""
        return self._shm_name

    def unlink_name(self) -> None:
        """Remove the arena's name from ``/dev/shm``; the mapping stays. From then on only a
        process handed a descriptor (:meth:`readonly_fd`) can map the arena: the daemon does
        this once it has mapped the arena itself, so that no local process can open it by
        name. Nothing is left behind in ``/dev/shm`` even by a crash."""
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()  # also unregisters it from the resource tracker
        disown_arena(self._shm_name)

    def readonly_fd(self) -> int:
        """A new read-only descriptor of the arena (the caller closes it)."""
        return reopen_readonly(self._shm._fd)  # type: ignore[attr-defined]  # noqa: SLF001  # CPython private; no public fd

    def location(self, key: BlockHash) -> tuple[int, int] | None:
        """``(offset, size)`` of ``key``'s payload in the arena, or None.

        Valid only while the block is held: a client must pin the block through the store
        before reading the arena directly.
        """
        with self._lock:
            entry = self._map.get(key)
        return None if entry is None else (entry[0], entry[1].size)

    def locations(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """:meth:`location` of every key, under one lock (a lease of thousands of blocks)."""
        get = self._map.get
        with self._lock:
            entries = [get(k) for k in keys]  # type: ignore[call-overload]  # bytes keys of BlockHash entries
        return [None if e is None else (e[0], e[1].size) for e in entries]

    def peek(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int]], int]:
        """``(offset, size)`` of the leading ``keys`` the arena holds now, and the free stamp
        they were seen at, for a reader that copies them before it holds them (an optimistic
        read): its bytes are valid only if :meth:`freed_since` says no slot of them was freed
        since (a slot is never rewritten for another key without being freed first)."""
        get = self._map.get
        out: list[tuple[int, int]] = []
        with self._lock:
            stamp = self._alloc.frees
            for k in keys:
                e = get(k)  # type: ignore[call-overload]  # bytes keys of BlockHash entries
                if e is None:
                    break
                out.append((e[0], e[1].size))
        return out, stamp

    def freed_since(self, offsets: Iterable[int], stamp: int) -> bool:
        """Whether a slot at one of ``offsets`` was freed after :meth:`peek` gave ``stamp``."""
        with self._lock:
            return self._alloc.freed_since(offsets, stamp)

    # ---- Tier --------------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        return key in self._map

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        with self._lock:
            entry = self._map.get(key)
        if entry is None:
            raise BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}")
        off, meta = entry
        out = byte_view(dst, writable=True)
        n = meta.size
        if out.nbytes < n:
            raise BufferSizeError(f"dst has {out.nbytes} bytes; block {key.hex()} needs {n}")
        self._copy.copy(((out[:n], self._buf[off : off + n]),))
        return n

    def read_many(self, keys: Sequence[BlockHash], dsts: Sequence[memoryview]) -> list[int | KVStoreError]:
        """Batched reads: blocks that lie back to back in the arena and are due back to back in
        one caller buffer (a load's run into one destination) move as one span, and the whole
        batch is copied at once, by ``copy_threads`` threads when it is large."""
        with self._lock:
            entries = [self._map.get(k) for k in keys]
        out: list[int | KVStoreError] = []
        locs: list[tuple[int, int]] = []
        views: list[memoryview] = []
        for key, dst, entry in zip(keys, dsts, entries, strict=True):
            if entry is None:
                out.append(BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}"))
                continue
            off, meta = entry
            view, n = byte_view(dst, writable=True), meta.size
            if view.nbytes < n:
                out.append(BufferSizeError(f"dst has {view.nbytes} bytes; block {key.hex()} needs {n}"))
                continue
            out.append(n)
            locs.append((off, n))
            views.append(view)
        self._copy.copy(arena_pairs(self._buf, locs, views))
        return out

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        data = byte_view(src)
        off, fresh = self._slot(key, data, meta)
        self._copy.copy(((self._buf[off : off + data.nbytes], data),))
        self._publish(key, off, meta, fresh)

    def write_many(
        self, items: Sequence[tuple[BlockHash, Buffer, BlockMeta]], *, durable: bool = False
    ) -> list[KVStoreError | None]:
        """Batched writes: slots for every block first, then payloads that lie back to back in
        one caller buffer and land in consecutive slots (a put's run into a fresh or evenly
        emptied arena) move as one span, and the whole batch is copied at once, by
        ``copy_threads`` threads when it is large."""
        out: list[KVStoreError | None] = []
        taken: list[tuple[BlockHash, memoryview, BlockMeta, int, bool]] = []
        for key, src, meta in items:
            try:
                data = byte_view(src)
                taken.append((key, data, meta, *self._slot(key, data, meta)))
                out.append(None)
            except KVStoreError as e:
                out.append(e)
        self._copy_in(taken)
        for key, _, meta, off, fresh in taken:
            self._publish(key, off, meta, fresh)
        return out

    def _copy_in(self, taken: list[tuple[BlockHash, memoryview, BlockMeta, int, bool]]) -> None:
        """The payloads of ``taken`` into their slots, in one batch. Its own frame: the arena
        views must not outlive the copy in the caller's (an error it caught keeps that frame)."""
        locs = [(off, data.nbytes) for _, data, _, off, _ in taken]
        self._copy.copy(arena_pairs(self._buf, locs, [data for _, data, _, _, _ in taken], into_arena=True))

    def _slot(self, key: BlockHash, data: memoryview, meta: BlockMeta) -> tuple[int, bool]:
        """The offset ``key``'s payload goes to, and whether it is a fresh slot."""
        n = data.nbytes
        if n != meta.size:
            raise BufferSizeError(f"src has {n} bytes but meta.size says {meta.size}")
        slot = self._alloc.slot_bytes(n)  # UsageError when no slab can hold it
        with self._lock:
            if self._buf is None:
                raise TierIOError(f"dram tier {self.name!r} is closed")
            old = self._map.get(key)
            if old is not None and self._alloc.slot_bytes(old[1].size) == slot:
                # Rewrite in place: a full arena can still replace a block with one of its class.
                return old[0], False
            got = self._alloc.alloc(n)
            if got is None:
                raise TierFullError(
                    f"dram tier {self.name!r} has no free {slot}-byte slot for block {key.hex()}"
                )
            return got, True

    def _publish(self, key: BlockHash, off: int, meta: BlockMeta, fresh: bool) -> None:
        with self._lock:
            self._enter(key, off, meta, fresh)

    def _enter(self, key: BlockHash, off: int, meta: BlockMeta, fresh: bool) -> None:
        """``key``'s payload is at ``off`` from now on (the caller holds ``_lock``)."""
        prev = self._map.get(key)
        self._map[key] = (off, meta)
        if fresh and prev is not None:
            self._alloc.free(prev[0])

    # ---- reserved slots (KVStore.reserve) ----------------------------------------------------

    def reserve_slots(self, size: int, count: int) -> list[int]:
        """Up to ``count`` fresh slots for ``size``-byte blocks, allocated now and named by no
        key: no read finds them and no delete frees them until :meth:`publish_slots` enters
        them (or :meth:`free_slots` gives them back). Fewer when the arena runs out of slots of
        that class. The caller writes the payloads in between (into :meth:`slot_view`, or into
        its own mapping of the arena at these offsets)."""
        self._alloc.slot_bytes(size)  # UsageError when no slab can hold it
        with self._lock:
            if self._buf is None:
                raise TierIOError(f"dram tier {self.name!r} is closed")
            return self._alloc.alloc_many(size, count)

    def slot_view(self, off: int, size: int) -> memoryview:
        """A writable view of a reserved slot (drop it before the slot is published or freed)."""
        return self._buf[off : off + size]

    def publish_slots(self, entries: Mapping[BlockHash, tuple[int, BlockMeta]]) -> None:
        """Enter reserved slots ``{key: (offset, meta)}`` whose payloads are written, under one
        lock: new keys in one ``dict.update`` (a put's commit, under the store's lock)."""
        with self._lock:
            if self._buf is None:
                raise TierIOError(f"dram tier {self.name!r} is closed")
            held = self._map
            if held.keys().isdisjoint(entries):  # (the usual case: new keys)
                held.update(entries)
                return
            for key, (off, meta) in entries.items():
                self._enter(key, off, meta, True)

    def free_slots(self, offsets: Iterable[int]) -> None:
        """Give back reserved slots that were not published."""
        with self._lock:
            for off in offsets:
                self._alloc.free(off)

    def meta(self, key: BlockHash) -> BlockMeta | None:
        entry = self._map.get(key)
        return None if entry is None else entry[1]

    def delete(self, key: BlockHash) -> bool:
        return self._slots.delete(key)

    def usage(self) -> TierUsage:
        return self._slots.usage()

    def fits(self, size: int) -> bool:
        return self._slots.fits(size)

    def size_class(self, size: int) -> int:
        return self._slots.size_class(size)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """A snapshot of the blocks held now (an empty arena after every start)."""
        with self._lock:
            items = [(k, m) for k, (_, m) in self._map.items()]
        return iter(items)

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        with self._lock:
            for key, expiry in items:
                entry = self._map.get(key)
                if entry is not None:
                    self._map[key] = (entry[0], entry[1].with_expiry(expiry))

    def close(self) -> None:
        """Drop every block and unlink the arena. Idempotent."""
        with self._lock:
            self._map.clear()
            self._buf = None  # type: ignore[assignment]  # unmapped at close; nothing reads it after
        self._finalizer()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(shm_name=self._shm_name, slab_bytes=self._alloc.slab_bytes, copy_threads=self._copy.threads)
        return d
