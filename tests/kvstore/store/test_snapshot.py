"""StoreSnapshot: a store directory read offline, without changing a byte of it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig
from kvstore.store import KVStore
from kvstore.store.snapshot import StoreSnapshot
from tests.conftest import SMALL_NS, chain_for, payload, small_tiers
from tiers.nvme import lock_holder, read_metadata


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and directory under ``root`` with its size, mtime and ctime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def _filled(tmp_path: Path, clock: Any) -> tuple[StoreConfig, list[bytes], list[bytes]]:
    cfg = StoreConfig(root=tmp_path / "store", tiers=small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=64))
    a, b = chain_for(1, 6), chain_for(2, 10)
    with KVStore(cfg, clock=clock) as s:
        s.register_namespace(SMALL_NS, ttl_s=7200)
        for c in (a, b):
            s.put(SMALL_NS, c, [payload(h) for h in c])
    return cfg, a, b


def test_the_snapshot_sees_what_the_persistent_tiers_hold_and_changes_nothing(tmp_path: Path, clock: Any) -> None:
    cfg, a, b = _filled(tmp_path, clock)
    before = _tree(cfg.root)
    snap = StoreSnapshot(cfg, clock=clock)
    assert snap.holder is None
    assert snap.stats()["blocks"] == 16 and snap.stats()["expired_blocks"] == 0
    assert [(ns, ttl) for ns, ttl in snap.namespaces()] == [(SMALL_NS, 7200.0)]
    assert snap.namespace_usage() == {SMALL_NS.root: (16, 16 * 4096)}
    tiers = {t["name"]: t for t in snap.tiers()}
    assert tiers["dram"]["blocks"] == 0 and "volatile" in tiers["dram"]["note"]
    assert tiers["nvme"]["blocks"] + tiers["object"]["blocks"] >= 16
    n, where = snap.lookup(SMALL_NS.root, b + [b"\0" * 16])
    assert n == 10 and set(where) <= {"nvme", "object"}
    assert snap.lookup(b"\1" * 16, b)[0] == 0  # another namespace's chain
    (row,) = snap.iter_blocks([b[3]])
    assert row["parent"] == b[2].hex() and row["depth"] == 3 and row["namespace"] == SMALL_NS.root.hex()
    assert next(snap.iter_blocks([a[0]]))["parent"] is None
    clock.advance(7201)
    assert snap.stats()["expired_blocks"] == 16 and snap.lookup(SMALL_NS.root, b)[0] == 0
    assert _tree(cfg.root) == before


_HOLD = """
import sys
from kvstore.config import StoreConfig
from kvstore.store import KVStore
from tests.conftest import small_tiers
s = KVStore(StoreConfig(root=sys.argv[1], tiers=small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=64)))
print("open", flush=True)
sys.stdin.readline()
s.close()
"""


def test_a_live_holder_is_named_and_still_read(tmp_path: Path) -> None:
    clock = time.time  # the holder runs on the real clock: blocks of a fake past would expire
    cfg, _, _ = _filled(tmp_path, clock)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(cfg.root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        assert lock_holder(cfg.root, "nvme") == proc.pid
        assert len(read_metadata(cfg.root, "nvme")) >= 1  # read-only open works beside the writer
        assert StoreSnapshot(cfg, clock=clock).holder == proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(60)
    assert lock_holder(cfg.root, "nvme") is None


def test_a_missing_directory_says_what_to_pass(tmp_path: Path) -> None:
    import pytest

    from kvstore.errors import UsageError

    with pytest.raises(UsageError, match="not a store directory"):
        StoreSnapshot(StoreConfig(root=tmp_path / "nope", tiers=small_tiers()))


def test_the_snapshot_reads_pins_and_keeps_pinned_blocks_unexpired(tmp_path: Path, clock: Any) -> None:
    cfg, a, b = _filled(tmp_path, clock)
    until = clock() + 10 * 3600
    with KVStore(cfg, clock=clock) as s:
        s.register_namespace(SMALL_NS)
        s.pin(SMALL_NS, a[:2])
        s.pin(SMALL_NS, a, until=until)
    before = _tree(cfg.root)
    snap = StoreSnapshot(cfg, clock=clock)
    p = snap.pins()
    assert p["summary"] == {"pins": 2, "timed": 1, "untimed": 1, "pinned_blocks": 6, "next_until": until, "ended": 0}
    assert [(r["block"], r["blocks"], r["until"], r["active"]) for r in p["pins"]] == [
        (a[1].hex(), 2, None, True), (a[5].hex(), 6, until, True)]
    assert snap.pins(ns="00" * 16)["pins"] == []
    (row,) = snap.iter_blocks([a[0]])
    assert row["pins"] == 2 and row["pin_until"] == [None, until]
    assert next(snap.iter_blocks([b[0]]))["pin_until"] == []
    clock.advance(7201)  # past the namespace's TTL: only what the pins hold is not expired
    assert snap.stats()["expired_blocks"] == 10 and snap.stats()["pins"]["pins"] == 2
    assert snap.lookup(SMALL_NS.root, a)[0] == 6 and snap.lookup(SMALL_NS.root, b)[0] == 0
    clock.set(until + 1)  # the guarantee has ended: a store opened now keeps the untimed pin only
    assert snap.pins()["summary"]["ended"] == 1 and [r["active"] for r in snap.pins()["pins"]] == [True, False]
    assert snap.lookup(SMALL_NS.root, a)[0] == 2
    assert _tree(cfg.root) == before


def test_a_damaged_pins_file_is_reported_not_fatal(tmp_path: Path, clock: Any) -> None:
    cfg, _, _ = _filled(tmp_path, clock)
    (cfg.root / "pins.json").write_text("{not json")
    snap = StoreSnapshot(cfg, clock=clock)
    assert "pins.json" in snap.stats()["pins_error"] and snap.stats()["blocks"] == 16
