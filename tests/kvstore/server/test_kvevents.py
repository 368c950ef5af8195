"""The daemon's KV event publisher: vLLM's wire format, sequence numbers, replay, tenants, drops."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvstore.client import connect  # noqa: E402
from kvstore.client.control import control  # noqa: E402
from kvstore.clock import FakeClock  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.errors import ConfigError, CorruptBlockError, ForbiddenError, UsageError  # noqa: E402
from kvstore.events import BlockChange, BlockRun, PutChain, PutTokens, block_changes, events_config  # noqa: E402
from kvstore.keys import hash_blocks  # noqa: E402
from kvstore.registry import make_tier  # noqa: E402
from kvstore.server import kvevents  # noqa: E402
from kvstore.server.daemon import ThreadedDaemon  # noqa: E402
from kvstore.store import KVStore  # noqa: E402
from kvstore.wire.kvevents import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decoder,
    masked,
    tenant_mask,
)
from tests.conftest import BB, SMALL_NS, small_tiers  # noqa: E402
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS, eventually  # noqa: E402
from tests.kvstore.route.tap import Tap, daemons, events_of, state  # noqa: E402
from tiers.faulty import FaultyTier  # noqa: E402


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ThreadedDaemon]]:
    with daemons(tmp_path) as s:
        yield s


def tokens_of(n: int, seed: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(n * SMALL_NS.block_tokens)]


def chain(n: int, seed: int = 0) -> list[bytes]:
    return hash_blocks(SMALL_NS, tokens_of(n, seed))


def payloads(n: int) -> list[bytes]:
    return [bytes([i % 251]) * BB for i in range(n)]


def tap_of(d: ThreadedDaemon, **auth: str) -> Tap:
    return Tap(d.info["events"]["replay"], **auth)


def nonempty(events: list) -> list:
    return [e for e in events if not isinstance(e, AllBlocksCleared)]


def test_a_put_is_one_chained_block_stored_in_vllm_layout(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("n")
    hs = chain(5)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs[:3], payloads(3))
        c.put(SMALL_NS, hs, payloads(2), start=3)
    tap = tap_of(d)
    batches = tap.replay(0)
    assert batches is not None
    assert [s for s, _ in batches] == list(range(len(batches)))  # one sequence, from 0, no hole
    events = events_of(batches)
    assert isinstance(events[0], AllBlocksCleared)  # a new publisher: forget what this node said
    stored = [e for e in events if isinstance(e, BlockStored)]
    # One BlockStored per run of a chain (two puts published in one batch are one run).
    assert [h for e in stored for h in e.block_hashes] == hs
    assert len(stored) <= 2 and stored[0].parent_block_hash is None
    assert all(e.parent_block_hash == hs[hs.index(e.block_hashes[0]) - 1] for e in stored[1:])
    for e in stored:  # (no tokens were sent with these puts)
        assert (e.block_size, e.medium, e.token_ids, e.lora_id, e.lora_name) == (16, "dram", [], None, None)
    tap.close()


def test_demotion_and_delete_are_block_events_per_medium(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("n")  # DRAM holds 16 blocks: a chain of 24 pushes 8 down to NVMe
    hs = chain(24)
    tap = tap_of(d)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs, payloads(24))
        tiers = c.lookup(SMALL_NS, hs).tiers
        seen = state(events_of(tap.replay(0) or []))
        assert set(seen) == set(hs)
        # What a subscriber believes is what the store says: the fastest medium of each block.
        fastest = {h: min(m, key=["dram", "nvme", "object"].index) for h, m in seen.items()}
        assert [fastest[h] for h in hs] == list(tiers)
        assert "nvme" in tiers
        events = events_of(tap.replay(0) or [])
        assert any(isinstance(e, BlockRemoved) and e.medium == "dram" for e in events)
        c.delete(SMALL_NS, hs[:1])  # the chain and everything that extends it
    assert state(events_of(tap.replay(0) or [])) == {}
    tap.close()


def test_replay_serves_history_then_a_snapshot_when_it_is_gone(start: Callable[..., ThreadedDaemon],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvevents, "PUMP_BATCH", 1)  # a batch per put: more than the buffer keeps
    d = start("n", replay_batches=2)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        for k in range(4):
            c.put(SMALL_NS, chain(2, seed=k), payloads(2))
        c.delete(SMALL_NS, chain(2, seed=0)[:1])
    tap = tap_of(d)
    full = tap.replay(0)
    assert full is not None and len(full) == 1  # the history from 0 is gone: one snapshot batch
    seq, batch = full[0]
    assert isinstance(batch.events[0], AllBlocksCleared)
    assert state(batch.events) == {h: {"dram"} for k in (1, 2, 3) for h in chain(2, seed=k)}
    recent = tap.replay(seq)  # still in the buffer: the batch itself
    assert recent is not None and [s for s, _ in recent] == [seq]
    assert tap.replay(seq + 1) == []  # nothing newer yet
    tap.close()


def test_each_tenant_sees_only_its_blocks(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("n", tenants=TENANTS)
    hs = chain(3)
    for token in (TOKEN_A, TOKEN_B):
        with connect(d.url, token=token) as c:
            c.register_namespace(SMALL_NS)
            c.put(SMALL_NS, hs if token == TOKEN_A else chain(3, seed=7), payloads(3))
    ep_a = control(d.url, "GET", "/v1/events", token=TOKEN_A)
    assert ep_a["tenant"] == "a" and ep_a["auth"] == "plain" and "stats" not in ep_a
    a = Tap(ep_a["replay"], "a", TOKEN_A)
    # Tenant a's stream: its blocks under the hashes its clients compute, nothing of b's.
    assert state(events_of(a.replay(0) or [])) == {h: {"dram"} for h in hs}
    # b's name and token do not open a's stream, nor does a wrong password.
    assert Tap(ep_a["replay"], "b", TOKEN_B, timeout_s=1.0).replay(0) is None
    assert Tap(ep_a["replay"], "a", "not-the-token", timeout_s=1.0).replay(0) is None
    with pytest.raises(ForbiddenError):
        control(d.url, "GET", "/v1/events?all=true", token=TOKEN_A)
    # The admin's stream of every tenant: each hash carries its tenant's mask.
    ep = control(d.url, "GET", "/v1/events?all=true", token=TOKEN_OPS)
    every = Tap(ep["replay"], "ops", TOKEN_OPS)
    want = {masked(h, tenant_mask("a")) for h in hs} | {masked(h, tenant_mask("b")) for h in chain(3, seed=7)}
    assert set(state(events_of(every.replay(0) or []))) == want
    assert ep["stats"]["dropped"] == 0
    for t in (a, every):
        t.close()


def test_a_full_queue_drops_counts_and_resyncs(start: Callable[..., ThreadedDaemon],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvevents, "REBUILD_EVERY_S", 0.0)
    d = start("n", publish_queue=1)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        for k in range(8):
            c.put(SMALL_NS, chain(2, seed=k), payloads(2))
        c.delete(SMALL_NS, chain(2, seed=3)[:1])
        want = {h: {"dram"} for k in range(8) if k != 3 for h in chain(2, seed=k)}
    stats = control(d.url, "GET", "/v1/events")["stats"]
    assert stats["dropped"] > 0
    # The rebuild runs on the publisher's thread after the drop (when, depends on the box's load).
    assert eventually(lambda: control(d.url, "GET", "/v1/events")["stats"]["rebuilds"] >= 2, 60.0)
    tap = tap_of(d)
    # Dropped hooks cost a rebuild of the mirror and a snapshot on the stream, never a wrong state.
    assert eventually(lambda: state(events_of(tap.replay(0) or [])) == want, 60.0)
    tap.close()


def test_a_restarted_daemon_says_so_and_announces_what_it_kept(tmp_path: Path,
                                                               start: Callable[..., ThreadedDaemon]) -> None:
    d = start("n")
    hs = chain(4)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs, payloads(4))
    epoch = d.info["events"]["epoch"]
    d.stop()  # a clean stop writes DRAM-only blocks down to NVMe (persist_on_close)
    d2 = start("n")
    assert d2.info["events"]["epoch"] != epoch
    tap = tap_of(d2)
    events = events_of(tap.replay(0) or [])
    assert isinstance(events[0], AllBlocksCleared)
    assert state(events) == {h: {"nvme"} for h in hs}
    stored = [e for e in nonempty(events) if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].block_hashes == hs
    tap.close()


def test_publish_endpoints_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        events_config({"publish": "localhost:5557"})
    with pytest.raises(ConfigError, match="positive"):
        events_config({"publish": "tcp://127.0.0.1:5557", "publish_queue": 0})
    assert events_config({"publish": "tcp://127.0.0.1:5557"}).publish == "tcp://127.0.0.1:5557"
    assert events_config({}).publish is None  # off by default


class Recorder:
    """A block sink that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[BlockChange], PutTokens | None]] = []
        self.chains: list[PutChain | None] = []

    def blocks(self, runs: list[BlockRun], tokens: PutTokens | None, chain: PutChain | None) -> None:
        self.calls.append((block_changes(runs), tokens))
        self.chains.append(chain)


