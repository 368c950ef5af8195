"""Warm restart: the persistent tiers' own metadata rebuilds the index, TTLs included."""

from __future__ import annotations

from kvstore.clock import FakeClock
from tests.conftest import SMALL_NS, chain_for, small_tiers
from tests.kvstore.test_store import assert_payloads, assert_prefix_closed, load, put_chain

H = 3600.0


def test_reopen_recovers_blocks_namespaces_depth_and_remaining_ttl(make_store, clock: FakeClock) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=16, object_blocks=64))
    chains = [chain_for(10 + i, 5, shared_prefix_blocks=2) for i in range(6)]  # 2 + 6*3 = 20 blocks
    for c in chains:
        put_chain(s, c)
    before = {b["hash"]: b for b in s.iter_blocks()}
    s.close()
    clock.advance(10 * H)
    s2 = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=16, object_blocks=64), register=False)
    assert [ns for ns, _ in s2.namespaces()] == [SMALL_NS]  # from namespaces.json
    after = {b["hash"]: b for b in s2.iter_blocks()}
    assert after.keys() == before.keys()
    for h, b in after.items():
        assert b["depth"] == before[h]["depth"]
        assert b["namespace"] == SMALL_NS.root.hex()
        assert b["expiry"] == before[h]["expiry"]  # 62 h of TTL remain
        assert set(b["tiers"]) <= {"nvme", "object"}
    for c in chains:
        n, buf = load(s2, c)
        assert n == 5
        assert_payloads(c, buf, n)
    assert_prefix_closed(s2)
    clock.advance(70 * H)  # refreshed by the loads above, so still there
    assert s2.lookup(SMALL_NS, chains[0]).num_blocks == 5


def test_refreshed_expiry_survives_restart_after_flush(make_store, clock: FakeClock) -> None:
    s = make_store(persist_on_close=True)
    c = chain_for(50, 3)
    put_chain(s, c, durable=True)
    clock.advance(60 * H)
    assert load(s, c)[0] == 3  # refresh: expires at 60 + 72 h now
    s.close()  # flushes refreshed expiry to the persistent tiers
    clock.advance(60 * H)  # 120 h after the put: only the refresh keeps it alive
    s2 = make_store(register=False)
    assert s2.lookup(SMALL_NS, c).num_blocks == 3
    clock.advance(13 * H)
    assert s2.lookup(SMALL_NS, c).num_blocks == 0
    assert s2.maintain()["expired"] == 3


def test_expired_while_down_is_gone_after_restart(make_store, clock: FakeClock) -> None:
    s = make_store()
    put_chain(s, chain_for(60, 4), durable=True)
    s.close()
    clock.advance(73 * H)
    s2 = make_store(register=False)
    assert s2.stats()["blocks"] == 0
    assert s2.stats()["expirations"] == 4


def test_volatile_only_blocks_are_written_down_on_clean_close(make_store) -> None:
    s = make_store()
    c = chain_for(70, 3)
    put_chain(s, c)  # DRAM only
    assert set(s.lookup(SMALL_NS, c).tiers) == {"dram"}
    s.close()
    s2 = make_store(register=False)
    assert s2.lookup(SMALL_NS, c).tiers == ("nvme",) * 3


def test_without_persist_on_close_dram_is_lost_and_orphans_are_dropped(make_store) -> None:
    s = make_store(persist_on_close=False, promote_on_hit=False)
    c = chain_for(80, 4)
    put_chain(s, c[:2])  # parents only in DRAM
    nvme = s.tiers[1]
    # Children were written down, but their parents were not: after a restart they are orphans.
    put_chain(s, c, start=2, durable=False)
    for key in c[2:]:
        bid = s.index.id_of(key)
        s._placer.demote(bid, 0, set())  # noqa: SLF001 - force the children down to NVMe only
    assert all(nvme.contains(k) for k in c[2:]) and not any(nvme.contains(k) for k in c[:2])
    s.close()
    s2 = make_store(persist_on_close=False, register=False)
    assert s2.stats()["blocks"] == 0
    assert s2.stats()["orphans_dropped"] == 2
    assert not any(s2.tiers[1].contains(k) for k in c)
