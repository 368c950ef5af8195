"""The data-plane wire format: versioned, length-limited, checksummed frames.

Shared by the daemon (TCP and UCX) and the client; imports nothing of the server, so a client
needs none of the server's dependencies. Every frame is::

    header (28 bytes, little-endian)
      magic    4s   b"KVSD"
      version  u8   VERSION
      op       u8   an Op
      flags    u16  0 (reserved; a frame with unknown flags is refused)
      req_id   u32  echoed by the reply
      meta_len u32  bytes of metadata that follow the header
      pay_len  u64  bytes of payload that follow the metadata
      crc      u32  CRC-32 of the first 24 header bytes and of the metadata
    metadata (meta_len bytes; op-specific, binary: namespace ids, integers, 16-byte hashes)
    payload  (pay_len bytes; block payloads back to back, one block_bytes each)

Payloads are not checksummed here: TCP checksums segments, and the store verifies its own
checksums on every persistent read; hashing gigabytes per second a second time would halve the
data plane's speed. Their length is validated instead (a whole number of blocks, within limits).

On UCX, where messages have boundaries, the same frame travels as one message for the header,
one for the metadata (if any) and one per block of payload (GET_RUNS: one per run of blocks its
reply names); on TCP the byte stream is the same.

Parsing never trusts a length before checking it against :class:`WireLimits`; every malformed
input raises :class:`ProtocolError` and nothing else (a property-based test holds it to that).
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"KVSD"
VERSION = 1
HEADER = struct.Struct("<4sBBHIIQI")
HEADER_BYTES = HEADER.size  # 28
HASH_BYTES = 16
NS_ID_BYTES = 16


class Op(enum.IntEnum):
    HELLO = 1
    """meta: bearer token (UTF-8; may be empty for the anonymous tenant). Reply meta: JSON."""
    GET = 2
    """meta: ns id, u32 n, n hashes. Reply meta: u32 count, u32 block_bytes; payload: blocks."""
    PUT = 3
    """meta: ns id, u32 start, u32 n, u8 flags (PUT_DURABLE, PUT_TOKENS), n hashes; payload:
    blocks start..n-1, then with PUT_TOKENS their token ids (int32, block_tokens a block)."""
    ACQUIRE = 4
    """meta: as GET. Reply meta: u64 lease id, u32 count, count x (u64 offset, u64 size)."""
    RELEASE = 5
    """meta: u64 lease id. No reply (ordering on the connection is enough)."""
    STAGING = 6
    """meta: u64 bytes. Reply meta: ``fd:`` and the hex ticket of a fresh memfd staging segment,
    to be fetched from the daemon's fd socket (kvstore.wire.fdpass)."""
    PUT_SHM = 7
    """meta: ns id, u32 start, u32 n, u8 flags, u64 staging offset, n hashes, then one u64
    xxh3-64 checksum per block put (n - start), verified against the staged bytes (none with
    PUT_UNCHECKED). No payload; with PUT_TOKENS the token ids are staged right after the blocks."""
    LOOKUP = 8
    """meta: as GET. Reply meta: JSON (:func:`encode_lookup`), the answer of ``POST /v1/lookup``
    without its HTTP: an engine's lookup before every prefill. A refusal is a REPLY too, naming
    the error's class (:func:`encode_refusal`), as the HTTP error body does."""
    GET_RUNS = 9
    """meta: as GET, then u32 k and k u32 run lengths in blocks (summing to n): the caller's
    destination, each run back to back in one buffer. Reply meta: u32 count, u32 block_bytes,
    u32 m and m u32 message lengths in blocks (summing to count); the payload is GET's, and on
    UCX it travels as one message per such run (:func:`encode_runs_meta`). Only to a daemon
    whose HELLO says ``"get_runs": true``."""
    PUT_DEVICE = 10
    """meta: ns id, u32 start, u32 n, u8 flags (PUT_DURABLE is refused), i32 CUDA device, u64
    offset, u64 size, the 64-byte CUDA IPC handle of a buffer in the client's GPU memory, n
    hashes. The daemon reserves arena slots for the new blocks, copies block ``start + i`` from
    the buffer's byte ``offset + i * block_bytes`` straight into them (one device-to-host DMA per
    run of slots) and commits them (``kvstore.server.devcopy``). Reply meta: u64 new blocks.
    Only to a same-node client granted shared memory, on a daemon whose HELLO says
    ``"put_device": true``."""
    LOOKUP_LEASE = 11
    """meta: as GET. A LOOKUP that also leases the leading blocks it finds in the arena, for an
    engine whose scheduler looks a prompt up and whose worker then loads it on the same node:
    the worker's copies start without an ACQUIRE round trip. Reply meta: u32 L, L bytes of
    LOOKUP's reply (a refusal too), then ACQUIRE's reply for the leased blocks (u64 lease id,
    u32 count, count x (u64 offset, u64 size); count 0 and id 0: no lease is held). Lease or not
    is the daemon's choice: only over shared memory, only the leading blocks the arena holds
    now, never a wait for a lower tier. Only to a daemon whose HELLO says ``"lookup_lease": true``."""
    REPLY = 0x80
    """A successful reply; its meta depends on the request's op."""
    ERROR = 0xFF
    """meta: u16 ErrorCode, UTF-8 message."""


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1  # the connection is closed after this
    UNAUTHENTICATED = 2  # closed
    TOO_LARGE = 3  # closed
    BAD_REQUEST = 4
    NOT_FOUND = 5
    CONFLICT = 6
    QUOTA = 7
    FORBIDDEN = 8
    UNAVAILABLE = 9  # a device or remote store failed (TierIOError): disk I/O, read-only, S3 down
    INTERNAL = 10
    FULL = 11  # no room in the store (TierFullError); an older daemon sent UNAVAILABLE for it


