"""The store over an S3 object tier on a real server (moto_server, a separate process): batched
loads, cold rebuild of a bucket other stores filled, expiry, outages (the server killed and
restarted mid-run) and two nodes in two processes sharing one bucket."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import BlockHash
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, own_s3_server
from tests.kvstore.test_store import assert_payloads, assert_prefix_closed, load, put_chain
from tools.s3server import LocalS3

H = 3600.0
MakeStore = Callable[..., KVStore]


def _tiers(object_options: dict[str, Any], dram_blocks: int = 0) -> tuple[TierSpec, ...]:
    obj = TierSpec("object", "object", {"capacity_bytes": 1 << 30, **object_options})
    if not dram_blocks:
        return (obj,)
    return (TierSpec("dram", "dram", {"capacity_bytes": dram_blocks * BB, "slab_bytes": 4 * BB}), obj)


@pytest.fixture
def s3_store(
    s3_tier_options: dict[str, Any], tmp_path: Path, clock: FakeClock
) -> Iterator[MakeStore]:
    """``s3_store(node, dram_blocks=0, register=True, **object_options)``: a store rooted at
    ``tmp_path/node`` whose object tier is this test's bucket (every node shares it)."""
    built: list[KVStore] = []

    def make(node: str, dram_blocks: int = 0, register: bool = True, **options: Any) -> KVStore:
        tiers = _tiers({**s3_tier_options, **options}, dram_blocks)
        store = KVStore(StoreConfig(root=tmp_path / node, tiers=tiers), clock=clock)
        if register:
            store.register_namespace(SMALL_NS)
        built.append(store)
        return store

    yield make
    for s in built:
        s.close()


def _spy_reads(store: KVStore) -> list[tuple[str, list[bytes]]]:
    """Record every ``read_many`` the store makes: ``(tier, keys)``."""
    calls: list[tuple[str, list[bytes]]] = []
    for tier in store.tiers:

        def spy(keys: Any, dsts: Any, _t: Any = tier, _orig: Any = tier.read_many) -> Any:
            calls.append((_t.name, list(keys)))
            return _orig(keys, dsts)

        tier.read_many = spy  # type: ignore[method-assign]
    return calls


# ---- batched loads ----------------------------------------------------------------------------


def test_consecutive_blocks_on_one_tier_load_in_one_batch(s3_store: MakeStore) -> None:
    writer = s3_store("writer", dram_blocks=16)
    chain = chain_for(1, 8)
    batches: list[int] = []
    obj = writer.tiers[1]
    write_many = obj.write_many
    obj.write_many = lambda items, **kw: batches.append(len(items)) or write_many(items, **kw)  # type: ignore[method-assign]
    put_chain(writer, chain, durable=True)
    assert batches == [8]  # into DRAM, then one batch of PUTs makes the chain durable
    node = s3_store("node", dram_blocks=16)  # cold: all eight blocks are on the bucket only
    calls = _spy_reads(node)
    remote = node.tiers[1].blobs.remote
    requests: list[int] = []
    run = remote.run
    remote.run = lambda batch: requests.append(len(batch)) or run(batch)  # type: ignore[method-assign]
    n, buf = load(node, chain[:3])  # the first three are promoted into DRAM
    assert n == 3 and calls == [("object", chain[:3])]
    assert requests == [3]  # one batch of GETs; promoting them asks for nothing more
    calls.clear()
    n, buf = load(node, chain)
    assert n == 8
    assert_payloads(chain, buf, n)
    # The warm prefix from DRAM, the cold tail from the bucket: one call per run of blocks.
    assert calls == [("dram", chain[:3]), ("object", chain[3:])]


# ---- cold rebuild ------------------------------------------------------------------------------


def test_cold_rebuild_learns_namespaces_prefix_structure_and_expiry(
    s3_store: MakeStore, tmp_path: Path, clock: FakeClock
) -> None:
    writer = s3_store("writer", dram_blocks=16)
    chains = [chain_for(10 + i, 5, shared_prefix_blocks=2) for i in range(3)]  # 2 + 3*3 blocks
    for c in chains:
        put_chain(writer, c, durable=True)
    before = {b["hash"]: b for b in writer.iter_blocks()}
    writer.close()
    clock.advance(5 * H)
    node = s3_store("node", register=False)  # a new machine: no namespaces.json, no index
    assert node.namespaces() == [(SMALL_NS, node.config.default_ttl_s)]  # from object headers
    assert (tmp_path / "node" / "namespaces.json").exists()
    assert node.stats()["recovered_blocks"] == 11
    after = {b["hash"]: b for b in node.iter_blocks()}
    assert after.keys() == before.keys()
    for h, b in after.items():
        assert (b["depth"], b["expiry"], b["namespace"]) == (
            before[h]["depth"], before[h]["expiry"], SMALL_NS.root.hex()
        )
    assert_prefix_closed(node)
    for c in chains:
        assert node.lookup(SMALL_NS, c).tiers == ("object",) * 5
        n, buf = load(node, c)
        assert n == 5
        assert_payloads(c, buf, n)


