"""A sample event log: days of a simulated serving workload through a real in-process store.

``python -m kvstore.report.sample DIR`` runs multi-turn chats of two tenants (shared system
prompts, users who come back after minutes, hours or days, a daily rhythm) through a
``KVStore`` on its real tiers with small capacities, on a fake clock that jumps from request to
request, so four simulated days take seconds. Tenant ``b`` runs with a 12-hour TTL (so hits are
lost to expiry), and from day 2 one of its engines is misconfigured with another block size (a
namespace mismatch). The store's event log lands in ``DIR/store/events``: what ``kvreport``
makes the README's screenshot and tests from.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.events import EventsConfig
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from kvstore.version import version

_LAYOUT = KVLayout("bfloat16", 16, (LayerGroup("full", 1, 1, 64),))  # 4 KiB blocks: fast to move
NS_A = Namespace("sample/chat-7b", _LAYOUT)
NS_B = Namespace("sample/agent-7b", _LAYOUT)
NS_B_BAD = Namespace("sample/agent-7b", KVLayout("bfloat16", 32, (LayerGroup("full", 1, 1, 64),)))
H = 3600.0


def _config(root: Path) -> StoreConfig:
    bb = _LAYOUT.block_bytes
    return StoreConfig(
        root=root,
        tiers=(TierSpec("dram", "dram", {"capacity_bytes": 512 * bb, "slab_bytes": 64 * bb}),
               TierSpec("nvme", "nvme", {"capacity_bytes": 2048 * bb, "slab_bytes": 64 * bb}),
               TierSpec("object", "object", {"capacity_bytes": 6144 * bb})),
        events=EventsConfig(enabled=True, max_age_s=24 * H),
    )


def progress_bar(stream: TextIO | None = None, width: int = 30) -> Callable[[float, int], None]:
    """``bar(done_fraction, requests)``: one updating line on ``stream`` (stderr), at most ten
    updates a second; a final newline at 1.0. Drawn only on a terminal unless ``stream`` is
    given."""
    out = stream or sys.stderr
    shown = stream is not None or bool(getattr(out, "isatty", lambda: False)())
    last = [0.0]

    def bar(frac: float, requests: int) -> None:
        if not shown:
            return
        now = time.monotonic()
        if frac < 1.0 and now - last[0] < 0.1:
            return
        last[0] = now
        filled = int(round(width * min(frac, 1.0)))
        out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {frac:6.1%} simulated, {requests:,} requests")
        if frac >= 1.0:
            out.write("\n")
        out.flush()

    return bar


def run(root: Path, days: float = 4.0, seed: int = 0, rate_per_hour: float = 60.0,
        progress: Callable[[float, int], None] | None = None) -> dict[str, Any]:
    """Simulate ``days`` of traffic into a store at ``root``; returns a few totals.
    ``progress(fraction of the simulated time done, requests so far)`` is called as it goes."""
    rng = np.random.default_rng(seed)
    clock = FakeClock(1_735_689_600.0)  # 2025-01-01 00:00 UTC
    systems = {t: [rng.integers(0, 32_000, int(rng.integers(20, 60)) * 16) for _ in range(3)] for t in "ab"}
    users: list[dict[str, Any]] = []
    served = total = 0
    with KVStore(_config(root), clock=clock) as store:
        store.events.set_tenant(NS_A.root, "team-a")
        store.events.set_tenant(NS_B.root, "team-b")
        store.events.set_tenant(NS_B_BAD.root, "team-b")
        store.register_namespace(NS_A)
        store.register_namespace(NS_B, ttl_s=12 * H)
        store.register_namespace(NS_B_BAD, ttl_s=12 * H)
        start = clock()
        end = start + days * H * 24
        next_maintain = clock()
        requests = 0
        while clock() < end:
            hour = (clock() % 86400) / H
            daily = 0.35 + 0.65 * math.sin(math.pi * (hour - 6) / 16) ** 2 if 6 <= hour <= 22 else 0.35
            rate = rate_per_hour * daily
            clock.advance(float(rng.exponential(H / rate)))
            if clock() >= next_maintain:
                store.maintain()
                stats = store.stats()
                store.events.usage(stats["tiers"], store=stats)  # tier fill and admission, as the daemon logs them
                next_maintain = clock() + 600
            # A returning user (more likely the more there are), or a new conversation.
            if users and rng.random() < 0.7:
                u = users[int(rng.integers(len(users)))]
                if clock() < u["back_at"]:
                    continue
            else:
                tenant = "a" if rng.random() < 0.6 else "b"
                u = {"tenant": tenant, "history": systems[tenant][int(rng.integers(3))].copy(), "back_at": 0.0}
                users.append(u)
            u["history"] = np.concatenate([u["history"], rng.integers(0, 32_000, int(rng.integers(2, 12)) * 16)])
            # Come back in minutes (usually), hours, or days.
            u["back_at"] = clock() + float(rng.choice([rng.exponential(600), rng.exponential(6 * H), rng.exponential(30 * H)],
                                                      p=[0.6, 0.3, 0.1]))
            ns = NS_A
            if u["tenant"] == "b":
                ns = NS_B_BAD if clock() - (end - days * 24 * H) > 36 * H and rng.random() < 0.25 else NS_B
            hashes = hash_blocks(ns, u["history"])
            buf = np.empty(len(hashes) * ns.block_bytes, np.uint8)
            hit = store.get_into(ns, hashes, buf)
            buf[hit * ns.block_bytes :] = 7  # "prefill": the payload does not matter here
            store.put(ns, hashes, buf[hit * ns.block_bytes :], start=hit)
            served += hit
            total += len(hashes)
            requests += 1
            if progress is not None:
                progress((clock() - start) / (end - start), requests)
            if len(users) > 400:
                users.pop(0)
        stats = store.stats()
    if progress is not None:
        progress(1.0, requests)
    return {"root": str(root), "events": str(root / "events"), "blocks_served": served, "blocks_asked": total,
            "evictions": stats["evictions"], "expirations": stats["expirations"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.report.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("dir", type=Path, help="output directory (its store/ is replaced)")
    p.add_argument("--days", type=float, default=4.0)
    p.add_argument("--rate", type=float, default=60.0, help="requests per hour at the daily peak")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    root = args.dir / "store"
    if root.exists():
        shutil.rmtree(root)
    print(json.dumps(run(root, args.days, args.seed, args.rate, progress=progress_bar())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