FATAL = frozenset({ErrorCode.BAD_FRAME, ErrorCode.UNAUTHENTICATED, ErrorCode.TOO_LARGE})
_REQUEST_OPS = frozenset({Op.HELLO, Op.GET, Op.PUT, Op.ACQUIRE, Op.RELEASE, Op.STAGING, Op.PUT_SHM, Op.LOOKUP, Op.GET_RUNS, Op.PUT_DEVICE,
                          Op.LOOKUP_LEASE})
_REPLY_OPS = frozenset({Op.REPLY, Op.ERROR})


class ProtocolError(Exception):
    """A frame that must be refused; ``code`` says how (FATAL codes close the connection)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def fatal(self) -> bool:
        return self.code in FATAL


@dataclass(frozen=True, slots=True)
class WireLimits:
    max_meta_bytes: int
    max_payload_bytes: int


@dataclass(frozen=True, slots=True)
class Header:
    op: Op
    req_id: int
    meta_len: int
    payload_len: int
    crc: int


def encode_header(op: Op, req_id: int, meta: bytes, payload_len: int) -> bytes:
    """The 28-byte header of a frame carrying ``meta`` and ``payload_len`` payload bytes."""
    head = HEADER.pack(MAGIC, VERSION, int(op), 0, req_id & 0xFFFFFFFF, len(meta), payload_len, 0)
    crc = zlib.crc32(meta, zlib.crc32(head[:24]))
    return head[:24] + struct.pack("<I", crc)


def parse_header(data: bytes | bytearray | memoryview, limits: WireLimits, *, reply: bool = False) -> Header:
    """Validate a header; ``reply`` selects which ops are expected (requests by default)."""
    if len(data) != HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a frame header has {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, op, flags, req_id, meta_len, pay_len, crc = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, "not a kvstore data-plane frame (bad magic); is this the data port?")
    if version != VERSION:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"protocol version {version} is not supported (this side speaks {VERSION}); "
            "upgrade the client or the daemon so that both match"
        )
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown op {op}") from None
    if op not in (_REPLY_OPS if reply else _REQUEST_OPS):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"op {op.name} is not expected here")
    if flags:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown flags {flags:#x}")
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"metadata of {meta_len} bytes exceeds the limit of {limits.max_meta_bytes}; "
            "send fewer blocks per request"
        )
    if pay_len > limits.max_payload_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"payload of {pay_len} bytes exceeds the limit of {limits.max_payload_bytes}; "
            "split the request"
        )
    return Header(op, req_id, meta_len, pay_len, crc)


def check_crc(header_bytes: bytes | bytearray | memoryview, meta: bytes | bytearray | memoryview, crc: int) -> None:
    if zlib.crc32(meta, zlib.crc32(bytes(header_bytes[:24]))) != crc:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame checksum mismatch (corrupt header or metadata)")


def consume(views: list[memoryview], sent: int) -> None:
    """Drop ``sent`` bytes from the front of ``views`` (after a partial ``sendmsg``)."""
    while sent and views:
        if sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0


# ---- metadata of each op ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """GET / ACQUIRE / PUT / PUT_SHM metadata."""

    ns_id: bytes
    hashes: list[bytes]
    start: int = 0
    durable: bool = False
    staging_offset: int = 0
    checksums: tuple[int, ...] | None = ()
    """PUT_SHM: the client's xxh3-64 of each block it staged; None for an unchecked PUT_SHM
    (PUT_UNCHECKED)."""
    tokens: bool = False
    """PUT / PUT_SHM: the token ids of the blocks follow them (PUT_TOKENS)."""


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PUT_FIXED = struct.Struct("<IIB")  # start, n, flags
_SHM_FIXED = struct.Struct("<IIBQ")  # start, n, flags, staging offset
PUT_DURABLE = 1
PUT_TOKENS = 2
PUT_UNCHECKED = 4
"""PUT_SHM only: no checksums follow the hashes. The daemon copies the staged bytes as they are
(a client that fills its staging segment straight from a GPU sends no checksum it would have to
compute on the host): a client writing its own staging during its own put can only tear its own
blocks, in its own tenant's keys, and every checksum the store keeps is the daemon's own, made
later from the copy in memory no client can write."""
"""The put carries its blocks' token ids (4 bytes a token, after the blocks): a daemon that
says ``"put_tokens": true`` in its HELLO reply takes them (an older one refuses the flag)."""


def _split_hashes(meta: bytes | bytearray | memoryview, off: int, n: int) -> list[bytes]:
    if len(meta) - off != n * HASH_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"metadata announces {n} hashes but carries {len(meta) - off} bytes for them"
        )
    raw = bytes(meta[off:])
    return [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def encode_blocks(ns_id: bytes, hashes: list[bytes]) -> bytes:
    return ns_id + _U32.pack(len(hashes)) + b"".join(hashes)


def _block_count(meta: bytes | bytearray | memoryview, max_blocks: int) -> int:
    """The u32 block count after a GET-like request's namespace id, checked against the limit."""
    if len(meta) < NS_ID_BYTES + 4:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"block request metadata needs at least {NS_ID_BYTES + 4} bytes")
    (n,) = _U32.unpack_from(meta, NS_ID_BYTES)
    if n > max_blocks:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} blocks exceed the limit of {max_blocks} per request")
    return int(n)