def test_the_sinks_hear_of_a_store_operation_in_one_call(tmp_path: Path) -> None:
    cfg = StoreConfig(root=tmp_path / "s", tiers=small_tiers(dram_blocks=4))
    with KVStore(cfg) as store:
        store.register_namespace(SMALL_NS)
        sink = Recorder()
        store.events.sinks.append(sink)
        hs = chain(6)
        store.put(SMALL_NS, hs, payloads(6), tokens=np.array(tokens_of(6)))
        # A call per locked part of the put, never per block: making room (2 of the 6 move
        # down, or 0 calls when no room had to be made), then the 6 new copies with the tokens.
        assert 1 <= len(sink.calls) <= 2
        changes = [c for call, _ in sink.calls for c in call]
        assert [c for c in changes if c[0] == "p" and c[2] == 0] == [("p", h, 0) for h in hs]
        assert sorted(h for kind, h, k in changes if kind == "c") == sorted(hs[:2])
        toks = sink.calls[-1][1]
        assert toks is not None and toks.keys == tuple(hs) and toks.tokens.tolist() == tokens_of(6)
        assert all(t is None for _, t in sink.calls[:-1])
        # The copies come with the chain they belong to (the store's keys): their parents.
        assert sink.chains[-1] == PutChain(SMALL_NS, tuple(hs)) and all(c is None for c in sink.chains[:-1])
        calls = len(sink.calls)
        dst = bytearray(2 * BB)
        assert store.get_into(SMALL_NS, hs[:2], dst) == 2  # promotions back into DRAM: one call
        assert len(sink.calls) == calls + 1 and sink.calls[-1][1] is None
        assert {c[1] for c in sink.calls[-1][0] if c[0] == "p" and c[2] == 0} == set(hs[:2])
        assert store.delete(SMALL_NS, hs[:1]) == 6
        assert len(sink.calls) == calls + 2 and {c[1] for c in sink.calls[-1][0] if c[0] == "d"} == set(hs)
        with pytest.raises(UsageError, match="token ids of the blocks put"):
            store.put(SMALL_NS, chain(2, seed=9), payloads(2), tokens=tokens_of(1))


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_token_ids_travel_with_a_put_as_vllm_sends_them(start: Callable[..., ThreadedDaemon], plane: str) -> None:
    d = start("n")  # DRAM holds 16 blocks: the last put moves the first chain down to NVMe
    hs, bare = chain(4), chain(3, seed=5)
    with connect(d.url, plane=plane) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs[:2], payloads(2), tokens=tokens_of(2))
        c.put(SMALL_NS, hs, payloads(2), start=2, tokens=np.array(tokens_of(4)[32:], dtype=np.int64))
        c.put(SMALL_NS, bare, payloads(3))  # no tokens: token_ids stays empty
        tap = tap_of(d)
        stored = [e for e in events_of(tap.replay(0) or []) if isinstance(e, BlockStored)]
        by_block = {h: e for e in stored for h in e.block_hashes}
        assert [h for e in stored if e.token_ids for h in e.block_hashes] == hs
        for e in stored:  # vLLM's layout: the tokens of every block of the event, in order
            want: list[Any] = [t for h in e.block_hashes for t in tokens_of(4)[hs.index(h) * 16:][:16]] if e.token_ids else []
            assert e.token_ids == want
        assert all(by_block[h].token_ids == [] for h in bare)
        c.put(SMALL_NS, chain(14, seed=6), payloads(14))  # pushes hs down: BlockStored on nvme
        events = events_of(tap.replay(0) or [])
        nvme = [e for e in events if isinstance(e, BlockStored) and e.medium == "nvme" and hs[0] in e.block_hashes]
        assert nvme and nvme[0].token_ids[:16] == tokens_of(1)
        with pytest.raises(UsageError, match="token ids"):
            c.put(SMALL_NS, chain(2, seed=8), payloads(2), tokens=tokens_of(3))
    tap.close()


