"""Replay a trace through a real :class:`~kvstore.store.KVStore` whose tiers are null tiers.

The store's own code decides everything (placement, promotion on a hit, demotion, expiry,
prefix-closed eviction through the configured policy); the null tiers (tiers/null.py) keep
metadata only, so no payload is copied. The store's clock is a :class:`FakeClock` set to each
request's timestamp, so TTLs and policy ages follow the trace's time, not the replay's.

Per request: ``get_into`` the request's blocks (longest-prefix hits, touching them), then
``put`` the rest (``start`` = the hits), exactly what an engine does.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eviction.cost import CostModel
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import ConfigError
from kvstore.events import EventsConfig
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from kvstore.units import parse_size
from tools.replay.trace import Trace

EPOCH = 1_700_000_000.0
_ITEM = re.compile(r"^(?:(?P<name>[A-Za-z][\w-]*)=)?(?P<amount>.+)$")
_INF = re.compile(r"(^|[=,])\s*(inf|unlimited)\s*(?=,|$)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class TierCapacity:
    name: str
    blocks: int


def parse_capacity(spec: str, unique_blocks: int, block_bytes: int) -> list[TierCapacity]:
    """Tiers, fastest first, from ``"5%"``, ``"2000"``, ``"64GiB"`` or ``"dram=1%,nvme=5%"``.

    A share is of the trace's unique blocks; bytes are converted at ``block_bytes`` a block.
    Raises ConfigError (a user's mistake) with what was expected.
    """
    tiers: list[TierCapacity] = []
    for k, item in enumerate(s.strip() for s in spec.split(",")):
        m = _ITEM.match(item)
        if not item or not m:
            raise ConfigError(f"capacity {spec!r}: empty tier; write e.g. '5%' or 'dram=1%,nvme=5%'")
        name, amount = m.group("name") or f"t{k}", m.group("amount").strip()
        if amount.endswith("%"):
            try:
                share = float(amount[:-1]) / 100
            except ValueError:
                raise ConfigError(f"capacity {item!r}: {amount!r} is not a percentage") from None
            blocks = int(share * unique_blocks)
        elif amount.isdigit():
            blocks = int(amount)
        else:
            blocks = parse_size(amount, f"capacity {item!r}") // max(block_bytes, 1)
        if blocks <= 0:
            raise ConfigError(f"capacity {item!r} holds no block (of {unique_blocks} unique)")
        tiers.append(TierCapacity(name, blocks))
    if len({t.name for t in tiers}) != len(tiers):
        raise ConfigError(f"capacity {spec!r}: tier names must be unique")
    return tiers


def expand_unlimited(spec: str, unique_blocks: int) -> str:
    """``object=inf`` (or ``unlimited``) as room for every unique block of the trace."""
    return _INF.sub(lambda m: f"{m.group(1)}{unique_blocks}", spec)


def parse_tiers(spec: str, unique_blocks: int, block_bytes: int = 1) -> list[TierCapacity]:
    """The tiers of a capacity string, ``object=inf`` included (:func:`expand_unlimited`, then
    ``parse_capacity``)."""
    return parse_capacity(expand_unlimited(spec, unique_blocks), unique_blocks, block_bytes)


@dataclass(slots=True)
class StoreRun:
    policy: str
    hits: np.ndarray
    """Blocks hit, per request."""
    seconds: float
    """Wall time of the replay loop."""
    cpu_seconds: float
    """Processor time of the replay loop (steadier than wall time on a shared machine)."""
    stats: dict[str, Any] = field(default_factory=dict)


def replay_store(
    trace: Trace,
    tiers: list[TierCapacity],
    policy: str,
    *,
    block_tokens: int,
    policy_options: dict[str, Any] | None = None,
    ttl_s: float | None = None,
    progress: Callable[[int], None] | None = None,
    events_dir: Path | None = None,
    admission: str | None = None,
    admission_options: dict[str, Any] | None = None,
) -> StoreRun:
    """Run ``trace`` through a KVStore with null tiers of the given capacities; with
    ``events_dir`` the store writes its event log there (for ``kvstore.report``). ``admission``
    is the last tier's rule (default: the store's)."""
    # A namespace whose blocks are as small as the store allows: the null tiers check sizes
    # and keep none of the bytes, so only the per-call overhead is left.
    ns = Namespace("replay/" + trace.name, KVLayout("uint8", block_tokens, (LayerGroup("full", 1, 1, 1),)))
    bb = ns.block_bytes
    longest = int(np.diff(trace.offsets).max()) if trace.num_requests else 0
    # One buffer for every request: a load lands in it and a put reads from it (a null tier
    # checks sizes only), passed whole so that the store cuts it into blocks itself.
    buf = memoryview(bytearray(max(longest, 1) * bb))
    keys = [i.to_bytes(16, "little") for i in range(trace.unique_blocks)]
    clock = FakeClock(EPOCH)
    hits = np.zeros(trace.num_requests, dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="kvstore-replay-") as root:
        config = StoreConfig(
            root=Path(root),
            tiers=tuple(TierSpec(t.name, "null", {"capacity_blocks": t.blocks}) for t in tiers),
            policy=policy,
            policy_options=policy_options or {},
            admission=admission or StoreConfig().admission,
            admission_options=admission_options or {},
            persist_on_close=False,
            # A replay outruns the log writer: a deep queue, so that no record is dropped.
            events=EventsConfig(enabled=True, dir=events_dir, queue=1 << 22) if events_dir else EventsConfig(),
        )
        store = KVStore(config, clock=clock)
        store.register_namespace(ns, ttl_s)
        get_into, put = store.get_into, store.put
        offsets, ids, stamps = trace.offsets.tolist(), trace.block_ids.tolist(), trace.timestamps_ms.tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        for r in range(trace.num_requests):
            clock.set(EPOCH + stamps[r] / 1000.0)
            chain = [keys[i] for i in ids[offsets[r] : offsets[r + 1]]]
            n = get_into(ns, chain, buf[: len(chain) * bb])
            put(ns, chain, buf[: (len(chain) - n) * bb], start=n)
            hits[r] = n
            if progress is not None:
                progress(r)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = store.stats()
        store.close()
    keep = ("evictions", "expirations", "demotions", "promotions", "hits_by_tier", "skipped_writes", "admission")
    out = {k: stats[k] for k in keep if k in stats}
    # Writes per tier, in blocks (every replay block has the same size).
    out["writes_by_tier"] = {t["name"]: t.get("bytes_in", 0) // bb for t in stats["tiers"]}
    return StoreRun(policy, hits, seconds, cpu, out)


def summarize(trace: Trace, hits: np.ndarray, block_tokens: int, cost: CostModel) -> dict[str, float]:
    """Block and token hit rates, and the share of prefill FLOPs the hits avoid."""
    hit_tokens = np.minimum(hits * block_tokens, trace.input_tokens)
    total = float(cost.prefix_flops(trace.input_tokens).sum())
    return {
        "block_hit_rate": float(hits.sum() / max(trace.num_blocks, 1)),
        "token_hit_rate": float(hit_tokens.sum() / max(int(trace.input_tokens.sum()), 1)),
        "compute_saved_fraction": float(cost.prefix_flops(hit_tokens).sum() / total) if total else 0.0,
    }
