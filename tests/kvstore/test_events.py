"""The event log: config, the writer (rotation, retention, drops), the reader, the store's hooks."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.eventread import read_events
from kvstore.events import (
    EventLog,
    EventsConfig,
    decode_hashes,
    event_files,
    key_int,
    short_key,
)
from kvstore.keys import Namespace
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers


def _ev(tmp_path: Path) -> EventsConfig:
    return EventsConfig(enabled=True, dir=tmp_path / "events")


def test_events_table_and_environment(tmp_path: Path) -> None:
    cfg_file = tmp_path / "kv.toml"
    cfg_file.write_text('[events]\nenabled = true\nmax_bytes = "1MiB"\nmax_age = "30min"\nretain_bytes = "1GiB"\n')
    cfg = load_config(cfg_file, env={"KVSTORE_EVENTS_DIR": str(tmp_path / "ev")})
    assert cfg.events == EventsConfig(True, tmp_path / "ev", 1 << 20, 1800.0, 1 << 30)
    assert load_config(env={}).events.enabled is None  # the host decides: off in process
    with pytest.raises(ConfigError, match="unknown key 'max_files'"):
        load_config(env={"KVSTORE_EVENTS_MAX_FILES": "3"})
    with pytest.raises(ConfigError, match="max_bytes and max_age must be positive"):
        EventsConfig(max_bytes=0)


def test_records_round_trip_with_hashes_as_bytes_or_ints(tmp_path: Path) -> None:
    clock = FakeClock()
    chain = chain_for(1, 3)
    with EventLog(tmp_path, clock=clock, source="replay", tiers=["dram", "nvme"]) as log:
        log.namespace(SMALL_NS, tenant="a", ttl_s=3600)
        log.request(ns=SMALL_NS.root, hashes=chain, hit_blocks=2, block_tokens=16, hit_tiers={"dram": 1, "nvme": 1},
                    tenant="a", lookup_s=0.001, load_s=0.002)
        log.request(ns="ff" * 16, hashes=[7, 8, 9], hit_blocks=0, block_tokens=512, t=clock() + 5)
        log.block("evicted", chain[2], tier="nvme", reason="capacity:lru")
    recs = list(read_events(tmp_path))
    assert [r["type"] for r in recs] == ["header", "namespace", "request", "request", "block"]
    assert recs[0]["source"] == "replay" and recs[0]["tiers"] == ["dram", "nvme"]
    req = recs[2]
    assert req["tenant"] == "a" and req["prompt_tokens"] == 48 and req["hit_tokens"] == 32
    assert req["hit_tokens_by_tier"] == {"dram": 16, "nvme": 16}
    assert decode_hashes(req["h"]).tolist() == [key_int(h) for h in chain]
    assert decode_hashes(recs[3]["h"]).tolist() == [7, 8, 9] and recs[3]["t"] == clock() + 5
    assert int.from_bytes(bytes.fromhex(recs[4]["h"]), "little") == key_int(chain[2])
    assert recs[4]["reason"] == "capacity:lru"
    # Time filters apply to what happens, not to what describes.
    later = list(read_events(tmp_path, since=clock() + 1))
    assert [r["type"] for r in later] == ["header", "namespace", "request"]


def test_blocks_go_as_one_record_and_a_flush_cuts_the_writers_wait_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blocks`` queues many block events as one record, written as one line each, in order,
    exactly as ``block`` writes them; the writer waits ``COALESCE_S`` after a record wakes it
    (an hour here), and ``flush`` and ``close`` end that wait."""
    monkeypatch.setattr("kvstore.events.COALESCE_S", 3600.0)
    clock = FakeClock()
    chain = chain_for(2, 3)
    log = EventLog(tmp_path, clock=clock, tiers=["dram"])
    log.blocks([("stored", chain[0], "dram", BB, "", 0), ("stored", chain[1], "dram", BB, "", 1),
                ("evicted", chain[2], "dram", 0, "capacity:lru", None)])
    log.block("expired", chain[0], tier="dram")
    assert log.flush(timeout=60.0)
    assert log.stats()["written"] == 4
    with pytest.raises(ValueError, match="not one of"):
        log.blocks([("gone", chain[0], "dram", 0, "", None)])
    log.block("stored", chain[2], tier="dram", size=BB, depth=2)
    log.close()  # (also ends the writer's wait)
    recs = [r for r in read_events(tmp_path) if r["type"] == "block"]
    assert [(r["event"], r.get("depth"), r.get("reason")) for r in recs] == [
        ("stored", 0, None), ("stored", 1, None), ("evicted", None, "capacity:lru"), ("expired", None, None),
        ("stored", 2, None)]
    assert [bytes.fromhex(r["h"]) for r in recs] == [short_key(h) for h in (*chain, chain[0], chain[2])]


