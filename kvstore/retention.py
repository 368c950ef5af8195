"""Retention classes: pins that survive restarts, with or without a deadline.

A *pin* is a guarantee: the pinned prefix stays in the store (on some tier; it may move down)
and does not expire while the pin holds. ``KVStore.pin(ns, hashes, until=T)`` holds until the
wall-clock time ``T``; without ``until`` until ``unpin``. Everything else is best-effort and
leaves by TTL (per namespace, 72 h by default) or by eviction.

The index keeps a pin *count* per block (what eviction and expiry read); this module keeps the
records behind the counts, so that they can be released at their deadline and re-applied after a
restart. Records live in ``<root>/pins.json``, rewritten atomically (temp file, fsync, rename) on
every change: pins change rarely, and a pin acknowledged must not be lost by a crash.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import KVStoreError

PINS_FILE = "pins.json"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PinRecord:
    ns: bytes
    """Namespace digest."""
    hashes: tuple[bytes, ...]
    """The blocks it holds: the prefix that was cached when it was pinned (less what a
    partial unpin of an untimed pin took back)."""
    until: float | None
    """Wall-clock deadline; None: until unpinned."""

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def to_json(self) -> dict[str, object]:
        return {"ns": self.ns.hex(), "hashes": [h.hex() for h in self.hashes], "until": self.until}

    @classmethod
    def from_json(cls, d: object) -> PinRecord:
        """A record from its JSON form; ValueError (with what is wrong) for anything else."""
        if not isinstance(d, dict) or not isinstance(d.get("ns"), str) or not isinstance(d.get("hashes"), list):
            raise ValueError(f"not a pin record: {str(d)[:100]}")
        ns = bytes.fromhex(d["ns"])
        hashes = tuple(bytes.fromhex(h) if isinstance(h, str) else b"" for h in d["hashes"])
        until = d.get("until")
        if len(ns) != 16 or any(len(h) != 16 for h in hashes):
            raise ValueError(f"a pin record names 16-byte hashes in hex: {str(d)[:100]}")
        if until is not None and (isinstance(until, bool) or not isinstance(until, int | float) or not math.isfinite(until)):
            raise ValueError(f"a pin deadline is a number of seconds: {until!r}")
        return cls(ns, hashes, None if until is None else float(until))


def read_pins(path: Path) -> list[PinRecord]:
    """The pin records saved in ``path`` (a store's ``pins.json``), in pinning order; none if
    absent. Read-only: the store's :class:`PinBook` and offline readers (``kvctl --dir``, the
    daemon's admin view) share it."""
    records, bad = _parse_pins(path)
    if bad:
        raise KVStoreError(f"cannot read {path}: {bad}; restore it, or remove it to drop every pin")
    return records


def _parse_pins(path: Path) -> tuple[list[PinRecord], str]:
    """The records that parse, and what was wrong with the rest ("" when nothing was)."""
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return [], ""
    except (OSError, ValueError) as e:  # unreadable, not JSON, not UTF-8
        return [], str(e)
    if not isinstance(raw, list):
        return [], f"expected a list of pin records, got {type(raw).__name__}"
    records: list[PinRecord] = []
    errors: list[str] = []
    for d in raw:
        try:
            records.append(PinRecord.from_json(d))
        except ValueError as e:
            errors.append(str(e))
    return records, f"{len(errors)} damaged record(s), e.g. {errors[0]}" if errors else ""


class PinBook:
    """The pin records of one store; not thread-safe (the store holds its lock)."""

    def __init__(self, path: Path, write: Callable[[Path, bytes], None]) -> None:
        self._path = path
        self._write = write
        self._records: dict[int, PinRecord] = {}  # by sequence number, in pinning order
        self._deadlines: list[tuple[float, int]] = []  # (until, seq); stale entries skipped
        self._seq = 0
        self._load()

    def _load(self) -> None:
        """Damage is moved aside, never fatal (as the tiers do with theirs): the file is kept
        as ``pins.json.corrupt-<time>`` and the records that still parse are re-applied."""
        records, bad = _parse_pins(self._path)
        for r in records:
            self._insert(r)
        if bad:
            aside = self._path.with_name(f"{self._path.name}.corrupt-{int(time.time())}")
            os.replace(self._path, aside)
            log.error("%s is damaged (%s); moved it to %s and kept the %d pin(s) that parse",
                      self._path, bad, aside, len(records))
            self._save()

    def _insert(self, record: PinRecord) -> None:
        self._seq += 1
        self._records[self._seq] = record
        if record.until is not None:
            heapq.heappush(self._deadlines, (record.until, self._seq))

    def _save(self) -> None:
        data = [r.to_json() for r in self._records.values()]
        self._write(self._path, json.dumps(data, indent=1).encode())

    def __iter__(self) -> Iterator[PinRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: PinRecord) -> None:
        self._insert(record)
        self._save()

    def take(self, ns: bytes, hashes: tuple[bytes, ...]) -> PinRecord | None:
        """Remove the record of the longest pinned prefix of ``hashes`` (an untimed one before
        a timed one of the same length); None when no pin covers a prefix of them."""
        best: tuple[tuple[int, bool], int] | None = None
        for seq, r in self._records.items():
            if r.ns != ns or len(r.hashes) > len(hashes) or hashes[: len(r.hashes)] != r.hashes:
                continue
            key = (len(r.hashes), r.until is None)
            if best is None or key > best[0]:
                best = (key, seq)
        if best is None:
            return None
        record = self._records.pop(best[1])
        self._save()
        return record

    def take_exact(self, ns: bytes, hashes: tuple[bytes, ...], until: float | None) -> PinRecord | None:
        """Remove the record of exactly ``hashes`` with exactly ``until`` (the latest such: the
        pin its caller made), or None. For a caller that knows which pin is its own (a
        handoff), so that another pin of the same prefix (the tenant's own guarantee) stays."""
        for seq in reversed(self._records):
            r = self._records[seq]
            if r.ns == ns and r.until == until and r.hashes == hashes:
                del self._records[seq]
                self._save()
                return r
        return None

    def trim(self, ns: bytes, hashes: tuple[bytes, ...]) -> PinRecord | None:
        """Take ``hashes`` out of the untimed pin that holds most of them (an unpin of part of
        a pinned prefix); the blocks taken, or None. Timed pins are guarantees: never trimmed."""
        want = set(hashes)
        best: tuple[int, int] | None = None
        for seq, r in self._records.items():
            if r.ns == ns and r.until is None:
                overlap = len(want.intersection(r.hashes))
                if overlap and (best is None or overlap > best[0]):
                    best = (overlap, seq)
        if best is None:
            return None
        r = self._records[best[1]]
        kept = tuple(h for h in r.hashes if h not in want)
        if kept:
            self._records[best[1]] = PinRecord(r.ns, kept, None)
        else:
            del self._records[best[1]]
        self._save()
        return PinRecord(ns, tuple(h for h in r.hashes if h in want), None)

    def next_deadline(self) -> float:
        """When the next timed pin ends (inf: none); O(1) but for stale heap entries."""
        while self._deadlines and self._deadlines[0][1] not in self._records:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def due(self, now: float) -> list[PinRecord]:
        """Remove and return the records whose deadline has passed."""
        gone: list[PinRecord] = []
        while self.next_deadline() <= now:
            _, seq = heapq.heappop(self._deadlines)
            gone.append(self._records.pop(seq))
        if gone:
            self._save()
        return gone
