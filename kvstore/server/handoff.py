"""Prefill -> decode handoff through the store: a request's KV held for a decode engine.

A prefill engine puts a request's blocks (the data plane, as any put) and then *offers* them
under its request id (``POST /v1/handoffs``): the daemon pins the chain for ``ttl_s`` and
records the handoff in ``<root>/handoffs.json`` (written atomically and synced, so a handoff
outlives a crash of the daemon). A decode engine on another node loads the blocks by hash from
this daemon (TCP or UCX: :func:`kvstore.route.handoff.receive`) and *confirms*
(``POST /v1/handoffs/{id}/confirm``), which releases the pin; a handoff nobody confirms is
released at its deadline by the daemon's maintenance.

Two kinds, as the prefill side chooses:

* ``durable``: the pin is a retention guarantee until the deadline (``KVStore.pin(until=)``):
  the chain is copied to the first persistent tier, synced, before the offer returns; it
  survives a restart of the daemon, and the store releases it at the deadline by itself.
* volatile (default): an untimed pin that this registry takes back at confirm or deadline;
  the blocks stay where the put left them (DRAM), so a crash loses them.

After a restart every recorded handoff is checked against the store: whole ones are served as
before; one that lost blocks is reported ``lost`` (``GET /v1/handoffs/{id}``), and the decode
side recomputes. Every method blocks (store I/O): the event loop calls them in the pool.

Bounds, in bytes (``docs/reliability.md``, "Every queue of the daemon and its bound"): a
tenant's open handoffs hold at most ``[server] max_handoff_bytes_per_tenant`` of records (each
names its blocks: :data:`KEY_BYTES` a block), an offer past it is refused (507) and counted;
finished handoffs are kept for status queries within ``[server] handoff_history_bytes`` (all
tenants together; a record lets go of its block keys when it finishes), the oldest forgotten
first (counted, logged once per burst). Both in :meth:`Handoffs.collector`.
"""

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from kvstore.clock import Clock
from kvstore.errors import (
    BlockNotFound,
    ForbiddenError,
    MissingPrefixError,
    QuotaExceededError,
    TierIOError,
    UsageError,
)
from kvstore.keys import Namespace
from kvstore.server.service import Service, Tenant
from kvstore.store import atomic_write

log = logging.getLogger(__name__)

HANDOFFS_FILE = "handoffs.json"
MAX_TTL_S = 3600.0
"""A handoff is short: a longer hold is a pin (``POST /v1/pin``), not a handoff."""
RECORD_BYTES = 640
"""What a handoff record costs besides its strings' characters and its block keys: the record,
its ids as hex strings, its key in the registry and the registry's entry."""
KEY_BYTES = 89
"""What each block key of an open handoff costs (a 32-character hex string and its slot)."""


def record_bytes(request_id: str, tenant: str, keys: int, reason: str = "") -> int:
    """What a handoff record with ``keys`` block keys costs in the daemon's memory (from above)."""
    return RECORD_BYTES + len(request_id) + len(tenant) + len(reason) + KEY_BYTES * keys
STATES = ("ready", "released", "expired", "lost")
_RID = r"^[A-Za-z0-9._:-]{1,128}$"


@dataclass(slots=True)
class Handoff:
    request_id: str
    tenant: str
    ns: str  # the client's namespace id (hex)
    stored_ns: str  # the namespace digest the store keeps (hex)
    keys: list[str]  # stored block keys (hex)
    deadline: float
    durable: bool
    state: str = "ready"
    reason: str = ""
    blocks: int = -1
    """How many blocks it names (its ``keys`` go once it is finished and released)."""

    def __post_init__(self) -> None:
        if self.blocks < 0:
            self.blocks = len(self.keys)

    def nbytes(self, keys: bool = True) -> int:
        """What the record costs in the daemon's memory (an estimate from above); without its
        keys: as it is kept once finished."""
        return record_bytes(self.request_id, self.tenant, len(self.keys) if keys else 0, self.reason)

    def view(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "ns": self.ns, "blocks": self.blocks,
                "deadline": self.deadline, "durable": self.durable, "state": self.state,
                "reason": self.reason}