def test_blocks_of_another_schema_version_or_layout_are_reported_never_served(
    s3_store: MakeStore, s3_server: LocalS3, clock: FakeClock
) -> None:
    writer = s3_store("writer")
    good = chain_for(1, 2)
    put_chain(writer, good, durable=True)
    tier = writer.tiers[0]
    # A namespace written by a future schema, and a block too small for this one's layout.
    future = json.dumps({**SMALL_NS.to_dict(), "schema_version": 99}, sort_keys=True).encode()
    future_root = xxhash.xxh3_128_digest(future)
    tier.register_namespace(future_root, future)
    odd = {
        BlockHash(b"F" * 16): BlockMeta(future_root, future_root, 0, BB, clock() + H, payload_checksum(bytes(BB)), clock()),
        BlockHash(b"S" * 16): BlockMeta(SMALL_NS.root, SMALL_NS.root, 0, 100, clock() + H, payload_checksum(bytes(100)), clock()),
    }
    for key, meta in odd.items():
        tier.write(key, bytes(meta.size), meta)
    node = s3_store("node", register=False)
    s = node.stats()
    assert (s["foreign_blocks"], s["recovered_blocks"]) == (2, 2)
    assert [ns for ns, _ in node.namespaces()] == [SMALL_NS]
    assert not {k.hex() for k in odd} & {b["hash"] for b in node.iter_blocks()}
    assert all(s3_server.fs.exists(tier.path(k)) for k in odd)  # left for their own stores
    assert load(node, good)[0] == 2


# ---- expiry -------------------------------------------------------------------------------------


def test_sweeper_expires_objects_and_spares_blocks_kept_alive_by_hits(
    s3_store: MakeStore, clock: FakeClock
) -> None:
    node = s3_store("node", dram_blocks=16, touch_min_s=H)
    cold, hot = chain_for(1, 3), chain_for(2, 3)
    put_chain(node, cold, durable=True)
    put_chain(node, hot, durable=True)
    clock.advance(60 * H)
    assert load(node, hot)[0] == 3  # refreshed: expires 72 h from now
    node.flush()  # refreshed expiry reaches the bucket as touches
    clock.advance(13 * H)  # the put-time expiry of both has passed
    obj = node.tiers[1]
    obj.tick()  # the background sweeper's round (its interval has passed)
    d = node.stats()["tiers"][1]
    assert (d["expired_deleted"], d["touches_written"]) == (3, 3)
    assert load(node, hot)[0] == 3
    assert node.lookup(SMALL_NS, cold).num_blocks == 0


# ---- outages ----------------------------------------------------------------------------------


