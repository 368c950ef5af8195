"""Prometheus metrics: the daemon's own counters plus the store's, read at scrape time.

A registry per daemon (not the process-global one) so that several daemons in one process
(tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        hits = CounterMetricFamily("kvstore_hit_blocks", "Blocks served from cache, by the tier that served them", labels=["tier"])
        for tier, n in s["hits_by_tier"].items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily("kvstore_lookup_blocks", "Blocks asked for by lookups and loads", value=s["lookup_blocks"])
        yield CounterMetricFamily(
            "kvstore_miss_blocks", "Blocks asked for and not cached", value=s["lookup_blocks"] - s["hit_blocks"]
        )
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


class Metrics:
    def __init__(self, store_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "kvstore_request_seconds", "Request latency in the daemon", ["plane", "op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.requests = Counter("kvstore_requests", "Requests by outcome", ["plane", "op", "outcome"], registry=r)
        self.bytes = Counter("kvstore_bytes", "Payload bytes moved", ["plane", "direction"], registry=r)
        self.connections = Gauge("kvstore_connections", "Open data-plane connections", ["plane"], registry=r)
        self.leases = Gauge("kvstore_leases", "Shared-memory leases held by clients", registry=r)
        self.leases_expired = Counter(
            "kvstore_leases_expired", "Leases the daemon took back at their lease_timeout", registry=r)
        self.refused = Counter(
            "kvstore_connections_refused",
            "Connections closed as accepted: over max_connections or max_connections_per_peer", registry=r)
        self.timeouts = Counter(
            "kvstore_connection_timeouts", "Connections closed at a deadline (handshake, frame, request)",
            ["plane", "reason"], registry=r)
        r.register(_StoreCollector(store_stats))

    def observe(self, plane: str, op: str, seconds: float, outcome: str = "ok") -> None:
        self.latency.labels(plane, op).observe(seconds)
        self.requests.labels(plane, op, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