class Handoffs:
    """The daemon's handoffs (see the module docstring). Thread-safe."""

    def __init__(self, service: Service, root: Path, clock: Clock) -> None:
        self.service = service
        self.store = service.store
        self.clock = clock
        self.path = Path(root) / HANDOFFS_FILE
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], Handoff] = {}
        self._done: OrderedDict[tuple[str, str], Handoff] = OrderedDict()
        self._open_bytes: Counter[str] = Counter()
        """Per tenant: the bytes of its open handoffs, and of offers on their way in."""
        self._done_bytes = 0
        self.refused = 0
        """Offers refused over ``max_handoff_bytes_per_tenant``."""
        self.forgotten = 0
        """Finished handoffs forgotten to stay within ``handoff_history_bytes``."""
        self._warned: dict[str, float] = {}
        self.lost_at_start: list[Handoff] = []
        self._load()

    # ---- the API --------------------------------------------------------------------------------

    def offer(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], request_id: str, ttl_s: float,
              durable: bool = False) -> dict[str, Any]:
        """Hold the (already stored) chain ``hashes`` for ``ttl_s`` under ``request_id``."""
        if not 0 < ttl_s <= MAX_TTL_S:
            raise UsageError(f"ttl_s={ttl_s} is outside (0, {MAX_TTL_S:.0f}]; a longer hold is a pin")
        if not hashes:
            raise UsageError("a handoff needs the request's block hashes")
        self.expire()
        key = (t.name, request_id)
        with self._lock:
            known = self._open.get(key)
        if known is not None:  # an offer retried after a lost answer
            return known.view()
        cost = record_bytes(request_id, t.name, len(hashes))
        self._reserve(t, cost)
        try:
            return self._offer(t, ns_id, hashes, request_id, ttl_s, durable)
        finally:
            with self._lock:
                self._open_bytes[t.name] -= cost  # the record counts itself, if it was made

    def _reserve(self, t: Tenant, cost: int) -> None:
        limit = self.service.limits.max_handoff_bytes_per_tenant
        with self._lock:
            have = self._open_bytes[t.name]
            if have + cost > limit:
                self.refused += 1
                self._warn("refused", "handoff: refusing offers over max_handoff_bytes_per_tenant (%d bytes; "
                           "tenant %r holds %d); %d refused so far", limit, t.name, have, self.refused)
                raise QuotaExceededError(
                    f"tenant {t.name!r} holds {have} bytes of open handoffs; this one ({cost} bytes, "
                    f"~{KEY_BYTES} a block) would pass the daemon's limit per tenant "
                    f"(max_handoff_bytes_per_tenant = {limit}): confirm the handoffs decode engines have "
                    "taken, offer shorter ones, or raise the limit"
                )
            self._open_bytes[t.name] += cost

    def _offer(self, t: Tenant, ns_id: bytes, hashes: Sequence[bytes], request_id: str, ttl_s: float,
               durable: bool) -> dict[str, Any]:
        key = (t.name, request_id)
        cached = self.service.lookup(t, ns_id, hashes).num_blocks
        if cached < len(hashes):
            raise MissingPrefixError(
                f"block {cached} of the {len(hashes)} offered is not cached: put the request's KV "
                "first, then offer it"
            )
        deadline = self.clock() + ttl_s
        pinned = self.service.pin(t, ns_id, hashes, deadline if durable else None)
        if pinned < len(hashes):  # evicted between the lookup and the pin: take back what held
            stored = self.service.namespace(t, ns_id)
            self._unpin_keys(stored, self.service.store_keys(t, stored, hashes[:pinned]), deadline if durable else None)
            raise MissingPrefixError(f"only {pinned} of {len(hashes)} blocks were still cached; put them again")
        stored = self.service.namespace(t, ns_id)
        h = Handoff(request_id, t.name, bytes(ns_id).hex(), bytes(stored.root).hex(),
                    [k.hex() for k in self.service.store_keys(t, stored, hashes)], deadline, durable)
        with self._lock:
            if key in self._open:  # the same offer twice at once: the later record stays, as before
                self._close(self._open[key])
            self._open[key] = h
            self._open_bytes[t.name] += h.nbytes()
            self._save()
        return h.view()

    def status(self, t: Tenant, request_id: str) -> dict[str, Any]:
        self.expire()  # a deadline that passed since the last maintenance shows now
        key = (t.name, request_id)
        with self._lock:
            h = self._open.get(key) or self._done.get(key)
        if h is None:
            raise BlockNotFound(f"no handoff {request_id!r} for tenant {t.name!r} (never offered, or long gone)")
        return h.view()

    def confirm(self, t: Tenant, request_id: str) -> dict[str, Any]:
        """The decode side has the KV: release the hold (idempotent). Past the deadline it is
        ``expired`` already: the KV may still have been loaded, but nothing held it."""
        self.expire()
        key = (t.name, request_id)
        with self._lock:
            h = self._open.get(key)
            if h is None:
                done = self._done.get(key)
                if done is None:
                    raise BlockNotFound(f"no handoff {request_id!r} for tenant {t.name!r}")
                return done.view()
            self._close(h)
            self._finish(h, "released")
            self._save()
        self._release(h)
        return h.view()

    def expire(self) -> int:
        """Release every handoff past its deadline (the daemon's maintenance calls it)."""
        now = self.clock()
        with self._lock:
            due = [h for h in self._open.values() if h.deadline <= now]
            for h in due:
                self._close(h)
                self._finish(h, "expired", "nobody confirmed it before the deadline")
            if due:
                self._save()
        for h in due:
            self._release(h)
        return len(due)

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = dict.fromkeys(STATES, 0)
            out["ready"] = len(self._open)
            for h in self._done.values():
                out[h.state] += 1
            return out

    # ---- internals ------------------------------------------------------------------------------

    def collector(self) -> Any:
        """A Prometheus collector (``/metrics``): ``kvstore_handoffs_refused_total`` (offers past
        ``max_handoff_bytes_per_tenant``), ``kvstore_handoffs_forgotten_total`` (finished
        handoffs let go of past ``handoff_history_bytes``; a status query of one answers 404)
        and ``kvstore_handoffs_held_bytes{state}`` (``open``, ``finished``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.registry import Collector

        reg = self

        class _Collector(Collector):
            def collect(self) -> Any:
                yield CounterMetricFamily("kvstore_handoffs_refused", "Handoff offers refused over "
                                          "max_handoff_bytes_per_tenant", value=reg.refused)
                yield CounterMetricFamily("kvstore_handoffs_forgotten", "Finished handoffs forgotten to stay "
                                          "within handoff_history_bytes", value=reg.forgotten)
                held = GaugeMetricFamily("kvstore_handoffs_held_bytes", "Bytes of handoff records the daemon "
                                         "holds", labels=["state"])
                b = reg.held_bytes()
                held.add_metric(["open"], b["open"])
                held.add_metric(["finished"], b["finished"])
                yield held

        return _Collector()

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the records held: ``open`` (all tenants, with offers on their way in) and
        ``finished``."""
        with self._lock:
            return {"open": sum(self._open_bytes.values()), "finished": self._done_bytes}

    # ---- internals ------------------------------------------------------------------------------

    def _warn(self, what: str, msg: str, *args: Any) -> None:
        """``msg`` once per burst of ``what`` (one line per 10 s at most)."""
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            log.warning(msg, *args)

    def _close(self, h: Handoff) -> None:
        """``h`` is no longer open (with the lock held)."""
        del self._open[(h.tenant, h.request_id)]
        self._open_bytes[h.tenant] -= h.nbytes()
        if self._open_bytes[h.tenant] <= 0:
            del self._open_bytes[h.tenant]

    def _finish(self, h: Handoff, state: str, reason: str = "") -> None:
        """Keep ``h`` for status queries (with the lock held); the oldest finished ones go past
        ``handoff_history_bytes``. Its keys stay until :meth:`_release` has used them."""
        h.state, h.reason = state, reason
        old = self._done.pop((h.tenant, h.request_id), None)
        if old is not None:
            self._done_bytes -= old.nbytes(keys=False)
        self._done[(h.tenant, h.request_id)] = h
        self._done_bytes += h.nbytes(keys=False)  # (as it is kept once released)
        limit, gone = self.service.limits.handoff_history_bytes, 0
        while self._done_bytes > limit and len(self._done) > 1:
            _, first = self._done.popitem(last=False)
            self._done_bytes -= first.nbytes(keys=False)
            gone += 1
        if gone:
            self.forgotten += gone
            self._warn("forgotten", "handoff: forgetting the oldest finished handoffs to stay within "
                       "handoff_history_bytes (%d); a status query of one answers 404; %d forgotten so far",
                       limit, self.forgotten)

    def _stored_ns(self, h: Handoff) -> Namespace | None:
        digest = bytes.fromhex(h.stored_ns)
        for ns, _ in self.store.namespaces():
            if bytes(ns.root) == digest:
                return ns
        return None

    def _release(self, h: Handoff) -> None:
        """Take back the handoff's pin (a durable one past its deadline the store released),
        then let go of its keys: a finished record keeps only their count."""
        if not (h.durable and h.deadline <= self.clock()):
            ns = self._stored_ns(h)
            if ns is not None:
                self._unpin_keys(ns, [bytes.fromhex(k) for k in h.keys], h.deadline if h.durable else None)
        if h.state != "ready":
            h.keys = []

    def _unpin_keys(self, ns: Namespace, keys: Sequence[bytes], until: float | None) -> None:
        """Undo the handoff's own pin (these keys, this deadline; None: untimed): never the
        tenant's own pin or guarantee of the same blocks, which a plain unpin could pick."""
        if keys:
            try:
                self.store.unpin_own(ns, keys, until)
            except TierIOError as e:  # pins.json could not be written: the pin ends at restart
                log.error("handoff: unpin failed: %s", e)

    def _save(self) -> None:
        data = json.dumps([asdict(h) for h in self._open.values()], separators=(",", ":")).encode()
        atomic_write(self.path, data)

    def _load(self) -> None:
        """Handoffs recorded before a restart: whole ones stay ready, the others are lost."""
        try:
            rows = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.error("handoff: cannot read %s (%s); its handoffs are reported lost", self.path, e)
            return
        now = self.clock()
        for row in rows:
            h = Handoff(**row)
            key = (h.tenant, h.request_id)
            ns = self._stored_ns(h)
            left = self.store.lookup(ns, [bytes.fromhex(k) for k in h.keys]).num_blocks if ns else 0
            if h.deadline <= now:
                self._finish(h, "expired", "the deadline passed while the daemon was down")
                self._release(h)
            elif left == len(h.keys):
                self._open[key] = h
                self._open_bytes[h.tenant] += h.nbytes()
            else:
                self._finish(h, "lost", f"the daemon restarted; {left} of {len(h.keys)} blocks survived"
                             + ("" if h.durable else " (a volatile handoff lives in memory)"))
                self.lost_at_start.append(h)
                self._release(h)
        if self.lost_at_start:
            log.warning("handoff: %d handoffs lost in the restart: %s", len(self.lost_at_start),
                        ", ".join(h.request_id for h in self.lost_at_start[:20]))
        self._save()


