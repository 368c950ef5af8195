"""Warm restart from columns (``kvstore/store/restart.py``): the columnar recovery must rebuild
exactly what the per-block recovery it replaced rebuilt (the same index rows and ids, tier bits,
namespaces, counters, policy orders and surviving tier contents), over DRAM + NVMe + object
tiers holding forests with orphans, wrong depths, foreign blocks, copies on two tiers and
expired blocks; with the object tier's manifest torn or stale; and after a crash in the middle
of a restart. The oracle, ``legacy_recover``, is the per-block ``recover`` as it stood before
the columns (commit 9c6ed99), fed by ``Tier.scan``."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import Clock, FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import QuotaExceededError, TierIOError
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash, KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.registry import make_tier
from kvstore.retention import PinBook
from kvstore.store import KVStore, restart
from kvstore.store.ledger import Ledger, bits
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.placer import Placer
from kvstore.store.restart import learn_namespaces

log = logging.getLogger("kvstore.store")

NS = Namespace("test/restart-columns", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 4),)))
OWN = Namespace("test/restart-own", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 8),)))
"""Never registered, no descriptor on any tier: recovered as a namespace of its own."""
ALIEN = Namespace("test/restart-alien", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 4),)))
"""Its object headers carry a descriptor that does not hash to its digest: foreign."""
H = 3600.0


def specs() -> tuple[TierSpec, ...]:
    return (
        TierSpec("dram", "dram", {"capacity_bytes": 4 << 20, "slab_bytes": 1 << 20}),
        TierSpec("nvme", "nvme", {"capacity_bytes": 8 << 20, "slab_bytes": 1 << 20}),
        TierSpec("object", "object", {"capacity_bytes": 64 << 20, "sweep_interval_s": 0}),
    )


def config(root: Path) -> StoreConfig:
    return StoreConfig(root=root, tiers=specs(), persist_on_close=False)


# ---- the per-block recovery the columns replaced (the oracle) -----------------------------------

def legacy_recover(
    tiers: Sequence,
    ledger: Ledger,
    placer: Placer,
    namespaces: NamespaceTable,
    pins: PinBook,
    config: StoreConfig,
    clock: Clock,
) -> None:
    """Rebuild the index from the persistent tiers' own metadata (warm restart)."""
    # A guarantee whose deadline passed while the store was down is dropped unapplied: the
    # first expiry pass would otherwise release it, taking the pin of another record off the
    # blocks the two share.
    pins.due(clock())
    persistent = [k for k, t in enumerate(tiers) if t.persistent]
    shared = {k for k, t in enumerate(tiers) if getattr(t, "shared", False)}
    counters = ledger.counters
    found: dict[bytes, tuple[BlockMeta, int]] = {}
    for k in persistent:
        bit = 1 << k
        for key, meta in tiers[k].scan():
            prev = found.get(key)
            if prev is None:
                found[key] = (meta, bit)
            else:
                found[key] = (meta if meta.expiry > prev[0].expiry else prev[0], prev[1] | bit)
    if not found:
        return
    foreign = learn_namespaces(tiers, namespaces, {meta.ns for meta, _ in found.values()}, config.default_ttl_s)
    now = clock()
    idx = ledger.index
    id_of = idx.id_of
    order = sorted(found.items(), key=lambda kv: kv[1][0].depth)
    recovered: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # per level: ids, masks, sizes, created
    # Per namespace digest: (nid, its block bytes or None when not registered), or None for a
    # foreign one.
    ns_state: dict[bytes, tuple[int, int | None] | None] = {}
    # The depth level being collected, as columns.
    keys: list[bytes] = []
    masks: list[int] = []
    pids: list[int] = []
    metas: list[BlockMeta] = []
    nids: list[int] = []

    def drop_orphan(key: bytes, mask: int) -> None:
        # A block whose parent did not survive (it lived only in DRAM) can never be reached by
        # a prefix match; free its room. Not on a shared tier: there the parent may be in
        # another node's DRAM, to be written later (a probe then finds both).
        counters.orphans_dropped += 1
        for k in bits(mask):
            if k in shared:
                continue
            try:
                tiers[k].delete(BlockHash(key))
            except TierIOError as e:
                log.warning("could not drop orphan %s from tier %s: %s", key.hex(), tiers[k].name, e)

    def insert_level(depth: int) -> None:
        # One depth level at a time: every parent is already in the index.
        if not keys:
            return
        parents = np.array(pids, np.int64)
        linked = parents != NO_PARENT
        wrong = linked & (idx.depth[np.where(linked, parents, 0)] != depth - 1)
        keep = None
        if wrong.any():  # a parent at another depth: damaged metadata, an orphan
            for i in np.flatnonzero(wrong).tolist():
                drop_orphan(keys[i], masks[i])
            keep = np.flatnonzero(~wrong)
        n = len(keys) if keep is None else keep.size
        if n:
            cols = (keys, masks, metas, nids) if keep is None else (
                [c[i] for i in keep.tolist()] for c in (keys, masks, metas, nids))
            lk, lm, lmeta, ln = cols
            mask_col = np.array(lm, np.uint8)
            sizes = np.fromiter(map(attrgetter("size"), lmeta), np.uint32, n)
            created = np.fromiter(map(attrgetter("created"), lmeta), np.float64, n)
            ids = idx.insert_blocks(
                lk,
                (parents if keep is None else parents[keep]).astype(np.int32),
                np.full(n, depth, np.int32),
                sizes,
                np.array(ln, np.uint16),
                mask_col,
                created,
                np.fromiter(map(attrgetter("expiry"), lmeta), np.float64, n),
            )
            recovered.append((np.asarray(ids, np.int64), mask_col, sizes, created))
        for c in (keys, masks, pids, metas, nids):
            c.clear()

    depth = 0
    for key, (meta, mask) in order:
        if meta.depth != depth:
            insert_level(depth)
            depth = meta.depth
        ns = meta.ns
        if ns in ns_state:
            state = ns_state[ns]
        else:
            info = namespaces.by_digest.get(ns)
            if ns in foreign:
                state = None
            elif info is None:
                state = (-1, None)  # a namespace of its own, made at its first block
            else:
                state = (info.nid, info.namespace.block_bytes if info.namespace is not None else None)
            ns_state[ns] = state
        if state is None or (state[1] is not None and meta.size != state[1]):
            # Another schema version or layout: never served, and left where it is for the
            # stores it belongs to.
            counters.foreign_blocks += 1
            continue
        if state[0] < 0:
            try:
                state = ns_state[ns] = (namespaces.add(ns, None, config.default_ttl_s).nid, None)
            except QuotaExceededError as e:  # past max_namespaces: kept on the tier, not served
                log.warning("blocks of namespace %s are not served: %s", ns.hex(), e)
                ns_state[ns] = None
                counters.foreign_blocks += 1
                continue
        pid = (NO_PARENT if meta.parent == ns else None) if depth == 0 else id_of(meta.parent)
        if pid is None:
            drop_orphan(key, mask)
            continue
        keys.append(key)
        masks.append(mask)
        pids.append(pid)
        metas.append(meta)
        nids.append(state[0])
    insert_level(depth)
    # Policies learn the blocks deepest first, so leaves are the first candidates: one
    # insert_many per tier, in the order of per-block inserts (the last tier's policy sees the
    # final child counts and holds the blocks that have children).
    n_recovered = 0
    if recovered:
        all_ids, all_masks, all_sizes, all_created = (np.concatenate(col)[::-1] for col in zip(*recovered, strict=True))
        n_recovered = all_ids.size
        for k in range(len(tiers)):
            on_k = (all_masks & (1 << k)) != 0
            if on_k.any():
                ledger.policies[k].insert_many(all_ids[on_k], all_sizes[on_k], all_created[on_k])
        placer.keep_always(all_ids)  # admission never refuses a block that was stored before
    counters.recovered_blocks += n_recovered
    for record in pins:  # before expiry: a pinned block must not expire at open
        if record.until is None or record.until > now:
            ledger.pin([i for h in record.hashes if (i := idx.id_of(h)) is not None])
    placer.expire(now, config.expire_work_cap)
    log.info("recovered %d blocks", counters.recovered_blocks)




