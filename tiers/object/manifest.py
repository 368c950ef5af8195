"""The header manifest of a local object tier: every object's header, written at close, so that
a warm restart reads one file instead of opening every object.

Objects are immutable: a write goes to a temp name and is renamed into place, so an object
whose size, modification time, change time and inode are those the manifest recorded holds the
header the manifest recorded. The restart lists ``blocks/`` (a ``stat`` per object, which the
listing needs anyway), takes the header of each such object from the manifest and reads the
others' (written after the manifest, by a run that crashed before its close) from their files.
A manifest that is missing, torn or of another version is ignored: the restart reads every
header, as without one. A restart that used a manifest removes it (:func:`retire`), so that a
run that crashes leaves none behind. Nothing here decides what a block is: the headers still go through
``unpack_header`` and its checksum.

A prefix directory (``blocks/ab/``) can vouch for all its objects at once: objects enter and
leave it only by rename and unlink, which change the directory's mtime and ctime, so a
directory whose mtime, ctime and inode are those recorded holds the objects recorded, and their
files need no ``stat``. Only a directory whose recorded mtime is older than the manifest's own
time by :data:`SETTLED_NS` vouches so: a change in the same tick of the file system's coarse
clock as the recording could leave the mtime as it was (git's "racy" entries). An object
rewritten in place (not by this tier, which never does that) is not seen at open; its read then
fails its header, length or payload checksum, and it is a miss, never wrong bytes.

Layout: ``b"KVSM" | u16 version | u32 count | u32 dirs | i64 recorded (ns, the OS clock) |
u64 xxh3-64 of the body | body``, where the body (zstd) is ``count`` records (16-byte hash, u64
size, i64 mtime_ns, i64 ctime_ns, u64 inode, u32 header length), ``dirs`` directory records
(8-byte name, i64 mtime_ns, i64 ctime_ns, u64 inode), then the headers back to back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Callable, Iterable

import numpy as np
import xxhash
import zstandard

from kvstore.keys import HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

NAME = "manifest.kvm"
MAGIC = b"KVSM"
VERSION = 2
_HEAD = struct.Struct("<4sHIIqQ")
_DIR = np.dtype([("name", "S8"), ("mtime", "<i8"), ("ctime", "<i8"), ("ino", "<u8")])
SETTLED_NS = 2_000_000_000
"""How much older than the manifest a directory's last change must be for it to vouch for its
objects (2 s: coarser than any file system's timestamps but FAT's, which is 2 s)."""
DirStat = tuple[int, int, int]
"""What proves a prefix directory unchanged: mtime_ns, ctime_ns, inode."""
_RECORD = np.dtype([("key", f"V{HASH_BYTES}"), ("size", "<u8"), ("mtime", "<i8"), ("ctime", "<i8"),
                    ("ino", "<u8"), ("length", "<u4")])

Stat = tuple[int, int, int, int]
"""What proves an object unchanged since the manifest: size, mtime_ns, ctime_ns, inode."""


def stat_of(st: os.stat_result) -> Stat:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def dir_stat_of(st: os.stat_result) -> DirStat:
    return st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class Manifest:
    """A loaded manifest, as columns: ``records`` (one row an object: hash, stat, header
    length) and the ``headers`` back to back, row ``i``'s at ``starts[i]:ends[i]``."""

    __slots__ = ("records", "headers", "starts", "ends", "_where", "dirs", "recorded_ns")

    def __init__(self, records: np.ndarray, headers: bytes, starts: np.ndarray,
                 dirs: dict[str, DirStat] | None = None, recorded_ns: int = 0) -> None:
        self.records = records
        self.headers = headers
        self.starts = starts
        self.dirs = dirs or {}
        self.recorded_ns = recorded_ns
        self.ends = starts + records["length"].astype(np.int64)
        self._where: dict[bytes, int] | None = None

    def __len__(self) -> int:
        return int(self.records.size)

    def header(self, key: bytes, stat: Stat) -> bytes | None:
        """The recorded header of ``key``'s object if the object is the one recorded."""
        if self._where is None:
            raw = self.records["key"].tobytes()
            self._where = {raw[i * HASH_BYTES : (i + 1) * HASH_BYTES]: i for i in range(len(self))}
        i = self._where.get(key)
        if i is None:
            return None
        r = self.records[i]
        if (int(r["size"]), int(r["mtime"]), int(r["ctime"]), int(r["ino"])) != stat:
            return None
        return self.headers[int(self.starts[i]) : int(self.ends[i])]

    def vouches(self, name: str, stat: DirStat) -> bool:
        """Whether prefix directory ``name`` is unchanged since the manifest and settled then,
        so that its objects are those recorded (see the module docstring)."""
        return self.dirs.get(name) == stat and stat[0] < self.recorded_ns - SETTLED_NS

    def match(self, keys: np.ndarray, size: np.ndarray, mtime: np.ndarray, ctime: np.ndarray,
              ino: np.ndarray, vouched: np.ndarray | None = None) -> np.ndarray:
        """Per listed object (``keys``: a column of 16-byte hashes, with its stat columns), the
        row that records that very object, or -1: :meth:`header` for a whole listing at once.
        Joined on the hashes' first 8 bytes and checked on all 16 (two hashes that share their
        first 8 bytes may miss their row: the object's own header is read then, as for any
        object the manifest does not hold). Where ``vouched`` is set the object's directory
        vouches for it: its name is enough, its stat columns are not looked at."""
        out = np.full(keys.size, -1, np.int64)
        if not len(self) or not keys.size:
            return out
        have = _halves(self.records["key"])
        want = _halves(keys)
        order = np.argsort(have[:, 0], kind="stable")
        at = order[np.minimum(np.searchsorted(have[order, 0], want[:, 0]), order.size - 1)]
        r = self.records[at]
        same = (r["size"] == size) & (r["mtime"] == mtime) & (r["ctime"] == ctime) & (r["ino"] == ino)
        if vouched is not None:
            same |= vouched
        same &= (have[at] == want).all(axis=1)
        out[same] = at[same]
        return out


