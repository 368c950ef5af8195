"""The NVMe tier: payloads in one preallocated slab file, metadata in RocksDB.

Layout under ``tier_dir(root, name)``:

* ``data.slab``: one file preallocated to the capacity and cut into slots by a
  :class:`~tiers._slab.SlabAllocator`. Payloads move with ``O_DIRECT`` ``pwritev``/``preadv``
  straight between the file and caller memory (see :mod:`tiers._direct`).
* ``meta.rocksdb``: one record per block, ``b"B" + key -> offset (u64 LE) + BlockMeta.pack()``,
  and a geometry record (``b"\\x00geometry"``) that pins ``slab_bytes`` and the alignment, because
  a slab file cut one way cannot be read back cut another way.

Crash safety rests on ordering, not on journaling payloads: a payload is complete on disk (and,
when durable, fdatasync'ed) before its record is put, and a record is deleted before its slot is
freed. So a record always points at a complete payload, and a torn write is never referenced.
The one window left (a delete lost from an unsynced WAL while its slot was already rewritten) is
caught by the checksum that every read verifies: corrupt KV is a miss, never a wrong answer.

An in-memory index ``key -> (offset, BlockMeta)`` is loaded at open, so reads never touch
RocksDB (and never write anything).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any, cast

import numpy as np
import xxhash
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from kvstore.block import BlockMeta, payload_checksum
from kvstore.buffers import Buffer, byte_view
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    CorruptBlockError,
    KVStoreError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.keys import HASH_BYTES, BlockHash
from tiers._direct import ALIGN, DirectFile
from tiers._slab import SlabAllocator
from tiers.base import HASH, BlockColumns, OfflineScan, Tier, TierUsage, tier_dir

log = logging.getLogger(__name__)

MiB = 1024 * 1024

_GEOMETRY_KEY = b"\x00geometry"
_BLOCK_PREFIX = b"B"
_OFFSET = struct.Struct("<Q")
_RECORD_BYTES = _OFFSET.size + BlockMeta.PACKED_SIZE
# A record decoded in bulk at open: the offset, then BlockMeta.pack()'s fields (ns, parent,
# depth, size, expiry, created, checksum), as one numpy row.
_RECORD = struct.Struct("<Q" + BlockMeta.FORMAT.lstrip("<"))
_RECORD_DTYPE = np.dtype(
    [("offset", "<u8"), ("ns", HASH), ("parent", HASH), ("depth", "<u4"), ("size", "<u8"),
     ("expiry", "<f8"), ("created", "<f8"), ("checksum", "<u8")]
)


def _record_layout_matches() -> bool:
    meta = BlockMeta(bytes(range(16)), bytes(range(16, 32)), 7, 12345, 1.5, 99, 2.5)
    value = _OFFSET.pack(8192) + meta.pack()
    row = np.frombuffer(value, _RECORD_DTYPE)[0]
    return (
        _RECORD.size == len(value) == _RECORD_BYTES == _RECORD_DTYPE.itemsize
        and (int(row["offset"]), int(row["size"]), int(row["depth"])) == (8192, 12345, 7)
        and (row["ns"].tobytes(), row["parent"].tobytes()) == (meta.ns, meta.parent)
        and (float(row["expiry"]), float(row["created"]), int(row["checksum"])) == (1.5, 2.5, 99)
        and _RECORD.unpack(value) == (8192, meta.ns, meta.parent, 7, 12345, 1.5, 2.5, 99)
    )


if not _record_layout_matches():  # BlockMeta's packing changed: update _RECORD and _RECORD_DTYPE
    raise ImportError("tiers.nvme: the bulk record layout does not match BlockMeta.pack()")

_GEOMETRY_VERSION = 1


class _Records(dict):
    """The tier's index, ``key -> (offset, BlockMeta)``. The records read at open stay packed
    (their RocksDB values) until one is first asked for, then are decoded in place: a restart
    loads a million records without building a BlockMeta for each. Guarded by the tier's
    ``_lock``, like any dict it would be."""

    __slots__ = ()

    def get(self, key: bytes, default: Any = None) -> tuple[int, BlockMeta] | Any:
        entry = dict.get(self, key, default)
        if type(entry) is bytes:
            entry = _decode_record(entry)
            dict.__setitem__(self, key, entry)
        return entry

    def items(self) -> list[tuple[bytes, tuple[int, BlockMeta]]]:  # type: ignore[override]  # decoded, a list not a view
        return [(k, self.get(k)) for k in self]


def _decode_record(value: bytes) -> tuple[int, BlockMeta]:
    offset, ns, parent, depth, size, expiry, created, checksum = _RECORD.unpack(value)
    return offset, BlockMeta(ns, parent, depth, size, expiry, checksum, created)

# A read is one preadv of the whole block, like a raw O_DIRECT read: splitting a block into
# pieces (to hash one while the next is read) made read_into 0.47-0.68 of raw on a virtio disk,
# where each request waits its own latency and one large request is split and queued by the
# block layer at once. Hashing a freshly read block afterwards costs 7-11% of its read there.
_HASH_WORKERS = max(2, min(8, os.cpu_count() or 1))


# read_many: blocks whose slots lie back to back go in one preadv of at most this many bytes
# and views (IOV_MAX is 1024 on Linux): one request of many MiB is queued by the block layer
# at once, where each 1 MiB request waits its own latency.
_RUN_BYTES = 16 * MiB
_RUN_VIEWS = 256


def _streaming_checksum_matches() -> bool:
    """Whether a streaming xxh3-64 reproduces payload_checksum (if it ever changes, reads fall
    back to hashing after the read instead of returning wrong verdicts)."""
    probe = bytes(range(256)) * 1031
    h = xxhash.xxh3_64()
    h.update(probe[:1000])
    h.update(probe[1000:])
    return h.intdigest() == payload_checksum(probe)


_STREAMING_CHECKSUM = _streaming_checksum_matches()


def _is_corruption(e: BaseException) -> bool:
    """RocksDB reported damage (its status "Corruption: ...", or a file of the DB gone missing),
    as opposed to a held lock or an unwritable directory."""
    msg = str(e)
    return "Corruption" in msg or "No such file or directory" in msg


def _checksums(todo: SimpleQueue[memoryview | None]) -> list[int]:
    """payload_checksum of each buffer from ``todo`` up to None, in order; streaming, as
    ``update`` releases the GIL (it runs beside the caller's next read)."""
    out = []
    while (data := todo.get()) is not None:
        h = xxhash.xxh3_64()
        h.update(data)
        out.append(h.intdigest())
    return out


# What to do about an errno, appended to every TierIOError message.
_HINTS = {
    errno.ENOSPC: "the disk is full: free space on it or lower the tier's capacity_bytes",
    errno.EDQUOT: "the disk quota is exhausted: raise it or lower the tier's capacity_bytes",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg) and move the tier "
    "to a healthy one",
    errno.EACCES: "the directory is not writable by this process: fix its permissions or "
    "choose another store root",
    errno.EPERM: "the directory is not writable by this process: fix its permissions or "
    "choose another store root",
    errno.EROFS: "the filesystem is read-only: choose a store root on a writable disk",
    errno.ENOTDIR: "a component of the path is a file, not a directory: choose another store root",
    errno.ENOENT: "the directory vanished: check the store root",
    errno.EINVAL: "the filesystem rejected the I/O (O_DIRECT alignment?): set direct_io = false "
    "for this tier",
}


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """Options of one NVMe tier (``[[tiers]]`` with ``kind = "nvme"``)."""

    capacity_bytes: int
    """Size of the preallocated data file (rounded down to whole slabs); a size larger than the
    disk's free space is refused at start."""
    slab_bytes: int = 64 * MiB
    """The allocator's slab: the largest block it can hold. Fixed when the file is created."""
    direct_io: bool = True
    """Use ``O_DIRECT`` (falls back to buffered I/O where the filesystem refuses it)."""

    def __post_init__(self) -> None:
        for f in ("capacity_bytes", "slab_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"nvme tier: {f} must be a positive size like '64GiB', got {v!r}")
        if self.slab_bytes % ALIGN:
            raise ConfigError(
                f"nvme tier: slab_bytes ({self.slab_bytes}) must be a multiple of {ALIGN}; "
                "use e.g. '64MiB'"
            )
        if self.capacity_bytes < self.slab_bytes:
            raise ConfigError(
                f"nvme tier: capacity_bytes ({self.capacity_bytes}) is smaller than one slab "
                f"({self.slab_bytes}); raise capacity_bytes or lower slab_bytes"
            )
        if not isinstance(self.direct_io, bool):
            raise ConfigError(f"nvme tier: direct_io must be true or false, got {self.direct_io!r}")


class NvmeTier(Tier):
    """A persistent tier on a local disk. See the module docstring for the layout.

    Locking: ``_lock`` guards the allocator and the index and is held only for dictionary and
    allocator operations; payload I/O always runs outside it (the store never deletes or
    rewrites a key while a read or write of that key is in flight). ``_db_lock`` orders every
    RocksDB mutation with the matching index change, so the DB never keeps a record that the
    index dropped (e.g. an expiry update racing a delete); reads never take it. Lock order:
    ``_db_lock`` before ``_lock``.
    """

    kind = "nvme"
    persistent = True
    Config = NvmeConfig

    @classmethod
    def read_offline(cls, name: str, config: Any, root: Path, clock: Clock) -> OfflineScan:
        """The block records in RocksDB, opened read-only (:func:`read_metadata`)."""
        return OfflineScan([(k, m) for k, _, m in read_metadata(root, name)])

    @classmethod
    def holder(cls, name: str, root: Path) -> int | None:
        """Who holds RocksDB's lock (:func:`lock_holder`)."""
        return lock_holder(root, name)

    def __init__(
        self, name: str, config: NvmeConfig, *, root: Path, clock: Clock = system_clock
    ) -> None:
        super().__init__(name)
        self.config = config
        self._clock = clock  # Unused: expiry is the store's business. Kept for the convention.
        self.path = tier_dir(Path(root), name)
        self._data_path = self.path / "data.slab"
        self._db_path = self.path / "meta.rocksdb"
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()
        self._index = _Records()
        # The records read at open, as columns, until the first change: the restart's scan.
        self._opened: BlockColumns | None = None
        self._closed = False
        self._dropped_on_open = 0
        self._file: DirectFile | None = None
        self._db: Rdict | None = None
        self._hash_pool: ThreadPoolExecutor | None = None
        self._wo = WriteOptions()
        self._wo_sync = WriteOptions()
        self._wo_sync.sync = True
        self._alloc = SlabAllocator(config.capacity_bytes, config.slab_bytes, ALIGN)

        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._os_error(e, "creating the tier directory", self.path) from e
        self._quarantined = 0
        try:
            self._db = self._open_db()
            fresh = not self._data_path.exists()
            try:
                self._check_geometry()
                self._open_data_file()
                self._load(fresh)
            except Exception as e:  # rocksdict raises bare Exception
                if not _is_corruption(e):
                    raise
                # Damage RocksDB found only as it read the records: same remedy as at open.
                self._quarantine_db(e)
                self._check_geometry()
                if self._file is None:
                    self._open_data_file()
        except BaseException:
            self.close()
            raise

    # ---- open ---------------------------------------------------------------------------------

    def _open_data_file(self) -> None:
        existed = self._data_path.exists()
        old_size = 0
        try:
            self._file = DirectFile.open(str(self._data_path), direct=self.config.direct_io)
            old_size = self._file.size()
            self._check_free_space()
            self._file.resize(self._alloc.capacity_bytes)
        except (OSError, ConfigError) as e:
            # Leave no partial preallocation behind: a half-filled disk helps nobody.
            if self._file is not None:
                with contextlib.suppress(OSError):
                    if existed:
                        os.ftruncate(self._file.fd, old_size)
                    else:
                        self._data_path.unlink()
                self._file.close()
                self._file = None
            if isinstance(e, ConfigError):
                raise
            raise self._os_error(e, "preallocating the data file", self._data_path) from e

    def _check_free_space(self) -> None:
        """Refuse a capacity the filesystem cannot hold before ``posix_fallocate`` fills it."""
        assert self._file is not None
        st = os.fstat(self._file.fd)
        have = st.st_blocks * 512  # what the file holds on disk already
        need = self._alloc.capacity_bytes - min(have, self._alloc.capacity_bytes)
        vfs = os.fstatvfs(self._file.fd)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise ConfigError(
                f"nvme tier {self.name!r}: capacity_bytes asks for {_gib(self._alloc.capacity_bytes)} "
                f"in {self._data_path}, which needs {_gib(need)} more on disk, but only {_gib(free)} "
                f"is free there; lower capacity_bytes (at most {_gib(have + free)} fits, less leaves "
                "the disk's other users room) "
                "or put the tier on a disk with room"
            )

    def _open_db(self) -> Rdict:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        try:
            return Rdict(str(self._db_path), opts)
        except Exception as e:  # rocksdict raises bare Exception
            if _is_corruption(e) and not self._quarantined:
                self._quarantine_db(e)
                assert self._db is not None  # _quarantine_db opened an empty one
                return self._db
            msg = str(e)
            if "No space left" in msg:
                # A full disk: RocksDB cannot write its open-time files, but reading needs none.
                # Serve what the tier holds; its writes fail (TierIOError) until there is room.
                log.error("nvme tier %r: %s; opened its metadata DB read-only (reads work, writes "
                          "fail until the disk has room)", self.name, msg)
                try:
                    return Rdict(str(self._db_path), Options(raw_mode=True), access_type=AccessType.read_only(False))
                except Exception:  # rocksdict raises bare Exception; report the first error
                    pass
            if "/LOCK" in msg or "lock hold" in msg:  # not "lock": "block checksum" has one too
                hint = (
                    "another process, or another open tier object in this one, holds this tier: "
                    "close it first or give this tier another name or root"
                )
            else:
                hint = "check that the directory is writable and the disk is healthy"
            raise TierIOError(
                f"nvme tier {self.name!r}: cannot open its metadata DB {self._db_path}: "
                f"{msg}; {hint}"
            ) from e

    def _quarantine_db(self, error: Exception) -> None:
        """Move a metadata DB that RocksDB reports corrupt aside (``meta.rocksdb.corrupt-*``,
        for an operator to look at) and start an empty one. Its records are cache entries: the
        tier loses its blocks (their slots become free), never correctness, and a damaged DB
        must not keep the store, and so the daemon, from starting."""
        if self._db is not None:
            with contextlib.suppress(Exception):  # rocksdict raises bare Exception
                self._db.close()
            self._db = None
        stamp = int(self._clock())
        dest = self._db_path.with_name(f"meta.rocksdb.corrupt-{stamp}")
        while dest.exists():
            stamp += 1
            dest = self._db_path.with_name(f"meta.rocksdb.corrupt-{stamp}")
        try:
            os.rename(self._db_path, dest)
        except OSError as e:
            raise self._os_error(e, "quarantining the corrupt metadata DB", self._db_path) from e
        log.error(
            "nvme tier %r: metadata DB %s is corrupt (%s); moved to %s, the tier starts empty",
            self.name, self._db_path, error, dest,
        )
        self._quarantined += 1
        self._index.clear()
        self._opened = None
        self._alloc = SlabAllocator(self.config.capacity_bytes, self.config.slab_bytes, ALIGN)
        self._db = self._open_db()

    def _check_geometry(self) -> None:
        assert self._db is not None
        want = {"version": _GEOMETRY_VERSION, "slab_bytes": self.config.slab_bytes, "align": ALIGN}
        raw = self._db.get(_GEOMETRY_KEY)
        if raw is None:
            self._db_call(
                lambda db: db.put(_GEOMETRY_KEY, json.dumps(want).encode(), self._wo_sync)
            )
            return
        try:
            have = json.loads(raw)
        except ValueError as e:
            raise ConfigError(
                f"nvme tier {self.name!r}: the geometry record in {self._db_path} is unreadable; "
                f"delete {self.path} to start an empty tier"
            ) from e
        if have.get("slab_bytes") != want["slab_bytes"] or have.get("align") != ALIGN:
            raise ConfigError(
                f"nvme tier {self.name!r} at {self.path} was created with "
                f"slab_bytes={have.get('slab_bytes')} (align {have.get('align')}), but the config "
                f"says slab_bytes={self.config.slab_bytes}; set slab_bytes = "
                f"{have.get('slab_bytes')} for this tier, or delete {self.path} to start an "
                "empty tier with the new geometry"
            )

    def _load(self, fresh_file: bool) -> None:
        """Rebuild the index and the allocator's occupancy from the DB.

        Records that cannot be honoured are dropped from the DB: a data file created just now
        (the old one is gone), a malformed value, a slot outside a shrunk capacity or a slot
        claimed twice. They are cache entries, so dropping is always safe.
        """
        assert self._db is not None
        bad: list[bytes] = []
        keys: list[bytes] = []
        values: list[bytes] = []
        # raw_mode=True (_open_db): keys and values are bytes.
        for k, v in cast("Iterator[tuple[bytes, bytes]]", self._db.items(from_key=_BLOCK_PREFIX)):
            if not k.startswith(_BLOCK_PREFIX):
                break
            if fresh_file or len(k) != 1 + HASH_BYTES or len(v) != _RECORD_BYTES:
                bad.append(k)
            else:
                keys.append(k)
                values.append(v)
        if keys:
            # Decoded and claimed in bulk (a restart reads every record): the outcome of one
            # BlockMeta.unpack + slot check + claim per record, in key order.
            buf = b"".join(values)
            records = np.frombuffer(buf, _RECORD_DTYPE)
            offsets, sizes = records["offset"], records["size"]
            alloc = self._alloc
            slot = alloc.slot_bytes_many(sizes)
            ok = slot > 0
            ok[ok] = offsets[ok] % np.uint64(alloc.slab_bytes) % slot[ok].astype(np.uint64) == 0
            ok[ok] = alloc.claim_many(offsets[ok], sizes[ok])
            good = ok.tolist()
            kept = [k[1:] for k, g in zip(keys, good, strict=True) if g]
            bad += [k for k, g in zip(keys, good, strict=True) if not g]
            self._index.update(zip(kept, itertools.compress(values, good), strict=True))
            rows = records[ok]
            self._opened = BlockColumns(
                np.frombuffer(b"".join(kept), HASH), rows["ns"], rows["parent"],
                rows["depth"].astype(np.int64), rows["size"].astype(np.int64),
                rows["expiry"].copy(), rows["created"].copy(), rows["checksum"].copy(),
            )
        if bad:
            wb = WriteBatch(raw_mode=True)
            for k in bad:
                wb.delete(k)
            self._db_call(lambda db: db.write(wb, self._wo_sync))
            self._dropped_on_open = len(bad)

    # ---- the Tier protocol ----------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._index

    def meta(self, key: BlockHash) -> BlockMeta | None:
        with self._lock:
            entry = self._index.get(key)
        return entry[1] if entry else None

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        """Copy the payload into ``dst`` and verify its checksum; returns ``meta.size``.

        Raises BlockNotFound, BufferSizeError (``dst`` smaller than the block),
        CorruptBlockError (checksum mismatch) or TierIOError.
        """
        offset, meta, out, file = self._locate(key, dst)
        try:
            file.read_into(out, meta.size, offset)
        except OSError as e:
            raise self._os_error(e, f"reading block {key.hex()} from", self._data_path) from e
        self._verify(key, offset, meta, payload_checksum(out[: meta.size]))
        return meta.size

    def read_many(self, keys: Sequence[BlockHash], dsts: Sequence[memoryview]) -> list[int | KVStoreError]:
        """Batched reads (a run of a load): blocks whose slots lie back to back in the file go
        in one ``preadv`` into their buffers (up to :data:`_RUN_BYTES`), the others one read
        each, straight into the caller's buffer; checksums are computed by one pool thread
        while the next read runs, so that only the last read's hashes are on the critical path
        (a single block reads as :meth:`read_into` does). One job per call, fed through a
        queue: a pool task per block cost ~150 us of CPU per block in futures and wake-ups,
        which a loaded box pays in time. A read that fails is retried block by block, so a
        device error lands on its own block only."""
        if len(keys) < 2 or not _STREAMING_CHECKSUM:
            return super().read_many(keys, dsts)
        pool = self._pool()
        out: list[int | KVStoreError] = [0] * len(keys)
        read: list[tuple[int, int, BlockMeta]] = []
        todo: SimpleQueue[memoryview | None] = SimpleQueue()
        try:
            job = pool.submit(_checksums, todo)
        except RuntimeError as e:  # the pool was shut down by a concurrent close()
            raise TierIOError(f"nvme tier {self.name!r} is closed") from e

        def flush(run: list[tuple[int, int, BlockMeta, memoryview]], file: DirectFile) -> None:
            if len(run) > 1:
                try:
                    file.read_run([view for *_, view in run], run[0][1])
                except OSError:
                    pass  # read block by block below: the error lands on its own block
                else:
                    for i, offset, meta, view in run:
                        todo.put(view)
                        read.append((i, offset, meta))
                    return
            for i, offset, meta, view in run:
                try:
                    file.read_into(view, meta.size, offset)
                except OSError as e:
                    out[i] = self._os_error(e, f"reading block {keys[i].hex()} from", self._data_path)
                    continue
                todo.put(view)
                read.append((i, offset, meta))

        try:
            run: list[tuple[int, int, BlockMeta, memoryview]] = []
            file: DirectFile | None = None
            end = run_bytes = 0
            for i, (key, dst) in enumerate(zip(keys, dsts, strict=True)):
                try:
                    offset, meta, view, file = self._locate(key, dst)
                except KVStoreError as e:
                    out[i] = e
                    continue
                view = view[: meta.size]
                joins = file.can_run(view, meta.size)
                if run and not (joins and offset == end and run_bytes + meta.size <= _RUN_BYTES and len(run) < _RUN_VIEWS):
                    flush(run, file)
                    run, run_bytes = [], 0
                run.append((i, offset, meta, view))
                end, run_bytes = offset + meta.size, run_bytes + meta.size
                if not joins:  # through the bounce buffer, on its own
                    flush(run, file)
                    run, run_bytes = [], 0
            if run:
                assert file is not None
                flush(run, file)
        finally:
            # The end marker always goes, so the job always ends; no thread may still be
            # reading a caller's buffer once this returns or raises.
            todo.put(None)
            wait([job])
        for (i, offset, meta), checksum in zip(read, job.result(), strict=True):
            try:
                self._verify(keys[i], offset, meta, checksum)
                out[i] = meta.size
            except CorruptBlockError as e:
                out[i] = e
        return out

    def _locate(self, key: BlockHash, dst: memoryview) -> tuple[int, BlockMeta, memoryview, DirectFile]:
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
        if entry is None:
            raise BlockNotFound(f"nvme tier {self.name!r} does not hold block {key.hex()}")
        offset, meta = entry
        out = byte_view(dst, writable=True)
        if out.nbytes < meta.size:
            raise BufferSizeError(
                f"block {key.hex()} has {meta.size} bytes but the destination buffer has "
                f"{out.nbytes}; pass a buffer of at least {meta.size} bytes"
            )
        file = self._file
        assert file is not None
        return offset, meta, out, file

    def _verify(self, key: BlockHash, offset: int, meta: BlockMeta, checksum: int) -> None:
        if checksum != meta.checksum:
            raise CorruptBlockError(
                f"nvme tier {self.name!r}: block {key.hex()} at offset {offset} of "
                f"{self._data_path} fails its checksum"
            )

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        """Store ``src`` under ``key``; ``meta.checksum`` is trusted (the store computed it).

        Payload first (fdatasync'ed when ``durable``), then the record (a synced WAL write when
        ``durable``), then the replaced block's slot, if any, is freed. On TierFullError or
        TierIOError nothing of the new block is left behind.
        """
        if len(key) != HASH_BYTES:
            raise UsageError(f"a block key is {HASH_BYTES} bytes, got {len(key)}")
        view = byte_view(src)
        size = view.nbytes
        if size != meta.size:
            raise BufferSizeError(
                f"block {key.hex()}: the source buffer has {size} bytes but meta.size is "
                f"{meta.size}; they must agree"
            )
        offset = self._reserve(key, size)
        file = self._file
        assert file is not None
        try:
            file.write_at(view, offset)
            if durable:
                file.datasync()
        except OSError as e:
            self._release(offset)
            raise self._os_error(e, f"writing block {key.hex()} to", self._data_path) from e
        record = _OFFSET.pack(offset) + meta.pack()
        with self._db_lock:
            try:
                self._db_call(
                    lambda db: db.put(
                        _BLOCK_PREFIX + key, record, self._wo_sync if durable else self._wo
                    )
                )
            except BaseException:
                self._release(offset)
                raise
            with self._lock:
                self._opened = None
                old = self._index.get(key)
                self._index[key] = (offset, meta)
                if old is not None:
                    self._alloc.free(old[0])

    def delete(self, key: BlockHash) -> bool:
        """Drop ``key``: the record goes first, then the slot is freed (crash-safe order).

        The delete is not synced: if a crash loses it, the record reappears; should its slot have
        been rewritten meanwhile, the checksum catches it on read.
        """
        with self._db_lock:
            with self._lock:
                self._check_open()
                entry = self._index.get(key)
            if entry is None:
                return False
            self._db_call(lambda db: db.delete(_BLOCK_PREFIX + key, self._wo))
            with self._lock:
                self._opened = None
                del self._index[key]
                self._alloc.free(entry[0])
        return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._alloc.used_bytes, self._alloc.capacity_bytes, len(self._index))

    def fits(self, size: int) -> bool:
        with self._lock:
            return self._alloc.fits(size)

    def size_class(self, size: int) -> int:
        return self._alloc.slot_bytes(size)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """A snapshot of every block and its metadata, taken at the first ``next()``."""
        for cols in self.scan_columns():
            yield from cols.items()

    def scan_columns(self) -> Iterator[BlockColumns]:
        """A snapshot of every block and its metadata: the records read at open, in key order
        (decoded once, as columns) while nothing has changed since, else the index's (in the
        order its keys came)."""
        with self._lock:
            cols = self._opened
            if cols is None:
                cols = BlockColumns.from_items((k, m) for k, (_, m) in self._index.items())
        return iter([cols] if len(cols) else [])

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        """Rewrite the records of present keys with new expiry times, in one unsynced batch.

        Unknown keys are skipped. Losing the batch in a crash only shortens a block's life.
        """
        with self._db_lock:
            with self._lock:
                self._check_open()
                updates: dict[BlockHash, tuple[int, BlockMeta]] = {}
                for key, expiry in items:
                    entry = self._index.get(key)
                    if entry is not None:
                        updates[key] = (entry[0], entry[1].with_expiry(expiry))
            if not updates:
                return
            wb = WriteBatch(raw_mode=True)
            for key, (offset, meta) in updates.items():
                wb.put(_BLOCK_PREFIX + key, _OFFSET.pack(offset) + meta.pack())
            self._db_call(lambda db: db.write(wb, self._wo))
            with self._lock:
                self._opened = None
                self._index.update(updates)

    def flush(self) -> None:
        """fdatasync the data file, then sync the RocksDB WAL: every completed write survives."""
        with self._lock:
            self._check_open()
        assert self._file is not None
        try:
            self._file.datasync()
        except OSError as e:
            raise self._os_error(e, "syncing", self._data_path) from e
        self._db_call(lambda db: db.flush_wal(True))

    def close(self) -> None:
        """Close the data file and the DB. Idempotent; any later call raises TierIOError."""
        with self._db_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            file, self._file = self._file, None
            db, self._db = self._db, None
            self._index.clear()
            self._opened = None
            pool, self._hash_pool = self._hash_pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        try:
            if file is not None:
                file.close()
            if db is not None:
                db.close()
        except Exception as e:  # OSError, or rocksdict's bare Exception
            raise TierIOError(f"nvme tier {self.name!r}: closing {self.path} failed: {e}") from e

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        file = self._file
        d.update(
            path=str(self.path),
            slab_bytes=self.config.slab_bytes,
            direct_io=bool(file and file.direct),
            direct_io_fallback=file.fallback_reason if file else "",
            dropped_on_open=self._dropped_on_open,
            quarantined=self._quarantined,
        )
        return d

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(
                    max_workers=_HASH_WORKERS, thread_name_prefix=f"nvme-{self.name}-hash"
                )
            return self._hash_pool

    def _reserve(self, key: BlockHash, size: int) -> int:
        with self._lock:
            self._check_open()
            offset = self._alloc.alloc(size)
            replacing = offset is None and key in self._index
        if replacing:
            # Full, but the key being replaced holds a slot: give it up first. The old payload is
            # about to be superseded anyway, and otherwise a rewrite could never succeed.
            self.delete(key)
            with self._lock:
                offset = self._alloc.alloc(size)
        if offset is None:
            raise TierFullError(
                f"nvme tier {self.name!r} has no free {self._alloc.slot_bytes(size)}-byte slot "
                f"({self._alloc.used_bytes} of {self._alloc.capacity_bytes} bytes used); evict "
                "blocks of this size class or raise capacity_bytes"
            )
        return offset

    def _release(self, offset: int) -> None:
        with self._lock:
            if not self._closed:
                self._alloc.free(offset)

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError(f"nvme tier {self.name!r} is closed")

    def _db_call(self, fn: Any) -> Any:
        """Run ``fn(db)``, turning rocksdict's bare exceptions into TierIOError."""
        db = self._db
        if db is None:
            raise TierIOError(f"nvme tier {self.name!r} is closed")
        try:
            return fn(db)
        except Exception as e:
            raise TierIOError(
                f"nvme tier {self.name!r}: metadata DB {self._db_path} failed: {e}; check free "
                "space and the disk's health"
            ) from e

    def _os_error(self, e: OSError, doing: str, path: Path) -> TierIOError:
        hint = _HINTS.get(e.errno or 0, "check the disk and the kernel log (dmesg)")
        err = TierIOError(
            f"nvme tier {self.name!r}: {doing} {path} failed: {e.strerror or e}; {hint}"
        )
        err.errno = e.errno
        return err


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