# ---- a store directory to restart from --------------------------------------------------------------


def populate(root: Path, seed: int, clock: FakeClock) -> dict[str, int]:
    """Chains written straight through the persistent tiers (as a store that ran before left
    them), with the damage a restart must sort out; returns how many of each kind were made."""
    with KVStore(config(root), clock=clock) as s:
        s.register_namespace(NS)  # namespaces.json, as a store that ran before leaves it
    rng = random.Random(seed)
    tiers = {t.name: make_tier(t.kind, t.name, dict(t.options), root, clock) for t in specs()[1:]}
    tiers["object"].register_namespace(NS.root, NS.canonical_bytes())
    tiers["object"].register_namespace(ALIEN.root, json.dumps({"model_id": "not a namespace"}).encode())
    now = clock()
    made = dict.fromkeys(("skipped", "wrong_depth", "bad_root", "wrong_size", "expired", "both"), 0)
    earlier: list[tuple[Namespace, list[int]]] = []
    for c in range(28):
        if earlier and rng.random() < 0.4:  # a fork: an earlier chain's prefix, then new blocks
            ns, base = rng.choice(earlier)
            tokens = base[: 4 * rng.randint(1, len(base) // 4)] + list(range(10**6 + c * 100, 10**6 + c * 100 + 4 * rng.randint(1, 5)))
        else:
            ns = rng.choice([NS, NS, NS, NS, OWN, ALIEN])
            tokens = list(range(c * 1000, c * 1000 + 4 * rng.randint(1, 10)))
        earlier.append((ns, tokens))
        hashes = hash_blocks(ns, tokens)
        writes: dict[str, list[tuple[BlockHash, bytes, BlockMeta]]] = {"nvme": [], "object": []}
        for i, h in enumerate(hashes):
            if rng.random() < 0.04:
                made["skipped"] += 1  # lost (it lived in DRAM only): its descendants are orphans
                continue
            depth, parent, size = i, hashes[i - 1] if i else ns.root, ns.block_bytes
            if rng.random() < 0.03:
                depth += 1
                made["wrong_depth"] += 1
            if i == 0 and rng.random() < 0.1:
                parent = bytes(rng.randrange(256) for _ in range(16))
                made["bad_root"] += 1
            if ns is NS and rng.random() < 0.03:
                size += 4  # another layout's size: never served
                made["wrong_size"] += 1
            lapsed = rng.random() < (0.4 if i == len(hashes) - 1 else 0.05)  # a leaf, mostly
            expiry = now - 1.0 if lapsed else now + rng.uniform(1, 100) * H
            made["expired"] += expiry < now
            payload = bytes([c % 251]) * size
            meta = BlockMeta(ns.root, parent, depth, size, expiry, payload_checksum(payload), now - rng.uniform(0, 10 * H))
            where = rng.random()
            if where < 0.1:  # on both, one copy refreshed later than the other
                made["both"] += 1
                writes["nvme"].append((h, payload, meta))
                writes["object"].append((h, payload, meta.with_expiry(expiry + rng.choice([-H, 0.0, H]))))
            else:
                writes["nvme" if where < 0.55 else "object"].append((h, payload, meta))
        for name, items in writes.items():
            errors = tiers[name].write_many(items, durable=True)
            assert errors == [None] * len(items)
    for t in tiers.values():
        t.close()  # the object tier writes its header manifest
    return made



def snapshot(s: KVStore) -> dict[str, Any]:
    """Everything a restart decides: index rows (with their ids), namespaces, counters, each
    policy's order, and what the persistent tiers still hold."""
    idx = s.index
    rows = {}
    for bid in idx.live_ids().tolist():
        p = int(idx.parent[bid])
        rows[idx.hash_of(bid)] = (bid, None if p == NO_PARENT else idx.hash_of(p), *(
            col[bid].item() for col in (idx.depth, idx.size, idx.ns, idx.tiers, idx.children, idx.pins,
                                          idx.expiry, idx.last_access)))
    st = s.stats()
    return {
        "index": rows,
        "namespaces": sorted((info.digest, info.nid) for info in s._namespaces),  # noqa: SLF001
        "counters": {k: st[k] for k in ("recovered_blocks", "orphans_dropped", "foreign_blocks", "expirations")},
        "order": [list(p.candidates()) for p in s._ledger.policies],  # noqa: SLF001
        "tiers": [sorted(t.scan(), key=lambda kv: kv[0]) for t in s.tiers if t.persistent],
    }


def reopen(root: Path, clock: Clock) -> dict[str, Any]:
    with KVStore(config(root), clock=clock) as s:
        return snapshot(s)


def both_ways(tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, ready: Path) -> tuple[dict, dict]:
    """The columnar restart of ``ready`` and the per-block one of a copy of it."""
    shutil.copytree(ready, tmp_path / "old")
    new = reopen(ready, clock)
    with monkeypatch.context() as m:
        m.setattr(restart, "recover", legacy_recover)
        old = reopen(tmp_path / "old", clock)
    return new, old


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_columnar_recovery_rebuilds_what_the_per_block_one_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    clock = FakeClock()
    made = populate(tmp_path / "new", seed, clock)
    clock.advance(H)
    new, old = both_ways(tmp_path, clock, monkeypatch, tmp_path / "new")
    assert new == old
    c = new["counters"]
    # The case covers what it claims to: every kind of damage, and blocks on both tiers.
    assert c["recovered_blocks"] > 20 and c["orphans_dropped"] > 0 and c["foreign_blocks"] > 0
    assert made["both"] and made["expired"] and c["expirations"] > 0
    assert any(r[5] == 0b110 for r in new["index"].values())  # a block with both copies
    assert len(new["namespaces"]) == 2  # NS and OWN (learned at its first block); ALIEN is foreign


def _damage_manifest(root: Path, how: str, clock: FakeClock) -> None:
    from tiers.object import manifest

    path = root / "tiers" / "object" / "objects" / manifest.NAME
    if how == "torn":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "damaged entry":  # a header in the manifest flipped; the manifest's own checksum fine
        book = manifest.load(str(path))
        assert book is not None
        raw = book.records["key"].tobytes()
        entries = []
        for i in range(len(book)):
            head = bytearray(book.headers[int(book.starts[i]) : int(book.ends[i])])
            if i % 7 == 3:
                head[40] ^= 0xFF
            r = book.records[i]
            entries.append((raw[16 * i : 16 * i + 16], (int(r["size"]), int(r["mtime"]), int(r["ctime"]), int(r["ino"])), bytes(head)))
        manifest.save(str(path), entries)
    elif how == "stale":  # objects rewritten, added and removed after the manifest was written
        spec = specs()[2]
        quiet = make_tier(spec.kind, spec.name, {**spec.options, "manifest": False}, root, clock)
        found = sorted(quiet.scan(), key=lambda kv: kv[0])
        for key, meta in found[::9]:
            payload = bytes(meta.size)
            quiet.write(key, payload, meta.with_expiry(meta.expiry + 5 * H).with_checksum(payload_checksum(payload)), durable=True)
        for key, _ in found[4::11]:
            quiet.delete(key)
        quiet.close()
    else:
        assert how == "none"


@pytest.mark.parametrize("how", ["none", "torn", "stale", "damaged entry"])
def test_a_torn_or_stale_manifest_changes_nothing_but_the_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    clock = FakeClock()
    populate(tmp_path / "new", 7, clock)
    _damage_manifest(tmp_path / "new", how, clock)
    shutil.copytree(tmp_path / "new", tmp_path / "files")
    (tmp_path / "files" / "tiers" / "object" / "objects" / "manifest.kvm").unlink(missing_ok=True)
    # The object tier alone: its columns from the manifest equal those read from every file.
    from tiers.object.local import LocalBlobs

    read = []  # headers read from their files, per scan
    headers = LocalBlobs.headers
    monkeypatch.setattr(LocalBlobs, "headers", lambda self, items: read.append(len(items)) or headers(self, items))
    spec = specs()[2]
    scans = []
    for root in (tmp_path / "new", tmp_path / "files"):
        # A copy would change every object's inode: the manifest would hold none of them. With
        # manifest = false the tier reads the manifest but neither retires nor rewrites it.
        t = make_tier(spec.kind, spec.name, {**spec.options, "manifest": False}, root, clock)
        cols = list(t.scan_columns())
        d = t.describe()
        scans.append(([{f: getattr(c, f).tolist() for f in c.__slots__} for c in cols], d["bad_headers"], d["foreign_objects"]))
        t.close()
    monkeypatch.setattr(LocalBlobs, "headers", headers)
    assert scans[0] == scans[1]
    objects = sum(len(c) for c in cols)
    # With a sound manifest no header is read from its file; a damaged one costs only its entries.
    expected = {"none": 0, "torn": objects, "stale": None, "damaged entry": None}[how]
    if expected is not None:
        assert read[0] == expected
    assert 0 < read[0] < objects if how in ("stale", "damaged entry") else True
    assert read[1] == objects
    new, old = both_ways(tmp_path, clock, monkeypatch, tmp_path / "new")
    assert new == old
    assert new == reopen(tmp_path / "files", clock)  # every header from its file: the same


_CRASH = """
import os, sys
from pathlib import Path
from kvstore.clock import FakeClock
from kvstore.store import KVStore, placer
from tests.kvstore.store.test_restart_columns import config
placer.Placer.expire = lambda self, now, cap: os._exit(9)  # killed once the index is rebuilt
KVStore(config(Path(sys.argv[1])), clock=FakeClock(float(sys.argv[2])))
"""


def test_a_restart_killed_midway_leaves_a_directory_the_next_one_rebuilds_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    populate(tmp_path / "new", 5, clock)
    shutil.copytree(tmp_path / "new", tmp_path / "clean")
    # Killed after the orphans went and the manifest was retired, before the expiry pass and
    # any close: no manifest is left, and the next restart reads every header.
    crash = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path / "new"), repr(clock())],
                           capture_output=True, text=True, env={**os.environ}, timeout=300)
    assert crash.returncode == 9, crash.stderr
    assert not (tmp_path / "new" / "tiers" / "object" / "objects" / "manifest.kvm").exists()
    new, old = both_ways(tmp_path, clock, monkeypatch, tmp_path / "new")
    assert new == old
    clean = reopen(tmp_path / "clean", clock)
    assert new["counters"]["orphans_dropped"] == 0 < clean["counters"]["orphans_dropped"]  # dropped by the killed run
    assert {k: v for k, v in new.items() if k != "counters"} == {k: v for k, v in clean.items() if k != "counters"}
    assert new["counters"]["recovered_blocks"] == clean["counters"]["recovered_blocks"]


