"""One suite for every implementation of :class:`kvstore.api.KVCacheAPI`: the in-process store
and a daemon through its client over shared memory and over TCP (``conftest.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvstore.api import KVCacheAPI, LeaseLike, LookupResult, PinLike
from kvstore.errors import BufferSizeError, LayoutMismatchError, MissingPrefixError, UsageError
from kvstore.keys import KVLayout, LayerGroup
from kvstore.shm import attach_arena
from tests.api.conftest import DRAM_BLOCKS, IMPLS, World, open_world
from tests.conftest import BB, SMALL_NS, chain_for, payload

H = 3600.0


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def test_each_implementation_satisfies_the_protocol(world: World) -> None:
    assert isinstance(world.api, KVCacheAPI)


def test_put_then_load_and_look_up(world: World) -> None:
    api, chain = world.api, chain_for(1, 6)
    api.register_namespace(SMALL_NS)
    assert api.put(SMALL_NS, chain[:4], _blocks(chain[:4])) == 4
    assert api.put(SMALL_NS, chain, _blocks(chain[4:]), start=4) == 2
    assert api.put(SMALL_NS, chain, [payload(x) for x in chain]) == 0  # deduplicated
    assert api.lookup(SMALL_NS, chain) == LookupResult(6, SMALL_NS.block_tokens, ("dram",) * 6, ())
    assert api.lookup(SMALL_NS, chain_for(2, 3)) == LookupResult(0, SMALL_NS.block_tokens, (), ())
    out = np.zeros(6 * BB, np.uint8)
    assert api.get_into(SMALL_NS, chain, out) == 6
    assert np.array_equal(out, _blocks(chain))
    bufs = [bytearray(BB) for _ in range(2)]  # fewer buffers than hashes: that many load
    assert api.get_into(SMALL_NS, chain, bufs) == 2
    assert [bytes(b) for b in bufs] == [payload(x) for x in chain[:2]]
    assert api.get_into(SMALL_NS, chain_for(2, 2), bufs) == 0


def test_arguments_after_the_payload_are_keyword_only(world: World) -> None:
    api, chain = world.api, chain_for(3, 2)
    api.register_namespace(SMALL_NS)
    call: Any = api.put  # the positional forms that used to be accepted by the client only
    with pytest.raises(TypeError):
        call(SMALL_NS, chain, _blocks(chain), 0)
    call = api.pin
    with pytest.raises(TypeError):
        call(SMALL_NS, chain, world.clock() + H)
    assert api.lookup(SMALL_NS, chain).num_blocks == 0  # the refused put stored nothing


def test_refusals_raise_the_same_errors(world: World) -> None:
    api, chain = world.api, chain_for(4, 4)
    api.register_namespace(SMALL_NS)
    with pytest.raises(MissingPrefixError, match="start="):
        api.put(SMALL_NS, chain, _blocks(chain[2:]), start=2)
    with pytest.raises(UsageError, match="outside the chain"):
        api.put(SMALL_NS, chain, b"", start=5)
    with pytest.raises(UsageError, match="payloads"):
        api.put(SMALL_NS, chain, [payload(chain[0])])
    with pytest.raises(BufferSizeError):
        api.put(SMALL_NS, chain, np.zeros(4 * BB - 1, np.uint8))
    with pytest.raises(BufferSizeError):
        api.get_into(SMALL_NS, chain, np.zeros(BB + 1, np.uint8))
    other = replace(SMALL_NS, layout=KVLayout("bfloat16", 16, (LayerGroup("full", 2, 1, 64),)))
    with pytest.raises(LayoutMismatchError, match="layout"):
        api.lookup(other, chain)
    api.register_namespace(other)  # both layouts meant to be cached: registered explicitly
    assert api.lookup(other, chain).num_blocks == 0


def test_pins_list_unpin_and_delete(world: World) -> None:
    api, chain = world.api, chain_for(5, 4)
    api.register_namespace(SMALL_NS)
    api.put(SMALL_NS, chain, _blocks(chain))
    until = world.clock() + H
    assert api.pin(SMALL_NS, chain[:2]) == 2
    assert api.pin(SMALL_NS, chain[:3], until=until) == 3
    pins = api.pins()
    assert all(isinstance(p, PinLike) for p in pins)
    assert [(p.ns, p.num_blocks, p.until) for p in pins] == [(SMALL_NS.root, 2, None), (SMALL_NS.root, 3, until)]
    assert api.delete(SMALL_NS, chain[:1]) == 1  # the pinned prefix stays, its suffix goes
    assert api.unpin(SMALL_NS, chain[:2]) == 2
    assert [(p.num_blocks, p.until) for p in api.pins()] == [(3, until)]
    assert api.pin(SMALL_NS, chain_for(6, 2)) == 0  # nothing cached: nothing pinned
    assert api.unpin(SMALL_NS, chain[:3]) == 3  # a guarantee, undone whole
    assert list(api.pins()) == []
    assert api.delete(SMALL_NS, chain[:1]) == 3
    assert api.lookup(SMALL_NS, chain).num_blocks == 0


def test_leases_hold_blocks_in_the_arena(world: World) -> None:
    api, chain = world.api, chain_for(7, 3)
    api.register_namespace(SMALL_NS)
    api.put(SMALL_NS, chain, _blocks(chain))
    if world.kind == "tcp":
        with pytest.raises(UsageError, match="shared-memory plane"):
            api.acquire(SMALL_NS, chain)
        return
    lease = api.acquire(SMALL_NS, chain + chain_for(8, 1))
    assert isinstance(lease, LeaseLike) and lease.num_blocks == 3
    shm = attach_arena(lease.arena)
    try:
        assert [bytes(shm.buf[o : o + s]) for o, s in lease.locations] == [payload(x) for x in chain]
    finally:
        shm.close()
    assert api.delete(SMALL_NS, chain[:1]) == 0  # in use: nothing leaves
    api.release(lease)
    api.release(lease)  # idempotent
    assert api.delete(SMALL_NS, chain[:1]) == 3


def test_lookup_names_the_tiers_it_cannot_reach(world: World) -> None:
    api, chain = world.api, chain_for(9, DRAM_BLOCKS + 4)  # longer than DRAM: the head is on S3
    api.register_namespace(SMALL_NS)
    api.put(SMALL_NS, chain, _blocks(chain))
    up = api.lookup(SMALL_NS, chain)
    assert up.num_blocks == len(chain) and "object" in up.tiers and up.unavailable == ()
    world.object_tier.up = False
    down = api.lookup(SMALL_NS, chain)
    assert down.unavailable == ("object",)
    assert down.num_blocks < len(chain) and set(down.tiers) <= {"dram"}
    world.object_tier.up = True
    assert api.lookup(SMALL_NS, chain) == up


def test_stats_and_close(world: World) -> None:
    api = world.api
    assert isinstance(api.stats(), dict)
    with api as same:
        assert same is api
    api.close()  # a second close is a no-op


def _transcript(api: KVCacheAPI[Any], now: float) -> list[object]:
    """A scenario's every answer, as plain values."""
    a, b = chain_for(10, DRAM_BLOCKS - 3, shared_prefix_blocks=3), chain_for(11, 5, shared_prefix_blocks=3)
    out: list[object] = []
    api.register_namespace(SMALL_NS, ttl_s=2 * H)
    out.append(api.put(SMALL_NS, a, _blocks(a), durable=True))
    out.append(api.put(SMALL_NS, b, _blocks(b[3:]), start=3))
    for chain in (a, b, a[:4] + chain_for(12, 2)):
        r = api.lookup(SMALL_NS, chain)
        out.append((r.num_blocks, r.num_tokens, r.tiers, r.unavailable))
        buf = np.zeros(len(chain) * BB, np.uint8)
        n = api.get_into(SMALL_NS, chain, buf)
        out.append((n, buf[: n * BB].tobytes() == _blocks(chain[:n]).tobytes()))
    out.append((api.pin(SMALL_NS, b), api.pin(SMALL_NS, a[:2], until=now + H)))
    out.append([(p.ns, p.num_blocks, p.until) for p in api.pins()])
    out.append((api.delete(SMALL_NS, a[:1]), api.unpin(SMALL_NS, b), api.delete(SMALL_NS, b[:1])))
    out.append(api.lookup(SMALL_NS, a).num_blocks)
    return out


def test_every_implementation_gives_the_same_answers(open_worlds: Any) -> None:
    worlds: list[World] = open_worlds()
    transcripts = {w.kind: _transcript(w.api, w.clock()) for w in worlds}
    assert [w.kind for w in worlds] == list(IMPLS)
    assert transcripts["shm"] == transcripts["store"]
    assert transcripts["tcp"] == transcripts["store"]


@pytest.mark.parametrize("impl", IMPLS)
def test_get_into_a_chain_longer_than_the_first_tier(impl: str, tmp_path: Any, monkeypatch: Any) -> None:
    chain = chain_for(13, DRAM_BLOCKS + 2)
    with open_world(impl, tmp_path / impl, monkeypatch) as w:
        w.api.register_namespace(SMALL_NS)
        w.api.put(SMALL_NS, chain, _blocks(chain))
        out = np.zeros(len(chain) * BB, np.uint8)
        assert w.api.get_into(SMALL_NS, chain, out) == len(chain)
        assert np.array_equal(out, _blocks(chain))
