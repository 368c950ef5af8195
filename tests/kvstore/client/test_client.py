"""The client library: planes, round trips, zero-copy leases, retries and reconnects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon as spawn_daemon
from kvstore.errors import DaemonUnavailableError, MissingPrefixError, UsageError
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_round_trip_on_each_plane(start_daemon: Callable[..., ThreadedDaemon], plane: str) -> None:
    d = start_daemon()
    chain = chain_for(1, 12)
    with connect(d.url, plane=plane) as c:
        assert c.plane == plane
        assert c.put(SMALL_NS, chain[:8], _blocks(chain[:8])) == 8
        assert c.put(SMALL_NS, chain, _blocks(chain[8:]), start=8) == 4
        assert c.put(SMALL_NS, chain, _blocks(chain)) == 0  # deduplicated
        out = np.zeros(12 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 12
        assert np.array_equal(out, _blocks(chain))
        bufs = [bytearray(BB) for _ in range(3)]  # fewer buffers than hashes: that many load
        assert c.get_into(SMALL_NS, chain, bufs) == 3
        assert bytes(bufs[2]) == payload(chain[2])
        assert c.get_into(SMALL_NS, chain_for(2, 2), bufs) == 0
        assert c.lookup(SMALL_NS, chain).num_blocks == 12
        with pytest.raises(MissingPrefixError):
            c.put(SMALL_NS, chain_for(3, 4), _blocks(chain_for(3, 4)[2:]), start=2)


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_a_put_larger_than_one_frame_goes_as_several(start_daemon: Callable[..., ThreadedDaemon], plane: str) -> None:
    d = start_daemon()  # max_payload_bytes: 64 blocks of BB
    chain = chain_for(7, 150)
    tokens = np.arange(150 * SMALL_NS.block_tokens, dtype=np.int32)
    with connect(d.url, plane=plane) as c:
        assert c.info["max_payload_bytes"] < 150 * BB
        assert c.put(SMALL_NS, chain, _blocks(chain), tokens=tokens) == 150
        out = np.zeros(150 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 150
        assert np.array_equal(out, _blocks(chain))
        assert c.put(SMALL_NS, chain, _blocks(chain[10:]), start=10) == 0


def test_pins_and_deletes(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    chain = chain_for(4, 4)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        assert c.pin(SMALL_NS, chain[:2]) == 2
        assert c.delete(SMALL_NS, chain[:1]) == 2  # the pinned prefix stays, its suffix goes
        assert c.unpin(SMALL_NS, chain[:2]) == 2
        assert c.delete(SMALL_NS, chain[:1]) == 2
        assert c.stats()["store"]["blocks"] == 0


def test_shm_lease_views_are_zero_copy_and_read_only(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    chain = chain_for(5, 2)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        with c.acquire(SMALL_NS, chain) as lease:
            assert lease.num_blocks == 2
            assert lease.views[1].readonly
            assert bytes(lease.views[1]) == payload(chain[1])
    with connect(d.url, plane="tcp") as c, pytest.raises(UsageError, match="shared-memory plane"):
        c.acquire(SMALL_NS, chain)


def test_a_release_reaches_the_daemon_before_the_next_call(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """A shared-memory load gives its lease back without waiting for the reply; the reply is
    read before the next call on either plane, so nothing the client sends next finds the
    blocks still in use (a delete keeps in-use blocks)."""
    d = start_daemon()
    chain = chain_for(6, 4)
    with connect(d.url, plane="shm") as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        out = np.zeros(4 * BB, np.uint8)
        for _ in range(3):  # data-plane calls after a release read its reply first
            assert c.get_into(SMALL_NS, chain, out) == 4
        assert np.array_equal(out, _blocks(chain))
        assert c.delete(SMALL_NS, chain[:1]) == 4  # a control call: every lease is back
        c.put(SMALL_NS, chain, _blocks(chain))
        lease = c.acquire(SMALL_NS, chain)
        lease.release()
        assert c.delete(SMALL_NS, chain[:1]) == 4


def test_acquire_each_pipelines_the_leases_of_a_chain(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """Every chunk's ACQUIRE goes out at once; each lease comes back in order with the right
    bytes, another call in between reads past the replies still owed and keeps them."""
    d = start_daemon()
    chain = chain_for(8, 8)
    with connect(d.url, plane="shm") as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        leases = []
        for lease in c.acquire_each(SMALL_NS, [chain[:2], chain[2:4], chain[4:]]):
            leases.append(lease)
            assert c.lookup(SMALL_NS, chain).num_blocks == 8  # a call while ACQUIREs are owed
        assert [lease.num_blocks for lease in leases] == [2, 2, 4]
        got = [bytes(v) for lease in leases for v in lease.views]
        assert got == [payload(h) for h in chain]
        for lease in leases:
            lease.release()
        assert c.delete(SMALL_NS, chain[:1]) == 8  # every lease is back (in-use blocks stay)


def test_acquire_each_gives_back_the_leases_no_one_took(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """Closed after its first lease (a caller that stops early) the iterator gives back the
    leases the daemon granted for the rest; after a short lease it stops (the chain ends)."""
    d = start_daemon()
    chain = chain_for(9, 8)
    with connect(d.url, plane="shm") as c:
        c.put(SMALL_NS, chain[:6], _blocks(chain[:6]))
        each = c.acquire_each(SMALL_NS, [chain[:2], chain[2:4], chain[4:6]])
        first = next(each)
        each.close()
        first.release()
        assert c.delete(SMALL_NS, chain[:1]) == 6
        c.put(SMALL_NS, chain[:3], _blocks(chain[:3]))
        got = list(c.acquire_each(SMALL_NS, [chain[:2], chain[2:4], chain[4:8]]))
        assert [lease.num_blocks for lease in got] == [2, 1]  # the third was asked, and given back
        for lease in got:
            lease.release()
        assert c.delete(SMALL_NS, chain[:1]) == 3
    with connect(d.url, plane="tcp") as c, pytest.raises(UsageError, match="shared-memory plane"):
        list(c.acquire_each(SMALL_NS, [chain[:2]]))


def test_a_refused_connection_raises_at_once_without_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens on port 9: the refusal is the answer. No retry, no back-off sleep (an
    engine's first call after its daemon died must not wait for them)."""
    import socket

    from kvstore.client import client as client_module

    attempts: list[object] = []
    real = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: attempts.append(a) or real(*a, **k))
    monkeypatch.setattr(client_module.time, "sleep", lambda s: pytest.fail(f"slept {s} s before retrying a refusal"))
    with pytest.raises(DaemonUnavailableError, match="unreachable .*Connection refused"):
        connect("http://127.0.0.1:9", retries=5, timeout=2)
    assert len(attempts) == 1