def test_a_snapshot_carries_the_token_ids_too(start: Callable[..., ThreadedDaemon]) -> None:
    d = start("n", replay_batches=1)  # the history from 0 is gone at once: replays are snapshots
    hs = chain(3)
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        c.put(SMALL_NS, hs, payloads(3), tokens=tokens_of(3))
    tap = tap_of(d)
    batches = tap.replay(0)
    assert batches is not None and len(batches) == 1
    events = batches[0][1].events
    assert isinstance(events[0], AllBlocksCleared)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hs
    assert [t for e in stored for t in e.token_ids] == tokens_of(3)
    tap.close()


def test_the_engine_cache_sends_the_token_ids_of_what_it_stores(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from engine.client import EngineCache
    from engine.kvlayout import KVShape

    shape = KVShape(num_layers=2, kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float32)
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers())) as store:
        ns = shape.namespace("test/engine-tokens")
        cache = EngineCache(store, ns, shape, background=False)
        sink = Recorder()
        store.events.sinks.append(sink)
        ids = torch.arange(5 * 4, dtype=torch.long) + 7
        hashes = cache.hashes(ids)
        blocks = torch.zeros((3, shape.block_bytes), dtype=torch.uint8)
        first = cache.store_async(hashes, blocks[:2], 0)  # blocks 0..1, without their tokens
        assert first is not None and first.result() == 2
        fut = cache.store_async(hashes, blocks, 2, tokens=ids[8:20].numpy())  # blocks 2..4
        assert fut is not None and fut.result() == 3
        toks = sink.calls[-1][1]  # (the put's last call: its new copies, with the tokens)
        assert all(t is None for _, t in sink.calls[:-1])
        assert toks is not None and toks.keys == tuple(hashes[2:5]) and toks.tokens.tolist() == list(range(15, 27))