def test_store_keeps_serving_while_the_s3_server_is_down_and_recovers(
    tmp_path: Path, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    with own_s3_server(request) as server:
        server.make_bucket("outage")
        options = {
            "url": "s3://outage/kv", **server.tier_options(), "max_attempts": 1,
            "worker_interval_s": 0, "breaker_failures": 1, "breaker_retry_s": 30,
            "write_queue_bytes": 6 * (BB + 512),
        }
        tiers = _tiers(options, dram_blocks=8)
        other = KVStore(StoreConfig(root=tmp_path / "other", tiers=_tiers(options)), clock=clock)
        node = KVStore(StoreConfig(root=tmp_path / "node", tiers=tiers), clock=clock)
        with other, node:
            for s in (other, node):
                s.register_namespace(SMALL_NS)
            remote, local = chain_for(1, 4), chain_for(2, 4)
            put_chain(other, remote, durable=True)  # on the bucket only
            assert node.lookup(SMALL_NS, remote).num_blocks == 4  # found by probing
            put_chain(node, local)  # in DRAM only
            blocks = node.stats()["blocks"]

            server.kill()
            assert load(node, remote)[0] == 0  # no exception: a miss
            r = node.lookup(SMALL_NS, remote)
            assert (r.num_blocks, r.unavailable) == (0, ("object",))
            n, buf = load(node, local)  # the other tiers serve as before
            assert n == 4
            assert_payloads(local, buf, n)
            assert node.stats()["blocks"] == blocks  # the bucket's blocks are kept in the index
            assert node.stats()["unavailable_reads"] >= 1
            # Nothing below DRAM can be reached: for now DRAM is the last tier and its leaves
            # leave as a cache's do (no block lives only in DRAM that was put durably); no write
            # is even tried. Puts never fail.
            evicted = node.stats()["evictions"]
            for seed in range(10, 16):
                assert put_chain(node, chain_for(seed, 2)) == 2
            d = node.stats()["tiers"][1]
            assert d["queued_writes"] == 0 and node.stats()["evictions"] - evicted == 12 - 4
            assert node.lookup(SMALL_NS, chain_for(15, 2)).tiers == ("dram", "dram")

            server.start()  # moto comes back empty, a Ceph with its objects
            server.make_bucket("outage")
            clock.advance(30)
            node.tiers[1].tick()  # a trial request closes the breaker
            d = node.stats()["tiers"][1]
            assert d["breaker"] == "closed"
            assert node.lookup(SMALL_NS, remote).unavailable == ()
            for seed in range(20, 24):  # demotions out of a full DRAM reach the bucket again
                assert put_chain(node, chain_for(seed, 2)) == 2
            demoted = [
                key for b in node.iter_blocks()
                if b["tiers"] == ["object"] and (key := bytes.fromhex(b["hash"])) not in remote
            ]
            assert demoted
            node.flush()
            for key in demoted:  # each only copy reached the bucket
                assert server.fs.exists(node.tiers[1].path(key))
            # Lost with moto's memory: a miss, no error. A Ceph kept them: served again.
            assert load(node, remote)[0] == (4 if server.keeps_objects else 0)


# ---- two nodes, two processes, one bucket --------------------------------------------------


class _Node:
    """A store in a child process (tests/kvstore/s3_node.py)."""

    def __init__(self, root: Path, start: float, options: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kvstore.s3_node", str(root), repr(start), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == {"ready": True}

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.wait()}"
        return json.loads(line)

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self("quit")
        assert self.proc.wait() == 0


def test_two_nodes_share_prefixes_and_both_treat_a_corrupt_object_as_a_miss(
    s3_store: MakeStore, s3_tier_options: dict[str, Any], s3_server: LocalS3, tmp_path: Path, clock: FakeClock
) -> None:
    node_a = s3_store("a")
    node_b = _Node(tmp_path / "b", clock(), {"capacity_bytes": 1 << 30, **s3_tier_options})
    try:
        # A prefix one node writes is a hit for the other (found by probing past its index).
        put_chain(node_a, chain_for(1, 6), durable=True)
        assert node_b("get", seed=1, n=6) == {"loaded": 6, "ok": True}
        assert node_b("stats")["discovered_blocks"] == 6
        assert node_b("put", seed=2, n=4) == {"new": 4}
        n, buf = load(node_a, chain_for(2, 4))
        assert n == 4
        assert_payloads(chain_for(2, 4), buf, n)

        fs, obj = s3_server.fs, node_a.tiers[0]
        # A flipped payload bit: B reads first and fails the checksum; both miss from there.
        flipped = chain_for(3, 4)
        put_chain(node_a, flipped, durable=True)
        raw = bytearray(fs.cat_file(obj.path(flipped[2])))
        raw[-100] ^= 0x10
        fs.pipe_file(obj.path(flipped[2]), bytes(raw))
        assert node_b("get", seed=3, n=4) == {"loaded": 2, "ok": True}
        assert node_b("stats")["corrupt_blocks"] == 1
        assert load(node_a, flipped)[0] == 2
        # A truncated object: A reads first and finds it torn; both miss from there.
        torn = chain_for(4, 4)
        put_chain(node_a, torn, durable=True)
        fs.pipe_file(obj.path(torn[1]), fs.cat_file(obj.path(torn[1]))[:-1000])
        assert load(node_a, torn)[0] == 1
        assert node_a.stats()["corrupt_blocks"] == 1
        assert node_b("get", seed=4, n=4) == {"loaded": 1, "ok": True}
    finally:
        node_b.close()


def test_a_durable_block_demoted_to_s3_is_never_only_in_the_write_queue(
        tmp_path: Path, clock: FakeClock, request: pytest.FixtureRequest) -> None:
    """Issue 14 #1: a block whose last persistent copy is on NVMe moves to S3 only by a durable
    (synchronous) write, never by the write-behind queue; with S3 down it stays on NVMe."""
    with own_s3_server(request) as server:
        server.make_bucket("writeback")
        options = {"url": "s3://writeback/kv", **server.tier_options(), "max_attempts": 1, "breaker_failures": 1,
                   "breaker_retry_s": 30, "write_behind": True, "worker_interval_s": 3600}
        tiers = (TierSpec("nvme", "nvme", {"capacity_bytes": 4 * BB, "slab_bytes": 4 * BB}),
                 TierSpec("object", "object", {"capacity_bytes": 1 << 30, **options}))
        with KVStore(StoreConfig(root=tmp_path / "n", tiers=tiers), clock=clock) as s:
            s.register_namespace(SMALL_NS)
            a, b = chain_for(1, 4), chain_for(2, 4)
            put_chain(s, a, durable=True)
            put_chain(s, b[:2])  # NVMe is full: a[0], a[1] go down to S3, synchronously
            assert s.lookup(SMALL_NS, a).tiers == ("object",) * 2 + ("nvme",) * 2
            d = s.stats()["tiers"][1]
            assert d["queued_writes"] == 0
            assert all(server.fs.exists(s.tiers[1].path(h)) for h in a[:2])
            server.kill()
            s.tiers[1].tick()
            put_chain(s, b[:2] + [b[2]], start=2)  # room would need a[2] on S3: it is down
            assert [r["tiers"] for r in s.iter_blocks(a)] == [["object"]] * 2 + [["nvme"]] * 2
            assert all(s.tiers[0].contains(h) for h in a[2:])  # never dropped, never queued only
            # The one write queued is the new block b[2] itself (not durable: write-behind is its
            # way to the store while it is down).
            assert s.stats()["tiers"][1]["queued_writes"] == 1
            assert [r["tiers"] for r in s.iter_blocks(b[2:3])] == [["object"]]