def parse_blocks(meta: bytes | bytearray | memoryview, max_blocks: int) -> BlockRequest:
    n = _block_count(meta, max_blocks)
    return BlockRequest(bytes(meta[:NS_ID_BYTES]), _split_hashes(meta, NS_ID_BYTES + 4, n))


def encode_put(
    ns_id: bytes, hashes: list[bytes], start: int, durable: bool, staging_offset: int | None = None,
    checksums: list[int] | None = None, *, tokens: bool = False,
) -> bytes:
    """PUT metadata; with ``staging_offset`` PUT_SHM's, which needs ``checksums`` (one per block
    put), or ``None`` for an unchecked PUT_SHM (PUT_UNCHECKED). ``tokens``: the token ids follow
    the blocks (PUT_TOKENS)."""
    flags = (PUT_DURABLE if durable else 0) | (PUT_TOKENS if tokens else 0)
    if staging_offset is None:
        return ns_id + _PUT_FIXED.pack(start, len(hashes), flags) + b"".join(hashes)
    if checksums is None:
        fixed = _SHM_FIXED.pack(start, len(hashes), flags | PUT_UNCHECKED, staging_offset)
        return ns_id + fixed + b"".join(hashes)
    cs = checksums
    if len(cs) != len(hashes) - start:
        raise ValueError(f"a PUT_SHM of {len(hashes) - start} blocks needs as many checksums, got {len(cs)}")
    fixed = _SHM_FIXED.pack(start, len(hashes), flags, staging_offset)
    return ns_id + fixed + b"".join(hashes) + struct.pack(f"<{len(cs)}Q", *cs)