def test_placed_copies_go_as_one_record_written_as_block_does_each(tmp_path: Path) -> None:
    """``placed`` (a put's new copies, handed over under the store's lock) is one record whose
    lines the writer spells out: stored (no copy before), promoted (none as fast), demoted (a
    faster one), each line as ``block`` writes it; counted, dropped and limited per block."""
    clock = FakeClock()
    chain = chain_for(4, 4)
    priors, depths = [0, 0b100, 0b001, 0], [0, 1, 2, None]
    one = EventLog(tmp_path / "one", clock=clock, tiers=["dram", "nvme", "s3"])
    for key, prior, depth in zip(chain, priors, depths, strict=True):
        event = "stored" if not prior else "promoted" if not prior & 0b11 else "demoted"
        one.block(event, key, tier="nvme", size=BB, depth=depth)
    one.close()
    many = EventLog(tmp_path / "many", clock=clock, tiers=["dram", "nvme", "s3"])
    many.placed(chain, 1, "nvme", priors, BB, depths)
    many.placed([], 1, "nvme", [], BB, [])  # (nothing: no record)
    with pytest.raises(ValueError, match="prior masks"):
        many.placed(chain, 1, "nvme", priors[:2], BB, depths)
    assert many.flush(timeout=60.0) and many.stats()["written"] == 4
    many.close()
    recs = [r for r in read_events(tmp_path / "many") if r["type"] == "block"]
    assert recs == [r for r in read_events(tmp_path / "one") if r["type"] == "block"]
    assert [r["event"] for r in recs] == ["stored", "promoted", "demoted", "stored"]
    class Stalled(_Stalled):
        release = threading.Event()

    full = Stalled(tmp_path / "full", EventsConfig(enabled=True, queue=1))
    for _ in range(4):
        full.placed(chain, 0, "dram", priors, BB, depths)
    Stalled.release.set()
    full.flush()
    s = full.stats()
    full.close()
    assert s["dropped"] % 4 == 0 and s["dropped"] >= 4 and s["written"] + s["dropped"] == 16


def test_rotation_by_size_and_by_age_and_retention(tmp_path: Path) -> None:
    clock = FakeClock()
    cfg = EventsConfig(enabled=True, max_bytes=200, max_age_s=60, retain_bytes=0, level=1)
    with EventLog(tmp_path, cfg, clock=clock) as log:
        log.namespace(SMALL_NS)
        for i in range(3):
            log.request(ns=SMALL_NS.root, hashes=list(range(i * 50, i * 50 + 50)), hit_blocks=0, block_tokens=16)
            log.flush()  # a batch per request: each one passes max_bytes
        clock.advance(61)
        log.block("stored", 1)
        log.flush()
        clock.advance(10)
        log.block("stored", 2)
    files = event_files(tmp_path)
    assert len(files) == 5  # one per oversized batch, one more by age; the last batch fits
    for f in files:  # every file describes its namespaces: it can be read alone
        assert [r["type"] for r in read_events(f)][:2] == ["header", "namespace"]
    assert Counter(r["type"] for r in read_events(tmp_path))["request"] == 3
    # Retention: the oldest files go once the directory holds more than retain_bytes.
    keep = sum(f.stat().st_size for f in files[-2:])
    with EventLog(tmp_path, EventsConfig(enabled=True, retain_bytes=keep), clock=clock) as log:
        log.block("stored", 3)
    left = event_files(tmp_path)
    assert files[0] not in left and len(left) < len(files) + 1


