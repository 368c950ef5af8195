"""The client of the kvstore daemon: the store's API (:class:`kvstore.api.KVCacheAPI`:
``register_namespace``, ``lookup``, ``get_into``, ``put``, ``pin``/``unpin``, ``pins``,
``delete``, ``acquire``/``release``, ``stats``) over the network.

``connect(url)`` asks the daemon where its data plane listens and picks, per client:

* ``shm`` when the daemon is on this node and grants this tenant shared memory: the client maps
  the daemon's DRAM arena; a load takes a lease (the daemon copies nothing), copies the blocks
  from the arena into the caller's buffers and gives the lease back; a store writes into a
  staging segment that the daemon made for this connection and puts from;
* ``tcp`` otherwise: framed requests, payloads received with ``recv_into`` straight into the
  caller's buffers;
* ``ucx`` only when asked for (``plane="ucx"``).

Control calls (pin, stats; lookups by token ids, and every lookup to a daemon that offers no
LOOKUP frames) use HTTP over one keep-alive connection (:class:`kvstore.client.control.ControlClient`
over ``_http.HttpConn``: a plain socket, a lookup costs ~0.1 ms of client CPU where httpx took
~0.5 ms). Lookups by hashes go as LOOKUP
frames on the data connection: the daemon's side of one costs about half of what HTTP did. Idempotent calls
are retried after a reconnect (a daemon restart, a dropped connection), the first at once and
then with back-off; a refused connection (nothing listens: the daemon is down) raises
:class:`DaemonUnavailableError` at once, without retries. ``put`` is idempotent
too (blocks are content-addressed and deduplicated). ``pin`` and ``unpin`` count, so they are
not retried. A refusal raises the kvstore.errors class the daemon's error body names (``kind``),
as the in-process store would (an older daemon's: the class its HTTP status maps to;
:func:`kvstore.client.control.daemon_error`), and is not retried as a lost connection. Thread-safe: one lock serialises every call (both planes) on
the connections.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvstore.api import LookupResult, layout_mismatch
from kvstore.block import payload_checksum
from kvstore.buffers import address, arena_pairs, dst_views, span, src_views
from kvstore.client._conn import (
    ConnectionLost,
    ConnectionRefused,
    FrameConn,
    TcpTransport,
    UcxTransport,
    open_staging,
)
from kvstore.client.control import STATUS_ERRORS, ControlClient
from kvstore.errors import (
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    UnknownNamespaceError,
    UsageError,
    error_class,
)
from kvstore.events import put_tokens_of
from kvstore.keys import Namespace
from kvstore.shm import Prefault, attach_arena, remember_arena
from kvstore.wire import protocol as P
from kvstore.wire.fdpass import receive_fds

T = TypeVar("T")
PLANES = ("auto", "shm", "tcp", "ucx")
log = logging.getLogger("kvstore.client")
_STAGING_MIN = 64 << 20
_SLOT_ALIGN = 4096  # the DRAM arena hands out slots in multiples of this (tiers/dram.py)


# One mapping of a daemon's arena per process, shared by its clients: attaching the same segment
# from many threads at once races in multiprocessing's resource tracker (Python < 3.13).
# An entry: [mapping, clients using it, its Prefault].
_ARENAS: dict[str, list[Any]] = {}
_ARENAS_LOCK = threading.Lock()


def _attach_shared(name: str) -> SharedMemory:
    with _ARENAS_LOCK:
        entry = _ARENAS.get(name)
        if entry is None:
            shm = attach_arena(name)
            assert shm.buf is not None  # a segment just attached is mapped
            # A fresh mapping has no page table entries: the first load through it took a
            # fault per 4 KiB page, which cost the first get_into of each block about as much
            # as its copy. The pages are mapped in the background (read-only, no byte changes).
            entry = _ARENAS[name] = [shm, 0, Prefault(shm.buf, write=False, name="kvstore-client-prefault")]
        entry[1] += 1
        return entry[0]


def _detach_shared(name: str) -> None:
    with _ARENAS_LOCK:
        entry = _ARENAS.get(name)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _ARENAS[name]
            entry[2].stop()  # it holds a view of the mapping
            with contextlib.suppress(BufferError):
                entry[0].close()


def _unmap(arena: str | None, staging: SharedMemory | None) -> None:
    if arena is not None:
        _detach_shared(arena)
    if staging is not None:
        with contextlib.suppress(BufferError):
            staging.close()


# What lost connections let go of, unmapped by one thread per process. It is started when a
# client first maps an arena, not by the call that finds the daemon gone: on a loaded machine a
# new thread can take tens of milliseconds to be scheduled, and that call is an engine's.
_UNMAPS: queue.SimpleQueue[tuple[str | None, SharedMemory | None]] = queue.SimpleQueue()
_UNMAPPER: list[threading.Thread] = []


def _start_unmapper() -> None:
    with _ARENAS_LOCK:
        if not _UNMAPPER:
            _UNMAPPER.append(threading.Thread(target=_unmap_forever, name="kvstore-unmap", daemon=True))
            _UNMAPPER[0].start()


# A lost arena is unmapped this long after the call that lost it: munmap of a large mapping holds
# the process's memory-map lock (and, for an mmap object, the GIL), so unmapping at once stalled
# the engine's next calls by several milliseconds (`tools.bench outage`, first call after a kill).
_UNMAP_DELAY_S = 1.0


def _unmap_forever() -> None:
    while True:
        arena, staging = _UNMAPS.get()
        time.sleep(_UNMAP_DELAY_S)
        _unmap(arena, staging)


def _local_node_id() -> str:
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"



def _lookup_answer(ns: Namespace, r: tuple[int, tuple[str, ...], tuple[str, ...]] | P.Refusal) -> LookupResult:
    """A LOOKUP's (or LOOKUP_LEASE's) parsed answer as a result, or its refusal raised as the
    class the daemon names, as over HTTP."""
    if isinstance(r, P.Refusal):
        cls = error_class(r.kind) or STATUS_ERRORS.get(r.status, KVStoreError)
        raise cls(f"daemon: {r.detail} ({r.kind}, status {r.status})")
    return LookupResult(r[0], ns.block_tokens, r[1], r[2])

@dataclass(eq=False)
class ClientLease:
    """Blocks held in the daemon's arena for this client: ``views[i]`` is block ``i``, read-only,
    valid until :meth:`release` (or the end of a ``with`` block). A lease from
    :meth:`Client.lookup_lease` has no views (``locations`` only): it holds the blocks for
    another process's copies (an engine's worker, which maps the arena itself)."""

    views: list[memoryview]
    _release: Callable[[], None] = field(repr=False)
    arena: str = ""
    """The daemon's arena (shared-memory name), as in :class:`kvstore.api.Lease`."""
    locations: tuple[tuple[int, int], ...] = ()
    """``(offset, size)`` of each block in the arena, as in :class:`kvstore.api.Lease`."""
    _done: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.locations)

    def release(self) -> None:
        if not self._done:
            self._drop_views()
            self._release()

    def _drop_views(self) -> None:
        """Let go of the arena without telling the daemon (it dropped the lease already)."""
        self._done = True
        for v in self.views:
            v.release()

    def __enter__(self) -> ClientLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class ClientPin:
    """One pin of this tenant, as the daemon reports it (a :class:`kvstore.api.PinLike`)."""

    ns: bytes
    """The namespace's root as this client registered it (``Namespace.root``)."""
    num_blocks: int
    until: float | None
    """Wall-clock deadline (the daemon's clock); None: until unpinned."""
    model_id: str = ""
    nbytes: int = 0


