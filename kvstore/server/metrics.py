"""Prometheus metrics: the daemon's own counters plus the store's, read at scrape time.

A registry per daemon (not the process-global one) so that several daemons in one process
(tests) do not collide; it carries the standard process metrics too (``process_*``).

Lookups and loads are counted apart: a lookup asks what is cached and moves nothing, a load
(``get_into``, ``acquire``) serves blocks. Their hit rates are
``kvstore_lookup_hit_blocks / kvstore_lookup_blocks`` and ``kvstore_load_hit_blocks /
kvstore_load_blocks`` (the same in tokens). Per-namespace and per-tenant series are capped
(``max_namespace_labels``, ``max_tenant_labels``): the first ones to see traffic keep their own
labels for the daemon's life (so each series only grows), the rest add up under ``"other"``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
OTHER = "other"
MAX_NAMESPACE_LABELS = 32
MAX_TENANT_LABELS = 32
UNKNOWN_TENANT = "-"
_OPS = (("lookup", "lookup_blocks", "lookup_hit_blocks"), ("load", "load_blocks", "hit_blocks"))


class _Labels:
    """A capped label set: the first ``cap`` values keep their name, later ones read ``other``."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        if len(self._kept) < self._cap:
            self._kept.add(value)
            return value
        return OTHER


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], tenants: Callable[[], dict[str, str]],
                 max_namespace_labels: int, max_tenant_labels: int) -> None:
        self._stats = stats
        self._tenants = tenants
        self._ns_label = _Labels(max_namespace_labels)
        self._tenant_label = _Labels(max_tenant_labels)

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        yield from self._traffic(s)
        ev = CounterMetricFamily("kvstore_evictions", "Blocks that left the store, by reason", labels=["reason"])
        ev.add_metric(["capacity"], s["evictions"])
        ev.add_metric(["expiry"], s["expirations"])
        ev.add_metric(["corrupt"], s["corrupt_blocks"])
        yield ev
        yield CounterMetricFamily("kvstore_tier_errors", "Reads and writes a tier's device failed", value=s["tier_errors"])
        q = CounterMetricFamily(
            "kvstore_quarantined", "Damaged files moved aside at open (metadata DBs, objects, temp files of "
            "cut-short writes), by tier", labels=["tier"],
        )
        for t in s["tiers"]:
            if "quarantined" in t:
                q.add_metric([t["name"]], t["quarantined"])
        yield q
        yield CounterMetricFamily("kvstore_demotions", "Blocks written down a tier under pressure", value=s["demotions"])
        yield CounterMetricFamily("kvstore_promotions", "Blocks copied up to the first tier on a hit", value=s["promotions"])
        yield CounterMetricFamily("kvstore_put_blocks", "New blocks stored", value=s["put_blocks"])
        yield CounterMetricFamily(
            "kvstore_skipped_writes", "Demotions into the last tier that admission refused", value=s["skipped_writes"])
        yield CounterMetricFamily(
            "kvstore_skipped_bytes", "Bytes admission kept out of the last tier", value=s["skipped_bytes"])
        yield CounterMetricFamily(
            "kvstore_layout_conflicts", "Namespace registrations that met another layout (block size, dtype, ...) "
            "of the same model deployment: blocks of one never hit the other", value=s["layout_conflicts"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes used per tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks per tier", labels=["tier"])
        for t in s["tiers"]:
            cap.add_metric([t["name"]], t["capacity_bytes"])
            used.add_metric([t["name"]], t["used_bytes"])
            blocks.add_metric([t["name"]], t["blocks"])
        yield cap
        yield used
        yield blocks
        yield GaugeMetricFamily("kvstore_index_blocks", "Blocks in the radix index", value=s["blocks"])

    def _traffic(self, s: dict[str, Any]) -> Iterator[Any]:
        """Lookups and loads apart, in blocks and in tokens; per tier, namespace and tenant."""
        yield CounterMetricFamily("kvstore_lookup_blocks", "Blocks asked for by lookups", value=s["lookup_blocks"])
        yield CounterMetricFamily("kvstore_lookup_hit_blocks", "Leading blocks lookups found cached",
                                  value=s["lookup_hit_blocks"])
        yield CounterMetricFamily("kvstore_load_blocks", "Blocks asked for by loads (get_into, acquire)",
                                  value=s["load_blocks"])
        yield CounterMetricFamily("kvstore_load_hit_blocks", "Blocks loads served", value=s["hit_blocks"])
        miss = CounterMetricFamily("kvstore_miss_blocks", "Blocks asked for and not cached, by lookups and by loads",
                                   labels=["op"])
        miss.add_metric(["lookup"], s["lookup_blocks"] - s["lookup_hit_blocks"])
        miss.add_metric(["load"], s["load_blocks"] - s["hit_blocks"])
        yield miss
        hits = CounterMetricFamily("kvstore_hit_blocks", "Blocks loads served, by the tier that served them",
                                   labels=["tier"])
        for tier, n in s["hits_by_tier"].items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily("kvstore_lookup_tokens", "Tokens asked for by lookups", value=s["lookup_tokens"])
        yield CounterMetricFamily("kvstore_lookup_hit_tokens", "Tokens lookups found cached",
                                  value=s["lookup_hit_tokens"])
        yield CounterMetricFamily("kvstore_requested_tokens", "Tokens asked for by loads", value=s["requested_tokens"])
        yield CounterMetricFamily("kvstore_hit_tokens", "Tokens loads served", value=s["hit_tokens"])
        by_tier = CounterMetricFamily("kvstore_tier_hit_tokens", "Tokens loads served, by the tier that served them",
                                      labels=["tier"])
        for tier, n in s["hit_tokens_by_tier"].items():
            by_tier.add_metric([tier], n)
        yield by_tier
        names = self._tenants()
        ns_req = CounterMetricFamily("kvstore_namespace_requested_tokens", "Tokens asked for, by namespace "
                                     f"(capped; the rest under {OTHER!r}), tenant and op", labels=["ns", "tenant", "op"])
        ns_hit = CounterMetricFamily("kvstore_namespace_hit_tokens", "Tokens found (lookups) or served (loads), by "
                                     "namespace, tenant and op", labels=["ns", "tenant", "op"])
        t_req = CounterMetricFamily("kvstore_tenant_requested_tokens", "Tokens asked for, by tenant "
                                    f"(capped; the rest under {OTHER!r}) and op", labels=["tenant", "op"])
        t_hit = CounterMetricFamily("kvstore_tenant_hit_tokens", "Tokens found (lookups) or served (loads), by "
                                    "tenant and op", labels=["tenant", "op"])
        per_ns: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        per_tenant: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for row in s["namespace_traffic"]:
            tenant = self._tenant_label(names.get(row["ns"], UNKNOWN_TENANT))
            ns = self._ns_label(row["ns"])
            bt = row["block_tokens"]
            for op, asked, hit in _OPS:
                for acc in (per_ns[(ns, tenant if ns != OTHER else OTHER, op)], per_tenant[(tenant, op)]):
                    acc[0] += row[asked] * bt
                    acc[1] += row[hit] * bt
        for labels, (req, n_hit) in per_ns.items():
            ns_req.add_metric(list(labels), req)
            ns_hit.add_metric(list(labels), n_hit)
        for t_labels, (req, n_hit) in per_tenant.items():
            t_req.add_metric(list(t_labels), req)
            t_hit.add_metric(list(t_labels), n_hit)
        yield from (ns_req, ns_hit, t_req, t_hit)


class Metrics:
    """``store_stats``: ``KVStore.stats``; ``namespace_tenants``: ``{namespace digest (hex):
    tenant}`` for the per-tenant series (default: every namespace under ``"-"``)."""

    def __init__(self, store_stats: Callable[[], dict[str, Any]],
                 namespace_tenants: Callable[[], dict[str, str]] | None = None, *,
                 max_namespace_labels: int = MAX_NAMESPACE_LABELS, max_tenant_labels: int = MAX_TENANT_LABELS) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds, resident memory, open fds, start time
        PlatformCollector(registry=r)
        self.latency = Histogram(
            "kvstore_request_seconds", "Request latency in the daemon", ["plane", "op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.put_device = Histogram(
            "kvstore_put_device_seconds",
            "PUT_DEVICE by phase: reserve (quota and arena slots), queue (the DMAs out of the engine's GPU "
            "memory issued), wait (until they landed), commit; dma (the DMAs' device time, from the engine's "
            "event to their end, within queue and wait, where the CUDA runtime can time them)",
            ["phase"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.put_device_timeouts = Counter(
            "kvstore_put_device_timeouts",
            "PUT_DEVICEs failed at put_device_timeout (the engine's CUDA event had not completed): their "
            "arena slots are set aside until the copies land", registry=r)
        self.put_device_quarantined = Gauge(
            "kvstore_put_device_quarantined_slots",
            "Arena slots set aside for PUT_DEVICE copies past their deadline that have not landed yet",
            registry=r)
        self.requests = Counter("kvstore_requests", "Requests by outcome", ["plane", "op", "outcome"], registry=r)
        self.bytes = Counter("kvstore_bytes", "Payload bytes moved", ["plane", "direction"], registry=r)
        self.connections = Gauge("kvstore_connections", "Open data-plane connections", ["plane"], registry=r)
        self.leases = Gauge("kvstore_leases", "Shared-memory leases held by clients", registry=r)
        self.leases_expired = Counter(
            "kvstore_leases_expired", "Leases the daemon took back at their lease_timeout", registry=r)
        self.refused = Counter(
            "kvstore_connections_refused",
            "Connections closed over max_connections or max_connections_per_peer: refused as accepted, "
            "or an unauthenticated one closed to admit a newer connection", registry=r)
        self.timeouts = Counter(
            "kvstore_connection_timeouts", "Connections closed at a deadline (handshake, frame, request)",
            ["plane", "reason"], registry=r)
        r.register(_StoreCollector(store_stats, namespace_tenants or dict, max_namespace_labels, max_tenant_labels))

    def observe(self, plane: str, op: str, seconds: float, outcome: str = "ok") -> None:
        self.latency.labels(plane, op).observe(seconds)
        self.requests.labels(plane, op, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
