"""The numbers of a kvreport, from event-log records (kvstore/events.py).

One pass over the records in time order:

* lookups apart (``lookups``: what engines asked was cached; nothing served), the rest is loads;
* achieved: what the store served (``hit_tokens`` by tier and tenant, over time);
* ideal: the same requests replayed through an *unlimited* cache that never forgets (a set of
  every block hash seen so far; a request hits its longest prefix in the set, then adds all its
  blocks). Blocks the real store served that the set has not seen were cached before the log
  began: the ideal counts them too, so it is never below the achieved;
* lost hits (ideal minus achieved, per request) are attributed to why the first missing block
  was gone, from the block events seen so far: *evicted* (by the policy, under capacity),
  *expired* (its TTL ran out), *deleted* (an operator's evict), *corrupt*, *not stored* (a
  request saw it but nothing ever stored it), *other* (the log says it was still cached: an
  unreachable tier, records dropped); the rest of the misses were *never seen* (the ideal misses
  them too), or a possible *namespace mismatch* when another namespace of the same model (a
  different layout) had traffic: the same prompts there could not hit here;
* ages: each hit block's age since it was stored and its idle time since its last use; the
  idle times of hits and of expired lost hits give the hit rate each TTL would have reached;
* admission: the writes to the last tier that admission skipped, and their bytes, from the
  store counters of the usage records.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.events import decode_hashes, decode_key

H = 3600.0
AGE_BUCKETS = (("< 1 h", H), ("1-24 h", 24 * H), ("24-72 h", 72 * H), (">= 72 h", math.inf))
LOST_REASONS = ("evicted", "expired", "deleted", "corrupt", "not_stored", "other", "unknown")
_DEPLOYMENT = ("model_id", "model_revision", "rank", "world_size", "lora_id", "tenant_salt")
_BUCKETS = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400)


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """``prefill_tps``: prefill tokens per second one GPU computes on a miss (a hit saves that
    work); ``gpu_price``: price of one GPU-hour; ``max_buckets``: points of the time series."""

    prefill_tps: float = 25_000.0
    gpu_price: float = 3.0
    currency: str = "$"
    max_buckets: int = 96

    def __post_init__(self) -> None:
        if self.prefill_tps <= 0 or self.gpu_price < 0 or self.max_buckets < 2:
            raise ValueError("prefill_tps must be positive, gpu_price not negative, max_buckets at least 2")


class _Tally:
    """Totals for one group (all requests, one tenant, one time bucket)."""

    __slots__ = ("requests", "hit_requests", "prompt", "hit", "ideal", "by_tier")

    def __init__(self) -> None:
        self.requests = self.hit_requests = self.prompt = self.hit = self.ideal = 0
        self.by_tier: Counter[str] = Counter()

    def add(self, prompt: int, hit: int, ideal: int, by_tier: Mapping[str, int]) -> None:
        self.requests += 1
        self.hit_requests += hit > 0
        self.prompt += prompt
        self.hit += hit
        self.ideal += ideal
        self.by_tier.update(by_tier)


def _deployment(desc: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(desc.get(k) for k in _DEPLOYMENT)


def analyze(records: Iterable[Mapping[str, Any]], cfg: ReportConfig | None = None) -> dict[str, Any]:
    cfg = cfg or ReportConfig()
    namespaces: dict[str, Mapping[str, Any]] = {}
    tiers: list[str] = []
    timed: list[tuple[float, int, Mapping[str, Any]]] = []
    usage: list[Mapping[str, Any]] = []
    for seq, rec in enumerate(records):
        kind = rec.get("type")
        if kind == "namespace":
            namespaces[rec["ns"]] = rec
        elif kind == "header":
            tiers.extend(t for t in rec.get("tiers", []) if t not in tiers)
        elif kind in ("request", "block"):
            timed.append((float(rec["t"]), seq, rec))
        elif kind == "usage":
            usage.append(rec)
    timed.sort(key=lambda x: (x[0], x[1]))
    everything = [r for _, _, r in timed if r["type"] == "request"]
    if not everything:
        raise ValueError("the event log holds no request records: nothing to report (is [events] enabled?)")
    requests = [r for r in everything if r.get("op") != "lookup"]  # loads; lookups count apart
    t0, t1 = everything[0]["t"], everything[-1]["t"]
    width = next((b for b in _BUCKETS if (t1 - t0) / b < cfg.max_buckets), _BUCKETS[-1])
    nb = int((t1 - t0) // width) + 1
    fastest = tiers[0] if tiers else None

    siblings: dict[str, set[str]] = defaultdict(set)
    for a, ra in namespaces.items():
        for b, rb in namespaces.items():
            if a != b and _deployment(ra.get("descriptor", {})) == _deployment(rb.get("descriptor", {})):
                siblings[a].add(b)

    seen: set[int] = set()
    last_use: dict[int, float] = {}
    born: dict[int, float] = {}
    fate: dict[int, str] = {}
    block_events = 0
    total, lookups = _Tally(), _Tally()
    tenants: defaultdict[str, _Tally] = defaultdict(_Tally)
    tenant_lookups: defaultdict[str, _Tally] = defaultdict(_Tally)
    buckets = [_Tally() for _ in range(nb)]
    tenant_buckets: dict[str, list[_Tally]] = defaultdict(lambda: [_Tally() for _ in range(nb)])
    lost: Counter[str] = Counter()
    never_seen = mismatch = before_log = slow = 0
    ages: Counter[str] = Counter()
    gaps: list[tuple[float, int]] = []  # (idle seconds, tokens) of hits and of expiry-lost hits
    active: set[str] = set()
    lookup_s: list[float] = []
    load_per_block: dict[str, list[float]] = defaultdict(list)
    no_hashes = 0
    leaving: dict[str, list[int]] = {"evicted": [0] * nb, "expired": [0] * nb}  # blocks per bucket

    def bucket(t: float) -> int | None:
        b = int((t - t0) // width)
        return b if 0 <= b < nb else None

    for t, _, rec in timed:
        if rec["type"] == "block":
            block_events += 1
            k = decode_key(rec["h"])
            ev = rec["event"]
            if ev == "stored":
                born.setdefault(k, t)
                last_use.setdefault(k, t)
                fate[k] = "cached"
            elif ev in ("promoted", "demoted"):
                fate[k] = "cached"
            elif ev == "evicted":
                fate[k] = "deleted" if rec.get("reason", "").startswith("deleted") else "evicted"
                if fate[k] == "evicted" and (bi := bucket(t)) is not None:
                    leaving["evicted"][bi] += 1
            elif ev == "expired":
                fate[k] = "expired"
                if (bi := bucket(t)) is not None:
                    leaving["expired"][bi] += 1
            elif ev == "corrupt" and fate.get(k) != "evicted":
                fate[k] = "corrupt"
            continue
        bt = int(rec["block_tokens"])
        prompt = int(rec["prompt_tokens"])
        hit_b = int(rec["hit_blocks"])
        by_tier = {tn or "?": int(v) for tn, v in rec.get("hit_tokens_by_tier", {}).items()}
        ns = rec["ns"]
        if rec.get("op") == "lookup":
            tenant = rec.get("tenant") or namespaces.get(ns, {}).get("tenant") or "-"
            for tally in (lookups, tenant_lookups[tenant]):
                tally.add(prompt, hit_b * bt, hit_b * bt, by_tier)
            continue
        if "h" in rec:
            keys = decode_hashes(rec["h"]).tolist()
            n = len(keys)
            i = 0
            while i < n and keys[i] in seen:
                i += 1
            if i < hit_b:
                before_log += (hit_b - i) * bt
            ideal_b = max(i, hit_b)
            if ideal_b > hit_b:
                why = _reason(keys[hit_b], fate, block_events > 0)
                lost[why] += (ideal_b - hit_b) * bt
                if why == "expired":
                    gaps.extend((t - last_use[k], bt) for k in keys[hit_b:ideal_b] if k in last_use)
            misses = (n - ideal_b) * bt
            if any(s in active for s in siblings.get(ns, ())):
                mismatch += misses
            else:
                never_seen += misses
            for k in keys[:hit_b]:
                birth = born.get(k)
                if birth is None:
                    ages["before log"] += bt
                else:
                    ages[next(label for label, top in AGE_BUCKETS if t - birth < top)] += bt
                if k in last_use:
                    gaps.append((t - last_use[k], bt))
            seen.update(keys)
            for k in keys:
                last_use[k] = t
            ideal = ideal_b * bt
        else:
            no_hashes += 1
            ideal = hit_b * bt
        active.add(ns)
        hit = hit_b * bt
        tenant = rec.get("tenant") or namespaces.get(ns, {}).get("tenant") or "-"
        bi = int((t - t0) // width)
        for tally in (total, tenants[tenant], buckets[bi], tenant_buckets[tenant][bi]):
            tally.add(prompt, hit, ideal, by_tier)
        if fastest is not None:
            slow += sum(v for tn, v in by_tier.items() if tn != fastest)
        lookup_s.append(float(rec.get("lookup_s", 0.0)))
        if hit_b and len(by_tier) == 1:
            load_per_block[next(iter(by_tier))].append(float(rec.get("load_s", 0.0)) / hit_b)

    return {
        "span": {"start": t0, "end": t1, "seconds": t1 - t0, "bucket_s": width},
        "config": {"prefill_tps": cfg.prefill_tps, "gpu_price": cfg.gpu_price, "currency": cfg.currency},
        "log": {"requests": len(requests), "lookups": len(everything) - len(requests), "block_events": block_events, "requests_without_hashes": no_hashes,
                "namespaces": len(namespaces), "tiers": tiers},
        **_summary(total, cfg),
        "ideal": {"hit_tokens": total.ideal, "token_hit_rate": _rate(total.ideal, total.prompt),
                  "before_log_tokens": before_log},
        "misses": {"lost": {r: lost.get(r, 0) for r in LOST_REASONS if lost.get(r)},
                   "never_seen": never_seen, "namespace_mismatch": mismatch},
        "slow_tier": {"fastest_tier": fastest, "tokens": slow, "share_of_hits": _rate(slow, total.hit)},
        "ages": _ages(ages, total.hit),
        "retention": _retention(gaps, total.prompt, total.hit),
        "latency": _latency(lookup_s, load_per_block),
        "lookups": {**_lookups(lookups), "tenants": {n: _lookups(tl) for n, tl in sorted(tenant_lookups.items())}},
        "tenants": {name: _summary(tl, cfg) for name, tl in sorted(tenants.items())},
        "admission": _admission(usage),
        "timeseries": {**_series(buckets, tenant_buckets, t0, width, tiers),
                       "tier_fill": _fill(usage, tiers, bucket, nb),
                       "leaving_blocks_per_hour": {k: [round(n * 3600 / width, 3) for n in v] for k, v in leaving.items()}},
        "namespaces": [{"ns": k, "tenant": v.get("tenant", ""), "model_id": v.get("descriptor", {}).get("model_id"),
                        "siblings": sorted(siblings.get(k, ()))} for k, v in namespaces.items()],
    }


def _reason(k: int, fate: Mapping[int, str], have_block_events: bool) -> str:
    if not have_block_events:
        return "unknown"
    f = fate.get(k)
    if f is None:
        return "not_stored"
    return "other" if f == "cached" else f


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _summary(t: _Tally, cfg: ReportConfig) -> dict[str, Any]:
    gpu_s = t.hit / cfg.prefill_tps
    return {
        "requests": t.requests,
        "prompt_tokens": t.prompt,
        "hit_tokens": t.hit,
        "token_hit_rate": _rate(t.hit, t.prompt),
        "request_hit_rate": _rate(t.hit_requests, t.requests),
        "ideal_token_hit_rate": _rate(t.ideal, t.prompt),
        "hit_tokens_by_tier": dict(t.by_tier.most_common()),
        # DeepSeek API's usage fields: what a tenant's bill would show.
        "usage": {"prompt_cache_hit_tokens": t.hit, "prompt_cache_miss_tokens": t.prompt - t.hit},
        "savings": {"tokens": t.hit, "gpu_seconds": gpu_s, "money": gpu_s / 3600 * cfg.gpu_price},
    }


def _lookups(t: _Tally) -> dict[str, Any]:
    """Lookups: asked what is cached, served nothing (the rest of the report is about loads)."""
    return {"requests": t.requests, "prompt_tokens": t.prompt, "hit_tokens": t.hit,
            "token_hit_rate": _rate(t.hit, t.prompt), "request_hit_rate": _rate(t.hit_requests, t.requests),
            "hit_tokens_by_tier": dict(t.by_tier.most_common())}


def _ages(ages: Counter[str], hit: int) -> dict[str, Any]:
    tokens = {label: ages.get(label, 0) for label, _ in AGE_BUCKETS}
    tokens["before log"] = ages.get("before log", 0)
    known = hit - tokens["before log"]
    order = [label for label, _ in AGE_BUCKETS]
    older = {name: _rate(sum(tokens[label] for label in order[i:]), known)
             for name, i in (("1h", 1), ("24h", 2), ("72h", 3))}
    return {"tokens": tokens, "share_older_than": older,
            "note": "hit tokens by the age of the block that served them (since it was stored); "
                    "'before log': stored before the log began (shares count only known ages)"}


def _retention(gaps: list[tuple[float, int]], prompt: int, hit: int) -> dict[str, Any]:
    """Token hit rate a TTL of ``x`` hours would have reached, capacity aside: hits and
    expired-lost hits whose block had been idle at most ``x`` (a hit refreshes the TTL)."""
    if not gaps:
        return {"ttl_hours": [], "token_hit_rate": [], "at": {}, "idle_share_over": {}}
    g = np.array([x for x, _ in gaps])
    w = np.array([y for _, y in gaps], dtype=np.float64)
    order = np.argsort(g)
    g, w = g[order], np.cumsum(w[order])

    def kept(hours: float) -> float:
        j = int(np.searchsorted(g, hours * H, side="right"))
        return float(w[j - 1]) if j else 0.0

    top = max(96.0, float(g[-1]) / H * 1.05)
    hours = sorted({*np.linspace(0, top, 97).round(3).tolist(), 1.0, 24.0, 72.0})
    return {
        "ttl_hours": hours,
        "token_hit_rate": [round(_rate(kept(h), prompt), 5) for h in hours],
        "at": {f"{int(h)}h": _rate(kept(h), prompt) for h in (1.0, 24.0, 72.0)},
        "idle_share_over": {f"{int(h)}h": 1 - kept(h) / float(w[-1]) for h in (1.0, 24.0, 72.0)},
    }


def _latency(lookup_s: list[float], per_block: Mapping[str, list[float]]) -> dict[str, Any]:
    """p50 and p99 with their sample count ``n`` (a load is timed per tier only when one tier
    served all its hits)."""
    def q(xs: list[float]) -> dict[str, float]:
        a = np.array(xs)
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": len(xs)} if xs else {}

    return {"lookup_s": q(lookup_s), "load_s_per_block_by_tier": {k: q(v) for k, v in sorted(per_block.items())}}


def _fill(usage: list[Mapping[str, Any]], tiers: list[str], bucket: Any, nb: int) -> dict[str, list[float | None]]:
    """Each tier's fill (used / capacity) at the last usage record of each bucket; None where
    a bucket has none (a gap, not an empty tier)."""
    out: dict[str, list[float | None]] = {}
    for rec in sorted(usage, key=lambda r: float(r["t"])):
        b = bucket(float(rec["t"]))
        if b is None:
            continue
        for name, u in rec.get("tiers", {}).items():
            cap = u.get("capacity_bytes") or 0
            if cap > 0:
                out.setdefault(name, [None] * nb)[b] = round(u.get("used_bytes", 0) / cap, 5)
    order = {name: i for i, name in enumerate(tiers)}
    return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _admission(usage: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Admission to the last tier (``[store] admission``) from the store counters of usage
    records: what the counters grew by between the first and the last record (a count that
    fell, a restart, grows from zero again), and the rule the last record names."""
    recs = sorted((r for r in usage if "store" in r), key=lambda r: float(r["t"]))
    out: dict[str, Any] = {"logged": bool(recs), "admission": recs[-1]["store"].get("admission", "") if recs else "",
                           "skipped_writes": 0, "skipped_bytes": 0, "seconds": 0.0}
    for prev, cur in zip(recs, recs[1:], strict=False):
        for k in ("skipped_writes", "skipped_bytes"):
            a, b = int(prev["store"].get(k, 0)), int(cur["store"].get(k, 0))
            out[k] += b - a if b >= a else b
    if recs:
        out["seconds"] = float(recs[-1]["t"]) - float(recs[0]["t"])
    return out