def test_a_pump_publishes_on_the_callers_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the service does after each put: with the publisher's thread stopped, the pump
    alone turns the put's changes into a batch on the stream once PUMP_BATCH changes wait (or
    the oldest is a period old); fewer, younger ones it leaves."""
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers())) as store:
        store.register_namespace(SMALL_NS)
        pub = kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0"}))
        pub._period = 3600.0  # never old enough here, however slow the box: only the count counts
        try:
            assert pub.flush(60.0)  # the start's AllBlocksCleared is out
            pub._stopping.set()
            pub._asleep = True
            pub._nudge()
            pub._thread.join(60.0)
            assert not pub._thread.is_alive()
            seq = pub.streams[0].seq
            hs = chain(3)
            pub.names(SMALL_NS, hs, hs, 0)  # (nothing for the anonymous tenant: the put hands its chain)
            store.put(SMALL_NS, hs, payloads(3), tokens=tokens_of(3))
            assert pub.stats()["queued"] == 3  # the put's changes, nothing published yet
            pub.pump()
            s = pub.streams[0]
            assert s.seq == seq and pub.stats()["queued"] == 3  # fewer than PUMP_BATCH: they wait
            monkeypatch.setattr(kvevents, "PUMP_BATCH", 3)
            pub.pump()
            assert s.seq == seq + 1 and pub.stats()["queued"] == 0
            (batch,) = [decoder().decode(p) for q, p in s.buffer if q == s.seq]
            (stored,) = batch.events
            assert isinstance(stored, BlockStored) and stored.block_hashes == hs and stored.token_ids == tokens_of(3)
        finally:
            pub.close()


def test_what_no_pump_takes_the_thread_publishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put below the pumps' threshold: the thread publishes it (the first change after a
    lull at once; else two periods after it), with no flush and no further put."""
    monkeypatch.setattr(kvevents, "PUMP_BATCH", 1 << 30)
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers())) as store:
        store.register_namespace(SMALL_NS)
        pub = kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0"}))
        try:
            assert pub.flush(60.0)
            seq = pub.streams[0].seq
            hs = chain(3)
            pub.names(SMALL_NS, hs, hs, 0)
            store.put(SMALL_NS, hs, payloads(3), tokens=tokens_of(3))
            pub.pump()
            s = pub.streams[0]
            assert eventually(lambda: pub.stats()["queued"] == 0 and s.seq > seq)
            events = [e for q, p in list(s.buffer) if q > seq for e in decoder().decode(p).events]
            assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [hs]
        finally:
            pub.close()