# ---- HTTP --------------------------------------------------------------------------------------


class OfferIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ns: str = Field(pattern=r"^[0-9a-fA-F]{32}$")
    hashes: list[Annotated[str, Field(pattern=r"^[0-9a-fA-F]{32}$")]]
    request_id: str = Field(pattern=_RID)
    ttl_s: float = Field(gt=0, le=MAX_TTL_S, allow_inf_nan=False)
    durable: bool = False


def handoff_router(service: Service, run: Callable[..., Any], tenant: Callable[..., Any]) -> APIRouter:
    """``/v1/handoffs`` (needs ``service.handoffs``) and ``/v1/events`` (``service.kv_events``);
    ``tenant``: the dependency that authenticates a request. (No ``from __future__ import
    annotations`` here: FastAPI must see the closure's ``Auth``.)"""
    r = APIRouter()
    Auth = Annotated[Tenant, Depends(tenant)]
    Rid = Annotated[str, PathParam(pattern=_RID)]

    def handoffs() -> Handoffs:
        h = getattr(service, "handoffs", None)
        if h is None:
            raise UsageError("this daemon keeps no handoffs")
        return h

    @r.post("/v1/handoffs")
    async def offer(body: OfferIn, t: Auth) -> dict[str, Any]:
        """Hold a stored chain for a decode engine: until confirmed, or ``ttl_s`` at most."""
        if len(body.hashes) > service.limits.max_blocks:
            raise UsageError(f"{len(body.hashes)} hashes exceed the limit of {service.limits.max_blocks}")
        hashes = [bytes.fromhex(h) for h in body.hashes]
        return await run(handoffs().offer, t, bytes.fromhex(body.ns), hashes, body.request_id,
                         body.ttl_s, body.durable)

    @r.get("/v1/handoffs/{request_id}")
    async def status(request_id: Rid, t: Auth) -> dict[str, Any]:
        """``state``: ready, released, expired or lost (with ``reason``)."""
        return await run(handoffs().status, t, request_id)

    @r.post("/v1/handoffs/{request_id}/confirm")
    async def confirm(request_id: Rid, t: Auth) -> dict[str, Any]:
        """The decode side has the KV: release the hold."""
        return await run(handoffs().confirm, t, request_id)

    @r.get("/v1/events")
    async def events(t: Auth, all: bool = False) -> dict[str, Any]:
        """Where this tenant's KV events are published (``all``: every tenant's; admins only)."""
        pub = getattr(service, "kv_events", None)
        if pub is None:
            raise UsageError("this daemon publishes no KV events; set [events] publish = \"tcp://HOST:PORT\"")
        if service.anonymous is not None:
            out = pub.endpoints(None)
        elif all:
            if not t.spec.admin:
                raise ForbiddenError(f"tenant {t.name!r} is not an admin; ask for its own stream (all=false)")
            out = pub.endpoints(None)
        else:
            out = pub.endpoints(t.name)
        if service.anonymous is None:
            out["username"] = t.name  # ZeroMQ PLAIN: this tenant's name, its token the password
        if t.spec.admin:
            out["stats"] = pub.stats()
        return out

    return r