_DEV_FIXED = struct.Struct("<IIBiQQ")  # start, n, flags, device, offset, size
DEVICE_HANDLE_BYTES = 64
DEVICE_AFTER_EVENT = 0x1
"""PUT_DEVICE flag: a 64-byte CUDA IPC event handle follows the memory handle; the daemon's
copies wait (on its device) for that event, so a client sends the request while the kernels
that fill its buffer still run (HELLO's ``put_device_event``)."""


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """PUT_DEVICE metadata."""

    ns_id: bytes
    hashes: list[bytes]
    start: int
    device: int
    offset: int
    size: int
    handle: bytes
    event: bytes | None = None
    """The CUDA IPC event handle the copies wait for (``DEVICE_AFTER_EVENT``), or None."""


def encode_put_device(ns_id: bytes, hashes: list[bytes], start: int, device: int, handle: bytes, offset: int,
                      size: int, event: bytes | None = None) -> bytes:
    for what, h in (("handle", handle), ("event handle", event)):
        if h is not None and len(h) != DEVICE_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC {what} is {DEVICE_HANDLE_BYTES} bytes, not {len(h)}")
    flags = DEVICE_AFTER_EVENT if event is not None else 0
    return (ns_id + _DEV_FIXED.pack(start, len(hashes), flags, device, offset, size) + handle + (event or b"")
            + b"".join(hashes))


def parse_put_device(meta: bytes | bytearray | memoryview, max_blocks: int) -> DeviceRequest:
    fixed = NS_ID_BYTES + _DEV_FIXED.size + DEVICE_HANDLE_BYTES
    if len(meta) < fixed:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"PUT_DEVICE metadata needs at least {fixed} bytes")
    start, n, flags, device, offset, size = _DEV_FIXED.unpack_from(meta, NS_ID_BYTES)
    if n > max_blocks:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} blocks exceed the limit of {max_blocks} per request")
    if start > n:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"put start {start} is past its {n} blocks")
    if flags & ~DEVICE_AFTER_EVENT:
        raise ProtocolError(ErrorCode.BAD_FRAME,
                            f"unknown PUT_DEVICE flags {flags:#x} (a durable put goes through PUT)")
    if device < 0:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"CUDA device {device} is not a device index")
    at = NS_ID_BYTES + _DEV_FIXED.size
    event = None
    if flags & DEVICE_AFTER_EVENT:
        fixed += DEVICE_HANDLE_BYTES
        if len(meta) < fixed:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"PUT_DEVICE metadata with an event needs at least {fixed} bytes")
        event = bytes(meta[at + DEVICE_HANDLE_BYTES : fixed])
    return DeviceRequest(bytes(meta[:NS_ID_BYTES]), _split_hashes(meta, fixed, n), start, device, offset, size,
                         bytes(meta[at : at + DEVICE_HANDLE_BYTES]), event)


def parse_put(meta: bytes | bytearray | memoryview, max_blocks: int, *, shm: bool = False) -> BlockRequest:
    st = _SHM_FIXED if shm else _PUT_FIXED
    fixed = NS_ID_BYTES + st.size
    if len(meta) < fixed:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"put metadata needs at least {fixed} bytes")
    vals = st.unpack_from(meta, NS_ID_BYTES)
    start, n, flags = vals[0], vals[1], vals[2]
    if n > max_blocks:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{n} blocks exceed the limit of {max_blocks} per request")
    if start > n:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"put start {start} is past its {n} blocks")
    if flags & ~(PUT_DURABLE | PUT_TOKENS | (PUT_UNCHECKED if shm else 0)):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown put flags {flags:#x}")
    checksums: tuple[int, ...] | None = ()
    if shm and flags & PUT_UNCHECKED:
        checksums = None
    elif shm:
        k = n - start
        end = len(meta) - 8 * k
        if end < fixed:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"PUT_SHM metadata needs {k} checksums after its hashes")
        checksums = struct.unpack_from(f"<{k}Q", meta, end)
        meta = meta[:end]
    return BlockRequest(
        bytes(meta[:NS_ID_BYTES]),
        _split_hashes(meta, fixed, n),
        start=start,
        durable=bool(flags & PUT_DURABLE),
        staging_offset=vals[3] if shm else 0,
        checksums=checksums,
        tokens=bool(flags & PUT_TOKENS),
    )