class _Stalled(EventLog):
    """A writer that stalls on its first record until released: the queue fills."""

    release = threading.Event()

    def _format(self, item: tuple[Any, ...]) -> bytes:
        self.release.wait(30)
        return super()._format(item)


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    log = _Stalled(tmp_path, EventsConfig(enabled=True, queue=1))
    for i in range(10):
        log.block("stored", i)
    _Stalled.release.set()
    log.flush()
    s = log.stats()
    log.close()
    # The stalled writer holds at most two records and the queue one: the rest were dropped.
    assert s["dropped"] >= 7 and s["written"] + s["dropped"] == 10


def test_a_file_cut_short_reads_up_to_its_last_whole_batch(tmp_path: Path) -> None:
    with EventLog(tmp_path) as log:
        for i in range(3):
            log.block("stored", i)
            log.flush()
    (f,) = event_files(tmp_path)
    data = f.read_bytes()
    f.write_bytes(data[:-5])  # a crash in the middle of the last frame
    keys = [r["h"] for r in read_events(tmp_path) if r["type"] == "block"]
    assert len(keys) == 2


def test_the_store_logs_requests_and_every_block_lifecycle_event(make_store: Any, tmp_path: Path, clock: FakeClock) -> None:
    s = make_store(small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8), register=False, events=_ev(tmp_path))
    s.events.set_tenant(SMALL_NS.root, "team-a")
    s.register_namespace(SMALL_NS, ttl_s=3600)
    chain = chain_for(1, 6)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])          # 6 blocks: 4 fit in DRAM, the rest demote
    buf = np.empty(2 * BB, np.uint8)
    assert s.get_into(SMALL_NS, chain[:2], buf) == 2              # demoted first; promoted on the hit
    for i in range(2, 6):                                         # fill every tier: the last one evicts
        c = chain_for(10 + i, 4)
        s.put(SMALL_NS, c, [payload(h) for h in c])
    assert s.delete(SMALL_NS, chain_for(15, 4)[:1]) >= 1            # an operator's evict
    clock.advance(3601)
    s.maintain()                                                  # expiry
    s.events.flush()
    recs = list(read_events(tmp_path / "events"))
    ns = next(r for r in recs if r["type"] == "namespace")
    assert ns["tenant"] == "team-a" and ns["ttl_s"] == 3600 and Namespace.from_dict(ns["descriptor"]) == SMALL_NS
    (req,) = [r for r in recs if r["type"] == "request"]
    assert req["tenant"] == "team-a" and req["hit_blocks"] == 2 and req["prompt_tokens"] == 32
    assert req["hit_tokens_by_tier"] == {"nvme": 32}
    events = Counter(r["event"] for r in recs if r["type"] == "block")
    assert {"stored", "demoted", "promoted", "evicted", "expired"} <= set(events)
    reasons = {r.get("reason") for r in recs if r.get("event") == "evicted"}
    assert {f"capacity:{s.config.policy}", "deleted"} <= reasons
    stats = s.stats()
    assert stats["events"]["dropped"] == 0
    assert stats["events"]["written"] == sum(r["type"] in ("request", "block") for r in recs)
    dram = next(t for t in stats["tiers"] if t["name"] == "dram")
    assert dram["bytes_in"] >= 4 * BB and sum(t["bytes_out"] for t in stats["tiers"]) == 2 * BB


def test_a_corrupt_copy_is_logged(make_store: Any, tmp_path: Path) -> None:
    s = make_store(small_tiers(dram_blocks=4, nvme_blocks=16), promote_on_hit=False, events=_ev(tmp_path))
    chain = chain_for(2, 8)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])  # blocks 0..3 demoted to NVMe
    data = s.config.root / "tiers" / "nvme" / "data.slab"
    raw = bytearray(data.read_bytes())
    raw[raw.find(payload(chain[1])[:64]) + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert s.get_into(SMALL_NS, chain, np.empty(8 * BB, np.uint8)) == 1
    s.events.flush()
    bad = [r for r in read_events(tmp_path / "events") if r.get("event") == "corrupt"]
    assert len(bad) == 1 and bad[0]["tier"] == "nvme" and bad[0]["reason"] == "checksum"
    assert bad[0]["h"] == short_key(chain[1]).hex()


def test_off_by_default_in_process(make_store: Any) -> None:
    s = make_store()
    chain = chain_for(3, 2)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])
    assert s.stats()["events"] == {"enabled": False}
    assert not (s.config.root / "events").exists()