def per_block(events: list[Any]) -> list[tuple[Any, ...]]:
    """Events as one entry a block: ``("s", hash, parent, medium, tokens)``, ``("r", hash,
    medium)``, ``("c",)``."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            parent, bs = e.parent_block_hash, e.block_size
            for i, h in enumerate(e.block_hashes):
                out.append(("s", h, parent, e.medium, tuple(e.token_ids[i * bs:(i + 1) * bs])))
                parent = h
        elif isinstance(e, BlockRemoved):
            out.extend(("r", h, e.medium) for h in e.block_hashes)
        else:
            out.append(("c",))
    return out


def test_the_bulk_path_publishes_what_the_block_by_block_path_does(tmp_path: Path) -> None:
    """Two publishers on one store, one with the bulk paths (``_apply_put``, ``_apply_gone``,
    ``_apply_uniform``) turned off: puts with and without tokens, demotions down three tiers,
    promotions by loads, deletes and a put over a cached prefix publish the same events."""
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers(dram_blocks=8, nvme_blocks=16))) as store:
        store.register_namespace(SMALL_NS)
        pubs = [kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0"})) for _ in range(2)]
        pubs[1]._apply_uniform = lambda kind, k, keys, tokens: False  # type: ignore[method-assign]
        pubs[1]._apply_put = lambda keys, k, tokens, chain: False  # type: ignore[method-assign]
        pubs[1]._apply_gone = lambda kind, k, keys: False  # type: ignore[method-assign]
        took: dict[str, int] = {"put": 0, "gone": 0}

        def spy(name: str, f: Callable[..., bool]) -> Callable[..., bool]:
            def g(*a: Any) -> bool:
                ok = f(*a)
                took[name] += ok
                return ok
            return g

        pubs[0]._apply_put = spy("put", pubs[0]._apply_put)  # type: ignore[method-assign]
        pubs[0]._apply_gone = spy("gone", pubs[0]._apply_gone)  # type: ignore[method-assign]
        try:
            for p in pubs:
                assert p.flush(60.0)

            def put(hs: list[bytes], start: int = 0, tokens: list[int] | None = None) -> None:
                for p in pubs:
                    p.names(SMALL_NS, hs, hs, start)
                store.put(SMALL_NS, hs, payloads(len(hs) - start), start=start, tokens=tokens)
                for p in pubs:
                    p.pump()

            for k in range(4):
                hs = chain(6, seed=k)
                put(hs, tokens=tokens_of(6, seed=k) if k % 2 else None)
            put(chain(8, seed=3))  # from block 0, of which the first 6 are cached: the store puts 6 and 7
            long = chain(10, seed=1)  # extends seed 1's chain of 6 (same tokens): from block 6
            put(long, start=6, tokens=tokens_of(10, seed=1)[6 * SMALL_NS.block_tokens:])
            dst = np.empty(10 * BB, np.uint8)
            store.get_into(SMALL_NS, chain(6, seed=0), dst)  # promotions back to DRAM
            store.get_into(SMALL_NS, long, dst)
            store.delete(SMALL_NS, chain(6, seed=2)[:2])
            for p in pubs:
                p.pump()
                assert p.flush(60.0)
            published = [[e for _, b in p.streams[0].buffer for e in decoder().decode(b).events] for p in pubs]
            # Block by block (how many operations one publication took may differ between the
            # two, and a publication joins a chain's events): the same, in the same order.
            assert per_block(published[0]) == per_block(published[1])
            kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in published[0]}
            assert {("BlockStored", "dram"), ("BlockStored", "nvme"), ("BlockRemoved", "dram")} <= kinds
            assert any(isinstance(e, BlockStored) and e.token_ids for e in published[0])
            assert took["put"] >= 5 and took["gone"] >= 1  # (the bulk paths did take part)
        finally:
            for p in pubs:
                p.close()


def test_expired_and_corrupt_blocks_are_removed_blocks(tmp_path: Path) -> None:
    """The two ways a block leaves that no client asks for: its TTL passes (a maintenance
    pass), or its copy reads back corrupt (a load drops it): each a ``BlockRemoved`` on the
    tier it left, after the ``BlockStored`` that announced it."""
    clock = FakeClock()
    spec = small_tiers()[0]
    dram = FaultyTier(make_tier("dram", "dram", dict(spec.options), tmp_path, clock))
    cfg = StoreConfig(root=tmp_path / "s", tiers=(spec,), persist_on_close=False)
    with KVStore(cfg, clock=clock, tiers=[dram]) as store:
        store.register_namespace(SMALL_NS, ttl_s=60)
        pub = kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0"}))
        try:
            hs = chain(3)
            store.put(SMALL_NS, hs, payloads(3))
            dram.inject("read_into", CorruptBlockError, when=lambda k: k == hs[2], times=None)
            assert store.get_into(SMALL_NS, hs, bytearray(3 * BB)) == 2  # the third reads back corrupt
            clock.advance(61)
            store.maintain()  # the first two expire
            assert pub.flush(60.0)
            events = per_block([e for _, b in pub.streams[0].buffer for e in decoder().decode(b).events])
            assert events[:5] == [("c",), *(("s", h, p, "dram", ()) for h, p in zip(hs, [None, *hs[:2]], strict=True)),
                                  ("r", hs[2], "dram")]
            assert sorted(events[5:]) == sorted(("r", h, "dram") for h in hs[:2])
            assert pub.stats()["mirrored"] == 0
        finally:
            pub.close()



def test_the_replay_buffer_stays_within_replay_bytes_with_no_subscriber(tmp_path: Path) -> None:
    """Issue 33, item 4: with no subscriber the buffer was bounded only in batches (10,000, each
    up to megabytes with token ids: RSS grew 881 MiB over 300 puts). Now it keeps the newest
    batches within ``replay_bytes``, and a replay request that is never read costs no copy."""
    limit = 64 << 10
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers(dram_blocks=256, nvme_blocks=512))) as store:
        store.register_namespace(SMALL_NS)
        pub = kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0", "replay_bytes": limit}))
        try:
            s = pub.streams[0]
            peak = sent = 0
            for i in range(150):
                hs = chain(8, seed=i)
                store.put(SMALL_NS, hs, payloads(8), tokens=tokens_of(8, seed=i))
                assert pub.flush(60.0)
                sent += len(s.buffer[-1][1])
                peak = max(peak, s.buffer_bytes)
                assert s.buffer_bytes == sum(len(p) for _, p in s.buffer)
            assert sent > 2 * limit  # far more was published than the buffer keeps
            assert peak <= limit or len(s.buffer) == 1
            # a requester that never reads: its answers queue without copies, never blocking
            import zmq

            req = zmq.Context.instance().socket(zmq.DEALER)
            req.connect(s.replay_url)
            for _ in range(50):
                req.send_multipart((b"", (0).to_bytes(8, "big")))
            assert pub.flush(60.0)
            req.close(linger=0)
        finally:
            pub.close()


def test_the_mirrors_token_ids_stay_within_mirror_token_bytes(tmp_path: Path) -> None:
    """Issue 33, memory: the mirror kept every cached block's token ids (``4 x block_tokens``
    bytes a block), bounded only by the store's block count. Now it keeps the newest within
    ``mirror_token_bytes`` (counted, dropped and metered), and a put's own ``BlockStored``
    still carries all its tokens, even one whose tokens alone are over the budget."""
    limit = 4096  # 39 blocks' token ids of SMALL_NS (64 bytes each, and 41 for their entry)
    entry = 4 * SMALL_NS.block_tokens + kvevents.TOKEN_ENTRY_BYTES
    with KVStore(StoreConfig(root=tmp_path / "s", tiers=small_tiers(dram_blocks=256, nvme_blocks=512))) as store:
        store.register_namespace(SMALL_NS)
        pub = kvevents.KVEventPublisher(store, events_config({"publish": "tcp://127.0.0.1:0",
                                                              "mirror_token_bytes": "4KiB"}))
        try:
            s, dec = pub.streams[0], decoder()
            for i in range(60):  # 480 blocks, all cached (DRAM and NVMe)
                n = 50 if i == 30 else 8  # one put over the budget alone
                hs = chain(n, seed=i)
                store.put(SMALL_NS, hs, payloads(n), tokens=tokens_of(n, seed=i))
                assert pub.flush(60.0)
                kept = [r for r in pub._recs.values() if r.tokens is not None]
                assert len(kept) * entry <= limit, f"put {i}: {len(kept)} blocks' token ids kept"
                assert pub.stats()["mirror_token_bytes"] <= limit
                stored = [e for e in dec.decode(s.buffer[-1][1]).events
                          if type(e) is BlockStored and e.medium == store.tiers[0].name]  # (not demotions)
                assert [h for e in stored for h in e.block_hashes] == hs
                assert [t for e in stored for t in e.token_ids] == tokens_of(n, seed=i)
            assert len(kept) == limit // entry  # the newest blocks' token ids are kept
            assert all(pub._recs[h].tokens is not None for h in chain(8, seed=59))
            assert pub.stats()["tokens_dropped"] == 8 * 59 + 50 - len(kept)
            families = {m.name: m for m in pub.collector().collect()}
            dropped = {s.labels["what"]: s.value for s in families["kvstore_kv_events_dropped"].samples
                       if s.name.endswith("_total")}
            assert dropped["mirror_tokens"] == 8 * 59 + 50 - len(kept)
        finally:
            pub.close()