class Client:
    """The daemon's store through one connection; satisfies :class:`kvstore.api.KVCacheAPI`
    with :class:`ClientLease` leases. Use :func:`connect`."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:7070",
        *,
        token: str | None = None,
        plane: str = "auto",
        timeout: float = 30.0,
        retries: int = 5,
    ) -> None:
        if plane not in PLANES:
            raise UsageError(f"plane must be one of {', '.join(PLANES)}, got {plane!r}")
        self.url = url.rstrip("/")
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        self.requested_plane = plane
        self.plane = ""
        self.timeout = timeout
        self.retries = retries
        self._token = token or ""
        self._control = ControlClient(self.url, token=token, timeout=timeout)
        self._lock = threading.RLock()
        self._conn: FrameConn | None = None
        self._arena: SharedMemory | None = None
        self._arena_name = ""
        self._staging: SharedMemory | None = None
        self._ns: dict[bytes, tuple[Namespace, float | None]] = {}
        self._leases: weakref.WeakSet[ClientLease] = weakref.WeakSet()
        self.info: dict[str, Any] = {}
        self.layout_conflicts: list[dict[str, Any]] = []
        """Layout conflicts the daemon reported for this client's registrations (the latest
        per namespace): another layout of the same model deployment is registered there."""
        self._retry(self._connect)

    # ---- connection ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """Connect, HELLO, and map the arena where granted. A ticket revoked before this client
        claimed it (many clients of one tenant connecting at once: the daemon bounds unclaimed
        tickets) is a new HELLO, a few times with a short random back-off, not a lost arena."""
        for attempt in range(_TICKET_RETRIES + 1):
            try:
                return self._connect_once()
            except _StaleTicket:
                if attempt == _TICKET_RETRIES:
                    break
                time.sleep(random.uniform(0.005, 0.02) * 2**attempt)
        self._connect_once(stale_ok=True)

    def _connect_once(self, stale_ok: bool = False) -> None:
        self._disconnect()
        info = self._json("GET", "/v1/info")
        if self.requested_plane == "ucx":
            if not info.get("ucx_port"):
                raise UsageError("the daemon runs no UCX data plane; start it with ucx = true or use plane='tcp'")
            transport: TcpTransport | UcxTransport = UcxTransport(self.host, info["ucx_port"], self.timeout)
        else:
            transport = TcpTransport(self.host, info["data_port"], self.timeout)
        conn = FrameConn(transport)
        try:
            _, meta = conn.call(P.Op.HELLO, self._token.encode())
            hello = json.loads(bytes(meta))
            conn.limits = P.WireLimits(64 + 16 * hello["max_blocks"], hello["max_payload_bytes"])
            self.plane = "ucx" if self.requested_plane == "ucx" else "tcp"
            if self.requested_plane in ("auto", "shm"):
                self._arena = self._try_arena(hello, stale_ok)
                if self._arena is not None:
                    self.plane = "shm"
                elif self.requested_plane == "shm":
                    raise ForbiddenError(
                        "shared memory is not available: the daemon is on another node, or this "
                        "tenant has no allow_shm, or its arena cannot be mapped here; use plane='tcp'"
                    )
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.info = {**info, **hello}
        for ns, ttl in list(self._ns.values()):  # a restarted daemon forgets this client
            self._register(ns, ttl)

    def _try_arena(self, hello: dict[str, Any], stale_ok: bool = False) -> SharedMemory | None:
        if not hello.get("arena") or hello.get("node_id") != _local_node_id():
            return None
        try:
            if hello.get("shm_socket"):  # the arena has no name: a read-only descriptor of it
                try:
                    fds = receive_fds(hello["shm_socket"], bytes.fromhex(hello["arena_ticket"]), self.timeout)
                except ConnectionError as e:  # no descriptor for the ticket: revoked before the claim
                    if stale_ok:
                        raise
                    raise _StaleTicket(str(e)) from e
                remember_arena(hello["arena"], fds[0])
            shm = _attach_shared(hello["arena"])
        except OSError:  # another container's /dev/shm, say: fall back to TCP
            return None
        self._arena_name = hello["arena"]
        _start_unmapper()
        return shm

    def _disconnect(self, *, later: bool = False) -> None:
        """Close the data connection and let go of the arena and the staging segment.
        ``later``: unmap them on a thread of their own (a lost connection: unmapping tens of
        MiB takes milliseconds that the failing call, an engine's, should not wait for)."""
        # A lease's views pin the arena mapping; the daemon releases the leases of a closed
        # connection itself.
        for lease in list(self._leases):
            lease._drop_views()
        self._leases.clear()
        if self._conn is not None:
            with contextlib.suppress(OSError, ConnectionLost):
                self._conn.close()
            self._conn = None
        arena = self._arena_name if self._arena is not None else None
        staging = self._staging
        self._arena = self._staging = None
        if arena is None and staging is None:
            return
        if later and _UNMAPPER:
            _UNMAPS.put((arena, staging))
        else:
            _unmap(arena, staging)

    def _retry(self, fn: Callable[[], T], idempotent: bool = True) -> T:
        delay = 0.05
        attempt = 0
        forgotten = False
        while True:
            try:
                with self._lock:
                    if self._conn is None and fn != self._connect:
                        self._connect()
                    return fn()
            except UnknownNamespaceError:
                # A restarted daemon forgets the namespaces this client registered, and an HTTP
                # call can reach it before the data connection has noticed the restart. The call
                # did nothing (a pin neither), so: reconnect, which registers them again, and go
                # once more.
                if forgotten or not self._ns or fn == self._connect:
                    raise
                forgotten = True
                with self._lock:
                    self._disconnect()
            except KVStoreError:
                # The daemon's answer (HTTP error body or error frame), raised as it came: a
                # TierIOError is an OSError too, yet no reason to reconnect and retry.
                raise
            except (ConnectionLost, OSError) as e:
                lost = self._lost(e)
                # A refused connection is instant and says the daemon is not there: no retry
                # and no back-off, so that an engine's first call after a daemon died costs
                # a connect attempt, not the retries' sleeps (its breaker reconnects later).
                if not idempotent or attempt == self.retries or isinstance(e, ConnectionRefused):
                    raise lost from e
                attempt += 1
                if attempt > 1:  # a dropped connection is reconnected at once, then with back-off
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)

    def close(self) -> None:
        with self._lock:
            self._disconnect()
            self._control.close()

    def _settle(self) -> None:
        with self._lock:
            conn = self._conn
            if conn is None:
                return
            try:
                conn.settle()
            except (ConnectionLost, OSError):
                self._disconnect()  # the daemon gives a closed connection's leases back itself

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- control plane ------------------------------------------------------------------------

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        self._settle()  # the daemon has this client's releases before its control calls
        return self._control.request(method, path, body)

    def _register(self, ns: Namespace, ttl_s: float | None) -> None:
        r = self._json("POST", "/v1/namespaces", {"namespace": ns.to_dict(), "ttl_s": ttl_s})
        self._ns[bytes(ns.root)] = (ns, ttl_s)
        conflicts = r.get("layout_conflicts") or []  # an older daemon sends none
        mine = ns.root.hex()
        self.layout_conflicts = [w for w in self.layout_conflicts if w["namespaces"][0] != mine] + conflicts
        for w in conflicts:
            log.warning("kvstore daemon %s: layout conflict: %s", self.url, w["message"])

    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> None:
        self._retry(lambda: self._register(ns, ttl_s))

    def _ns_id(self, ns: Namespace) -> bytes:
        """The namespace's id, registering it on first use; a deployment this client registered
        with another layout raises LayoutMismatchError, as in the store."""
        if bytes(ns.root) not in self._ns:
            key = ns.model_key()
            for known, _ in self._ns.values():
                if known.model_key() == key:
                    raise layout_mismatch(known, ns)
            self._register(ns, None)
        return bytes(ns.root)

    def _blocks_call(
        self, path: str, ns: Namespace, hashes: Sequence[bytes], idempotent: bool, **extra: Any
    ) -> int:
        def call() -> int:
            body = {"ns": self._ns_id(ns).hex(), "hashes": [bytes(h).hex() for h in hashes], **extra}
            return int(self._json("POST", path, body)["blocks"])

        return self._retry(call, idempotent)

    def _lookup(self, ns: Namespace, key: str, values: list[Any]) -> LookupResult:
        def call() -> LookupResult:
            r = self._json("POST", "/v1/lookup", {"ns": self._ns_id(ns).hex(), key: values})
            # An older daemon sends no "unavailable": it names no unreachable tier.
            return LookupResult(r["num_blocks"], ns.block_tokens, tuple(r["tiers"]), tuple(r.get("unavailable", ())))

        return self._retry(call)

    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        """As :meth:`KVStore.lookup`: the cached prefix, its tiers, and the tiers the daemon
        cannot reach now (``unavailable``). On the data connection (a LOOKUP frame) when the
        daemon takes them: over HTTP a lookup cost the daemon ~0.3 ms of CPU at rest."""
        if not self.info.get("lookup") or len(hashes) > int(self.info.get("max_blocks", 0)):
            return self._lookup(ns, "hashes", [bytes(h).hex() for h in hashes])
        keys = [bytes(h) for h in hashes]

        def call() -> LookupResult:
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            _, meta = conn.call(P.Op.LOOKUP, P.encode_blocks(ns_id, keys))
            try:
                r = P.parse_lookup(meta)
            except P.ProtocolError as e:
                raise ConnectionLost(f"malformed reply from the daemon: {e}") from e
            return _lookup_answer(ns, r)

        return self._retry(call)

    def lookup_lease(self, ns: Namespace, hashes: Sequence[bytes]) -> tuple[LookupResult, ClientLease | None]:
        """:meth:`lookup`, and a lease on the leading blocks of the answer that the daemon's arena
        holds now (None: no lease; the daemon grants one only over shared memory, never waiting
        for a lower tier: see ``Op.LOOKUP_LEASE``), in one round trip. The lease has no views
        (:class:`ClientLease`): an engine's scheduler takes it at its lookup and hands its
        ``locations`` to the worker that copies from the arena, then releases it once those
        copies have landed. A daemon without LOOKUP_LEASE: a plain :meth:`lookup`."""
        if (not self.info.get("lookup_lease") or self.plane != "shm"
                or len(hashes) > int(self.info.get("max_blocks", 0))):
            return self.lookup(ns, hashes), None
        keys = [bytes(h) for h in hashes]

        def call() -> tuple[LookupResult, ClientLease | None]:
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            _, meta = conn.call(P.Op.LOOKUP_LEASE, P.encode_blocks(ns_id, keys))
            try:
                r, lease_id, locs = P.parse_lookup_lease(meta)
            except P.ProtocolError as e:
                raise ConnectionLost(f"malformed reply from the daemon: {e}") from e
            answer = _lookup_answer(ns, r)
            return answer, (self._held_lease(conn, lease_id, locs, []) if locs else None)

        return self._retry(call)

    def lookup_tokens(self, ns: Namespace, tokens: Sequence[int]) -> LookupResult:
        """:meth:`lookup` by token ids: the daemon hashes them (as :func:`kvstore.keys.hash_blocks`)."""
        return self._lookup(ns, "tokens", [int(t) for t in tokens])

    def pin(self, ns: Namespace, hashes: Sequence[bytes], *, until: float | None = None) -> int:
        """Pin the cached prefix of ``hashes`` (as :meth:`KVStore.pin`); returns its length.

        ``until`` (wall-clock seconds, the daemon's clock) makes it a retention guarantee: the
        prefix stays on some tier until then, past its TTL and under any pressure. One the store
        cannot honour (the store's room for guarantees is used up, or this tenant's
        ``pin_quota`` would be passed) raises :class:`RetentionError` and pins nothing; a tenant
        over its quota gets :class:`QuotaExceededError`. Without ``until`` the pin holds until
        :meth:`unpin`."""
        extra = {} if until is None else {"until": float(until)}
        return self._blocks_call("/v1/pin", ns, hashes, idempotent=False, **extra)

    def pins(self) -> list[ClientPin]:
        """This tenant's pin records, in pinning order (as :meth:`KVStore.pins`, without the
        block hashes: the daemon keeps salted keys, from which the client's cannot be
        recovered). Which still hold, and the tenant's guarantee budget: :meth:`pin_report`."""
        rows = self.pin_report()["pins"]
        return [ClientPin(bytes.fromhex(r["ns"]), r["blocks"], r["until"], r["model_id"], r["bytes"]) for r in rows]

    def pin_report(self, ns: Namespace | None = None) -> dict[str, Any]:
        """This tenant's pins (``GET /v1/pins``), or those of ``ns``: ``{"pins": rows,
        "summary": ..., "guaranteed_bytes": ..., "pin_quota_bytes": ...}``. A row names the
        namespace (``ns``: ``Namespace.root.hex()``), the pinned prefix's length in blocks and
        bytes, its deadline (``until``; None: until unpinned) and whether it still holds; never
        another tenant's pins. ``guaranteed_bytes``: what this tenant's guarantees hold (each
        block once), counted against ``pin_quota_bytes`` (None: no per-tenant limit)."""
        path = "/v1/pins" if ns is None else f"/v1/pins?ns={bytes(ns.root).hex()}"
        return self._retry(lambda: self._json("GET", path))

    def unpin(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Undo one pin of the longest pinned prefix of ``hashes`` (a guarantee only whole),
        else take them out of an untimed pin (as :meth:`KVStore.unpin`)."""
        return self._blocks_call("/v1/unpin", ns, hashes, idempotent=False)

    def delete(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        return self._blocks_call("/v1/evict", ns, hashes, idempotent=True)

    def stats(self) -> dict[str, Any]:
        """The daemon's view (``usage``; ``store`` for an admin) and this client's
        ``layout_conflicts`` (see the attribute)."""
        out = self._retry(lambda: self._json("GET", "/v1/stats"))
        return {**out, "layout_conflicts": list(self.layout_conflicts)}

    def health(self) -> dict[str, Any]:
        """The daemon's liveness answer (``GET /healthz``): ``{"status": "ok"}``."""
        return self._retry(lambda: self._json("GET", "/healthz"))

    # ---- data plane ---------------------------------------------------------------------------

    def get_into(self, ns: Namespace, hashes: Sequence[bytes], dst: Any | Sequence[Any]) -> int:
        """Load the leading cached blocks into caller buffers (as :meth:`KVStore.get_into`)."""
        bb = ns.block_bytes
        bufs = [b[:bb] for b in dst_views(dst, bb)]
        hashes = list(hashes[: len(bufs)])
        # One answer holds what the daemon sends in one frame (max_payload_bytes): a longer load
        # asks again for the blocks after the last that came, until a frame comes back short. A
        # lease on shared memory sends no payload: one, where the arena holds them all.
        per = max(1, int(self.info.get("max_payload_bytes", 1 << 40)) // bb)
        if self.plane == "shm" and self._lease_fits(len(hashes), bb):
            per = max(per, len(hashes))
        got = 0
        while got < len(hashes):
            want = min(per, len(hashes) - got)
            n = self._get_frame(ns, hashes[got : got + want], bufs[got : got + want])
            got += n
            if n < want:
                break
        return got

    def _get_frame(self, ns: Namespace, hashes: list[bytes], bufs: list[memoryview]) -> int:
        """One load (a lease on shared memory, GET_RUNS or GET) of the leading cached ``hashes``."""
        bb = ns.block_bytes

        def call() -> int:
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            if self.plane == "shm" and self._lease_fits(len(hashes), bb):
                return self._get_shm(conn, ns_id, hashes, bufs)
            if self.info.get("get_runs"):
                got = self._get_runs(conn, ns_id, hashes, bufs, bb, 64 + 16 * int(self.info["max_blocks"]))
                if got is not None:
                    return got

            def into(hdr: P.Header, meta: bytearray) -> list[memoryview]:
                count, got_bb = P.parse_data_meta(meta)
                if got_bb != bb or count > len(bufs) or hdr.payload_len != count * bb:
                    raise ConnectionLost(f"daemon sent {count} blocks of {got_bb} bytes; expected {bb}")
                return bufs[:count]

            _, meta = conn.call(P.Op.GET, P.encode_blocks(ns_id, hashes), into=into)
            return P.parse_data_meta(meta)[0]

        return self._retry(call)

    @staticmethod
    def _get_runs(
        conn: FrameConn, ns_id: bytes, hashes: list[bytes], bufs: list[memoryview], bb: int, max_meta: int
    ) -> int | None:
        """GET_RUNS: the payload lands in runs of blocks, each a span of one caller buffer (on
        UCX one message each: few large messages moved far more than one per block). None,
        sending nothing, when the request would not fit the daemon's metadata limit (a
        destination in many pieces, near ``max_blocks``): a plain GET does then."""
        spans = _dest_runs(bufs[: len(hashes)], bb)
        req = P.encode_get_runs(ns_id, hashes, [len(v) // bb for v in spans])
        if len(req) > max_meta:
            return None

        def into(hdr: P.Header, meta: bytearray) -> list[memoryview]:
            count, got_bb, msgs = P.parse_runs_meta(meta)
            if got_bb != bb or count > len(hashes) or hdr.payload_len != count * bb:
                raise ConnectionLost(f"daemon sent {count} blocks of {got_bb} bytes; expected {bb}")
            views, run, at = [], 0, 0  # at: bytes of spans[run] already taken
            for m in msgs:
                if at == spans[run].nbytes:
                    run, at = run + 1, 0
                if at + m * bb > spans[run].nbytes:
                    raise ConnectionLost(f"daemon sent a run of {m} blocks across the end of a destination run")
                views.append(spans[run][at : at + m * bb])
                at += m * bb
            return views

        _, meta = conn.call(P.Op.GET_RUNS, req, into=into)
        return P.parse_runs_meta(meta)[0]

    def _lease_fits(self, n: int, bb: int) -> bool:
        """Whether ``n`` blocks of ``bb`` bytes fit in the daemon's arena at once. A lease never
        holds more than the arena, so a longer load is read by the daemon (GET) instead: a
        lease would end the prefix where the arena is full of the chain's own blocks."""
        slot = -(-bb // _SLOT_ALIGN) * _SLOT_ALIGN
        return self._arena is not None and n * slot <= self._arena.size

    def _get_shm(self, conn: FrameConn, ns_id: bytes, hashes: list[bytes], bufs: list[memoryview]) -> int:
        _, meta = conn.call(P.Op.ACQUIRE, P.encode_blocks(ns_id, hashes))
        lease_id, locs = P.parse_lease(meta)
        try:
            assert self._arena is not None and self._arena.buf is not None  # the shm plane's arena
            arena = self._arena.buf
            _copy_runs(arena, locs, bufs)
            del arena
        finally:
            conn.release(lease_id)  # its reply is read with the next call's
        return len(locs)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> ClientLease:
        """Zero-copy access (shared-memory plane only): the leading cached blocks as read-only
        views of the daemon's arena, held until :meth:`ClientLease.release`."""

        def call() -> ClientLease:
            if self.plane != "shm":
                raise UsageError(f"acquire needs the shared-memory plane; this client uses {self.plane!r}")
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            _, meta = conn.call(P.Op.ACQUIRE, P.encode_blocks(ns_id, list(hashes)))
            return self._lease(conn, meta)

        return self._retry(call)

    def _lease(self, conn: FrameConn, meta: bytearray) -> ClientLease:
        """The lease an ACQUIRE's reply grants, on this connection's arena mapping (under the lock)."""
        assert self._arena is not None and self._arena.buf is not None
        lease_id, locs = P.parse_lease(meta)
        arena = self._arena.buf.toreadonly()
        views = [arena[off : off + size] for off, size in locs]
        arena.release()
        return self._held_lease(conn, lease_id, locs, views)

    def _held_lease(self, conn: FrameConn, lease_id: int, locs: list[tuple[int, int]],
                    views: list[memoryview]) -> ClientLease:
        """A lease the daemon granted on ``conn`` (under the lock)."""

        def release() -> None:
            with self._lock:
                if self._conn is conn:  # after a reconnect the daemon has dropped it already
                    with contextlib.suppress(ConnectionLost):
                        conn.release(lease_id)

        lease = ClientLease(views, release, self._arena_name, tuple(locs))
        self._leases.add(lease)
        return lease

    def acquire_each(self, ns: Namespace, chunks: Iterable[Sequence[bytes]]) -> Generator[ClientLease, None, None]:
        """:meth:`acquire` of each of ``chunks`` (consecutive pieces of one chain), pipelined:
        every request goes out at once (each as soon as ``chunks`` yields it: a lazy iterable
        may hash the rest of the chain while the first request is on its way) and each lease
        is yielded as its reply comes in, so a caller that queues copies from one lease
        meanwhile waits for no round trip but the first. Stops after a lease shorter than its
        chunk (the rest of the chain is not cached). Closing the iterator early gives back the leases still on their way. No retry: a
        connection lost midway raises DaemonUnavailableError (the leases it held are gone with
        it)."""
        if self.plane != "shm":
            raise UsageError(f"acquire needs the shared-memory plane; this client uses {self.plane!r}")
        parts: list[list[bytes]] = []
        pending: list[int] = []
        conn: FrameConn | None = None
        try:
            with self._lock:
                try:
                    if self._conn is None:
                        self._connect()
                    conn, ns_id = self._conn, self._ns_id(ns)
                    assert conn is not None
                    for c in chunks:
                        parts.append(list(c))
                        pending.append(conn.send(P.Op.ACQUIRE, P.encode_blocks(ns_id, parts[-1])))
                except (ConnectionLost, OSError) as e:
                    raise self._lost(e) from e
            for c in parts:
                with self._lock:
                    if conn is None or self._conn is not conn:
                        raise DaemonUnavailableError(f"kvstore daemon at {self.url}: the connection was lost")
                    try:
                        _, meta = conn.take(pending.pop(0))
                    except (ConnectionLost, OSError) as e:
                        raise self._lost(e) from e
                    lease = self._lease(conn, meta)
                yield lease
                if lease.num_blocks < len(c):
                    return
        finally:
            with self._lock:
                # leases granted that no one will read from
                if pending and conn is not None and self._conn is conn:
                    with contextlib.suppress(ConnectionLost, OSError, KVStoreError):
                        for req in pending:
                            with contextlib.suppress(KVStoreError):
                                self._lease(conn, conn.take(req)[1]).release()

    def _lost(self, e: BaseException) -> DaemonUnavailableError:
        """The data connection broke (``e``): close it, and the error to raise if no retry helps."""
        with self._lock:
            self._disconnect(later=True)
        return DaemonUnavailableError(f"kvstore daemon at {self.url} is unreachable ({e}); is it running? "
                                      "(`kvstore serve`)")

    def release(self, lease: ClientLease) -> None:
        """Give back an :meth:`acquire` lease (as :meth:`KVStore.release`). Idempotent."""
        lease.release()

    def put(
        self,
        ns: Namespace,
        hashes: Sequence[bytes],
        blocks: Any | Sequence[Any],
        *,
        start: int = 0,
        durable: bool = False,
        tokens: Any | None = None,
    ) -> int:
        """Store blocks ``start..`` of a chain (as :meth:`KVStore.put`); returns how many were new.
        ``tokens`` (the blocks' token ids) travel with them, 4 bytes a token, to a daemon that
        takes them (its KV events carry them); an older daemon is sent none."""
        bb = ns.block_bytes
        hashes = list(hashes)
        if not 0 <= start <= len(hashes):
            raise UsageError(f"start={start} is outside the chain of {len(hashes)} blocks")
        srcs = src_views(blocks, bb, len(hashes) - start)
        tok = None if tokens is None else put_tokens_of(hashes[start:], tokens, ns.block_tokens).tokens
        bt = ns.block_tokens
        new = 0
        # One frame holds what the daemon takes in one (its HELLO's max_payload_bytes, and on shared
        # memory its max_staging_bytes): a larger put goes as several, each storing the next
        # blocks under the same chain.
        limit = int(self.info.get("max_payload_bytes", 1 << 40))
        if self.plane == "shm" and int(self.info.get("max_staging_bytes", 0)) >= bb + 4 * bt:
            limit = min(limit, int(self.info["max_staging_bytes"]))
        per = max(1, limit // (bb + 4 * bt))
        for a in range(0, len(srcs), per):
            b = min(a + per, len(srcs))
            part = None if tok is None else tok[a * bt : b * bt]
            new += self._put_frame(ns, hashes[: start + b], srcs[a:b], start + a, durable, part)
        return new

    def _put_frame(self, ns: Namespace, hashes: list[bytes], srcs: list[Any], start: int, durable: bool,
                   tok: Any | None) -> int:
        """One PUT (or PUT_SHM through the staging segment) of blocks ``start..`` of ``hashes``."""
        bb = ns.block_bytes

        def call() -> int:
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            send = tok if tok is not None and tok.size and self.info.get("put_tokens") else None
            extra = [memoryview(send).cast("B")] if send is not None else []
            need = len(srcs) * bb
            tok_bytes = send.nbytes if send is not None else 0
            if self.plane == "shm" and 0 < need + tok_bytes <= int(self.info.get("max_staging_bytes", 0)):
                staging = self._staging_for(conn, need + tok_bytes)
                sbuf = staging.buf
                assert sbuf is not None  # the staging segment stays open with its connection
                for i, s in enumerate(srcs):
                    sbuf[i * bb : (i + 1) * bb] = s
                if extra:
                    sbuf[need : need + tok_bytes] = extra[0]
                del sbuf
                sums = [payload_checksum(s) for s in srcs]  # the daemon verifies the staged bytes
                meta_out = P.encode_put(ns_id, hashes, start, durable, 0, sums, tokens=bool(extra))
                _, meta = conn.call(P.Op.PUT_SHM, meta_out)
            else:
                meta_out = P.encode_put(ns_id, hashes, start, durable, tokens=bool(extra))
                _, meta = conn.call(P.Op.PUT, meta_out, [*srcs, *extra])
            return P.parse_u64(meta)

        return self._retry(call)

    def staging(self, nbytes: int) -> SharedMemory:
        """This connection's staging segment, of ``nbytes`` at least (the shared-memory plane
        only), for a caller that writes blocks into it itself (a GPU's device-to-host copy) and
        then stores them with :meth:`put_staged`: no copy and no checksum on the client. A new
        connection (after a daemon restart, say) has a new segment; :meth:`put_staged` refuses
        one that is no longer this connection's."""
        if self.plane != "shm":
            raise UsageError(f"staged puts need the shared-memory plane; this client uses {self.plane!r}")
        limit = int(self.info.get("max_staging_bytes", 0))
        if not 0 < nbytes <= limit:
            raise UsageError(f"a staging segment holds 1..{limit} bytes (the daemon's max_staging), not {nbytes}")

        def call() -> SharedMemory:
            conn = self._conn
            assert conn is not None
            return self._staging_for(conn, nbytes)

        return self._retry(call)

    def put_staged(
        self, ns: Namespace, hashes: Sequence[bytes], segment: SharedMemory, *, start: int = 0, offset: int = 0,
        durable: bool = False,
    ) -> int:
        """Store blocks ``start..`` of a chain that the caller wrote into ``segment`` (from
        :meth:`staging`) at byte ``offset``, back to back (as :meth:`put`; returns how many were
        new). The daemon copies the staged bytes into the store once; a caller writing the same
        bytes of its segment while the call runs tears only its own blocks. A segment that is no
        longer this connection's raises :class:`DaemonUnavailableError` (take it again)."""
        hashes = list(hashes)
        if not 0 <= start <= len(hashes):
            raise UsageError(f"start={start} is outside the chain of {len(hashes)} blocks")
        need = (len(hashes) - start) * ns.block_bytes
        if offset < 0 or offset + need > segment.size:
            raise UsageError(f"bytes {offset}..{offset + need} are outside the {segment.size}-byte staging segment")

        def call() -> int:
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            if self._staging is not segment:
                raise DaemonUnavailableError(
                    "the staging segment was replaced (the connection to the daemon was made again): "
                    "take the new one with staging() and write the blocks again"
                )
            _, meta = conn.call(P.Op.PUT_SHM, P.encode_put(ns_id, hashes, start, durable, offset, None))
            return P.parse_u64(meta)

        return self._retry(call, idempotent=False)

    def put_device(
        self, ns: Namespace, hashes: Sequence[bytes], *, device: int, handle: bytes, offset: int, size: int,
        start: int = 0, after: bytes | None = None,
    ) -> int:
        """Store blocks ``start..`` of a chain that lie back to back in this process's GPU memory:
        a buffer exported with a CUDA IPC handle (``engine.gpu.device_export``: the device, the
        allocation's 64-byte handle, the first block's ``offset`` in it and the ``size`` in bytes
        from there). The daemon copies them from the device straight into its arena (PUT_DEVICE:
        no host copy on either side); only on a same-node daemon whose HELLO offers it
        (``info["put_device"]``). Returns how many blocks were new, as :meth:`put`. The buffer
        must hold its bytes until the call returns. ``after``: the CUDA IPC handle of an event
        (``torch.cuda.Event(interprocess=True).ipc_handle()``) the daemon's copies wait for,
        so the call may go out while kernels still fill the buffer (``info["put_device_event"]``)."""
        hashes = list(hashes)
        if not 0 <= start <= len(hashes):
            raise UsageError(f"start={start} is outside the chain of {len(hashes)} blocks")
        if (len(hashes) - start) * ns.block_bytes > size:
            raise UsageError(f"{len(hashes) - start} blocks of {ns.block_bytes} bytes do not fit in {size} bytes")

        def call() -> int:
            if self.plane != "shm" or not self.info.get("put_device"):
                raise UsageError("this daemon does not copy from GPU memory (put_device): use put or put_staged")
            if after is not None and not self.info.get("put_device_event"):
                raise UsageError("this daemon does not wait for CUDA events (put_device_event): synchronize, "
                                 "then call put_device without after")
            conn, ns_id = self._conn, self._ns_id(ns)
            assert conn is not None
            meta = P.encode_put_device(ns_id, hashes, start, device, handle, offset, size, after)
            _, reply = conn.call(P.Op.PUT_DEVICE, meta)
            return P.parse_u64(reply)

        return self._retry(call, idempotent=False)

    def _staging_for(self, conn: FrameConn, need: int) -> SharedMemory:
        if self._staging is None or self._staging.size < need:
            size = min(max(need, _STAGING_MIN), int(self.info["max_staging_bytes"]))
            _, meta = conn.call(P.Op.STAGING, P.encode_u64(size))
            if self._staging is not None:
                with contextlib.suppress(BufferError):
                    self._staging.close()
            self._staging = open_staging(bytes(meta).decode(), self.info, self.timeout)
        return self._staging


_TICKET_RETRIES = 5


class _StaleTicket(Exception):
    """The daemon handed over no descriptor for this connection's arena ticket."""


def _dest_runs(bufs: list[memoryview], bb: int) -> list[memoryview]:
    """``bufs`` (block views) as spans of blocks that lie back to back in one caller buffer."""
    out: list[memoryview] = []
    i = 0
    while i < len(bufs):
        first, at, j = bufs[i], address(bufs[i]) + bb, i + 1
        while j < len(bufs) and bufs[j].obj is first.obj and address(bufs[j]) == at:
            at, j = at + bb, j + 1
        whole = span(first, (j - i) * bb) if j - i > 1 else None
        if whole is None:
            out.extend(b[:bb] for b in bufs[i:j])
        else:
            out.append(whole)
        i = j
    return out


def _copy_runs(arena: memoryview, locs: Sequence[tuple[int, int]], bufs: list[memoryview]) -> None:
    """Copy leased blocks into ``bufs``, runs that lie back to back in the arena and in one
    caller buffer in one copy each (:func:`kvstore.buffers.arena_pairs`)."""
    for dst, src in arena_pairs(arena, locs, bufs):
        dst[:] = src


def connect(
    url: str | None = None, *, token: str | None = None, plane: str = "auto", timeout: float = 30.0, retries: int = 5
) -> Client:
    """A client of the daemon at ``url`` (default ``$KVSTORE_URL`` or http://127.0.0.1:7070);
    the token defaults to ``$KVSTORE_TOKEN``."""
    url = url or os.environ.get("KVSTORE_URL", "http://127.0.0.1:7070")
    token = token if token is not None else os.environ.get("KVSTORE_TOKEN")
    return Client(url, token=token, plane=plane, timeout=timeout, retries=retries)