def _settle_directories(root: Path, clock: FakeClock) -> Path:
    """Age the object tier's prefix directories (as hours without writes would) and let a
    clean close write the manifest: from then on the directories vouch for their objects."""
    blocks = root / "tiers" / "object" / "objects" / "blocks"
    old = os.stat(blocks).st_mtime - 3600
    for d in blocks.iterdir():
        os.utime(d, (old, old))
    spec = specs()[2]
    t = make_tier(spec.kind, spec.name, dict(spec.options), root, clock)
    list(t.scan_columns())
    t.close()  # writes the manifest, with the directories' stats
    return blocks


@pytest.mark.parametrize("change", ["none", "rewritten", "added by hand"])
def test_settled_directories_vouch_for_their_objects_and_a_changed_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    from tiers.object import local

    clock = FakeClock()
    populate(tmp_path / "new", 11, clock)
    blocks = _settle_directories(tmp_path / "new", clock)
    spec = specs()[2]
    changed: set[str] = set()
    if change == "rewritten":  # through a tier: temp name, then rename, so the directory changes
        quiet = make_tier(spec.kind, spec.name, {**spec.options, "manifest": False}, tmp_path / "new", clock)
        key, meta = sorted(quiet.scan(), key=lambda kv: kv[0])[3]
        payload = bytes(meta.size)
        quiet.write(key, payload, meta.with_expiry(meta.expiry + H).with_checksum(payload_checksum(payload)), durable=True)
        quiet.close()
        changed.add(key.hex()[:2])
    elif change == "added by hand":  # a copy of an object under a name the manifest lacks
        some = next(p for p in sorted(blocks.rglob("*.kvb")))
        other = sorted(blocks.rglob("*.kvb"))[-1]
        shutil.copy(other, some.parent / other.name)
        changed.add(some.parent.name)
    shutil.copytree(tmp_path / "new", tmp_path / "files")
    (tmp_path / "files" / "tiers" / "object" / "objects" / "manifest.kvm").unlink()
    statted: list[str] = []
    stat_of = local.stat_of
    monkeypatch.setattr(local, "stat_of", lambda st: statted.append("file") or stat_of(st))
    t = make_tier(spec.kind, spec.name, {**spec.options, "manifest": False}, tmp_path / "new", clock)
    vouched = [{f: getattr(c, f).tolist() for f in c.__slots__} for c in t.scan_columns()], t.describe()["bad_headers"]
    t.close()
    in_changed = sum(1 for d in changed for _ in (blocks / d).iterdir())
    assert len(statted) == in_changed  # only the files of a changed directory were statted
    monkeypatch.setattr(local, "stat_of", stat_of)
    t = make_tier(spec.kind, spec.name, {**spec.options, "manifest": False}, tmp_path / "files", clock)
    from_files = [{f: getattr(c, f).tolist() for f in c.__slots__} for c in t.scan_columns()], t.describe()["bad_headers"]
    t.close()
    assert vouched == from_files
    new, old = both_ways(tmp_path, clock, monkeypatch, tmp_path / "new")
    assert new == old
