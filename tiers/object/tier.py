"""ObjectTier: the Tier surface over an fsspec filesystem (see the package docstring)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from kvstore.block import BlockMeta
from kvstore.buffers import Buffer, byte_view
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    CorruptBlockError,
    KVStoreError,
    TierFullError,
    TierIOError,
    TierUnavailableError,
    UsageError,
)
from kvstore.keys import HASH_BYTES, BlockHash
from tiers.base import HASH, BlockColumns, OfflineScan, Tier, TierUsage, hash_groups, tier_dir
from tiers.object import manifest
from tiers.object.blobs import Blob, BlobStore, open_blobs
from tiers.object.config import ObjectConfig
from tiers.object.expiry import Expiry
from tiers.object.format import (
    FORMAT_VERSION,
    HEADER_FIELDS,
    MAGIC,
    MAX_DESCRIPTOR,
    RAW,
    SUFFIX,
    TOUCH_SUFFIX,
    ForeignObjectError,
    Header,
    descriptor_fields,
    encode,
    key_of,
    keys_of,
    pack_header,
    unpack_header,
    unpack_headers,
)

log = logging.getLogger(__name__)

_RECENT = 4096  # headers kept after a read or write (see ObjectTier._recent)
# What the listing found of each object (ObjectTier._scan_headers).
_OK, _GONE, _FOREIGN, _CORRUPT, _ERROR = range(5)
_STAT = np.dtype([("size", "<u8"), ("mtime", "<i8"), ("ctime", "<i8"), ("ino", "<u8")])  # manifest.Stat
_NO_STAT = (0, 0, 0, 0)
_STALE_TEMP_S = 3600.0  # a temp file this old on a shared directory is left over from a crash


@dataclass(slots=True)
class _Counters:
    bad_headers: int = 0
    foreign_objects: int = 0
    expired_deleted: int = 0
    sweeps: int = 0
    sweep_examined: int = 0
    touches_written: int = 0
    touches_dropped: int = 0
    compressed_writes: int = 0
    probed_blocks: int = 0
    quarantined: int = 0


class ObjectTier(Tier):
    """Blocks as immutable objects on an fsspec filesystem.

    The filesystem is the truth: ``read_into`` and ``meta`` fetch the object whether or not this
    process wrote it (another node may have). The in-memory maps (``key -> payload size`` and the
    effective expiry) answer ``contains`` and ``usage`` without a request; they hold what this
    tier wrote, scanned or probed, and are what ``capacity_bytes`` is enforced against. The
    bytes move through :attr:`blobs`, the local or remote backend (``blobs.py``).

    Thread safety: ``_lock`` guards the maps and counters; requests run outside it.
    """

    kind = "object"
    persistent = True
    Config = ObjectConfig

    def __init__(
        self, name: str, config: ObjectConfig, *, root: Path, clock: Clock = system_clock
    ) -> None:
        super().__init__(name)
        self.config = config
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()  # queued writes to send: the worker runs at once
        url = config.url or f"file://{tier_dir(Path(root), name).absolute().as_posix()}/objects"
        wake = self._wake.set if config.worker_interval_s > 0 else None
        self.blobs: BlobStore
        self.blobs, self._base = open_blobs(name, url, config, clock, wake=wake)
        self.url = url
        self._local = self.blobs.local
        self.shared = bool(config.url) and config.discover_max_blocks > 0
        self._blocks = f"{self._base}/blocks"
        self._manifest_path = f"{self._base}/{manifest.NAME}"
        self._touches = f"{self._base}/touch"
        self._lock = threading.Lock()
        self._sizes: dict[BlockHash, int] = {}
        self._expiry: dict[BlockHash, float] = {}  # effective expiry (header or touch)
        self._touched: set[BlockHash] = set()  # keys with a touch object we know of
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, so that concurrent writes respect capacity
        self._descriptors: dict[bytes, bytes] = {}  # registered by the store: written into headers
        self._seen: dict[bytes, bytes] = {}  # found in headers by scan or probe
        self._compress: dict[bytes, int] = {}  # namespace digest -> item size to shuffle by
        # Headers of blocks just read, written or probed: the store asks for a block's meta
        # right after reading it (to promote it), and a header GET per block would double the
        # requests of a load. Content addressing makes a cached header safe to reuse.
        self._recent: OrderedDict[BlockHash, BlockMeta] = OrderedDict()
        self._counters = _Counters()
        self._closed = False
        self._sweeper = Expiry(
            name=name, config=config, clock=clock, blobs=self.blobs, blocks_dir=self._blocks,
            lock=self._lock, sizes=self._sizes, expiry=self._expiry, touched=self._touched,
            counters=self._counters, path=self.path, touch_path=self.touch_path, forget=self._forget,
        )
        self._next_sweep = clock() + config.sweep_interval_s
        # The store is listed once, on first use: the maps need it, and a store opening this
        # tier scans it at once (cold rebuild), so that scan is the listing.
        self._listed = False
        self._list_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        if config.worker_interval_s > 0 and (not self._local or self.shared):
            self._worker = threading.Thread(
                target=self._work, name=f"kvstore-object-{name}", daemon=True
            )
            self._worker.start()

    @classmethod
    def read_offline(cls, name: str, config: ObjectConfig, root: Path, clock: Clock) -> OfflineScan:
        """List the objects and read their headers with the background work switched off (no
        worker, no sweeper, which deletes expired objects, no bucket lifecycle rule): listing
        and reading headers is all the tier does here."""
        url = config.url or f"file://{tier_dir(Path(root), name).absolute().as_posix()}/objects"
        if url.startswith("file://") and not Path(url[len("file://") :], "blocks").is_dir():
            return OfflineScan([])  # never written to; opening it would create its directory
        quiet = dataclasses.replace(config, worker_interval_s=0, sweep_interval_s=0, lifecycle_days=0, manifest=False)
        tier = cls(name, quiet, root=Path(root), clock=clock)
        try:
            found = list(tier.scan())
            d = tier.describe()
            extra = {"url": url, "descriptors": tier.namespaces(), "bad_headers": d["bad_headers"],
                     "foreign_objects": d["foreign_objects"]}
            return OfflineScan(found, extra)
        finally:
            tier.close()

    # ---- object-store surface ----------------------------------------------------------------

    def path(self, key: BlockHash) -> str:
        """Where ``key``'s object lives, on this tier's filesystem."""
        h = key.hex()
        return f"{self._blocks}/{h[:2]}/{h}{SUFFIX}"

    def touch_path(self, key: BlockHash) -> str:
        h = key.hex()
        return f"{self._touches}/{h[:2]}/{h}{TOUCH_SUFFIX}"

    def register_namespace(self, digest: bytes, descriptor: bytes) -> None:
        """Embed ``descriptor`` (a namespace's canonical bytes) in the header of every block of
        namespace ``digest`` written from now on, so a cold reader can tell what the block
        holds; and compress its blocks if ``compress_namespaces`` names it."""
        if len(digest) != HASH_BYTES:
            raise UsageError(f"a namespace digest has {HASH_BYTES} bytes, got {len(digest)}")
        if len(descriptor) > MAX_DESCRIPTOR:
            raise UsageError(f"a namespace descriptor holds at most {MAX_DESCRIPTOR} bytes")
        model_id, itemsize = descriptor_fields(descriptor)
        wanted = self.config.compress_namespaces
        with self._lock:
            self._descriptors[bytes(digest)] = bytes(descriptor)
            if "*" in wanted or digest.hex() in wanted or (model_id and model_id in wanted):
                self._compress[bytes(digest)] = itemsize
            else:
                self._compress.pop(bytes(digest), None)

    def namespaces(self) -> dict[bytes, bytes]:
        """``{digest: descriptor}`` found in headers by scan or probe, plus those registered."""
        self._ensure_listed()
        with self._lock:
            return {**self._seen, **self._descriptors}

    def available(self) -> bool:
        return self.blobs.available()

    # ---- reads -------------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        """Whether this tier wrote, scanned or probed ``key`` (no request after the first
        listing)."""
        self._ensure_listed()
        return key in self._sizes

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        """Copy the verified payload into ``dst``. On an error ``dst``'s bytes are unspecified."""
        (r,) = self.read_many([key], [dst])
        if isinstance(r, KVStoreError):
            raise r
        return r

    def read_many(
        self, keys: Sequence[BlockHash], dsts: Sequence[memoryview]
    ) -> list[int | KVStoreError]:
        """Batched reads: one concurrent batch of GETs on a remote store."""
        if len(keys) != len(dsts):
            raise UsageError(f"{len(keys)} keys but {len(dsts)} destination buffers")
        out: list[int | KVStoreError] = [0] * len(keys)
        items: list[tuple[BlockHash, str, memoryview]] = []
        pending: list[int] = []
        for i, (key, dst) in enumerate(zip(keys, dsts, strict=True)):
            try:
                self._check_open()
                items.append((key, self.path(key), byte_view(dst, writable=True)))
            except KVStoreError as e:
                out[i] = e
                continue
            pending.append(i)
        for i, (key, _, _), r in zip(pending, items, self.blobs.read_into(items), strict=True):
            if isinstance(r, KVStoreError):
                out[i] = r
                continue
            if not self._local:
                self._remember(key, r)
            out[i] = r.size
        return out

    def _remember(self, key: BlockHash, meta: BlockMeta) -> None:
        with self._lock:
            self._recent[key] = meta
            self._recent.move_to_end(key)
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    def meta(self, key: BlockHash) -> BlockMeta | None:
        """The header's metadata (with a later refreshed expiry, if this tier knows one), read
        from the store; None when there is no such object. CorruptBlockError when the header is
        damaged, TierUnavailableError while the store is unreachable."""
        queued = self.blobs.queued(key)
        with self._lock:
            recent = self._recent.get(key)
        if queued is not None:
            meta = unpack_header(queued.data, key, queued.path).meta
        elif recent is not None:
            meta = recent
        else:
            (h,) = self._headers([key])
            if isinstance(h, BlockNotFound):
                return None
            if isinstance(h, KVStoreError):
                raise h
            meta = h.meta
        with self._lock:
            known = self._expiry.get(key, 0.0)
        return meta.with_expiry(known) if known > meta.expiry else meta

    def _headers(self, keys: Sequence[BlockHash]) -> list[Header | KVStoreError]:
        """The headers of ``keys``' objects: ranged reads, one concurrent batch when remote."""
        return self.blobs.headers([(k, self.path(k)) for k in keys])

    # ---- writes ------------------------------------------------------------------------------

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        """Publish the object atomically (temp name + rename locally, one PUT elsewhere).

        Remote: a non-durable write is queued and sent in the background (``write_behind``,
        readable at once). Unreachable: a durable write raises TierUnavailableError; another is
        queued or, past ``write_queue_bytes``, dropped with TierUnavailableError."""
        (err,) = self.write_many([(key, src, meta)], durable=durable)
        if err is not None:
            raise err

    def write_many(
        self, items: Sequence[tuple[BlockHash, Buffer, BlockMeta]], *, durable: bool = False
    ) -> list[KVStoreError | None]:
        """Batched writes (one concurrent batch of PUTs when remote); each result is None or
        that block's error, as :meth:`write` would raise it."""
        out: list[KVStoreError | None] = [None] * len(items)
        staged: list[tuple[int, Blob, BlockMeta, int]] = []
        try:
            for i, (key, src, meta) in enumerate(items):
                try:
                    blob = Blob(key, self.path(key), self._encode(key, src, meta), meta.size)
                    grow = self._reserve(key, meta)
                except KVStoreError as e:
                    out[i] = e
                    continue
                staged.append((i, blob, meta, grow))
            if staged:
                results = self.blobs.write([s[1] for s in staged], durable=durable)
                for (i, _, _, _), err in zip(staged, results, strict=True):
                    out[i] = err
        finally:
            with self._lock:
                self._reserved -= sum(s[3] for s in staged)
        for i, blob, meta, _ in staged:
            if out[i] is None:
                self._commit(blob.key, meta)
        return out

    def _encode(self, key: BlockHash, src: Buffer, meta: BlockMeta) -> bytes:
        """The whole object: header, then the payload (compressed if its namespace asks)."""
        data = byte_view(src)
        if data.nbytes != meta.size:
            raise BufferSizeError(f"src has {data.nbytes} bytes but meta.size says {meta.size}")
        if len(key) != HASH_BYTES:
            raise UsageError(f"a block hash has {HASH_BYTES} bytes, got {len(key)}")
        with self._lock:
            descriptor = self._descriptors.get(meta.ns, b"")
            itemsize = self._compress.get(meta.ns)
        stored: bytes | memoryview
        codec, stored = RAW, data
        if itemsize is not None:
            codec, stored = encode(data, itemsize, self.config.compress_level)
            if codec != RAW:
                with self._lock:
                    self._counters.compressed_writes += 1
        header = pack_header(
            key, meta, descriptor, codec=codec, itemsize=itemsize or 0, stored=len(stored)
        )
        # One copy into a single buffer: a PUT body must be one bytes-like object.
        return b"".join((header, stored))

    def _reserve(self, key: BlockHash, meta: BlockMeta) -> int:
        self._ensure_listed()
        with self._lock:
            self._check_open()
            grow = max(0, meta.size - self._sizes.get(key, 0))
            if self._used + self._reserved + grow > self.config.capacity_bytes:
                raise TierFullError(
                    f"object tier {self.name!r}: {meta.size} more bytes exceed its capacity of "
                    f"{self.config.capacity_bytes} ({self._used} used)"
                )
            self._reserved += grow
            return grow

    def _commit(self, key: BlockHash, meta: BlockMeta) -> None:
        self._remember(key, meta)
        with self._lock:
            self._used += meta.size - self._sizes.get(key, 0)
            self._sizes[key] = meta.size
            self._expiry[key] = meta.expiry

    def drain(self) -> int:
        """Send writes queued during an outage; returns how many reached the store."""
        return self.blobs.drain()

    # ---- deletes -------------------------------------------------------------------------------

    def delete(self, key: BlockHash) -> bool:
        self._check_open()
        self._ensure_listed()
        with self._lock:
            known = key in self._sizes
            touched = key in self._touched
        paths = [self.path(key), self.touch_path(key)] if touched else [self.path(key)]
        existed = self.blobs.delete_block(key, paths, known=known)
        self._forget([key])
        return existed

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        """Refreshed expiry times as touch objects (:meth:`Expiry.update_expiry`)."""
        self._ensure_listed()
        self._sweeper.update_expiry(items)

    def sweep(self, limit: int | None = None) -> int:
        """Delete objects whose expiry has passed (:meth:`Expiry.sweep`); returns how many."""
        self._check_open()
        self._ensure_listed()
        return self._sweeper.sweep(limit)

    def _forget(self, keys: Iterable[BlockHash]) -> None:
        with self._lock:
            for key in keys:
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._used -= size
                self._expiry.pop(key, None)
                self._recent.pop(key, None)
                self._touched.discard(key)

    def usage(self) -> TierUsage:
        """``used_bytes``: payload bytes of the blocks in the map (headers not counted)."""
        self._ensure_listed()
        with self._lock:
            return TierUsage(self._used, self.config.capacity_bytes, len(self._sizes))

    # ---- listing: cold rebuild and discovery ---------------------------------------------------

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """Every block in the store with its metadata (expiry: header or later touch), one
        pair a block (:meth:`scan_columns`)."""
        for cols in self.scan_columns():
            yield from cols.items()

    def scan_columns(self) -> Iterator[BlockColumns]:
        """Every block in the store with its metadata (expiry: header or later touch), as
        columns, in name (hash) order.

        Lists ``blocks/`` and reads every header: from the manifest of the last clean close
        where it records the very object listed (decoded with numpy, no object per block),
        the others in concurrent batches of ranged GETs. Objects with a bad header, a bad name
        or a size that disagrees with the header are skipped and counted
        (``describe()["bad_headers"]``); objects of another format version are skipped and
        counted apart (``foreign_objects``). What is found is added to the in-memory maps.
        """
        first = self._ensure_listed()
        cols = first if first is not None else self._scan_now()
        return iter([cols] if len(cols) else [])

    def _ensure_listed(self) -> BlockColumns | None:
        """List the store once, on first use; returns the listing to the call that made it."""
        if self._listed:
            return None
        with self._list_lock:
            if self._listed:
                return None
            try:
                return self._scan_now()
            except TierUnavailableError as e:
                log.warning("object tier %r starts empty: %s; probes find its blocks", self.name, e)
                return BlockColumns.empty()
            finally:
                self._listed = True

    def _scan_now(self) -> BlockColumns:
        self._check_open()
        # A local tier lists with what tells an object from the one its manifest recorded
        # (written at the last close): those headers come from the manifest, not the files.
        book = manifest.load(self._manifest_path) if self._local else None
        stats = self.blobs.stats(self._blocks, book.vouches if book is not None else None)
        listed: dict[str, Any] = self._list(self._blocks) if stats is None else stats
        if book is not None and self.config.manifest:
            manifest.retire(self._manifest_path)  # this run's close writes the next one
        debris: list[str] = []  # damaged objects and temp files of writes cut short
        objects: list[str] = []
        for path in sorted(listed):
            if path.endswith(SUFFIX):
                objects.append(path)
            elif self._stale_temp(path):  # a temp file of a write in flight, or one cut short
                debris.append(path)
        keys: list[BlockHash] = []
        paths: list[str] = []
        bad = foreign = 0
        for path, key in zip(objects, keys_of(objects), strict=True):
            if key is None:
                bad += 1
                debris.append(path)
            else:
                keys.append(key)
                paths.append(path)
        n = len(keys)
        # -1: listed unstatted, its directory vouching for it (the manifest gives its size)
        sizes = np.fromiter((listed[p] if stats is None else -1 if listed[p] is None else listed[p][0]
                             for p in paths), np.int64, n)
        touches = self._sweeper.read_touches(self._list(self._touches)) if keys else {}
        key_col = np.frombuffer(b"".join(keys), HASH) if keys else np.empty(0, HASH)
        fields, status, errors, descriptor = self._scan_headers(keys, key_col, paths, sizes, stats, book)
        ok = status == _OK
        torn = ok & (fields["length"].astype(np.int64) + fields["stored"].astype(np.int64) != sizes)
        status[torn] = _CORRUPT  # torn or padded: a read would fail its checks anyway
        end = min(errors) if errors else n
        found = np.flatnonzero(status[:end] == _OK)
        cols = BlockColumns(
            key_col[found], fields["ns"][found], fields["parent"][found],
            fields["depth"][found].astype(np.int64), fields["size"][found].astype(np.int64),
            fields["expiry"][found], fields["created"][found], fields["checksum"][found],
        )
        found_keys = [keys[i] for i in found.tolist()]
        if touches:
            later = np.fromiter((touches.get(k, 0.0) for k in found_keys), np.float64, found.size)
            np.maximum(cols.expiry, later, out=cols.expiry)
        with_desc = found[fields["desc_len"][found] > 0]
        seen = {bytes(fields["ns"][i].tobytes()): descriptor(int(i)) for i in _last_of_each(fields["ns"], with_desc)}
        self._learn_columns(found_keys, cols, seen, [k for k in found_keys if k in touches])
        if errors:
            raise errors[end]  # what came before stays learned
        damaged = np.flatnonzero(status == _CORRUPT)
        debris += [self.path(keys[i]) for i in damaged.tolist()]
        bad += int(damaged.size)
        foreign = int((status == _FOREIGN).sum())
        moved = self._quarantine(debris)
        with self._lock:
            self._counters.bad_headers = bad
            self._counters.foreign_objects = foreign
            self._counters.quarantined += moved
        return cols

    def _scan_headers(
        self, keys: list[BlockHash], key_col: np.ndarray, paths: list[str], sizes: np.ndarray,
        stats: dict[str, manifest.Stat | None] | None, book: manifest.Manifest | None,
    ) -> tuple[np.ndarray, np.ndarray, dict[int, KVStoreError], Callable[[int], bytes]]:
        """The headers of ``keys`` (listed at ``paths``): from the manifest where it holds the
        very object listed (decoded in bulk), the others read (one batch). Returns their fixed
        fields (``format.HeaderColumns.fields``), a status per key (``_OK``, ``_GONE``: deleted
        since the listing, ``_FOREIGN``, ``_CORRUPT``, ``_ERROR``), the errors of ``_ERROR``
        keys by position, and the descriptor of a key by position. ``sizes`` (the listed object sizes) gets
        those of objects listed unstatted."""
        n = len(keys)
        status = np.full(n, _OK, np.int8)
        fields = np.zeros(n, HEADER_FIELDS)
        descriptors: dict[int, bytes] = {}
        todo = np.arange(n)
        blob, desc_at = b"", np.zeros(n, np.int64)
        if book is not None and stats is not None and n:
            st = np.array([stats[p] or _NO_STAT for p in paths], _STAT)
            vouched = sizes < 0
            rows = book.match(key_col, st["size"], st["mtime"], st["ctime"], st["ino"], vouched)
            sizes[vouched] = book.records["size"][rows[vouched]].astype(np.int64)
            lost = np.flatnonzero(vouched & (rows < 0))  # in a vouching directory, not recorded
            for i, got in zip(lost.tolist(), self.blobs.stat_paths([paths[i] for i in lost.tolist()]), strict=True):
                sizes[i] = got[0] if got is not None else -1
            have = np.flatnonzero(rows >= 0)
            heads = unpack_headers(book.headers, book.starts[rows[have]], book.ends[rows[have]], key_col[have])
            fields[have] = heads.fields
            blob = book.headers
            desc_at[have] = heads.desc_at
            todo = np.concatenate([np.flatnonzero(rows < 0), have[~heads.ok]])
            for i in have[~heads.ok].tolist():  # the file decides; say why the entry was passed over
                try:
                    unpack_header(book.headers[int(book.starts[rows[i]]) : int(book.ends[rows[i]])], keys[i], paths[i])
                except KVStoreError as e:
                    log.warning("object tier %r: manifest entry of %s unusable: %s", self.name, keys[i].hex(), e)
            todo.sort()
        errors: dict[int, KVStoreError] = {}
        on_file = todo.tolist()
        for i, h in zip(on_file, self._headers([keys[i] for i in on_file]), strict=True):
            if isinstance(h, Header):
                m = h.meta
                fields[i] = (MAGIC, FORMAT_VERSION, h.length, keys[i], m.ns, m.parent, m.depth, m.size,
                             m.expiry, m.created, m.checksum, h.codec, h.itemsize, 0, h.stored, len(h.descriptor))
                descriptors[i] = h.descriptor
            elif isinstance(h, BlockNotFound):
                status[i] = _GONE
            elif isinstance(h, ForeignObjectError):
                status[i] = _FOREIGN
            elif isinstance(h, CorruptBlockError):
                status[i] = _CORRUPT
            else:
                status[i] = _ERROR
                errors[i] = h

        def descriptor(i: int) -> bytes:
            if i in descriptors:
                return descriptors[i]
            a = int(desc_at[i])
            return blob[a : a + int(fields["desc_len"][i])]

        return fields, status, errors, descriptor

    def _write_manifest(self) -> None:
        """At close, a local tier's header manifest for the next warm restart (headers of
        objects unchanged since the last one come from it, the rest from their files)."""
        recorded = time.time_ns()  # the OS clock, as file times are; before the directories' stats
        try:
            dirs = self.blobs.dir_stats(self._blocks)
            listing = self.blobs.stats(self._blocks)
        except TierIOError as e:
            log.warning("object tier %r: no manifest written: %s", self.name, e)
            return
        if listing is None:
            return  # a remote store: a listing cannot prove an object unchanged
        # No vouch: every file is statted, no value is None.
        listing = {p: st for p, st in listing.items() if p.endswith(SUFFIX)}
        n = manifest.refresh(self._manifest_path, cast("dict[str, manifest.Stat]", listing), key_of, self.blobs.header_bytes, dirs, recorded)
        log.info("object tier %r: header manifest of %d objects written", self.name, n)

    def _stale_temp(self, path: str) -> bool:
        """Whether a temp file can only be left over from a crash: at the first listing of a
        private tier (its store opening) nothing writes to it yet; otherwise a write may be in
        flight (another node's, on a shared directory), so only one untouched for an hour
        counts. Remote writes are single PUTs: they leave no temp files."""
        if not self._local:
            return False
        if not self.config.url and not self._listed:
            return True
        age = self.blobs.age_s(path)
        return age is not None and age > _STALE_TEMP_S

    def _quarantine(self, paths: list[str]) -> int:
        """Move damaged objects and stale temp files out of ``blocks/`` into ``quarantine/``
        (for an operator to look at; delete at will), so that nothing damaged stays on the
        tier's books or uses its room forever. Local tiers whose sweeper is on only: a read-only
        listing (kvctl's snapshot turns the sweeper off) must not move anything, and on a remote
        store such objects are only counted (``bad_headers``)."""
        if not paths or not self._local or not self.config.sweep_interval_s:
            return 0
        qdir = f"{self._base}/quarantine"
        moved = self.blobs.quarantine(paths, qdir)
        if moved:
            log.warning("object tier %r: moved %d damaged objects or temp files of cut-short writes to %s",
                        self.name, moved, qdir)
        return moved

    def _learn_columns(
        self, keys: list[BlockHash], cols: BlockColumns, seen: dict[bytes, bytes], touched: list[BlockHash]
    ) -> None:
        """:meth:`_learn_many` of a listing's blocks (``keys``, with their ``cols``), in bulk."""
        with self._lock:
            sizes, expiry = self._sizes, self._expiry
            if not sizes:
                sizes.update(zip(keys, cols.size.tolist(), strict=True))
                self._used = sum(sizes.values())
            else:
                for key, size in zip(keys, cols.size.tolist(), strict=True):
                    self._used += size - sizes.get(key, 0)
                    sizes[key] = size
            if not expiry:
                expiry.update(zip(keys, cols.expiry.tolist(), strict=True))
            else:
                for key, e in zip(keys, cols.expiry.tolist(), strict=True):
                    expiry[key] = max(e, expiry.get(key, 0.0))
            self._touched.update(touched)
            self._seen.update(seen)

    def _learn(self, key: BlockHash, meta: BlockMeta, descriptor: bytes, touched: bool) -> None:
        self._learn_many([(key, meta, descriptor, touched)])

    def _learn_many(self, items: Iterable[tuple[BlockHash, BlockMeta, bytes, bool]]) -> None:
        with self._lock:
            sizes, expiry = self._sizes, self._expiry
            for key, meta, descriptor, touched in items:
                self._used += meta.size - sizes.get(key, 0)
                sizes[key] = meta.size
                expiry[key] = max(meta.expiry, expiry.get(key, 0.0))
                if touched:
                    self._touched.add(key)
                if descriptor:
                    self._seen[meta.ns] = descriptor

    def probe(self, keys: Sequence[BlockHash]) -> list[BlockMeta]:
        """Headers of the leading ``keys`` in the store, stopping at the first one missing (or
        damaged, or foreign), at most ``discover_max_blocks``: how a node finds blocks other
        nodes wrote since it listed the bucket.

        Windows of 1, 2, 4, ... concurrent ranged GETs: a miss (the usual case) costs one
        request, a run of ``n`` found blocks about ``log2(n)`` round trips.
        """
        limit = min(len(keys), self.config.discover_max_blocks)
        if not self.shared or not limit or not self.available():
            return []
        found: list[Header] = []
        window = 1
        while len(found) < limit:
            batch = keys[len(found) : min(len(found) + window, limit)]
            headers = self._headers(batch)
            present = cast("list[Header]", list(itertools.takewhile(lambda h: isinstance(h, Header), headers)))
            found += present
            if len(present) < len(headers):
                break
            window *= 2
        keys = list(keys[: len(found)])
        now = self._clock()
        stale = [k for k, h in zip(keys, found, strict=True) if h.meta.expiry <= now]
        touches = self._sweeper.read_touches(self.touch_path(k) for k in stale)
        metas = []
        for k, h in zip(keys, found, strict=True):
            meta = h.meta.with_expiry(touches[k]) if touches.get(k, 0.0) > h.meta.expiry else h.meta
            self._learn(k, meta, h.descriptor, k in touches)
            metas.append(meta)
        with self._lock:
            self._counters.probed_blocks += len(metas)
        return metas

    def _list(self, path: str, *, after: str = "", limit: int | None = None) -> dict[str, int]:
        """``{path: size}`` of the objects under ``path`` in name order, those after ``after``,
        at most ``limit`` (on S3: one LIST per 1,000, resumed server-side)."""
        return self.blobs.list(path, after=after, limit=limit)

    # ---- background work -----------------------------------------------------------------------

    def tick(self) -> None:
        """One round of background work: the backend's (a trial request when the breaker is
        due one, draining queued writes), and a sweep when ``sweep_interval_s`` has passed (on
        the injected clock). The worker thread calls it every ``worker_interval_s``; tests call
        it directly."""
        if self._closed:
            return
        self.blobs.tick()
        now = self._clock()
        if self.config.sweep_interval_s and now >= self._next_sweep and self.available():
            self._next_sweep = now + self.config.sweep_interval_s
            self.sweep()

    def _work(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.worker_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick()
            except Exception:  # the thread must outlive any one failure; the next tick retries
                log.exception("object tier %r: background work failed", self.name)

    def flush(self) -> None:
        """fsync local objects written with ``durable=False``; send queued remote writes if the
        store answers (remote PUTs themselves are durable when acknowledged)."""
        self.blobs.flush()

    def close(self) -> None:
        """Stop the background thread, flush; writes still queued (the store is unreachable)
        are dropped and counted. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
        self.flush()
        if self._listed and self.config.manifest:
            self._write_manifest()
        self.blobs.close()
        with self._lock:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError(f"object tier {self.name!r} is closed")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        c = self._counters
        d.update(
            url=self.url,
            shared=self.shared,
            available=self.available(),
            bad_headers=c.bad_headers,
            quarantined=c.quarantined,
            foreign_objects=c.foreign_objects,
            expired_deleted=c.expired_deleted,
            sweeps=c.sweeps,
            sweep_examined=c.sweep_examined,
            touches_written=c.touches_written,
            touches_dropped=c.touches_dropped,
            compressed_writes=c.compressed_writes,
            probed_blocks=c.probed_blocks,
        )
        d.update(self.blobs.describe())
        return d



def _last_of_each(ns: np.ndarray, rows: np.ndarray) -> list[int]:
    """Of ``rows`` (positions in the hash column ``ns``), the last one of each distinct hash:
    whose descriptor a listing keeps when several blocks of a namespace carry one."""
    if not rows.size:
        return []
    back = rows[::-1]
    first, _ = hash_groups(ns[back])
    return back[first].tolist()
