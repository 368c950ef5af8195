"""The daemon's tenant-aware view of the store, shared by the control and data planes.

Isolation: a client names blocks by the hashes it computed under its own (unsalted) namespace.
The daemon never stores those hashes as they are: for a configured tenant it

* registers the namespace with ``tenant_salt`` set to the tenant's salt (derived from a secret
  kept in the store directory, so it is stable across restarts and unknown to every client): the
  tenant's namespaces, TTLs and layout checks are its own;
* keys every block by ``xxh3_128(tenant key || namespace digest || client hash)``: the same
  prompt of two tenants lands on two different blocks, a tenant that learns another tenant's
  hashes still cannot name, read or probe that tenant's blocks, and a hash put under one of a
  tenant's namespaces is never served under another (with another block size).

The anonymous tenant (no ``[[tenants]]`` configured, loopback only) uses hashes as they are, so
a store directory written in process reads the same through the daemon.

Every method blocks (store I/O): the event loop calls them through a thread pool.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from kvstore.api import Lease, LookupResult
from kvstore.clock import Clock, system_clock
from kvstore.errors import (
    AuthError,
    BlockNotFound,
    ConfigError,
    ForbiddenError,
    LayoutMismatchError,
    MissingPrefixError,
    QuotaExceededError,
    RetentionError,
    TierFullError,
    TierIOError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.inspection import layout_conflicts, pin_summary
from kvstore.keys import Namespace, hash_blocks
from kvstore.retention import PinRecord
from kvstore.server.config import ANONYMOUS, ServerConfig, TenantSpec
from kvstore.store import KVStore
from kvstore.store.reservation import Reservation as SlotReservation
from kvstore.wire.protocol import ErrorCode

SECRET_FILE = "server-secret"
SECRET_BYTES = 32
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tenant:
    spec: TenantSpec
    salt: str
    key: bytes
    used_bytes: int = 0
    namespaces: dict[bytes, Namespace] = field(default_factory=dict)
    """client namespace id (the unsalted root digest) -> the namespace registered in the store"""
    reserved_bytes: int = 0
    """Bytes of puts admitted against the quota and not yet stored (reserved before the payload
    is read, so parallel puts cannot pass the quota together)."""
    leased_bytes: int = 0
    """Bytes of the arena its leases hold now."""
    pin_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Serialises the tenant's pins and namespace registrations: each checks a limit (pin
    records, pin_quota bytes, namespaces) that the others change, and holds it to the end."""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(slots=True, eq=False)
class Reservation:
    """Bytes of one put admitted against a tenant's quota (:meth:`Service.reserve`). Given
    back once, however many paths end the put (:meth:`Service.unreserve` is idempotent): a put
    refused after its admission once gave its bytes back twice, and the tenant's
    ``reserved_bytes`` went negative, lifting its quota by as much."""

    tenant: Tenant
    nbytes: int
    held: bool = True


