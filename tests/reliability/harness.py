"""What the reliability tests share: the run size, daemon configs, a verifying workload, and
an offline audit of a store directory.

The workload puts, loads and looks up chains of ``SMALL_NS`` blocks whose payloads derive from
their hashes (``tests.conftest.payload``), so every byte a client is served can be checked: a
torn, stale or misplaced block never passes.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.errors import BlockNotFound, CorruptBlockError, KVStoreError, TierIOError
from kvstore.keys import BlockHash
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tiers.nvme import read_metadata

LONG = os.environ.get("KVSTORE_RELIABILITY", "").strip().lower() == "long"
"""``KVSTORE_RELIABILITY=long``: the long versions (docs/reliability.md has their figures)."""


def pick(short: Any, long: Any) -> Any:
    """The value for this run's size."""
    return long if LONG else short


# ---- daemon configuration ------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(
    path: Path,
    tiers: Iterable[tuple[str, str, dict[str, Any]]],
    *,
    server: dict[str, Any] | None = None,
    tenants: Iterable[dict[str, Any]] = (),
    events: bool = True,
    events_options: dict[str, Any] | None = None,
) -> Path:
    """A TOML file for ``kvstore serve --config``: ``tiers`` as ``(name, kind, options)``;
    ``events_options``: more keys of ``[events]`` (``publish``...)."""
    lines = ["[events]", f"enabled = {_toml_value(events)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (events_options or {}).items()]
    lines.append("")
    for name, kind, options in tiers:
        lines += ["[[tiers]]", f'name = "{name}"', f'kind = "{kind}"']
        lines += [f"{k} = {_toml_value(v)}" for k, v in options.items()]
        lines.append("")
    if server:
        lines.append("[server]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in server.items()]
        lines.append("")
    for t in tenants:
        lines.append("[[tenants]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in t.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def crash_tiers(dram_blocks: int = 64, nvme_blocks: int = 256, object_blocks: int = 1 << 16) -> list[tuple[str, str, dict[str, Any]]]:
    """DRAM and NVMe small enough that a load demotes all the time; an object tier so large that
    nothing acknowledged ever has to leave the store (so every durable ack can be checked)."""
    return [
        ("dram", "dram", {"capacity_bytes": dram_blocks * BB, "slab_bytes": 4 * BB}),
        ("nvme", "nvme", {"capacity_bytes": nvme_blocks * BB, "slab_bytes": 4 * BB}),
        ("object", "object", {"capacity_bytes": object_blocks * BB}),
    ]


# ---- the workload ----------------------------------------------------------------------------------


def chain_of(seed: int) -> list[bytes]:
    """Chain ``seed``: 2-7 blocks, the first two shared by every chain (dedup, contention)."""
    return chain_for(seed, 2 + seed % 6, shared_prefix_blocks=2)


@dataclass
class Tally:
    """What one or more workers did; merged across threads and processes."""

    ops: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    served_blocks: int = 0
    wrong_blocks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Errors no request should meet (the test fails on any)."""
    expected_errors: int = 0
    """Errors of requests in flight when the daemon was killed on purpose."""
    durable_acked: list[int] = field(default_factory=list)
    volatile_acked: list[int] = field(default_factory=list)

    def merge(self, other: Tally) -> None:
        self.ops.update(other.ops)
        for op, xs in other.latencies.items():
            self.latencies.setdefault(op, []).extend(xs)
        self.served_blocks += other.served_blocks
        self.wrong_blocks += other.wrong_blocks
        self.errors += other.errors
        self.expected_errors += other.expected_errors
        self.durable_acked += other.durable_acked
        self.volatile_acked += other.volatile_acked

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": dict(self.ops), "latencies": self.latencies, "served_blocks": self.served_blocks,
            "wrong_blocks": self.wrong_blocks, "errors": self.errors, "expected_errors": self.expected_errors,
            "durable_acked": self.durable_acked, "volatile_acked": self.volatile_acked,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Tally:
        return cls(Counter(d["ops"]), d["latencies"], d["served_blocks"], d["wrong_blocks"], d["errors"],
                   d["expected_errors"], d["durable_acked"], d["volatile_acked"])


def check_served(chain: list[bytes], buf: np.ndarray, n: int, tally: Tally, what: str) -> None:
    """Every block served is the block asked for, byte for byte."""
    for i in range(n):
        if buf[i * BB : (i + 1) * BB].tobytes() != payload(chain[i]):
            tally.wrong_blocks.append(f"{what}: block {i} of {chain[i].hex()}")
    tally.served_blocks += n


class Workload:
    """One client's mix of puts (half of them durable), loads and lookups; verifies every byte.

    Worker ``wid`` of ``workers`` writes chains ``wid, wid + workers, ...`` (from ``first``) and
    reads any chain written so far (``high_water``), its own or another's.
    """

    def __init__(self, client: Any, wid: int, workers: int, rng: random.Random, first: int = 0,
                 mix: tuple[float, float, float] = (0.35, 0.40, 0.25), durable_share: float = 0.5,
                 preloaded: int = 0) -> None:
        self.c = client
        self.preloaded = preloaded
        """Chains ``0..preloaded-1`` were put before: most reads go there (hits)."""
        self.rng = rng
        self.next_seed = first + wid
        self.stride = workers
        self.first = first
        self.mix = mix
        self.durable_share = durable_share
        self.tally = Tally()
        self.buf = np.zeros(8 * BB, np.uint8)

    def _timed(self, op: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.tally.latencies.setdefault(op, []).append(time.perf_counter() - t0)
        self.tally.ops[op] += 1
        return out

    def step(self, high_water: int) -> None:
        r = self.rng.random()
        put, get, _ = self.mix
        if r < put or high_water <= self.first:
            seed = self.next_seed
            self.next_seed += self.stride
            chain = chain_of(seed)
            durable = self.rng.random() < self.durable_share
            blocks = [payload(h) for h in chain]
            self._timed("put_durable" if durable else "put",
                        lambda: self.c.put(SMALL_NS, chain, blocks, durable=durable))
            (self.tally.durable_acked if durable else self.tally.volatile_acked).append(seed)
            return
        if self.preloaded and self.rng.random() < 0.7:
            seed = self.rng.randrange(self.preloaded)
        else:
            seed = self.rng.randrange(self.first, high_water)
        chain = chain_of(seed)
        if r < put + get:
            view = self.buf[: len(chain) * BB]
            n = self._timed("get", lambda: self.c.get_into(SMALL_NS, chain, view))
            check_served(chain, view, n, self.tally, f"get of chain {seed}")
        else:
            res = self._timed("lookup", lambda: self.c.lookup(SMALL_NS, chain))
            if not 0 <= res.num_blocks <= len(chain):
                self.tally.errors.append(f"lookup of chain {seed} says {res.num_blocks} of {len(chain)}")


def run_workers(
    clients: list[Any], seconds: float, *, first: int = 0, seed: int = 0, killed: threading.Event | None = None,
    mix: tuple[float, float, float] = (0.35, 0.40, 0.25), on_started: Any = None, preloaded: int = 0,
) -> Tally:
    """Run one :class:`Workload` per client on its own thread for ``seconds`` (or until the
    caller kills the daemon and sets ``killed``; errors after that are expected)."""
    stop = threading.Event()
    workers = [Workload(c, i, len(clients), random.Random(seed * 1000 + i), first, mix, preloaded=preloaded)
               for i, c in enumerate(clients)]
    lock = threading.Lock()
    high = [first + len(clients)]

    def loop(w: Workload) -> None:
        while not stop.is_set():
            try:
                w.step(high[0])
            except (KVStoreError, OSError) as e:
                if killed is not None and killed.is_set():
                    w.tally.expected_errors += 1
                    return
                w.tally.errors.append(f"{type(e).__name__}: {e}")
            with lock:
                high[0] = max(high[0], w.next_seed - w.stride + 1)

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    if on_started is not None:
        on_started()
    if killed is None:
        time.sleep(seconds)  # the load runs on its own threads for a bounded time
    else:
        killed.wait(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    total = Tally()
    for w in workers:
        total.merge(w.tally)
    return total


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50, p99 and max in milliseconds."""
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return round(1000 * s[min(len(s) - 1, math.ceil(p * len(s)) - 1)], 3)

    return {"n": len(s), "p50_ms": q(0.50), "p99_ms": q(0.99), "max_ms": round(1000 * s[-1], 3)}


# ---- offline audit of a store directory ---------------------------------------------------------------


@dataclass
class Inventory:
    """What the persistent tiers hold on disk, read without opening the store."""

    nvme: set[bytes]
    objects: set[bytes]
    temp_files: list[Path]


def disk_inventory(root: Path) -> Inventory:
    nvme = {bytes(k) for k, _, _ in read_metadata(root, "nvme")}
    objects: set[bytes] = set()
    temps: list[Path] = []
    base = root / "tiers" / "object" / "objects" / "blocks"
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith(".kvb"):
                objects.add(bytes.fromhex(f[: -len(".kvb")]))
            else:
                temps.append(Path(dirpath) / f)
    return Inventory(nvme, objects, temps)


@dataclass
class Audit:
    blocks: int
    orphans_dropped: int
    """Payloads whose parent did not survive, deleted by the recovery."""
    orphans_left: int
    """Payloads on disk that the recovered index does not reach (must be 0)."""
    temp_files_left: int
    """Files of writes cut short, still on disk after the recovery (must be 0)."""
    bad_copies: list[str]
    """Index entries whose copy is missing, corrupt or holds the wrong bytes (must be none)."""
    missing_parents: int
    missing_durable: list[int]
    recovery_s: float


def audit_store(config: StoreConfig, durable_seeds: Iterable[int] = ()) -> Audit:
    """Open the directory as the daemon's restart would (warm recovery), then check that the
    index and the tiers agree: every payload on disk is reachable, every copy the index names
    reads back with the right bytes, every block's parent is cached, and every chain
    acknowledged as durable is whole."""
    t0 = time.perf_counter()
    with KVStore(config) as store:
        recovery_s = time.perf_counter() - t0
        rows = {bytes.fromhex(r["hash"]): r for r in store.iter_blocks()}
        inv = disk_inventory(config.root)
        tiers = {t.name: t for t in store.tiers}
        bad: list[str] = []
        buf = np.zeros(BB, np.uint8)
        for key, row in rows.items():
            if not row["tiers"]:
                bad.append(f"{key.hex()}: in the index, in no tier")
            for name in row["tiers"]:
                try:
                    tiers[name].read_into(BlockHash(key), memoryview(buf))
                except (BlockNotFound, CorruptBlockError, TierIOError) as e:
                    bad.append(f"{key.hex()} on {name}: {type(e).__name__}: {e}")
                    continue
                if buf.tobytes() != payload(key):
                    bad.append(f"{key.hex()} on {name}: wrong bytes")
        missing_parents = sum(1 for r in rows.values() if r["parent"] is not None and bytes.fromhex(r["parent"]) not in rows)
        missing = [s for s in durable_seeds if any(h not in rows for h in chain_of(s))]
        stats = store.stats()
    return Audit(
        blocks=len(rows),
        orphans_dropped=stats["orphans_dropped"],
        orphans_left=len((inv.nvme | inv.objects) - rows.keys()),
        temp_files_left=len(inv.temp_files),
        bad_copies=bad,
        missing_parents=missing_parents,
        missing_durable=missing,
        recovery_s=recovery_s,
    )