def encode_u64(v: int) -> bytes:
    return _U64.pack(v)


def parse_u64(meta: bytes | bytearray | memoryview) -> int:
    if len(meta) != 8:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 8 bytes of metadata, got {len(meta)}")
    return _U64.unpack(meta)[0]


def encode_data_meta(count: int, block_bytes: int) -> bytes:
    return struct.pack("<II", count, block_bytes)


def parse_data_meta(meta: bytes | bytearray | memoryview) -> tuple[int, int]:
    if len(meta) != 8:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a data reply has 8 bytes of metadata, got {len(meta)}")
    return struct.unpack("<II", meta)


def encode_get_runs(ns_id: bytes, hashes: list[bytes], runs: Sequence[int]) -> bytes:
    """GET_RUNS metadata: the blocks, then the destination's runs (lengths in blocks)."""
    return encode_blocks(ns_id, hashes) + _encode_runs(runs)


def parse_get_runs(meta: bytes | bytearray | memoryview, max_blocks: int) -> tuple[BlockRequest, list[int]]:
    n = _block_count(meta, max_blocks)
    end = NS_ID_BYTES + 4 + n * HASH_BYTES
    return parse_blocks(meta[:end], max_blocks), _parse_runs(meta, end, n)


def encode_runs_meta(count: int, block_bytes: int, runs: Sequence[int]) -> bytes:
    """A GET_RUNS reply's metadata: the data meta, then the payload's messages (blocks each)."""
    return encode_data_meta(count, block_bytes) + _encode_runs(runs)


def parse_runs_meta(meta: bytes | bytearray | memoryview) -> tuple[int, int, list[int]]:
    if len(meta) < 8:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a GET_RUNS reply needs at least 8 bytes of metadata, got {len(meta)}")
    count, bb = struct.unpack_from("<II", meta)
    return count, bb, _parse_runs(meta, 8, count)


def _encode_runs(runs: Sequence[int]) -> bytes:
    return struct.pack(f"<I{len(runs)}I", len(runs), *runs)


def _parse_runs(meta: bytes | bytearray | memoryview, off: int, total: int) -> list[int]:
    """``total`` blocks cut into runs: a u32 count at ``off``, then as many u32 lengths, each at
    least 1, summing to ``total``, ending the metadata."""
    if len(meta) < off + 4:
        raise ProtocolError(ErrorCode.BAD_FRAME, "the metadata ends before its run count")
    (k,) = _U32.unpack_from(meta, off)
    if len(meta) != off + 4 + 4 * k:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"metadata announces {k} runs but carries {len(meta) - off - 4} bytes for them")
    runs = list(struct.unpack_from(f"<{k}I", meta, off + 4))
    if sum(runs) != total or (runs and min(runs) < 1):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"runs {runs[:8]}... do not cut {total} blocks into runs of at least 1")
    return runs