def _halves(column: np.ndarray) -> np.ndarray:
    """A column of 16-byte hashes as rows of two uint64."""
    return np.frombuffer(np.ascontiguousarray(column).tobytes(), np.uint64).reshape(-1, 2)


def load(path: str) -> Manifest | None:
    """The manifest at ``path``; None when there is none or it cannot be trusted (torn, of
    another version): the caller then reads every header."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("object manifest %s unreadable, reading every header: %s", path, e)
        return None
    try:
        magic, version, count, ndirs, recorded, digest = _HEAD.unpack_from(data)
        body = memoryview(data)[_HEAD.size :]
        if magic != MAGIC or version != VERSION or xxhash.xxh3_64_intdigest(body) != digest:
            raise ValueError("not a manifest of this version, or torn")
        raw = zstandard.ZstdDecompressor().decompress(bytes(body))
        records = np.frombuffer(raw, _RECORD, count)
        dirs = np.frombuffer(raw, _DIR, ndirs, records.nbytes)
        headers = raw[records.nbytes + dirs.nbytes :]
        starts = np.zeros(count, np.int64)
        np.cumsum(records["length"][:-1], out=starts[1:])
        if count and int(starts[-1]) + int(records["length"][-1]) != len(headers):
            raise ValueError("header bytes do not add up")
    except (ValueError, struct.error, zstandard.ZstdError) as e:
        log.warning("object manifest %s ignored, reading every header: %s", path, e)
        return None
    by_name = {n.decode(): (m, c, i) for n, m, c, i in zip(
        dirs["name"].tolist(), dirs["mtime"].tolist(), dirs["ctime"].tolist(), dirs["ino"].tolist(), strict=True)}
    return Manifest(records, headers, starts, by_name, recorded)


def retire(path: str) -> None:
    """Remove the manifest once a restart has read it (synced): from then on this run changes
    the objects, and only its clean close writes a manifest that describes them. A crash
    therefore leaves no manifest, and the next restart reads every header; the stat check
    still guards against changes no run of this tier made (another node, an operator)."""
    try:
        os.unlink(path)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("object manifest %s not removed: %s", path, e)


def save(path: str, entries: Iterable[tuple[BlockHash, Stat, bytes]],
         dirs: dict[str, DirStat] | None = None, recorded_ns: int = 0) -> int:
    """Write the manifest of ``entries`` (hash, stat, header) and of the prefix directories'
    stats ``dirs``, taken at ``recorded_ns`` (before the entries were listed), atomically (temp
    name, fsync, rename): a crash leaves the old manifest or the new one, never a torn one in
    its place. Returns how many entries it holds."""
    rows, heads = [], []
    for key, (size, mtime, ctime, ino), head in entries:
        rows.append((bytes(key), size, mtime, ctime, ino, len(head)))
        heads.append(head)
    records = np.array(rows, _RECORD) if rows else np.zeros(0, _RECORD)
    dir_rows = np.array([(n.encode(), *st) for n, st in (dirs or {}).items()], _DIR) if dirs else np.zeros(0, _DIR)
    body = zstandard.ZstdCompressor(level=1).compress(records.tobytes() + dir_rows.tobytes() + b"".join(heads))
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_HEAD.pack(MAGIC, VERSION, len(rows), dir_rows.size, recorded_ns, xxhash.xxh3_64_intdigest(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows)


def refresh(
    path: str,
    listing: dict[str, Stat],
    key_of: Callable[[str], BlockHash | None],
    read_header: Callable[[str], bytes | None],
    dirs: dict[str, DirStat] | None = None,
    recorded_ns: int = 0,
) -> int:
    """At close: the manifest of the objects ``listing`` holds (path -> stat), each header
    taken from the old manifest when its object is unchanged, else read from the file
    (``read_header``; None skips a damaged one: the next restart reads and quarantines it)."""
    old = load(path)
    entries: list[tuple[BlockHash, Stat, bytes]] = []
    for p, stat in listing.items():
        key = key_of(p)
        if key is None:
            continue
        head = old.header(key, stat) if old is not None else None
        if head is None:
            head = read_header(p)
            if head is None:
                continue
        entries.append((key, stat, head))
    try:
        return save(path, entries, dirs, recorded_ns)
    except OSError as e:
        log.warning("object manifest %s not written (the next restart reads every header): %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(f"{path}.tmp")
        return 0
