"""KVStore end to end on real tiers (shared-memory DRAM, O_DIRECT NVMe + RocksDB, file:// objects)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import (
    BufferSizeError,
    LayoutMismatchError,
    MissingPrefixError,
    TierIOError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers

H = 3600.0


def put_chain(store: KVStore, chain: list[bytes], start: int = 0, **kw: object) -> int:
    return store.put(SMALL_NS, chain, [payload(h) for h in chain[start:]], start=start, **kw)  # type: ignore[arg-type]


def load(store: KVStore, chain: list[bytes]) -> tuple[int, np.ndarray]:
    buf = np.zeros(len(chain) * BB, dtype=np.uint8)
    n = store.get_into(SMALL_NS, chain, buf)
    return n, buf


def assert_payloads(chain: list[bytes], buf: np.ndarray, n: int) -> None:
    for i in range(n):
        assert buf[i * BB : (i + 1) * BB].tobytes() == payload(chain[i]), f"block {i} differs"


def assert_prefix_closed(store: KVStore) -> None:
    idx = store.index
    for bid in idx.live_ids().tolist():
        p = int(idx.parent[bid])
        assert p == -1 or idx.hash_of_or_none(p) is not None, "a cached block lost its parent"
        assert p == -1 or idx.depth[p] == idx.depth[bid] - 1


def test_put_lookup_get_round_trip(make_store) -> None:
    s = make_store()
    chain = chain_for(1, 6)
    assert put_chain(s, chain) == 6
    r = s.lookup(SMALL_NS, chain)
    assert r.num_blocks == 6 and r.num_tokens == 96 and set(r.tiers) == {"dram"}
    n, buf = load(s, chain)
    assert n == 6
    assert_payloads(chain, buf, n)
    assert put_chain(s, chain) == 0  # deduplicated
    assert s.stats()["dedup_blocks"] == 6


def test_partial_prefix_and_suffix_put(make_store) -> None:
    s = make_store()
    a = chain_for(2, 8, shared_prefix_blocks=3)
    b = chain_for(3, 8, shared_prefix_blocks=3)
    assert a[:3] == b[:3] and a[3] != b[3]
    put_chain(s, a)
    assert s.lookup(SMALL_NS, b).num_blocks == 3
    n, buf = load(s, b)
    assert n == 3
    assert_payloads(b, buf, 3)
    assert put_chain(s, b, start=3) == 5  # only the computed suffix
    assert s.lookup(SMALL_NS, b).num_blocks == 8
    with pytest.raises(MissingPrefixError, match="start=0"):
        put_chain(s, chain_for(4, 4), start=2)


def test_get_into_list_of_buffers_and_short_buffers(make_store) -> None:
    s = make_store()
    chain = chain_for(5, 4)
    put_chain(s, chain)
    bufs = [bytearray(BB) for _ in range(2)]
    assert s.get_into(SMALL_NS, chain, bufs) == 2  # as many as buffers given
    assert bytes(bufs[1]) == payload(chain[1])
    with pytest.raises(BufferSizeError):
        s.get_into(SMALL_NS, chain, [bytearray(BB - 1)])
    with pytest.raises(BufferSizeError):
        s.get_into(SMALL_NS, chain, bytearray(BB + 1))
    with pytest.raises(UsageError, match="read-only"):
        s.get_into(SMALL_NS, chain, bytes(BB))


def test_bad_input_gets_clear_errors_and_store_stays_usable(make_store) -> None:
    s = make_store()
    chain = chain_for(6, 3)
    with pytest.raises(BufferSizeError, match="4096"):
        s.put(SMALL_NS, chain, [b"x" * 10, b"y" * BB, b"z" * BB])
    with pytest.raises(UsageError, match="expected 3"):
        s.put(SMALL_NS, chain, [b"x" * BB])
    other = Namespace("test/other", SMALL_NS.layout)
    with pytest.raises(UnknownNamespaceError, match="register_namespace"):
        s.lookup(other, chain)
    mismatched = Namespace(SMALL_NS.model_id, KVLayout("float16", 16, (LayerGroup("full", 1, 1, 64),)))
    with pytest.raises(LayoutMismatchError, match="dtype"):
        s.get_into(mismatched, chain, bytearray(BB))
    with pytest.raises(UsageError, match="ttl_s"):
        s.register_namespace(other, ttl_s=-1)
    with pytest.raises(UsageError, match="start"):
        put_chain(s, chain, start=5)
    assert put_chain(s, chain) == 3
    assert load(s, chain)[0] == 3


def test_demotion_promotion_and_prefix_closure(make_store) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=8, nvme_blocks=16, object_blocks=32))
    chains = [chain_for(100 + i, 4) for i in range(6)]  # 24 blocks > 8 in DRAM
    for c in chains:
        put_chain(s, c)
    st = s.stats()
    # 24 blocks into 8 of DRAM: the 16 oldest move to NVMe (room for 16), none leaves.
    assert (st["demotions"], st["evictions"], st["blocks"]) == (16, 0, 24)
    assert [set(s.lookup(SMALL_NS, c).tiers) for c in chains] == [{"nvme"}] * 4 + [{"dram"}] * 2
    # The oldest chain went down to NVMe; a hit there is promoted back into DRAM.
    assert set(s.lookup(SMALL_NS, chains[0]).tiers) == {"nvme"}
    n, buf = load(s, chains[0])
    assert n == 4
    assert_payloads(chains[0], buf, 4)
    assert s.stats()["promotions"] == 4
    assert set(s.lookup(SMALL_NS, chains[0]).tiers) == {"dram"}
    assert s.stats()["hits_by_tier"] == {"nvme": 4}
    assert_prefix_closed(s)


def test_drop_only_from_last_tier_and_leaves_first(make_store) -> None:
    # The store's mechanics under the policy these counts were worked out for (``density``;
    # the default ``chain`` keeps some later leaves instead: tests/eviction/test_chain.py).
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=16), policy="density")
    chains = [chain_for(200 + i, 4, shared_prefix_blocks=2) for i in range(20)]  # 42 blocks > 28
    for c in chains:
        put_chain(s, c, start=0)
    st = s.stats()
    # 2 + 20 x 2 = 42 blocks into 4 + 8 + 16 = 28: 14 leave, leaves first, oldest first: both
    # tail blocks of chains 0-5, the leaf of chains 6 and 7. The shared prefix stays.
    assert (st["evictions"], st["blocks"]) == (14, 28)
    assert [s.lookup(SMALL_NS, c).num_blocks for c in chains] == [2] * 6 + [3] * 2 + [4] * 12
    assert_prefix_closed(s)
    last = chains[-1]
    n, buf = load(s, last)
    assert n == 4
    assert_payloads(last, buf, n)


def test_ttl_expiry_refresh_and_per_namespace_ttl(make_store, clock: FakeClock) -> None:
    s = make_store()
    short = Namespace("test/short", SMALL_NS.layout)
    s.register_namespace(short, ttl_s=1 * H)
    c1 = chain_for(300, 3)
    put_chain(s, c1)
    c2 = chain_for(301, 2)
    s.put(short, [bytes(h) for h in c2], [payload(h) for h in c2])
    clock.advance(2 * H)
    assert s.lookup(short, c2).num_blocks == 0  # 1 h TTL
    assert s.lookup(SMALL_NS, c1).num_blocks == 3  # 72 h default
    clock.advance(60 * H)
    assert load(s, c1)[0] == 3  # a hit refreshes the TTL
    clock.advance(60 * H)
    assert s.lookup(SMALL_NS, c1).num_blocks == 3
    clock.advance(73 * H)
    assert s.lookup(SMALL_NS, c1).num_blocks == 0
    assert s.maintain()["expired"] == 5
    assert s.stats()["blocks"] == 0


def test_pins_protect_from_expiry_and_eviction(make_store, clock: FakeClock) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=4, object_blocks=8))
    keep = chain_for(400, 3)
    put_chain(s, keep)
    assert s.pin(SMALL_NS, keep) == 3
    for i in range(8):
        put_chain(s, chain_for(401 + i, 2))
    clock.advance(100 * H)
    s.maintain()
    assert s.lookup(SMALL_NS, keep).num_blocks == 3
    n, buf = load(s, keep)
    assert_payloads(keep, buf, n)
    assert s.unpin(SMALL_NS, keep) == 3
    clock.advance(100 * H)
    s.maintain()
    assert s.lookup(SMALL_NS, keep).num_blocks == 0


def test_delete_removes_the_subtree(make_store) -> None:
    s = make_store()
    a = chain_for(500, 5, shared_prefix_blocks=2)
    b = chain_for(501, 5, shared_prefix_blocks=2)
    put_chain(s, a)
    put_chain(s, b, start=2)
    assert s.delete(SMALL_NS, [a[1]]) == 7  # a[1] and everything under it, both branches
    assert s.lookup(SMALL_NS, a).num_blocks == 1
    assert s.lookup(SMALL_NS, b).num_blocks == 1
    assert_prefix_closed(s)


def test_corrupt_copy_is_a_miss_never_wrong_bytes(make_store, tmp_path: Path) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=16, object_blocks=32), promote_on_hit=False)
    chain = chain_for(600, 8)
    put_chain(s, chain)  # blocks 0..3 demoted to NVMe
    assert s.lookup(SMALL_NS, chain).tiers[:4] == ("nvme",) * 4
    nvme = s.tiers[1]
    data = tmp_path / "store" / "tiers" / "nvme" / "data.slab"
    raw = bytearray(data.read_bytes())
    pos = raw.find(payload(chain[2])[:64])
    assert pos >= 0
    raw[pos + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    n, buf = load(s, chain)
    assert n == 2  # the prefix ends at the corrupt block
    assert_payloads(chain, buf, 2)
    assert s.stats()["corrupt_blocks"] == 1
    assert not nvme.contains(chain[2])
    assert s.lookup(SMALL_NS, chain).num_blocks == 2
    put_chain(s, chain, start=2)  # recomputed and stored again
    assert load(s, chain)[0] == 8


def test_concurrent_puts_and_gets(make_store) -> None:
    s = make_store(tiers=small_tiers(dram_blocks=16, nvme_blocks=32, object_blocks=512))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(15):
                chain = chain_for(1000 + w * 100 + i, 3, shared_prefix_blocks=1)
                n, _ = load(s, chain)
                put_chain(s, chain, start=n) if n < 3 else None
                n, buf = load(s, chain)
                assert_payloads(chain, buf, n)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert_prefix_closed(s)
    assert (s.index.in_use[s.index.live_ids()] == 0).all()


def test_unwritable_root_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TierIOError, match="writable"):
        KVStore(StoreConfig(root=blocker / "store", tiers=small_tiers()))


def test_durable_needs_a_persistent_tier(tmp_path: Path) -> None:
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 16 * BB, "slab_bytes": 4 * BB}),)
    with KVStore(StoreConfig(root=tmp_path, tiers=tiers)) as s:
        s.register_namespace(SMALL_NS)
        chain = chain_for(700, 2)
        with pytest.raises(UsageError, match="persistent"):
            put_chain(s, chain, durable=True)
        assert load(s, chain)[0] == 2  # placed in DRAM all the same


def test_torch_tensors_as_caller_buffers(make_store) -> None:
    torch = pytest.importorskip("torch")
    s = make_store()
    chain = chain_for(800, 3)
    src = torch.frombuffer(bytearray(b"".join(payload(h) for h in chain)), dtype=torch.bfloat16)
    assert s.put(SMALL_NS, chain, src) == 3
    dst = torch.zeros(3 * BB // 2, dtype=torch.bfloat16)
    assert s.get_into(SMALL_NS, chain, dst) == 3
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    with pytest.raises(UsageError, match="contiguous"):
        s.get_into(SMALL_NS, chain, torch.zeros(3 * BB, dtype=torch.uint8)[::2])


def test_lookup_nowait_answers_from_memory_or_steps_aside(make_store) -> None:
    s = make_store()
    chain = chain_for(900, 3)
    put_chain(s, chain)
    r = s.lookup_nowait(SMALL_NS, chain)
    assert r is not None and r.num_blocks == 3
    held, go = threading.Event(), threading.Event()

    def hold() -> None:
        with s._lock:  # noqa: SLF001 - stands for a put or a move holding the store
            held.set()
            go.wait(timeout=30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(timeout=30)
    try:
        assert s.lookup_nowait(SMALL_NS, chain) is None  # busy: the caller goes to a thread
    finally:
        go.set()
        t.join()
    assert s.lookup_nowait(SMALL_NS, chain).num_blocks == 3