def encode_lease(lease_id: int, locations: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> bytes:
    flat = [v for loc in locations for v in loc]
    return struct.pack(f"<QI{2 * len(locations)}Q", lease_id, len(locations), *flat)


def parse_lease(meta: bytes | bytearray | memoryview) -> tuple[int, list[tuple[int, int]]]:
    if len(meta) < 12:
        raise ProtocolError(ErrorCode.BAD_FRAME, "a lease reply needs at least 12 bytes")
    lease_id, n = struct.unpack_from("<QI", meta)
    if len(meta) != 12 + 16 * n:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a lease of {n} blocks needs {12 + 16 * n} bytes")
    flat = struct.unpack_from(f"<{2 * n}Q", meta, 12)
    return lease_id, list(zip(flat[0::2], flat[1::2], strict=True))


def encode_lookup(num_blocks: int, tiers: Sequence[str], unavailable: Sequence[str]) -> bytes:
    """A LOOKUP reply: JSON with each cached block's tier as an index into ``names`` (two bytes
    a block, whatever the tier names: the reply stays within ``64 + 16 * max_blocks``)."""
    names = list(dict.fromkeys(tiers))
    at = {n: i for i, n in enumerate(names)}
    out = {"num_blocks": num_blocks, "names": names, "tiers": [at[n] for n in tiers], "unavailable": list(unavailable)}
    return json.dumps(out, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused LOOKUP: the kvstore.errors class name (``kind``), its HTTP status, the message."""

    kind: str
    status: int
    detail: str


def encode_refusal(kind: str, status: int, detail: str) -> bytes:
    return json.dumps({"kind": kind, "status": status, "detail": detail[:4096]}, separators=(",", ":")).encode()


def parse_lookup(meta: bytes | bytearray | memoryview) -> tuple[int, tuple[str, ...], tuple[str, ...]] | Refusal:
    """``(num_blocks, tiers, unavailable)`` of a LOOKUP reply, or its :class:`Refusal`."""
    try:
        r = json.loads(bytes(meta))
        if isinstance(r, dict) and "kind" in r:
            refusal = Refusal(r["kind"], r["status"], r["detail"])
            if not (isinstance(refusal.kind, str) and type(refusal.status) is int and isinstance(refusal.detail, str)):
                raise TypeError("a refusal's fields are of the wrong kind")
            return refusal
        names, n, idx, unavailable = r["names"], r["num_blocks"], r["tiers"], r["unavailable"]
        ok = (
            all(isinstance(x, str) for x in [*names, *unavailable])
            and isinstance(n, int) and isinstance(idx, list) and n == len(idx)
            and all(type(i) is int and 0 <= i < len(names) for i in idx)
        )
    except (ValueError, TypeError, KeyError) as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a malformed lookup reply: {e!r}") from None
    if not ok:
        raise ProtocolError(ErrorCode.BAD_FRAME, "a malformed lookup reply (fields of the wrong kind)")
    return n, tuple(names[i] for i in idx), tuple(unavailable)


def encode_lookup_lease(lookup: bytes, lease_id: int = 0,
                        locations: list[tuple[int, int]] | tuple[tuple[int, int], ...] = ()) -> bytes:
    """A LOOKUP_LEASE reply: LOOKUP's reply (or refusal) ``lookup``, then the lease (none: id 0,
    no locations)."""
    return _U32.pack(len(lookup)) + lookup + encode_lease(lease_id, locations)


def parse_lookup_lease(meta: bytes | bytearray | memoryview) -> tuple[
        tuple[int, tuple[str, ...], tuple[str, ...]] | Refusal, int, list[tuple[int, int]]]:
    """``(lookup, lease id, locations)`` of a LOOKUP_LEASE reply (:func:`parse_lookup` of its
    first part; id 0 and no locations: no lease)."""
    if len(meta) < 4:
        raise ProtocolError(ErrorCode.BAD_FRAME, "a lookup-lease reply needs at least 4 bytes")
    (n,) = _U32.unpack_from(meta, 0)
    if len(meta) < 4 + n:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a lookup-lease reply's lookup part of {n} bytes is cut short")
    view = memoryview(meta)
    lookup = parse_lookup(view[4 : 4 + n])
    lease_id, locations = parse_lease(view[4 + n :])
    return lookup, lease_id, locations


def encode_error(code: ErrorCode, message: str) -> bytes:
    return struct.pack("<H", int(code)) + message.encode("utf-8", "replace")[:4096]


def parse_error(meta: bytes | bytearray | memoryview) -> tuple[ErrorCode, str]:
    if len(meta) < 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, "an error frame needs at least 2 bytes")
    (code,) = struct.unpack_from("<H", meta)
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    return ec, bytes(meta[2:]).decode("utf-8", "replace")