def _series(buckets: list[_Tally], tenant_buckets: Mapping[str, list[_Tally]], t0: float, width: float,
            tier_order: Sequence[str] = ()) -> dict[str, Any]:
    order = {name: i for i, name in enumerate(tier_order)}  # fastest first, as the log's header lists them
    tiers = sorted({k for b in buckets for k in b.by_tier}, key=lambda k: (order.get(k, len(order)), k))
    return {
        "t": [t0 + i * width for i in range(len(buckets))],
        "requests": [b.requests for b in buckets],
        "prompt_tokens": [b.prompt for b in buckets],
        "hit_tokens": [b.hit for b in buckets],
        # None in a bucket without requests: idle is no data (a gap), not a 0% hit rate.
        "token_hit_rate": [_rate(b.hit, b.prompt) if b.requests else None for b in buckets],
        "request_hit_rate": [_rate(b.hit_requests, b.requests) if b.requests else None for b in buckets],
        "ideal_token_hit_rate": [_rate(b.ideal, b.prompt) if b.requests else None for b in buckets],
        "hit_tokens_by_tier": {k: [b.by_tier.get(k, 0) for b in buckets] for k in tiers},
        "tenant_token_hit_rate": {name: [_rate(b.hit, b.prompt) if b.prompt else None for b in bs]
                                  for name, bs in sorted(tenant_buckets.items())},
    }