# ---- offline inspection (kvctl --dir) ---------------------------------------------------------------


def read_metadata(root: Path, name: str) -> list[tuple[BlockHash, int, BlockMeta]]:
    """``(key, offset, meta)`` of every block record of NVMe tier ``name`` under store ``root``,
    read without modifying anything there (another process may hold the tier open).

    RocksDB's read-only mode takes no lock, but rocksdict rewrites its own config file on every
    open; so the DB is opened through a private directory of symbolic links to its files (no
    copy, and nothing under ``root`` is written). A live writer may compact files away while
    they are read: that open fails, and a retry sees the new set.
    """
    import shutil
    import tempfile

    from rocksdict import AccessType

    # Absolute: the links in the private directory must not be relative to where we stand.
    db = tier_dir(Path(root).resolve(), name) / "meta.rocksdb"
    if not (db / "CURRENT").exists():
        return []
    last: Exception | None = None
    for _ in range(3):
        view = Path(tempfile.mkdtemp(prefix="kvstore-nvme-ro-"))
        try:
            for f in os.listdir(db):
                if f not in ("LOCK", "rocksdict-config.json") and not f.startswith("LOG"):
                    os.symlink(db / f, view / f)
            rdb = Rdict(str(view), Options(raw_mode=True), access_type=AccessType.read_only(False))
            try:
                out: list[tuple[BlockHash, int, BlockMeta]] = []
                # raw_mode=True: keys and values are bytes.
                for k, v in cast("Iterator[tuple[bytes, bytes]]", rdb.items(from_key=_BLOCK_PREFIX)):
                    if not k.startswith(_BLOCK_PREFIX):
                        break
                    if len(k) == 1 + HASH_BYTES and len(v) == _RECORD_BYTES:
                        with contextlib.suppress(KVStoreError, ValueError):
                            out.append((BlockHash(bytes(k[1:])), _OFFSET.unpack_from(v)[0],
                                        BlockMeta.unpack(v[_OFFSET.size :])))
                return out
            finally:
                rdb.close()
        except Exception as e:  # rocksdict raises bare Exception (a file compacted away)
            last = e
        finally:
            shutil.rmtree(view, ignore_errors=True)
    raise TierIOError(f"nvme tier {name!r}: cannot read {db} read-only: {last}")


def lock_holder(root: Path, name: str) -> int | None:
    """The pid of another process that holds NVMe tier ``name`` under ``root`` open (RocksDB's
    lock), or None. Asks the kernel (F_GETLK): takes no lock itself."""
    import fcntl

    lock = tier_dir(Path(root), name) / "meta.rocksdb" / "LOCK"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, flock))
    except OSError:
        return None
    finally:
        os.close(fd)
    return pid if l_type != fcntl.F_UNLCK and pid != os.getpid() else None
