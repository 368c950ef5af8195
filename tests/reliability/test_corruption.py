"""Corruption: bit flips, truncation and deleted files in the NVMe slab file, its metadata
store (RocksDB) and the object tier's objects.

Every damaged block is detected (100%, on hundreds of random flips), served as a miss and never
as wrong bytes, counted, and repaired (a later put stores a good copy) or quarantined (moved out
of the way at open, so that nothing damaged stays on the tier's books). Damage a store cannot
read around (its metadata DB) costs that tier's contents, never the daemon's start.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.reliability.harness import Tally, check_served, disk_inventory, pick
from tiers.nvme import read_metadata

FLIPS = pick(128, 1024)  # damaged blocks per kind of damage


def _tiers(nvme_blocks: int = 4096, with_object: bool = True) -> tuple[TierSpec, ...]:
    out = [
        TierSpec("dram", "dram", {"capacity_bytes": 16 * BB, "slab_bytes": 4 * BB}),
        TierSpec("nvme", "nvme", {"capacity_bytes": nvme_blocks * BB, "slab_bytes": 64 * BB}),
    ]
    if with_object:
        out.append(TierSpec("object", "object", {"capacity_bytes": 1 << 30}))
    return tuple(out)


def _open(root: Path, tiers: tuple[TierSpec, ...], clock: FakeClock) -> KVStore:
    s = KVStore(StoreConfig(root=root, tiers=tiers), clock=clock)
    s.register_namespace(SMALL_NS)
    return s


def _fill(store: KVStore, chains: int, blocks: int, durable: bool = True) -> list[list[bytes]]:
    out = []
    for i in range(chains):
        c = chain_for(10_000 + i, blocks)
        store.put(SMALL_NS, c, [payload(h) for h in c], durable=durable)
        out.append(c)
    return out


def _load(store: KVStore, chain: list[bytes], tally: Tally) -> int:
    buf = np.zeros(len(chain) * BB, np.uint8)
    n = store.get_into(SMALL_NS, chain, buf)
    check_served(chain, buf, n, tally, "load")
    return n


def _flip(path: Path, offset: int, rng: random.Random) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def _object_path(root: Path, key: bytes) -> Path:
    h = key.hex()
    return root / "tiers" / "object" / "objects" / "blocks" / h[:2] / f"{h}.kvb"


# ---- NVMe payloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["bit flip", "garbage run", "zeroed block"])
def test_every_damaged_nvme_payload_is_a_miss_counted_and_repaired(tmp_path: Path, damage: str, figures) -> None:
    clock, rng, root = FakeClock(), random.Random(hash(damage) & 0xFFFF), tmp_path / "s"
    tiers = _tiers(with_object=False)
    chains = FLIPS // 4
    with _open(root, tiers, clock) as s:
        all_chains = _fill(s, chains, 4)
    records = {bytes(k): off for k, off, _ in read_metadata(root, "nvme")}
    slab = root / "tiers" / "nvme" / "data.slab"
    victims: dict[int, int] = {}  # chain -> depth of its damaged block
    for i, c in enumerate(all_chains):
        d = rng.randrange(len(c))
        off = records[c[d]]
        if damage == "bit flip":
            _flip(slab, off + rng.randrange(BB), rng)
        else:
            with open(slab, "r+b") as f:
                n = BB if damage == "zeroed block" else rng.randrange(1, 64)
                f.seek(off + (0 if damage == "zeroed block" else rng.randrange(BB - n)))
                f.write(bytes(n) if damage == "zeroed block" else os.urandom(n))
        victims[i] = d
    tally = Tally()
    # Blocks shared by several chains (none here: every chain has its own tokens) aside, each
    # load stops exactly at its damaged block.
    with _open(root, tiers, clock) as s:
        for i, c in enumerate(all_chains):
            assert _load(s, c, tally) == victims[i], f"chain {i}: damage at block {victims[i]} not detected"
        stats = s.stats()
        assert stats["corrupt_blocks"] == chains
        # Repair: the engine recomputes and puts the missing blocks; the chain is whole again.
        for c in all_chains:
            s.put(SMALL_NS, c, [payload(h) for h in c], durable=True)
        assert all(_load(s, c, tally) == len(c) for c in all_chains)
    assert not tally.wrong_blocks
    figures(damaged_blocks=chains, detected=stats["corrupt_blocks"], served_wrong=0, repaired_by_put=chains)


def test_truncated_or_deleted_slab_file(tmp_path: Path, figures) -> None:
    clock, root = FakeClock(), tmp_path / "s"
    tiers = _tiers(nvme_blocks=256, with_object=False)
    with _open(root, tiers, clock) as s:
        chains = _fill(s, 32, 4)
    slab = root / "tiers" / "nvme" / "data.slab"
    os.truncate(slab, slab.stat().st_size // 4)  # the open re-extends it: zeros past the cut
    tally = Tally()
    with _open(root, tiers, clock) as s:
        served = sum(_load(s, c, tally) for c in chains)
        truncated = s.stats()["corrupt_blocks"]
    assert 0 < served < 32 * 4 and truncated > 0 and not tally.wrong_blocks
    slab.unlink()
    with _open(root, tiers, clock) as s:
        assert sum(_load(s, c, tally) for c in chains) == 0
        dropped = s.stats()["tiers"][1]["dropped_on_open"]
        assert dropped > 0 and s.stats()["blocks"] == 0
    assert read_metadata(root, "nvme") == []  # no record left pointing into the new file
    figures(truncated_detected=truncated, records_dropped_after_slab_deleted=dropped)


# ---- NVMe metadata (RocksDB) ------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["bit flips", "truncation", "deletion"])
def test_damaged_metadata_db_never_stops_the_store(tmp_path: Path, damage: str, figures) -> None:
    """Every file of the metadata DB in turn: the store opens, serves only right bytes, and a
    DB it cannot read is quarantined (moved aside) and counted."""
    clock, rng = FakeClock(), random.Random(3)
    tiers = _tiers(nvme_blocks=1024, with_object=False)
    pristine = tmp_path / "pristine"
    with _open(pristine, tiers, clock) as s:
        chains = _fill(s, 64, 4)
    db = pristine / "tiers" / "nvme" / "meta.rocksdb"
    files = sorted(p.name for p in db.iterdir() if p.is_file() and p.name != "LOCK" and not p.name.startswith("LOG"))
    outcomes = {"served_all": 0, "served_some": 0, "quarantined": 0}
    for name in files:
        root = tmp_path / f"case-{name}"
        shutil.copytree(pristine, root)
        target = root / "tiers" / "nvme" / "meta.rocksdb" / name
        size = target.stat().st_size
        if damage == "deletion":
            target.unlink()
        elif damage == "truncation":
            os.truncate(target, size // 2)
        else:
            for _ in range(8):
                if size:
                    _flip(target, rng.randrange(size), rng)
        tally = Tally()
        with _open(root, tiers, clock) as s:  # never raises
            served = sum(_load(s, c, tally) for c in chains)
            quarantined = s.stats()["tiers"][1].get("quarantined", 0)
        assert not tally.wrong_blocks, (name, tally.wrong_blocks[:3])
        if quarantined:
            outcomes["quarantined"] += 1
            assert any(p.name.startswith("meta.rocksdb.corrupt") for p in (root / "tiers" / "nvme").iterdir())
        outcomes["served_all" if served == 64 * 4 else "served_some"] += 1
        # A second open is clean: what was quarantined stays out of the way.
        with _open(root, tiers, clock) as s:
            assert sum(_load(s, c, tally) for c in chains) == served
    figures(db_files=files, **outcomes)


# ---- object tier --------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["payload bit flip", "header bit flip", "truncation", "deletion"])
def test_damaged_objects_are_misses_then_repaired(tmp_path: Path, damage: str, figures) -> None:
    """Damage while the store runs: the read detects it, the copy is dropped, a put repairs it."""
    clock, rng, root = FakeClock(), random.Random(5), tmp_path / "s"
    tiers = (TierSpec("object", "object", {"capacity_bytes": 1 << 30}),)
    n = FLIPS // 4
    tally = Tally()
    with _open(root, tiers, clock) as s:
        chains = _fill(s, n, 4)
        depths = []
        for c in chains:
            d = rng.randrange(4)
            path = _object_path(root, c[d])
            size = path.stat().st_size
            if damage == "payload bit flip":
                _flip(path, size - BB + rng.randrange(BB), rng)
            elif damage == "header bit flip":
                _flip(path, rng.randrange(size - BB), rng)
            elif damage == "truncation":
                os.truncate(path, rng.randrange(size))
            else:
                path.unlink()
            depths.append(d)
        for c, d in zip(chains, depths, strict=True):
            assert _load(s, c, tally) == d
        st = s.stats()
        assert st["corrupt_blocks"] + st["tier_errors"] == n
        assert (st["tier_errors"] == n) == (damage == "deletion")
        for c in chains:
            s.put(SMALL_NS, c, [payload(h) for h in c], durable=True)
        assert all(_load(s, c, tally) == 4 for c in chains)
    assert not tally.wrong_blocks
    figures(damaged=n, detected=st["corrupt_blocks"] + st["tier_errors"], served_wrong=0)


@pytest.mark.parametrize("damage", ["header bit flip", "payload bit flip", "truncation", "temp file"])
def test_objects_damaged_at_rest_are_quarantined_at_open(tmp_path: Path, damage: str, figures) -> None:
    """Damage while the store is down: the next open keeps no damaged object on its books, and
    moves what it cannot read (and temp files of cut-short writes) out of the tier."""
    clock, rng, root = FakeClock(), random.Random(7), tmp_path / "s"
    tiers = (TierSpec("object", "object", {"capacity_bytes": 1 << 30}),)
    with _open(root, tiers, clock) as s:
        chains = _fill(s, 16, 4)
    damaged = []
    for c in chains:
        key = c[rng.randrange(4)]
        path = _object_path(root, key)
        size = path.stat().st_size
        if damage == "header bit flip":
            _flip(path, rng.randrange(size - BB), rng)
        elif damage == "payload bit flip":
            _flip(path, size - BB + rng.randrange(BB), rng)
        elif damage == "truncation":
            os.truncate(path, rng.randrange(size))
        else:  # a write cut short by a crash: the temp name it never got to rename
            shutil.copy(path, f"{path}.tmp-{rng.getrandbits(64):016x}")
            continue
        damaged.append(key)
    tally = Tally()
    with _open(root, tiers, clock) as s:
        for c in chains:
            _load(s, c, tally)
        st = s.stats()
        described = st["tiers"][0]
    assert not tally.wrong_blocks
    inv = disk_inventory(root)
    assert inv.temp_files == []
    # Header damage and truncation are found by the open's listing; payload damage by the read.
    assert not set(damaged) & inv.objects
    quarantine = root / "tiers" / "object" / "objects" / "quarantine"
    found_at_open = described.get("quarantined", 0)
    if damage in ("header bit flip", "truncation"):
        assert found_at_open == len(damaged) == len(list(quarantine.iterdir()))
    elif damage == "payload bit flip":
        assert st["corrupt_blocks"] == len(damaged)
    figures(damaged=len(damaged) or len(chains), quarantined_at_open=found_at_open,
            detected_on_read=st["corrupt_blocks"])
