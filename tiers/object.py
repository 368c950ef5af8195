"""The object-store tier: content-addressed, self-describing objects on any fsspec filesystem.

``file://`` (the embedded default, under the tier's directory) works out of the box; ``s3://``
and other URLs work wherever fsspec has a backend installed. An object is found from the block
hash alone, so any node sharing the bucket finds any block::

    {base}/blocks/{hash[:2]}/{hash}.kvb

and carries everything a cold restart needs, so the index can be rebuilt by listing the bucket::

    magic b"KVSB" | u16 format | u32 header length | 16-byte block hash | BlockMeta.pack()
    | u16 descriptor length | namespace descriptor | u64 xxh3-64 of everything before it
    | payload (BlockMeta.size bytes)

The header's own checksum and the payload checksum in BlockMeta are verified on every read; a
bad magic, an unknown format, a truncated object or a mismatch raises CorruptBlockError.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from fsspec.core import url_to_fs

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    CorruptBlockError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.keys import HASH_BYTES, BlockHash
from tiers.base import Buffer, Tier, TierUsage, byte_view, tier_dir

MAGIC = b"KVSB"
FORMAT_VERSION = 1
SUFFIX = ".kvb"

_PREFIX = struct.Struct("<4sHI")  # magic, format version, header length
_DESC_LEN = struct.Struct("<H")
_TRAILER = struct.Struct("<Q")  # xxh3-64 of the header bytes before it
_META_AT = _PREFIX.size + HASH_BYTES
_DESC_LEN_AT = _META_AT + BlockMeta.PACKED_SIZE
MIN_HEADER = _DESC_LEN_AT + _DESC_LEN.size + _TRAILER.size
MAX_DESCRIPTOR = 0xFFFF
# One ranged read that holds a whole header in practice (a descriptor is a few hundred bytes of
# JSON); a larger header costs a second read.
_PROBE = 4096
_TiB = 1024**4


@dataclass(frozen=True)
class ObjectConfig:
    """``url``: where objects live (``s3://bucket/prefix``, ``file:///path``); empty is
    ``file://<tier dir>/objects``. ``capacity_bytes``: payload bytes this node may keep there.
    ``storage_options``: passed to the fsspec filesystem (credentials, endpoint_url, ...)."""

    url: str = ""
    capacity_bytes: int = _TiB
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(
                f"object url must be a string like 's3://bucket/kv', got {self.url!r}"
            )
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ConfigError(
                f"object capacity_bytes must be a positive size like '1TiB', got {self.capacity_bytes!r}"
            )
        if not isinstance(self.storage_options, dict):
            raise ConfigError(
                "object storage_options must be a table of fsspec options "
                f"(e.g. {{endpoint_url = '...'}}), got {self.storage_options!r}"
            )


def pack_header(key: BlockHash, meta: BlockMeta, descriptor: bytes = b"") -> bytes:
    """The header that precedes a payload in an object."""
    if len(descriptor) > MAX_DESCRIPTOR:
        raise UsageError(f"a namespace descriptor holds at most {MAX_DESCRIPTOR} bytes")
    length = MIN_HEADER + len(descriptor)
    body = b"".join(
        (
            _PREFIX.pack(MAGIC, FORMAT_VERSION, length),
            key,
            meta.pack(),
            _DESC_LEN.pack(len(descriptor)),
            descriptor,
        )
    )
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def header_length(buf: bytes | memoryview, where: str) -> int:
    """The full header length announced by the first bytes of an object (checks magic/format)."""
    if len(buf) < _PREFIX.size:
        raise CorruptBlockError(f"{where}: truncated header ({len(buf)} bytes)")
    magic, version, length = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptBlockError(f"{where}: not a kvstore block (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(
            f"{where}: block format {version} is not this build's {FORMAT_VERSION}"
        )
    if not MIN_HEADER <= length <= MIN_HEADER + MAX_DESCRIPTOR:
        raise CorruptBlockError(f"{where}: impossible header length {length}")
    return length


def unpack_header(buf: bytes | memoryview, key: BlockHash, where: str) -> tuple[BlockMeta, bytes]:
    """``(meta, namespace descriptor)`` from a whole header; CorruptBlockError on any mismatch."""
    length = header_length(buf, where)
    if len(buf) < length:
        raise CorruptBlockError(f"{where}: truncated header ({len(buf)} of {length} bytes)")
    body = memoryview(buf)[: length - _TRAILER.size]
    (stored,) = _TRAILER.unpack_from(buf, length - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise CorruptBlockError(f"{where}: header checksum mismatch")
    if bytes(body[_PREFIX.size : _META_AT]) != key:
        # Right bytes under the wrong name (a bad copy or rename): never serve them for this key.
        raise CorruptBlockError(
            f"{where}: object holds block {bytes(body[_PREFIX.size : _META_AT]).hex()}"
        )
    meta = BlockMeta.unpack(body[_META_AT:_DESC_LEN_AT], key)
    (desc_len,) = _DESC_LEN.unpack_from(body, _DESC_LEN_AT)
    if MIN_HEADER + desc_len != length:
        raise CorruptBlockError(f"{where}: descriptor length {desc_len} disagrees with header")
    start = _DESC_LEN_AT + _DESC_LEN.size
    return meta, bytes(body[start : start + desc_len])


def _key_of(path: str) -> BlockHash | None:
    stem = path.rsplit("/", 1)[-1][: -len(SUFFIX)]
    if len(stem) != 2 * HASH_BYTES:
        return None
    try:
        return BlockHash(bytes.fromhex(stem))
    except ValueError:
        return None


def _readinto_full(f: Any, dst: memoryview) -> int:
    """Fill ``dst`` from ``f`` unless the file ends first; returns the bytes read."""
    got = 0
    while got < len(dst):
        n = f.readinto(dst[got:])
        if not n:
            break
        got += n
    return got


class ObjectTier(Tier):
    """Blocks as immutable objects on an fsspec filesystem.

    The filesystem is the truth: ``read_into`` and ``meta`` fetch the object whether or not this
    process wrote it (another node may have). The in-memory ``key -> payload size`` map answers
    ``contains`` and ``usage`` without a request; it holds what this tier wrote or found in
    :meth:`scan` (run once at open) and is what ``capacity_bytes`` is enforced against.

    Thread safety: ``_lock`` guards the map and the byte accounting; requests run outside it.
    """

    kind = "object"
    persistent = True
    Config = ObjectConfig

    def __init__(
        self, name: str, config: ObjectConfig, *, root: Path, clock: Clock = system_clock
    ) -> None:
        super().__init__(name)
        self.config = config
        self._clock = clock  # unused today; expiry on objects comes with lifecycle rules
        url = config.url or f"file://{tier_dir(Path(root), name).absolute().as_posix()}/objects"
        try:
            self._fs, base = url_to_fs(url, **config.storage_options)
        except ImportError as e:
            raise ConfigError(
                f"object tier {name!r}: url {url!r} needs {e.name or 'an fsspec backend'}; "
                "for s3:// run pip install 'kvstore[s3]'"
            ) from e
        except ValueError as e:
            raise ConfigError(f"object tier {name!r}: cannot use url {url!r}: {e}") from e
        self.url = url
        protocol = self._fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self._local = "file" in protocols
        self._base = base.rstrip("/")
        self._blocks = f"{self._base}/blocks"
        self._lock = threading.Lock()
        self._sizes: dict[BlockHash, int] = {}
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, so that concurrent writes respect capacity
        self._descriptors: dict[bytes, bytes] = {}  # registered by the store: written into headers
        self._seen: dict[bytes, bytes] = {}  # found in headers by scan
        self._bad_headers = 0
        self._unsynced: set[str] = set()  # local objects written with durable=False
        self._dirs: set[str] = set()
        self._closed = False
        if self._local:
            self._make_base()
        for _ in self.scan():  # fills _sizes; a cold start lists the store once
            pass

    # ---- object-store surface ----------------------------------------------------------------

    def path(self, key: BlockHash) -> str:
        """Where ``key``'s object lives, on this tier's filesystem."""
        h = key.hex()
        return f"{self._blocks}/{h[:2]}/{h}{SUFFIX}"

    def register_namespace(self, digest: bytes, descriptor: bytes) -> None:
        """Embed ``descriptor`` (opaque bytes) in the header of every block of namespace
        ``digest`` written from now on, so a cold reader can tell what the block holds."""
        if len(digest) != HASH_BYTES:
            raise UsageError(f"a namespace digest has {HASH_BYTES} bytes, got {len(digest)}")
        if len(descriptor) > MAX_DESCRIPTOR:
            raise UsageError(f"a namespace descriptor holds at most {MAX_DESCRIPTOR} bytes")
        with self._lock:
            self._descriptors[bytes(digest)] = bytes(descriptor)

    def namespaces(self) -> dict[bytes, bytes]:
        """``{digest: descriptor}`` found in headers by scan, plus those registered here."""
        with self._lock:
            return {**self._seen, **self._descriptors}

    # ---- Tier --------------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        """Whether this tier wrote or scanned ``key`` (no request is made)."""
        return key in self._sizes

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        """Copy the verified payload into ``dst``. On an error ``dst``'s bytes are unspecified."""
        self._check_open()
        out = byte_view(dst, writable=True)
        path = self.path(key)
        if self._local:
            meta = self._read_local(key, path, out)
        else:
            meta = self._read_remote(key, path, out)
        if payload_checksum(out[: meta.size]) != meta.checksum:
            raise CorruptBlockError(f"{path}: payload checksum mismatch")
        return meta.size

    def _read_local(self, key: BlockHash, path: str, out: memoryview) -> BlockMeta:
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}") from None
        except OSError as e:
            raise TierIOError(f"{path}: {e}") from e
        with f:
            try:
                head = bytearray(_PROBE)
                got = _readinto_full(f, memoryview(head))
                length = header_length(memoryview(head)[:got], path)
                if length > got:
                    head.extend(bytes(length - got))
                    got += _readinto_full(f, memoryview(head)[got:])
                meta, _ = unpack_header(memoryview(head)[:got], key, path)
                total = os.fstat(f.fileno()).st_size
                if total != length + meta.size:
                    raise CorruptBlockError(
                        f"{path}: {total} bytes, header says {length + meta.size} (torn object)"
                    )
                self._check_dst(key, out, meta)
                f.seek(length)
                if _readinto_full(f, out[: meta.size]) != meta.size:
                    raise CorruptBlockError(f"{path}: truncated payload")
            except OSError as e:
                raise TierIOError(f"{path}: {e}") from e
        return meta

    def _read_remote(self, key: BlockHash, path: str, out: memoryview) -> BlockMeta:
        try:
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            raise BlockNotFound(f"block {key.hex()} is not in tier {self.name!r}") from None
        except OSError as e:
            raise TierIOError(f"{path}: {e}") from e
        meta, _ = unpack_header(data, key, path)
        length = header_length(data, path)
        if len(data) != length + meta.size:
            raise CorruptBlockError(
                f"{path}: {len(data)} bytes, header says {length + meta.size} (torn object)"
            )
        self._check_dst(key, out, meta)
        out[: meta.size] = memoryview(data)[length:]
        return meta

    @staticmethod
    def _check_dst(key: BlockHash, out: memoryview, meta: BlockMeta) -> None:
        if out.nbytes < meta.size:
            raise BufferSizeError(
                f"dst has {out.nbytes} bytes; block {key.hex()} needs {meta.size}"
            )

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        """Publish the object atomically (temp name + rename locally, one PUT elsewhere)."""
        data = byte_view(src)
        if data.nbytes != meta.size:
            raise BufferSizeError(f"src has {data.nbytes} bytes but meta.size says {meta.size}")
        if len(key) != HASH_BYTES:
            raise UsageError(f"a block hash has {HASH_BYTES} bytes, got {len(key)}")
        header = pack_header(key, meta, self._descriptors.get(meta.ns, b""))
        with self._lock:
            self._check_open()
            grow = max(0, meta.size - self._sizes.get(key, 0))
            if self._used + self._reserved + grow > self.config.capacity_bytes:
                raise TierFullError(
                    f"object tier {self.name!r}: {meta.size} more bytes exceed its capacity of "
                    f"{self.config.capacity_bytes} ({self._used} used)"
                )
            self._reserved += grow
        path = self.path(key)
        try:
            if self._local:
                self._write_local(path, header, data, durable)
            else:
                self._write_remote(path, header, data)
        finally:
            with self._lock:
                self._reserved -= grow
        with self._lock:
            self._used += meta.size - self._sizes.get(key, 0)
            self._sizes[key] = meta.size
            if self._local and not durable:
                self._unsynced.add(path)
            else:
                self._unsynced.discard(path)

    def _write_local(self, path: str, header: bytes, data: memoryview, durable: bool) -> None:
        directory = path.rsplit("/", 1)[0]
        tmp = f"{path}.tmp-{secrets.token_hex(8)}"  # no .kvb suffix: scan never sees it
        try:
            new_dir = self._make_dir(directory)
            with open(tmp, "xb") as f:
                f.write(header)
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if durable:
                _fsync_dir(directory)
                if new_dir:
                    _fsync_dir(self._blocks)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierIOError(f"object tier {self.name!r}: cannot write {path}: {e}") from e

    def _make_base(self) -> None:
        """Create ``blocks/`` at open, so that a durable write only has to sync its own prefix
        directory and ``blocks/`` (the chain above is synced here, once)."""
        if os.path.isdir(self._blocks):
            return
        try:
            os.makedirs(self._blocks, exist_ok=True)
            _fsync_dir(self._base)
            _fsync_dir(os.path.dirname(self._base) or "/")
        except OSError as e:
            raise TierIOError(
                f"object tier {self.name!r}: cannot create {self._blocks}: {e}"
            ) from e

    def _make_dir(self, directory: str) -> bool:
        """Create ``directory`` once per process; returns whether this call created it."""
        if directory in self._dirs:
            return False
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        self._dirs.add(directory)
        return created

    def _write_remote(self, path: str, header: bytes, data: memoryview) -> None:
        # One PUT is atomic on S3-like stores: a reader sees the old object or the new one.
        try:
            self._fs.pipe_file(path, b"".join((header, data)))
        except OSError as e:
            raise TierIOError(f"object tier {self.name!r}: cannot write {path}: {e}") from e

    def delete(self, key: BlockHash) -> bool:
        self._check_open()
        path = self.path(key)
        known = key in self._sizes
        try:
            if self._local:
                os.unlink(path)
                existed = True
            else:
                # S3 deletes succeed for missing keys, so ask first when the map cannot answer.
                existed = known or self._fs.exists(path)
                if existed:
                    self._fs.rm_file(path)
        except FileNotFoundError:
            existed = False
        except OSError as e:
            raise TierIOError(f"object tier {self.name!r}: cannot delete {path}: {e}") from e
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
            self._unsynced.discard(path)
        return existed

    def usage(self) -> TierUsage:
        """``used_bytes``: payload bytes of the blocks in the map (headers not counted)."""
        with self._lock:
            return TierUsage(self._used, self.config.capacity_bytes, len(self._sizes))

    def meta(self, key: BlockHash) -> BlockMeta | None:
        """The header's metadata, read from the store; None when there is no such object.
        CorruptBlockError when the header is damaged."""
        try:
            meta, _ = self._read_header(key, self.path(key))
        except FileNotFoundError:
            return None
        return meta

    def _read_header(self, key: BlockHash, path: str) -> tuple[BlockMeta, bytes]:
        """A ranged read of the object's first bytes (two when the header is large)."""
        try:
            head = self._fs.cat_file(path, start=0, end=_PROBE)
            length = header_length(head, path)
            if length > len(head):
                head = self._fs.cat_file(path, start=0, end=length)
        except FileNotFoundError:
            raise  # a miss, not a device failure: callers tell the two apart
        except OSError as e:
            raise TierIOError(f"{path}: {e}") from e
        return unpack_header(head, key, path)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        """List ``blocks/`` and read every header. Objects with a bad header, a bad name or a
        size that disagrees with the header are skipped; a complete scan records their count
        (``describe()["bad_headers"]``). What is found is added to the in-memory map."""
        try:
            found = self._fs.find(self._blocks, detail=True)
        except FileNotFoundError:
            found = {}
        except OSError as e:
            raise TierIOError(f"object tier {self.name!r}: cannot list {self._blocks}: {e}") from e
        bad = 0
        for path, info in sorted(found.items()):
            if not path.endswith(SUFFIX):
                continue  # a temp file of a write in flight, or of one cut short by a crash
            key = _key_of(path)
            if key is None:
                bad += 1
                continue
            try:
                meta, descriptor = self._read_header(key, path)
            except FileNotFoundError:
                continue  # deleted since the listing
            except CorruptBlockError:
                bad += 1
                continue
            size = info.get("size")
            if size is not None and size != MIN_HEADER + len(descriptor) + meta.size:
                bad += 1  # torn or padded: a read would fail its checks anyway
                continue
            with self._lock:
                self._used += meta.size - self._sizes.get(key, 0)
                self._sizes[key] = meta.size
                if descriptor:
                    self._seen[meta.ns] = descriptor
            yield key, meta
        self._bad_headers = bad

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        """A no-op: objects are immutable, and rewriting one to move its expiry would cost a
        PUT per refreshed block. The header keeps the expiry given at write time; expiry on
        the object tier is decided by the store (and later by bucket lifecycle rules)."""

    def flush(self) -> None:
        """fsync local objects written with ``durable=False`` (remote PUTs are durable)."""
        with self._lock:
            pending, self._unsynced = self._unsynced, set()
        dirs: set[str] = set()
        for path in pending:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise TierIOError(f"object tier {self.name!r}: cannot flush {path}: {e}") from e
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.rsplit("/", 1)[0])
        try:
            for d in dirs:
                _fsync_dir(d)
        except OSError as e:
            raise TierIOError(f"object tier {self.name!r}: cannot flush {self._blocks}: {e}") from e

    def close(self) -> None:
        """Flush pending local writes; the filesystem object stays cached by fsspec. Idempotent."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError(f"object tier {self.name!r} is closed")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(url=self.url, bad_headers=self._bad_headers)
        return d


def _fsync_dir(directory: str) -> None:
    """Make a rename or a new entry in ``directory`` survive a crash of the machine."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
