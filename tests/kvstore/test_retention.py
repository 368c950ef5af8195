"""Retention classes: pins with a deadline are guarantees (kept under pressure, refused when they
cannot be kept, released at the deadline) and pins of both kinds survive restarts."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.errors import KVStoreError, RetentionError, UsageError
from kvstore.retention import PINS_FILE, read_pins
from tests.conftest import BB, SMALL_NS, chain_for, small_tiers
from tests.kvstore.test_store import assert_payloads, assert_prefix_closed, load, put_chain

H = 3600.0


def _flood(s, start: int, chains: int = 12) -> None:  # type: ignore[no-untyped-def]
    for i in range(chains):
        put_chain(s, chain_for(start + i, 2))


def test_a_timed_pin_holds_under_pressure_and_past_the_ttl_then_ends(make_store, clock: FakeClock) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=4, object_blocks=8))
    keep = chain_for(1, 3)
    put_chain(s, keep)
    until = clock() + 100 * H  # past the 72 h TTL
    assert s.pin(SMALL_NS, keep, until=until) == 3
    _flood(s, 100)
    clock.advance(90 * H)
    s.maintain()
    n, buf = load(s, keep)
    assert n == 3
    assert_payloads(keep, buf, n)
    assert_prefix_closed(s)
    clock.set(until + 1)
    s.maintain()  # the guarantee has ended: best effort again, within the TTL of the last hit
    assert (s.index.pins[s.index.match(keep).ids] == 0).all()
    assert s.unpin(SMALL_NS, keep) == 0  # already released
    clock.advance(62 * H)  # 72 h after that hit
    s.maintain()
    assert s.lookup(SMALL_NS, keep).num_blocks == 0


def test_a_timed_pin_is_copied_to_the_persistent_tier(make_store, clock: FakeClock) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=8, nvme_blocks=8, object_blocks=16))
    keep = chain_for(2, 3)
    put_chain(s, keep)
    assert {t for b in s.iter_blocks(keep) for t in b["tiers"]} == {"dram"}
    s.pin(SMALL_NS, keep, until=clock() + H)
    assert all("nvme" in b["tiers"] for b in s.iter_blocks(keep))


def test_a_guarantee_that_cannot_be_kept_is_refused_and_pins_nothing(make_store, clock: FakeClock) -> None:
    # The last tier holds 8 blocks; pins may take half of it.
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8))
    a, b = chain_for(3, 3), chain_for(4, 2)
    put_chain(s, a)
    put_chain(s, b)
    assert s.pin(SMALL_NS, a, until=clock() + H) == 3
    with pytest.raises(RetentionError, match="pin_limit_fraction"):
        s.pin(SMALL_NS, b, until=clock() + H)  # 5 pinned blocks > 4
    ids = s.index.match(b).ids
    assert (s.index.pins[ids] == 0).all()
    assert s.unpin(SMALL_NS, b) == 0
    assert s.pin(SMALL_NS, b[:1], until=clock() + H) == 1  # 4 blocks: still within the limit


def test_pin_rejects_a_deadline_in_the_past(make_store, clock: FakeClock) -> None:
    s = make_store()
    c = chain_for(5, 2)
    put_chain(s, c)
    with pytest.raises(UsageError, match="not in the future"):
        s.pin(SMALL_NS, c, until=clock() - 1)


def test_unpin_undoes_one_pin_of_that_prefix_and_no_other(make_store) -> None:
    s = make_store()
    c = chain_for(6, 4)
    put_chain(s, c)
    assert s.pin(SMALL_NS, c) == 4
    assert s.pin(SMALL_NS, c[:2]) == 2
    ids = s.index.match(c).ids
    assert s.unpin(SMALL_NS, c[:3]) == 2  # the longest pinned prefix of c[:3] is c[:2]
    assert s.index.pins[ids].tolist() == [1, 1, 1, 1]
    assert s.unpin(SMALL_NS, c[:1]) == 1  # part of a pin: taken out of it
    assert s.index.pins[ids].tolist() == [0, 1, 1, 1]
    assert s.unpin(SMALL_NS, c) == 3  # the rest of that pin
    assert s.index.pins[ids].tolist() == [0, 0, 0, 0]
    assert s.unpin(SMALL_NS, c) == 0


def test_part_of_a_timed_pin_cannot_be_unpinned(make_store, clock: FakeClock) -> None:
    s = make_store()
    c = chain_for(12, 3)
    put_chain(s, c)
    s.pin(SMALL_NS, c, until=clock() + H)
    assert s.unpin(SMALL_NS, c[:1]) == 0  # a guarantee is not broken piecemeal
    assert s.unpin(SMALL_NS, c) == 3


def test_pins_and_deadlines_survive_a_restart(make_store, clock: FakeClock) -> None:
    tiers = small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=16)
    s = make_store(tiers=tiers)
    forever, timed, gone = chain_for(7, 2), chain_for(8, 2), chain_for(9, 2)
    for c in (forever, timed, gone):
        put_chain(s, c)
    s.pin(SMALL_NS, forever)
    s.pin(SMALL_NS, timed, until=clock() + 100 * H)
    s.pin(SMALL_NS, gone, until=clock() + 2 * H)
    s.close()
    clock.advance(80 * H)  # past every TTL; past one deadline
    s2 = make_store(tiers=tiers, register=False)
    assert s2.lookup(SMALL_NS, forever).num_blocks == 2
    assert s2.lookup(SMALL_NS, timed).num_blocks == 2
    assert s2.lookup(SMALL_NS, gone).num_blocks == 0  # its guarantee ended while down
    assert s2.unpin(SMALL_NS, forever) == 2
    clock.advance(30 * H)
    s2.maintain()
    assert s2.lookup(SMALL_NS, timed).num_blocks == 0
    assert s2.lookup(SMALL_NS, forever).num_blocks == 0


def test_a_damaged_pins_file_is_moved_aside_and_the_store_opens(make_store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = make_store()
    put_chain(s, chain_for(10, 1))
    s.pin(SMALL_NS, chain_for(10, 1))
    s.close()
    root = tmp_path / "store"
    (root / PINS_FILE).write_text("{not json")
    s = make_store(register=False)
    assert s.pins() == []
    aside = [p for p in root.iterdir() if p.name.startswith(PINS_FILE + ".corrupt-")]
    assert len(aside) == 1 and aside[0].read_text() == "{not json"
    with pytest.raises(KVStoreError, match="corrupt"):  # offline readers still say what is wrong
        read_pins(aside[0])


def test_pinned_bytes_count_each_block_once(make_store, clock: FakeClock) -> None:
    """Two guarantees over one prefix take its room once."""
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8))
    c = chain_for(11, 4)
    put_chain(s, c)
    assert s.pin(SMALL_NS, c, until=clock() + H) == 4
    assert s.pin(SMALL_NS, c, until=clock() + 2 * H) == 4
    live = s.index.live_ids()
    assert int(s.index.size[live][s.index.pins[live] > 0].sum()) == 4 * BB
    assert np.all(s.index.pins[s.index.match(c).ids] == 2)


def test_a_deadline_that_passed_while_down_leaves_other_pins_alone(make_store, clock: FakeClock) -> None:
    tiers = small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=16)
    s = make_store(tiers=tiers)
    c = chain_for(13, 2)
    put_chain(s, c)
    s.pin(SMALL_NS, c)
    s.pin(SMALL_NS, c, until=clock() + H)
    s.close()
    clock.advance(80 * H)  # past the deadline and the TTL while down
    s2 = make_store(tiers=tiers, register=False)
    assert s2.lookup(SMALL_NS, c).num_blocks == 2  # the untimed pin still holds it
