"""A read-only view of a store directory: what its persistent tiers hold, from their own metadata.

For inspecting a store that no daemon serves (``kvctl --dir``), or one that a daemon serves but
cannot be asked. Nothing under the directory is written, locked or deleted: each persistent
tier is read by its class's ``Tier.read_offline`` (the class comes from the tier registry: the
NVMe tier's RocksDB opened read-only, the object tier listed with its background work, sweeps,
lifecycle rules and write-back switched off), and ``namespaces.json`` is only read. Volatile tiers (DRAM, HBM) exist only inside a running process, so they look empty.

Pins are read from ``pins.json`` (the store rewrites it atomically on every change): a block held
by a pin that a store opened now would re-apply (no deadline, or one still ahead) does not count
as expired. What a snapshot cannot know: hit counts and in-use counts live in a running store's
memory (``hits`` comes from the event log instead, when there is one; see kvstore/ctl).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.block import BlockMeta
from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import KVStoreError, UsageError
from kvstore.inspection import pin_deadlines, pin_report, pin_summary
from kvstore.keys import Namespace
from kvstore.registry import build_config, tier_class
from kvstore.retention import PINS_FILE, PinRecord, read_pins
from kvstore.store import read_namespaces
from kvstore.units import parse_size

Progress = Callable[[str, int], None]
"""``progress(what, count)``: called as a long scan advances (tools draw a bar with it)."""


@dataclass(slots=True)
class _Block:
    meta: BlockMeta
    mask: int


class StoreSnapshot:
    """The blocks and namespaces of the store directory ``config.root``, as its persistent
    tiers record them now. ``holder``: the pid of a live process (a daemon) that holds the
    directory, or None; what it keeps in DRAM and has not written down is not in the view."""

    def __init__(self, config: StoreConfig, *, clock: Clock = system_clock, progress: Progress | None = None) -> None:
        self.config = config
        self.root = Path(config.root)
        self._clock = clock
        if not self.root.is_dir():
            raise UsageError(f"{self.root} is not a store directory (it does not exist); pass the daemon's data dir")
        self.holder = self._holder()
        self._ns: dict[bytes, tuple[Namespace, float | None]] = {}
        self._read_namespaces()
        self.pins_error: str | None = None
        """Why ``pins.json`` could not be read (a store would refuse to open), or None."""
        self._pins: list[PinRecord] = []
        try:
            self._pins = read_pins(self.root / PINS_FILE)
        except KVStoreError as e:
            self.pins_error = str(e)
        self._blocks: dict[bytes, _Block] = {}
        self._tiers: list[dict[str, Any]] = []
        for k, spec in enumerate(config.tiers):
            self._tiers.append(self._scan_tier(k, spec, progress))

    # ---- loading --------------------------------------------------------------------------

    def _holder(self) -> int | None:
        for spec in self.config.tiers:
            if (pid := tier_class(spec.kind).holder(spec.name, self.root)) is not None:
                return pid
        return None

    def _read_namespaces(self) -> None:
        for ns, ttl_s in read_namespaces(self.root):
            self._ns[ns.root] = (ns, ttl_s)

    def _scan_tier(self, k: int, spec: TierSpec, progress: Progress | None) -> dict[str, Any]:
        cls = tier_class(spec.kind)  # the registry's class says how its kind is read offline
        row: dict[str, Any] = {"name": spec.name, "kind": spec.kind, "persistent": bool(cls.persistent),
                               "capacity_bytes": _capacity(spec), "used_bytes": 0, "blocks": 0}
        if not cls.persistent:
            row["note"] = "volatile: its blocks live only inside a running store (use --url)"
            return row
        if progress:
            progress(f"reading tier {spec.name}", 0)
        config = build_config(cls.Config, dict(spec.options), f"tier {spec.name!r}")
        scan = cls.read_offline(spec.name, config, self.root, self._clock)
        if scan is None:
            row["note"] = f"tier kind {spec.kind!r} cannot be read offline"
            return row
        found, extra = scan.blocks, dict(scan.extra)
        for key, desc in extra.pop("descriptors", {}).items():
            if key not in self._ns:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    ns = Namespace.from_dict(json.loads(desc))
                    if ns.root == key:
                        self._ns[key] = (ns, None)
        for i, (key, meta) in enumerate(found):
            b = self._blocks.get(key)
            if b is None:
                self._blocks[key] = _Block(meta, 1 << k)
            else:
                b.mask |= 1 << k
                if meta.expiry > b.meta.expiry:
                    b.meta = meta
            row["used_bytes"] += meta.size
            if progress and i % 4096 == 0:
                progress(f"reading tier {spec.name}", i)
        row["blocks"] = len(found)
        row.update(extra)
        if progress:
            progress(f"reading tier {spec.name}", len(found))
        return row

    # ---- queries --------------------------------------------------------------------------

    def tiers(self) -> list[dict[str, Any]]:
        return [dict(t) for t in self._tiers]

    def namespaces(self) -> list[tuple[Namespace, float | None]]:
        return list(self._ns.values())

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]:
        out: dict[bytes, list[int]] = {}
        for b in self._blocks.values():
            u = out.setdefault(b.meta.ns, [0, 0])
            u[0] += 1
            u[1] += b.meta.size
        return {k: (v[0], v[1]) for k, v in out.items()}

    def pins(self, ns: str | None = None) -> dict[str, Any]:
        """The pin records (of namespace ``ns``, hex), as :func:`kvstore.inspection.pin_report`
        (``active``: a store opened now would re-apply it)."""
        return pin_report(self._pins, self._clock(), ns)

    def stats(self) -> dict[str, Any]:
        now = self._clock()
        held = pin_deadlines(self._pins, now)
        expired = sum(1 for k, b in self._blocks.items() if b.meta.expiry <= now and k not in held)
        return {
            "root": str(self.root),
            "offline": True,
            "live_process": self.holder,
            "blocks": len(self._blocks),
            "expired_blocks": expired,
            "bytes": sum(b.meta.size for b in self._blocks.values()),
            "namespaces": len(self._ns),
            "pins": pin_summary(self._pins, now),
            **({"pins_error": self.pins_error} if self.pins_error else {}),
            "tiers": self.tiers(),
        }

    def lookup(self, ns: bytes, hashes: Sequence[bytes]) -> tuple[int, list[str]]:
        """Leading blocks of ``hashes`` (namespace ``ns``) a store opened now would serve, and
        the fastest tier holding each."""
        now = self._clock()
        held = pin_deadlines(self._pins, now)
        names = [t["name"] for t in self._tiers]
        tiers: list[str] = []
        for h in hashes:
            b = self._blocks.get(bytes(h))
            if b is None or not b.mask or b.meta.ns != ns or (b.meta.expiry <= now and bytes(h) not in held):
                break
            tiers.append(names[(b.mask & -b.mask).bit_length() - 1])
        return len(tiers), tiers

    def iter_blocks(self, keys: Iterable[bytes] | None = None) -> Iterator[dict[str, Any]]:
        """Rows like ``KVStore.iter_blocks`` (hits and in-use are unknown offline: 0), plus
        ``created`` and ``pin_until``: the deadline of each pin holding the block (None: until
        unpinned), as many as ``pins``."""
        names = [t["name"] for t in self._tiers]
        held = pin_deadlines(self._pins, self._clock())
        items = self._blocks.items() if keys is None else (
            (bytes(k), b) for k in keys if (b := self._blocks.get(bytes(k))) is not None
        )
        for key, b in items:
            m = b.meta
            yield {
                "hash": key.hex(), "namespace": m.ns.hex(),
                "parent": m.parent.hex() if m.depth else None,
                "depth": m.depth, "size": m.size,
                "tiers": [n for k, n in enumerate(names) if b.mask >> k & 1],
                "hits": 0, "last_access": None, "expiry": m.expiry, "pins": len(held.get(key, ())), "in_use": 0,
                "created": m.created, "pin_until": held.get(key, []),
            }


def _capacity(spec: TierSpec) -> int | None:
    cap = spec.options.get("capacity_bytes")
    return parse_size(cap, f"tier {spec.name!r}.capacity_bytes") if cap is not None else None