def load_secret(root: Path) -> bytes:
    """The daemon's secret (32 random bytes, mode 0600), created on first start.

    A secret of any other length is damage (a truncated copy, an empty file from a full disk):
    used silently it would re-key every tenant, making every cached block unreachable, so it is
    refused with what to do."""
    path = root / SECRET_FILE
    try:
        return _checked_secret(path, path.read_bytes())
    except FileNotFoundError:
        pass
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = secrets.token_bytes(SECRET_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another daemon on the same directory won the race
        return _checked_secret(path, path.read_bytes())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _checked_secret(path: Path, data: bytes) -> bytes:
    if len(data) != SECRET_BYTES:
        raise ConfigError(
            f"{path} holds {len(data)} bytes, not the {SECRET_BYTES} of a server secret: it is damaged. "
            "Restore it from a backup (tenants' block keys and salts derive from it); or, to start "
            "over with every tenant's cache unreachable, remove it and the daemon makes a new one"
        )
    return data


class Service:
    def __init__(self, store: KVStore, config: ServerConfig, secret: bytes, *, clock: Clock = system_clock) -> None:
        self.store = store
        self.clock = clock
        """The store's wall clock (what pin deadlines are compared with)."""
        self.config = config
        self.limits = config.limits
        self._lock = threading.Lock()
        self._usage_epoch = 0
        """Bumped by each :meth:`refresh_usage` (under ``_lock``): a put whose store call overlapped
        a refresh cannot tell whether the refresh counted its blocks, so it refreshes again instead
        of adding them (adding them counted them twice under parallel puts)."""
        self._by_token: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        for spec in config.tenants:
            mac = hmac.new(secret, spec.name.encode(), hashlib.sha256).digest()
            t = Tenant(spec, salt=mac[:16].hex(), key=mac[16:])
            self._by_token[spec.token] = t
            self._tenants[spec.name] = t
        self.anonymous: Tenant | None = None
        if not config.tenants:
            self.anonymous = Tenant(TenantSpec(ANONYMOUS, "-" * 16, admin=True, allow_shm=True), "", b"")
            self._tenants[ANONYMOUS] = self.anonymous
        self.refresh_usage()  # what earlier runs left counts against each quota from the start
        self.arena: str | None = store.arena  # the shared-memory tier leases live in
        self.kv_events: Any = None
        """The KV event publisher (kvstore/server/kvevents.py) when [events] publish is set."""
        self.handoffs: Any = None
        """Prefill -> decode handoffs (kvstore/server/handoff.py), set by the daemon."""

    # ---- tenants ------------------------------------------------------------------------------

    def authenticate(self, token: str | None) -> Tenant:
        if self.anonymous is not None:
            return self.anonymous
        if not token:
            raise AuthError("this daemon requires a bearer token: pass token=... to kvstore.client.connect")
        for known, tenant in self._by_token.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return tenant
        raise AuthError("unknown bearer token; check the token configured for your tenant")

    def accepts(self, token: str | None) -> bool:
        """Whether ``token`` authenticates (for the connection gate: an HTTP connection that
        sent one is never closed to make room for an unauthenticated one)."""
        try:
            self.authenticate(token)
        except AuthError:
            return False
        return True

    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def namespace_tenants(self) -> dict[str, str]:
        """``{stored namespace digest (hex): tenant name}`` of every namespace a tenant registered
        (the labels of the per-tenant metrics)."""
        with self._lock:
            return {ns.root.hex(): t.name for t in self._tenants.values() for ns in t.namespaces.values()}

    def store_keys(self, t: Tenant, ns: Namespace, hashes: Sequence[bytes]) -> list[bytes]:
        """The stored keys of a tenant's client hashes in its (stored) namespace ``ns``."""
        if not t.key:
            return list(hashes)
        h = xxhash.xxh3_128_digest
        k = t.key + ns.root
        return [h(k + x) for x in hashes]

    def _check_count(self, n: int) -> None:
        if n > self.limits.max_blocks:
            raise UsageError(f"{n} blocks exceed the limit of {self.limits.max_blocks} per request; split it")

    # ---- namespaces ---------------------------------------------------------------------------

    def register(self, t: Tenant, ns: Namespace, ttl_s: float | None = None) -> tuple[bytes, list[dict[str, Any]]]:
        """Register ``ns`` for tenant ``t``; returns its id (the client's namespace root) and
        the layout conflicts it met: the tenant's registered namespaces of the same model
        deployment with another layout, in the tenant's own namespace ids (the store logs and
        counts them too). Everything is checked before the store sees it: a refused
        registration is never written."""
        if ns.tenant_salt:
            raise UsageError("tenant_salt is chosen by the server; leave it empty in the namespace")
        if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s > 0):
            raise UsageError(f"ttl_s must be a positive, finite number of seconds, got {ttl_s!r}")
        if ns.block_bytes > self.limits.max_payload_bytes:
            # Such a block could never travel the data plane: refuse it now, not at each put.
            raise UsageError(
                f"a block of this namespace holds {ns.block_bytes} bytes, more than the daemon's "
                f"max_payload of {self.limits.max_payload_bytes}; use fewer tokens per block"
            )
        stored = replace(ns, tenant_salt=t.salt) if t.salt else ns
        with t.pin_lock:  # one registration of a tenant at a time: the count below stays true
            if bytes(ns.root) not in t.namespaces:
                self._check_namespace_limit(t, stored)
            self.store.events.set_tenant(stored.root, t.name)  # the access log names the tenant
            self.store.register_namespace(stored, ttl_s)
            with self._lock:
                t.namespaces[bytes(ns.root)] = stored
            # In the tenant's view: the unsalted namespaces, whose roots are its namespace ids.
            others = [replace(o, tenant_salt="") for o in self.store.layout_conflicts(stored)]
        return bytes(ns.root), layout_conflicts(ns, others)

    def _check_namespace_limit(self, t: Tenant, stored: Namespace) -> None:
        """QuotaExceededError when a new namespace would take the tenant past
        ``max_namespaces_per_tenant`` (counted in the store, so registrations of earlier runs
        count too; re-registering one it has is always allowed)."""
        limit = self.limits.max_namespaces_per_tenant
        mine = {bytes(n.root) for n, _ in self.store.namespaces() if n.tenant_salt == t.salt}
        if bytes(stored.root) not in mine and len(mine) >= limit:
            raise QuotaExceededError(
                f"tenant {t.name!r} has {len(mine)} namespaces, the daemon's limit per tenant "
                f"(max_namespaces_per_tenant = {limit}); reuse a registered namespace (one per "
                "model deployment and layout), or raise the limit in [server]"
            )

    def namespace(self, t: Tenant, ns_id: bytes) -> Namespace:
        try:
            return t.namespaces[bytes(ns_id)]
        except KeyError:
            raise UnknownNamespaceError(
                f"namespace {bytes(ns_id).hex()} is not registered for tenant {t.name!r}; "
                "register it first (client.register_namespace(ns) or POST /v1/namespaces)"
            ) from None

    def list_namespaces(self, t: Tenant) -> list[tuple[bytes, Namespace]]:
        with self._lock:
            return list(t.namespaces.items())

    # ---- lookups and blocks -------------------------------------------------------------------

    def _resolve(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> tuple[Namespace, list[bytes]]:
        """The stored namespace and keys of a request, limits checked first."""
        self._check_count(len(hashes))
        ns = self.namespace(t, ns_id)
        return ns, self.store_keys(t, ns, hashes)

    def lookup(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> LookupResult:
        return self.store.lookup(*self._resolve(t, ns_id, hashes))

    def peek(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> LookupResult:
        """:meth:`lookup` for the daemon's own checks: not counted (KVStore.peek)."""
        return self.store.peek(*self._resolve(t, ns_id, hashes))

    def lookup_nowait(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> LookupResult | None:
        """:meth:`lookup` answered from memory without waiting, or None (see KVStore.lookup_nowait)."""
        return self.store.lookup_nowait(*self._resolve(t, ns_id, hashes))

    def lookup_tokens(self, t: Tenant, ns_id: bytes, tokens: Any) -> LookupResult:
        if len(tokens) > self.limits.max_tokens:
            raise UsageError(f"{len(tokens)} tokens exceed the limit of {self.limits.max_tokens}")
        stored = self.namespace(t, ns_id)
        client_ns = replace(stored, tenant_salt="")  # the client hashes without the salt
        return self.lookup(t, ns_id, hash_blocks(client_ns, tokens))

    def block_bytes(self, t: Tenant, ns_id: bytes) -> int:
        return self.namespace(t, ns_id).block_bytes

    def get_into(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], dst: Any) -> int:
        n = self.store.get_into(*self._resolve(t, ns_id, hashes), dst)
        self._pump()
        return n

    def _pump(self) -> None:
        """The KV event publisher publishes what the call just changed, here (kvevents.pump)."""
        if self.kv_events is not None:
            self.kv_events.pump()

    def acquire_nowait(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> Lease | None:
        """A client's :meth:`acquire` served at once from the arena, or None (see
        ``KVStore.acquire_nowait``: run :meth:`acquire` on a worker thread)."""
        return self._acquire(t, ns_id, hashes, True, nowait=True)

    def acquire(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], *, for_client: bool = True) -> Lease:
        """A lease on the blocks in the arena. ``for_client=False``: the daemon itself sends them
        (TCP, UCX) straight from the arena, which needs no shared-memory grant.

        A client's leases count against the tenant's share of the arena
        (``max_lease_fraction`` of the first tier): blocks held in use can neither move nor
        leave, so one tenant's unreleased leases would otherwise fill the arena for everyone.
        The request is cut to what fits; nothing fits: QuotaExceededError."""
        lease = self._acquire(t, ns_id, hashes, for_client, nowait=False)
        assert lease is not None
        return lease

    def _acquire(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], for_client: bool, *,
                 nowait: bool) -> Lease | None:
        if for_client and not t.spec.allow_shm:
            raise ForbiddenError(
                f"tenant {t.name!r} may not map the shared arena; use the TCP data plane "
                "(or set allow_shm = true for it in [[tenants]])"
            )
        ns, keys = self._resolve(t, ns_id, hashes)
        if not for_client:
            lease = self.store.acquire(ns, keys)
            self._pump()
            return lease
        cap = self.lease_cap_bytes
        with self._lock:
            room = max(0, cap - t.leased_bytes) // ns.block_bytes
            if room == 0 and keys:
                raise QuotaExceededError(
                    f"tenant {t.name!r} holds {t.leased_bytes} bytes of leases, its share of the arena "
                    f"({cap} bytes, max_lease_fraction); release leases before taking more"
                )
            keys = keys[:room]
            t.leased_bytes += len(keys) * ns.block_bytes  # reserved until the lease is known
        got: Lease | None = None
        try:
            got = self.store.acquire_nowait(ns, keys) if nowait else self.store.acquire(ns, keys)
        finally:
            with self._lock:
                t.leased_bytes -= len(keys) * ns.block_bytes
                if got is not None:
                    t.leased_bytes += sum(size for _, size in got.locations)
        if got is not None:
            self._pump()
        return got

    def release(self, lease: Lease, t: Tenant | None = None) -> None:
        """Give a lease back; ``t``: the tenant whose share it counted in (a client's lease)."""
        self.store.release(lease)
        self._released(lease, t)

    def release_nowait(self, lease: Lease, t: Tenant | None = None) -> bool:
        """:meth:`release` if the store can take it back at once (True), else nothing (False:
        run :meth:`release` on a worker thread)."""
        if not self.store.release_nowait(lease):
            return False
        self._released(lease, t)
        return True

    def _released(self, lease: Lease, t: Tenant | None) -> None:
        if t is not None:
            with self._lock:
                t.leased_bytes -= sum(size for _, size in lease.locations)

    @property
    def lease_cap_bytes(self) -> int:
        """The bytes of the arena one tenant's leases may hold (all of it when it is the only
        tenant: there is nobody to starve)."""
        share = self.limits.max_lease_fraction if len(self._tenants) > 1 else 1.0
        arena = self.store.arena_tier
        return int(arena.usage().capacity_bytes * share) if arena is not None else 0

    def reserve(self, t: Tenant, ns_id: bytes, n_hashes: int, start: int) -> Reservation:
        """Admit a put of ``n_hashes`` blocks from ``start`` against the tenant's quota *before*
        its payload is read: the bytes are reserved (so parallel puts cannot pass the quota
        together); give them back with :meth:`unreserve` after the put (as :meth:`put` does
        with ``reserved=``). QuotaExceededError when they do not fit."""
        self._check_count(n_hashes)
        ns = self.namespace(t, ns_id)
        incoming = max(0, n_hashes - start) * ns.block_bytes
        quota = t.spec.quota_bytes
        if not quota:
            return Reservation(t, incoming, held=False)
        for refreshed in (False, True):
            with self._lock:
                if t.used_bytes + t.reserved_bytes + incoming <= quota:
                    t.reserved_bytes += incoming
                    return Reservation(t, incoming)
            if not refreshed:
                self.refresh_usage()  # evictions may have freed room since the last refresh
        raise QuotaExceededError(
            f"tenant {t.name!r} uses {t.used_bytes} of its {quota}-byte quota ({t.reserved_bytes} more "
            f"are being put); this put needs {incoming} more: evict or unpin prefixes, or raise the quota"
        )

    def unreserve(self, r: Reservation) -> None:
        """Give ``r``'s bytes back; a second call does nothing."""
        with self._lock:
            if r.held:
                r.held = False
                r.tenant.reserved_bytes -= r.nbytes

    def put(
        self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], blocks: Any, start: int = 0,
        durable: bool = False, *, reserved: Reservation | None = None, tokens: Any | None = None,
    ) -> int:
        """Put blocks ``start..`` of ``hashes``. ``reserved``: what :meth:`reserve` admitted
        for it (given back here, once); None reserves now. ``tokens``: the token ids of the blocks
        put, for the KV event publisher (``KVStore.put``)."""
        if reserved is None:
            reserved = self.reserve(t, ns_id, len(hashes), start)
        try:
            ns, keys = self._resolve(t, ns_id, hashes)
            if self.kv_events is not None:  # names the put's blocks for the KV event publisher
                self.kv_events.names(ns, hashes, keys, start)
            epoch = self._usage_epoch
            new = self.store.put(ns, keys, blocks, start=start, durable=durable, tokens=tokens)
            with self._lock:
                overlapped = self._usage_epoch != epoch
                if not overlapped:
                    t.used_bytes += new * ns.block_bytes
            if overlapped and new:
                self.refresh_usage()  # a refresh overlapped the store call: recount, never add twice
            self._pump()
            return new
        finally:
            self.unreserve(reserved)

    def put_device(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], start: int,
                   fill: Callable[[SlotReservation], int]) -> int:
        """A put whose payloads the daemon writes itself into the arena slots of a store
        reservation (PUT_DEVICE): quota admitted first, as :meth:`put`; ``fill(reservation)``
        writes the leading slots and returns how many it wrote; those are committed, the rest
        given back (an exception: nothing is stored). Returns how many blocks were new."""
        reserved = self.reserve(t, ns_id, len(hashes), start)
        try:
            ns, keys = self._resolve(t, ns_id, hashes)
            if self.kv_events is not None:
                self.kv_events.names(ns, hashes, keys, start)
            epoch = self._usage_epoch
            res = self.store.reserve(ns, keys, start=start)
            try:
                new = res.commit(fill(res))
            finally:
                res.abort()  # (nothing after the commit)
            with self._lock:
                overlapped = self._usage_epoch != epoch
                if not overlapped:
                    t.used_bytes += new * ns.block_bytes
            if overlapped and new:
                self.refresh_usage()
            self._pump()
            return new
        finally:
            self.unreserve(reserved)

    def pin(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], until: float | None = None) -> int:
        """As :meth:`KVStore.pin`: ``until`` (wall-clock seconds) makes it a retention guarantee
        (RetentionError, HTTP 409, when the store cannot honour it, or when it would take the
        tenant's guarantees past its ``pin_quota``).

        Quota: a tenant pins only blocks it has cached, which count against its quota (pinned
        or not) until they leave, so its pins never hold more than its quota. A tenant already
        over its quota (it was lowered) may not pin until it is back under: a pin would keep
        those bytes past eviction. A tenant holds at most ``max_pins_per_tenant`` pin records
        (every pin rewrites ``pins.json`` under the store's lock)."""
        ns, keys = self._resolve(t, ns_id, hashes)
        quota = t.spec.quota_bytes
        if quota:
            self.refresh_usage()  # pins are rare; the count must be today's, not the last refresh's
            if t.used_bytes > quota:
                raise QuotaExceededError(
                    f"tenant {t.name!r} caches {t.used_bytes} bytes, over its {quota}-byte quota, so it may not "
                    "pin (a pin keeps bytes past eviction): evict or unpin prefixes, or raise the quota"
                )
        with t.pin_lock:  # one pin of a tenant at a time: each sees the others' records and bytes
            self._check_pin_count(t)
            if until is None or t.spec.pin_quota_bytes is None or not until > self.clock():
                return self.store.pin(ns, keys, until=until)  # (the store refuses a past deadline)
            keys = keys[: self._cached_prefix(ns, keys)]  # what the store would pin, and no more
            self._check_pin_quota(t, ns, keys)
            return self.store.pin(ns, keys, until=until)

    def _check_pin_count(self, t: Tenant) -> None:
        limit = self.limits.max_pins_per_tenant
        have = len(self._tenant_pins(t))
        if have >= limit:
            raise QuotaExceededError(
                f"tenant {t.name!r} holds {have} pins, the daemon's limit per tenant "
                f"(max_pins_per_tenant = {limit}); unpin prefixes it no longer needs (GET /v1/pins "
                "lists them), pin longer prefixes instead of many short ones, or raise the limit"
            )

    def _cached_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` a pin would take now: the index's match (cached, on a
        reachable tier, unexpired or pinned), through the store's public lookup. Passing only
        those to the store keeps a put that extends the chain meanwhile out of a pin whose bytes
        were already counted."""
        return self.store.peek(ns, keys).num_blocks

    def _check_pin_quota(self, t: Tenant, ns: Namespace, keys: Sequence[bytes]) -> None:
        """RetentionError unless the tenant's guarantees, with these blocks, fit its pin_quota
        (a block held by several of its guarantees, or already held, counts once)."""
        limit = t.spec.pin_quota_bytes
        if limit is None:
            return
        held = self._guaranteed(t, self.clock())
        add = {bytes(k): ns.block_bytes for k in keys if bytes(k) not in held}
        have = sum(held.values())
        need = sum(add.values())
        if need and have + need > limit:
            raise RetentionError(
                f"cannot guarantee {len(keys)} blocks: tenant {t.name!r} holds {have} bytes in "
                f"retention guarantees and this one would add {need}, over its pin_quota of "
                f"{limit} bytes; unpin guarantees it no longer needs (GET /v1/pins lists them), "
                "pin a shorter prefix, or raise pin_quota in its [[tenants]] entry"
            )

    def _tenant_pins(self, t: Tenant) -> list[tuple[PinRecord, bytes, Namespace]]:
        """The store's pin records in the tenant's namespaces, each with the client's namespace
        id and the stored namespace. By salt, not by ``t.namespaces``: after a restart the
        tenant's guarantees count before it registers its namespaces again."""
        mine: dict[bytes, tuple[bytes, Namespace]] = {}
        for ns, _ in self.store.namespaces():
            if ns.tenant_salt == t.salt:
                client = replace(ns, tenant_salt="") if t.salt else ns
                mine[bytes(ns.root)] = (bytes(client.root), ns)
        return [(r, *mine[r.ns]) for r in self.store.pins() if r.ns in mine]

    def _guaranteed(self, t: Tenant, now: float) -> dict[bytes, int]:
        """``{stored key: bytes}`` of every block a guarantee of the tenant holds now."""
        out: dict[bytes, int] = {}
        for r, _, ns in self._tenant_pins(t):
            if r.until is not None and r.until > now:
                out.update(dict.fromkeys(r.hashes, ns.block_bytes))
        return out

    def list_pins(self, t: Tenant, ns_id: bytes | None = None) -> dict[str, Any]:
        """The tenant's pins (all, or of its namespace ``ns_id``), in its own namespace ids.
        Rows carry no block hashes: stored keys are salted, and the client's hashes cannot be
        recovered from them."""
        now = self.clock()
        pins = [(r, c, ns) for r, c, ns in self._tenant_pins(t) if ns_id is None or c == bytes(ns_id)]
        rows = [
            {"ns": c.hex(), "model_id": ns.model_id, "blocks": len(r.hashes),
             "bytes": len(r.hashes) * ns.block_bytes, "until": r.until,
             "active": r.until is None or r.until > now}
            for r, c, ns in pins if r.hashes
        ]
        return {
            "pins": rows,
            "summary": pin_summary([r for r, _, _ in pins], now),
            "guaranteed_bytes": sum(self._guaranteed(t, now).values()),
            "pin_quota_bytes": t.spec.pin_quota_bytes,
        }

    def unpin(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """As :meth:`KVStore.unpin`: undoes one pin of the longest pinned prefix of ``hashes``
        (a guarantee too, but only whole), else takes them out of an untimed pin."""
        return self.store.unpin(*self._resolve(t, ns_id, hashes))

    def evict(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        return self.store.delete(*self._resolve(t, ns_id, hashes))

    # ---- usage --------------------------------------------------------------------------------

    def refresh_usage(self) -> None:
        """Recompute each tenant's bytes from the store (evictions and expiry free quota).

        By the namespaces' salts, not the tenant's registrations: after a restart the blocks
        of earlier runs count before the tenant registers their namespaces again (counted only
        once registered, a tenant could put a quota's worth more in each new run)."""
        usage = self.store.namespace_usage()
        used = {t.salt: 0 for t in self._tenants.values()}
        for ns, _ in self.store.namespaces():
            if ns.tenant_salt in used:
                used[ns.tenant_salt] += usage.get(bytes(ns.root), (0, 0))[1]
        with self._lock:
            self._usage_epoch += 1
            for t in self._tenants.values():
                t.used_bytes = used[t.salt]

    def usage(self, t: Tenant) -> dict[str, Any]:
        return {
            "tenant": t.name,
            "used_bytes": t.used_bytes,
            "quota_bytes": t.spec.quota_bytes,
            "pin_quota_bytes": t.spec.pin_quota_bytes,
            "namespaces": len(t.namespaces),
            "reserved_bytes": t.reserved_bytes,
            "leased_bytes": t.leased_bytes,
        }


def classify(exc: BaseException) -> tuple[ErrorCode, int]:
    """The data-plane error code and HTTP status of an error raised by a request."""
    for cls, code, status in _ERRORS:
        if isinstance(exc, cls):
            return code, status
    return ErrorCode.INTERNAL, 500


_ERRORS: tuple[tuple[type[BaseException], ErrorCode, int], ...] = (
    (AuthError, ErrorCode.UNAUTHENTICATED, 401),
    (ForbiddenError, ErrorCode.FORBIDDEN, 403),
    (QuotaExceededError, ErrorCode.QUOTA, 507),
    (UnknownNamespaceError, ErrorCode.NOT_FOUND, 404),
    (BlockNotFound, ErrorCode.NOT_FOUND, 404),  # an admin call naming a block that is not cached
    (LayoutMismatchError, ErrorCode.CONFLICT, 409),
    # A retention guarantee the store cannot give (its pin budget or persistent tier is full):
    # a conflict with the store's state, not a malformed request.
    (RetentionError, ErrorCode.CONFLICT, 409),
    (MissingPrefixError, ErrorCode.CONFLICT, 409),
    (TierFullError, ErrorCode.FULL, 507),
    # A device or remote store failed (disk full, read-only, S3 down): the request that needed
    # it fails with the tier's own message; the connection and every other client carry on.
    (TierIOError, ErrorCode.UNAVAILABLE, 503),
    (UsageError, ErrorCode.BAD_REQUEST, 400),
)