def test_bad_plane_name() -> None:
    with pytest.raises(UsageError, match="plane must be"):
        connect("http://127.0.0.1:9", plane="carrier-pigeon")


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_reconnects_after_a_daemon_restart(tmp_path: Path, plane: str) -> None:
    chain = chain_for(6, 4)
    d = spawn_daemon(tmp_path / "store")
    try:
        c = connect(d.url, plane=plane, retries=40)
        c.put(SMALL_NS, chain, _blocks(chain))
        assert d.stop() == 0  # graceful: the blocks are written down to NVMe
        # Same ports again, so that the client's URL stays valid.
        d = spawn_daemon(tmp_path / "store", args=["--http-port", str(d.info["http_port"]),
                                                    "--data-port", str(d.info["data_port"])])
        out = np.zeros(4 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 4  # reconnects, re-registers, loads
        assert np.array_equal(out, _blocks(chain))
        assert c.plane == plane
        c.close()
    finally:
        d.stop()


def test_copy_runs_moves_back_to_back_blocks_and_keeps_the_others_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore import buffers as buffers_mod
    from kvstore.client import client as client_mod

    bb = 4096
    arena = memoryview(bytearray(np.random.default_rng(7).integers(0, 256, 16 * bb, np.uint8).tobytes()))
    # blocks 0-2 back to back, then a gap, block 3 alone, then 4-5 back to back again
    locs = [(0, bb), (bb, bb), (2 * bb, bb), (5 * bb, bb), (9 * bb, bb), (10 * bb, bb)]
    want = b"".join(bytes(arena[o : o + n]) for o, n in locs)
    spans: list[int] = []
    real_span = buffers_mod.span

    def counting_span(first: memoryview, nbytes: int, *, writable: bool = True) -> memoryview | None:
        spans.append(nbytes)
        return real_span(first, nbytes, writable=writable)

    monkeypatch.setattr(buffers_mod, "span", counting_span)
    one = np.zeros(len(locs) * bb, np.uint8)
    mv = memoryview(one)
    client_mod._copy_runs(arena, locs, [mv[i * bb : (i + 1) * bb] for i in range(len(locs))])
    assert one.tobytes() == want
    assert spans == [3 * bb, 2 * bb]  # the two runs in one copy each; block 3 alone
    spans.clear()
    apart = [bytearray(bb) for _ in locs]  # separate caller buffers: block by block
    client_mod._copy_runs(arena, locs, [memoryview(b) for b in apart])
    assert b"".join(apart) == want and spans == []


def test_shm_arena_mapping_is_prefaulted_and_let_go_at_close(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    from kvstore.client import client as client_mod

    d = start_daemon()
    chain = chain_for(21, 6)
    with connect(d.url, plane="shm") as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        (entry,) = client_mod._ARENAS.values()
        prefault = entry[2]
        assert prefault.done.wait(60)  # a background thread; the loads below need not wait for it
        assert prefault.faulted_bytes == entry[0].size
        out = np.zeros(6 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 6 and np.array_equal(out, _blocks(chain))
    assert client_mod._ARENAS == {}
    assert not prefault._thread.is_alive()


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_lookups_go_over_the_data_connection_and_fall_back_to_http(
    start_daemon: Callable[..., ThreadedDaemon], plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = start_daemon()
    chain = chain_for(22, 5)
    with connect(d.url, plane=plane) as c:
        c.put(SMALL_NS, chain[:3], _blocks(chain[:3]))
        assert c.info["lookup"] is True
        http_paths: list[str] = []
        real_request = c._control._http.request

        def spying(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
            http_paths.append(path)
            return real_request(method, path, body)

        monkeypatch.setattr(c._control._http, "request", spying)
        r = c.lookup(SMALL_NS, chain)
        assert (r.num_blocks, r.tiers, r.unavailable, r.num_tokens) == (3, ("dram",) * 3, (), 3 * SMALL_NS.block_tokens)
        assert http_paths == []  # the namespace was registered by the put: no HTTP at all
        assert c.lookup(SMALL_NS, chain_for(23, 2)).num_blocks == 0
        c.info["lookup"] = False  # as an older daemon answers HELLO
        assert c.lookup(SMALL_NS, chain).num_blocks == 3
        assert http_paths == ["/v1/lookup"]


def test_get_into_over_tcp_asks_for_runs_of_its_destination(start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.wire import protocol as P

    d = start_daemon()
    chain = chain_for(5, 5)
    asked: list[list[int]] = []
    real = P.encode_get_runs

    def spy(ns_id: bytes, hashes: list[bytes], runs: list[int]) -> bytes:
        asked.append(list(runs))
        return real(ns_id, hashes, runs)

    monkeypatch.setattr(P, "encode_get_runs", spy)
    with connect(d.url, plane="tcp") as c:
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        big = np.zeros(6 * BB, np.uint8)
        other = np.zeros(BB, np.uint8)
        mv = memoryview(big)  # views of one exporter: what a run is made of
        # blocks 0-1 back to back, 2 elsewhere, 3-4 back to back but after a gap
        dst = [mv[:BB], mv[BB : 2 * BB], other, mv[3 * BB : 4 * BB], mv[4 * BB : 5 * BB]]
        assert c.get_into(SMALL_NS, chain, dst) == 5
    assert asked == [[2, 1, 2]]
    got = [bytes(big[:BB]), bytes(big[BB : 2 * BB]), bytes(other), bytes(big[3 * BB : 4 * BB]), bytes(big[4 * BB : 5 * BB])]
    assert got == [payload(x) for x in chain]
    assert not big[2 * BB : 3 * BB].any() and not big[5 * BB :].any()  # nothing outside the views


def test_lookup_lease_holds_the_arena_prefix_for_another_connection(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """LOOKUP_LEASE answers as LOOKUP and leases the leading blocks the arena holds: another
    connection of the node reads them at the lease's locations in its own mapping, and they
    stay (in use: a delete keeps them) until the lease is released."""
    d = start_daemon()
    chain = chain_for(31, 6)
    with connect(d.url, plane="shm") as sched, connect(d.url, plane="shm") as worker:
        sched.put(SMALL_NS, chain[:4], _blocks(chain[:4]))
        r, lease = sched.lookup_lease(SMALL_NS, chain)
        assert (r.num_blocks, r.tiers) == (4, ("dram",) * 4)
        assert r == sched.lookup(SMALL_NS, chain)
        assert lease is not None and lease.num_blocks == 4 and lease.views == []
        assert lease.arena == worker.info["arena"]
        with worker.acquire(SMALL_NS, chain[:1]) as other:  # the worker's own mapping of the arena
            arena = other.views[0].obj
            assert [bytes(arena[o : o + s]) for o, s in lease.locations] == [payload(h) for h in chain[:4]]
        assert worker.delete(SMALL_NS, chain[:1]) == 0  # in use: the lease holds them
        lease.release()
        lease.release()  # idempotent
        assert worker.delete(SMALL_NS, chain[:1]) == 4
        r, lease = sched.lookup_lease(SMALL_NS, chain)
        assert r.num_blocks == 0 and lease is None


def test_lookup_lease_leases_only_what_the_arena_holds_and_falls_back(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """Blocks on a lower tier are counted by the lookup but never leased (no wait for a
    promotion); over TCP, or from a daemon without LOOKUP_LEASE, the answer is a plain
    lookup."""
    d = start_daemon()
    chain = chain_for(32, 24)  # more than the 16-block DRAM tier holds
    with connect(d.url, plane="shm") as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        r, lease = c.lookup_lease(SMALL_NS, chain)
        assert r == c.lookup(SMALL_NS, chain) and r.num_blocks == 24
        lead = next((i for i, t in enumerate(r.tiers) if t != "dram"), r.num_blocks)
        assert lead < r.num_blocks  # some of the chain is below the arena
        assert (lease.num_blocks if lease is not None else 0) == lead
        if lease is not None:
            lease.release()
        c.info["lookup_lease"] = False  # as an older daemon answers HELLO
        assert c.lookup_lease(SMALL_NS, chain) == (r, None)
    with connect(d.url, plane="tcp") as c:
        r2, lease = c.lookup_lease(SMALL_NS, chain)
        assert r2.num_blocks == 24 and lease is None
